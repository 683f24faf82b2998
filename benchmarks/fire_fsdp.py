"""FIRE under FSDP2: a model of equal square layers on 1 process and on 2 ranks (CPU seconds and peak memory
per rank); per matrix, the sharded Gram route against gathering the matrix; and a projection, from the
measured costs, of FIRE on 1B, 7B and 70B models with 8 and 64 ranks.

Equal layers: ``apply_fire`` (default options) once on ``--layers`` square ``--width`` Linear layers, in one
process (plain parameters: LAPACK's fastest exact polar factor) and on ``--ranks`` gloo ranks (``fully_shard``-
style ``Shard(0)`` DTensors: each layer's ``eigh`` on one rank, round robin), one thread per process; the
process CPU time of each rank (the slowest is shown) against the one process's.

Each rank holds ``m/r`` rows of an ``m × n`` weight (a ``Shard(0)`` DTensor on a gloo mesh, one thread
per rank). Sharded: :func:`plasticity_callbacks.distributed.sharded_fire.sharded_fire` (an all-reduce of the
``n × n`` Gram matrix, a float64 ``eigh``, this rank's rows times ``G^{-1/2}``; a wide matrix is gathered
by it). Gathered: ``full_tensor()`` (all-gather), the exact polar factor of the whole matrix by float64
SVD, this rank's rows kept. Peak memory: the rise of the rank's peak resident set (``VmHWM`` after
``/proc/self/clear_refs``) above its resident set before the call, so it counts what the call
allocates, not the shard it already holds.

    python benchmarks/fire_fsdp.py                 # 8 layers of 768², then 2 ranks per matrix, shapes up to 2048
    python benchmarks/fire_fsdp.py --quick         # small shapes, seconds

Timings on a shared CPU are indicative; nothing asserts them.
"""
from __future__ import annotations

import argparse
import json
import math
import os
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
    options = FIREOptions(method="svd")
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
        rows.append(dict(m=m, n=n, route="gram" if m >= n else "gather", sharded_s=float(times[0]),
                         gathered_s=float(times[1]), sharded_mib=float(times[2]), gathered_mib=float(times[3]),
                         shard_mib=m * n * 4 / world / 2**20))
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def measure(shapes, world: int) -> list[dict]:
    return run_ranks(_worker, world, shapes)


def _layers_worker(rank: int, world: int, port: int, layers: int, width: int, out: str) -> None:
    """``apply_fire`` once on ``layers`` square Linear layers: one process (``world == 1``, plain parameters) or
    ``Shard(0)`` DTensors on ``world`` gloo ranks. Rank 0 writes the slowest rank's CPU seconds, the largest
    peak, and a checksum of the weights (equal results on both sides)."""
    torch.set_num_threads(1)
    from plasticity_callbacks.functional.isometry import FIREOptions
    from plasticity_callbacks.model_map import Selection
    from plasticity_callbacks.ops.fire import apply_fire

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (world,))
        for layer in model:
            layer.weight = nn.Parameter(distribute_tensor(layer.weight.detach(), mesh, [Shard(0)]))
        dist.barrier()
    selection = Selection(include_head=True)
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


def equal_layers(layers: int, width: int, world: int) -> None:
    one = run_ranks(_layers_worker, 1, layers, width)
    many = run_ranks(_layers_worker, world, layers, width)
    print(f"FIRE once on {layers} square {width}x{width} layers (default options), process CPU seconds, 1 thread each")
    print(f"{'processes':>9} {'CPU s per rank':>15} {'ratio':>6} {'peak extra MiB per rank':>24} {'weights checksum':>18}")
    for world_, r in ((1, one), (world, many)):
        print(f"{world_:>9} {r['seconds']:>15.3f} {r['seconds'] / one['seconds']:>6.2f} {r['mib']:>24.1f} "
              f"{r['checksum']:>18.9f}")
    print(f"model weights: {layers * width * width * 4 / 2**20:.1f} MiB (float32); shard per rank: "
          f"{layers * width * width * 4 / world / 2**20:.1f} MiB\n")


# --------------------------------------------------------------------------------- the projection

# Llama-style decoders: (hidden d, layers, key/value width, MLP width); FIRE treats q, k, v, o, gate, up, down.
MODELS = {"1B": (2048, 16, 512, 8192), "7B": (4096, 32, 4096, 11008), "70B": (8192, 80, 1024, 28672)}
BANDWIDTH = {8: 100e9, 64: 25e9}  # bytes/s per rank: NVLink-class inside a node of 8; 200 Gb/s InfiniBand across


def fit_costs(rows: list[dict], world: int) -> dict[str, float]:
    """Seconds per unit of work, fitted on the measured matrices (least squares through the origin):
    Gram route ``a·n³ + b·(m/r)·n²`` (eigh of ``n × n``; Gram and product of the local rows), gathered
    ``c·m·n·min(m,n)`` (the SVD of the whole matrix)."""
    gram = [r for r in rows if r["route"] == "gram"]
    X = torch.tensor([[r["n"] ** 3, r["m"] / world * r["n"] ** 2] for r in gram], dtype=torch.float64)
    y = torch.tensor([r["sharded_s"] for r in gram], dtype=torch.float64)
    a, b = torch.linalg.lstsq(X, y[:, None]).solution.flatten().clamp_min(0).tolist()
    work = torch.tensor([r["m"] * r["n"] * min(r["m"], r["n"]) for r in rows], dtype=torch.float64)
    c = float((work * torch.tensor([r["gathered_s"] for r in rows], dtype=torch.float64)).sum() / work.square().sum())
    return {"a": a, "b": b, "c": c}


def project(costs: dict[str, float], model: str, ranks: int) -> dict[str, float]:
    """Seconds and peak extra GiB per rank for one FIRE application on every block matrix, sequentially."""
    d, layers, kv, ffn = MODELS[model]
    shapes = [(d, d), (kv, d), (kv, d), (d, d), (ffn, d), (ffn, d), (d, ffn)]  # (out, in): q k v o gate up down
    bandwidth = BANDWIDTH[ranks]
    seconds = peak = gathered_seconds = gathered_peak = 0.0
    for m, n in shapes:
        ring = (ranks - 1) / ranks
        gather_s = costs["c"] * m * n * min(m, n) + ring * m * n * 4 / bandwidth
        gather_mem = 8 * m * n * 3 + 8 * min(m, n) ** 2  # float64 matrix, U, U·Vh; Vh
        if m >= n:  # Gram route: all-reduce n² float64 (twice: G and the check of the result)
            # each eigh on one rank, round robin over the matrices (all of one layer's tall ones share n = d);
            # a reduce of G to its owner and a broadcast of G^-1/2 (each as much traffic as half an all-reduce)
            own = costs["a"] * n**3 / ranks + costs["b"] * m / ranks * n**2 + 2 * ring * 8 * n * n / bandwidth
            mem = 8 * (m / ranks) * n * 2 + 8 * n * n * 4  # local rows and new rows; G, eigenvectors, G^-1/2, received
        else:  # wide: gathered by the sharded path too
            own, mem = gather_s, gather_mem
        seconds += layers * own
        peak = max(peak, mem)
        gathered_seconds += layers * gather_s
        gathered_peak = max(gathered_peak, gather_mem)
    params = layers * sum(m * n for m, n in shapes)
    return {"seconds": seconds, "peak_gib": peak / 2**30, "gathered_seconds": gathered_seconds,
            "gathered_peak_gib": gathered_peak / 2**30, "shard_gib": params * 2 / ranks / 2**30}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="small shapes only")
    parser.add_argument("--layers", type=int, default=8, help="equal square layers: how many")
    parser.add_argument("--width", type=int, default=768, help="equal square layers: their width")
    parser.add_argument("--layers-only", action="store_true", help="the equal-layers comparison alone")
    args = parser.parse_args()
    equal_layers(args.layers, args.width, args.ranks)
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
    costs = fit_costs(rows, args.ranks)
    print(f"\nfitted on this CPU: eigh {costs['a']:.3g} s/n³, local products {costs['b']:.3g} s/(m/r·n²), "
          f"SVD {costs['c']:.3g} s/(m·n·min)")
    print("Projection (one FIRE application on q,k,v,o,gate,up,down of every layer; Llama-style shapes; each tall\n"
          "matrix's eigh on one rank, round robin, at the fitted CPU rate, one thread; communication at the stated\n"
          "bandwidth per rank, ring collectives; bf16 parameter shards; wide matrices (down, GQA k/v) gathered):")
    print(f"{'model':>6} {'ranks':>6} {'GB/s':>5} {'sharded s':>10} {'gathered s':>11} {'speedup':>8} "
          f"{'shard GiB':>10} {'peak extra GiB':>15} {'gathered GiB':>13}")
    for model in MODELS:
        for ranks in BANDWIDTH:
            p = project(costs, model, ranks)
            print(f"{model:>6} {ranks:>6} {BANDWIDTH[ranks] / 1e9:>5.0f} {p['seconds']:>10.0f} "
                  f"{p['gathered_seconds']:>11.0f} {p['gathered_seconds'] / p['seconds']:>7.2f}x "
                  f"{p['shard_gib']:>10.2f} {p['peak_gib']:>15.2f} {p['gathered_peak_gib']:>13.2f}")


if __name__ == "__main__":
    main()
