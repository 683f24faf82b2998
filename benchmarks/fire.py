"""FIRE benchmark: the default polar factor against every exact anchor, per size and on a GPT-2-small-sized model.

    python benchmarks/fire.py --sizes 256,512,768,1024        # CPU, one thread (~2 min on a quiet core)
    python benchmarks/fire.py --part model                    # GPT-2-small-sized model only (~2 min)
    python benchmarks/fire.py --device cuda --sizes 256,1024,4096

Part 1 — per size ``n`` (default 256 … 4096), a square ``n×n`` and a tall ``4n×n`` Gaussian matrix
(the square one is the hard case: its smallest σ is near 0): the default
``orthogonalize(W)`` (``method="auto"``) against each anchor, all in this one process:

* ``svd``   — ``torch.linalg.svd`` → ``U Vᵀ`` in float32;
* ``eigh64`` — float64 Gram matrix ``XᵀX``, ``torch.linalg.eigh``, ``X·V Λ^(-1/2) Vᵀ`` in float64;
* ``polar_express`` — ``orthogonalize(W, PolarOptions("polar_express"))``: matrix products only,
  to ``tol = 1e-5``.

Each line gives every method's time (median over interleaved rounds), its relative error
``‖Q − U Vᵀ‖_F / ‖U Vᵀ‖_F`` against a float64 SVD, and the ratio default / anchor (< 1: the
default is faster); ``vs fastest`` is default / the fastest anchor (target ≤ 1.0, goal 0.8).

Part 2 — ``apply_fire`` with default options on a GPT-2-small-sized model (12 layers, width 768,
vocabulary 50304: 72 target matrices, Q/K/V separate) against one AdamW training step at batch
1×256, measured in the same rounds (target: FIRE ≤ 2 training steps).

CPU timings are process CPU time (``time.process_time``) on ``--threads`` threads (default 1), so
other jobs on a shared machine inflate them less; CUDA timings are wall time between synchronizes.
The machine is shared: read the ratios, which are measured side by side, not the absolute times.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
import warnings

import torch
import torch.nn.functional as F

from plasticity_callbacks.core.apply_fire import apply_fire
from plasticity_callbacks.functional.spectral import PolarOptions, orthogonalize
from plasticity_callbacks.models import GPT, GPTConfig


def svd_anchor(W: torch.Tensor) -> torch.Tensor:
    U, _, Vh = torch.linalg.svd(W, full_matrices=False)
    return U @ Vh


def eigh64_anchor(W: torch.Tensor) -> torch.Tensor:
    X = (W.mT if W.shape[-2] < W.shape[-1] else W).double()
    eigenvalues, V = torch.linalg.eigh(X.mT @ X)
    Q = X @ ((V * eigenvalues.rsqrt()) @ V.mT)
    return (Q.mT if W.shape[-2] < W.shape[-1] else Q).to(W.dtype)


def polar_express_anchor(W: torch.Tensor) -> torch.Tensor:
    return orthogonalize(W, PolarOptions("polar_express"))


ANCHORS = {"svd": svd_anchor, "eigh64": eigh64_anchor, "polar_express": polar_express_anchor}


class Clock:
    """Process CPU time on CPU; wall time between synchronizes on CUDA."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn) -> tuple[float, object]:
        if self.cuda:
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = fn()
            torch.cuda.synchronize()
            return time.perf_counter() - start, out
        start = time.process_time()
        out = fn()
        return time.process_time() - start, out


def relative_error(Q: torch.Tensor, exact: torch.Tensor) -> float:
    return float((Q.double() - exact).norm() / exact.norm())


def matrix_table(sizes: list[int], rounds: int, device: torch.device, clock: Clock) -> None:
    print(f"{'matrix':>11s} {'default':>22s} " + " ".join(f"{name:>30s}" for name in ANCHORS) + "  vs fastest")
    generator = torch.Generator().manual_seed(0)
    for n in sizes:
        for m in (n, 4 * n):
            W = torch.randn(m, n, generator=generator).to(device)
            U, _, Vh = torch.linalg.svd(W.double(), full_matrices=False)
            exact = U @ Vh
            del U, Vh
            methods = {"default": lambda: orthogonalize(W, return_info=True),
                       **{name: (lambda anchor=anchor: anchor(W)) for name, anchor in ANCHORS.items()}}
            times = {name: [] for name in methods}
            errors, info = {}, None
            for r in range(rounds):  # interleaved, starting at a different method each round
                names = list(methods)
                for name in names[r % len(names):] + names[:r % len(names)]:
                    seconds, out = clock(methods[name])
                    times[name].append(seconds)
                    if name == "default":
                        out, info = out
                    errors[name] = relative_error(out, exact)
                    del out
            median = {name: statistics.median(values) for name, values in times.items()}
            fastest = min(median[name] for name in ANCHORS)
            cells = [f"{info.method:>6s} {median['default']:7.3f}s {errors['default']:6.1e}"]
            for name in ANCHORS:
                cells.append(f"{median[name]:8.3f}s {errors[name]:6.1e} ratio {median['default'] / median[name]:5.2f}")
            print(f"{m:>5d}x{n:<5d} " + " ".join(f"{c:>22s}" if i == 0 else f"{c:>30s}" for i, c in enumerate(cells))
                  + f"  {median['default'] / fastest:5.2f}", flush=True)


def gpt2_small(device: torch.device) -> GPT:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=50304, sequence_len=256, n_layer=12, n_head=12, n_kv_head=12, n_embd=768)
    model = GPT(config).to(device)
    with torch.no_grad():  # the init zeroes the output projections; after training they are not
        for block in model.blocks:
            for proj in (block.attn.c_proj, block.mlp.c_proj):
                proj.weight.normal_(0.0, 1.0 / math.sqrt(proj.weight.shape[1]))
    return model


def whole_model(rounds: int, device: torch.device, clock: Clock) -> None:
    model = gpt2_small(device)
    config = model.config
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, config.vocab_size, (1, config.sequence_len), device=device)
    y = torch.randint(0, config.vocab_size, (1, config.sequence_len), device=device)

    def train_step():
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    train_step()  # warm up, and create the optimizer state FIRE resets
    step_times, fire_times, records = [], [], []
    for _ in range(rounds):
        step_times.append(clock(train_step)[0])
        seconds, records = clock(lambda: apply_fire(model, optimizer))
        fire_times.append(seconds)
    step, fire = statistics.median(step_times), statistics.median(fire_times)
    done = [r for r in records if r.skipped is None]
    print(f"GPT-2-small-sized model ({config.n_layer} layers, width {config.n_embd}, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters): FIRE on {len(done)} matrices, "
          f"largest DfI after {max(r.dfi_after for r in done):.1e}")
    print(f"  one training step (1x{config.sequence_len} tokens, AdamW) {step:.2f} s; apply_fire {fire:.2f} s; "
          f"ratio FIRE / step = {fire / step:.2f} (target <= 2)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("all", "matrices", "model"), default="all")
    parser.add_argument("--sizes", default="256,512,1024,2048,4096", help="comma-separated n (square n×n, tall 4n×n)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians are reported")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--device", default="cpu", help="cpu | cuda")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    clock = Clock(device)
    warnings.simplefilter("ignore")
    started = time.perf_counter()
    print(f"torch {torch.__version__}, device {device}"
          + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else f", {args.threads} thread(s)")
          + f", float32, {args.rounds} interleaved rounds, medians; ratio = default / anchor time")
    if args.part in ("all", "matrices"):
        matrix_table([int(n) for n in args.sizes.split(",")], args.rounds, device, clock)
    if args.part in ("all", "model"):
        whole_model(args.rounds, device, clock)
    print(f"total {time.perf_counter() - started:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
