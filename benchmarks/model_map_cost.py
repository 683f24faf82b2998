"""Cost of building the model map (random init, nothing downloaded), against one training step.

Times ``select_targets`` (the first call on a model runs the forward probes: the attention probe for
fused Q/K/V and the trace that reads bare parameters, expert stacks and every layer's output cuts;
later calls are served from the map kept per model, one walk over its modules to see that nothing changed),
``find_neuron_layers`` and ``coverage_report``, and one SGD training step (batch 4 × 128 tokens, forward +
backward + step) on the same model. Side by side, in the same run: ``re-read``, a call with the kept map
dropped (probe and trace results still cached), which is what every call after the first cost before the map
was kept. Tiny models (2 layers, width 64, vocabulary 512) come first: there a training step is cheap, so the
map's cost relative to it is largest. Families at 124M: GPT-2 124M, a GPT-NeoX
of the same size (fused Q/K/V read by the probe), and the frontier ones of issue 32 at about that size:
Mixtral-style MoE (8 experts), GPT-OSS (interleaved ``(in, out)`` experts), DeepSeek-V3 (latent attention
+ MoE), Mamba, Mamba-2 and Jamba (hybrid); and this package's GPT at GPT-2's size, dense, hybrid
(``layer_pattern=[attn, mamba2]``: a fused ``in_proj`` the trace splits) and mixture-of-experts (``mlp=moe``:
expert stacks the trace reads), each from a random init. Prints milliseconds of process CPU time on one
thread; asserts nothing. Timings exclude start-up: every timed call runs once first, untimed, on a throwaway
small model (the trace imports ``torch._dynamo``, about a second, unless building a Hugging Face model did), so
``first`` is the model's own probes and trace, whichever family comes first.

Usage: ``python benchmarks/model_map_cost.py [family ...]`` (``tiny``: the tiny families only)
"""
from __future__ import annotations

import sys
import time
import warnings

import torch
import torch.nn.functional as F
import transformers

from plasticity_callbacks.model_map import coverage_report, find_neuron_layers, select_targets
from plasticity_callbacks.model_map import select as model_map_select
from plasticity_callbacks.models import GPT, GPTConfig

VOCAB = 50304
TINY_VOCAB = 512
TINY_MOE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, vocab_size=TINY_VOCAB)
MOE = dict(hidden_size=768, intermediate_size=768, num_hidden_layers=6, num_attention_heads=12, num_key_value_heads=4,
           vocab_size=VOCAB)
GPT_124M = dict(vocab_size=VOCAB, sequence_len=256, n_layer=12, n_head=12, n_kv_head=12, n_embd=768)
TINY = {
    "tiny gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=2, vocab_size=TINY_VOCAB)),
    "tiny gpt-neox (probed)": lambda: transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2, vocab_size=TINY_VOCAB)),
    "tiny mixtral-4x": lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(
        num_local_experts=4, num_experts_per_tok=2, **TINY_MOE)),
    "tiny mamba": lambda: transformers.MambaForCausalLM(transformers.MambaConfig(
        hidden_size=64, num_hidden_layers=2, vocab_size=TINY_VOCAB, use_mambapy=False)),
    "tiny package gpt": lambda: GPT(GPTConfig(vocab_size=TINY_VOCAB, sequence_len=256, n_layer=2, n_head=2,
                                              n_kv_head=2, n_embd=64)),
    "tiny package gpt moe": lambda: GPT(GPTConfig(vocab_size=TINY_VOCAB, sequence_len=256, n_layer=2, n_head=2,
                                                  n_kv_head=2, n_embd=64, mlp="moe",
                                                  mlp_options=dict(n_experts=4, top_k=2))),
}
FAMILIES = {
    **TINY,
    "gpt2-124M": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config()),
    "gpt-neox-124M (probed)": lambda: transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12, vocab_size=VOCAB)),
    "mixtral-8x (6 layers)": lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(
        num_local_experts=8, num_experts_per_tok=2, **MOE)),
    "gpt-oss-8x (6 layers)": lambda: transformers.GptOssForCausalLM(transformers.GptOssConfig(
        num_local_experts=8, num_experts_per_tok=2, head_dim=64, layer_types=["full_attention"] * 6, **MOE)),
    "deepseek-v3 (6 layers)": lambda: transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        hidden_size=768, intermediate_size=2048, moe_intermediate_size=512, num_hidden_layers=6,
        first_k_dense_replace=1, num_attention_heads=12, num_key_value_heads=12, q_lora_rank=384, kv_lora_rank=256,
        qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=8, num_experts_per_tok=2,
        n_group=1, topk_group=1, vocab_size=VOCAB)),
    "mamba-130M": lambda: transformers.MambaForCausalLM(transformers.MambaConfig(
        hidden_size=768, num_hidden_layers=24, vocab_size=VOCAB, use_mambapy=False)),
    "mamba2 (24 layers)": lambda: transformers.Mamba2ForCausalLM(transformers.Mamba2Config(
        hidden_size=768, num_hidden_layers=24, num_heads=24, head_dim=64, n_groups=1, vocab_size=VOCAB)),
    "jamba (8 layers)": lambda: transformers.JambaForCausalLM(transformers.JambaConfig(
        hidden_size=768, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=12, num_key_value_heads=4,
        num_experts=8, vocab_size=VOCAB, use_mamba_kernels=False)),
    "package gpt 12x768": lambda: GPT(GPTConfig(**GPT_124M)),
    "package gpt [attn, mamba2]": lambda: GPT(GPTConfig(**GPT_124M, layer_pattern=["attn", "mamba2"])),
    "package gpt moe 8x top-2": lambda: GPT(GPTConfig(**GPT_124M, mlp="moe", mlp_options=dict(n_experts=8, top_k=2))),
}


def timed(fn, repeat: int = 3) -> tuple[float, float]:
    """(first call, best later call) in milliseconds of process CPU time."""
    times = []
    for _ in range(repeat):
        start = time.process_time()
        fn()
        times.append((time.process_time() - start) * 1e3)
    return times[0], min(times[1:])


def vocabulary(model: torch.nn.Module) -> int:
    """The model's own vocabulary size (token ids are drawn below it)."""
    if isinstance(model, GPT):
        return model.config.vocab_size
    return model.get_input_embeddings().num_embeddings


def reread(model: torch.nn.Module) -> None:
    """``select_targets`` with the kept map dropped: what a later call cost before the map was kept."""
    getattr(model_map_select, "_MAPS", {}).pop(model, None)  # (a source tree without the kept map: a plain call)
    select_targets(model)


def language_model_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    if isinstance(model, GPT):  # this package's GPT: (B, T) ids to (B, T, V) logits
        return F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
    return model(input_ids=ids, labels=ids).loss


def training_step_ms(model: torch.nn.Module) -> float:
    """Best of two SGD steps on 4 × 128 random tokens (the first one warms up), in milliseconds."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    ids = torch.randint(0, vocabulary(model), (4, 128))
    model.train()

    def step():
        optimizer.zero_grad()
        language_model_loss(model, ids).backward()
        optimizer.step()

    step()
    return timed(step, repeat=3)[1]


def warm_up() -> None:
    """Every timed call once, untimed, on a throwaway two-layer GPT-2: library start-up is not the map's cost."""
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB))
    select_targets(model), reread(model), find_neuron_layers(model), coverage_report(model)
    training_step_ms(model)


def main(names: list[str]) -> None:
    transformers.logging.set_verbosity_error()
    warnings.simplefilter("once")  # the map's notes on a model, once each, not once per timed call
    torch.set_num_threads(1)  # CPU time of one thread: what a shared machine's other jobs inflate least
    warm_up()
    names = list(TINY) if names == ["tiny"] else names or list(FAMILIES)
    print("select_targets in ms (in training steps); find_neuron_layers first / later and coverage_report in ms")
    print(f"{'family':<28}{'params':>8}{'step ms':>9}{'first':>16}{'kept map':>16}{'re-read':>16}"
          f"{'neurons':>14}{'coverage':>10}")
    for label in names:
        torch.manual_seed(0)
        model = FAMILIES[label]()
        params = sum(p.numel() for p in model.parameters()) / 1e6
        select = timed(lambda: select_targets(model), repeat=6)
        again = timed(lambda: reread(model), repeat=4)
        neurons = timed(lambda: find_neuron_layers(model))
        report = timed(lambda: coverage_report(model))
        step = training_step_ms(model)

        def cell(ms: float) -> str:
            return f"{ms:.1f} ({ms / step:.3f})"

        print(f"{label:<28}{params:>7.1f}M{step:>9.1f}{cell(select[0]):>16}{cell(select[1]):>16}{cell(again[1]):>16}"
              f"{neurons[0]:>8.0f} / {neurons[1]:<4.0f}{report[1]:>10.0f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
