"""ContinualBackprop against a plain-torch re-derivation of the reference generate-and-test loop.

The loop below is written from Dohare et al.'s equations and the reference code's choices
(``shibhansh/loss-of-plasticity`` ``lop/algos/gnt.py``, ``adaptable_contribution``, ``accumulate=True``):
ages first, then the bias-corrected running mean and utility, topk of the eligible units, layers in
order, each re-drawn from ``U(±√2·√(3/fan_in))`` and then its outgoing columns zeroed. It does not
import the package's math; only the draws come from the callback's per-step seed.
"""
from __future__ import annotations

import math

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from plasticity_callbacks.callbacks.continual_backprop import ContinualBackprop
from plasticity_callbacks.distributed.strategy import rank_identical_generator
from plasticity_callbacks.functional import continual_backprop as cbp
from helpers import fit

ETA, MATURITY, RATE, LR, STEPS = 0.9, 5, 0.05, 0.1, 40


class MLP(L.LightningModule):
    def __init__(self, widths=(6, 10, 8, 3)):
        super().__init__()
        layers = []
        for a, b in zip(widths[:-1], widths[1:]):
            layers += [nn.Linear(a, b), nn.ReLU()]
        self.net = nn.Sequential(*layers[:-1])

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


def _data(steps: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(steps * 16, 6, generator=g), torch.randn(steps * 16, 3, generator=g)


def _batches(*tensors: torch.Tensor) -> DataLoader:
    return DataLoader(TensorDataset(*tensors), batch_size=16)


def _reference_loop(net: nn.Sequential, x, y, steps, seed, bias_correction):
    """The reference's per-step loop on a ``Linear, ReLU, ...`` stack; returns (utilities, ages, replaced)."""
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    linears = [m for m in net if isinstance(m, nn.Linear)]
    hidden = len(linears) - 1
    util = [torch.zeros(l.out_features) for l in linears[:-1]]
    mean = [torch.zeros(l.out_features) for l in linears[:-1]]
    age = [torch.zeros(l.out_features) for l in linears[:-1]]
    owed, replaced = [0.0] * hidden, 0
    for step in range(steps):
        xb, yb = x[step * 16:(step + 1) * 16], y[step * 16:(step + 1) * 16]
        features, h = [], xb
        for i, layer in enumerate(linears):
            h = layer(h)
            if i < hidden:
                h = torch.relu(h)
                features.append(h.detach())
        opt.zero_grad()
        F.mse_loss(h, yb).backward()
        opt.step()
        with torch.no_grad():
            chosen = []
            for i in range(hidden):
                f, up, down = features[i], linears[i], linears[i + 1]
                age[i] += 1
                correction = 1 - ETA ** age[i]
                mean[i] = ETA * mean[i] + (1 - ETA) * f.mean(0)
                f_hat = mean[i] / correction
                contribution = down.weight.abs().mean(0) * (f - f_hat).abs().mean(0)
                util[i] = ETA * util[i] + (1 - ETA) * contribution / up.weight.abs().mean(1)
                eligible = torch.where(age[i] > MATURITY)[0]
                units = eligible[:0]
                if len(eligible):
                    owed[i] += RATE * len(eligible)
                    k = int(owed[i])
                    owed[i] -= k
                    units = eligible[torch.topk(-(util[i] / correction)[eligible], k).indices]
                chosen.append((units, f_hat.clone()))
            g = rank_identical_generator(seed, step + 1)  # the callback's seed at global_step after the step
            for i, (units, f_hat) in enumerate(chosen):
                up, down = linears[i], linears[i + 1]
                bound = math.sqrt(2) * math.sqrt(3 / up.in_features)
                up.weight[units] = torch.empty(len(units), up.in_features).uniform_(-bound, bound, generator=g)
                up.bias[units] = 0
                if bias_correction:
                    down.bias += (down.weight[:, units] * f_hat[units]).sum(1)
                down.weight[:, units] = 0
                util[i][units], mean[i][units], age[i][units] = 0, 0, 0
                replaced += len(units)
    return util, age, replaced


@pytest.mark.parametrize("bias_correction", [True, False])
def test_matches_the_rederived_reference_loop(bias_correction):
    torch.manual_seed(0)
    module = MLP()
    reference = MLP()
    reference.load_state_dict(module.state_dict())
    x, y = _data(STEPS, seed=1)
    callback = ContinualBackprop(replacement_rate=RATE, maturity_threshold=MATURITY, decay_rate=ETA,
                                 bias_correction=bias_correction, seed=3)
    fit(module, callback, STEPS, data=_batches(x, y))
    util, age, replaced = _reference_loop(reference.net, x, y, STEPS, seed=3, bias_correction=bias_correction)
    assert replaced == callback.replaced >= 15  # (40 - 5) steps x 18 units x 0.05
    for ours, theirs in zip(module.parameters(), reference.parameters()):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    for stats, u, a in zip(callback.stats, util, age):
        torch.testing.assert_close(stats["util"], u, rtol=1e-5, atol=1e-7)
        assert torch.equal(stats["age"], a)


def test_bias_correction_moves_the_mean_contribution_into_the_next_bias():
    g = torch.Generator().manual_seed(5)
    down, bias = torch.randn(4, 7, generator=g), torch.randn(4, generator=g)
    means, units = torch.rand(7, generator=g), torch.tensor([1, 5])
    expected_bias = bias + down[:, 1] * means[1] + down[:, 5] * means[5]
    kept = down.clone()
    cbp.retire_outgoing_(down, bias, units, means)
    torch.testing.assert_close(bias, expected_bias)
    assert torch.equal(down[:, units], torch.zeros(4, 2))
    assert torch.equal(down[:, [0, 2, 3, 4, 6]], kept[:, [0, 2, 3, 4, 6]])


def test_flattened_conv_channels_retire_all_their_positions():
    down, units = torch.ones(3, 12), torch.tensor([2])  # 4 channels x 3 positions, then 0-offset
    cbp.retire_outgoing_(down, None, units, None, group=3)
    assert torch.equal(down.sum(0), torch.tensor([3.0] * 6 + [0.0] * 3 + [3.0] * 3))


class ConvNet(L.LightningModule):
    """conv → BN → ReLU → conv → ReLU → flatten → Linear: conv→conv and conv→flatten→Linear units."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 5, 3),
                                 nn.ReLU(), nn.Flatten(), nn.Linear(5 * 16, 3))

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _hf_module(family: str):
    import model_zoo

    class Wrapped(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = getattr(model_zoo, family)()

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch[0], labels=batch[0]).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    return Wrapped(), (torch.randint(0, 40, (64, 8)),)


@pytest.mark.parametrize("family", ["cnn", "gpt2", "llama"])
def test_replaced_units_are_fresh_on_other_families(family):
    """A unit replaced at the last step has zero outgoing weights, a new incoming row inside the bound and
    zeroed Adam moments on both; units not replaced that step keep what the optimizer gave them."""
    torch.manual_seed(0)
    if family == "cnn":
        module = ConvNet()
        data = (torch.randn(64, 1, 6, 6), torch.randint(0, 3, (64,)))
    else:  # GPT-2's Conv1D (stored (in, out)); Llama's gated MLP (gate rows re-drawn with up's)
        module, data = _hf_module(family)
    callback = ContinualBackprop(replacement_rate=0.3, maturity_threshold=2, decay_rate=0.9, init="default")
    trainer = fit(module, callback, 3, data=_batches(*data))
    optimizer = trainer.optimizers[0]
    assert callback.replaced > 0
    for layer, stats in zip(callback.layers, callback.stats):
        new = stats["age"] == 0
        assert new.any(), layer.name  # 3 steps > maturity 2: 30 % of every layer replaced at step 3
        rows = layer.up.weight.mT if type(layer.up).__name__ == "Conv1D" else layer.up.weight
        down = layer.down.weight.mT if type(layer.down).__name__ == "Conv1D" else layer.down.weight
        columns = cbp.unit_columns(torch.nonzero(new).flatten(), layer.down_offset, layer.group)
        # rows of down that the next layer re-drew after this one retired its units (the reference's order)
        redrawn = [s["age"] == 0 for l, s in zip(callback.layers, callback.stats) if l.up is layer.down]
        kept = ~redrawn[0] if redrawn else torch.ones(down.shape[0], dtype=torch.bool)
        assert torch.equal(down[kept][:, columns], torch.zeros_like(down[kept][:, columns]))
        assert rows[new].abs().max() <= 1 / math.sqrt(rows[0].numel())
        if layer.gate is not None:
            assert layer.gate.weight[new].abs().max() <= 1 / math.sqrt(layer.gate.weight.shape[1])
            gate_moments = optimizer.state[layer.gate.weight]["exp_avg"]
            assert torch.equal(gate_moments[new], torch.zeros_like(gate_moments[new]))
        moments = optimizer.state[layer.up.weight]["exp_avg"]
        moments = moments.mT if type(layer.up).__name__ == "Conv1D" else moments
        assert torch.equal(moments[new], torch.zeros_like(moments[new]))
        assert moments[~new].abs().sum() > 0
        if layer.norm is not None:
            assert torch.equal(layer.norm.weight[new], torch.ones(int(new.sum())))


def test_ages_count_optimizer_steps_under_gradient_accumulation():
    torch.manual_seed(0)
    callback = ContinualBackprop(replacement_rate=0.2, maturity_threshold=2)
    x, y = _data(6, seed=4)
    fit(MLP(), callback, 3, data=_batches(x, y), accumulate_grad_batches=2)  # 6 batches, 3 optimizer steps
    # only step 3 has mature units (age 3 > 2): int(0.2·10) + int(0.2·8) = 3 replaced
    assert callback.replaced == 3
    assert [int(s["age"].max()) for s in callback.stats] == [3, 3]


@pytest.mark.multiprocess
@pytest.mark.ddp_run([
    {"_target_": "plasticity_callbacks.callbacks.continual_backprop.ContinualBackprop", "replacement_rate": 0.2,
     "maturity_threshold": 2},
    {"_target_": "plasticity_callbacks.callbacks.l2_init.L2Init", "strength": 0.1},
    {"_target_": "plasticity_callbacks.callbacks.weight_clip.WeightClip", "kappa": 0.5},
    {"_target_": "plasticity_callbacks.callbacks.hare_tortoise.HareTortoise", "decay": 0.5,
     "schedule": {"every_n_steps": 2}},
], model="mlp", steps=5, accumulate=2)
def test_ranks_stay_identical_under_ddp_with_every_per_step_method(ddp_run):
    """CBP's draws come from a rank-identical generator and its statistics are averaged over ranks; L2-Init,
    weight clipping and Hare & Tortoise are deterministic: after 5 accumulated steps both ranks agree."""
    from ddp_harness import assert_ranks_identical

    results = ddp_run
    assert_ranks_identical(results)
    metrics = results[0]["metrics"]
    assert metrics["cbp/replaced"] > 0 and "weight_clip/clipped" in metrics and metrics["hare_tortoise/distance"] > 0


@pytest.mark.parametrize("bad", [dict(replacement_rate=-0.1), dict(maturity_threshold=1.5), dict(decay_rate=1.0),
                                 dict(utility="weight"), dict(init="orthogonal"), dict(bias_correction="yes")])
def test_bad_arguments_are_refused(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        ContinualBackprop(**bad)
