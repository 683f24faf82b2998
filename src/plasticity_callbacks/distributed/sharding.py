"""Plasticity operations on weights sharded by FSDP2 (``fully_shard``: ``DTensor`` parameters, ``Shard(0)``).

Each rank holds a contiguous slice of the stored parameter along dim 0, ``torch.chunk``-style:
rank ``r`` of ``n`` holds rows ``[r·c, (r+1)·c)`` with ``c = ⌈rows/n⌉`` (the last ranks may hold fewer or none).
Here: which rows a rank holds, DASH's shrink of them, and the agreement of all ranks on a check; FIRE's
polar factors over the ranks are :mod:`.sharded_fire`'s.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..functional.shrink import apply_shrink_
from .strategy import is_dtensor


def local_span(tensor: torch.Tensor) -> tuple[int, int]:
    """``(start, stop)`` of this rank's slice of a ``Shard(0)`` DTensor on a 1-D mesh, along dim 0."""
    from torch.distributed.tensor import Shard

    mesh, placements = tensor.device_mesh, tensor.placements
    if mesh.ndim != 1 or len(placements) != 1 or placements[0] != Shard(0):
        raise NotImplementedError(f"a weight with placements {placements} on a {mesh.ndim}-D mesh: only FSDP2's "
                                  "Shard(0) on one data-parallel mesh dimension is handled; shard with "
                                  "fully_shard(module, mesh=device_mesh['data_parallel'])")
    rows, size, rank = tensor.shape[0], mesh.size(), mesh.get_local_rank()
    chunk = math.ceil(rows / size)
    start = min(rank * chunk, rows)
    stop = min(start + chunk, rows)
    if tensor.to_local().shape[0] != stop - start:
        raise NotImplementedError(f"local shard of {tuple(tensor.to_local().shape)} is not torch.chunk's slice "
                                  f"[{start}:{stop}] of {tuple(tensor.shape)}")
    return start, stop


def local_part(tensor: torch.Tensor) -> tuple[torch.Tensor, slice]:
    """``(what this rank writes, the rows of dim 0 it covers)``: a ``Shard(0)`` DTensor's local shard and its
    rows, or a plain tensor and all of them. An edit of whole rows or columns of a full-size tensor then
    reads ``local.copy_(full[rows])``, and a mask along dim 0 is sliced the same way.

    Example:
        >>> local, rows = local_part(layer.weight)
        >>> local.masked_fill_(dead[rows, None], 0)   # rows of dead units, on every rank
    """
    if not is_dtensor(tensor):
        return tensor, slice(None)
    start, stop = local_span(tensor)
    return tensor.to_local(), slice(start, stop)


def _all_reduce(tensor: torch.Tensor, group) -> torch.Tensor:
    dist.all_reduce(tensor, group=group)
    return tensor


def all_finite_on_every_rank(tensors: list[torch.Tensor]) -> bool:
    """Whether every entry of every tensor is finite, on every rank: DTensors are checked on their local
    shards and the answer agreed over their mesh (one all-reduce), so all ranks take the same branch."""
    local = [t.to_local() if is_dtensor(t) else t for t in tensors]
    # one host sync: the max-abs norm is finite exactly when every entry is
    finite = not local or bool(torch.isfinite(torch.nn.utils.get_total_norm(local, norm_type=math.inf)))
    sharded = next((t for t in tensors if is_dtensor(t)), None)
    if sharded is None:
        return finite
    flag = torch.tensor([float(finite)], device=local[0].device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=sharded.device_mesh.get_group())
    return bool(flag.item())


@torch.no_grad()
def sharded_shrink_(target, direction: torch.Tensor, factor_fn) -> torch.Tensor:
    """DASH's shrink of one ``Shard(0)`` DTensor weight: each rank scales the rows it holds.

    A row of the ``(out, in)`` view and its gradient row live on the same rank for ``nn.Linear`` and
    convs, so the factors of this rank's rows come from its shards alone. A transposed weight (HF
    ``Conv1D``, stored ``(in, out)``) holds every output neuron's row split over the ranks: its weight and
    direction are gathered (that matrix alone, two full copies at peak), the factors computed whole, and each
    rank scales its own slice.

    Args:
        target: a :class:`~model_map.WeightView` whose parameter is a DTensor.
        direction: stored like the parameter, a DTensor with the same placements (``.grad`` under FSDP2).
        factor_fn: ``(weight, direction) -> factors`` in ``(out, in)`` orientation, one per row or kernel slice.

    Returns:
        The factors of every row, identical on every rank (for the metrics).

    Example:
        >>> factors = sharded_shrink_(view, view.param.grad, lambda w, g: penalty_shrink_factors(w, g))
    """
    if target.groups != 1:
        raise NotImplementedError(f"DASH on {target.name} under FSDP2: a grouped conv ({target.groups} groups) is "
                                  "not sharded by rows; exclude it from the selection or train with strategy='ddp'")
    if not is_dtensor(direction) or direction.placements != target.param.placements:
        raise RuntimeError(f"DASH on {target.name} under FSDP2: its direction is "
                           f"{getattr(direction, 'placements', 'a plain tensor')}, not sharded like the weight "
                           f"({target.param.placements}); shard the module with fully_shard so that its gradient is")
    local, rows = local_part(target.param)
    if target.transposed:
        full_factors = factor_fn(target.oriented(target.param.full_tensor()), target.oriented(direction.full_tensor()))
        mine = full_factors if full_factors.dim() == 1 else full_factors[:, rows]  # conv: (out, in) slices
        apply_shrink_(target.oriented(local), mine)
        return full_factors
    factors = factor_fn(local, direction.to_local())  # this rank's rows
    apply_shrink_(local, factors)
    full_factors = factors.new_zeros(target.param.shape[0], *factors.shape[1:])
    full_factors[rows] = factors
    return _all_reduce(full_factors, target.param.device_mesh.get_group())  # each row from the rank that holds it


@torch.no_grad()
def sharded_vector_shrink_(vector: torch.Tensor, direction: torch.Tensor, factor_fn) -> torch.Tensor:
    """Scale a sharded 1-D parameter (a bias) by one factor from the whole vector; gathered: it is small."""
    factor = factor_fn(vector.full_tensor(), direction.full_tensor())
    apply_shrink_(vector.to_local(), factor)
    return factor


def fraction_over_shards(fraction: torch.Tensor, shards: list[torch.Tensor], params: list[torch.Tensor]) -> torch.Tensor:
    """The share of all entries of ``params`` from each rank's ``fraction`` of its ``shards`` (FSDP2
    ``Shard(0)`` DTensors: one all-reduce; plain parameters: ``fraction`` itself)."""
    sharded = next((p for p in params if is_dtensor(p)), None)
    if sharded is None:
        return fraction
    count = fraction.double().reshape(1) * sum(s.numel() for s in shards)
    return _all_reduce(count, sharded.device_mesh.get_group())[0] / sum(p.numel() for p in params)
