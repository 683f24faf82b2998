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
