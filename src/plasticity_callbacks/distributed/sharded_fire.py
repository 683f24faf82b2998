"""FIRE on weights sharded by FSDP2 (``Shard(0)`` DTensors): each polar factor decomposed on one rank.

Each row block (a whole matrix, Q/K/V, gate/up, a conv's taps) is seen as ``X``, whose rows are the sharded
dimension (``W`` for ``nn.Linear`` and convs, ``Wᵀ`` for Hugging Face's ``Conv1D``), ``m × n``; rank ``r``
holds rows ``X_r``. Let ``Y`` be ``X`` when it is tall or square, ``Xᵀ`` when it is wide, so that ``Y``'s
Gram matrix ``G = YᵀY`` is the smaller side's, and ``polar(Y) = Y G^{-1/2}`` (``polar(X) = polar(Xᵀ)ᵀ``).

* Tall or square ``X``: ``Y = X`` and each rank holds rows of ``Y``.
* Wide ``X``: an all-to-all hands rank ``r`` the columns ``X[:, c_r]`` (all rows), i.e. rows of ``Y = Xᵀ``;
  the new columns go back to the ranks that hold the rows by a second all-to-all. Never the whole ``X``.

Blocks are taken ``world`` at a time; the ``i``-th of each round is owned by rank ``i`` (round robin), which
receives ``G = Σ_r Y_rᵀY_r`` (a reduce), decomposes it (``eigh``) and broadcasts ``G^{-1/2}``; every rank
writes its rows ``Y_r G^{-1/2}·scale``. The SFE and the 8-probe DfI-after estimate of all blocks of a
round come from one all-reduce. So each rank runs ``1/world`` of the ``eigh`` calls and ``1/world`` of the
row products. A wide block's columns are fetched once a round and kept until its new columns go back. On GPUs a
round's Gram matrices travel in one reduce-scatter and its owners' findings and ``G^{-1/2}`` in one all-gather
while ``world`` of them fit ``BATCH_BYTES``; on CPU (gloo, whose reduce and broadcast cost less than its
reduce-scatter and all-gather) and above that size, one block at a time.

The arithmetic is one process's (:func:`~functional.spectral.orthogonalize`): where one process would run
its ``eigh`` route (an oblong block, float32 compute), the Gram matrix is float32 and decomposed in float32
when a Lanczos estimate of ``κ²`` and then the exact eigenvalues say its rounding stays below a float32 SVD's
(``κ ≤ 4``), else the block is done again from float64 Gram matrices, and the row products run in float32
where their rounding ``eps₃₂·κ`` stays below ``DEFAULT_TOL``. Where one process runs an SVD (a square-ish
block, ``svd``, the iterations), the Gram matrix, ``eigh`` and products are float64 (``κ²`` of a square
matrix is far beyond float32). Either way the result is the exact polar factor up to float32 rounding.

A rank-deficient block (no full isometry from ``G`` alone: the null directions need the whole matrix), and
every block when the options fix the number of iterations (``steps``: a partial orthogonalization of the
whole block), is gathered whole and solved on every rank as on one process. Extra memory per rank: the
block's ``n × n`` matrices of the smaller side (its own ``G``, eigenvectors, ``G^{-1/2}`` and a received
``G^{-1/2}``; ``world`` of them where a round is batched), a float64 copy of its rows of one block, and the
column shards of the round's wide blocks (``1/world`` of each); the whole block only when gathered.
``docs/distributed.md`` gives measured costs.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from ..functional.isometry import FireRecord, _skip_degenerate, as_matrices, target_scale
from ..functional.spectral import (DEFAULT_TOL, FLOAT32_GRAM_MAX_ERROR, _UNIT_ROUNDOFF32, _condition_squared_estimate,
                                   choose_method, deviation_from_isometry, orthogonalize)
from .sharding import _all_reduce, local_span

OK, NON_FINITE, ZERO, DEFICIENT, AGAIN_IN_FLOAT64 = range(5)  # what a block's owner found
HEADER = 5  # [status, scale, DfI before, ‖X‖², float32 products] per block, then its spectrum
PROBES = 8  # DfI after, as one process estimates it (spectral.estimated_deviation_from_isometry)
# A float32 Gram matrix is trusted only where its entries are far from float32's overflow and underflow
# (one process divides by the largest entry first; here each rank holds a part of the matrix).
_FLOAT32_SAFE = (2.0**-100, 2.0**100)
# Per device type, the bytes per rank up to which a round's ``world`` Gram matrices go to their owners in one
# reduce-scatter and come back as G^{-1/2} in one all-gather (3 collectives a round instead of 2·world + 2);
# larger ones travel one block at a time (a reduce and a broadcast), so a rank never holds ``world`` matrices of
# n = 8192 (64 × 512 MiB). CPU (gloo): never batched, gloo's reduce-scatter and all-gather cost more CPU than a
# reduce and a broadcast per block (``benchmarks/fire_fsdp.py`` prints both); on GPUs (NCCL) each collective
# costs a launch and a wait, so the round is batched there (not measured: no multi-GPU machine here).
BATCH_BYTES = {"cpu": 0}
DEFAULT_BATCH_BYTES = 64 << 20


def _index(positions: list[int]):
    """A slice where the positions are consecutive (a view, no copy), else a long tensor."""
    if not positions:
        return slice(0, 0)
    if positions == list(range(positions[0], positions[-1] + 1)):
        return slice(positions[0], positions[-1] + 1)
    return torch.tensor(positions, dtype=torch.long)


def _chunks(total: int, world: int) -> list[tuple[int, int]]:
    """``torch.chunk``'s split of ``total`` over ``world`` ranks: ``(start, stop)`` of each."""
    size = math.ceil(total / world)
    return [(min(r * size, total), min(r * size + size, total)) for r in range(world)]


@dataclass
class _Block:
    """One row block of a sharded weight as ``X`` (the block, or its transpose: rows = the sharded dimension)."""

    target: object  # its WeightView
    name: str
    index: tuple  # this rank's rows of X in the local shard: local[index] is (rows of X here, cols of X, *k)
    holders: list[torch.Tensor]  # for every rank, which rows of X it holds, in its local order
    rows: int  # of the whole X
    cols: int  # of X
    kernel: tuple[int, ...]  # a conv's taps: one matrix X per tap
    eigh_route: bool  # one process would take its eigh route (float32 compute): float32 where accurate enough
    float32_gram: bool = False  # this attempt's Gram matrix is float32
    record: FireRecord | None = None

    @property
    def wide(self) -> bool:
        return self.rows < self.cols

    @property
    def tall_shape(self) -> tuple[int, int]:
        """``(m, n)`` of ``Y``: ``X``, or ``Xᵀ`` for a wide block."""
        return (self.cols, self.rows) if self.wide else (self.rows, self.cols)

    def view_shape(self) -> tuple[int, ...]:
        """The block's ``(out, in, *k)`` shape."""
        return (self.cols, self.rows, *self.kernel) if self.target.transposed else (self.rows, self.cols, *self.kernel)

    @property
    def taps(self) -> int:
        return math.prod(self.kernel)

    def local_rows(self) -> torch.Tensor:
        """This rank's rows of ``X`` as ``(*k, local rows, cols)`` matrices, as stored (a view where it can)."""
        return as_matrices(self.target.param.to_local()[self.index])

    def write(self, new: torch.Tensor) -> None:
        """Put ``(*k, local rows, cols)`` matrices back into this rank's shard."""
        local = self.target.param.to_local()
        new = new if new.dim() == 2 else new.permute(new.dim() - 2, new.dim() - 1, *range(new.dim() - 2))
        local[self.index] = new.to(local.dtype)

    def read_tall(self, group) -> torch.Tensor:
        """This rank's rows of ``Y``, ``(*k, local rows of Y, n)``: its rows of ``X``, or (wide) its columns of
        ``X``, fetched from the ranks that hold them, transposed."""
        return _to_columns(self, group).mT if self.wide else self.local_rows()

    def write_tall(self, new: torch.Tensor, group) -> None:
        self.write(_from_columns(self, new.mT, group) if self.wide else new)


def _wire_dtype(param: torch.Tensor) -> torch.dtype:
    return torch.float64 if param.dtype == torch.float64 else torch.float32  # bf16 travels exactly as float32


def _to_columns(block: _Block, group) -> torch.Tensor:
    """All rows of this rank's columns of a wide ``X`` (an all-to-all): ``(*k, rows, columns here)``."""
    me, spans = dist.get_rank(group), _chunks(block.cols, dist.get_world_size(group))
    local = block.local_rows().to(_wire_dtype(block.target.param))  # (*k, r, n)
    mine = spans[me][1] - spans[me][0]
    send = torch.cat([local[..., a:b].reshape(-1) for a, b in spans])  # my rows of each rank's columns
    received = send.new_empty(block.taps * block.rows * mine)
    dist.all_to_all_single(received, send, [block.taps * len(h) * mine for h in block.holders],
                           [local[..., a:b].numel() for a, b in spans], group=group)
    columns = send.new_empty(*block.kernel, block.rows, mine)
    for piece, held in zip(received.split([block.taps * len(h) * mine for h in block.holders]), block.holders):
        columns[..., held, :] = piece.view(*block.kernel, len(held), mine)
    return columns


def _from_columns(block: _Block, columns: torch.Tensor, group) -> torch.Tensor:
    """The inverse of :func:`_to_columns`: this rank's rows of ``X`` from every rank's new columns."""
    spans = _chunks(block.cols, dist.get_world_size(group))
    columns = columns.to(_wire_dtype(block.target.param))
    send = torch.cat([columns[..., held, :].reshape(-1) for held in block.holders])
    here = len(block.holders[dist.get_rank(group)])
    sizes = [block.taps * here * (b - a) for a, b in spans]
    received = send.new_empty(sum(sizes))
    dist.all_to_all_single(received, send, sizes, [block.taps * len(h) * columns.shape[-1] for h in block.holders],
                           group=group)
    rows = send.new_empty(*block.kernel, here, block.cols)
    for piece, (a, b) in zip(received.split(sizes), spans):
        rows[..., a:b] = piece.view(*block.kernel, here, b - a)
    return rows


@torch.no_grad()
def sharded_fire(targets: list, options, record_spectra: bool = False) -> list[list[FireRecord]]:
    """FIRE on weights whose parameters are ``Shard(0)`` DTensors: every row block, rows written in place.

    Each block's ``eigh`` runs on one rank (round robin); wide blocks are redistributed by columns rather than
    gathered; a rank-deficient or fixed-``steps`` block is gathered (module docstring).

    Args:
        targets: :class:`~model_map.WeightView` s (not factorized, not grouped convs), in the same order on
            every rank: this is a collective.
        options: :class:`~functional.isometry.FIREOptions`; ``scale``, ``dtype`` and ``on_degenerate``
            apply. An iteration run to its tolerance reaches the exact polar factor, which the Gram route
            computes directly; a fixed ``steps`` count stops short of it, so such a block is gathered and
            orthogonalized with ``options`` as one process does.
        record_spectra: keep singular values before/after (square roots of the Gram matrix's eigenvalues).

    Returns:
        For each target, one :class:`~functional.isometry.FireRecord` per block, identical on every rank.

    Example:
        >>> records = sharded_fire([view_q, view_fc], FIREOptions())   # on every rank: a collective
    """
    blocks = [_blocks_of(target, options) for target in targets]
    by_group: dict[int, tuple] = {}  # the Gram route's blocks of each mesh, in order (the same on every rank)
    gathered = []
    for block in (b for bs in blocks for b in bs):
        if options.steps is None:
            group = block.target.param.device_mesh.get_group()
            by_group.setdefault(id(group), (group, []))[1].append(block)
        else:
            gathered.append(block)
    for group, members in by_group.values():
        again = _gram_pass(members, group, options, record_spectra, gathered)
        for block in again:  # the float32 Gram matrix was not accurate enough: float64, as one process falls back
            block.float32_gram = False
        _gram_pass(again, group, options, record_spectra, gathered)
    for block in gathered:  # partial or rank-deficient: the whole block on every rank
        group = block.target.param.device_mesh.get_group()
        block.record, new = _fire_gathered(block, options, record_spectra, group)
        if new is not None:
            block.write(new)
    return [[b.record for b in bs] for bs in blocks]


def _blocks_of(target, options) -> list[_Block]:
    if target.factorized or target.groups != 1:
        what = "factorized (W_p + BA)" if target.factorized else f"a grouped conv ({target.groups} groups)"
        raise NotImplementedError(f"FIRE on {target.name} under FSDP2: the weight is {what}, which is not sharded "
                                  "by rows; exclude it from FIRE's selection or train with strategy='ddp'")
    start, stop = local_span(target.param)
    spans = _chunks(target.param.shape[0], target.param.device_mesh.size())
    row_blocks = target.block_list()
    out = []
    for block in row_blocks:
        name = target.name if len(row_blocks) == 1 else f"{target.name}[{block.label}]"
        rows = list(block.rows)  # the block's rows of the (out, in) view
        if target.transposed:  # X = the block transposed: its rows are the stored rows, all of them
            holders = [list(range(a, b)) for a, b in spans]
            index = (slice(None), _index(rows))
            total, cols = target.param.shape[0], len(rows)
        else:  # X = the block: each rank holds those of its rows in its span, in the block's order
            holders = [[p for p, i in enumerate(rows) if a <= i < b] for a, b in spans]
            index = (_index([i - start for i in rows if start <= i < stop]),)
            total, cols = len(rows), target.param.shape[1]
        shape = (total, cols) if not target.transposed else (cols, total)
        method = choose_method(shape, target.param.device, options.torch_dtype) if options.method == "auto" \
            else options.method
        eigh_route = method == "eigh" and options.torch_dtype == torch.float32 and target.param.dtype != torch.float64
        out.append(_Block(target, name, index, [torch.tensor(h, dtype=torch.long) for h in holders], total, cols,
                          tuple(target.param.shape[2:]), eigh_route, float32_gram=eigh_route))
    return out


def _gram_pass(blocks: list[_Block], group, options, record_spectra: bool, gathered: list) -> list[_Block]:
    """The Gram route for ``blocks``, ``world`` at a time; appends rank-deficient blocks to ``gathered`` and
    returns those whose float32 Gram matrix was not accurate enough."""
    size, again = dist.get_world_size(group), []
    for start in range(0, len(blocks), size):
        for block, code in _gram_round(blocks[start:start + size], group, options, record_spectra):
            if code == DEFICIENT:
                gathered.append(block)
            elif code == AGAIN_IN_FLOAT64:
                again.append(block)
    return again


def _gram(Y: torch.Tensor) -> torch.Tensor:
    """``YᵀY`` from three products of column halves written in place (3/4 of ``Y.mT @ Y``'s multiply-adds; torch
    has no ``syrk``), the fourth block a transposed copy. Small or batched (conv taps): one product."""
    n = Y.shape[-1]
    if n < 256 or Y.dim() > 2:
        return Y.mT @ Y
    half = n // 2
    left, right = Y[:, :half], Y[:, half:]
    out = Y.new_empty(n, n)
    torch.mm(left.mT, left, out=out[:half, :half])
    torch.mm(right.mT, left, out=out[half:, :half])
    torch.mm(right.mT, right, out=out[half:, half:])
    out[:half, half:] = out[half:, :half].mT
    return out


def _gram_round(blocks: list[_Block], group, options, record_spectra: bool) -> list[tuple[_Block, int]]:
    """Up to ``world`` blocks, block ``i`` decomposed on rank ``i``; each block with its owner's finding."""
    started = time.perf_counter()
    me = dist.get_rank(group)
    tall = [block.read_tall(group) for block in blocks]  # a wide block's columns: fetched once, kept for the products
    owned = _reduce_to_owners(blocks, tall, group)
    spectrum = max(b.taps * b.tall_shape[1] for b in blocks) if record_spectra else 0
    found = torch.zeros(HEADER + spectrum, dtype=torch.float64)  # this rank's finding on its own block
    inverse_sqrt = None
    if owned is not None:
        inverse_sqrt = _decompose(blocks[me], owned, options, found, record_spectra)
        del owned
    header, inverse_sqrt_of = _share_from_owners(blocks, found, inverse_sqrt, group)
    del inverse_sqrt
    status = header[:, 0].long().tolist()
    for block, code, (scale, dfi_before) in zip(blocks, status, header[:, 1:3].tolist()):
        block.record = FireRecord(block.name, block.view_shape(), scale=scale, dfi_before=dfi_before)
        if code in (NON_FINITE, ZERO):
            what = "contains NaN/Inf" if code == NON_FINITE else "is all zero (no polar factor)"
            _skip_degenerate(block.record, f"FIRE: {block.name} {what}", "non-finite" if code == NON_FINITE else "zero",
                             options.on_degenerate)  # raises on every rank before any block of the round changes
    shares, done, probes = [], [], {}
    for owner, block in enumerate(blocks):
        if status[owner] != OK:
            continue
        n = block.tall_shape[1]
        compute = torch.float32 if header[owner, 4] else torch.float64
        Y = tall[owner]
        new = (Y.to(compute) @ inverse_sqrt_of(owner, compute)).mul_(block.record.scale)
        new = new.to(block.target.param.dtype)  # as it is stored: the SFE and DfI after measure what is written
        new64 = new.double()
        if n not in probes:
            probes[n] = torch.randn(n, PROBES, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        Z = probes[n]
        sfe = torch.linalg.vector_norm(Y.double().sub_(new64)).square().reshape(1)
        shares += [sfe, (new64.mT @ (new64 @ Z)).reshape(-1)]
        if record_spectra:
            block.record.spectrum_after = new64.mT @ new64  # summed over ranks below
        del new64
        block.write_tall(new, group)
        done.append((owner, block, Z))
    del tall
    if shares:  # this rank's share of every SFE and of every (QᵀQ)z, in one all-reduce
        total = _all_reduce(torch.cat(shares), group)
        for owner, block, Z in done:
            sfe, products, total = total[0], total[1:1 + Z.numel() * block.taps], total[1 + Z.numel() * block.taps:]
            residual = products.view(-1, *Z.shape) - block.record.scale ** 2 * Z  # (QᵀQ − s²I) z per tap
            block.record.dfi_after = float(residual.square().sum()) / PROBES
            block.record.sfe = float(sfe)
            block.record.sfe_normalized = block.record.sfe / float(header[owner, 3])
    if record_spectra:
        for owner, block, _ in done:
            after = _all_reduce(block.record.spectrum_after, group)
            block.record.spectrum_after = torch.linalg.eigvalsh(after).clamp_min(0).sqrt().flip(-1).float()
            n = block.tall_shape[1]
            block.record.spectrum_before = header[owner, HEADER:HEADER + block.taps * n].view(*block.kernel, n).float()
    seconds = (time.perf_counter() - started) / len(blocks)
    for block in blocks:
        block.record.seconds = seconds
    return list(zip(blocks, status))


def _batched(blocks: list[_Block], extra: int, dtype: torch.dtype, group) -> int | None:
    """The length of one rank's part of a round's batched collective (``extra`` numbers, then the largest block's
    ``n × n`` matrices), or None when ``world`` such parts pass ``BATCH_BYTES`` of the device: each block
    then travels alone."""
    part = extra + max(b.taps * b.tall_shape[1] ** 2 for b in blocks)
    limit = BATCH_BYTES.get(blocks[0].target.param.device.type, DEFAULT_BATCH_BYTES)
    fits = dist.get_world_size(group) * part * dtype.itemsize <= limit
    return part if fits else None


def _reduce_to_owners(blocks: list[_Block], tall: list[torch.Tensor], group) -> torch.Tensor | None:
    """Each block's Gram matrix ``Σ_r Y_rᵀY_r`` on its owner (block ``i`` on rank ``i``; None on a rank that owns
    none): one reduce-scatter for the round, or a reduce per block where the round's matrices would not fit."""
    me, world = dist.get_rank(group), dist.get_world_size(group)
    dtypes = [torch.float32 if b.float32_gram else torch.float64 for b in blocks]
    wire = torch.float64 if torch.float64 in dtypes else torch.float32  # float32 sums are exact in float64
    part = _batched(blocks, 0, wire, group)
    if part is None:  # one n × n matrix at a time
        owned = None
        for owner, (Y, dtype) in enumerate(zip(tall, dtypes)):
            gram = _gram(Y.to(dtype))
            dist.reduce(gram, group=group, group_dst=owner)
            if owner == me:
                owned = gram
        return owned
    send = torch.zeros(world, part, dtype=wire, device=tall[0].device)
    for i, (Y, dtype) in enumerate(zip(tall, dtypes)):
        gram = _gram(Y.to(dtype)).reshape(-1)
        send[i, :gram.numel()] = gram
        del gram
    mine = send.new_empty(part)
    dist.reduce_scatter_single(mine, send.view(-1), group=group)
    if me >= len(blocks):
        return None
    n = blocks[me].tall_shape[1]
    return mine[:blocks[me].taps * n * n].view(*blocks[me].kernel, n, n).to(dtypes[me])


def _share_from_owners(blocks: list[_Block], found: torch.Tensor, inverse_sqrt: torch.Tensor | None, group):
    """Every owner's finding, as the rows of a header identical on every rank, and ``inverse_sqrt_of(owner, dtype)``,
    that block's ``G^{-1/2}`` (called for every decomposed block, in order, on every rank): one all-gather of
    findings and matrices for the round, or an all-reduce of the findings and a broadcast per block where the
    round's matrices would not fit."""
    me, width = dist.get_rank(group), found.numel()
    part = _batched(blocks, width, torch.float64, group)
    if part is None:
        header = torch.zeros(len(blocks), width, dtype=torch.float64)
        if me < len(blocks):
            header[me] = found
        dist.all_reduce(header, group=group)  # each row from its owner

        def broadcast(owner: int, dtype: torch.dtype) -> torch.Tensor:
            n = blocks[owner].tall_shape[1]
            buffer = inverse_sqrt if owner == me else torch.empty(*blocks[owner].kernel, n, n, dtype=dtype,
                                                                  device=blocks[owner].target.param.device)
            dist.broadcast(buffer, group=group, group_src=owner)
            return buffer

        return header, broadcast
    # float32 matrices travel exactly as float64, beside the finding
    send = torch.zeros(part, dtype=torch.float64, device=blocks[0].target.param.device)
    send[:width] = found
    if inverse_sqrt is not None:
        send[width:width + inverse_sqrt.numel()] = inverse_sqrt.reshape(-1)
    everything = send.new_empty(dist.get_world_size(group), part)
    dist.all_gather_single(everything.view(-1), send, group=group)

    def gathered(owner: int, dtype: torch.dtype) -> torch.Tensor:
        n = blocks[owner].tall_shape[1]
        return everything[owner, width:width + blocks[owner].taps * n * n].view(*blocks[owner].kernel, n, n).to(dtype)

    return everything[:len(blocks), :width], gathered


def _decompose(block: _Block, gram: torch.Tensor, options, header: torch.Tensor, record_spectra: bool):
    """On the block's owner: ``G^{-1/2}`` (float32 when the products may run in float32), with
    ``[status, scale, DfI before, ‖X‖², float32 products, spectrum]`` in ``header``."""
    m, n = block.tall_shape
    # A NaN/Inf entry of Y reaches its column's diagonal entry of G: the trace is finite iff Y is.
    diagonal = gram.diagonal(dim1=-2, dim2=-1)
    squared_norm = float(diagonal.sum(dtype=torch.float64))
    single = gram.dtype == torch.float32
    if single and not (math.isfinite(squared_norm) and _FLOAT32_SAFE[0] <= float(diagonal.min())
                       and float(diagonal.max()) <= _FLOAT32_SAFE[1]):
        header[0] = AGAIN_IN_FLOAT64  # overflow, underflow or NaN in float32: float64 decides
        return None
    if not math.isfinite(squared_norm) or squared_norm == 0.0:
        header[0] = NON_FINITE if not math.isfinite(squared_norm) else ZERO
        return None
    if options.scale == "preserve_norm":
        scale = math.sqrt(squared_norm / (min(m, n) * block.taps))
    else:
        scale = target_scale(torch.empty(block.view_shape(), device="meta"), options.scale)
    header[1], header[3] = scale, squared_norm
    if single:
        inverse_sqrt, eigenvalues = _float32_inverse_sqrt(gram)
        if inverse_sqrt is None:
            header[0] = AGAIN_IN_FLOAT64
            return None
        header[4] = 1.0
    else:
        inverse_sqrt, eigenvalues, float32_products = _float64_inverse_sqrt(gram, block)
        if inverse_sqrt is None:  # a zero conv tap has no polar factor from its Gram matrix either: gathered
            header[0] = DEFICIENT
            return None
        header[4] = float(float32_products)
    eigenvalues = eigenvalues.double().clamp_min(0)
    header[2] = float((eigenvalues - scale**2).square().sum())
    if record_spectra:
        header[HEADER:HEADER + block.taps * n] = eigenvalues.sqrt().flip(-1).reshape(-1)
    header[0] = OK
    return inverse_sqrt


def _float32_inverse_sqrt(gram: torch.Tensor):
    """One process's float32 ``eigh`` route (``spectral._eigh_polar``): ``(G^{-1/2}, eigenvalues)`` in float32
    where a Lanczos estimate of ``κ²``, and then the exact eigenvalues, keep its rounding below a float32
    SVD's; ``(None, None)`` where they do not."""
    bad = torch.zeros(gram.shape[:-2], dtype=torch.bool)
    if not bool((_condition_squared_estimate(gram, bad) * _UNIT_ROUNDOFF32 <= FLOAT32_GRAM_MAX_ERROR).all()):
        return None, None
    eigenvalues, V = torch.linalg.eigh(gram)  # ascending
    if not bool((eigenvalues[..., 0] * FLOAT32_GRAM_MAX_ERROR >= _UNIT_ROUNDOFF32 * eigenvalues[..., -1]).all()):
        return None, None
    inverse_root = eigenvalues.clamp_min(torch.finfo(torch.float32).tiny).rsqrt()
    return (V * inverse_root[..., None, :]) @ V.mT, eigenvalues


def _float64_inverse_sqrt(gram: torch.Tensor, block: _Block):
    """``(G^{-1/2}, eigenvalues, float32 products)`` from a float64 ``eigh`` (it reads the lower triangle,
    so the sum over ranks need not be symmetric to the last bit); ``G^{-1/2}`` is None where ``G`` is
    numerically rank-deficient. The products run in float32 on one process's ``eigh`` route where their
    rounding ``eps₃₂·κ`` stays below ``DEFAULT_TOL``."""
    n = gram.shape[-1]
    eigenvalues, V = torch.linalg.eigh(gram)  # ascending
    del gram
    if bool((eigenvalues[..., 0] <= n * torch.finfo(torch.float64).eps * eigenvalues[..., -1]).any()):
        return None, eigenvalues, False  # rank below n: the null directions need the whole matrix
    condition = (eigenvalues[..., -1] / eigenvalues[..., 0]).sqrt()
    float32_products = block.eigh_route and bool((condition * 1.2e-7 <= DEFAULT_TOL).all())
    root = V.mul_(eigenvalues.rsqrt().sqrt()[..., None, :])  # V Λ^{-1/4}: G^{-1/2} = (V Λ^{-1/4})(V Λ^{-1/4})ᵀ
    inverse_sqrt = _gram(root.mT)
    return (inverse_sqrt.float() if float32_products else inverse_sqrt), eigenvalues, float32_products


def _fire_gathered(block: _Block, options, record_spectra: bool, group):
    """FIRE on one block gathered whole on every rank and solved as on one process: a rank-deficient one (no
    full isometry from ``G``), or a fixed number of iterations (the FIRE recipes' 5 or 10 Newton–Schulz
    steps stop short of the exact factor). Returns the record and this rank's new rows of ``X`` (None when skipped)."""
    started = time.perf_counter()
    record = FireRecord(block.name, block.view_shape())
    X_local = block.local_rows()
    flags = _all_reduce(torch.tensor([float(not bool(torch.isfinite(X_local).all()))], dtype=torch.float64,
                                     device=X_local.device), group)
    if flags.item():
        return _skip_degenerate(record, f"FIRE: {block.name} contains NaN/Inf", "non-finite", options.on_degenerate), None
    positions = block.holders[dist.get_rank(group)]
    full = X_local.double().new_zeros(*block.kernel, block.rows, block.cols)  # zero-padded all-reduce: a gather
    full[..., positions, :] = X_local.double()
    full = _all_reduce(full, group)
    squared_norm = float(full.square().sum())
    if squared_norm == 0.0:
        return _skip_degenerate(record, f"FIRE: {block.name} is all zero (no polar factor)", "zero",
                                options.on_degenerate), None
    if options.scale == "preserve_norm":
        scale = math.sqrt(squared_norm / (min(block.rows, block.cols) * block.taps))
    else:
        scale = target_scale(torch.empty(block.view_shape(), device="meta"), options.scale)
    record.scale = scale
    if options.steps is not None:
        polar = orthogonalize(full, replace(options, on_degenerate="skip")).mul_(scale)
    else:
        U, _, Vh = torch.linalg.svd(full, full_matrices=False)
        polar = (U @ Vh).mul_(scale)
    record.dfi_before = float(deviation_from_isometry(full, scale, torch.float64).sum())
    record.dfi_after = float(deviation_from_isometry(polar, scale, torch.float64).sum())
    if record_spectra:
        record.spectrum_before = torch.linalg.svdvals(full).float().cpu()
        record.spectrum_after = torch.linalg.svdvals(polar).float().cpu()
    record.sfe = float((full - polar).square().sum())
    record.sfe_normalized = record.sfe / squared_norm
    record.seconds = time.perf_counter() - started
    return record, polar[..., positions, :]
