"""WeightClip against a plain loop that clamps after each step, on an MLP, a CNN and GPT-2's Conv1D."""
from __future__ import annotations

import math

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from plasticity_callbacks.callbacks.weight_clip import WeightClip
from tiny import cpu_trainer

KAPPA, LR, STEPS = 1.0, 0.2, 6


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(1, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 16, 8), nn.LayerNorm(8),
                                 nn.ReLU(), nn.Linear(8, 2))

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


def test_matches_clamping_to_the_fan_in_bound_after_every_step():
    torch.manual_seed(0)
    module, reference = Net(), Net()
    reference.load_state_dict(module.state_dict())
    x, y = torch.randn(STEPS * 8, 1, 6, 6) * 3, torch.randint(0, 2, (STEPS * 8,))
    trainer = cpu_trainer(max_steps=STEPS, callbacks=[WeightClip(kappa=KAPPA)])
    trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=8))

    opt = torch.optim.SGD(reference.parameters(), lr=LR)
    bounds = {0: 1 / 3, 3: 1 / math.sqrt(48), 6: 1 / math.sqrt(8)}  # 1/√fan_in: conv 1·3·3, Linear 48, Linear 8
    clipped_any = False
    for step in range(STEPS):
        opt.zero_grad()
        F.cross_entropy(reference.net(x[step * 8:(step + 1) * 8]), y[step * 8:(step + 1) * 8]).backward()
        opt.step()
        with torch.no_grad():
            for index, bound in bounds.items():
                for p in (reference.net[index].weight, reference.net[index].bias):
                    clipped_any |= bool((p.abs() > KAPPA * bound).any())
                    p.clamp_(-KAPPA * bound, KAPPA * bound)
    assert clipped_any  # else the test proves nothing
    for ours, theirs in zip(module.parameters(), reference.parameters()):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    assert module.net[4].weight.max() > 0.9  # LayerNorm's weight (init 1) has no fan-in bound: not clipped


def test_conv1d_bound_uses_its_input_rows():
    from model_zoo import gpt2

    class Wrapped(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = gpt2()

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch[0], labels=batch[0]).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    module = Wrapped()
    trainer = cpu_trainer(max_steps=2, callbacks=[WeightClip(kappa=0.5)])
    trainer.fit(module, DataLoader(TensorDataset(torch.randint(0, 40, (8, 8))), batch_size=4))
    mlp = module.model.transformer.h[0].mlp
    for layer in (mlp.c_fc, mlp.c_proj):  # Conv1D stores (in, out): fan-in is its row count
        limit = 0.5 / math.sqrt(layer.weight.shape[0])
        assert layer.weight.abs().max() <= limit + 1e-7
        assert torch.isclose(layer.weight.abs().max(), torch.tensor(limit))  # lr 0.1 pushes some weight to the box


@pytest.mark.parametrize("bad", [dict(kappa=0), dict(kappa=-1.0), dict(selection={"include_head": True})])
def test_bad_arguments_are_refused(bad):
    with pytest.raises(ValueError):
        WeightClip(**bad)
