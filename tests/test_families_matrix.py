"""Families beyond the rest of the suite (issue 43), each cell checked against the family's own forward code.

Every true block below is written out from the family's ``modeling_*.py`` (``transformers`` 5.x), never read from
the model map: which rows of a fused projection its forward cuts apart, which matrices of an expert stack it applies,
and in which orientation. A cell is ``right`` (FIRE: every true block an isometry in float64, nothing else changed;
DASH: each output neuron of each true matrix scaled by the paper's clamped cosine, nothing else changed; WeightClip:
every linear map bounded by its own matrix's fan-in), ``refused`` (the callback named the weight at setup with the
``declare_plasticity`` line, and that line, applied, makes the cell right), or ``silent`` (anything else).
:func:`family_matrix` computes the table the issue note reports.
"""
from __future__ import annotations

import fnmatch
import math
import re
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from plasticity_callbacks.callbacks.weight_clip import clip_bounds
from plasticity_callbacks.functional.isometry import FIREOptions
from plasticity_callbacks import model_map
from plasticity_callbacks.ops.dash import dash_
from plasticity_callbacks.ops.fire import apply_fire

transformers = pytest.importorskip("transformers")
W, HEADS, KV = 16, 4, 2
_LM = dict(vocab_size=32, hidden_size=W, num_hidden_layers=1, num_attention_heads=HEADS, max_position_embeddings=16,
           pad_token_id=0, bos_token_id=0, eos_token_id=0)


def _hf(config: str, model: str, **fields) -> nn.Module:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return getattr(transformers, model)(getattr(transformers, config)(**fields))


def rows(weight: torch.Tensor, index) -> torch.Tensor:
    return weight[torch.as_tensor(index)]


def per_group(weight: torch.Tensor, groups: int, parts: dict[str, int]) -> dict[str, torch.Tensor]:
    """``view(..., groups, Σparts)`` then a split by ``parts``: part ``p`` is those rows of every group."""
    size, out, start = sum(parts.values()), {}, 0
    for label, n in parts.items():
        out[label] = rows(weight, [g * size + start + i for g in range(groups) for i in range(n)])
        start += n
    return out


def contiguous(weight: torch.Tensor, parts: dict[str, int]) -> dict[str, torch.Tensor]:
    return per_group(weight, 1, parts)


def experts_chunked(stack: torch.Tensor) -> dict[str, torch.Tensor]:
    """``F.linear(x, gate_up_proj[e]).chunk(2)``: (E, 2I, H), contiguous gate/up per expert."""
    half = stack.shape[1] // 2
    return {f"{e}.{part}": matrix for e in range(stack.shape[0])
            for part, matrix in (("gate", stack[e, :half]), ("up", stack[e, half:]))}


def experts_whole(stack: torch.Tensor) -> dict[str, torch.Tensor]:
    return {str(e): stack[e] for e in range(stack.shape[0])}


def whole(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """A router's bare ``weight`` (transformers 5.x): ``F.linear(x, self.weight)``."""
    return {"all": weight}


# family -> (builder, {parameter pattern: its true (out, in) blocks from the family's forward}, patterns never treated)
FAMILIES: dict[str, tuple[Callable[[], nn.Module], dict[str, Callable], tuple[str, ...]]] = {
    # DbrxAttention: Wqkv(x).clamp(±clip_qkv).split([H, kv, kv]); DbrxExperts: w1/v1/w2 stored (E·I, H) and
    # viewed (E, I, H): x @ w1[e].T, x @ v1[e].T, h @ w2[e]
    "dbrx": (lambda: _hf("DbrxConfig", "DbrxForCausalLM", vocab_size=32, d_model=W, n_heads=HEADS, n_layers=1,
                         max_seq_len=16, attn_config={"kv_n_heads": KV, "clip_qkv": 8.0, "rope_theta": 10000.0},
                         ffn_config={"ffn_hidden_size": 12, "moe_num_experts": 3, "moe_top_k": 2},
                         pad_token_id=0, bos_token_id=0, eos_token_id=0),
             {"*.Wqkv.weight": lambda w: contiguous(w, {"q": W, "k": KV * 4, "v": KV * 4}),
              "*.mlp.w1": lambda w: experts_whole(w.view(3, 12, W)),
              "*.mlp.v1": lambda w: experts_whole(w.view(3, 12, W)),
              "*.mlp.w2": lambda w: experts_whole(w.view(3, 12, W).mT)}, ()),
    # GraniteMoeExperts: F.linear(x, gate_up_proj[e]).chunk(2)
    "granitemoe": (lambda: _hf("GraniteMoeConfig", "GraniteMoeForCausalLM", intermediate_size=12,
                               num_key_value_heads=KV, num_local_experts=3, num_experts_per_tok=2, **_LM),
                   {"*.gate_up_proj": experts_chunked, "*.down_proj": experts_whole, "*.router.weight": whole}, ()),
    # OLMoE: q_norm/k_norm over all heads, experts as Mixtral
    "olmoe": (lambda: _hf("OlmoeConfig", "OlmoeForCausalLM", intermediate_size=12, num_key_value_heads=KV,
                          num_experts=3, num_experts_per_tok=2, **_LM),
              {"*.gate_up_proj": experts_chunked, "*.down_proj": experts_whole, "*.mlp.gate.weight": whole}, ()),
    # Lfm2ShortConv: in_proj(x).transpose(-1, -2).chunk(3, dim=-2) -> B, C, x; a causal depthwise conv, no A_log
    "lfm2": (lambda: _hf("Lfm2Config", "Lfm2ForCausalLM", intermediate_size=24, num_key_value_heads=KV,
                         layer_types=["conv", "full_attention"], **{**_LM, "num_hidden_layers": 2}),
             {"*.conv.in_proj.weight": lambda w: contiguous(w, {"B": W, "C": W, "x": W})}, ("*.conv.conv.weight",)),
    # T5: separate q/k/v/o, gated wi_0/wi_1 (encoder-decoder)
    "t5": (lambda: _hf("T5Config", "T5ForConditionalGeneration", vocab_size=32, d_model=W, d_kv=4, d_ff=24,
                       num_layers=1, num_decoder_layers=1, num_heads=HEADS, feed_forward_proj="gated-gelu",
                       decoder_start_token_id=0, pad_token_id=0), {}, ()),
    # BART: separate projections, encoder-decoder
    "bart": (lambda: _hf("BartConfig", "BartForConditionalGeneration", vocab_size=32, d_model=W, encoder_layers=1,
                         decoder_layers=1, encoder_attention_heads=HEADS, decoder_attention_heads=HEADS,
                         encoder_ffn_dim=24, decoder_ffn_dim=24, max_position_embeddings=16, pad_token_id=0,
                         bos_token_id=0, eos_token_id=0, decoder_start_token_id=0), {}, ()),
    # ViT: patch conv (per tap), separate projections
    "vit": (lambda: _hf("ViTConfig", "ViTForImageClassification", hidden_size=W, num_hidden_layers=1,
                        num_attention_heads=HEADS, intermediate_size=24, image_size=8, patch_size=4, num_labels=3),
            {}, ()),
    # ConvNeXt: stem/downsampling convs (per tap), a 7×7 depthwise conv (groups == channels), pointwise Linears
    "convnext": (lambda: _hf("ConvNextConfig", "ConvNextForImageClassification", num_stages=2, hidden_sizes=[8, 16],
                             depths=[1, 1], num_labels=3), {}, ("*.dwconv.weight",)),
    # Phi: partial rotary (rotate half of each head), separate q/k/v/dense
    "phi": (lambda: _hf("PhiConfig", "PhiForCausalLM", intermediate_size=24, partial_rotary_factor=0.5, **_LM), {}, ()),
    # MptAttention: Wqkv(x).chunk(3, dim=2), ALiBi
    "mpt": (lambda: _hf("MptConfig", "MptForCausalLM", vocab_size=32, d_model=W, n_heads=HEADS, n_layers=1,
                        max_seq_len=16, expansion_ratio=2, pad_token_id=0, bos_token_id=0, eos_token_id=0),
            {"*.Wqkv.weight": lambda w: contiguous(w, {"q": W, "k": W, "v": W})}, ()),
    # MiniMaxLightningAttention: act(qkv_proj(x)).reshape(..., heads, 3·hd).split(hd): [q, k, v] per head; MoE
    "minimax": (lambda: _hf("MiniMaxConfig", "MiniMaxForCausalLM", intermediate_size=12, num_key_value_heads=KV,
                            num_local_experts=3, num_experts_per_tok=2, head_dim=4, block_size=4,
                            layer_types=["linear_attention", "full_attention"], **{**_LM, "num_hidden_layers": 2}),
                {"*.qkv_proj.weight": lambda w: per_group(w, HEADS, {"q": 4, "k": 4, "v": 4}),
                 "*.gate_up_proj": experts_chunked, "*.down_proj": experts_whole, "*.mlp.gate.weight": whole}, ()),
    # BambaMixer (Mamba-2): in_proj = [gate (32) | x (32) | B (4) | C (4) | dt (4)], xBC through a depthwise conv
    "bamba": (lambda: _hf("BambaConfig", "BambaForCausalLM", intermediate_size=24, num_key_value_heads=KV,
                          attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=8, mamba_n_groups=1, mamba_d_state=4,
                          mamba_d_conv=3, mamba_expand=2, mamba_chunk_size=4, **{**_LM, "num_hidden_layers": 2}),
              {"*.mamba.in_proj.weight": lambda w: contiguous(w, {"z": 32, "x": 32, "B": 4, "C": 4, "dt": 4})},
              ("*.mamba.conv1d.weight",)),
    # Qwen3-Next: q_proj(x).view(..., heads, 2·hd).chunk(2) -> [q | gate] per head; GatedDeltaNet in_proj_qkvz per key
    # head group [q 4 | k 4 | v 8 | z 8], in_proj_ba per group [b 2 | a 2], a causal depthwise conv1d; MoE
    "qwen3_next": (lambda: _hf("Qwen3NextConfig", "Qwen3NextForCausalLM", intermediate_size=24, moe_intermediate_size=8,
                               shared_expert_intermediate_size=8, num_key_value_heads=KV, head_dim=4, num_experts=3,
                               num_experts_per_tok=2, linear_num_value_heads=4, linear_num_key_heads=2,
                               linear_key_head_dim=4, linear_value_head_dim=4, linear_conv_kernel_dim=3,
                               layer_types=["linear_attention", "full_attention"], decoder_sparse_step=1,
                               **{**_LM, "num_hidden_layers": 2}),
                   {"*.self_attn.q_proj.weight": lambda w: per_group(w, HEADS, {"q": 4, "gate": 4}),
                    "*.in_proj_qkvz.weight": lambda w: per_group(w, 2, {"q": 4, "k": 4, "v": 8, "z": 8}),
                    "*.in_proj_ba.weight": lambda w: per_group(w, 2, {"b": 2, "a": 2}),
                    "*.gate_up_proj": experts_chunked, "*.down_proj": experts_whole, "*.mlp.gate.weight": whole},
                   ("*.linear_attn.conv1d.weight",)),
    # Whisper: images of sound (mel frames) through two conv1d (per tap), separate q/k/v, an encoder-decoder: the map
    # runs it on zero mel frames its config sizes, with one decoder token
    "whisper": (lambda: _hf("WhisperConfig", "WhisperForConditionalGeneration", vocab_size=32, d_model=W,
                            encoder_layers=1, decoder_layers=1, encoder_attention_heads=HEADS,
                            decoder_attention_heads=HEADS, encoder_ffn_dim=24, decoder_ffn_dim=24, num_mel_bins=8,
                            max_source_positions=16, max_target_positions=16, pad_token_id=0, bos_token_id=0,
                            eos_token_id=0, decoder_start_token_id=0), {}, ("*proj_out*",)),
    # Swin: pixel input, shifted windows, a relative position bias table indexed (not a linear map), patch merging
    "swin": (lambda: _hf("SwinConfig", "SwinForImageClassification", image_size=16, patch_size=2, embed_dim=8,
                         depths=[1, 1], num_heads=[2, 2], window_size=2, num_labels=3), {}, ()),
}
HEAD = ("*lm_head*", "*classifier*")


def true_maps(family: str, model: nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    """``{parameter name: {block: (out, in) matrix}}`` of every linear map a method treats, from the table above:
    the family's fused and stacked weights, every other ``nn.Linear`` whole, every conv one matrix per tap."""
    _, fused, _ = FAMILIES[family]
    maps = {}
    for module_name, module in model.named_modules():
        for attr, param in module.named_parameters(recurse=False):
            name = f"{module_name}.{attr}" if module_name else attr
            pattern = next((p for p in fused if fnmatch.fnmatchcase(name, p)), None)
            if any(fnmatch.fnmatchcase(name, p) for p in (*HEAD, *FAMILIES[family][2])):
                continue
            if pattern is not None:
                maps[name] = fused[pattern](param)
            elif isinstance(module, nn.Linear) and attr == "weight":
                maps[name] = {"all": param}
            elif isinstance(module, (nn.Conv1d, nn.Conv2d)) and attr == "weight" and module.groups == 1:
                maps[name] = {f"tap{i}": param.flatten(2)[..., i] for i in range(param[0, 0].numel())}
    return maps


def off_isometry(matrix: torch.Tensor, taps: int = 1) -> float:
    """max |σ/scale − 1| with FIRE's default scale √(out/in), over the taps of a conv, in float64."""
    sigma = torch.linalg.svdvals(matrix.detach().double())
    return float((sigma / (math.sqrt(matrix.shape[0] / matrix.shape[1]) / taps) - 1).abs().max())


def _unchanged_elsewhere(model: nn.Module, before: dict[str, torch.Tensor], treated: set[str]) -> list[str]:
    return [n for n, p in model.named_parameters() if n not in treated and not torch.equal(p, before[n])]


def _declarations(message: str) -> list[str]:
    return re.findall(r"declare_plasticity\(model, fused=\{.*?\}\)(?=\s|;|$|\))", message)


def fire_cell(family: str) -> str:
    model = FAMILIES[family][0]()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    cell = "right"
    try:
        apply_fire(model, None, FIREOptions(method="svd"))
    except ValueError as err:
        fixes = _declarations(str(err))
        if not fixes:
            return f"silent (refused without a fix: {err})"
        for line in fixes:
            eval(line, {"declare_plasticity": model_map.declare_plasticity, "model": model, **vars(model_map)})
        apply_fire(model, None, FIREOptions(method="svd"))
        cell = "refused"
    maps = true_maps(family, model)
    off = {f"{n}[{b}]": off_isometry(m, len(blocks) if b.startswith("tap") else 1)
           for n, blocks in maps.items() for b, m in blocks.items()}
    bad = {k: round(v, 3) for k, v in off.items() if v > 1e-4}
    changed = _unchanged_elsewhere(model, before, set(maps))
    return cell if not bad and not changed else f"silent ({bad or ''} {changed or ''})"


def dash_cell(family: str) -> str:
    model = FAMILIES[family][0]()
    torch.manual_seed(1)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    dash_(model, min_factor=0.3, shrink_bias=False)
    params = dict(model.named_parameters())
    maps = true_maps(family, model)
    bad = []
    for name, blocks in maps.items():
        # DASH's factor is per output neuron: a row of each true (out, in) matrix; of a conv, per (out, in) kernel
        if next(iter(blocks)).startswith("tap"):
            pairs = [(before[name].flatten(2), -grads[name].flatten(2), params[name].detach().flatten(2))]
        elif next(iter(blocks)) == "all":
            pairs = [(before[name], -grads[name], params[name].detach())]
        else:
            pattern = next(p for p in FAMILIES[family][1] if fnmatch.fnmatchcase(name, p))
            split = FAMILIES[family][1][pattern]
            pairs = list(zip(split(before[name]).values(), split(-grads[name]).values(),
                             split(params[name].detach()).values()))
        for w0, g, w1 in pairs:
            factor = F.cosine_similarity(g.double(), w0.double(), dim=-1).clamp(0.3, 1.0)
            if not torch.allclose(w1.double(), w0.double() * factor[..., None], rtol=1e-4, atol=1e-6):
                bad.append(name)
                break
    changed = _unchanged_elsewhere(model, before, set(maps))
    return "right" if not bad and not changed else f"silent ({bad or ''} {changed or ''})"


def clip_cell(family: str) -> str:
    model = FAMILIES[family][0]()
    bounds, _ = clip_bounds(model)
    bad = []
    for name, blocks in true_maps(family, model).items():
        matrix = next(iter(blocks.values()))
        expected = 1 / math.sqrt(matrix.shape[1] if matrix.dim() == 2 else matrix[0].numel())
        conv = next((m for n, m in model.named_modules() if f"{n}.weight" == name and isinstance(m, (nn.Conv1d, nn.Conv2d))), None)
        if conv is not None:
            expected = 1 / math.sqrt(conv.weight[0].numel())  # PyTorch's conv init: fan-in over the kernel
        if name not in bounds or abs(bounds[name][1] - expected) > 1e-9:
            bad.append(f"{name}: {bounds[name][1] if name in bounds else 'no bound'} vs {expected:.3f}")
    return "right" if not bad else f"silent ({bad})"


EXPECTED_FIRE = {"qwen3_next": "refused"}  # in_proj_ba feeds the chunked delta rule (cumsum, triangular solves)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fire_on_every_true_block(family):
    assert fire_cell(family) == EXPECTED_FIRE.get(family, "right")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_dash_per_output_neuron(family):
    assert dash_cell(family) == "right"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_weight_clip_bound_per_matrix(family):
    assert clip_cell(family) == "right"


def family_matrix() -> str:
    """The family × callback table of the issue note (``python tests/test_families_matrix.py``)."""
    lines = ["| family | FIRE | DASH | WeightClip |", "|---|---|---|---|"]
    for family in FAMILIES:
        lines.append(f"| {family} | {fire_cell(family)} | {dash_cell(family)} | {clip_cell(family)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(family_matrix())
