"""HareTortoise against the paper's two equations in a plain loop: the tortoise's EMA after every
step, the hare reset to the tortoise when the schedule is due."""
from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from plasticity_callbacks.callbacks.hare_tortoise import HareTortoise
from tiny import cpu_trainer

DECAY, EVERY, LR, STEPS = 0.7, 4, 0.1, 10


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))

    def training_step(self, batch, batch_idx):
        return F.mse_loss(self.net(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        self.evaluated = [p.detach().clone() for p in self.parameters()]  # the weights validation ran on

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


def test_matches_ema_and_periodic_reset():
    torch.manual_seed(0)
    module, reference = Net(), Net()
    reference.load_state_dict(module.state_dict())
    x, y = torch.randn(STEPS * 4, 4), torch.randn(STEPS * 4, 2)
    callback = HareTortoise(decay=DECAY, schedule={"every_n_steps": EVERY})
    trainer = cpu_trainer(max_steps=STEPS, callbacks=[callback], limit_val_batches=1)
    loader = DataLoader(TensorDataset(x, y), batch_size=4)
    trainer.fit(module, loader, val_dataloaders=loader)  # one epoch = STEPS steps, then validation

    opt = torch.optim.SGD(reference.parameters(), lr=LR)
    tortoise = [p.detach().clone() for p in reference.parameters()]
    for step in range(STEPS):
        if step > 0 and step % EVERY == 0:  # the hare becomes the tortoise before step `step` trains
            with torch.no_grad():
                for hare, slow in zip(reference.parameters(), tortoise):
                    hare.copy_(slow)
        opt.zero_grad()
        F.mse_loss(reference.net(x[step * 4:(step + 1) * 4]), y[step * 4:(step + 1) * 4]).backward()
        opt.step()
        tortoise = [DECAY * slow + (1 - DECAY) * hare.detach() for slow, hare in zip(tortoise, reference.parameters())]
    assert callback.resets == 2  # steps 4 and 8
    for ours, theirs in zip(module.parameters(), reference.parameters()):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    for ours, theirs, evaluated in zip(callback.tortoise, tortoise, module.evaluated):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
        assert torch.equal(evaluated, ours)  # validation ran on the tortoise, training goes on with the hare


@pytest.mark.parametrize("bad", [dict(decay=1.0), dict(decay=-0.1), dict(reset_optimizer="no"), dict(evaluate_tortoise=1),
                                 dict(schedule={"every_n_stepz": 3})])
def test_bad_arguments_are_refused(bad):
    with pytest.raises((ValueError, TypeError)):
        HareTortoise(**bad)


class HareRecorder(L.Callback):
    """The hare's weights at the start and after every optimizer step (listed first: before any reset or measure)."""

    def on_train_start(self, trainer, pl_module):
        self.steps = [[p.detach().clone() for p in pl_module.parameters()]]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps.append([p.detach().clone() for p in pl_module.parameters()])


@pytest.mark.parametrize("evaluate_tortoise", [True, False])
def test_task_metrics_measure_the_tortoise_of_a_task_stream(evaluate_tortoise):
    """Every task end of a task stream is measured on the tortoise, recomputed here as the EMA of the hare's
    recorded weights (reset to it at the boundary); with evaluate_tortoise=False, on the hare."""
    from plasticity_callbacks.callbacks.schedule import Schedule
    from plasticity_callbacks.callbacks.task_metrics import TaskMetrics, plasticity_metrics
    from plasticity_callbacks.data.digits import RandomLabelDigits
    from plasticity_callbacks.models.classifier import DigitsClassifier

    torch.manual_seed(0)
    decay, per_task = 0.6, 4
    module, stream = DigitsClassifier(widths=[16, 16], lr=1e-2), RandomLabelDigits(2, per_task, 32, seed=0)
    recorder, metrics = HareRecorder(), TaskMetrics()
    ht = HareTortoise(decay=decay, schedule=Schedule(at_task_boundaries=True), evaluate_tortoise=evaluate_tortoise)
    cpu_trainer(max_epochs=1, callbacks=[recorder, metrics, ht]).fit(module, datamodule=stream)

    tortoise, expected, hares = [w.clone() for w in recorder.steps[0]], [], []
    for step, hare in enumerate(recorder.steps[1:], 1):
        tortoise = [decay * t + (1 - decay) * h for t, h in zip(tortoise, hare)]
        if step % per_task == 0:  # a task's end: the measured network
            hares.append(hare)
            expected.append(tortoise if evaluate_tortoise else hare)
    assert ht.resets == 1
    probe = DigitsClassifier(widths=[16, 16], lr=1e-2)
    for task, (weights, hare) in enumerate(zip(expected, hares)):
        with torch.no_grad():
            for p, w in zip(probe.parameters(), weights):
                p.copy_(w)
        reference = plasticity_metrics(probe, *stream.eval_data(task), tau=0.025)
        row = metrics.history[task]
        for name in ("loss", "weight_norm", "accuracy"):
            assert row[name] == pytest.approx(reference[name], rel=1e-5, abs=1e-6), (task, name)
        hare_norm = torch.cat([h.flatten() for h in hare]).norm()
        assert (abs(row["weight_norm"] - hare_norm) > 1e-3) == evaluate_tortoise  # the tortoise is not the hare
    for p, h in zip(module.parameters(), recorder.steps[-1]):  # training ends with the hare's weights in place
        assert torch.equal(p, h)
