"""Forward+backward time and parameter count of every attention / MLP / position block,
relative to the standard block of its group, at the default model size (``GPTConfig()``).

All variants run in one process, interleaved round by round (each round visits every variant in
a rotated order), and the table shows the median per-iteration time over rounds divided by the
baseline's. These machines are noisy; only ratios measured side by side mean anything.

    python benchmarks/blocks.py                       # CPU, batch 16 × 256 tokens, ~2 minutes
    python benchmarks/blocks.py --rounds 15 --iters 3 --groups attention,mlp
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from plasticity_callbacks.models import GPT, GPTConfig

# (group, label, GPTConfig overrides); the first row of each group is its baseline.
VARIANTS = [
    ("attention", "standard (rope)", dict(attention="standard")),
    ("attention", "reciprocal R=4 (rope)", dict(attention="reciprocal")),
    ("attention", "standard (none)", dict(attention="standard", position="none")),
    ("attention", "reciprocal R=4 (none)", dict(attention="reciprocal", position="none")),
    ("attention", "reciprocal R=4 (alibi)", dict(attention="reciprocal", position="alibi")),
    ("position", "rope (standard attn)", dict(position="rope")),
    ("position", "none", dict(position="none")),
    ("position", "fire", dict(position="fire")),
    ("position", "fire clamped", dict(position="fire", position_options={"variant": "clamped"})),
    ("position", "alibi", dict(position="alibi")),
    ("position", "t5", dict(position="t5")),
    ("mlp", "relu2", dict(mlp="relu2")),
    ("mlp", "swiglu", dict(mlp="swiglu")),
    ("mlp", "geglu", dict(mlp="geglu")),
    ("mlp", "reciprocal", dict(mlp="reciprocal")),
    ("model", "standard/relu2/rope", dict()),
    ("model", "reciprocal/reciprocal/rope", dict(attention="reciprocal", mlp="reciprocal")),
    ("model", "standard/relu2/fire", dict(position="fire")),
]


def build(group: str, overrides: dict):
    """A callable running one forward+backward of the block (or whole model), and its parameter count."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**overrides))
    with torch.no_grad():  # zero-initialized projections would make parts of the backward trivial
        for p in model.parameters():
            if p.dim() == 2 and p.abs().sum() == 0:
                p.normal_(0, 0.02)
    block = model.blocks[0]
    module = {"attention": block.attn, "position": block.attn, "mlp": block.mlp, "model": model}[group]
    params = sum(p.numel() for p in module.parameters())
    return module, params


def make_step(group: str, module, batch: int, config: GPTConfig):
    T, d = config.sequence_len, config.n_embd
    if group == "model":
        idx = torch.randint(0, 256, (batch, T))
        return lambda: module(idx).float().square().mean().backward()
    x = torch.randn(batch, T, d, requires_grad=True)
    if group == "mlp":
        attn_out = torch.randn(batch, T, d)
        return lambda: module(x, attn_out=attn_out).square().mean().backward()
    return lambda: module(x).square().mean().backward()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=2, help="forward+backward passes per variant per round")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (the machine is shared)")
    parser.add_argument("--groups", default="attention,position,mlp,model", help="comma-separated subset")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = GPTConfig()
    variants = [v for v in VARIANTS if v[0] in args.groups.split(",")]
    steps, params = [], []
    for group, _, overrides in variants:
        module, count = build(group, overrides)
        steps.append(make_step(group, module, args.batch, GPTConfig(**overrides)))
        params.append(count)
    for step in steps:  # warm-up: allocator, kernels, RoPE tables
        step()
    times: list[list[float]] = [[] for _ in variants]
    started = time.perf_counter()
    for r in range(args.rounds):
        order = list(range(len(variants)))
        order = order[r % len(order):] + order[: r % len(order)]  # rotate so no variant always runs first
        for i in order:
            t0 = time.perf_counter()
            for _ in range(args.iters):
                steps[i]()
            times[i].append((time.perf_counter() - t0) / args.iters)
    print(f"blocks at GPTConfig() defaults: d={config.n_embd}, heads={config.n_head}/{config.n_kv_head}, "
          f"T={config.sequence_len}, batch={args.batch}, torch {torch.__version__}, {args.threads} thread(s), "
          f"{args.rounds} rounds × {args.iters} fwd+bwd, {time.perf_counter() - started:.0f} s")
    print(f"{'group':10s} {'variant':28s} {'ms (median)':>12s} {'time ×':>8s} {'params':>9s} {'params ×':>9s}")
    baseline = {}
    for (group, label, _), t, n in zip(variants, times, params):
        median = statistics.median(t)
        base_t, base_n = baseline.setdefault(group, (median, n))
        spread = (max(t) - min(t)) / median
        print(f"{group:10s} {label:28s} {1e3 * median:12.2f} {median / base_t:8.2f} {n:9d} {n / base_n:9.3f}"
              f"   (spread {spread:.0%})")


if __name__ == "__main__":
    main()
