"""Minor-subspace training on weights sharded by FSDP2 (``fully_shard``: ``DTensor`` parameters, ``Shard(0)``).

``AdaptiveSVDSwitch(minor_training="project")`` replaces a gradient ``∇W`` (the ``(out, in)`` view) by
``U_m U_mᵀ ∇W``, ``U_m`` the ``r`` minor left singular vectors of ``W``. Under FSDP2:

* ``nn.Linear`` and convs store ``(out, in, *k)`` and each rank holds the rows ``i`` of ``∇W``, so
  ``(U_m U_mᵀ ∇W)[i] = U_m[i] · Σ_ranks U_m[rows]ᵀ ∇W[rows]``: each rank keeps its own rows of ``U``
  (``Shard(0)``, laid out like the weight), and one all-reduce of an ``r × d_in`` matrix per matrix (all
  matrices of a step coalesced into one all-reduce) gives every rank the sum.
* Hugging Face's ``Conv1D`` (stored ``(in, out)``, any transposed view) gives each rank whole columns of
  the ``(out, in)`` view, so its projection is local; every rank keeps every row of ``U_m`` (``r`` columns)
  besides its rows of ``U``.

The singular vectors are those of the whole matrix: each matrix is gathered at an SVD cycle, one at a
time, and its SVD is computed by one rank (:func:`owner_of`, spread over the ranks) which shares the
outcome (:func:`broadcast_from`, :func:`scatter_rows_from`), so every rank acts on the same vectors and the
same decision.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..functional.subspace import as_matrix


def owner_of(index: int, tensor: torch.Tensor) -> int:
    """The rank (in the tensor's 1-D mesh) that computes the SVD of the ``index``-th matrix: round robin."""
    return index % tensor.device_mesh.size()


def is_owner(index: int, tensor: torch.Tensor) -> bool:
    return tensor.device_mesh.get_local_rank() == owner_of(index, tensor)


def scatter_rows_from(owner: int, tensor: torch.Tensor | None, like: torch.Tensor, shape: tuple[int, ...],
                      dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` of the rank ``owner`` split by rows over the mesh of ``like`` (a DTensor parameter): a scatter,
    each rank receiving its chunk in ``torch.chunk``'s layout, as FSDP2 shards (so a weight with as many rows
    holds the same rows on each rank).

    Args:
        owner: the mesh rank holding the value; the others pass ``tensor=None``.
        shape, dtype: the value's (every rank must know them to receive it).

    Returns:
        A ``Shard(0)`` DTensor on ``like``'s mesh and device.

    Example:
        >>> U = scatter_rows_from(owner_of(i, w), svd.U if mine else None, w, (d_out, g), torch.float32)
    """
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = like.device_mesh
    if mesh.get_local_rank() != owner:  # a receive buffer: its values are never read
        tensor = torch.empty(shape, dtype=dtype, device=like.to_local().device)
    return distribute_tensor(tensor.to(dtype), mesh, [Shard(0)], src_data_rank=owner)


def broadcast_from(owner: int, tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``tensor`` of the mesh rank ``owner`` on every rank of ``like``'s mesh, in place."""
    dist.broadcast(tensor, group=like.device_mesh.get_group(), group_src=owner)
    return tensor


@torch.no_grad()
def project_sharded_(items: list[tuple[torch.Tensor, torch.Tensor, bool]]) -> None:
    """``T ← U_m U_mᵀ T`` in place for each ``(T, U_m, transposed)``; a collective (call it on every rank,
    with the same items in the same order).

    Args:
        items: ``T`` a ``Shard(0)`` DTensor shaped like its weight (a gradient, a momentum), stored
            ``(out, in, *k)``, or ``(in, out, *k)`` when ``transposed``; ``U_m`` a plain tensor: this rank's rows
            of the ``(out, r)`` minor vectors (laid out like the weight's rows), or all of them when ``transposed``.

    Example:
        >>> project_sharded_([(layer.weight.grad, U_minor.to_local(), False)])   # on every rank
    """
    rows = [(T.to_local(), U) for T, U, transposed in items if not transposed]
    for T, U, transposed in items:
        if transposed:  # this rank's columns of the (out, in) view: U_m U_mᵀ acts on each column alone
            local = T.to_local().transpose(0, 1)
            local.copy_((U @ (U.mT @ as_matrix(local).to(U.dtype))).reshape(local.shape))
    if not rows:
        return
    # U_mᵀ T = Σ_ranks U_m[rows]ᵀ T[rows]: each rank's share, all matrices in one all-reduce
    shares = [U.mT @ as_matrix(T).to(U.dtype) for T, U in rows]  # (r, in·∏k) each
    flat = torch.cat([s.reshape(-1) for s in shares])
    dist.all_reduce(flat, group=items[0][0].device_mesh.get_group())
    for (T, U), whole in zip(rows, flat.split([s.numel() for s in shares])):
        T.copy_((U @ whole.view(U.shape[1], -1)).reshape(T.shape))
