"""AdaptiveSVDSwitch under FSDP2, per matrix: an SVD cycle and a step's projection on the shards, against the
same work on a whole matrix held by every rank (what each DDP rank does); time and peak memory per rank.

Each rank holds ``m/r`` rows of an ``m × n`` weight and of its gradient (``Shard(0)`` DTensors on a gloo
mesh, one thread per rank). Sharded cycle: ``AdaptiveSVDSwitch._sharded_cycle`` (weight, gradient and
previous ``U`` gathered; one rank computes the SVD and the decision; ``U`` scattered by rows; gradient
projected). Whole: every rank holds ``W`` and ``∇W`` and computes the SVD, the decision and the
projection itself. A model row runs ``--matrices`` matrices of one shape in one cycle: the SVDs are spread
over the ranks, so the sharded cycle's time falls with more ranks while the whole one does not. Step: the
projection ``U_m U_mᵀ∇W`` between cycles, sharded (one all-reduce of ``r × n``) against whole. Peak
memory: the rise of the rank's peak resident set above its resident set before the call (as
``benchmarks/fire_fsdp.py`` measures it), largest over the ranks; times are the slowest rank's.

    python benchmarks/adaptive_svd_fsdp.py            # shapes up to 2048 × 1024
    python benchmarks/adaptive_svd_fsdp.py --quick    # small shapes, seconds

Timings on a shared CPU are indicative; nothing asserts them.
"""
from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn

from rank_processes import measured, run_ranks

SHAPES = [(512, 512), (1024, 1024), (2048, 512), (2048, 1024)]
QUICK = [(128, 128), (256, 64)]


def _worker(rank: int, world: int, port: int, shapes, matrices: int, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from plasticity_callbacks import AdaptiveSVDSwitch
    from plasticity_callbacks.callbacks.adaptive_svd import _Matrix
    from plasticity_callbacks.ops.factorization import project_onto
    from plasticity_callbacks.model_map import WeightView
    from plasticity_callbacks.distributed.sharded_subspace import project_sharded_
    from plasticity_callbacks.functional.subspace import decide_mode, svd_triplets

    mesh = init_device_mesh("cpu", (world,))
    trainer = SimpleNamespace(optimizers=[])
    rows = []

    def slowest(*values):
        numbers = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(numbers, op=dist.ReduceOp.MAX)
        return numbers.tolist()

    for m, n in shapes:
        g = min(m, n)
        switch = AdaptiveSVDSwitch(thresholds={"clobber_alignment": 0.0}, initial_rank=g // 4, save_figure=False)
        generator = torch.Generator().manual_seed(m * 7919 + n)
        weights = [torch.randn(m, n, generator=generator) / math.sqrt(n) for _ in range(matrices)]
        grads = [torch.randn(m, n, generator=generator) for _ in range(matrices)]
        sharded = []
        for W, G in zip(weights, grads):
            holder = nn.Module()
            holder.weight = nn.Parameter(distribute_tensor(W, mesh, [Shard(0)]))
            holder.weight.grad = distribute_tensor(G, mesh, [Shard(0)])
            sharded.append(_Matrix(WeightView("weight", holder, holder.weight, role="other", kind="matrix"),
                                   "weight", g))

        def sharded_cycle(which):
            for index in which:
                switch._sharded_cycle(trainer, sharded[index], index, step=1)

        def whole_cycle(which):  # every rank: the whole matrix and gradient, its own SVD, decision, projection
            for index in which:
                W, G = weights[index], grads[index].clone()
                svd = svd_triplets(W, top=g - g // 4)
                decide_mode(W, svd, svd.U, svd.S, G, g // 4, "full", clobber_alignment=0.0)
                project_onto(G, svd.U[:, g - g // 4:])

        sharded_cycle(range(matrices))  # a first cycle: U exists, the next one gathers it (the angle)
        dist.barrier()
        t_cycle, mib_cycle = measured(lambda: sharded_cycle([0]))
        dist.barrier()
        t_whole, mib_whole = measured(lambda: whole_cycle([0]))
        dist.barrier()
        t_model, _ = measured(lambda: sharded_cycle(range(matrices)))
        dist.barrier()
        t_model_whole, _ = measured(lambda: whole_cycle(range(matrices)))
        one = sharded[0]
        U_minor_whole = one.U_prev.full_tensor()[:, g - one.r:]
        G_whole = grads[0].clone()
        dist.barrier()
        t_step, mib_step = measured(lambda: project_sharded_([(one.target.param.grad, one.U_minor, False)]))
        dist.barrier()
        t_step_whole, mib_step_whole = measured(lambda: project_onto(G_whole, U_minor_whole))
        values = slowest(t_cycle, t_whole, mib_cycle, mib_whole, t_model, t_model_whole, t_step, t_step_whole,
                         mib_step, mib_step_whole)
        rows.append(dict(zip(("cycle_s", "whole_s", "cycle_mib", "whole_mib", "model_s", "model_whole_s", "step_s",
                              "step_whole_s", "step_mib", "step_whole_mib"), values),
                         m=m, n=n, r=one.r, matrix_mib=m * n * 4 / 2**20))
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def measure(shapes, world: int, matrices: int) -> list[dict]:
    return run_ranks(_worker, world, shapes, matrices)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--matrices", type=int, default=4, help="matrices of one shape in the model row")
    parser.add_argument("--quick", action="store_true", help="small shapes only")
    args = parser.parse_args()
    rows = measure(QUICK if args.quick else SHAPES, args.ranks, args.matrices)
    print(f"AdaptiveSVDSwitch under FSDP2, {args.ranks} gloo ranks on CPU, 1 thread each (slowest rank, largest "
          f"peak); r = g/4; 'whole': every rank holds the matrix and does the work itself (DDP)")
    print(f"{'m x n':>12} {'matrix MiB':>10} {'cycle s':>8} {'whole s':>8} {'ratio':>6} {'cycle MiB':>10} "
          f"{'whole MiB':>10} {f'{args.matrices} mats s':>11} {'whole s':>8} {'ratio':>6} "
          f"{'step ms':>8} {'whole ms':>9} {'ratio':>6}")
    for r in rows:
        print(f"{r['m']:>5} x {r['n']:<5} {r['matrix_mib']:>10.1f} {r['cycle_s']:>8.3f} {r['whole_s']:>8.3f} "
              f"{r['whole_s'] / r['cycle_s']:>5.2f}x {r['cycle_mib']:>10.1f} {r['whole_mib']:>10.1f} "
              f"{r['model_s']:>11.3f} {r['model_whole_s']:>8.3f} {r['model_whole_s'] / r['model_s']:>5.2f}x "
              f"{1e3 * r['step_s']:>8.2f} {1e3 * r['step_whole_s']:>9.2f} {r['step_whole_s'] / r['step_s']:>5.2f}x")
    print("ratio: whole time / sharded time (> 1: the sharded path is faster). Cycle MiB: peak extra per rank for "
          "one matrix (compare with the matrix's own size).")


if __name__ == "__main__":
    main()
