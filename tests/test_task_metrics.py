"""Each per-task metric of ``TaskMetrics`` equals a direct computation on the same stream and weights."""
import copy

import lightning as L
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("sklearn")

from plasticity_callbacks.callbacks.task_metrics import TaskMetrics, probe_accuracy  # noqa: E402
from plasticity_callbacks.data.digits import PermutedDigits  # noqa: E402
from plasticity_callbacks.models.classifier import DigitsClassifier  # noqa: E402

STEPS = 6


class DirectRecord(L.Callback):
    """Each step's batch loss and accuracy recomputed before the update, and a copy of the module at
    every task end (listed before TaskMetrics: its copy is taken from the same weights)."""

    def __init__(self):
        self.batch_loss, self.batch_accuracy, self.ends = [], [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        x, y = batch
        with torch.no_grad():
            logits = pl_module(x)
        self.batch_loss.append(float(F.cross_entropy(logits, y)))
        self.batch_accuracy.append(float((logits.argmax(-1) == y).float().mean()))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step % STEPS == 0:
            self.ends.append(copy.deepcopy(pl_module.network))


@pytest.fixture(scope="module")
def stream_run():
    stream = PermutedDigits(num_tasks=4, steps_per_task=STEPS, batch_size=64, seed=3)
    record = DirectRecord()
    metrics = TaskMetrics(stability_tasks=2, probe_steps=4, probe_every_n_tasks=2, probe_lr=3e-3)
    L.seed_everything(0)
    trainer = L.Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, log_every_n_steps=STEPS, callbacks=[record, metrics])
    trainer.fit(DigitsClassifier(widths=[32, 32]), datamodule=stream)
    return stream, record, metrics.history


def test_online_metrics_are_the_mean_over_the_tasks_steps(stream_run):
    _, record, history = stream_run
    for row in history:
        steps = slice(row["task"] * STEPS, (row["task"] + 1) * STEPS)
        assert row["online_loss"] == pytest.approx(sum(record.batch_loss[steps]) / STEPS, rel=1e-5)
        assert row["online_accuracy"] == pytest.approx(sum(record.batch_accuracy[steps]) / STEPS, rel=1e-6)


def accuracy(network, x, y):
    with torch.no_grad():
        return float((network(x).argmax(-1) == y).float().mean())


def test_retained_accuracy_is_the_accuracy_on_the_previous_tasks(stream_run):
    stream, record, history = stream_run
    assert history[0]["retained_accuracy"] != history[0]["retained_accuracy"]  # NaN: no earlier task
    for row in history[1:]:
        task, network = row["task"], record.ends[row["task"]]
        earlier = [accuracy(network, *stream.eval_data(j)) for j in range(max(0, task - 2), task)]
        assert row["retained_accuracy"] == pytest.approx(sum(earlier) / len(earlier))
        assert row["accuracy"] == pytest.approx(accuracy(network, *stream.eval_data(task)))


def test_probe_refits_the_probe_task_from_each_probed_tasks_end(stream_run):
    stream, record, history = stream_run
    x, y = stream.probe_data()
    assert [r["task"] for r in history if r["probe_accuracy"] == r["probe_accuracy"]] == [0, 2, 3]  # every 2, last
    for row in history:
        if row["probe_accuracy"] != row["probe_accuracy"]:
            continue
        network = copy.deepcopy(record.ends[row["task"]])  # the hand-written loop: plain Adam, full batch
        optimizer = torch.optim.Adam(network.parameters(), lr=3e-3)
        for _ in range(4):
            optimizer.zero_grad()
            F.cross_entropy(network(x), y).backward()
            optimizer.step()
        assert row["probe_accuracy"] == pytest.approx(accuracy(network, x, y))
    assert torch.equal(stream.probe_data()[1], y)  # a fixed task: the same labels every time


def test_bad_probe_settings_name_the_field():
    with pytest.raises(ValueError, match="probe_steps"):
        TaskMetrics(probe_steps=-1)
    with pytest.raises(ValueError, match="probe_lr"):
        TaskMetrics(probe_lr=0)


def test_probe_trains_the_module_itself_and_puts_back_weights_buffers_and_gradients():
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                 torch.nn.Linear(16, 4))
    x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))
    F.cross_entropy(module(x), y).backward()  # the training step's gradients, still held
    before = copy.deepcopy(module.state_dict())
    grads = [p.grad.clone() for p in module.parameters()]
    reference = copy.deepcopy(module)  # the hand-written loop on a copy: plain Adam, full batch
    optimizer = torch.optim.Adam(reference.parameters(), lr=0.05)
    for _ in range(5):
        optimizer.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        optimizer.step()
    with torch.no_grad():
        expected = float((reference(x).argmax(-1) == y).float().mean())
    assert probe_accuracy(module, x, y, steps=5, lr=0.05) == expected
    for key, value in module.state_dict().items():  # BatchNorm's running statistics included
        assert torch.equal(value, before[key]), key
    for p, grad in zip(module.parameters(), grads):
        assert torch.equal(p.grad, grad)
