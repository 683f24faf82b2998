"""L2Init against autograd of the authors' loss ``loss + λ·½·Σ(θ - θ₀)²`` over every parameter but the
LayerNorm's, in a plain loop (an unused parameter included)."""
from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from plasticity_callbacks.callbacks.l2_init import L2Init
from tiny import cpu_trainer

LAMBDA, LR, STEPS = 0.5, 0.05, 8


class Net(L.LightningModule):
    def __init__(self, optimizer: str):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.ReLU(), nn.Linear(7, 2))
        self.unused = nn.Parameter(torch.randn(3))  # no gradient from the loss: only the pull moves it
        self.optimizer = optimizer

    def training_step(self, batch, batch_idx):
        return F.mse_loss(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)
        return torch.optim.AdamW(self.parameters(), lr=LR)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_matches_the_loss_term_by_autograd(optimizer):
    torch.manual_seed(0)
    module, reference = Net(optimizer), Net(optimizer)
    reference.load_state_dict(module.state_dict())
    x, y = torch.randn(STEPS * 4, 5), torch.randn(STEPS * 4, 2)
    trainer = cpu_trainer(max_steps=STEPS, callbacks=[L2Init(strength=LAMBDA)])
    trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=4))

    anchors = {n: p.detach().clone() for n, p in reference.named_parameters()}
    opt = reference.configure_optimizers()
    for step in range(STEPS):
        xb, yb = x[step * 4:(step + 1) * 4], y[step * 4:(step + 1) * 4]
        pull = sum((p - anchors[n]).pow(2).sum() for n, p in reference.named_parameters() if not n.startswith("net.1."))
        opt.zero_grad()
        (F.mse_loss(reference.net(xb), yb) + LAMBDA * 0.5 * pull).backward()
        opt.step()
    for ours, theirs in zip(module.parameters(), reference.parameters()):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    # AdamW decays the unused parameter only because the pull gives it a gradient, as the loss term does
    assert torch.equal(module.unused, anchors["unused"]) == (optimizer == "sgd")


def test_exclude_leaves_parameters_free_and_empty_selection_is_refused():
    torch.manual_seed(0)
    module = Net("sgd")
    start = module.unused.detach().clone()
    trainer = cpu_trainer(max_steps=3, callbacks=[L2Init(strength=LAMBDA, selection={"exclude": ["unused"]})])
    trainer.fit(module, DataLoader(TensorDataset(torch.randn(12, 5), torch.randn(12, 2)), batch_size=4))
    assert torch.equal(module.unused, start)
    loader = DataLoader(TensorDataset(torch.randn(4, 5), torch.randn(4, 2)), batch_size=4)
    with pytest.raises(ValueError, match="matches no parameter"):
        cpu_trainer(max_steps=1, callbacks=[L2Init(selection={"include": ["nothing.*"]})]).fit(Net("sgd"), loader)


@pytest.mark.parametrize("bad", [dict(strength=-1.0), dict(strength="big"), dict(selection={"scope": "mlp"}),
                                 dict(include_norms="no")])
def test_bad_arguments_are_refused(bad):
    with pytest.raises(ValueError):
        L2Init(**bad)
