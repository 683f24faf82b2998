"""GradientTap: a minor weight's projected gradient computed in the backward, against the full gradient's
projection in float64; its check refusing weights with other uses; its removal restoring the layer."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from plasticity_callbacks.ops.minor_gradient import MIN_ENTRIES, GradientTap, compiled, full_gradients, tappable


def orthonormal(rows: int, cols: int, seed: int) -> torch.Tensor:
    return torch.linalg.qr(torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)))[0]


def conv1d(d_in: int, d_out: int) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    return transformers.pytorch_utils.Conv1D(d_out, d_in)  # stored (in, out)


def out_in(grad: torch.Tensor, transposed: bool) -> torch.Tensor:
    return (grad.mT if transposed else grad).double()


@pytest.mark.parametrize("kind", ["linear", "conv1d", "linear_called_twice", "linear_bf16_autocast"])
def test_tapped_gradient_is_the_projection_of_the_full_gradient(kind):
    seed = torch.randint(0, 2**31, ()).item()  # fresh inputs each run
    torch.manual_seed(seed)
    d_in, d_out, r = 11, 9, 3
    layer = conv1d(d_in, d_out) if kind == "conv1d" else nn.Linear(d_in, d_out)
    transposed = kind == "conv1d"
    reference = copy.deepcopy(layer)  # before the tap: a plain layer with the same weights
    U = orthonormal(d_out, r, seed)
    tap = GradientTap(layer.weight, layer, transposed)
    tap.install(U, checked=True)
    assert not layer.weight.requires_grad  # autograd skips the weight-gradient product

    def loss(module, x):
        y = module(x)
        if kind == "linear_called_twice":
            y = y + module(torch.tanh(x)).flip(0)
        return (y.float() ** 3).sum()

    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=kind == "linear_bf16_autocast")
    for micro_batch in range(2):  # gradient accumulation: both sums add up
        x = torch.randn(4, 5, d_in)
        with autocast:
            y, y_ref = layer(x), reference(x)
            assert torch.equal(y, y_ref)  # the tap adds an exact zero to the output
            loss(layer, x).backward()
            loss(reference, x).backward()
    full = out_in(reference.weight.grad, transposed)
    expected = U.double() @ (U.double().mT @ full)
    tolerance = 2e-2 if "bf16" in kind else 1e-5
    torch.testing.assert_close(out_in(layer.weight.grad, transposed), expected, rtol=tolerance,
                               atol=tolerance * expected.abs().max().item())
    torch.testing.assert_close(layer.bias.grad, reference.bias.grad)  # the bias keeps its own gradient
    tap.remove()
    assert layer.weight.requires_grad and not layer._forward_hooks


class TiedPair(nn.Module):
    """A Linear whose weight is also an embedding table (weight tying)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(6, 6, bias=False)
        self.embed = nn.Embedding(6, 6)
        self.embed.weight = self.proj.weight

    def forward(self, tokens):
        return self.proj(torch.tanh(self.embed(tokens)))


class ReadDirectly(nn.Module):
    """Reads the Linear's weight without calling it, as nn.MultiheadAttention does with ``out_proj``."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(6, 6)

    def forward(self, tokens):
        x = F.one_hot(tokens, 6).float()
        return F.linear(x, self.proj.weight, self.proj.bias)


class KeywordCall(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(6, 6)

    def forward(self, tokens):
        return self.proj(input=F.one_hot(tokens, 6).float())


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(6, 8)
        self.attention = nn.MultiheadAttention(8, 2, batch_first=True)
        self.proj = self.attention.out_proj

    def forward(self, tokens):
        x = self.embed(tokens)
        return self.attention(x, x, x, need_weights=False)[0]


@pytest.mark.parametrize("model", [TiedPair, ReadDirectly, KeywordCall, Attention])
def test_the_check_refuses_a_weight_with_other_uses(model):
    torch.manual_seed(0)
    module = model()
    tap = GradientTap(module.proj.weight, module.proj, transposed=False)
    tap.install(orthonormal(module.proj.weight.shape[0], 2, 1), checked=None)
    assert module.proj.weight.requires_grad  # checking: the full gradient is still formed
    module(torch.randint(0, 6, (3, 4))).square().sum().backward()
    assert tap.verdict() is False


def test_the_check_passes_for_a_plain_layer_and_waits_while_it_has_no_gradient():
    torch.manual_seed(0)
    layer = nn.Linear(6, 5)
    tap = GradientTap(layer.weight, layer, transposed=False)
    tap.install(orthonormal(5, 2, 1), checked=None)
    assert tap.verdict() is None  # no backward yet: no evidence either way
    layer(torch.randn(3, 6)).square().sum().backward()
    assert tap.verdict() is True


@pytest.mark.parametrize("other_use", [0.0, 0.05])
def test_the_check_under_bf16_with_a_gradient_almost_all_principal(other_use):
    """bf16 rounds the whole gradient, and the share of that rounding in the r minor directions exceeds 1e-2 of a
    small minor part (99 % of the gradient principal). No other use: passes; another use adding 5 % of the
    gradient's norm: fails."""
    torch.manual_seed(0)
    d, tokens, r = 512, 2048, 448
    layer = nn.Linear(d, d, bias=False)
    U = orthonormal(d, r, 3)
    principal = torch.linalg.qr(torch.cat([U, torch.randn(d, d - r)], 1))[0][:, r:]  # the other d − r directions
    tap = GradientTap(layer.weight, layer, transposed=False)
    tap.install(U, checked=None)
    x, x2 = torch.randn(tokens, d), torch.randn(tokens, d)
    g = torch.randn(tokens, d - r) @ principal.mT * 26 + torch.randn(tokens, r) @ U.mT  # 99 % principal
    g2 = torch.randn(tokens, d)
    g2 *= other_use * (g.mT @ x).norm() / (g2.mT @ x2).norm()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        # the layer's forward, and a read of its weight without it
        loss = (layer(x).float() * g).sum() + (F.linear(x2, layer.weight).float() * g2).sum()
    loss.backward()
    assert tap.verdict() is (other_use == 0.0)


def test_full_gradients_lifts_every_tap_inside_and_puts_it_back():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 4))
    taps = [GradientTap(model[i].weight, model[i], transposed=False) for i in (0, 2)]
    for tap, rows in zip(taps, (5, 4)):
        tap.install(orthonormal(rows, 2, rows), checked=True)
    with full_gradients(model):
        assert all(model[i].weight.requires_grad and not model[i]._forward_hooks for i in (0, 2))
    assert all(not model[i].weight.requires_grad and model[i]._forward_hooks for i in (0, 2))
    assert all(tap.skips_full_gradient for tap in taps)


def test_a_check_under_way_survives_full_gradients():
    """A side computation between two micro-batches (TaskMetrics' probe) lifts the tap; the check's sums stay."""
    torch.manual_seed(0)
    layer = nn.Linear(6, 5)
    tap = GradientTap(layer.weight, layer, transposed=False)
    tap.install(orthonormal(5, 2, 1), checked=None)
    layer(torch.randn(3, 6)).square().sum().backward()
    with full_gradients(layer):
        layer(torch.randn(3, 6)).sum().backward()  # the side computation's own gradient, taken back after
    layer.weight.grad = None
    layer(torch.randn(3, 6)).square().sum().backward()  # the check continues
    assert tap.verdict() is False  # W.grad holds one backward, C.grad both: C kept its sums across the pause
    tap.restart_check()
    layer.weight.grad = None
    layer(torch.randn(3, 6)).square().sum().backward()
    assert tap.verdict() is True


def test_tappable_and_compiled():
    linear, conv = nn.Linear(3, 3), nn.Conv2d(3, 3, 1)
    assert tappable(linear, linear.weight) and not tappable(conv, conv.weight)
    assert not tappable(linear, linear.bias)
    big, small = nn.Linear(256, 128), nn.Linear(128, 128)  # "auto": only where the saved product outweighs the tap
    assert tappable(big, big.weight, MIN_ENTRIES) and not tappable(small, small.weight, MIN_ENTRIES)
    model = nn.Sequential(nn.Linear(3, 3))
    assert not compiled(model)
    model[0].compile()  # compiles lazily: nothing traced here
    assert compiled(model)
    from plasticity_callbacks import GPTLightningModule

    assert compiled(GPTLightningModule(dict(n_layer=1, n_embd=16, n_head=1, n_kv_head=1, compile=True)))
    assert not compiled(GPTLightningModule(dict(n_layer=1, n_embd=16, n_head=1, n_kv_head=1)))
