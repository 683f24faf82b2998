"""A value a callback measures only at some steps is logged at exactly those steps, with the value it measured:
never repeated in later rows (Lightning's ``pl_module.log`` would repeat it until the epoch ends)."""
from __future__ import annotations

import csv
import shutil

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

pytest.importorskip("sklearn")

from plasticity_callbacks.app.report.runs import Run, read_curves, single_fit_state  # noqa: E402
from plasticity_callbacks.callbacks.l2_init import L2Init  # noqa: E402
from plasticity_callbacks.callbacks.redo import ReDoMonitor  # noqa: E402
from plasticity_callbacks.callbacks.task_metrics import TaskMetrics  # noqa: E402
from plasticity_callbacks.callbacks.step_logging import log_at_step  # noqa: E402
from plasticity_callbacks.data.digits import PermutedDigits  # noqa: E402
from plasticity_callbacks.models.classifier import DigitsClassifier  # noqa: E402

STEPS_PER_TASK, TASKS, REDO_EVERY = 3, 3, 2
LOG_EVERY = 3  # the trainer's: Lightning's rows at steps 2, 5, 8; L2Init measures at 0, 3, 6


class Measured(L.Callback):
    """What was measured, and at which step, found independently of the callbacks under test: ReDo's fractions
    as it computes them, and ``‖θ - θ₀‖`` from this callback's own copy of the initial weights."""

    def __init__(self, redo: ReDoMonitor):
        self.dormant, self.distance, self._start, self._step = {}, {}, None, None
        fractions = redo._fractions

        def recorded(scores):
            values = fractions(scores)
            self.dormant[self._step] = float(values["redo/dormant"])
            return values

        redo._fractions = recorded

    def on_fit_start(self, trainer, pl_module):
        self._start = [p.detach().clone() for p in pl_module.parameters()]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._step = trainer.global_step  # ReDo runs after this callback in the same hook

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step % LOG_EVERY == 0:
            squared = sum(float((p.detach().double() - s.double()).square().sum())
                          for p, s in zip(pl_module.parameters(), self._start))
            self.distance[trainer.global_step] = squared ** 0.5


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    folder = tmp_path_factory.mktemp("series")
    redo = ReDoMonitor(tau=0.5, collect_every_n_steps=1, log_every_n_steps=REDO_EVERY)
    measured, tasks = Measured(redo), TaskMetrics()
    L.seed_everything(0)
    best = ModelCheckpoint(dirpath=folder / "checkpoints", monitor="task/accuracy", mode="max",
                           every_n_train_steps=STEPS_PER_TASK, save_top_k=1)
    trainer = L.Trainer(max_epochs=1, log_every_n_steps=LOG_EVERY, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[measured, redo, L2Init(strength=1e-2), tasks, best],
                        logger=[CSVLogger(folder, name="logs", version=""),  # a single fit's folders, as the
                                TensorBoardLogger(folder, name="tensorboard", version="")])  # report reads them
    stream = PermutedDigits(num_tasks=TASKS, steps_per_task=STEPS_PER_TASK, batch_size=32, seed=1)
    trainer.fit(DigitsClassifier(widths=[16]), datamodule=stream)
    with open(folder / "logs" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    scalars = {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}
    csv_series = {name: {int(row["step"]): float(row[name]) for row in rows if row.get(name)} for name in rows[0]}
    csv_counts = {name: sum(1 for row in rows if row.get(name)) for name in rows[0]}
    return trainer, measured, tasks, csv_series, csv_counts, scalars, folder


def expected(measured: Measured, tasks: TaskMetrics) -> dict[str, dict[int, float]]:
    return {"redo/dormant": measured.dormant, "l2_init/distance": measured.distance,
            "task/accuracy": {row["step"]: row["accuracy"] for row in tasks.history},
            "task/index": {row["step"]: float(row["task"]) for row in tasks.history}}


def test_the_measured_steps_are_the_expected_ones(logged):
    _, measured, tasks, *_ = logged
    steps = STEPS_PER_TASK * TASKS
    assert sorted(measured.dormant) == list(range(REDO_EVERY, steps + 1, REDO_EVERY))
    assert sorted(measured.distance) == list(range(0, steps, LOG_EVERY))
    assert [row["step"] for row in tasks.history] == list(range(STEPS_PER_TASK, steps + 1, STEPS_PER_TASK))


@pytest.mark.parametrize("name", ["redo/dormant", "l2_init/distance", "task/accuracy", "task/index"])
def test_each_measurement_is_one_csv_row_at_its_step_with_its_value(logged, name):
    _, measured, tasks, csv_series, csv_counts, *_ = logged
    want = expected(measured, tasks)[name]
    assert csv_counts[name] == len(want), (name, csv_series[name])  # once each: not repeated in later rows
    assert sorted(csv_series[name]) == sorted(want)
    for step, value in want.items():
        assert csv_series[name][step] == pytest.approx(value, rel=1e-5, abs=1e-7), (name, step)


@pytest.mark.parametrize("name", ["redo/dormant", "l2_init/distance", "task/accuracy", "task/index"])
def test_each_measurement_is_one_tensorboard_point_at_its_step_with_its_value(logged, name):
    _, measured, tasks, _, _, scalars, _ = logged
    want = expected(measured, tasks)[name]
    assert sorted(scalars[name]) == sorted(want)
    for step, value in want.items():
        assert scalars[name][step] == pytest.approx(value, rel=1e-5, abs=1e-7), (name, step)


def test_the_latest_measurement_stays_in_callback_metrics_for_monitors(logged):
    trainer, measured, tasks, *_ = logged
    for name, series in expected(measured, tasks).items():
        assert float(trainer.callback_metrics[name]) == pytest.approx(series[max(series)], rel=1e-5, abs=1e-7)
    best = trainer.checkpoint_callback  # ModelCheckpoint(monitor="task/accuracy") saw every task end's value
    accuracies = [row["accuracy"] for row in tasks.history]
    assert float(best.best_model_score) == pytest.approx(max(accuracies), rel=1e-6)
    assert f"step={tasks.history[accuracies.index(max(accuracies))]['step']}" in best.best_model_path


def test_the_report_reads_each_measurement_at_its_step_and_the_last_one_as_the_runs(logged, tmp_path):
    _, measured, *_, folder = logged
    (folder / ".hydra").mkdir(exist_ok=True)
    (folder / ".hydra" / "config.yaml").write_text("seed: 0\ncallbacks:\n  redo: {tau: 0.5}\n")
    tensorboard_only = tmp_path / "tensorboard_only"
    shutil.copytree(folder / "tensorboard", tensorboard_only / "tensorboard")
    (tensorboard_only / ".hydra").mkdir()
    (tensorboard_only / ".hydra" / "config.yaml").write_text("seed: 0\ncallbacks:\n  redo: {tau: 0.5}\n")
    for run_dir in (folder, tensorboard_only):
        method, seed, state = single_fit_state(run_dir)
        assert state["phases"]["fit"]["dormant_fraction"] == pytest.approx(measured.dormant[max(measured.dormant)])
        curves = read_curves(Run(run_dir, method, seed, state))
        assert curves["dormant"] == pytest.approx(measured.dormant), run_dir.name  # the measured steps only


def test_log_at_step_writes_once_at_the_current_step_and_keeps_the_values(tmp_path):
    class Stub:
        global_step, callback_metrics = 7, {}
        loggers = [CSVLogger(tmp_path, name="stub", version=0)]

    trainer = Stub()
    assert log_at_step(trainer, {"a": torch.tensor(0.25), "b": 3}) == {"a": 0.25, "b": 3.0}
    assert float(trainer.callback_metrics["a"]) == 0.25 and float(trainer.callback_metrics["b"]) == 3.0
    with open(tmp_path / "stub" / "version_0" / "metrics.csv", newline="") as f:
        assert list(csv.DictReader(f)) == [{"a": "0.25", "b": "3.0", "step": "7"}]
    with pytest.raises(ValueError, match="one number"):
        log_at_step(trainer, {"c": torch.ones(2)})


def test_gate_logger_writes_the_gates_once_at_each_step_it_reads_them(tmp_path):
    from plasticity_callbacks.callbacks.gate_logger import GateLogger

    from tiny import cpu_trainer, tiny_gpt_module, token_loader

    class GateRecord(L.Callback):  # the gate the logger reads, read here first in the same hook
        def __init__(self):
            self.gates = {}

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.gates[trainer.global_step] = float(pl_module.model.blocks[0].attn.gate_values()["gate_rec"])

    L.seed_everything(0)
    module, record = tiny_gpt_module(attention="reciprocal", mlp="reciprocal", n_kv_head=1), GateRecord()
    trainer = cpu_trainer(max_steps=6, log_every_n_steps=1, callbacks=[record, GateLogger(every_n_steps=3)],
                          logger=CSVLogger(tmp_path, name="run", version=0))
    trainer.fit(module, token_loader())
    with open(tmp_path / "run" / "version_0" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    name = "gates/model.blocks.0.attn/gate_rec"
    logged = {int(row["step"]): float(row[name]) for row in rows if row[name]}
    assert sum(1 for row in rows if row[name]) == 2 and sorted(logged) == [3, 6]
    assert logged == pytest.approx({step: record.gates[step] for step in (3, 6)})
    assert record.gates[3] != record.gates[6]  # the gate trains: a repeated value would show


def test_l2_init_measures_nothing_when_the_trainer_logs_nothing():
    from tiny import TinyMLPModule, cpu_trainer, regression_loader

    trainer = cpu_trainer(max_steps=2, log_every_n_steps=0, callbacks=[L2Init(strength=1e-2)])
    trainer.fit(TinyMLPModule(), regression_loader())
    assert "l2_init/distance" not in trainer.callback_metrics
