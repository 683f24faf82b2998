"""Plasticity operations on weights sharded by FSDP2 (``fully_shard``: ``DTensor`` parameters, ``Shard(0)``).

Each rank holds a contiguous slice of the stored parameter along dim 0, ``torch.chunk``-style:
rank ``r`` of ``n`` holds rows ``[r·c, (r+1)·c)`` with ``c = ⌈rows/n⌉`` (the last ranks may hold fewer or none).

FIRE's polar factor without gathering: let ``X`` be a weight seen so that its rows are the sharded
dimension (``W`` for ``nn.Linear``; ``Wᵀ`` for Hugging Face's ``Conv1D``, stored ``(in, out)``).
``XᵀX = Σ_r X_rᵀX_r``, so a reduce of each rank's small Gram matrix gives the block's owner ``G = XᵀX``;
the owner (round robin over the blocks, so each rank decomposes ``1/world`` of them) broadcasts ``G^{-1/2}``
(float64 eigendecomposition of ``G``) and each rank writes its own rows of ``polar(X) = X G^{-1/2}``.
``polar(Wᵀ) = polar(W)ᵀ``, so the transposed layout is the same computation
(:func:`~functional.spectral.gram_inverse_sqrt` is the owner's part). A row
block of a fused matrix (Q/K/V) is a set of rows: each rank contributes the Gram matrix of the rows of
the block it holds, whichever shard boundaries fall inside the block. The route is exact when ``X`` is
tall or square and has full column rank. A wide ``X`` (``m < n``: ``G`` would be ``n × n``, larger
than the block itself, to send and to decompose) or a rank-deficient one (no full isometry from ``G``
alone: the null directions must be completed from the whole matrix) is gathered, that block alone,
and its polar factor computed by SVD as on one process. So is every block when the options fix the
number of iterations (``steps``: a partial orthogonalization, which one process computes from the whole block).
Extra memory per rank: one float64 copy of the local rows of a block plus ``4·d²`` float64 for its own
block's ``G``, eigenvectors and ``G^{-1/2}`` and one received ``G^{-1/2}``, ``d`` the block's smaller
dimension; never the whole matrix, except a gathered (wide or degenerate) block. ``docs/distributed.md``
says what runs on which rank, with measured costs.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from ..functional.isometry import FireRecord, _skip_degenerate, as_matrices, target_scale
from ..functional.shrink import apply_shrink_
from ..functional.spectral import (DegenerateMatrixError, RankDeficientError, _symmetric_gram,
                                   deviation_from_isometry, gram_inverse_sqrt, orthogonalize)
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


@dataclass
class _Block:
    """One row block of a sharded weight as ``X`` (the block, or its transpose: rows = the sharded dimension)."""

    target: object  # its WeightView
    name: str
    index: tuple  # this rank's rows of X in the local shard: local[index] is (rows of X here, cols of X, *k)
    positions: list[int]  # which rows of X this rank holds
    rows: int  # of the whole X
    cols: int  # of X
    kernel: tuple[int, ...]  # a conv's taps: one matrix X per tap
    record: FireRecord | None = None

    def view_shape(self) -> tuple[int, ...]:
        """The block's ``(out, in, *k)`` shape."""
        return (self.cols, self.rows, *self.kernel) if self.target.transposed else (self.rows, self.cols, *self.kernel)

    def local_rows_shape(self) -> tuple[int, ...]:
        """The shape of :meth:`local_rows`: ``(*k, local rows, cols)``."""
        return (*self.kernel, len(self.positions), self.cols)

    def local_rows_raw(self) -> torch.Tensor:
        """This rank's rows of ``X`` as stored, ``(local rows, cols, *k)`` (a copy)."""
        return self.target.param.to_local()[self.index]

    def write_raw(self, new: torch.Tensor) -> None:
        local = self.target.param.to_local()
        local[self.index] = new.to(local.dtype)

    def local_rows(self) -> torch.Tensor:
        """This rank's rows of ``X`` as float64 matrices ``(*k, local rows, cols)`` (a copy)."""
        return as_matrices(self.local_rows_raw()).double()

    def write(self, new: torch.Tensor) -> None:
        """Put ``(*k, local rows, cols)`` matrices back into this rank's shard."""
        self.write_raw(new if new.dim() == 2 else new.permute(new.dim() - 2, new.dim() - 1, *range(new.dim() - 2)))


@torch.no_grad()
def sharded_fire(targets: list, options, record_spectra: bool = False) -> list[list[FireRecord]]:
    """FIRE on weights whose parameters are ``Shard(0)`` DTensors: every row block, rows written in place.

    The blocks' ``eigh`` are spread over the ranks: blocks are taken ``world`` at a time, the ``i``-th of
    each round owned by rank ``i``, which receives its Gram matrix (a reduce), decomposes it and broadcasts
    ``G^{-1/2}``; every rank then multiplies its own rows. So each rank decomposes ``1/world`` of the blocks
    and holds at most two ``n × n`` float64 matrices beyond its own ``eigh``. A wide, rank-deficient or
    fixed-``steps`` block is gathered and solved on every rank as on one process (module docstring).

    Args:
        targets: :class:`~model_map.WeightView` s (not factorized, not grouped convs), in the same order on
            every rank: this is a collective.
        options: :class:`~functional.isometry.FIREOptions`; ``scale`` and ``on_degenerate``
            apply. An iteration run to its tolerance reaches the exact polar factor, which the Gram route
            computes directly; a fixed ``steps`` count stops short of it, so such a block is gathered and
            orthogonalized with ``options`` as one process does.
        record_spectra: keep singular values before/after (square roots of the Gram matrix's eigenvalues).

    Returns:
        For each target, one :class:`~functional.isometry.FireRecord` per block, identical on every rank.

    Example:
        >>> records = sharded_fire([view_q, view_fc], FIREOptions())   # on every rank: a collective
    """
    blocks = [_blocks_of(target) for target in targets]
    by_group: dict[int, tuple] = {}  # the Gram route's blocks of each mesh, in order (the same on every rank)
    gathered = []
    for block in (b for bs in blocks for b in bs):
        group = block.target.param.device_mesh.get_group()
        if options.steps is None and block.rows >= block.cols:
            by_group.setdefault(id(group), (group, []))[1].append(block)
        else:
            gathered.append(block)
    for group, tall in by_group.values():
        size = dist.get_world_size(group)
        for start in range(0, len(tall), size):
            gathered.extend(_gram_round(tall[start:start + size], group, options, record_spectra))
    for block in gathered:  # wide, partial or rank-deficient: the whole block on every rank
        group = block.target.param.device_mesh.get_group()
        block.record, new = _fire_gathered(block.name, block.target.transposed, block.local_rows_raw(), block.positions,
                                       block.rows, options, record_spectra, group)
        if new is not None:
            block.write_raw(new)
    return [[b.record for b in bs] for bs in blocks]


def _blocks_of(target) -> list[_Block]:
    if target.factorized or target.groups != 1:
        what = "factorized (W_p + BA)" if target.factorized else f"a grouped conv ({target.groups} groups)"
        raise NotImplementedError(f"FIRE on {target.name} under FSDP2: the weight is {what}, which is not sharded "
                                  "by rows; exclude it from FIRE's selection or train with strategy='ddp'")
    start, stop = local_span(target.param)
    row_blocks = target.block_list()
    out = []
    for block in row_blocks:
        name = target.name if len(row_blocks) == 1 else f"{target.name}[{block.label}]"
        rows = list(block.rows)  # the block's rows of the (out, in) view
        if target.transposed:  # X = the block transposed: its rows are the stored rows this rank holds
            index = (slice(None), torch.tensor(rows, dtype=torch.long))
            positions, total, cols = list(range(start, stop)), target.param.shape[0], len(rows)
        else:  # X = the block: this rank holds those of its rows in [start, stop)
            mine = [(p, i - start) for p, i in enumerate(rows) if start <= i < stop]
            index = (torch.tensor([i for _, i in mine], dtype=torch.long),)
            positions, total, cols = [p for p, _ in mine], len(rows), target.param.shape[1]
        out.append(_Block(target, name, index, positions, total, cols, tuple(target.param.shape[2:])))
    return out


OK, NON_FINITE, ZERO, DEFICIENT = range(4)  # what a block's owner found
PROBES = 8  # DfI after, as one process estimates it (spectral.estimated_deviation_from_isometry)


def _gram_round(blocks: list[_Block], group, options, record_spectra: bool) -> list[_Block]:
    """The Gram route for up to ``world`` tall blocks, block ``i`` decomposed on rank ``i``; returns the
    rank-deficient ones (to be gathered)."""
    started = time.perf_counter()
    me = dist.get_rank(group)
    owned = None
    for owner, block in enumerate(blocks):  # the Gram matrix of every block, each summed on its owner only
        X64 = block.local_rows()
        gram = _symmetric_gram(X64)  # (*k, cols, cols)
        dist.reduce(gram, group=group, group_dst=owner)
        if owner == me:
            owned = gram
    spectrum = max(math.prod(b.local_rows_shape()[:-2]) * b.local_rows_shape()[-1] for b in blocks)
    header = torch.zeros(len(blocks), 4 + (spectrum if record_spectra else 0), dtype=torch.float64)
    inverse_sqrt = None
    if owned is not None:
        inverse_sqrt = _decompose(blocks[me], owned, options, header[me], record_spectra)
        del owned
    dist.all_reduce(header, group=group)  # each row from its owner: every rank learns every outcome
    status, norms = header[:, 0].long().tolist(), header[:, 3].tolist()
    for block, (code, scale, dfi_before) in zip(blocks, header[:, :3].tolist()):
        block.record = FireRecord(block.name, block.view_shape(), scale=scale, dfi_before=dfi_before)
        if code in (NON_FINITE, ZERO):
            what = "contains NaN/Inf" if code == NON_FINITE else "is all zero (no polar factor)"
            _skip_degenerate(block.record, f"FIRE: {block.name} {what}", "non-finite" if code == NON_FINITE else "zero",
                             options.on_degenerate)  # raises on every rank before any block of the round changes
    shares, done = [], []
    for owner, block in enumerate(blocks):
        if status[owner] != OK:
            continue
        X64 = block.local_rows()
        buffer = inverse_sqrt if owner == me else X64.new_empty(*X64.shape[:-2], X64.shape[-1], X64.shape[-1])
        dist.broadcast(buffer, group=group, group_src=owner)
        new = (X64 @ buffer).mul_(block.record.scale)
        del buffer
        new = new.to(block.target.param.dtype).double()  # as stored: what the SFE and DfI after measure
        Z = torch.randn(X64.shape[-1], PROBES, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        shares += [(X64 - new).square().sum().reshape(1), (new.mT @ (new @ Z)).reshape(-1)]
        if record_spectra:
            block.record.spectrum_after = new.mT @ new  # summed over ranks below
        block.write(new)
        done.append((block, Z, norms[owner]))
    if shares:  # this rank's share of every SFE and of every (QᵀQ)z, in one all-reduce
        total = _all_reduce(torch.cat(shares), group)
        for block, Z, squared_norm in done:
            sfe, total = total[0], total[1:]
            products, total = total[:Z.numel() * _taps(block)], total[Z.numel() * _taps(block):]
            residual = products.view(-1, *Z.shape) - block.record.scale ** 2 * Z  # (QᵀQ − s²I) z per tap
            block.record.dfi_after = float(residual.square().sum()) / PROBES
            block.record.sfe = float(sfe)
            block.record.sfe_normalized = block.record.sfe / squared_norm
    if record_spectra:
        for owner, (block, _, _) in zip((b for b in range(len(blocks)) if status[b] == OK), done):
            after = _all_reduce(block.record.spectrum_after, group)
            block.record.spectrum_after = torch.linalg.eigvalsh(after).clamp_min(0).sqrt().flip(-1).float()
            taps, cols = _taps(block), block.local_rows_shape()[-1]
            before = header[owner, 4:4 + taps * cols].view(*block.local_rows_shape()[:-2], cols)
            block.record.spectrum_before = before.float()
    seconds = (time.perf_counter() - started) / len(blocks)
    for block in blocks:
        block.record.seconds = seconds
    return [b for b, code in zip(blocks, status) if code == DEFICIENT]


def _taps(block: _Block) -> int:
    return math.prod(block.local_rows_shape()[:-2])


def _decompose(block: _Block, gram: torch.Tensor, options, header: torch.Tensor, record_spectra: bool):
    """On the block's owner: its ``G^{-1/2}``, with ``[status, scale, DfI before, ‖X‖², spectrum]`` in ``header``."""
    taps, cols = _taps(block), gram.shape[-1]
    finite = bool(torch.isfinite(gram).all())
    squared_norm = float(gram.diagonal(dim1=-2, dim2=-1).sum()) if finite else math.nan
    if not finite or squared_norm == 0.0:
        header[0] = NON_FINITE if not finite else ZERO
        return None
    if options.scale == "preserve_norm":
        scale = math.sqrt(squared_norm / (min(block.rows, cols) * taps))
    else:
        scale = target_scale(torch.empty(block.view_shape(), device="meta"), options.scale)
    header[1], header[3] = scale, squared_norm
    try:  # a zero conv tap has no polar factor from its Gram matrix either: gathered, as a deficient block
        inverse_sqrt, eigenvalues = gram_inverse_sqrt(gram, block.rows, cols * torch.finfo(torch.float64).eps)
    except (RankDeficientError, DegenerateMatrixError):
        header[0] = DEFICIENT
        return None
    eigenvalues = eigenvalues.clamp_min(0)
    header[2] = float((eigenvalues - scale**2).square().sum())
    if record_spectra:
        header[4:4 + taps * cols] = eigenvalues.sqrt().flip(-1).reshape(-1)
    header[0] = OK
    return inverse_sqrt


def _fire_gathered(name, transposed, X_local, positions, rows, options, record_spectra, group):
    """FIRE on one block given as ``X`` (the block, or its transpose) of ``rows`` rows, this rank holding rows
    ``positions``, gathered whole on every rank and solved as on one process: a wide block (its Gram matrix of
    the larger side would cost more than the block), a rank-deficient one (no full isometry from ``G``), or a
    fixed number of iterations (the FIRE recipes' 5 or 10 Newton–Schulz steps stop short of the exact factor).
    Returns the record and the new local rows (None when skipped)."""
    started = time.perf_counter()
    cols = X_local.shape[1]
    view_shape = (cols, rows, *X_local.shape[2:]) if transposed else (rows, cols, *X_local.shape[2:])
    record = FireRecord(name, view_shape)
    flags = _all_reduce(torch.tensor([float(not bool(torch.isfinite(X_local).all()))], dtype=torch.float64,
                                     device=X_local.device), group)
    if flags.item():
        return _skip_degenerate(record, f"FIRE: {name} contains NaN/Inf", "non-finite", options.on_degenerate), None
    X64 = as_matrices(X_local).double()  # (*k, local rows, cols): one matrix per conv tap
    full = _gather_rows(X64, positions, rows, group)
    squared_norm = float(full.square().sum())
    if squared_norm == 0.0:
        return _skip_degenerate(record, f"FIRE: {name} is all zero (no polar factor)", "zero", options.on_degenerate), None
    taps = math.prod(X_local.shape[2:])
    if options.scale == "preserve_norm":
        scale = math.sqrt(squared_norm / (min(rows, cols) * taps))
    else:
        scale = target_scale(torch.empty(view_shape, device="meta"), options.scale)
    record.scale = scale
    if options.steps is not None:
        polar = orthogonalize(full, replace(options, on_degenerate="skip")).mul_(scale)
    else:
        U, _, Vh = torch.linalg.svd(full, full_matrices=False)
        polar = (U @ Vh).mul_(scale)
    new = polar[..., positions, :]
    record.dfi_before = float(deviation_from_isometry(full, scale, torch.float64).sum())
    record.dfi_after = float(deviation_from_isometry(polar, scale, torch.float64).sum())
    if record_spectra:
        record.spectrum_before = torch.linalg.svdvals(full).float().cpu()
        record.spectrum_after = torch.linalg.svdvals(polar).float().cpu()
    record.sfe = float((full - polar).square().sum())
    record.sfe_normalized = record.sfe / squared_norm
    record.seconds = time.perf_counter() - started
    # back to (local rows, cols, *k)
    new = new if new.dim() == 2 else new.permute(new.dim() - 2, new.dim() - 1, *range(new.dim() - 2))
    return record, new


def _gather_rows(X64: torch.Tensor, positions: list[int], rows: int, group) -> torch.Tensor:
    """The whole block on every rank, from each rank's rows ``positions``, by a zero-padded all-reduce."""
    full = X64.new_zeros(*X64.shape[:-2], rows, X64.shape[-1])
    full[..., positions, :] = X64
    return _all_reduce(full, group)


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
