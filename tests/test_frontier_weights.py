"""FIRE, DASH, AdaptiveSVD and WeightClip on the frontier families (issue 32), checked from the raw parameters.

Every true block is written out here from each family's own forward code (``transformers`` 5.x):
Mixtral/Qwen3-MoE/DeepSeek/Jamba experts compute ``F.linear(x, gate_up_proj[e]).chunk(2)`` (contiguous,
``(out, in)``), GPT-OSS experts ``x @ gate_up_proj[e]`` then ``[..., ::2]``/``[..., 1::2]`` (interleaved,
``(in, out)``); Mamba's ``in_proj`` is ``[x | z]`` and ``x_proj`` ``[dt | B | C]``; Mamba-2's ``in_proj`` is
``[z | x | B | C | dt]``; DeepSeek's ``kv_b_proj`` is per head ``[k_nope | v]`` and ``kv_a_proj_with_mqa``
``[latent | rope key]``; ModernBERT's ``Wi`` is ``chunk(2)``. The expert split is also checked against the
experts module's own forward, so a wrong hand split fails here before any callback is judged.
"""
from __future__ import annotations

import math

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from helpers import fit
from model_zoo import FRONTIER_MODELS, Wrapped, batches, loss_of
from plasticity_callbacks.callbacks.adaptive_svd import AdaptiveSVDSwitch
from plasticity_callbacks.callbacks.dash import DASHShrink
from plasticity_callbacks.callbacks.weight_clip import WeightClip
from plasticity_callbacks.functional.isometry import FIREOptions
from plasticity_callbacks.model_map import (Interleaved, coverage_report, declare_plasticity, select_targets,
                                            stacked_matrices)
from plasticity_callbacks.ops.fire import apply_fire

pytest.importorskip("transformers")
MOE = ("mixtral", "qwen3_moe", "gpt_oss", "deepseek_v3", "jamba")


def experts_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(getattr(m, "gate_up_proj", None), nn.Parameter)
            and m.gate_up_proj.dim() == 3]


def expert_matrices(family: str, experts: nn.Module, e: int) -> dict[str, torch.Tensor]:
    """Expert ``e``'s gate, up and down matrices in ``(out, in)`` orientation, as its family's forward uses them."""
    if family == "gpt_oss":  # x @ W[e], gate = [..., ::2], up = [..., 1::2]; x @ down[e]
        gate_up = experts.gate_up_proj[e]  # (H, 2I)
        return {"gate": gate_up[:, ::2].mT, "up": gate_up[:, 1::2].mT, "down": experts.down_proj[e].mT}
    gate_up = experts.gate_up_proj[e]  # (2I, H): F.linear(x, W[e]).chunk(2)
    half = gate_up.shape[0] // 2
    return {"gate": gate_up[:half], "up": gate_up[half:], "down": experts.down_proj[e]}


def by_hand(family: str, experts: nn.Module, e: int, x: torch.Tensor) -> torch.Tensor:
    m = expert_matrices(family, experts, e)
    if family == "gpt_oss":
        bias = experts.gate_up_proj_bias[e]
        gate = (x @ m["gate"].mT + bias[::2]).clamp(max=experts.limit)
        up = (x @ m["up"].mT + bias[1::2]).clamp(-experts.limit, experts.limit)
        glu = gate * torch.sigmoid(gate * experts.alpha)
        return ((up + 1) * glu) @ m["down"].mT + experts.down_proj_bias[e]
    return F.linear(experts.act_fn(F.linear(x, m["gate"])) * F.linear(x, m["up"]), m["down"])


def off_isometry(matrix: torch.Tensor) -> float:
    """max |σ/scale − 1| with FIRE's default scale √(out/in)."""
    sigma = torch.linalg.svdvals(matrix.detach().double())
    return float((sigma / math.sqrt(matrix.shape[0] / matrix.shape[1]) - 1).abs().max())


def true_blocks(family: str, model: nn.Module) -> dict[str, torch.Tensor]:
    """Every matrix FIRE must make an isometry, by the family's own code, ``(out, in)``."""
    blocks = {}
    for experts in experts_modules(model):
        for e in range(experts.gate_up_proj.shape[0]):
            for part, matrix in expert_matrices(family, experts, e).items():
                blocks[f"{id(experts)}.expert{e}.{part}"] = matrix
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("gate", "router") and isinstance(getattr(module, "weight", None), nn.Parameter) \
                and not isinstance(module, nn.Linear):
            blocks[f"{name}.router"] = module.weight  # F.linear(x, weight): (out, in)
        if hasattr(module, "A_log") and hasattr(module, "in_proj"):  # a state-space mixer
            W, inner = module.in_proj.weight, module.intermediate_size
            if hasattr(module, "x_proj"):  # Mamba: in_proj [x | z], x_proj [dt | B | C]
                blocks.update({f"{name}.x": W[:inner], f"{name}.z": W[inner:]})
                rank, state = module.time_step_rank, module.ssm_state_size
                X = module.x_proj.weight
                blocks.update({f"{name}.dt": X[:rank], f"{name}.B": X[rank:rank + state],
                               f"{name}.C": X[rank + state:], f"{name}.dt_proj": module.dt_proj.weight})
            else:  # Mamba-2: in_proj [z | x | B | C | dt]
                bc = module.n_groups * module.ssm_state_size
                cuts = [inner, inner, bc, bc, module.num_heads]
                assert sum(cuts) == W.shape[0]
                for part, rows in zip(("z", "x", "B", "C", "dt"), W.split(cuts)):
                    blocks[f"{name}.{part}"] = rows
            blocks[f"{name}.out_proj"] = module.out_proj.weight
        if hasattr(module, "kv_b_proj"):  # latent attention
            heads, nope, v = module.num_heads, module.qk_nope_head_dim, module.v_head_dim
            kv_b = module.kv_b_proj.weight.view(heads, nope + v, -1)  # per head [k_nope | v]
            blocks.update({f"{name}.k_nope": kv_b[:, :nope].flatten(0, 1), f"{name}.v": kv_b[:, nope:].flatten(0, 1)})
            kv_a, rank = module.kv_a_proj_with_mqa.weight, module.kv_lora_rank
            blocks.update({f"{name}.latent": kv_a[:rank], f"{name}.rope_key": kv_a[rank:],
                           f"{name}.q_b": module.q_b_proj.weight})  # all query: per head [nope | rope]
        if leaf == "mlp" and hasattr(module, "Wi"):  # ModernBERT: input, gate = Wi(x).chunk(2)
            half = module.Wi.weight.shape[0] // 2
            blocks.update({f"{name}.input": module.Wi.weight[:half], f"{name}.gate": module.Wi.weight[half:]})
    return blocks


def left_alone(model: nn.Module) -> dict[str, torch.Tensor]:
    """A state-space layer's own parameters and depthwise conv: never changed by default."""
    return {n: p.detach().clone() for n, p in model.named_parameters()
            if n.endswith(("conv1d.weight", "conv1d.bias", "A_log", ".D", "dt_bias"))}


def check_hand_split(family: str, model: nn.Module) -> None:
    """The hand split of each expert reproduces the experts module's own forward (on a copy, with every
    expert parameter redrawn so that biases count too)."""
    import copy

    experts = copy.deepcopy(experts_modules(model)[0])
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.3)
        x = torch.randn(5, experts.gate_up_proj.shape[-1 if family != "gpt_oss" else 1])
        for e in range(experts.gate_up_proj.shape[0]):
            ours = experts(x, torch.full((5, 1), e), torch.ones(5, 1))
            torch.testing.assert_close(ours, by_hand(family, experts, e, x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", sorted(FRONTIER_MODELS))
def test_fire_makes_every_true_block_an_isometry_and_leaves_ssm_parameters(family):
    torch.manual_seed(0)
    model = FRONTIER_MODELS[family]()
    if family in MOE:
        check_hand_split(family, model)
    before = left_alone(model)
    blocks = true_blocks(family, model)
    assert blocks
    assert max(off_isometry(b) for b in blocks.values()) > 0.1  # random init: the check below can fail
    apply_fire(model, None, FIREOptions(method="svd"))
    off = {name: off_isometry(b) for name, b in true_blocks(family, model).items()}
    assert max(off.values()) < 1e-4, {n: round(v, 3) for n, v in off.items() if v >= 1e-4}
    for name, value in before.items():
        assert torch.equal(dict(model.named_parameters())[name], value), name


def test_fire_callback_treats_experts_and_routers_in_a_fit():
    from plasticity_callbacks.callbacks.fire import FIREReinit
    from plasticity_callbacks.callbacks.schedule import Schedule

    module = Wrapped("gpt_oss")
    fit(module, [FIREReinit(schedule=Schedule(at_fit_start=True), options=FIREOptions(method="svd"))])
    off = {name: off_isometry(b) for name, b in true_blocks("gpt_oss", module.model).items()}
    assert len(off) == 4 * 3 + 1 and max(off.values()) < 1e-4


def test_latent_attention_is_read_from_the_forward_not_guessed():
    report = coverage_report(FRONTIER_MODELS["deepseek_v3"]())
    lines = {line.split()[0]: line for line in report.splitlines() if line.startswith("  ")}
    assert lines["model.layers.*.self_attn.q_b_proj.weight"].split(";")[0].endswith("whole")  # all query
    assert "k=16 rows, strided, v=24 rows, strided" in lines["model.layers.*.self_attn.kv_b_proj.weight"]
    assert "k=rows 8:10, rest=rows 0:8" in lines["model.layers.*.self_attn.kv_a_proj_with_mqa.weight"]


@pytest.mark.parametrize("family", ["mamba", "mamba2", "jamba"])
def test_coverage_names_what_a_state_space_layer_keeps(family):
    report = coverage_report(FRONTIER_MODELS[family]())
    conv = next(line for line in report.splitlines() if "conv1d.weight" in line)
    assert "depthwise causal conv1d of a state-space layer" in conv and "include=" in conv
    if family != "mamba2":  # Mamba-2's A_log is 1-D
        assert "state-space parameter (A_log)" in next(line for line in report.splitlines() if "A_log" in line)
    assert "no callback knows" not in report
    included = [t.name for t in select_targets(FRONTIER_MODELS[family](), {"include": ["*conv1d.weight"]})]
    assert len(included) == 1 and included[0].endswith("conv1d.weight")  # a name pattern brings it back


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss", "deepseek_v3"])
def test_dash_shrinks_each_expert_row_and_every_linear_map_by_its_own_factor(family):
    module = Wrapped(family)
    first = next(iter(DataLoader(batches(family), batch_size=4)))
    module.train()
    module.zero_grad()
    loss_of(family, module.model, first).backward()
    experts = experts_modules(module.model)[0]
    stacks = {n: getattr(experts, n) for n in ("gate_up_proj", "down_proj")}
    maps = {n: p for n, p in module.named_parameters()  # routers, attention and dense MLP maps: (out, in)
            if p.dim() == 2 and p.grad is not None and not n.endswith(("embed_tokens.weight", "lm_head.weight"))}
    grads = {n: p.grad.detach().clone() for n, p in {**stacks, **maps}.items()}
    before = {n: p.detach().clone() for n, p in {**stacks, **maps}.items()}
    module.zero_grad()
    fit(module, [DASHShrink(n_batches=1, gradient_ema_weight=1.0, min_factor=0.3, shrink_bias=False,
                            gradient_mode="train")])
    for name, param in {**stacks, **maps}.items():
        W0, G, W = before[name].double(), -grads[name].double(), param.detach().double()
        if family == "gpt_oss" and name in stacks:  # stored (E, in, out): a row (output neuron) is a column here
            W0, G, W = W0.mT, G.mT, W.mT
        factor = F.cosine_similarity(G, W0, dim=-1).clamp(0.3, 1.0)  # per expert, per output neuron
        torch.testing.assert_close(W, W0 * factor[..., None], rtol=1e-4, atol=1e-6, msg=name)
        assert name not in stacks or (factor < 1).any()


def test_adaptive_svd_treats_each_expert_and_refuses_a_factorized_stack_by_name_with_its_fix():
    module = Wrapped("mixtral")
    switch = AdaptiveSVDSwitch()
    switch.check_targets(None, module)
    names = [m.name for m in switch.matrices]
    assert "model.model.layers.0.mlp.experts.gate_up_proj[3]" in names  # one matrix per expert
    assert "model.model.layers.0.mlp.gate.weight" in names  # the router
    with pytest.raises(ValueError, match=r"experts\.gate_up_proj.*stacks of expert matrices.*'\*\.experts\.down_proj'"):
        AdaptiveSVDSwitch(minor_training="factorize").check_targets(None, module)
    fixed = AdaptiveSVDSwitch(minor_training="factorize",
                              selection={"exclude": ["*.experts.down_proj", "*.experts.gate_up_proj"]})
    fixed.check_targets(None, module)
    assert "model.model.layers.0.mlp.gate.weight" in [m.name for m in fixed.matrices]


class Classic(L.LightningModule):
    """nn.MultiheadAttention (fused and separate q/k/v weights), an LSTM and a GRU under WeightClip."""

    def __init__(self):
        super().__init__()
        self.fused = nn.MultiheadAttention(8, 2, batch_first=True)
        self.separate = nn.MultiheadAttention(8, 2, kdim=6, vdim=5, batch_first=True)
        self.lstm, self.gru = nn.LSTM(8, 12, batch_first=True), nn.GRU(12, 4, batch_first=True)

    def training_step(self, batch, batch_idx):
        x, k, v = batch
        h = self.fused(x, x, x)[0] + self.separate(x, k, v)[0]
        return self.gru(self.lstm(h)[0])[0].pow(2).mean() * 1e3

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1.0)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(8, 3, 8, generator=g), torch.randn(8, 3, 6, generator=g),
                                        torch.randn(8, 3, 5, generator=g)), batch_size=4)


def test_weight_clip_bounds_attention_and_recurrent_weights():
    module = Classic()
    fit(module, [WeightClip(kappa=0.5)], steps=2)
    bounds = {"fused.in_proj_weight": 8, "fused.in_proj_bias": 8, "separate.q_proj_weight": 8,
              "separate.k_proj_weight": 6, "separate.v_proj_weight": 5,
              **{f"lstm.{n}": 12 for n, _ in module.lstm.named_parameters()}}  # 1/√hidden_size
    bounds.update({f"gru.{n}": 4 for n, _ in module.gru.named_parameters()})
    params = dict(module.named_parameters())
    at_the_box = 0
    for name, fan_in in bounds.items():
        limit = 0.5 / math.sqrt(fan_in)
        top = float(params[name].abs().max())
        assert top <= limit + 1e-7, (name, top, limit)
        at_the_box += math.isclose(top, limit, rel_tol=1e-6)
    assert at_the_box >= len(bounds) // 2  # lr 1.0 pushes most of them to their box: the check can fail


KAPPA = 0.05  # below the HF init's spread (std 0.02 over fan-ins of 12 and 16): every expert matrix reaches its box


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_weight_clip_bounds_each_expert_matrix_and_router_by_its_own_fan_in(family):
    module = Wrapped(family, lr=1.0)
    fit(module, [WeightClip(kappa=KAPPA)], steps=2)
    experts = experts_modules(module.model)[0]
    at_the_box = 0
    for e in range(experts.gate_up_proj.shape[0]):
        for part, matrix in expert_matrices(family, experts, e).items():
            limit = KAPPA / math.sqrt(matrix.shape[1])  # one expert matrix's fan-in, whatever the storage
            top = float(matrix.abs().max())
            assert top <= limit + 1e-7, (e, part, top, limit)
            at_the_box += math.isclose(top, limit, rel_tol=1e-6)
    router = next(m for n, m in module.named_modules() if n.endswith(("mlp.gate", "mlp.router")))
    assert float(router.weight.abs().max()) <= KAPPA / math.sqrt(router.weight.shape[1]) + 1e-7
    assert at_the_box >= 6


def test_a_declared_stack_overrides_the_trace_and_a_wrong_one_fails_when_made():
    model = FRONTIER_MODELS["gpt_oss"]()
    name = "model.layers.0.mlp.experts.gate_up_proj"
    for bad, match in [(lambda: stacked_matrices("in_out", split=[5, 5]), "add up to 10 rows, the matrix has 24"),
                       (lambda: [12, 12], "3-D stack"), (lambda: stacked_matrices("sideways"), "stored='sideways'"),
                       (lambda: stacked_matrices("out_in", split=Interleaved(("a", "b", "c", "d", "e"))),
                        "rows do not deal out evenly to 5 parts")]:
        with pytest.raises(ValueError, match=match):
            declare_plasticity(model, fused={name: bad()})
        assert not hasattr(model, "plasticity_declaration")  # nothing stored: the model is as it was
    with pytest.raises(ValueError, match="linear_map"):
        declare_plasticity(model, fused={"model.layers.0.mlp.router.weight": stacked_matrices()})
    declare_plasticity(model, fused={name: stacked_matrices("in_out", split=[12, 12])})  # contiguous: a wrong claim
    view = next(t for t in select_targets(model) if t.name == name)
    assert [b.describe() for b in view.per_matrix] == ["block0=rows 0:12", "block1=rows 12:24"]
    declare_plasticity(model, fused={name: stacked_matrices("in_out", split=Interleaved(("gate", "up")))})
    apply_fire(model, None, FIREOptions(method="svd"))
    experts = experts_modules(model)[0]
    assert max(off_isometry(m) for e in range(4) for m in expert_matrices("gpt_oss", experts, e).values()) < 1e-4


class MinorGradients(L.Callback):
    """Checks, before each optimizer step, that every minor matrix's gradient lies in its minor left subspace."""

    def __init__(self, switch):
        self.switch, self.checked = switch, set()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        for m in self.switch.matrices:
            if m.state != "minor":
                continue
            param = m.target.param
            W = (param.mT if m.target.transposed else param).detach().double()
            G = (param.grad.mT if m.target.transposed else param.grad).double()
            U = torch.linalg.svd(W, full_matrices=False)[0][:, -m.r:]
            assert (G - U @ (U.mT @ G)).norm() <= 1e-4 * G.norm() + 1e-12, m.target.name
            self.checked.add(m.target.name)


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3", "jamba"])
def test_adaptive_svd_projects_routers_and_their_neighbours_onto_their_minor_subspace(family):
    from plasticity_callbacks.callbacks.schedule import Schedule

    module = Wrapped(family)
    switch = AdaptiveSVDSwitch(minor_training="project", schedule=Schedule(steps=[0], every_n_steps=1),
                               thresholds={"clobber_alignment": 0.0}, r_min=2, initial_rank=3,
                               svd={"dtype": "float64"}, save_figure=False, log_per_matrix=False,
                               selection={"exclude": ["*.experts.gate_up_proj", "*.experts.down_proj"]})
    probe = MinorGradients(switch)
    fit(module, [switch, probe])
    wanted = {"mixtral": ["mlp.gate.weight"], "deepseek_v3": ["mlp.gate.weight", "kv_a_proj_with_mqa.weight"],
              "jamba": ["feed_forward.router.weight", "mamba.x_proj.weight"]}[family]
    for suffix in wanted:
        assert any(name.endswith(suffix) for name in probe.checked), (suffix, sorted(probe.checked))


def test_a_bf16_model_with_wide_experts_is_read_exactly_and_left_in_bf16():
    """bf16 holds integers exactly only up to 256: 280 interleaved gate/up rows must still split right. The
    halves are wide (140 × 320), so a finer split than the forward's would also break their isometry."""
    import transformers

    config = transformers.GptOssConfig(vocab_size=40, hidden_size=320, intermediate_size=140, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=4, num_local_experts=2,
                                       num_experts_per_tok=1, layer_types=["full_attention"])
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config).to(torch.bfloat16)
    apply_fire(model, None, FIREOptions(method="svd"))
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    experts = experts_modules(model)[0]
    off = [off_isometry(m) for e in range(2) for m in expert_matrices("gpt_oss", experts, e).values()]
    assert max(off) < 0.02  # bf16 rounding of an exact isometry; a wrong split is off by far more


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm", "batched_mm"])
@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_every_experts_implementation_is_read_the_same_with_trained_biases(family, implementation):
    """transformers runs experts by a loop over ``W[e]``, one ``grouped_mm`` or a ``bmm`` of gathered experts;
    biases far from their zero init (GPT-OSS) are added in place or not: the split and orientation hold."""
    torch.manual_seed(0)
    model = FRONTIER_MODELS[family]()
    model.set_experts_implementation(implementation)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "experts" in name and "bias" in name:
                p.normal_(0, 3.0)
    check_hand_split(family, model)
    apply_fire(model, None, FIREOptions(method="svd"))
    experts = experts_modules(model)[0]
    assert max(off_isometry(m) for e in range(4) for m in expert_matrices(family, experts, e).values()) < 1e-4
