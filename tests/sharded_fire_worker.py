"""``python sharded_fire_worker.py out.pt``: ``apply_fire`` on 2 gloo ranks (``Shard(0)`` DTensors, no Lightning)
beside one process on the same weights; rank 0 saves both results and each rank's ``eigh`` calls (shape, dtype).
Run twice on the sharded side: each round's matrices in one reduce-scatter and one all-gather (NCCL's way), and
one block at a time (a reduce and a broadcast each: gloo's way, and what blocks too large to batch take).

The model mixes every route of :func:`plasticity_callbacks.distributed.sharded_fire.sharded_fire`: tall and square
blocks (the Gram route, spread over the ranks), a conv (one Gram matrix per tap), wide matrices (redistributed by
columns: a Linear, a conv, a transposed Conv1D, rows split unevenly), a rank-deficient one (gathered), one with a
NaN (skipped), more Gram-route blocks than ranks.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import os
import socket
import sys
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from transformers.pytorch_utils import Conv1D

from rank_exit import exit_after_results


def model() -> nn.Module:
    from plasticity_callbacks.model_map import declare_plasticity

    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(24, 40), nn.Linear(40, 40), nn.Linear(40, 12), nn.Conv2d(6, 10, 3),
                           nn.Linear(7, 33), nn.Linear(12, 12), nn.Linear(16, 16),
                           nn.Conv2d(10, 4, 2), Conv1D(40, 11), nn.Linear(50, 7))  # wide: by columns
    with torch.no_grad():
        layers[5].weight[:, 3] = 0  # rank 11 of 12: no full isometry from its Gram matrix
        layers[6].weight[2, 5] = math.nan
    # a bag of matrices no input runs through: each declared one matrix (the map refuses what it cannot read)
    declare_plasticity(layers, fused={f"{i}.weight": [rows] for i, rows in
                                      ((0, 40), (1, 40), (2, 12), (4, 33), (5, 12), (6, 16), (8, 40), (9, 7))})
    return layers


# How a round's matrices travel: batched (reduce-scatter, all-gather) or one block at a time (reduce, broadcast);
# a wide block's columns there and back (all-to-all).
COLLECTIVES = ("reduce_scatter_single", "all_gather_single", "reduce", "broadcast", "all_to_all_single")


def as_dicts(records) -> list[dict]:
    """FIRE's records as plain dicts: the test reads the file with ``weights_only=True``."""
    return [dataclasses.asdict(record) for record in records]


def sharded_run(mesh, apply_fire, options, selection, route) -> dict:
    """``apply_fire`` on the model as ``Shard(0)`` DTensors: the whole weights, every rank's records, ``eigh``
    calls, the Gram route's collectives by name, the gathered blocks, and the warnings."""
    from torch.distributed.tensor import Shard, distribute_tensor

    sharded = model()
    for name, param in list(sharded.named_parameters()):
        module, attr = name.rsplit(".", 1)
        setattr(sharded.get_submodule(module), attr, nn.Parameter(distribute_tensor(param.detach(), mesh, [Shard(0)])))
    eigh, calls = torch.linalg.eigh, []

    def counted(matrix, *args, **kwargs):
        calls.append((tuple(matrix.shape), str(matrix.dtype).removeprefix("torch.")))
        return eigh(matrix, *args, **kwargs)

    solve_whole, gathered = route._fire_gathered, []

    def gathering(block, *args, **kwargs):
        gathered.append(block.name)
        return solve_whole(block, *args, **kwargs)

    collectives: dict[str, int] = {}
    originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def counting(name):
        def call(*args, **kwargs):
            collectives[name] = collectives.get(name, 0) + 1
            return originals[name](*args, **kwargs)
        return call

    torch.linalg.eigh, route._fire_gathered = counted, gathering
    for name in COLLECTIVES:
        setattr(dist, name, counting(name))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            two = apply_fire(sharded, None, options, selection, record_spectra=True)
    finally:
        torch.linalg.eigh, route._fire_gathered = eigh, solve_whole
        for name, original in originals.items():
            setattr(dist, name, original)
    records = [None, None]
    dist.all_gather_object(records, [copy.copy(r) for r in two])
    counts = [None, None]
    dist.all_gather_object(counts, calls)
    params = {name: p.full_tensor().detach() for name, p in sharded.named_parameters()}
    return {"sharded": params, "records": [as_dicts(r) for r in records], "eigh_calls": counts, "gathered": gathered,
            "collectives": collectives, "warnings": [str(w.message) for w in caught]}


def worker(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from torch.distributed.device_mesh import init_device_mesh

    from plasticity_callbacks.functional.isometry import FIREOptions
    from plasticity_callbacks.model_map import Selection
    from plasticity_callbacks.ops.fire import apply_fire

    single = model()
    selection, options = Selection(include_head=True), FIREOptions()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        one = apply_fire(single, None, options, selection, record_spectra=True)
    mesh = init_device_mesh("cpu", (2,))
    import plasticity_callbacks.distributed.sharded_fire as route

    results = {}
    for name, batch_bytes in (("batched", route.DEFAULT_BATCH_BYTES), ("per_block", 0)):
        route.BATCH_BYTES = {"cpu": batch_bytes}
        results[name] = sharded_run(mesh, apply_fire, options, selection, route)
    if rank == 0:
        torch.save({"single": dict(single.named_parameters()), "records_single": as_dicts(one), **results}, out)
    exit_after_results()


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    mp.start_processes(worker, args=(free, sys.argv[1]), nprocs=2, start_method="spawn")
