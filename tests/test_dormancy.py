"""dormancy: scores against an independent float64 computation; recycling on hand-built networks."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from plasticity_callbacks.functional.dormancy import (dormancy_scores, dormant_fraction, dormant_mask, fresh_weights,
                                           mean_abs_activation)
from tiny import OPTIMIZERS, make_optimizer, recycle


def test_scores_are_activity_over_layer_mean():
    a = torch.rand(37) * torch.randint(0, 2, (37,))  # some exactly zero
    expected = [float(v) / (sum(float(u) for u in a) / len(a)) for v in a]  # plain Python, float64
    scores = dormancy_scores(a)
    assert torch.allclose(scores.double(), torch.tensor(expected, dtype=torch.float64), rtol=1e-6)
    assert math.isclose(float(scores.mean()), 1.0, rel_tol=1e-6)


@pytest.mark.parametrize("shape,unit_dim", [((3, 300, 700), -1), ((4, 6, 5, 5), 1), ((50, 9), 1), ((7,), 0)])
def test_mean_abs_activation_matches_float64_mean(shape, unit_dim):
    h = torch.randn(shape) * torch.rand(shape[unit_dim]).reshape([-1] + [1] * (len(shape) - 1 - unit_dim % len(shape)))
    dims = tuple(d for d in range(h.dim()) if d != unit_dim % h.dim())
    expected = h.double().abs().mean(dim=dims) if dims else h.double().abs()
    torch.testing.assert_close(mean_abs_activation(h, unit_dim).double(), expected, rtol=1e-5, atol=1e-7)
    if h.dim() == 3:  # a non-contiguous view (one of several layers reading slices of one down)
        part = h.narrow(-1, 100, 250)
        torch.testing.assert_close(mean_abs_activation(part).double(), part.double().abs().mean(dim=(0, 1)))


def test_all_dead_layer_scores_zero_not_nan():
    scores = dormancy_scores(torch.zeros(8))
    assert torch.equal(scores, torch.zeros(8))
    assert float(dormant_fraction(scores, 0.0)) == 1.0


def test_mask_tau_zero_means_exactly_dead_and_tau_is_inclusive():
    scores = torch.tensor([0.0, 1e-12, 0.01, 0.025, 0.03, 2.0])
    assert dormant_mask(scores, 0.0).tolist() == [True, True, False, False, False, False]
    assert dormant_mask(scores, 0.025).tolist() == [True, True, True, True, False, False]
    assert float(dormant_fraction(scores, 0.025)) == pytest.approx(4 / 6)
    with pytest.raises(ValueError, match="tau"):
        dormant_mask(scores, -0.1)


def _dead_mlp(d_in=6, hidden=12, d_out=3, dead=(1, 4, 9), gated=False):
    """Linear → ReLU → Linear whose ``dead`` hidden units have a large negative bias."""
    up, down = nn.Linear(d_in, hidden), nn.Linear(hidden, d_out)
    gate = nn.Linear(d_in, hidden) if gated else None
    with torch.no_grad():
        up.bias[list(dead)] = -100.0
    return up, down, gate


def _forward(up, down, gate, x):
    h = F.relu(up(x))
    if gate is not None:
        h = h * torch.sigmoid(gate(x))
    return down(h)


@pytest.mark.parametrize("gated", [False, True])
def test_recycling_dead_neurons_keeps_output_and_touches_only_their_rows_and_columns(gated):
    dead = [1, 4, 9]
    up, down, gate = _dead_mlp(dead=dead, gated=gated)
    x = torch.randn(32, 6)
    mean_abs = F.relu(up(x)).abs().mean(0)
    if gated:
        mean_abs = (F.relu(up(x)) * torch.sigmoid(gate(x))).abs().mean(0)
    mask = dormant_mask(dormancy_scores(mean_abs.detach()), 0.0)
    assert mask.nonzero().flatten().tolist() == dead
    before = {n: p.detach().clone() for n, p in [("up", up.weight), ("up_b", up.bias), ("down", down.weight)]
              + ([("gate", gate.weight)] if gated else [])}
    out_before = _forward(up, down, gate, x).detach()

    count = recycle(up, down, mask, gate=gate, init=0.5, generator=torch.Generator().manual_seed(1))

    assert int(count) == 3
    torch.testing.assert_close(_forward(up, down, gate, x), out_before, rtol=0, atol=1e-6)
    keep = ~mask
    for name, layer in [("up", up)] + ([("gate", gate)] if gated else []):
        assert torch.equal(layer.weight[keep], before[name][keep])
        assert not torch.equal(layer.weight[mask], before[name][mask])
    assert torch.equal(up.bias[mask], torch.zeros(3)) and torch.equal(up.bias[keep], before["up_b"][keep])
    assert torch.equal(down.weight[:, mask], torch.zeros(3, 3))
    assert torch.equal(down.weight[:, keep], before["down"][:, keep])
    assert bool((F.relu(up(x))[:, mask] > 0).any()), "recycled neurons should fire again"


def test_recycling_dormant_but_alive_neurons_equals_ablating_them():
    up, down = nn.Linear(5, 10), nn.Linear(10, 2)
    x = torch.randn(16, 5)
    mask = torch.zeros(10, dtype=torch.bool)
    mask[[0, 7]] = True
    h = F.relu(up(x)).detach()
    ablated = (h * (~mask).float()) @ down.weight.detach().T + down.bias.detach()  # independent
    recycle(up, down, mask)
    torch.testing.assert_close(down(F.relu(up(x)) * (~mask).float()), ablated)
    torch.testing.assert_close(down(F.relu(up(x))), ablated)


def test_conv_channel_is_a_neuron():
    up, down = nn.Conv2d(3, 6, 3, padding=1), nn.Conv2d(6, 4, 3, padding=1)
    with torch.no_grad():
        up.bias[2] = -100.0
    x = torch.randn(4, 3, 5, 5)
    h = F.relu(up(x))
    mask = dormant_mask(dormancy_scores(h.abs().mean(dim=(0, 2, 3)).detach()), 0.0)
    assert mask.nonzero().flatten().tolist() == [2]
    out_before, w_before = down(h).detach(), up.weight.detach().clone()
    recycle(up, down, mask, init="default")
    torch.testing.assert_close(down(F.relu(up(x))), out_before, rtol=0, atol=1e-6)
    assert torch.equal(down.weight[:, 2], torch.zeros(4, 3, 3))
    assert not torch.equal(up.weight[2], w_before[2]) and torch.equal(up.weight[:2], w_before[:2])
    assert float(up.bias[2].detach()) == 0.0


def test_down_offset_zeroes_the_right_columns():
    up, down = nn.Linear(4, 3), nn.Linear(8, 2)
    mask = torch.tensor([False, True, False])
    before = down.weight.detach().clone()
    recycle(up, down, mask, down_offset=5)
    changed = (down.weight != before).any(0).nonzero().flatten().tolist()
    assert changed == [6] and float(down.weight[:, 6].abs().sum()) == 0.0


@pytest.mark.parametrize("init,expected_std", [
    (0.3, 0.3), ("weight_std", None), ("default", 1 / math.sqrt(3 * 256)),
    ("xavier_uniform", math.sqrt(6 / (256 + 512)) / math.sqrt(3)),
])
def test_init_scales(init, expected_std):
    up, down = nn.Linear(256, 512), nn.Linear(512, 8)
    with torch.no_grad():
        up.weight.normal_(0, 0.07)
    if expected_std is None:
        expected_std = float(up.weight.std())
    mask = torch.arange(512) % 2 == 0
    recycle(up, down, mask, init=init, generator=torch.Generator().manual_seed(0))
    assert float(up.weight[mask].std()) == pytest.approx(expected_std, rel=0.03)
    if isinstance(init, str) and init != "weight_std":  # uniform: bounded by √3·std
        assert float(up.weight[mask].abs().max()) <= expected_std * math.sqrt(3) + 1e-7


def test_same_generator_seed_same_weights():
    layers = []
    for seed in (3, 3, 4):
        torch.manual_seed(0)
        up, down = nn.Linear(4, 6), nn.Linear(6, 2)
        recycle(up, down, torch.ones(6, dtype=torch.bool), generator=torch.Generator().manual_seed(seed))
        layers.append(up.weight.detach().clone())
    assert torch.equal(layers[0], layers[1]) and not torch.equal(layers[0], layers[2])


def test_bad_mask_shape_is_rejected():
    with pytest.raises(ValueError, match="mask"):
        recycle(nn.Linear(4, 6), nn.Linear(6, 2), torch.ones(5, dtype=torch.bool))
    with pytest.raises(ValueError, match="init"):
        fresh_weights(torch.zeros(3, 3), "kaiming")


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_optimizer_moments_of_exactly_the_recycled_slices_are_zeroed(optimizer):
    model = nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 3))
    opt = make_optimizer(model, optimizer, lr=1e-2)
    model(torch.randn(8, 6)).square().mean().backward()
    opt.step()
    leaves = getattr(opt, "optimizers", [opt])
    snapshot = {}
    for leaf in leaves:  # random moments, so that zeroing cannot pass by accident
        for p, state in leaf.state.items():
            for key, value in state.items():
                if torch.is_tensor(value) and value.shape == p.shape:
                    value.copy_(torch.rand_like(value) + 0.5)
            snapshot[p] = {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}
    mask = torch.zeros(10, dtype=torch.bool)
    mask[[2, 3, 8]] = True
    recycle(model[0], model[2], mask, optimizer=opt)

    zeroed = {model[0].weight: (0, mask), model[0].bias: (0, mask), model[2].weight: (1, mask)}
    checked = 0
    for leaf in leaves:
        for p, state in leaf.state.items():
            for key, value in state.items():
                old = snapshot[p][key]
                if not (torch.is_tensor(value) and value.shape == p.shape):
                    assert torch.equal(value, old) if torch.is_tensor(value) else value == old  # step kept
                    continue
                if p in zeroed:
                    dim, m = zeroed[p]
                    sel = m if dim == 0 else (slice(None), m)
                    keep = ~m if dim == 0 else (slice(None), ~m)
                    assert float(value[sel].abs().sum()) == 0.0, f"{key} of recycled slice not zeroed"
                    assert torch.equal(value[keep], old[keep]), f"{key} of kept slice changed"
                    checked += 1
                else:
                    assert torch.equal(value, old)
    assert checked >= 3
