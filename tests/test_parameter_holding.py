"""Parameters as users hold them: frozen, adapted by PEFT LoRA, parametrized, initialized by the model's own code.

Every check reads the raw parameters after a fit with SGD at lr 0, so every change is the callback's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrizations
from torch.utils.data import DataLoader, TensorDataset

from plasticity_callbacks.callbacks.continual_backprop import ContinualBackprop
from plasticity_callbacks.callbacks.dash import DASHShrink
from plasticity_callbacks.callbacks.fire import FIREReinit
from plasticity_callbacks.callbacks.full_reset import FullReset
from plasticity_callbacks.callbacks.redo import ReDoMonitor
from plasticity_callbacks.callbacks.schedule import Schedule
from plasticity_callbacks.callbacks.shrink_perturb import ShrinkPerturb
from plasticity_callbacks.model_map import coverage_report, select_targets

from helpers import fit


class Lit(L.LightningModule):
    """Any model under Lightning, SGD at lr 0: a regression on random inputs (or next-token for token models)."""

    def __init__(self, model: nn.Module, inputs: torch.Tensor, loss=None):
        super().__init__()
        self.model, self.inputs = model, inputs
        self.loss = loss or (lambda out, x: out.float().pow(2).mean())

    def training_step(self, batch, batch_idx):
        return self.loss(self.model(batch[0]), batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.0)

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.inputs), batch_size=4)


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_untouched(model: nn.Module, before: dict[str, torch.Tensor], names) -> None:
    for name in names:
        assert torch.equal(dict(model.named_parameters())[name], before[name]), name


def singular_values(matrix: torch.Tensor) -> torch.Tensor:
    return torch.linalg.svdvals(matrix.detach().double())


class MLP(nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(8, width), nn.Linear(width, width), nn.Linear(width, 3)

    def forward(self, x):
        return self.head(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def inputs(d: int = 8, n: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------- frozen, no PEFT
CALLBACKS = {
    "fire": lambda: FIREReinit(),
    "dash": lambda: DASHShrink(n_batches=2),
    "shrink_perturb": lambda: ShrinkPerturb(shrink=0.5, perturb=0.5, seed=5),  # not the seed the model was built by
    "full_reset": lambda: FullReset(seed=5),
    "redo": lambda: ReDoMonitor(tau=1.0, collect_every_n_steps=1, log_every_n_steps=1, init="model",
                                schedule=Schedule(every_n_steps=1)),
    "continual_backprop": lambda: ContinualBackprop(replacement_rate=1.0, maturity_threshold=0),
}


class Deep(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return self.head(torch.relu(self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))))


@pytest.mark.parametrize("method", sorted(CALLBACKS))
def test_a_frozen_layer_is_left_bit_identical_by_every_callback(method):
    torch.manual_seed(0)
    model = Deep()
    model.fc2.requires_grad_(False)  # the down of fc1's units and the up of its own
    before = snapshot(model)
    fit(Lit(model, inputs()), CALLBACKS[method](), steps=3)
    assert_untouched(model, before, ["fc2.weight", "fc2.bias"])  # the failure this catches: changed by each
    changed = [n for n in ("fc1.weight", "fc3.weight") if not torch.equal(dict(model.named_parameters())[n], before[n])]
    assert changed, f"{method} changed nothing: the frozen check must not silence the method"


def test_a_frozen_weight_named_by_include_is_treated_and_listed_as_frozen():
    torch.manual_seed(0)
    model = MLP()
    model.fc2.weight.requires_grad_(False)
    assert [t.name for t in select_targets(model)] == ["fc1.weight"]
    assert [t.name for t in select_targets(model, {"include": ["fc2.*"]})] == ["fc2.weight"]
    table = coverage_report(model)
    assert "fc2.weight (16, 16) frozen (requires_grad=False" in table
    fit(Lit(model, inputs()), FIREReinit(selection={"include": ["*fc2.weight"]}))
    s = singular_values(model.fc2.weight)
    torch.testing.assert_close(s / s[0], torch.ones_like(s), atol=1e-4, rtol=0)  # an isometry (times FIRE's scale)


def test_dash_leaves_a_weight_without_gradient_as_it_is():
    torch.manual_seed(0)
    model = MLP()
    model.unused = nn.Linear(8, 8)  # trainable, never in the forward: no gradient, no direction
    model.output_head_name = "head"  # the last Linear registered is no longer the head
    before = snapshot(model)
    fit(Lit(model, inputs()), DASHShrink(n_batches=2, shrink_bias=False))
    assert torch.equal(model.unused.weight, before["unused.weight"])  # the failure this catches: every row × 0.3
    assert not torch.equal(model.fc1.weight, before["fc1.weight"])


# ---------------------------------------------------------------------------------------------- PEFT LoRA
def lora_model(width: int = 64, r: int = 8):
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model = peft.get_peft_model(MLP(width), peft.LoraConfig(r=r, lora_alpha=r, target_modules=["fc1", "fc2"]))
    with torch.no_grad():  # as after some training: B no longer zero
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return model


def frozen_names(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if not p.requires_grad]


def lora_names(model: nn.Module, part: str) -> list[str]:
    return [n for n, _ in model.named_parameters() if f"lora_{part}" in n]


@pytest.mark.parametrize("method", ["fire", "dash", "shrink_perturb", "full_reset"])
def test_lora_base_and_head_stay_bit_identical(method):
    model = lora_model()
    before = snapshot(model)
    fit(Lit(model, inputs()), CALLBACKS[method]())
    frozen = frozen_names(model)
    assert len(frozen) == 6  # fc1, fc2 base weight and bias, the head's weight and bias
    assert_untouched(model, before, frozen)  # the failure this catches: DASH ×0.3, FIRE polar factors, S&P a fresh head
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters() if "lora_" in n)


def test_lora_adapters_are_redrawn_by_peft_init():
    model = lora_model()
    params = dict(model.named_parameters())
    B_before = {n: params[n].detach().clone() for n in lora_names(model, "B")}
    fit(Lit(model, inputs()), ShrinkPerturb(shrink=0.5, perturb=0.3))
    for name, value in B_before.items():  # PEFT's fresh B is zeros: S&P only shrinks it
        torch.testing.assert_close(params[name].detach(), 0.5 * value, rtol=0, atol=0)
    fit(Lit(model, inputs()), FullReset(seed=3))
    for name in lora_names(model, "B"):
        assert torch.count_nonzero(params[name]) == 0  # the failure this catches: Linear's kaiming draw
    for name in lora_names(model, "A"):  # kaiming_uniform(a=√5): U(±1/√fan_in), std 1/√(3·fan_in)
        fan_in = params[name].shape[1]
        assert params[name].std().item() == pytest.approx(1 / math.sqrt(3 * fan_in), rel=0.1)
    x = inputs(seed=1)
    with model.disable_adapter():
        base = model(x)
    torch.testing.assert_close(model(x), base)  # B = 0: the adapted model is its base again


def test_lora_coverage_names_adapters_and_frozen_base():
    model = lora_model()
    table = coverage_report(model)
    assert "fc2.lora_A.default.weight (8, 64) role=mlp whole, adapter (LoRA A)" in table
    assert "adapter (LoRA B); fresh draw: PEFT LoRA init" in table
    assert "fc1.base_layer.weight (64, 8) frozen (LoRA base)" in table
    assert "head.weight (3, 64) frozen" in table


def test_redo_and_cbp_find_no_units_to_recycle_in_a_lora_model():
    model = lora_model()
    for callback in (CALLBACKS["redo"](), CALLBACKS["continual_backprop"]()):
        with pytest.raises(ValueError, match="no (neuron|hidden-unit) layers"):
            fit(Lit(model, inputs()), callback)


# ---------------------------------------------------------------------------------------------- parametrizations
PARAMETRIZED = {
    "weight_norm": (parametrizations.weight_norm, "weight norm"),
    "spectral_norm": (parametrizations.spectral_norm, "spectral norm"),
    "orthogonal": (parametrizations.orthogonal, "orthogonal"),
}


def parametrized_mlp(kind: str) -> Deep:
    torch.manual_seed(0)
    model = Deep()
    PARAMETRIZED[kind][0](model.fc2)
    return model


def originals(model: Deep) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.fc2.parametrizations.weight.named_parameters()}


@pytest.mark.parametrize("kind", sorted(PARAMETRIZED))
def test_parametrized_weight_is_named_in_coverage_with_what_each_method_does(kind):
    model = parametrized_mlp(kind)
    table = coverage_report(model)  # the failure this catches: AttributeError
    assert "fc2.parametrizations.weight.original" in table and f"parametrized ({PARAMETRIZED[kind][1]})" in table
    assert [t.name for t in select_targets(model)] == ["fc1.weight", "fc2.weight", "fc3.weight"]
    kept = originals(model)  # DASHShrink: weight norm through g, the others refused by name (tests/test_parametrized)
    if kind == "weight_norm":
        fit(Lit(model, inputs()), CALLBACKS["dash"]())
        shrunk = originals(model)["original0"] / kept["original0"]  # each row of g·v/‖v‖ by its factor
        assert torch.equal(originals(model)["original1"], kept["original1"])
        assert (shrunk <= 1).all() and (shrunk < 1).any()
        return
    with pytest.warns(UserWarning, match=rf"leaves alone model.fc2.weight \({PARAMETRIZED[kind][1]}: "):
        fit(Lit(model, inputs()), CALLBACKS["dash"]())
    for name, value in originals(model).items():
        assert torch.equal(value, kept[name]), name


@pytest.mark.parametrize("kind", sorted(PARAMETRIZED))
def test_redo_leaves_parametrized_units_alone_and_says_so(kind):
    model = parametrized_mlp(kind)
    kept = originals(model)
    with pytest.warns(UserWarning, match=r"leave alone the units of"):
        fit(Lit(model, inputs()), CALLBACKS["redo"](), steps=2)
    for name, value in originals(model).items():
        assert torch.equal(value, kept[name]), name


@pytest.mark.parametrize("kind", ["weight_norm", "spectral_norm"])
def test_full_reset_draws_a_parametrized_weight_through_its_parametrization(kind):
    model = parametrized_mlp(kind)
    kept = originals(model)
    fit(Lit(model, inputs()), FullReset(seed=7))  # the failure this catches: AttributeError (delta) or original0/1 skipped
    fresh = originals(model)
    v = fresh["original1" if kind == "weight_norm" else "original"]  # a fresh Linear weight: U(±1/√fan_in)
    assert not torch.equal(v, kept["original1" if kind == "weight_norm" else "original"])
    assert v.std().item() == pytest.approx(1 / math.sqrt(3 * 16), rel=0.2) and v.abs().max() <= 0.25
    if kind == "weight_norm":  # as weight_norm builds it from a weight v: g = ‖v‖ per row
        torch.testing.assert_close(fresh["original0"], v.norm(dim=1, keepdim=True))


def test_shrink_perturb_refuses_an_orthogonal_weight_by_name():
    model = parametrized_mlp("orthogonal")
    with pytest.raises(ValueError, match=r"cannot treat model.fc2.weight: .*orthogonal.* exclude it: "
                                         r"ShrinkPerturb\(selection=\{'exclude': \['model.fc2.parametrizations"):
        fit(Lit(model, inputs()), ShrinkPerturb(seed=5))
    kept = originals(model)
    before = model.fc2.weight.detach().clone()
    fit(Lit(model, inputs()), ShrinkPerturb(seed=5, selection={"exclude": ["*fc2.parametrizations.*"]}))
    assert torch.equal(originals(model)["original"], kept["original"])
    torch.testing.assert_close(model.fc2.weight.detach(), before)


# ---------------------------------------------------------------------------------------------- the model's own init
@dataclass
class NanoConfig:
    block_size: int = 8
    vocab_size: int = 64
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.n_head = config.n_head

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class NanoMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(config.n_embd), CausalSelfAttention(config)
        self.ln_2, self.mlp = nn.LayerNorm(config.n_embd), NanoMLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """nanoGPT's model.py, shortened: ``self.apply(self._init_weights)``, then c_proj scaled by 1/√(2·n_layer)."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd), wpe=nn.Embedding(config.block_size, config.n_embd),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]), ln_f=nn.LayerNorm(config.n_embd)))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx):
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(idx.shape[1]))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))  # (B, T, vocab)


def nano_std(name: str) -> float:
    return 0.02 / math.sqrt(4) if name.endswith("c_proj.weight") else 0.02


def test_full_reset_draws_nanogpt_by_its_own_init():
    torch.manual_seed(0)
    model = NanoGPT(NanoConfig())
    with torch.no_grad():  # as after training: far from the init
        for p in model.parameters():
            p.mul_(3.0).add_(0.1)
    tokens = torch.randint(0, 64, (16, 8), generator=torch.Generator().manual_seed(0))
    fit(Lit(model, tokens), FullReset(seed=1))
    for name, p in model.named_parameters():
        if p.dim() == 2:  # the failure this catches: c_proj 0.051 and c_fc 0.10 (PyTorch's Linear default), not 0.010 and 0.020
            assert p.std().item() == pytest.approx(nano_std(name), rel=0.1), name
            assert abs(p.mean().item()) < 0.2 * nano_std(name), name
        elif name.endswith("bias"):
            assert torch.count_nonzero(p) == 0, name
    assert model.transformer.wte.weight is model.lm_head.weight  # still tied


def test_shrink_perturb_on_nanogpt_adds_a_fresh_draw_of_its_own_scale():
    torch.manual_seed(0)
    model = NanoGPT(NanoConfig())
    before = snapshot(model)
    tokens = torch.randint(0, 64, (16, 8), generator=torch.Generator().manual_seed(0))
    fit(Lit(model, tokens), ShrinkPerturb(shrink=0.5, perturb=1.0, selection={"include": ["*c_proj.weight"]}))
    for name, p in model.named_parameters():
        if name.endswith("c_proj.weight"):  # θ − 0.5·θ_before is the fresh draw
            assert (p - 0.5 * before[name]).std().item() == pytest.approx(0.01, rel=0.1), name
        else:
            assert torch.equal(p, before[name]), name


def test_full_reset_draws_nn_transformer_by_its_xavier_pass():
    torch.manual_seed(0)
    model = nn.Transformer(d_model=32, nhead=2, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=64,
                           batch_first=True)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)
    module = Lit(model, torch.randn(16, 5, 32, generator=torch.Generator().manual_seed(0)),
                 loss=lambda out, x: out.pow(2).mean())
    module.model = _SelfTransformer(model)
    fit(module, FullReset(seed=2))
    for name, p in model.named_parameters():
        if p.dim() == 2:  # xavier_uniform: std √(2 / (fan_in + fan_out)); the failure this catches: linear1/2 and out_proj kaiming
            assert p.std().item() == pytest.approx(math.sqrt(2 / sum(p.shape)), rel=0.12), name


class _SelfTransformer(nn.Module):
    def __init__(self, transformer):
        super().__init__()
        self.transformer = transformer

    def forward(self, x):
        return self.transformer(x, x)


def test_coverage_names_the_init_code_of_each_fresh_draw():
    table = coverage_report(NanoGPT(NanoConfig()))
    assert "c_proj.weight" in table and "fresh draw: NanoGPT(config), rebuilt" in table
    mha = coverage_report(nn.Sequential(nn.MultiheadAttention(16, 2, kdim=8, vdim=12), nn.Linear(16, 2)))
    assert "0.q_proj_weight (16, 16)" in mha and "fresh draw: MultiheadAttention._reset_parameters" in mha
    assert "0.out_proj.weight (16, 16)" in mha and "fresh draw: NonDynamicallyQuantizableLinear.reset_parameters" in mha


# ---------------------------------------------------------------------------------------------- MHA, LSTM
class Attend(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 2, kdim=8, vdim=12, batch_first=True)
        self.head = nn.Linear(16, 2)

    def forward(self, x):  # (B, T, 16) queries over keys/values from x's first 8 / 12 features
        return self.head(self.attn(x, x[..., :8], x[..., :12])[0])


def test_fire_on_mha_with_kdim_vdim_treats_each_projection_and_leaves_a_frozen_one():
    torch.manual_seed(0)
    model = Attend()
    model.attn.k_proj_weight.requires_grad_(False)
    before = snapshot(model)
    fit(Lit(model, torch.randn(8, 4, 16, generator=torch.Generator().manual_seed(0))), FIREReinit())
    assert torch.equal(model.attn.k_proj_weight, before["attn.k_proj_weight"])  # the failure this catches: orthogonalized
    for name in ("q_proj_weight", "v_proj_weight", "out_proj.weight"):
        s = singular_values(model.attn.get_parameter(name))
        torch.testing.assert_close(s / s[0], torch.ones_like(s), atol=1e-4, rtol=0)


class Recurrent(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(6, 8, proj_size=4, batch_first=True)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.lstm(x)[0])


def test_lstm_with_proj_size_fire_per_gate_and_fresh_draw_of_its_own_scale():
    torch.manual_seed(0)
    model = Recurrent()
    x = torch.randn(8, 5, 6, generator=torch.Generator().manual_seed(0))
    fit(Lit(model, x), FIREReinit())
    for name in ("weight_ih_l0", "weight_hh_l0"):
        for gate in model.lstm.get_parameter(name).detach().chunk(4):  # i, f, g, o: each its own isometry
            s = singular_values(gate)
            torch.testing.assert_close(s / s[0], torch.ones_like(s), atol=1e-4, rtol=0)
    s = singular_values(model.lstm.weight_hr_l0)
    torch.testing.assert_close(s / s[0], torch.ones_like(s), atol=1e-4, rtol=0)
    model.lstm.weight_hr_l0.requires_grad_(False)
    kept = model.lstm.weight_hr_l0.detach().clone()
    fit(Lit(model, x), FullReset(seed=4))
    assert torch.equal(model.lstm.weight_hr_l0, kept)
    bound = 1 / math.sqrt(8)  # LSTM.reset_parameters: U(±1/√hidden)
    assert model.lstm.weight_ih_l0.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.15)
    assert model.lstm.weight_ih_l0.abs().max().item() <= bound


def test_redo_recycles_nanogpt_rows_by_its_own_init():
    torch.manual_seed(0)
    model = NanoGPT(NanoConfig())
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(5.0)  # as after training: far from the init scale
    before = snapshot(model)
    tokens = torch.randint(0, 64, (16, 8), generator=torch.Generator().manual_seed(0))
    mlp = "model.transformer.h.0.mlp"
    fit(Lit(model, tokens), ReDoMonitor(tau=1.0, collect_every_n_steps=1, log_every_n_steps=1, init="model",
                                        layer_map={"mlp0": (f"{mlp}.c_fc", f"{mlp}.c_proj")},
                                        schedule=Schedule(steps=[1])), steps=2)
    weight = model.transformer.h[0].mlp.c_fc.weight.detach()
    recycled = (weight != before["transformer.h.0.mlp.c_fc.weight"]).any(dim=1)
    assert 16 <= int(recycled.sum()) < 128
    assert weight[recycled].std().item() == pytest.approx(0.02, rel=0.15)  # the failure this catches: Linear's default, 0.10


class BareParameter(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.scale = nn.Linear(8, 8), nn.Parameter(torch.ones(8, 8))

    def forward(self, x):
        return self.fc(x) @ self.scale


def test_full_reset_names_a_parameter_no_init_reaches_and_takes_the_fix_it_suggests():
    torch.manual_seed(0)
    model = BareParameter()
    fix = r"FullReset\(selection=\{'exclude': \['model.scale'\]\}\)"
    with pytest.raises(RuntimeError, match=r"\['model.scale'\].*" + fix):
        fit(Lit(model, inputs()), FullReset(seed=5))
    fc = model.fc.weight.detach().clone()
    fit(Lit(model, inputs()), FullReset(seed=5, selection={"exclude": ["model.scale"]}))
    assert torch.equal(model.scale, torch.ones(8, 8)) and not torch.equal(model.fc.weight, fc)


def test_lora_on_a_hugging_face_model_draws_adapters_by_peft_not_by_hugging_face():
    peft = pytest.importorskip("peft")
    from model_zoo import gpt2

    torch.manual_seed(0)
    model = peft.get_peft_model(gpt2(), peft.LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.5)
    before = snapshot(model)
    tokens = torch.randint(1, 32, (8, 6), generator=torch.Generator().manual_seed(0))
    fit(Lit(model, tokens, loss=lambda out, x: out.logits.float().pow(2).mean()), FullReset(seed=5))
    assert_untouched(model, before, frozen_names(model))
    for name, p in model.named_parameters():
        if "lora_B" in name:  # Hugging Face's _init_weights would draw N(0, 0.02)
            assert torch.count_nonzero(p) == 0, name
        elif "lora_A" in name:
            assert p.std().item() == pytest.approx(1 / math.sqrt(3 * p.shape[1]), rel=0.25), name


def test_the_docs_example_runs_as_written(capsys):
    pytest.importorskip("peft")
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "parameters.md").read_text()
    (snippet,) = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    exec(compile(snippet, "docs/parameters.md", "exec"), {"__name__": "docs_example"})
    printed = capsys.readouterr().out
    for line in re.findall(r"^# {3}(.*?)(?: \.\.\.)?$", snippet, flags=re.M):  # the table lines the docs quote
        assert line.rstrip(" .") in printed, line


def test_a_weight_whose_gradient_a_tap_computes_is_not_taken_for_frozen():
    from plasticity_callbacks.ops.minor_gradient import GradientTap

    torch.manual_seed(0)
    model = MLP()
    U = torch.linalg.qr(torch.randn(16, 4))[0]  # (d_out, r) orthonormal columns
    tap = GradientTap(model.fc1.weight, model.fc1, transposed=False)
    tap.install(U, checked=True)  # AdaptiveSVD's projection: requires_grad off, the tap gives the gradient
    assert not model.fc1.weight.requires_grad
    assert [t.name for t in select_targets(model)] == ["fc1.weight", "fc2.weight"]
    tap.remove()
    model.fc1.weight.requires_grad_(False)  # now the user froze it
    assert [t.name for t in select_targets(model)] == ["fc2.weight"]
