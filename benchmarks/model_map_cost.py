"""Cost of building the model map on a GPT-2 124M-sized model (random init, nothing downloaded).

Times ``select_targets`` (the first call on a model also builds and logs its coverage table),
``find_neuron_layers`` and ``coverage_report``, and, for a model whose fused Q/K/V split is read
by the forward probe, a GPT-NeoX of the same size. Prints milliseconds; asserts nothing.

Usage: ``python benchmarks/model_map_cost.py``
"""
from __future__ import annotations

import time

import torch
import transformers

from plasticity_callbacks.model_map import coverage_report, find_neuron_layers, select_targets


def timed(fn, repeat: int = 3) -> tuple[float, float]:
    """(first call, best later call) in milliseconds."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return times[0], min(times[1:])


def main() -> None:
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    models = {
        "gpt2-124M": transformers.GPT2LMHeadModel(transformers.GPT2Config()),
        "gpt-neox-124M (probed)": transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
            hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
            vocab_size=50304)),
    }
    for label, model in models.items():
        params = sum(p.numel() for p in model.parameters()) / 1e6
        select = timed(lambda: select_targets(model))
        neurons = timed(lambda: find_neuron_layers(model))
        report = timed(lambda: coverage_report(model))
        print(f"{label} ({params:.0f}M params): select_targets first {select[0]:.0f} ms, then {select[1]:.0f} ms; "
              f"find_neuron_layers {neurons[0]:.0f} / {neurons[1]:.0f} ms; coverage_report {report[1]:.0f} ms")


if __name__ == "__main__":
    main()
