"""The model map fails closed (issue 43): every weight's rows are whole, split as the forward cuts them, or refused.

Each module below does exactly one thing the trace used to lose a projection's row numbering on (a scale by a
buffer before the split, a layer summed with an adapter, experts' outputs concatenated, a square k/v projection
in an attention the probe cannot read, experts stored 2-D and viewed ``(E, I, H)``, an op the trace does not
model before a cut). Every true block is written out here from the module's own forward, and FIRE's effect is
checked on it in float64 (singular values of the block against FIRE's scale ``√(out/in)``), never against the map.
"""
from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from plasticity_callbacks.callbacks.weight_clip import clip_bounds
from plasticity_callbacks.functional.isometry import FIREOptions
from plasticity_callbacks.model_map import coverage_report, declare_plasticity, select_targets
from plasticity_callbacks.model_map.coverage import coverage
from plasticity_callbacks.ops.dash import dash_
from plasticity_callbacks.ops.fire import apply_fire

H, V = 8, 11


class LM(nn.Module):
    """Token embedding -> mixer -> head: the trace runs it on one token."""

    def __init__(self, mixer: nn.Module):
        super().__init__()
        self.emb, self.mixer, self.head = nn.Embedding(V, H), mixer, nn.Linear(H, V)

    def forward(self, idx):
        return self.head(self.mixer(self.emb(idx)))


class Scaled(nn.Module):
    """``in_proj(x) * mup`` (a per-feature buffer, muP-style), then a three-way split."""

    def __init__(self):
        super().__init__()
        self.in_proj, self.out = nn.Linear(H, 3 * H), nn.Linear(H, H)
        self.register_buffer("mup", torch.rand(3 * H) + 0.5)

    def forward(self, x):
        a, b, c = (self.in_proj(x) * self.mup).split([H, H, H], -1)
        return self.out(a * torch.sigmoid(b) + c)

    def true_blocks(self):
        w = self.in_proj.weight
        return {"in_proj.a": w[:H], "in_proj.b": w[H:2 * H], "in_proj.c": w[2 * H:], "out": self.out.weight}


class Adapted(nn.Module):
    """A fused gate/up summed with an adapter of the same width, then ``chunk(2)``."""

    def __init__(self):
        super().__init__()
        self.gate_up, self.adapter, self.down = nn.Linear(H, 4 * H), nn.Linear(H, 4 * H), nn.Linear(2 * H, H)

    def forward(self, x):
        gate, up = (self.gate_up(x) + self.adapter(x)).chunk(2, -1)
        return self.down(F.silu(gate) * up)

    def true_blocks(self):
        out = {"down": self.down.weight}
        for name in ("gate_up", "adapter"):
            w = getattr(self, name).weight
            out.update({f"{name}.gate": w[:2 * H], f"{name}.up": w[2 * H:]})
        return out


class Concatenated(nn.Module):
    """Per-expert Linear outputs concatenated over tokens (``torch.cat``), then each cut into gate and up."""

    def __init__(self):
        super().__init__()
        self.experts, self.down = nn.ModuleList(nn.Linear(H, 4 * H) for _ in range(3)), nn.Linear(2 * H, H)

    def forward(self, x):
        x = x.reshape(-1, H)  # (T, H)
        gate, up = torch.cat([expert(x) for expert in self.experts], 0).chunk(2, -1)  # (3T, 2H) each
        return self.down(F.silu(gate) * up)[: x.shape[0]].unsqueeze(0)

    def true_blocks(self):
        out = {"down": self.down.weight}
        for e, expert in enumerate(self.experts):
            out.update({f"{e}.gate": expert.weight[:2 * H], f"{e}.up": expert.weight[2 * H:]})
        return out


class ParallelExperts(nn.Module):
    """Granite-MoE style: a 3-D stack, ``F.linear(inputs[e], weight[e])`` per expert, outputs ``cat``, ``chunk(2)``."""

    def __init__(self):
        super().__init__()
        self.weight, self.down = nn.Parameter(torch.randn(3, 4 * H, H) / 3), nn.Linear(2 * H, H)

    def forward(self, x):
        inputs = x.reshape(-1, H).repeat(3, 1).split(x.numel() // H, 0)
        hidden = torch.cat([F.linear(inputs[e], self.weight[e]) for e in range(3)], 0)
        gate, up = hidden.chunk(2, -1)
        return self.down(F.silu(gate) * up)[: x.numel() // H].unsqueeze(0)

    def true_blocks(self):
        out = {"down": self.down.weight}
        for e in range(3):
            out.update({f"{e}.gate": self.weight[e, :2 * H], f"{e}.up": self.weight[e, 2 * H:]})
        return out


class LinearAttention(nn.Module):
    """Square ``[q | gate]`` and ``[k | v]`` projections in an attention the probe cannot read (an ``einsum``)."""

    def __init__(self):
        super().__init__()
        self.q_gate, self.kv, self.o = nn.Linear(H, H), nn.Linear(H, H), nn.Linear(H // 2, H)

    def forward(self, x):
        q, gate = self.q_gate(x).chunk(2, -1)
        k, v = self.kv(x).chunk(2, -1)
        mixed = torch.einsum("btd,bsd,bse->bte", F.elu(q) + 1, F.elu(k) + 1, v)
        return self.o(mixed * torch.sigmoid(gate))

    def true_blocks(self):
        half = H // 2
        return {"q": self.q_gate.weight[:half], "gate": self.q_gate.weight[half:], "k": self.kv.weight[:half],
                "v": self.kv.weight[half:], "o": self.o.weight}


class PerHeadAttention(nn.Module):
    """A fused ``qkv`` laid out ``[heads, 3, head_dim]`` in an attention the probe cannot read (an ``einsum``): the
    probe's head-count suggestions cannot tell the layout, the trace reads it."""

    num_heads = 2

    def __init__(self):
        super().__init__()
        self.qkv, self.o = nn.Linear(H, 3 * H), nn.Linear(H, H)

    def forward(self, x):
        q, k, v = self.qkv(x).view(*x.shape[:2], self.num_heads, -1).chunk(3, -1)  # (B, T, heads, head_dim)
        scores = torch.einsum("bthd,bshd->bhts", q, k).softmax(-1)
        return self.o(torch.einsum("bhts,bshd->bthd", scores, v).flatten(2))

    def true_blocks(self):
        w = self.qkv.weight.view(self.num_heads, 3, H // self.num_heads, H)  # (heads, 3, head_dim, in)
        return {"q": w[:, 0].flatten(0, 1), "k": w[:, 1].flatten(0, 1), "v": w[:, 2].flatten(0, 1), "o": self.o.weight}


class FlatExperts(nn.Module):
    """DBRX style: experts stored 2-D ``(E·I, H)`` and viewed ``(E, I, H)``; ``x @ w1[e].T`` and ``h @ w2[e]``."""

    E, I = 3, 5

    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(self.E * self.I, H))
        self.w2 = nn.Parameter(torch.randn(self.E * self.I, H))

    def forward(self, x):
        w1, w2 = self.w1.view(self.E, self.I, H), self.w2.view(-1, self.I, H)
        return sum(F.silu(x.matmul(w1[e].T)).matmul(w2[e]) for e in range(self.E))

    def true_blocks(self):  # (out, in) as the forward applies them
        w1, w2 = self.w1.view(self.E, self.I, H), self.w2.view(self.E, self.I, H)
        return {**{f"w1.{e}": w1[e] for e in range(self.E)}, **{f"w2.{e}": w2[e].T for e in range(self.E)}}


CASES = [Scaled, Adapted, Concatenated, ParallelExperts, LinearAttention, PerHeadAttention, FlatExperts]


def off_isometry(matrix: torch.Tensor) -> float:
    """max |σ/√(out/in) − 1| (FIRE's default scale), in float64."""
    sigma = torch.linalg.svdvals(matrix.detach().double())
    return float((sigma / math.sqrt(matrix.shape[0] / matrix.shape[1]) - 1).abs().max())


# Refused at setup, with the one declaration that fixes it: the q/k/v rows were cut apart by the trace, but the
# einsum after them sums each query over head_dim and keeps the heads, which no numbering can follow.
REFUSED = {"PerHeadAttention": "mixer.qkv.weight"}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_fire_makes_every_block_the_forward_uses_an_isometry(case):
    torch.manual_seed(0)
    model = LM(case())
    assert max(off_isometry(b) for b in model.mixer.true_blocks().values()) > 0.1  # the check below can fail
    if case.__name__ in REFUSED:
        with pytest.raises(ValueError, match=re.escape(REFUSED[case.__name__])) as refused:
            apply_fire(model, None, FIREOptions(method="svd"))
        [line] = re.findall(r"declare_plasticity\(model, fused=\{.*?\}\)(?=  #)", str(refused.value))
        eval(line, {"declare_plasticity": declare_plasticity, "model": model})
    apply_fire(model, None, FIREOptions(method="svd"))
    off = {name: off_isometry(b) for name, b in model.mixer.true_blocks().items()}
    assert max(off.values()) < 1e-6, off


def test_flat_experts_are_seen_per_expert_by_weight_clip_and_dash():
    torch.manual_seed(0)
    model = LM(FlatExperts())
    bounds, left = clip_bounds(model)
    # WeightClip's bound is one expert matrix's fan-in: H for w1 (x @ w1[e].T), I for w2 (h @ w2[e])
    assert bounds["mixer.w1"][1] == pytest.approx(1 / math.sqrt(H))
    assert bounds["mixer.w2"][1] == pytest.approx(1 / math.sqrt(FlatExperts.I))
    assert "mixer.w1" not in left and "mixer.w2" not in left
    model.mixer.w2.grad = torch.randn_like(model.mixer.w2)
    model.mixer.w1.grad = torch.randn_like(model.mixer.w1)
    W0, G = model.mixer.w2.detach().clone().double(), -model.mixer.w2.grad.double()
    dash_(model, min_factor=0.3, shrink_bias=False)
    # an output neuron of expert e's w2 is a column of its (I, H) block: one factor each
    W0e, Ge = W0.view(3, FlatExperts.I, H), G.view(3, FlatExperts.I, H)
    factor = F.cosine_similarity(Ge, W0e, dim=1).clamp(0.3, 1.0)  # (E, H)
    torch.testing.assert_close(model.mixer.w2.detach().double().view(3, FlatExperts.I, H), W0e * factor[:, None, :])


class Unmodelled(nn.Module):
    """``in_proj`` through an op the trace does not model (a running sum over tokens), then split."""

    def __init__(self):
        super().__init__()
        self.in_proj, self.out = nn.Linear(H, 3 * H), nn.Linear(H, H)

    def forward(self, x):
        a, b, c = torch.cumsum(self.in_proj(x), dim=1).split([H, H, H], -1)
        return self.out(a * torch.sigmoid(b) + c)


def test_a_cut_after_an_unmodelled_op_is_refused_by_name_and_the_printed_declaration_fixes_it():
    torch.manual_seed(0)
    model = LM(Unmodelled())
    with pytest.raises(ValueError, match=r"mixer\.in_proj\.weight.*cumsum.*declare_plasticity") as refused:
        apply_fire(model, None, FIREOptions(method="svd"))
    line = refused.value.args[0].split("declare_plasticity(", 1)[1].split("  #")[0]
    assert line == "model, fused={'mixer.in_proj.weight': [8, 8, 8]})"
    eval("declare_plasticity(" + line, {"declare_plasticity": declare_plasticity, "model": model})
    apply_fire(model, None, FIREOptions(method="svd"))
    w = model.mixer.in_proj.weight
    assert max(off_isometry(w[i * H:(i + 1) * H]) for i in range(3)) < 1e-6
    assert "split unknown" not in str(coverage_report(model))


class Lost(nn.Module):
    """``in_proj`` through an op whose result has another shape (an FFT over features), then a cut."""

    def __init__(self):
        super().__init__()
        self.in_proj, self.out = nn.Linear(H, 2 * H), nn.Linear(H + 1, H)

    def forward(self, x):
        spectrum = torch.fft.rfft(self.in_proj(x), dim=-1).abs()  # (B, T, H + 1)
        return self.out(spectrum[..., : H + 1])


def test_numbers_that_cannot_follow_an_op_do_not_prove_a_weight_whole():
    model = LM(Lost())
    [view] = [t for t in select_targets(model) if t.name == "mixer.in_proj.weight"]
    assert "fft_rfft" in view.split_unknown and "[16]" in view.split_unknown
    with pytest.raises(ValueError, match=r"mixer\.in_proj\.weight"):
        apply_fire(model, None, FIREOptions(method="svd"))
    declare_plasticity(model, fused={"mixer.in_proj.weight": [16]})  # the printed fix: one matrix
    apply_fire(model, None, FIREOptions(method="svd"))
    assert off_isometry(model.mixer.in_proj.weight) < 1e-6


class ShortConv(nn.Module):
    """LFM2-style short conv: ``[B | C | x]``, a causal depthwise conv1d, no ``A_log``."""

    def __init__(self):
        super().__init__()
        self.in_proj, self.out_proj = nn.Linear(H, 3 * H), nn.Linear(H, H)
        self.conv = nn.Conv1d(H, H, 3, groups=H, padding=2)

    def forward(self, x):
        b, c, h = self.in_proj(x).transpose(-1, -2).chunk(3, -2)  # (B, H, T) each
        y = self.conv(b * h)[..., : x.shape[1]]
        return self.out_proj((c * y).transpose(-1, -2))


def test_a_causal_depthwise_conv_of_any_sequence_mixer_is_left_alone_and_listed():
    torch.manual_seed(0)
    model = LM(ShortConv())
    before = model.mixer.conv.weight.detach().clone()
    apply_fire(model, None, FIREOptions(method="svd"))
    assert torch.equal(model.mixer.conv.weight, before)
    w = model.mixer.in_proj.weight
    assert max(off_isometry(w[i * H:(i + 1) * H]) for i in range(3)) < 1e-6
    [row] = [r for r in coverage(model) if r[0] == "mixer.conv.weight"]
    assert row[2] == "untreated" and "depthwise causal conv1d of ShortConv" in row[3] and "include=" in row[3]


# --- Models the map must run on an input it makes (or be told one), else refuse -----------------------------------


def polar64(matrix: torch.Tensor) -> torch.Tensor:
    """The polar factor U Vᵀ of ``matrix`` in float64 (an independent SVD, not FIRE's solver)."""
    u, _, vh = torch.linalg.svd(matrix.detach().double(), full_matrices=False)
    return u @ vh


def assert_scaled_polar(new: torch.Tensor, old: torch.Tensor, what: str) -> None:
    """``new`` is a positive multiple of ``old``'s polar factor (the multiple is FIRE's scale rule, not checked)."""
    target = polar64(old)
    new = new.detach().double()
    scale = float((new * target).sum() / (target * target).sum())
    assert scale > 0 and torch.allclose(new, scale * target, atol=1e-5 * scale), what


class PixelViT(nn.Module):
    """Images in, a fused qkv reshaped ``(B, T, 3, heads, hd)``: no token id or vector input runs it."""

    def __init__(self, d: int = 16, heads: int = 2):
        super().__init__()
        self.patch, self.qkv, self.proj, self.head = nn.Conv2d(3, d, 4, 4), nn.Linear(d, 3 * d), nn.Linear(d, d), \
            nn.Linear(d, 5)
        self.d, self.heads = d, heads

    def forward(self, image):
        x = self.patch(image).flatten(2).transpose(1, 2)  # (B, T, d)
        b, t, d = x.shape
        q, k, v = self.qkv(x).reshape(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attention = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d // self.heads), -1) @ v
        return self.head(self.proj(attention.transpose(1, 2).reshape(b, t, d)).mean(1))


def test_a_model_that_takes_images_is_run_on_a_made_image_and_its_fused_qkv_treated_per_block():
    torch.manual_seed(3)
    model = PixelViT()
    before = model.qkv.weight.detach().clone()
    apply_fire(model, None, FIREOptions(method="svd"))
    d = model.d
    for i, part in enumerate("qkv"):  # the forward's reshape puts q, k, v in consecutive d-row blocks
        rows = slice(i * d, (i + 1) * d)
        assert_scaled_polar(model.qkv.weight[rows], before[rows], part)


class TwoInputs(nn.Module):
    """A forward that needs a mask beside ``x``: nothing the map can make runs it."""

    def __init__(self):
        super().__init__()
        self.gate_up, self.down = nn.Linear(H, 4 * H), nn.Linear(2 * H, H)

    def forward(self, x, mask):
        gate, up = self.gate_up(x).chunk(2, -1)
        return self.down(F.silu(gate) * up * mask)


def test_a_model_whose_forward_cannot_run_is_refused_by_name_until_it_carries_an_example_input():
    torch.manual_seed(4)
    model = TwoInputs()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"\['gate_up.weight'.*example_input_array"):
        apply_fire(model, None, FIREOptions(method="svd"))
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # refused before touching anything
    model.example_input_array = (torch.zeros(1, 2, H), torch.ones(1, 2, 2 * H))  # read by a fresh map
    apply_fire(model, None, FIREOptions(method="svd"))
    for rows, part in ((slice(0, 2 * H), "gate"), (slice(2 * H, 4 * H), "up")):
        assert_scaled_polar(model.gate_up.weight[rows], before["gate_up.weight"][rows], part)


class HeldFused(nn.Module):
    """Linear -> chunk -> GLU -> Linear, held by a LightningModule that computes in ``training_step``."""

    def __init__(self):
        super().__init__()
        self.fused, self.out = nn.Linear(H, 2 * H), nn.Linear(H, 3)

    def forward(self, x):
        a, b = self.fused(x).chunk(2, -1)
        return self.out(a * torch.sigmoid(b))


def test_a_lightning_module_without_forward_is_read_through_the_one_network_it_holds():
    import lightning as L

    class StepsOnly(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = HeldFused()

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).square().mean()

    torch.manual_seed(5)
    module = StepsOnly()
    before = module.net.fused.weight.detach().clone()
    apply_fire(module, None, FIREOptions(method="svd"))
    for rows in (slice(0, H), slice(H, 2 * H)):
        assert_scaled_polar(module.net.fused.weight[rows], before[rows], str(rows))


class GatedConv(nn.Module):
    """A conv whose output channels the forward cuts in two (a gated conv, GLU over channels)."""

    def __init__(self):
        super().__init__()
        self.conv, self.mix, self.head = nn.Conv2d(3, 16, 3, padding=1), nn.Conv2d(8, 8, 3), nn.Linear(8, 2)

    def forward(self, image):
        a, b = self.conv(image).chunk(2, dim=1)
        return self.head(F.adaptive_avg_pool2d(self.mix(a * torch.sigmoid(b)), 1).flatten(1))


def test_a_conv_whose_channels_the_forward_cuts_is_treated_per_block_per_tap():
    torch.manual_seed(6)
    model = GatedConv()
    before = model.conv.weight.detach().clone()
    (target,) = [t for t in select_targets(model) if t.name == "conv.weight"]
    assert [list(b.rows) for b in target.blocks] == [list(range(8)), list(range(8, 16))]
    apply_fire(model, None, FIREOptions(method="svd"))
    for rows in (slice(0, 8), slice(8, 16)):
        for i in range(3):
            for j in range(3):
                assert_scaled_polar(model.conv.weight[rows, :, i, j], before[rows, :, i, j], f"{rows} tap {i},{j}")


class Captioner(nn.Module):
    """An image encoder with a fused gate/up and a token decoder; the forward takes both. One token runs the
    decoder alone, which says nothing of the encoder's weights."""

    def __init__(self):
        super().__init__()
        self.vision = HeldFused()
        self.text = LM(nn.Linear(H, H))

    def forward(self, features, idx):
        return self.text(idx) + self.vision(features).sum()


def test_weights_outside_the_part_of_the_model_a_token_reaches_are_refused_not_treated_whole():
    torch.manual_seed(7)
    model = Captioner()
    before = model.vision.fused.weight.detach().clone()
    with pytest.raises(ValueError, match=r"\['vision.fused.weight', 'vision.out.weight'\].*could not run the forward"):
        apply_fire(model, None, FIREOptions(method="svd"))
    model.example_input_array = (torch.zeros(1, H), torch.zeros(1, 1, dtype=torch.long))
    apply_fire(model, None, FIREOptions(method="svd"))
    for rows in (slice(0, H), slice(H, 2 * H)):
        assert_scaled_polar(model.vision.fused.weight[rows], before[rows], str(rows))
