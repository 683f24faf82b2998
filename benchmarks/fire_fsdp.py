"""FIRE under FSDP2: equal square layers on 1 process and on 2 ranks, repeated (CPU seconds and peak memory per
rank); per matrix, the sharded route against gathering the matrix; and a projection, from measured rates, of FIRE
on 1B, 7B and 70B models with 8 and 64 ranks.

Equal layers: ``apply_fire`` (default options) on ``--layers`` square ``--width`` Linear layers, in one process
(plain parameters: LAPACK's fastest exact polar factor) and on ``--ranks`` gloo ranks (``fully_shard``-style
``Shard(0)`` DTensors: each layer's ``eigh`` on one rank, round robin), one thread per process, alternately,
``--repeats`` times under glibc's usual allocator, then once more (``mmap``) with every block of 64 KiB or more a
fresh mmap, returned when freed, for the rise of the peak resident set (each matrix buffer then costs page faults,
which the usual allocator's reuse of freed blocks avoids; its ratio is printed too). Each process first runs FIRE
once untimed on a copy of the layers (library start-up is not FIRE's cost), then the measured call: its process
CPU time (the slowest rank's).

Per matrix: each rank holds ``m/r`` rows of an ``m × n`` weight (a ``Shard(0)`` DTensor on a gloo mesh, one
thread per rank). Sharded: :func:`plasticity_callbacks.distributed.sharded_fire.sharded_fire` (tall or square:
the ``n × n`` Gram matrix reduced to one rank, its ``eigh`` there, ``G^{-1/2}`` broadcast; wide: the same on
``Xᵀ`` after an all-to-all to column shards, and back). Gathered: ``full_tensor()`` (all-gather), the exact
polar factor of the whole matrix by float64 SVD, this rank's rows kept. Peak memory: the rise of the rank's peak
resident set (``VmHWM`` after ``/proc/self/clear_refs``) above its resident set before the call.

Projection: the rates of a float64 ``eigh`` with ``G^{-1/2}`` (``s/n³``) and of a rank's Gram matrix and row
product (``s/(rows·n²)``), each timed on its own here at ``n`` = 256…1024 and fitted through the origin; the
blocks of a Llama-shaped model dealt round robin over the ranks (the busiest rank's ``eigh`` work counts).

    python benchmarks/fire_fsdp.py                 # 5 x (8 layers of 768²), per matrix up to 2048, projection
    python benchmarks/fire_fsdp.py --layers-only   # the equal-layers comparison alone
    python benchmarks/fire_fsdp.py --quick         # small shapes, seconds

Timings on a shared CPU are indicative; nothing asserts them.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from rank_processes import measured, run_ranks

SHAPES = [(1024, 256), (512, 512), (2048, 512), (1024, 1024), (2048, 1024), (512, 2048), (2048, 2048)]
QUICK = [(256, 64), (256, 128), (128, 256), (512, 256)]


def _worker(rank: int, world: int, port: int, shapes, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from plasticity_callbacks.model_map import WeightView
    from plasticity_callbacks.distributed.sharded_fire import sharded_fire
    from plasticity_callbacks.distributed.sharding import local_span
    from plasticity_callbacks.functional.isometry import FIREOptions

    mesh = init_device_mesh("cpu", (world,))
    options = FIREOptions(method="svd")  # the float64 route throughout (the ill-conditioned case)
    rows = []
    for m, n in shapes:
        weight = torch.randn(m, n, generator=torch.Generator().manual_seed(m * 7919 + n)) / math.sqrt(n)
        holder = nn.Module()
        holder.weight = nn.Parameter(distribute_tensor(weight, mesh, [Shard(0)]))
        view = WeightView("weight", holder, holder.weight, role="other", kind="matrix")
        del weight

        @torch.no_grad()
        def gathered():
            start, stop = local_span(holder.weight)
            full = holder.weight.full_tensor().double()
            U, _, Vh = torch.linalg.svd(full, full_matrices=False)
            holder.weight.to_local().copy_((U[start:stop] @ Vh) * math.sqrt(m / n))

        dist.barrier()
        t_sharded, mib_sharded = measured(lambda: sharded_fire([view], options))
        dist.barrier()
        t_gathered, mib_gathered = measured(gathered)
        times = torch.tensor([t_sharded, t_gathered, mib_sharded, mib_gathered], dtype=torch.float64)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)  # the slowest rank and the largest peak
        rows.append(dict(m=m, n=n, route="gram" if m >= n else "column", sharded_s=float(times[0]),
                         gathered_s=float(times[1]), sharded_mib=float(times[2]), gathered_mib=float(times[3]),
                         shard_mib=m * n * 4 / world / 2**20))
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def measure(shapes, world: int) -> list[dict]:
    return run_ranks(_worker, world, shapes)


def _layers_worker(rank: int, world: int, port: int, layers: int, width: int, out: str) -> None:
    """``apply_fire`` once on ``layers`` square Linear layers: one process (``world == 1``, plain parameters) or
    ``Shard(0)`` DTensors on ``world`` gloo ranks, after one untimed application to a copy. Rank 0 writes the
    slowest rank's CPU seconds, the largest peak, and a checksum of the weights (equal results on both sides)."""
    torch.set_num_threads(1)
    from plasticity_callbacks.functional.isometry import FIREOptions
    from plasticity_callbacks.model_map import Selection
    from plasticity_callbacks.ops.fire import apply_fire

    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (world,))

    def layers_of_width() -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
        if world > 1:
            for layer in model:
                layer.weight = nn.Parameter(distribute_tensor(layer.weight.detach(), mesh, [Shard(0)]))
        return model

    selection = Selection(include_head=True)

    apply_fire(layers_of_width(), None, FIREOptions(), selection)  # warm-up: LAPACK's and gloo's first calls
    model = layers_of_width()
    if world > 1:
        dist.barrier()
    seconds, mib = measured(lambda: apply_fire(model, None, FIREOptions(), selection), cpu=True)
    full = [layer.weight.full_tensor() if world > 1 else layer.weight for layer in model]
    checksum = float(sum((w.detach().double() * torch.arange(w.numel()).view_as(w).sin()).sum() for w in full))
    if world > 1:
        numbers = torch.tensor([seconds, mib], dtype=torch.float64)
        dist.all_reduce(numbers, op=dist.ReduceOp.MAX)  # the slowest rank and the largest peak
        seconds, mib = numbers.tolist()
        dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(dict(seconds=seconds, mib=mib, checksum=checksum)))


def equal_layers(layers: int, width: int, world: int, repeats: int) -> None:
    print(f"FIRE once on {layers} square {width}x{width} layers (default options), process CPU seconds of the slowest "
          f"rank, 1 thread each;\n1 process and {world} ranks alternately, {repeats} times (load: 1-minute average "
          f"before the pair)")
    print(f"{'run':>4} {'load':>5} {'1 process s':>12} {f'{world} ranks s':>11} {'ratio':>6} "
          f"{'peak extra MiB (1 / per rank)':>30} {'checksum rel. diff':>19}")
    ratios = []
    for run in range(repeats + 1):
        memory = run == repeats  # the last pair: every block of 64 KiB or more a fresh mmap, for the peak memory
        load = os.getloadavg()[0]
        one = run_ranks(_layers_worker, 1, layers, width, fixed_mmap_threshold=memory)
        many = run_ranks(_layers_worker, world, layers, width, fixed_mmap_threshold=memory)
        ratios.append(many["seconds"] / one["seconds"])
        differ = abs(many["checksum"] - one["checksum"]) / abs(one["checksum"])  # float32 rounding: equal results
        peaks = f"{one['mib']:>14.1f} / {many['mib']:<13.1f}" if memory else f"{'':>30}"
        print(f"{'mmap' if memory else run + 1:>4} {load:>5.1f} {one['seconds']:>12.3f} {many['seconds']:>11.3f} "
              f"{ratios[-1]:>6.2f} {peaks} {differ:>19.1e}")
    print(f"median ratio {world} ranks / 1 process: {statistics.median(ratios[:-1]):.2f} "
          f"(runs 1-{repeats}: {', '.join(f'{r:.2f}' for r in ratios[:-1])}; glibc's usual allocator)")
    print(f"model weights: {layers * width * width * 4 / 2**20:.1f} MiB (float32); shard per rank: "
          f"{layers * width * width * 4 / world / 2**20:.1f} MiB\n")


# --------------------------------------------------------------------------------- the projection

# Llama-style decoders: (hidden d, layers, key/value width, MLP width); FIRE treats q, k, v, o, gate, up, down.
MODELS = {"1B": (2048, 16, 512, 8192), "7B": (4096, 32, 4096, 11008), "70B": (8192, 80, 1024, 28672)}
BANDWIDTH = {8: 100e9, 64: 25e9}  # bytes/s per rank: NVLink-class inside a node of 8; 200 Gb/s InfiniBand across


def _per_call(fn, calls: int = 3) -> float:
    """The median process CPU seconds of ``fn()`` over ``calls`` calls, after one untimed call."""
    fn()
    times = []
    for _ in range(calls):
        started = time.process_time()
        fn()
        times.append(time.process_time() - started)
    return statistics.median(times)


def fit_rates(sizes: list[int], world: int) -> dict[str, float]:
    """Seconds per unit of work on one thread, each timed on its own and fitted through the origin (least squares
    weighted to the large sizes): the owner's ``eigh`` of the float64 ``n × n`` Gram matrix with ``G^{-1/2}``
    (``a``, s/n³), a rank's float64 Gram matrix of its ``n/world`` rows and their product with ``G^{-1/2}``
    (``b``, s/(rows·n²)), and the whole matrix's float64 SVD (``c``, s/(m·n·min))."""
    from plasticity_callbacks.distributed.sharded_fire import _gram

    torch.set_num_threads(1)
    work = {"a": [], "b": [], "c": []}
    for n in sizes:
        X = torch.randn(n, n, dtype=torch.float64) / math.sqrt(n)
        G = X.mT @ X
        rows = X[: n // world]

        def decompose():
            eigenvalues, V = torch.linalg.eigh(G)
            return _gram(V.mul_(eigenvalues.rsqrt().sqrt()).mT)

        work["a"].append((n**3, _per_call(decompose)))
        work["b"].append((rows.shape[0] * n * n, _per_call(lambda: (_gram(rows), rows @ G))))
        work["c"].append((n**3, _per_call(lambda: torch.linalg.svd(X, full_matrices=False))))
    return {k: sum(u * t for u, t in v) / sum(u * u for u, _ in v) for k, v in work.items()}


def project(rates: dict[str, float], model: str, ranks: int) -> dict[str, float]:
    """Seconds and peak extra GiB on the busiest rank for one FIRE application on every block matrix."""
    d, layers, kv, ffn = MODELS[model]
    shapes = [(d, d), (kv, d), (kv, d), (d, d), (ffn, d), (ffn, d), (d, ffn)]  # (out, in): q k v o gate up down
    bandwidth, ring = BANDWIDTH[ranks], (ranks - 1) / ranks
    owned = [0.0] * ranks  # each rank's eigh work: blocks dealt round robin, in order
    rows_work = traffic = peak = gathered_seconds = gathered_peak = 0.0
    for index, (m, n) in enumerate(shapes * layers):
        tall, small = max(m, n), min(m, n)  # Y = X or Xᵀ: its Gram matrix is the smaller side's
        owned[index % ranks] += rates["a"] * small**3
        rows_work += rates["b"] * tall / ranks * small**2  # Gram matrix and product of this rank's rows
        # a reduce of G to its owner and a broadcast of G^-1/2, n² float64 each; a wide block's column shards
        # (float32) go there twice and back once
        traffic += 2 * ring * 8 * small**2 + (3 * ring * 4 * m * n / ranks if m < n else 0.0)
        mem = 8 * small**2 * 4 + 8 * tall / ranks * small * 2 + (4 * m * n / ranks * 3 if m < n else 0)
        peak = max(peak, mem)
        gathered_seconds += rates["c"] * m * n * small + ring * m * n * 4 / bandwidth
        gathered_peak = max(gathered_peak, 8 * m * n * 3 + 8 * small**2)  # float64 matrix, U, U·Vh; Vh
    params = layers * sum(m * n for m, n in shapes)
    return {"seconds": max(owned) + rows_work + traffic / bandwidth, "eigh_seconds": max(owned),
            "peak_gib": peak / 2**30, "gathered_seconds": gathered_seconds,
            "gathered_peak_gib": gathered_peak / 2**30, "shard_gib": params * 2 / ranks / 2**30}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="small shapes only")
    parser.add_argument("--layers", type=int, default=8, help="equal square layers: how many")
    parser.add_argument("--width", type=int, default=768, help="equal square layers: their width")
    parser.add_argument("--repeats", type=int, default=5, help="equal square layers: how many runs")
    parser.add_argument("--layers-only", action="store_true", help="the equal-layers comparison alone")
    args = parser.parse_args()
    equal_layers(args.layers, args.width, args.ranks, args.repeats)
    if args.layers_only:
        return
    shapes = QUICK if args.quick else SHAPES
    rows = measure(shapes, args.ranks)
    print(f"FIRE per matrix under FSDP2, {args.ranks} gloo ranks on CPU, 1 thread each (slowest rank, largest peak)")
    print(f"{'m x n':>12} {'route':>6} {'sharded s':>10} {'gathered s':>11} {'speedup':>8} "
          f"{'shard MiB':>10} {'sharded MiB':>12} {'gathered MiB':>13} {'memory ratio':>13}")
    for r in rows:
        print(f"{r['m']:>5} x {r['n']:<5} {r['route']:>6} {r['sharded_s']:>10.3f} {r['gathered_s']:>11.3f} "
              f"{r['gathered_s'] / r['sharded_s']:>7.2f}x {r['shard_mib']:>10.1f} {r['sharded_mib']:>12.1f} "
              f"{r['gathered_mib']:>13.1f} {r['gathered_mib'] / max(r['sharded_mib'], 1e-3):>12.2f}x")
    rates = fit_rates([128, 256, 384] if args.quick else [256, 512, 768, 1024], args.ranks)
    print(f"\nrates on this CPU, 1 thread, float64, each timed on its own: eigh + G^-1/2 {rates['a']:.3g} s/n³, "
          f"Gram + product of a rank's rows {rates['b']:.3g} s/(rows·n²), SVD {rates['c']:.3g} s/(m·n·min)")
    print("Projection (one FIRE application on q,k,v,o,gate,up,down of every layer; Llama-style shapes; blocks dealt\n"
          "round robin, the busiest rank's eigh work; Gram matrices of the smaller side (wide ones by columns);\n"
          "communication at the stated bandwidth per rank, ring collectives; bf16 parameter shards):")
    print(f"{'model':>6} {'ranks':>6} {'GB/s':>5} {'sharded s':>10} {'of it eigh':>11} {'gathered s':>11} "
          f"{'speedup':>8} {'shard GiB':>10} {'peak extra GiB':>15} {'gathered GiB':>13}")
    for model in MODELS:
        for ranks in BANDWIDTH:
            p = project(rates, model, ranks)
            print(f"{model:>6} {ranks:>6} {BANDWIDTH[ranks] / 1e9:>5.0f} {p['seconds']:>10.0f} {p['eigh_seconds']:>11.0f} "
                  f"{p['gathered_seconds']:>11.0f} {p['gathered_seconds'] / p['seconds']:>7.2f}x "
                  f"{p['shard_gib']:>10.2f} {p['peak_gib']:>15.2f} {p['gathered_peak_gib']:>13.2f}")


if __name__ == "__main__":
    main()
