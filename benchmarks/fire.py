"""FIRE benchmark: orthogonalization cost/accuracy per method, and whole-model cost of ``apply_fire``.

    python benchmarks/fire.py            # ~1-3 min on 2 CPU cores
    OMP_NUM_THREADS=8 python benchmarks/fire.py --part matrices

Part 1 — for a square Gaussian (worst case: smallest σ near 0), a tall Gaussian and a
trained-like heavy-tailed spectrum: steps, matrix products, relative error against the float64
SVD polar factor, and time, for cubic Newton–Schulz (Frobenius, spectral), Polar Express
(Frobenius, Gram bound) and SVD, all with the default tolerance stop (tol=1e-5, checked every
step). Methods run interleaved, best of 2 timings. Goal: the best iterative method needs
≤ 0.5× the products of cubic NS (Frobenius, the reference code's normalization).

Part 2 — ``apply_fire`` on the default GPT (``GPTConfig()``, projections made non-zero as after
training) against one AdamW training step at the default data shape (16 × 256 tokens), as a
ratio, and the peak extra memory of ``apply_fire`` (torch profiler's CPU allocator record,
"Total Allocated") against the largest weight matrix. Goals: ≤ 10 steps, ≤ 3× the matrix.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
import warnings

import torch
import torch.nn.functional as F

from plasticity_callbacks.core.apply_fire import apply_fire
from plasticity_callbacks.models import GPT, GPTConfig
from plasticity_callbacks.functional.spectral import orthogonalize

METHODS = [  # label, method, normalize
    ("cubic NS, frobenius", "newton_schulz", "frobenius"),
    ("cubic NS, spectral", "newton_schulz", "spectral"),
    ("Polar Express, frobenius", "polar_express", "frobenius"),
    ("Polar Express, gram", "polar_express", "gram"),
    ("SVD", "svd", None),
]


def heavy_tailed(n: int, generator: torch.Generator) -> torch.Tensor:
    """A trained-like spectrum: a few large σ, a power-law bulk, a tail down to ~1e-3 of σ_max."""
    U, _ = torch.linalg.qr(torch.randn(n, n, generator=generator, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(n, n, generator=generator, dtype=torch.float64))
    sigma = (torch.arange(1, n + 1, dtype=torch.float64) ** -1.0)
    sigma[:4] *= 3.0
    return ((U * sigma) @ V.T).float()


def exact_polar(W: torch.Tensor) -> torch.Tensor:
    U, _, Vh = torch.linalg.svd(W.double(), full_matrices=False)
    return U @ Vh


def orthogonalization_table() -> None:
    g = torch.Generator().manual_seed(0)
    matrices = {
        "square Gaussian 768x768": torch.randn(768, 768, generator=g),
        "tall Gaussian 3072x768": torch.randn(3072, 768, generator=g),
        "heavy-tailed 768x768": heavy_tailed(768, g),
    }
    print(f"{'matrix':26s} {'method':26s} {'steps':>5s} {'matmuls':>7s} {'rel.err':>9s} {'time s':>7s}")
    for name, W in matrices.items():
        Q_exact = exact_polar(W)
        times = {label: [] for label, _, _ in METHODS}
        results = {}
        for _ in range(2):  # interleaved repetitions: the machine is shared and noisy
            for label, method, normalize in METHODS:
                start = time.perf_counter()
                Q, info = orthogonalize(W, method, normalize, return_info=True)
                times[label].append(time.perf_counter() - start)
                error = float((Q.double() - Q_exact).norm() / Q_exact.norm())
                results[label] = (info, error)
        for label, _, _ in METHODS:
            info, error = results[label]
            note = f"  (SVD fallback on {info.fell_back})" if info.fell_back else ""
            print(f"{name:26s} {label:26s} {info.iterations:5d} {info.matmuls:7d} {error:9.1e} "
                  f"{min(times[label]):7.3f}{note}")
        reference = results["cubic NS, frobenius"][0].matmuls
        iterative = [(results[label][0].matmuls, label) for label, method, _ in METHODS if method != "svd"]
        best, best_label = min(iterative)
        print(f"{name:26s} best iterative: {best_label} — {best}/{reference} = {best / reference:.2f}x the "
              f"matmuls of cubic NS (frobenius); vs cubic NS spectral: "
              f"{best / results['cubic NS, spectral'][0].matmuls:.2f}x\n")


def trained_like_gpt() -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    with torch.no_grad():  # the nanochat init zeroes the output projections; training would not leave them so
        for block in model.blocks:
            for proj in (block.attn.c_proj, block.mlp.c_proj):
                proj.weight.normal_(0.0, 1.0 / math.sqrt(proj.weight.shape[1]))
    return model


def peak_extra_bytes(fn) -> int:
    """Peak of the CPU allocator's "Total Allocated" during ``fn`` above its level at the start."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = [e["args"] for e in json.load(f)["traceEvents"] if e.get("name") == "[memory]"]
    if not events:
        return 0
    start = events[0]["Total Allocated"] - events[0]["Bytes"]
    return max(e["Total Allocated"] for e in events) - start


def whole_model() -> None:
    model = trained_like_gpt()
    config = model.config
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, config.vocab_size, (16, config.sequence_len))
    y = torch.randint(0, config.vocab_size, (16, config.sequence_len))

    def train_step():
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    train_step()  # warm up and create the optimizer state FIRE will reset
    step_times, fire_times = [], []
    records = []
    for _ in range(3):  # interleaved
        start = time.perf_counter()
        train_step()
        step_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        records = apply_fire(model, optimizer)
        fire_times.append(time.perf_counter() - start)
    step, fire = statistics.median(step_times), statistics.median(fire_times)
    done = [r for r in records if r.skipped is None]
    print(f"default GPT ({config.n_layer} layers, n_embd {config.n_embd}, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params): FIRE on {len(done)} matrices, "
          f"max {max(r.iterations for r in done)} steps, mean DfI after {statistics.mean(r.dfi_after for r in done):.1e}")
    print(f"  one training step (16x{config.sequence_len} tokens, AdamW): {step * 1e3:.1f} ms; "
          f"apply_fire: {fire * 1e3:.1f} ms; ratio FIRE / step = {fire / step:.2f} (goal <= 10)")
    fresh = trained_like_gpt()
    skipped = (fresh.wte.weight, fresh.lm_head.weight)  # not FIRE targets
    largest = max(t.numel() * t.element_size() for t in fresh.parameters()
                  if t.dim() == 2 and all(t is not s for s in skipped))
    extra = peak_extra_bytes(lambda: apply_fire(fresh))
    print(f"  peak extra memory of apply_fire: {extra / 1024:.0f} KiB = {extra / largest:.2f}x the largest "
          f"treated matrix ({largest / 1024:.0f} KiB) (goal <= 3x)")
    single = torch.randn(3072, 768)
    extra = peak_extra_bytes(lambda: orthogonalize(single))
    print(f"  one 3072x768 matrix, Polar Express: peak extra {extra / 2**20:.1f} MiB = "
          f"{extra / (single.numel() * 4):.2f}x the matrix")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("all", "matrices", "model"), default="all",
                        help="matrices: part 1 only; model: part 2 only")
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")),
                        help="torch threads (default: $OMP_NUM_THREADS, else 2)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    started = time.perf_counter()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32, tol=1e-5, checked every step\n")
    if args.part in ("all", "matrices"):
        orthogonalization_table()
    if args.part in ("all", "model"):
        whole_model()
    print(f"\ntotal {time.perf_counter() - started:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
