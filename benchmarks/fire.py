"""FIRE benchmark: the default polar factor against every exact anchor, per size and on a GPT-2-small-sized model.

    python benchmarks/fire.py --sizes 256,512,768,1024        # CPU, one thread (~2 min on a quiet core)
    python benchmarks/fire.py --part model --threads 1,2      # GPT-2-small-sized model only (~3 min)
    python benchmarks/fire.py --sizes 4096 --rounds 1 --anchors svd,eigh64 --exact-max 2048   # ~6 min
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
default is faster); ``vs fastest`` is default / the fastest anchor (target ≤ 1.0, goal 0.8); ``steps`` is the default's
iteration count (Polar Express, the default on CUDA; ``-`` for the one-shot SVD / ``eigh``).

Part 2 — ``apply_fire`` with default options on a GPT-2-small-sized model (12 layers, width 768,
vocabulary 50304: 72 target matrices, Q/K/V separate) against one AdamW training step at batch
1×256, measured in the same rounds at the same thread count, for each count in ``--threads``
(target: FIRE ≤ 2 training steps). On CUDA, side by side with it: the same solves one weight at a
time (what ``apply_fire`` batches by shape there), the authors' LM recipe (5 Newton–Schulz steps) and the
exact solvers (``eigh``, SVD), batched. On CPU: the floor of FIRE's design there: the LAPACK calls and
the matrix products alone (an SVD and its ``U·Vᵀ`` per square weight; per oblong weight its Gram matrix,
``eigh``, and ``X·(V Λ^(-1/2) Vᵀ)``), and the step's FLOPs (``torch.utils.flop_counter``) per second.

Timings exclude start-up: part 2 applies FIRE once, untimed, to a copy of the model first (a process's first
``apply_fire`` pays library start-up); part 1's calls show none and are medians over rounds.
CPU timings are process CPU time (``time.process_time``), so other jobs on a shared machine inflate
them less; with several threads the wall time is given too (CPU time then sums the threads). CUDA
timings are wall time between synchronizes. Read the ratios, measured side by side, not the times.
"""
from __future__ import annotations

import argparse
import copy
import math
import statistics
import sys
import time
import warnings

import torch
import torch.nn.functional as F

from plasticity_callbacks.functional.isometry import FIREOptions, fire_matrix
from plasticity_callbacks.functional.spectral import PolarOptions, orthogonalize
from plasticity_callbacks.model_map import Selection, select_targets
from plasticity_callbacks.ops.fire import apply_fire
from plasticity_callbacks.ops.optimizer_state import reset_optimizer_state
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


def relative_error(Q: torch.Tensor, exact: torch.Tensor | None) -> float:
    return float("nan") if exact is None else float((Q.double() - exact).norm() / exact.norm())


def matrix_table(sizes: list[int], rounds: int, device: torch.device, clock: Clock, anchors: dict,
                 exact_max: int) -> None:
    print(f"{'matrix':>11s} {'default':>22s} " + " ".join(f"{name:>30s}" for name in anchors) + "  vs fastest  steps")
    generator = torch.Generator().manual_seed(0)
    for n in sizes:
        for m in (n, 4 * n):
            W = torch.randn(m, n, generator=generator).to(device)
            exact = None  # error "nan": no float64 SVD reference above --exact-max
            if n <= exact_max:
                U, _, Vh = torch.linalg.svd(W.double(), full_matrices=False)
                exact = U @ Vh
                del U, Vh
            methods = {"default": lambda: orthogonalize(W, return_info=True),
                       **{name: (lambda anchor=anchor: anchor(W)) for name, anchor in anchors.items()}}
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
            fastest = min(median[name] for name in anchors)
            cells = [f"{info.method:>6s} {median['default']:7.3f}s {errors['default']:6.1e}"]
            for name in anchors:
                cells.append(f"{median[name]:8.3f}s {errors[name]:6.1e} ratio {median['default'] / median[name]:5.2f}")
            print(f"{m:>5d}x{n:<5d} " + " ".join(f"{c:>22s}" if i == 0 else f"{c:>30s}" for i, c in enumerate(cells))
                  + f"  {median['default'] / fastest:10.2f}  {info.iterations or '-':>5}", flush=True)


def gpt2_small(device: torch.device) -> GPT:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=50304, sequence_len=256, n_layer=12, n_head=12, n_kv_head=12, n_embd=768)
    model = GPT(config).to(device)
    with torch.no_grad():  # the init zeroes the output projections; after training they are not
        for block in model.blocks:
            for proj in (block.attn.c_proj, block.mlp.c_proj):
                proj.weight.normal_(0.0, 1.0 / math.sqrt(proj.weight.shape[1]))
    return model


def whole_model(rounds: int, device: torch.device, clock: Clock, threads: int) -> None:
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
    # untimed, on a throwaway copy: a process's first apply_fire pays library start-up (the model map's trace
    # imports torch._dynamo, about a second of CPU), several times a small model's FIRE
    apply_fire(copy.deepcopy(model), None)
    step_times, fire_times, step_walls, fire_walls, records = [], [], [], [], []
    for _ in range(rounds):
        wall = time.perf_counter()
        step_times.append(clock(train_step)[0])
        step_walls.append(time.perf_counter() - wall)
        wall = time.perf_counter()
        seconds, records = clock(lambda: apply_fire(model, optimizer))
        fire_walls.append(time.perf_counter() - wall)
        fire_times.append(seconds)
    step, fire = statistics.median(step_times), statistics.median(fire_times)
    done = [r for r in records if r.skipped is None]
    print(f"GPT-2-small-sized model ({config.n_layer} layers, width {config.n_embd}, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters), {threads} thread(s): FIRE on "
          f"{len(done)} matrices ({', '.join(sorted({str(r.shape) for r in done}))}), "
          f"largest DfI after {max(r.dfi_after for r in done):.1e}")
    print(f"  one training step (1x{config.sequence_len} tokens, AdamW) {step:.2f} s; apply_fire {fire:.2f} s; "
          f"ratio FIRE / step = {fire / step:.2f} (target <= 2)", flush=True)
    if threads > 1:
        step_wall, fire_wall = statistics.median(step_walls), statistics.median(fire_walls)
        print(f"  wall time: step {step_wall:.2f} s; apply_fire {fire_wall:.2f} s; ratio {fire_wall / step_wall:.2f}")
    if device.type == "cpu":
        floor(model, clock, step, train_step)
    else:
        gpu_variants(model, optimizer, rounds, clock, step)


def one_weight_at_a_time(model: GPT, optimizer, options: FIREOptions) -> None:
    """FIRE as a loop of ``fire_matrix`` over every row block (what ``apply_fire`` batches on a GPU)."""
    targets = select_targets(model, Selection())
    with torch.no_grad():
        for target in targets:
            weight = target.read()
            for block in target.block_list():
                rows = block.take(weight)
                fire_matrix(target.name, rows, options)
                block.put(weight, rows)
            target.write(weight)
    reset_optimizer_state(optimizer, [p for target in targets for p in target.trainable()])


def gpu_variants(model: GPT, optimizer, rounds: int, clock: Clock, step: float) -> None:
    """On a GPU, side by side with apply_fire: the same solves one weight at a time (the unbatched baseline),
    the authors' LM recipe (5 Newton–Schulz steps, Frobenius normalization), and the exact solvers, batched."""
    recipe = FIREOptions(method="newton_schulz", normalize="frobenius", steps=5)
    variants = {"apply_fire (batched by shape)": lambda: apply_fire(model, optimizer),
                "one weight at a time (fire_matrix loop)": lambda: one_weight_at_a_time(model, optimizer, FIREOptions()),
                "authors' LM recipe, batched": lambda: apply_fire(model, optimizer, recipe),
                "exact eigh (float64 Gram), batched": lambda: apply_fire(model, optimizer, FIREOptions(method="eigh")),
                "exact SVD, batched": lambda: apply_fire(model, optimizer, FIREOptions(method="svd"))}
    times = {name: [] for name in variants}
    for _ in range(rounds):
        for name, run in variants.items():
            times[name].append(clock(run)[0])
    for name, values in times.items():
        seconds = statistics.median(values)
        print(f"  {name:<42s} {seconds:7.3f} s = {seconds / step:6.2f} steps", flush=True)


def floor(model: GPT, clock: Clock, step: float, train_step) -> None:
    """The LAPACK calls and matrix products FIRE's CPU design cannot avoid, timed alone on the same weights."""
    from torch.utils.flop_counter import FlopCounterMode

    weights = [p.detach() for name, p in model.named_parameters() if p.dim() == 2 and "blocks" in name]
    square = [W for W in weights if W.shape[0] == W.shape[1]]
    oblong = [W if W.shape[0] > W.shape[1] else W.T.contiguous() for W in weights if W.shape[0] != W.shape[1]]
    svd = sum(clock(lambda W=W: torch.linalg.svd(W, full_matrices=False))[0] for W in square)
    factors = [torch.linalg.svd(W, full_matrices=False) for W in square]
    uv = sum(clock(lambda U=U, Vh=Vh: U @ Vh)[0] for U, _, Vh in factors)
    grams = [W.mT @ W for W in oblong]
    gram = sum(clock(lambda W=W: W.mT @ W)[0] for W in oblong)
    eigh = sum(clock(lambda G=G: torch.linalg.eigh(G))[0] for G in grams)
    product = sum(clock(lambda W=W, G=G: W @ G)[0] for W, G in zip(oblong, grams))
    counter = FlopCounterMode(display=False)
    with counter:
        train_step()
    flops = counter.get_total_flops()
    total = svd + uv + gram + eigh + product
    products = sum(4 * W.shape[0] * W.shape[1] ** 2 for W in oblong)  # XᵀX and X·M: 2mn² multiply-adds each
    print(f"  calls alone: sgesdd on {len(square)} square {svd:.2f} s, their U·Vᵀ {uv:.2f} s; on {len(oblong)} oblong: "
          f"XᵀX {gram:.2f} s, ssyevd {eigh:.2f} s, X·M {product:.2f} s; total {total:.2f} s = {total / step:.2f} steps")
    print(f"  step: {flops / 1e9:.0f} GFLOP in {step:.2f} s = {flops / 1e9 / step:.0f} GFLOP/s; XᵀX and X·M: "
          f"{products / 1e9:.0f} GFLOP in {gram + product:.2f} s = {products / 1e9 / (gram + product):.0f} GFLOP/s",
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("all", "matrices", "model"), default="all")
    parser.add_argument("--sizes", default="256,512,1024,2048,4096", help="comma-separated n (square n×n, tall 4n×n)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians are reported")
    parser.add_argument("--threads", default="1", help="torch CPU threads; the model part runs each of a list (1,2)")
    parser.add_argument("--anchors", default=",".join(ANCHORS), help=f"comma-separated, of {', '.join(ANCHORS)}")
    parser.add_argument("--exact-max", type=int, default=2048, help="largest n with a float64 SVD reference")
    parser.add_argument("--device", default="cpu", help="cpu | cuda")
    args = parser.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    anchors = {name: ANCHORS[name] for name in args.anchors.split(",")}
    torch.set_num_threads(threads[0])
    device = torch.device(args.device)
    clock = Clock(device)
    warnings.simplefilter("ignore")
    started = time.perf_counter()
    print(f"torch {torch.__version__}, device {device}"
          + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else f", {threads[0]} thread(s)")
          + f", float32, {args.rounds} interleaved rounds, medians; ratio = default / anchor time")
    if args.part in ("all", "matrices"):
        matrix_table([int(n) for n in args.sizes.split(",")], args.rounds, device, clock, anchors, args.exact_max)
    if args.part in ("all", "model"):
        for count in threads if device.type == "cpu" else threads[:1]:
            torch.set_num_threads(count)
            whole_model(args.rounds, device, clock, count)
    print(f"total {time.perf_counter() - started:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
