"""FIRE under FSDP2: equal square layers on 1 process and on 2 ranks, interleaved (process CPU seconds of the
slowest rank, median and spread, peak memory per rank); per matrix, the sharded route against gathering the
matrix; and a projection, from rates timed here, of FIRE on 1B, 7B and 70B models with 8 and 64 ranks.

Equal layers: ``apply_fire`` (default options) on ``--layers`` square ``--width`` Linear layers, in one process
(plain parameters: LAPACK's fastest exact polar factor, a float32 SVD) and on ``--ranks`` gloo ranks
(``fully_shard``-style ``Shard(0)`` DTensors: each layer's ``eigh`` on one rank, round robin), one thread per
process. One set of ranks does both, ``--repeats`` times, interleaved with the order flipped each repetition so
that a drift in the machine's load hits both sides: "1 process" is rank 0 alone on plain weights while the other
ranks wait at a barrier. Each call runs on a fresh copy after one untimed application of each (library start-up
is not FIRE's cost). The figure is the process CPU time (user + system, every thread: gloo's included) of the
slowest rank, which a busy machine does not inflate the way it inflates wall time (a collective waits until
every rank has a CPU); the wall ratio is printed beside it. Printed: each repetition, then the median, IQR and
min-max of each side and of the per-repetition ratio. Peak memory: one more application with every block of 64
KiB or more a fresh mmap, returned when freed, so the rise of the peak resident set is the call's own. Then one
round's collectives at ``n = --width``, per block (reduce + broadcast, what ``sharded_fire`` runs on CPU) and
batched (reduce-scatter + all-gather): their CPU and wall time, and the bandwidth the projection uses.

Per matrix: each rank holds ``m/r`` rows of an ``m × n`` weight (a ``Shard(0)`` DTensor on a gloo mesh, one
thread per rank). Sharded: :func:`plasticity_callbacks.distributed.sharded_fire.sharded_fire` (tall or square:
the ``n × n`` Gram matrix reduced to one rank, its ``eigh`` there, ``G^{-1/2}`` broadcast; wide: the same on
``Xᵀ`` after an all-to-all to column shards, and back). Gathered: ``full_tensor()`` (all-gather), the exact
polar factor of the whole matrix by float64 SVD, this rank's rows kept. Peak memory: the rise of the rank's peak
resident set (``VmHWM`` after ``/proc/self/clear_refs``) above its resident set before the call.

Projection: the rates of a float64 ``eigh`` with ``G^{-1/2}`` (``s/n³``) and of a rank's Gram matrix and row
product (``s/(rows·n²)``), each timed on its own here at ``n`` = 256…1024 and fitted through the origin, and the
reduce + broadcast bandwidth measured above; the blocks of a Llama-shaped model dealt round robin over the ranks
(the busiest rank's ``eigh`` work counts); memory per rank from the matrices each rank holds at once.

    python benchmarks/fire_fsdp.py                  # 7 x (8 layers of 768²), per matrix up to 2048, projection
    python benchmarks/fire_fsdp.py --layers-only    # the equal-layers comparison alone
    python benchmarks/fire_fsdp.py --no-per-matrix  # equal layers and the projection
    python benchmarks/fire_fsdp.py --quick          # small shapes, seconds

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


def _layers_worker(rank: int, world: int, port: int, layers: int, width: int, repeats: int, out: str) -> None:
    """``apply_fire`` on ``layers`` square Linear layers, ``repeats`` times each way, interleaved (the order flips
    every repetition, so a drift in the machine's load hits both): one process (rank 0 alone on plain weights while
    the other ranks wait at a barrier) and ``world`` ranks (``Shard(0)`` DTensors), each on a fresh copy after one
    untimed application of both. Then the collectives of one round at ``n = width``. Rank 0 writes, per
    repetition, the process CPU seconds (one process; the slowest rank), wall seconds and the peak extra memory,
    and the largest difference of the results."""
    torch.set_num_threads(1)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from plasticity_callbacks.functional.isometry import FIREOptions
    from plasticity_callbacks.model_map import Selection
    from plasticity_callbacks.ops.fire import apply_fire

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))

    def layers_of_width(sharded: bool) -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
        if sharded:
            for layer in model:
                layer.weight = nn.Parameter(distribute_tensor(layer.weight.detach(), mesh, [Shard(0)]))
        return model

    selection, options = Selection(include_head=True), FIREOptions()

    def one_process() -> tuple[float, float, float, nn.Module]:
        model, numbers = layers_of_width(sharded=False), [math.nan] * 3
        dist.barrier()
        if rank == 0:
            started = time.perf_counter()
            cpu, mib = measured(lambda: apply_fire(model, None, options, selection), cpu=True)
            numbers = [cpu, time.perf_counter() - started, mib]
        dist.barrier()
        return (*numbers, model)

    def ranks() -> tuple[float, float, float, nn.Module]:
        model = layers_of_width(sharded=True)
        dist.barrier()
        started = time.perf_counter()
        cpu, mib = measured(lambda: apply_fire(model, None, options, selection), cpu=True)
        numbers = torch.tensor([cpu, time.perf_counter() - started, mib], dtype=torch.float64)
        dist.all_reduce(numbers, op=dist.ReduceOp.MAX)  # the slowest rank and the largest peak
        return (*numbers.tolist(), model)

    one_process(), ranks()  # warm-up: LAPACK's and gloo's first calls, library start-up
    rows = []
    for run in range(repeats):
        load = os.getloadavg()[0]
        first, second = (one_process, ranks) if run % 2 == 0 else (ranks, one_process)
        a, b = first(), second()
        (one, one_wall, one_mib, plain), (many, many_wall, many_mib, sharded) = (a, b) if run % 2 == 0 else (b, a)
        differ = max(float((s.weight.full_tensor() - p.weight).detach().abs().max()) for s, p in zip(sharded, plain))
        rows.append(dict(load=load, order="1,r" if run % 2 == 0 else "r,1", one=one, many=many, one_wall=one_wall,
                         many_wall=many_wall, one_mib=one_mib, many_mib=many_mib, differ=differ))
    result = dict(rows=rows, collectives=_round_collectives(rank, world, width))
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(result))


def _round_collectives(rank: int, world: int, n: int, calls: int = 10) -> dict[str, float]:
    """One round's traffic at ``n``: ``world`` float64 ``n × n`` matrices to their owners and back, per block (a
    reduce and a broadcast each, what ``sharded_fire`` does on CPU) and batched (one reduce-scatter, one
    all-gather): the median CPU seconds of the slowest rank and wall seconds, and the bytes each rank moves."""
    matrices = torch.randn(world, n * n, dtype=torch.float64)
    mine, everything = torch.empty(n * n, dtype=torch.float64), torch.empty(world * n * n, dtype=torch.float64)

    def per_block():
        for owner in range(world):
            dist.reduce(matrices[owner], dst=owner)
        for owner in range(world):
            dist.broadcast(matrices[owner], src=owner)

    def batched():
        dist.reduce_scatter_single(mine, matrices.view(-1))
        dist.all_gather_single(everything, mine)

    timed = {}
    for name, fn in (("per_block", per_block), ("batched", batched)):
        fn()
        cpu, wall = [], []
        for _ in range(calls):
            dist.barrier()
            started, clock = time.process_time(), time.perf_counter()
            fn()
            numbers = torch.tensor([time.process_time() - started, time.perf_counter() - clock], dtype=torch.float64)
            dist.all_reduce(numbers, op=dist.ReduceOp.MAX)
            cpu.append(float(numbers[0]))
            wall.append(float(numbers[1]))
        timed[f"{name}_cpu"], timed[f"{name}_wall"] = statistics.median(cpu), statistics.median(wall)
    # Each block: the rank's Gram matrix out (or the sum in) and G^-1/2 in (or out): 2 · 8n² bytes per rank.
    timed["bytes"] = world * 2 * 8 * n * n
    return timed


def _spread(values: list[float]) -> str:
    """``median [IQR q1-q3] (min-max)`` of ``values``."""
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else values * 3
    return f"{median:.3f} [IQR {q1:.3f}-{q3:.3f}] (min-max {min(values):.3f}-{max(values):.3f})"


def equal_layers(layers: int, width: int, world: int, repeats: int) -> dict[str, float]:
    """Print the equal-layers comparison; returns the round's collectives as measured (for the projection)."""
    print(f"FIRE once on {layers} square {width}x{width} layers (default options), 1 thread per process: process CPU "
          f"seconds (the slowest rank's),\n1 process and {world} ranks interleaved {repeats} times (order flipped "
          f"each time; load: 1-minute average before the pair)")
    print(f"{'run':>4} {'load':>5} {'order':>5} {'1 process s':>12} {f'{world} ranks s':>11} {'ratio':>6} "
          f"{'wall 1 / ranks s':>17} {'wall ratio':>11} {'max |diff|':>11}")
    result = run_ranks(_layers_worker, world, layers, width, repeats, fixed_mmap_threshold=False)
    rows = result["rows"]
    for i, r in enumerate(rows, 1):
        print(f"{i:>4} {r['load']:>5.1f} {r['order']:>5} {r['one']:>12.3f} {r['many']:>11.3f} "
              f"{r['many'] / r['one']:>6.2f} {r['one_wall']:>8.3f} / {r['many_wall']:<6.3f} "
              f"{r['many_wall'] / r['one_wall']:>11.2f} {r['differ']:>11.1e}")
    print(f"1 process CPU s:      {_spread([r['one'] for r in rows])}")
    print(f"{world} ranks CPU s:        {_spread([r['many'] for r in rows])}")
    print(f"ratio per repetition: {_spread([r['many'] / r['one'] for r in rows])}")
    print(f"wall ratio:           {_spread([r['many_wall'] / r['one_wall'] for r in rows])} (wall time counts the "
          "waits for a CPU under load)")
    memory = run_ranks(_layers_worker, world, layers, width, 1, fixed_mmap_threshold=True)["rows"][0]
    print(f"peak extra MiB (every block of 64 KiB or more a fresh mmap): 1 process {memory['one_mib']:.1f}, per "
          f"rank {memory['many_mib']:.1f}; model weights {layers * width * width * 4 / 2**20:.1f} MiB (float32), "
          f"shard per rank {layers * width * width * 4 / world / 2**20:.1f} MiB")
    c = result["collectives"]
    print(f"one round's matrices ({world} of {width}² float64, to the owners and back, {c['bytes'] / 2**20:.1f} MiB "
          f"per rank), median of 10: per block (reduce + broadcast) {c['per_block_cpu'] * 1e3:.1f} ms CPU, "
          f"{c['per_block_wall'] * 1e3:.1f} ms wall; batched (reduce-scatter + all-gather) "
          f"{c['batched_cpu'] * 1e3:.1f} ms CPU, {c['batched_wall'] * 1e3:.1f} ms wall\n")
    return c


# --------------------------------------------------------------------------------- the projection

# Llama-style decoders: (hidden d, layers, key/value width, MLP width); FIRE treats q, k, v, o, gate, up, down.
MODELS = {"1B": (2048, 16, 512, 8192), "7B": (4096, 32, 4096, 11008), "70B": (8192, 80, 1024, 28672)}
RANKS = (8, 64)


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


def project(rates: dict[str, float], bandwidth: float, model: str, ranks: int) -> dict[str, float]:
    """Seconds and peak extra GiB on the busiest rank for one FIRE application on every block matrix, from the
    timed rates and ``bandwidth`` (bytes/s a rank moves in a reduce or broadcast, measured in the run)."""
    d, layers, kv, ffn = MODELS[model]
    shapes = [(d, d), (kv, d), (kv, d), (d, d), (ffn, d), (ffn, d), (d, ffn)]  # (out, in): q k v o gate up down
    ring = (ranks - 1) / ranks
    owned = [0.0] * ranks  # each rank's eigh work: blocks dealt round robin, in order
    rows_work = traffic = peak = gathered_seconds = gathered_peak = 0.0
    blocks = shapes * layers
    for first in range(0, len(blocks), ranks):  # a round: its wide blocks' column shards are kept to its end
        round_blocks = blocks[first:first + ranks]
        kept = sum(4 * m * n / ranks for m, n in round_blocks if m < n)
        for index, (m, n) in enumerate(round_blocks, first):
            tall, small = max(m, n), min(m, n)  # Y = X or Xᵀ: its Gram matrix is the smaller side's
            owned[index % ranks] += rates["a"] * small**3
            rows_work += rates["b"] * tall / ranks * small**2  # Gram matrix and product of this rank's rows
            # a reduce of G to its owner and a broadcast of G^-1/2, n² float64 each; a wide block's column shard
            # (float32) comes once and goes back once
            traffic += 2 * ring * 8 * small**2 + (2 * ring * 4 * m * n / ranks if m < n else 0.0)
            # G, eigenvectors, eigh's workspace, G^-1/2 (n² float64 each); a float64 copy of the rows and the product
            peak = max(peak, kept + 8 * small**2 * 4 + 8 * tall / ranks * small * 2)
            gathered_seconds += rates["c"] * m * n * small + ring * m * n * 4 / bandwidth
            gathered_peak = max(gathered_peak, 8 * m * n * 3 + 8 * small**2)  # float64 matrix, U, U·Vh; Vh
    params = layers * sum(m * n for m, n in shapes)
    return {"seconds": max(owned) + rows_work + traffic / bandwidth, "eigh_seconds": max(owned),
            "traffic_seconds": traffic / bandwidth, "peak_gib": peak / 2**30, "gathered_seconds": gathered_seconds,
            "gathered_peak_gib": gathered_peak / 2**30, "shard_gib": params * 2 / ranks / 2**30}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="small shapes only")
    parser.add_argument("--layers", type=int, default=8, help="equal square layers: how many")
    parser.add_argument("--width", type=int, default=768, help="equal square layers: their width")
    parser.add_argument("--repeats", type=int, default=7, help="equal square layers: how many interleaved runs")
    parser.add_argument("--layers-only", action="store_true", help="the equal-layers comparison alone")
    parser.add_argument("--no-per-matrix", action="store_true", help="equal layers and the projection")
    args = parser.parse_args()
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} (1, 5, 15 min) on {os.cpu_count()} CPUs\n")
    collectives = equal_layers(args.layers, args.width, args.ranks, args.repeats)
    if args.layers_only:
        return
    if not args.no_per_matrix:
        per_matrix(QUICK if args.quick else SHAPES, args.ranks)
    rates = fit_rates([128, 256, 384] if args.quick else [256, 512, 768, 1024], args.ranks)
    bandwidth = collectives["bytes"] / collectives["per_block_wall"]
    print(f"rates on this CPU, 1 thread, float64, each timed on its own: eigh + G^-1/2 {rates['a']:.3g} s/n³, "
          f"Gram + product of a rank's rows {rates['b']:.3g} s/(rows·n²), SVD {rates['c']:.3g} s/(m·n·min);\n"
          f"reduce + broadcast measured above: {bandwidth / 1e9:.2f} GB/s per rank (gloo over loopback TCP)")
    print("Projection (one FIRE application on q,k,v,o,gate,up,down of every layer; Llama-style shapes; blocks dealt\n"
          "round robin, the busiest rank's eigh work; Gram matrices of the smaller side (wide ones by columns);\n"
          "communication at the measured bandwidth per rank, ring collectives; bf16 parameter shards):")
    print(f"{'model':>6} {'ranks':>6} {'sharded s':>10} {'of it eigh':>11} {'of it comm':>11} {'gathered s':>11} "
          f"{'speedup':>8} {'shard GiB':>10} {'peak extra GiB':>15} {'gathered GiB':>13}")
    for model in MODELS:
        for ranks in RANKS:
            p = project(rates, bandwidth, model, ranks)
            print(f"{model:>6} {ranks:>6} {p['seconds']:>10.0f} {p['eigh_seconds']:>11.0f} {p['traffic_seconds']:>11.0f} "
                  f"{p['gathered_seconds']:>11.0f} {p['gathered_seconds'] / p['seconds']:>7.2f}x "
                  f"{p['shard_gib']:>10.2f} {p['peak_gib']:>15.2f} {p['gathered_peak_gib']:>13.2f}")


def per_matrix(shapes, world: int) -> None:
    rows = measure(shapes, world)
    print(f"FIRE per matrix under FSDP2, {world} gloo ranks on CPU, 1 thread each (slowest rank, largest peak)")
    print(f"{'m x n':>12} {'route':>6} {'sharded s':>10} {'gathered s':>11} {'speedup':>8} "
          f"{'shard MiB':>10} {'sharded MiB':>12} {'gathered MiB':>13} {'memory ratio':>13}")
    for r in rows:
        print(f"{r['m']:>5} x {r['n']:<5} {r['route']:>6} {r['sharded_s']:>10.3f} {r['gathered_s']:>11.3f} "
              f"{r['gathered_s'] / r['sharded_s']:>7.2f}x {r['shard_mib']:>10.1f} {r['sharded_mib']:>12.1f} "
              f"{r['gathered_mib']:>13.1f} {r['gathered_mib'] / max(r['sharded_mib'], 1e-3):>12.2f}x")
    print()


if __name__ == "__main__":
    main()
