"""Model family × callback: each callback's effect on tiny Hugging Face, torch and hand-written models.

Expectations are computed here from the raw parameters and a hand-written list of what each family
holds (orientation, fused blocks, head), not from the model map the callbacks use. SGD with lr=0
keeps training from moving the weights, so every change seen is the callback's.
"""
from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from torch import nn

from helpers import fit
from model_zoo import FAMILIES, LAYOUT_MODELS, Wrapped, batches, loss_of
from plasticity_callbacks.callbacks.adaptive_svd import AdaptiveSVDSwitch
from plasticity_callbacks.callbacks.dash import DASHShrink
from plasticity_callbacks.callbacks.fire import FIREReinit
from plasticity_callbacks.callbacks.redo import ReDoMonitor
from plasticity_callbacks.callbacks.shrink_perturb import ShrinkPerturb
from plasticity_callbacks.distributed.strategy import rank_identical_generator
from plasticity_callbacks.model_map import fresh_parameters
from plasticity_callbacks.callbacks.schedule import Schedule
from plasticity_callbacks.functional.isometry import FIREOptions

pytest.importorskip("transformers")

HEADS = {"gpt2": "model.lm_head", "llama": "model.lm_head", "mistral": "model.lm_head",
         "bert": "model.cls.predictions.decoder",
         "torch_encoder": "model.head", "resnet": "model.head", "mlp": "model.4", "gpt_neox": "model.lm_head",
         **{f: "model.lm_head" for f in ("bloom", "falcon_gqa", "falcon_mqa", "bigcode_mqa", "phi3")}}
# The layout families (fused Q/K/V by head, by K/V group, multi-query; fused gate/up) in the generic cells too.
WIDE = (*FAMILIES, *LAYOUT_MODELS)
# Expected neuron layers: (up, gate, down, down inputs per unit, BatchNorm) by module name.
NEURONS = {
    "gpt2": [(f"model.transformer.h.{i}.mlp.c_fc", None, f"model.transformer.h.{i}.mlp.c_proj", 1, None)
             for i in range(2)],
    "llama": [(f"model.model.layers.{i}.mlp.up_proj", f"model.model.layers.{i}.mlp.gate_proj",
               f"model.model.layers.{i}.mlp.down_proj", 1, None) for i in range(2)],
    "mistral": [("model.model.layers.0.mlp.up_proj", "model.model.layers.0.mlp.gate_proj",
                 "model.model.layers.0.mlp.down_proj", 1, None)],
    "bert": [(f"model.bert.encoder.layer.{i}.intermediate.dense", None, f"model.bert.encoder.layer.{i}.output.dense",
              1, None) for i in range(2)],
    "torch_encoder": [(f"model.encoder.layers.{i}.linear1", None, f"model.encoder.layers.{i}.linear2", 1, None)
                      for i in range(2)],
    "resnet": [("model.block.conv1", None, "model.block.conv2", 1, "model.block.bn1"),
               ("model.reduce", None, "model.fc", 36, None), ("model.fc", None, "model.head", 1, None)],
    "mlp": [("model.0", None, "model.2", 1, None), ("model.2", None, "model.4", 1, None)],
    "gpt_neox": [("model.gpt_neox.layers.0.mlp.dense_h_to_4h", None, "model.gpt_neox.layers.0.mlp.dense_4h_to_h", 1,
                  None)],
    **{f: [("model.transformer.h.0.mlp.dense_h_to_4h", None, "model.transformer.h.0.mlp.dense_4h_to_h", 1, None)]
       for f in ("bloom", "falcon_gqa", "falcon_mqa")},
    "bigcode_mqa": [("model.transformer.h.0.mlp.c_fc", None, "model.transformer.h.0.mlp.c_proj", 1, None)],
}


def treated(family: str, module: nn.Module):
    """``(name, param, transposed, row blocks)`` of every weight a callback should treat, by hand."""
    out = []
    for name, m in module.named_modules():
        if name == HEADS[family] or isinstance(m, nn.Embedding):
            continue
        if type(m).__name__ == "Conv1D":  # HF GPT-2: stored (in, out)
            rows = m.weight.shape[1]
            blocks = [rows // 3] * 3 if name.endswith("c_attn") else [rows]
            out.append((f"{name}.weight", m.weight, True, blocks))
        elif isinstance(m, (nn.Linear, nn.Conv2d)):
            out.append((f"{name}.weight", m.weight, False, [m.weight.shape[0]]))
        elif isinstance(m, nn.MultiheadAttention):
            out.append((f"{name}.in_proj_weight", m.in_proj_weight, False, [m.embed_dim] * 3))
    return out


def oriented(param: torch.Tensor, transposed: bool) -> torch.Tensor:
    return param.detach().mT if transposed else param.detach()


@pytest.mark.parametrize("family", FAMILIES)
def test_fire_makes_every_block_a_scaled_isometry(family):
    module = Wrapped(family)
    fire = FIREReinit(schedule=Schedule(at_fit_start=True), options=FIREOptions(method="svd"))
    fit(module, [fire])
    expected = treated(family, module)
    assert len([r for r in fire.last_records if r.skipped is None]) == sum(len(b) for *_, b in expected)
    for name, param, transposed, blocks in expected:
        W, start = oriented(param, transposed).double(), 0
        for rows in blocks:
            block = W[start:start + rows]
            start += rows
            taps = block.shape[2:].numel() if block.dim() > 2 else 1
            scale = math.sqrt(block.shape[0] / block.shape[1]) / taps
            per_tap = block.permute(*range(2, block.dim()), 0, 1) if block.dim() > 2 else block
            s = torch.linalg.svdvals(per_tap)
            torch.testing.assert_close(s, torch.full_like(s, scale), rtol=1e-4, atol=1e-6, msg=f"{name}: {s}")


@pytest.mark.parametrize("family", WIDE)
def test_shrink_perturb_draws_fresh_values_everywhere(family):
    module = Wrapped(family)
    with torch.no_grad():  # a trained-looking model: no parameter sits at its init value
        for p in module.parameters():
            p.add_(0.05 * torch.randn_like(p))
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    fit(module, [ShrinkPerturb(shrink=0.5, perturb=0.3, seed=3)])
    fresh = fresh_parameters(module, rank_identical_generator(3, 0).initial_seed())
    for name, p in module.named_parameters():
        assert not torch.equal(fresh[name], before[name]), f"{name}: the fresh draw is the current value"
        torch.testing.assert_close(p.detach(), 0.5 * before[name] + 0.3 * fresh[name])
        if p.dim() >= 2:  # not a mere rescale (λ+p)·θ
            assert not torch.allclose(p.detach(), 0.8 * before[name], atol=1e-6), name


class Snapshot(L.Callback):
    def on_train_start(self, trainer, pl_module):
        self.before = {n: p.detach().clone() for n, p in pl_module.named_parameters()}


@pytest.mark.parametrize("family", sorted(NEURONS))  # phi3's fused gate/up: its own test below
def test_redo_finds_every_mlp_and_recycles_by_layout(family):
    module = Wrapped(family)
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.fill_(0.5)
    redo = ReDoMonitor(tau=1.0, collect_every_n_steps=1, log_every_n_steps=1, schedule=Schedule(steps=[1]))
    snap = Snapshot()
    fit(module, [snap, redo], steps=2)
    modules = dict(module.named_modules())
    names = {id(m): n for n, m in modules.items()}
    assert sorted(names[id(layer.up)] for layer in redo.layers) == sorted(up for up, *_ in NEURONS[family])
    for up_name, gate_name, down_name, group, norm_name in NEURONS[family]:
        up, down = modules[up_name], modules[down_name]
        t_up, t_down = type(up).__name__ == "Conv1D", type(down).__name__ == "Conv1D"
        W_up, W_up0 = oriented(up.weight, t_up), oriented(snap.before[f"{up_name}.weight"], t_up)
        # Re-sampled rows hold new non-zero values (zeroing, by the layout before, only writes zeros).
        changed = ((W_up != W_up0) & (W_up != 0)).flatten(1).any(1)
        assert changed.any(), f"{up_name}: nothing recycled at tau=1"
        if gate_name:  # the gate's rows are the same units
            gate = modules[gate_name]
            assert torch.equal((gate.weight != snap.before[f"{gate_name}.weight"]).flatten(1).any(1), changed)
        assert torch.equal(W_up[~changed], W_up0[~changed]) or any(d == up_name for *_, d, _, _ in NEURONS[family])
        columns = changed.repeat_interleave(group)
        W_down, W_down0 = oriented(down.weight, t_down), oriented(snap.before[f"{down_name}.weight"], t_down)
        # A down layer that is also the next layout's up has some rows re-sampled whole: leave those out.
        resampled = ((W_down != W_down0) & (W_down != 0)).flatten(1).any(1)
        if not any(up == down_name for up, *_ in NEURONS[family]):
            assert not resampled.any()
        kept = W_down[~resampled]
        assert kept[:, columns].abs().sum() == 0, f"{down_name}: outgoing weights of recycled units not zero"
        assert W_down0[~resampled][:, columns].abs().sum() > 0  # they were not zero before
        if norm_name:
            norm = modules[norm_name]
            assert torch.all(norm.weight[changed] == 1) and torch.all(norm.weight[~changed] == 0.5)


@pytest.mark.parametrize("family", WIDE)
def test_dash_one_factor_per_output_neuron(family):
    module = Wrapped(family)
    first = next(iter(torch.utils.data.DataLoader(batches(family), batch_size=4)))
    module.train()
    module.zero_grad()
    loss_of(family, module.model, first).backward()
    grads = {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}
    module.zero_grad()
    snap = Snapshot()
    fit(module, [snap, DASHShrink(n_batches=1, gradient_ema_weight=1.0, min_factor=0.3, shrink_bias=False,
                                  gradient_mode="train")])  # the gradients above are taken in train mode
    for name, param, transposed, _ in treated(family, module):
        W0 = oriented(snap.before[name], transposed).double()
        G = -oriented(grads[name], transposed).double()
        flat_w, flat_g = (W0.flatten(2), G.flatten(2)) if W0.dim() > 2 else (W0, G)
        factor = torch.nn.functional.cosine_similarity(flat_g, flat_w, dim=-1).clamp(0.3, 1.0)
        expected = W0 * factor.reshape(factor.shape + (1,) * (W0.dim() - factor.dim()))
        torch.testing.assert_close(oriented(param, transposed).double(), expected, rtol=1e-4, atol=1e-6,
                                   msg=f"{name}")
        assert factor.shape[0] == W0.shape[0]  # one factor per output neuron (conv: per (out, in) slice)


class GradientProbe(L.Callback):
    def __init__(self, switch):
        self.switch, self.checked = switch, 0

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        for m in self.switch.matrices:
            if m.state != "minor":
                continue
            t = m.target
            W = oriented(t.param, t.transposed).double().reshape(t.shape[0], -1)
            G = oriented(t.param.grad, t.transposed).double().reshape(t.shape[0], -1)
            U = torch.linalg.svd(W, full_matrices=False)[0]
            U_minor = U[:, U.shape[1] - m.r:]
            residual = G - U_minor @ (U_minor.mT @ G)
            assert residual.norm() <= 1e-4 * G.norm() + 1e-12, t.name
            self.checked += 1


@pytest.mark.parametrize("family", WIDE)
def test_adaptive_svd_projects_onto_the_minor_subspace(family):
    module = Wrapped(family)
    switch = AdaptiveSVDSwitch(minor_training="project", schedule=Schedule(steps=[0], every_n_steps=1),
                               thresholds={"clobber_alignment": 0.0}, r_min=2,
                               initial_rank=3, svd={"dtype": "float64"}, save_figure=False, log_per_matrix=False)
    probe = GradientProbe(switch)
    fit(module, [switch, probe])
    assert probe.checked == len(treated(family, module))


@pytest.mark.parametrize("family", WIDE)
def test_adaptive_svd_projects_in_the_backward_exactly_where_the_forward_allows(family):
    """With ``skip_full_gradient`` a minor Linear/Conv1D weight gets ``U_m U_mᵀ ∇W`` from the backward (its own
    gradient off); training equals projecting the full gradient after the backward, on every family. The
    engaged weights are listed by hand: not MultiheadAttention's ``out_proj`` (read without its forward)."""
    engaged, finals = set(), {}
    for skip in (True, False):
        module = Wrapped(family, lr=0.1)
        switch = AdaptiveSVDSwitch(minor_training="project", schedule=Schedule(steps=[0]), initial_rank=2, r_min=1,
                                   thresholds={"clobber_alignment": 0.0}, save_figure=False, log_per_matrix=False,
                                   skip_full_gradient=skip)

        class Projected(L.Callback):  # after the switch: the gradient the optimizer will use
            def on_before_optimizer_step(self, trainer, pl_module, optimizer):
                for m in switch.matrices:
                    if m.state == "minor" and trainer.global_step >= 2 and m.target.param.grad is not None:
                        G = oriented(m.target.param.grad, m.target.transposed).double().flatten(1)
                        U = m.U_minor.double()
                        assert (G - U @ (U.mT @ G)).norm() <= 1e-5 * G.norm() + 1e-12, m.target.name
                        if skip and not m.target.param.requires_grad:
                            engaged.add(m.target.name)

        fit(module, [switch, Projected()], steps=4)
        assert all(p.requires_grad for p in module.parameters()) and all(m.tap is None or not m.tap.installed
                                                                          for m in switch.matrices)
        finals[skip] = {n: p.detach().clone() for n, p in module.named_parameters()}
    for name, value in finals[True].items():
        torch.testing.assert_close(value, finals[False][name], rtol=1e-5, atol=1e-6, msg=name)
    expected = {name for name, param, *_ in treated(family, module)  # Linear and Conv1D (2-D), not convs
                if param.dim() == 2 and not name.endswith(("in_proj_weight", "self_attn.out_proj.weight"))}
    assert engaged == expected


# Layout classes: each family's Q/K/V (or gates, groups, taps) recomputed the way its own forward
# computes them, never read from the model map.
def _heads(W, groups, slots):  # W (rows, d) viewed as the forward's [groups, slots, head_dim]
    return W.view(groups, slots, -1, W.shape[-1])


QKV_OF_FORWARD = {  # the fused weight and how the family's forward splits its (out, in) rows
    "gpt_neox": ("gpt_neox.layers.0.attention.query_key_value", lambda W: _heads(W, 4, 3).unbind(1)),
    "bloom": ("transformer.h.0.self_attention.query_key_value", lambda W: _heads(W, 4, 3).unbind(1)),
    "falcon_gqa": ("transformer.h.0.self_attention.query_key_value",
                   lambda W: (_heads(W, 2, 4)[:, :2], _heads(W, 2, 4)[:, 2], _heads(W, 2, 4)[:, 3])),
    "falcon_mqa": ("transformer.h.0.self_attention.query_key_value", lambda W: W.split([16, 4, 4])),
    "bigcode_mqa": ("transformer.h.0.attn.c_attn", lambda W: W.split([16, 4, 4])),
    "phi3": ("model.layers.0.self_attn.qkv_proj", lambda W: W.split([16, 8, 8])),
}


def _scaled_isometry(M, msg):
    M = M.reshape(-1, M.shape[-1]).double()
    s = torch.linalg.svdvals(M)
    scale = math.sqrt(M.shape[0] / M.shape[1])
    torch.testing.assert_close(s, torch.full_like(s, scale), rtol=1e-4, atol=1e-6, msg=f"{msg}: {s}")


@pytest.mark.parametrize("family", sorted(QKV_OF_FORWARD))
def test_fire_makes_the_forwards_own_q_k_v_isometries(family):
    from model_zoo import LAYOUT_MODELS
    from plasticity_callbacks.model_map import select_targets
    from plasticity_callbacks.ops.fire import apply_fire

    torch.manual_seed(0)
    model = LAYOUT_MODELS[family]()
    name, split = QKV_OF_FORWARD[family]
    layer = model.get_submodule(name)
    views = {v.name: v for v in select_targets(model)}
    assert views[f"{name}.weight"].role == "attention" and not views[f"{name}.weight"].split_unknown
    apply_fire(model, options=FIREOptions(method="svd"))
    W = layer.weight.detach().mT if type(layer).__name__ == "Conv1D" else layer.weight.detach()
    for part, M in zip("qkv", split(W)):
        _scaled_isometry(M, f"{family} {part}")
    if family == "phi3":  # gate_up_proj: forward chunk(2) -> gate, up; both MLP
        gate_up = model.model.layers[0].mlp.gate_up_proj
        for half in gate_up.weight.detach().chunk(2):
            _scaled_isometry(half, "phi3 gate_up")
        assert views["model.layers.0.mlp.gate_up_proj.weight"].role == "mlp"
        assert views["model.layers.0.mlp.down_proj.weight"].role == "mlp"


def _operator_taps(layer, channels_in):
    """The conv's own operator per kernel tap, ``(taps, C_out, C_in)``, from one-hot inputs through its forward."""
    k = layer.kernel_size[0]
    columns = []
    with torch.no_grad():
        for c in range(channels_in):
            x = torch.zeros(k * k, channels_in, k, k) if isinstance(layer, nn.Conv2d) else \
                torch.zeros(k * k, channels_in, 1, 1)
            for t in range(k * k):
                if isinstance(layer, nn.Conv2d):  # valid conv over a k×k input: output = Σ W[:, :, tap] x[tap]
                    x[t, c, t // k, t % k] = 1.0
                else:
                    x[t, c, 0, 0] = 1.0
            y = torch.nn.functional.conv2d(x, layer.weight, None, 1, 0, 1, layer.groups) \
                if isinstance(layer, nn.Conv2d) else \
                torch.nn.functional.conv_transpose2d(x, layer.weight, None, 1, 0, 0, layer.groups)
            if isinstance(layer, nn.Conv2d):
                columns.append(y[:, :, 0, 0])  # (taps, C_out)
            else:
                columns.append(torch.stack([y[t, :, t // k, t % k] for t in range(k * k)]))
    return torch.stack(columns, -1)  # (taps, C_out, C_in)


def test_fire_treats_grouped_depthwise_and_transposed_convs_per_group_per_tap():
    from model_zoo import ConvZoo
    from plasticity_callbacks.ops.fire import apply_fire

    torch.manual_seed(0)
    model = ConvZoo()
    apply_fire(model, options=FIREOptions(method="svd"))
    for name in ("grouped", "depthwise", "up", "up_grouped"):
        layer = getattr(model, name)
        c_in = layer.in_channels
        taps = _operator_taps(layer, c_in)
        g, c_out = layer.groups, layer.out_channels
        og, ig = c_out // g, c_in // g
        for group in range(g):
            block = taps[:, group * og:(group + 1) * og, group * ig:(group + 1) * ig]
            off = taps[:, group * og:(group + 1) * og].clone()
            off[:, :, group * ig:(group + 1) * ig] = 0
            assert off.abs().max() == 0  # the operator is block-diagonal over groups
            scale = math.sqrt(og / ig) / taps.shape[0]
            s = torch.linalg.svdvals(block.double())
            torch.testing.assert_close(s, torch.full_like(s, scale), rtol=1e-4, atol=1e-6, msg=f"{name}: {s}")


def test_fire_treats_each_recurrent_gate_on_its_own():
    from model_zoo import Recurrent
    from plasticity_callbacks.ops.fire import apply_fire

    torch.manual_seed(0)
    model = Recurrent()
    records = apply_fire(model, options=FIREOptions(method="svd"))
    gates = {"lstm": 4, "gru": 3, "rnn": 1}
    count = 0
    for module_name, n in gates.items():
        for name, param in getattr(model, module_name).named_parameters():
            if name.startswith("weight_"):  # PyTorch stacks the gates by rows: (W_i | W_f | W_g | W_o)
                for gate in param.detach().chunk(n):
                    _scaled_isometry(gate, f"{module_name}.{name}")
                    count += 1
    assert len(records) == count


class TwoArgumentAttention(nn.Module):
    """A fused per-head QKV whose forward needs a mask argument, so no probe can run it."""

    def __init__(self):
        super().__init__()
        self.num_heads = 4
        self.qkv = nn.Linear(16, 48, bias=False)
        self.proj = nn.Linear(16, 16)

    def forward(self, x, mask):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 4, 12).transpose(1, 2).chunk(3, dim=-1)  # [heads, 3, head_dim]
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(y.transpose(1, 2).reshape(B, T, 16))


class MaskedModel(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.attn, self.head = TwoArgumentAttention(), nn.Linear(16, 3)

    def training_step(self, batch, batch_idx):
        x, y = batch
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()
        return torch.nn.functional.cross_entropy(self.head(self.attn(x, mask).mean(1)), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def train_dataloader(self):
        data = torch.utils.data.TensorDataset(torch.randn(8, 4, 16), torch.randint(0, 3, (8,)))
        return torch.utils.data.DataLoader(data, batch_size=4)


def test_an_unknown_split_is_refused_by_fire_with_the_declaration_and_treated_whole_by_the_rest():
    from plasticity_callbacks.model_map import declare_plasticity, interleaved_heads

    torch.manual_seed(0)
    with pytest.raises(ValueError, match=r"interleaved_heads\(heads=4\)"):
        fit(MaskedModel(), [FIREReinit(schedule=Schedule(at_fit_start=True), options=FIREOptions(method="svd"))])
    for callback in (DASHShrink(n_batches=1, gradient_ema_weight=1.0, min_factor=0.3, shrink_bias=False),
                     AdaptiveSVDSwitch(minor_training="project", schedule=Schedule(steps=[0]), r_min=2,
                                       initial_rank=3, save_figure=False, log_per_matrix=False),
                     ShrinkPerturb(shrink=0.5, perturb=0.1, seed=1)):
        module = MaskedModel()
        before = module.attn.qkv.weight.detach().clone()
        fit(module, [callback])
        if not isinstance(callback, AdaptiveSVDSwitch):
            assert not torch.equal(module.attn.qkv.weight, before), type(callback).__name__
    module = MaskedModel()  # the suggested declaration, written by the user: FIRE acts on the forward's blocks
    # its steps call two modules, whose outputs the map cannot follow: every matrix declared
    declare_plasticity(module, fused={"attn.qkv.weight": interleaved_heads(heads=4), "attn.proj.weight": [16]})
    fit(module, [FIREReinit(schedule=Schedule(at_fit_start=True), options=FIREOptions(method="svd"))])
    for part, M in zip("qkv", _heads(module.attn.qkv.weight.detach(), 4, 3).unbind(1)):
        _scaled_isometry(M, part)


def _out_in(name: str, module: nn.Module, tensor: torch.Tensor) -> torch.Tensor:
    """A weight-shaped tensor in the operator's (out, in, *k) orientation, by PyTorch's documented layouts."""
    if isinstance(module, nn.ConvTranspose2d):  # stored (C_in, C_out/groups, *k)
        return tensor.unflatten(0, (module.groups, -1)).transpose(1, 2).flatten(0, 1)
    return tensor


@pytest.mark.parametrize("family", ["conv_zoo", "recurrent"])
def test_dash_and_adaptive_svd_act_on_grouped_transposed_and_recurrent_weights(family):
    module = Wrapped(family)
    weights = {f"model.{n}": (module.model.get_submodule(n.rsplit(".", 1)[0]), p)
               for n, p in module.model.named_parameters() if p.dim() >= 2 and not n.startswith("head")}
    first = next(iter(torch.utils.data.DataLoader(batches(family), batch_size=4)))
    module.train()
    loss_of(family, module.model, first).backward()
    grads = {n: p.grad.detach().clone() for n, (_, p) in weights.items()}
    module.zero_grad()
    before = {n: p.detach().clone() for n, (_, p) in weights.items()}
    fit(module, [DASHShrink(n_batches=1, gradient_ema_weight=1.0, min_factor=0.3, shrink_bias=False,
                            gradient_mode="train")])
    for name, (owner, param) in weights.items():
        W0, G = _out_in(name, owner, before[name]).double(), -_out_in(name, owner, grads[name]).double()
        flat_w, flat_g = (W0.flatten(2), G.flatten(2)) if W0.dim() > 2 else (W0, G)  # conv: per (out, in) slice
        factor = torch.nn.functional.cosine_similarity(flat_g, flat_w, dim=-1).clamp(0.3, 1.0)
        expected = W0 * factor.reshape(factor.shape + (1,) * (W0.dim() - factor.dim()))
        torch.testing.assert_close(_out_in(name, owner, param.detach()).double(), expected, rtol=1e-4, atol=1e-6,
                                   msg=name)

    module = Wrapped(family, lr=0.1)
    switch = AdaptiveSVDSwitch(minor_training="project", schedule=Schedule(steps=[0], every_n_steps=1),
                               thresholds={"clobber_alignment": 0.0}, r_min=1, initial_rank=1,
                               svd={"dtype": "float64"}, save_figure=False, log_per_matrix=False,
                               selection={"exclude": ["*up_grouped*"]} if "up_grouped" in str(weights) else None)
    checked = []

    class Projected(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            for m in switch.matrices:
                if m.state != "minor":
                    continue
                owner = pl_module.get_submodule(m.target.name.rsplit(".", 1)[0])
                W = _out_in(m.target.name, owner, m.target.param.detach()).double().flatten(1)
                G = _out_in(m.target.name, owner, m.target.param.grad).double().flatten(1)
                U = torch.linalg.svd(W, full_matrices=False)[0][:, -m.r:]
                assert (G - U @ (U.mT @ G)).norm() <= 1e-4 * G.norm() + 1e-12, m.target.name
                checked.append(m.target.name)

    fit(module, [switch, Projected()], steps=2)
    # every weight with a gradient (a reverse RNN's W_hh gets none from the last step's output alone)
    assert set(checked) == {n for n in weights if "up_grouped" not in n and grads[n].any()}


def test_redo_recycles_a_fused_gate_up_unit_as_one_row_of_each_half_and_its_down_column():
    module = Wrapped("phi3")
    redo = ReDoMonitor(tau=1.0, collect_every_n_steps=1, log_every_n_steps=1, schedule=Schedule(steps=[1]))
    snap = Snapshot()
    fit(module, [snap, redo], steps=2)
    mlp = module.model.model.layers[0].mlp
    [layer] = redo.layers
    assert layer.up is mlp.gate_up_proj and layer.down is mlp.down_proj and layer.width == 24
    W, W0 = mlp.gate_up_proj.weight.detach(), snap.before["model.model.layers.0.mlp.gate_up_proj.weight"]
    gate_changed, up_changed = (W != W0).any(1).chunk(2)  # the forward's chunk(2): gate rows, then up rows
    assert gate_changed.any() and torch.equal(gate_changed, up_changed)  # a unit is a row of each half
    down = mlp.down_proj.weight.detach()
    assert down[:, gate_changed].abs().sum() == 0 and down[:, ~gate_changed].abs().sum() > 0


MLP_OF = {  # (up, down) of each layout family's MLP, by module name
    "gpt_neox": ("gpt_neox.layers.0.mlp.dense_h_to_4h", "gpt_neox.layers.0.mlp.dense_4h_to_h"),
    "bloom": ("transformer.h.0.mlp.dense_h_to_4h", "transformer.h.0.mlp.dense_4h_to_h"),
    "falcon_gqa": ("transformer.h.0.mlp.dense_h_to_4h", "transformer.h.0.mlp.dense_4h_to_h"),
    "falcon_mqa": ("transformer.h.0.mlp.dense_h_to_4h", "transformer.h.0.mlp.dense_4h_to_h"),
    "bigcode_mqa": ("transformer.h.0.mlp.c_fc", "transformer.h.0.mlp.c_proj"),
    "phi3": ("model.layers.0.mlp.gate_up_proj", "model.layers.0.mlp.down_proj"),
}


@pytest.mark.parametrize("family", sorted(MLP_OF))
def test_layout_families_give_redo_their_mlp_and_every_method_the_fused_weight(family):
    from model_zoo import LAYOUT_MODELS
    from plasticity_callbacks.model_map import Selection, find_neuron_layers, select_targets

    model = LAYOUT_MODELS[family]()
    names = {id(m): n for n, m in model.named_modules()}
    assert [(names[id(layer.up)], names[id(layer.down)]) for layer in find_neuron_layers(model)] == [MLP_OF[family]]
    fused = f"{QKV_OF_FORWARD[family][0]}.weight"
    attention = {t.name for t in select_targets(model, Selection(scope="attention"))}
    mlp = {t.name for t in select_targets(model, Selection(scope="mlp"))}
    assert fused in attention and {f"{n}.weight" for n in MLP_OF[family]} <= mlp and not attention & mlp


def test_dash_shrinks_a_probed_fused_qkv_row_by_row():
    module = Wrapped("falcon_gqa")
    name = "model.transformer.h.0.self_attention.query_key_value.weight"
    first = next(iter(torch.utils.data.DataLoader(batches("falcon_gqa"), batch_size=4)))
    module.train()
    loss_of("falcon_gqa", module.model, first).backward()
    param = dict(module.named_parameters())[name]
    W0, G = param.detach().clone().double(), -param.grad.detach().clone().double()
    module.zero_grad()
    fit(module, [DASHShrink(n_batches=1, gradient_ema_weight=1.0, min_factor=0.3, shrink_bias=False,
                            gradient_mode="train")])
    factor = torch.nn.functional.cosine_similarity(G, W0, dim=-1).clamp(0.3, 1.0)
    torch.testing.assert_close(dict(module.named_parameters())[name].detach().double(), W0 * factor[:, None],
                               rtol=1e-4, atol=1e-6)


def test_continual_backprop_replaces_a_fused_gate_up_unit_in_both_halves():
    from plasticity_callbacks.callbacks.continual_backprop import ContinualBackprop

    module = Wrapped("phi3")
    callback = ContinualBackprop(replacement_rate=0.3, maturity_threshold=2, decay_rate=0.9, init="default")
    snap = Snapshot()
    fit(module, [snap, callback], steps=3)
    [layer], [stats] = callback.layers, callback.stats
    new = stats["age"] == 0
    assert new.any() and not new.all()
    W, W0 = layer.up.weight.detach(), snap.before["model.model.layers.0.mlp.gate_up_proj.weight"]
    gate_changed, up_changed = (W != W0).any(1).chunk(2)  # the forward's chunk(2): gate rows, then up rows
    assert torch.equal(gate_changed, new) and torch.equal(up_changed, new)
    assert layer.down.weight.detach()[:, new].abs().sum() == 0
