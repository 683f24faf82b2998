"""A resumed run's logs hold every row of the uninterrupted run's, once: CSV rows and TensorBoard scalars.

Each run is interrupted three times and resumed in the same run directory each time:
- SIGTERM (``fault_injection.SignalAt``) right after the validation and checkpoint of step 3, where ReDo
  also recycled at the end of step 3 (its row, at step 3, was written before the checkpoint and is not
  logged again on resume),
- SIGTERM at step 4, where no validation follows (the checkpoint is written at the end of the batch,
  before Lightning logs the step's training row),
- a crash when step 5 starts (``fault_injection.CrashAt``): step 4's rows were written after the last
  checkpoint, and the resumed run logs them again,
then finished. A second interruption must not lose what the first resume restored.
The single fit (``plasticity-train``'s ``fit``) and a pipeline phase go through the same rule
(``app/resumed_logs.py``).
"""
from __future__ import annotations

import csv
from pathlib import Path

import pytest

from plasticity_callbacks.app.pipeline import Pipeline
from plasticity_callbacks.app.runs.resumed_logs import kept, restore_logs, rewrite_events
from plasticity_callbacks.app.train import fit
from plasticity_callbacks.app.runs.checkpoints import RunInterrupted

from fault_injection import Crash
from hydra_app import compose_config

# ReDo recycles every 3 steps and measures its dormant fractions every 2: each written once, at its step, at the end
# of the batch (repeated into every later row of the epoch, as Lightning does with pl_module.log, they would differ
# after a resume, whose results start empty).
REDO = ["+callbacks=redo", "callbacks.redo.collect_every_n_steps=1", "callbacks.redo.log_every_n_steps=2",
        "callbacks.redo.schedule={every_n_steps: 3}"]
SINGLE_FIT = ["experiment=smoke", "validate_before_fit=false", *REDO]
# one phase of the pipeline (pretrain, 6 steps, validated and checkpointed every 3), with its validation before the fit
PHASE = ["experiment=pipeline_smoke", "+method=warm", "pipeline.stop_phase=pretrain", "phases.pretrain.steps=6",
         "trainer.val_check_interval=3", "checkpoint.every_n_train_steps=3", "callbacks.redo.log_every_n_steps=2",
         "callbacks.redo.schedule={every_n_steps: 3}"]
VOLATILE = ("seconds", "per_sec")  # wall-clock measurements differ run to run


def compose_run(run_dir: Path, overrides: list[str]):
    return compose_config(*overrides, output_dir=run_dir)


def stop_at(step: int) -> str:
    return f"{{_target_: fault_injection.SignalAt, step: {step}}}"


def crash_at(step: int) -> str:
    return f"{{_target_: fault_injection.CrashAt, step: {step}}}"


def run_single_fit(run_dir: Path, overrides: list[str], fault: str | None = None, resume: bool = False) -> None:
    extra = ["ckpt_path=last", "resume_allow_changes=[callbacks.fault]"] if resume else []
    extra += [f"+callbacks.fault={fault}"] if fault else []
    fit(compose_run(run_dir, [*overrides, *extra]))


def run_phase(run_dir: Path, overrides: list[str], fault: str | None = None, resume: bool = False) -> None:
    extra = ["pipeline.resume=true", "resume_allow_changes=[phases.pretrain.callbacks.fault]"] if resume else []
    extra += [f"+phases.pretrain.callbacks.fault={fault}"] if fault else []
    Pipeline(compose_run(run_dir, [*overrides, *extra])).run()


def interrupted_three_times(run, run_dir: Path, overrides: list[str]) -> None:
    """Stopped by SIGTERM at step 3 (after its validation and ReDo's action) and at step 4 (no validation
    follows), then crashed when step 5 starts (step 4's row written after its checkpoint), then finished."""
    with pytest.raises(RunInterrupted):
        run(run_dir, overrides, stop_at(3))
    with pytest.raises(RunInterrupted):
        run(run_dir, overrides, stop_at(4), resume=True)
    with pytest.raises(Crash):
        run(run_dir, overrides, crash_at(5), resume=True)
    run(run_dir, overrides, resume=True)


def csv_rows(folder: Path) -> list[dict[str, str]]:
    with (folder / "metrics.csv").open(newline="") as f:
        return [{k: v for k, v in row.items() if v and not k.endswith(VOLATILE)} for row in csv.DictReader(f)]


def scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of every event file in ``folder``, per tag, as TensorBoard reads them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    events.Reload()
    # By step: TensorBoard reads a folder's files in name order, and the names of writers one process opens
    # in one second end in a counter compared as text ("….10" before "….9"), which the fits run in this test
    # process reach; a step logged twice still shows twice.
    return {tag: sorted(((e.step, e.value) for e in events.Scalars(tag)), key=lambda event: event[0])
            for tag in events.Tags()["scalars"] if not tag.endswith(VOLATILE)}


@pytest.mark.slow  # four fits per logger: tens of seconds
@pytest.mark.parametrize("logger", ["csv", "tensorboard"])
def test_a_single_fit_interrupted_three_times_logs_every_row_of_the_uninterrupted_fit_once(tmp_path, logger):
    overrides = [*SINGLE_FIT, f"logger={logger}"]
    run_single_fit(tmp_path / "reference", overrides)
    interrupted_three_times(run_single_fit, tmp_path / "run", overrides)
    if logger == "csv":
        reference = csv_rows(tmp_path / "reference" / "logs")
        # what the first stop puts at its checkpoint: the validation after step 3 (logged at step 2), the action
        assert [row["step"] for row in reference if "val/loss" in row] == ["2", "5"]
        assert [row["step"] for row in reference if "redo/recycled" in row] == ["3", "6"]
        assert [row["step"] for row in reference if "redo/dormant" in row] == ["2", "4", "6"]
        assert csv_rows(tmp_path / "run" / "logs") == reference
    else:
        reference = scalars(tmp_path / "reference" / "tensorboard")
        assert [step for step, _ in reference["redo/recycled"]] == [3, 6]
        assert [step for step, _ in reference["redo/dormant"]] == [2, 4, 6]
        resumed = scalars(tmp_path / "run" / "tensorboard")
        assert len(list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))) == 4  # one per fit
        assert resumed == reference


@pytest.mark.slow  # four pipeline phases: tens of seconds
def test_a_pipeline_phase_interrupted_three_times_logs_every_row_of_the_uninterrupted_phase_once(tmp_path):
    run_phase(tmp_path / "reference", PHASE)
    interrupted_three_times(run_phase, tmp_path / "run", PHASE)
    reference = csv_rows(tmp_path / "reference" / "logs" / "pretrain")
    assert [row["step"] for row in reference if "val/loss" in row] == ["0", "2", "5", "6"]  # before, 3, 6, after
    assert [row["step"] for row in reference if "redo/recycled" in row] == ["3", "6"]
    assert csv_rows(tmp_path / "run" / "logs" / "pretrain") == reference


def test_a_phase_crashed_before_its_first_checkpoint_starts_its_tensorboard_log_afresh(tmp_path):
    overrides = [*PHASE, "logger=tensorboard"]
    run_phase(tmp_path / "reference", overrides)
    with pytest.raises(Crash):
        run_phase(tmp_path / "run", overrides, crash_at(2))  # steps 0 and 1 logged, no checkpoint yet
    run_phase(tmp_path / "run", overrides, resume=True)  # the phase runs again from its start
    reference = scalars(tmp_path / "reference" / "tensorboard" / "pretrain")
    assert [step for step, _ in reference["train/loss"]] == list(range(6))
    assert scalars(tmp_path / "run" / "tensorboard" / "pretrain") == reference


def test_the_rule_keeps_what_the_checkpoint_saw_and_every_earlier_step():
    # resumed at step 4: an action row at 4 written before the checkpoint stays; the training row of
    # step 3 written after a checkpoint at the end of its batch stays; a row at 4 written after it goes
    assert kept(True, 4, 4) and kept(False, 3, 4)
    assert not kept(False, 4, 4) and not kept(False, 5, 4)


def test_an_event_file_keeps_the_events_before_its_checkpoint_position_and_below_the_step(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path))
    for step in range(3):
        writer.add_scalar("loss", float(step), step)
    writer.add_scalar("action", 1.0, 3)  # written before the checkpoint of step 3
    writer.flush()
    path = next(tmp_path.glob("events.out.tfevents.*"))
    position = path.stat().st_size
    writer.add_scalar("loss", 30.0, 3)  # after it: the resumed fit logs step 3 again
    writer.add_scalar("loss", 2.5, 2)  # after it, below its step: kept
    writer.add_scalar("loss", 40.0, 4)
    writer.close()
    rewrite_events(path, position, 3)
    assert scalars(tmp_path) == {"loss": [(0, 0.0), (1, 1.0), (2, 2.0), (2, 2.5)], "action": [(3, 1.0)]}


def test_a_checkpoint_without_a_log_position_keeps_the_earlier_steps_and_says_what_may_be_missing(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    first = CSVLogger(tmp_path, name="run", version="")
    for step in range(4):
        first.log_metrics({"loss": step / 3, "epoch": 0}, step=step)
    first.save()
    with pytest.warns(UserWarning, match="records no log position.*step 2"):
        restore_logs(CSVLogger(tmp_path, name="run", version=""), {"global_step": 2})
    assert csv_rows(tmp_path / "run") == [{"epoch": "0", "loss": str(step / 3), "step": str(step)} for step in (0, 1)]
