"""One Trainer over a digits task stream: the plasticity metrics are right, and a run resumed in the
middle of the stream continues at the right task with the batches an uninterrupted run trains on."""
import csv
import math

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

pytest.importorskip("sklearn")

from plasticity_callbacks.callbacks.task_metrics import TaskMetrics, plasticity_metrics  # noqa: E402
from plasticity_callbacks.data.digits import RandomLabelDigits  # noqa: E402
from plasticity_callbacks.models.classifier import DigitsClassifier  # noqa: E402


def small_stream(**kwargs):
    return RandomLabelDigits(**{"num_tasks": 4, "steps_per_task": 4, "batch_size": 32, "samples_per_task": 128,
                                "seed": 0, **kwargs})


def trainer(tmp_path, callbacks, **kwargs):
    options = dict(default_root_dir=tmp_path, max_epochs=1, logger=False, enable_progress_bar=False,
                   enable_model_summary=False, log_every_n_steps=1, callbacks=callbacks)
    return L.Trainer(**{**options, **kwargs})


class BatchRecorder(L.Callback):
    def __init__(self):
        self.seen = {}  # global step -> the batch trained on

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen[trainer.global_step] = [t.clone() for t in batch]


def test_plasticity_metrics_match_a_direct_computation():
    torch.manual_seed(0)
    module = DigitsClassifier("mlp", widths=[32, 16])
    with torch.no_grad():  # five units of the first layer never fire: dead, hence dormant
        module.network[0].weight[:5] = 0
        module.network[0].bias[:5] = -1
    x, y = torch.randn(200, 64), torch.randint(0, 10, (200,))
    got = plasticity_metrics(module, x, y, tau=0.025)

    with torch.no_grad():
        h1 = torch.relu(x @ module.network[0].weight.T + module.network[0].bias)
        h2 = torch.relu(h1 @ module.network[2].weight.T + module.network[2].bias)
        logits = h2 @ module.network[4].weight.T + module.network[4].bias
    scores = torch.cat([h.abs().mean(0) / h.abs().mean() for h in (h1, h2)])
    s = torch.linalg.svdvals(h2.double())
    p = s / s.sum()
    assert got["accuracy"] == pytest.approx(float((logits.argmax(1) == y).float().mean()))
    assert got["loss"] == pytest.approx(float(torch.nn.functional.cross_entropy(logits, y)), rel=1e-5)
    assert got["dead"] == pytest.approx(float((scores == 0).float().mean())) and got["dead"] * 48 >= 5 - 1e-4
    assert got["dormant"] == pytest.approx(float((scores <= 0.025).float().mean()))
    assert got["feature_rank"] == pytest.approx(float(torch.exp(-(p * p.log()).sum())), rel=1e-4)
    assert got["stable_rank"] == pytest.approx(float(s.square().sum() / s[0] ** 2), rel=1e-4)
    norm = math.sqrt(sum(float(q.detach().square().sum()) for q in module.parameters()))
    assert got["weight_norm"] == pytest.approx(norm, rel=1e-5)


def test_plasticity_metrics_read_conv_channels():
    module = DigitsClassifier("cnn", channels=[4, 8], hidden=16)
    got = plasticity_metrics(module, torch.randn(50, 64), torch.randint(0, 10, (50,)), tau=0.025)
    assert 0 <= got["dormant"] <= 1 and 1 <= got["feature_rank"] <= 16


def test_task_metrics_measure_every_task_end(tmp_path):
    metrics = TaskMetrics(grad_norm_every_n_steps=1)
    stream = small_stream()
    trainer(tmp_path, [metrics]).fit(DigitsClassifier(widths=[32, 32]), datamodule=stream)
    assert [row["task"] for row in metrics.history] == [0, 1, 2, 3]
    assert [row["step"] for row in metrics.history] == [4, 8, 12, 16]
    assert all(row["grad_norm"] > 0 for row in metrics.history)
    lines = (tmp_path / "tasks.csv").read_text().splitlines()
    assert lines[0].startswith("task,step,accuracy") and len(lines) == 5


def test_task_metrics_log_every_task_end_at_its_step_whatever_the_log_interval(tmp_path):
    metrics = TaskMetrics()
    logger = CSVLogger(tmp_path, name="log", version=0)
    trainer(tmp_path, [metrics], log_every_n_steps=3, logger=logger).fit(DigitsClassifier(widths=[8]),
                                                                          datamodule=small_stream())
    with open(tmp_path / "log" / "version_0" / "metrics.csv", newline="") as f:
        rows = [row for row in csv.DictReader(f) if row["task/accuracy"]]
    assert [int(row["step"]) for row in rows] == [4, 8, 12, 16]  # task ends, none a multiple of 3
    assert [float(row["task/accuracy"]) for row in rows] == pytest.approx([r["accuracy"] for r in metrics.history])


def test_resume_in_the_middle_of_the_stream_continues_at_the_right_task(tmp_path):
    L.seed_everything(0)
    full_batches, full_metrics = BatchRecorder(), TaskMetrics()
    # The uninterrupted run leaves a mid-stream checkpoint behind: step 6, two steps into task 1.
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=6, save_top_k=-1,
                                 filename="{step}")
    full = DigitsClassifier(widths=[32, 32])
    trainer(tmp_path / "full", [full_batches, full_metrics, checkpoint]).fit(full, datamodule=small_stream())

    resumed_batches, resumed_metrics = BatchRecorder(), TaskMetrics()
    resumed = DigitsClassifier(widths=[32, 32])
    trainer(tmp_path / "resumed", [resumed_batches, resumed_metrics]).fit(
        resumed, datamodule=small_stream(), ckpt_path=tmp_path / "ckpt" / "step=6.ckpt")

    assert sorted(resumed_batches.seen) == list(range(6, 16))  # task 1 from its third step, then tasks 2 and 3
    for step, batch in resumed_batches.seen.items():
        assert all(torch.equal(a, b) for a, b in zip(batch, full_batches.seen[step]))
    assert [row["task"] for row in resumed_metrics.history] == [0, 1, 2, 3]  # task 0's row came with the checkpoint
    # exactly equal, a metric not measured at task 0 (no earlier task to retain) being NaN in both
    torch.testing.assert_close(resumed_metrics.history[0], full_metrics.history[0], rtol=0, atol=0, equal_nan=True)
    for a, b in zip(full.parameters(), resumed.parameters()):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("cut", [6, 8])  # inside task 1; exactly at the boundary into task 2
def test_resumed_stream_with_a_boundary_method_matches_the_uninterrupted_run(tmp_path, cut):
    pytest.importorskip("plasticity_callbacks.callbacks.schedule")
    from plasticity_callbacks.callbacks.full_reset import FullReset

    def run(root, ckpt_path=None, extra=()):
        L.seed_everything(0)
        module, reset, metrics = DigitsClassifier(widths=[32, 32]), FullReset(schedule={"at_task_boundaries": True}), \
            TaskMetrics(grad_norm_every_n_steps=1)
        trainer(root, [metrics, reset, *extra]).fit(module, datamodule=small_stream(), ckpt_path=ckpt_path)
        return module, metrics

    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=cut, save_top_k=-1, filename="{step}")
    full, full_metrics = run(tmp_path / "full", extra=[checkpoint])
    resumed, resumed_metrics = run(tmp_path / "resumed", ckpt_path=tmp_path / "ckpt" / f"step={cut}.ckpt")
    # same metrics at every task end, exactly; NaN where a metric is not measured (task 0 retains nothing)
    torch.testing.assert_close(resumed_metrics.history, full_metrics.history, rtol=0, atol=0, equal_nan=True)
    for a, b in zip(full.parameters(), resumed.parameters()):
        torch.testing.assert_close(a, b)

