"""``apply_fire``: FIRE on the selected weights of a model, once, as a plain function (no Lightning).

The model-level half of FIRE: select weights through the model map, orthogonalize each (one row
block at a time, :func:`~functional.isometry.fire_matrix`; a block is any set
of rows, a grouped conv is treated per group and tap), write them back (a factorized weight
through ``W_p + BA``) and drop the optimizer state of exactly those weights. A fused matrix whose
split is unknown is refused with the declarations that fit it. Under FSDP2 each rank writes its own
rows of every polar factor, the decompositions spread over the ranks
(:func:`~distributed.sharded_fire.sharded_fire`).

On CPU with ``torch.get_num_threads() = T > 1`` the weights are solved ``T`` at a time, one thread each:
LAPACK's SVD and ``eigh`` gain little from threads inside one matrix (and spin against other work on a
busy machine), while independent matrices scale with the threads. On a GPU the weights of one shape are
solved as one batch (:func:`~functional.isometry.fire_matrices`): small solves there cost their kernel
launches and synchronizations, which a batch pays once.

A weight a parametrization computes (:mod:`~model_map.parametrized`) is orthogonalized as the forward uses it
and written back through the parametrization (:data:`FIRE_THROUGH`): under weight norm the effective weight
becomes exactly FIRE's result (``v`` its direction, ``g`` its row norms); under spectral norm the original takes
it and the forward divides by its largest singular value, so the effective weight is the polar factor itself
(σ_max = 1 is what spectral norm allows, whatever ``scale`` says); an orthogonal one is already an isometry and
is skipped, named in a warning. The optimizer state dropped is the originals' (``g``, ``v``, ``original``).
"""
from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

from ..functional.isometry import FireItem, FIREOptions, FireRecord, fire_matrices, fire_matrix
from ..model_map import (Selection, WeightView, refuse_parametrized, refuse_unknown_splits, require_targets,
                         select_targets)
from ..distributed.strategy import is_dtensor
from .optimizer_state import leaf_optimizers, reset_optimizer_state
from ..distributed.sharded_fire import sharded_fire

# How FIRE meets each parametrization (see the module docstring): "" acts through it, else why it is left alone.
FIRE_THROUGH = {"weight norm": "", "spectral norm": "",
                "orthogonal": "already an isometry by construction, which is what FIRE would make of it"}


def apply_fire(
    module: nn.Module,
    optimizers=None,
    options: FIREOptions | None = None,
    selection: Selection | None = None,
    record_spectra: bool = False,
    targets: list[WeightView] | None = None,
) -> list[FireRecord]:
    """Orthogonalize the selected weights of ``module`` in place, rescale them, reset their optimizer state.

    Args:
        module: the model whose weights change.
        optimizers: an optimizer or a list of them (None: no optimizer state to reset).
        options: how to orthogonalize and rescale (:class:`FIREOptions`; None: its defaults).
        selection: which weights (:class:`~model_map.Selection`; None: every
            weight but the head); ignored when ``targets`` is given.
        record_spectra: keep singular values before/after in each record.
        targets: the exact weights to change.

    A parameter with NaN/Inf, or all zero (nanochat's zero-initialized ``c_proj``), is skipped with
    a warning (or raises, ``on_degenerate="raise"``). Returns one :class:`FireRecord` per target.

    Example:
        >>> records = apply_fire(model, optimizer, FIREOptions(method="svd"), Selection(scope="attention"))
        >>> sum(r.dfi_after for r in records)
    """
    options = FIREOptions() if options is None else options
    if not isinstance(options, FIREOptions):
        raise ValueError(f"apply_fire options={options!r} must be a FIREOptions")
    leaves = list(leaf_optimizers(optimizers))  # checked before any weight changes
    foreign = [type(o).__name__ for o in leaves if not (hasattr(o, "state") and hasattr(o, "param_groups"))]
    if foreign:
        raise TypeError(f"apply_fire(optimizers=...) takes a torch optimizer, a list of them or None, got a "
                        f"{foreign[0]}")
    if targets is None:  # an empty selection (a pattern that matches nothing) is an error, not a silent no-op
        selection = Selection() if selection is None else selection
        targets = require_targets(select_targets(module, selection), "apply_fire", selection, FIRE_THROUGH)
    else:
        targets = refuse_parametrized(targets, "apply_fire", FIRE_THROUGH)
    refuse_unknown_splits(targets, "FIRE")
    sharded_through = [t.name for t in targets if t.through is not None and is_dtensor(t.param)]
    if sharded_through:
        raise NotImplementedError(f"FIRE: {sharded_through} are computed by a parametrization and sharded by FSDP2, "
                                  "whose rows per rank are not the effective weight's; remove the parametrization, "
                                  "exclude them or run FIRE unsharded (DDP)")
    sharded_stacks = [t.name for t in targets if t.stack and is_dtensor(t.param)]
    if sharded_stacks:
        raise NotImplementedError(f"FIRE: {sharded_stacks} are expert stacks sharded by FSDP2, whose rows per rank do "
                                  "not follow expert boundaries; exclude them or run FIRE unsharded (DDP)")
    records, fired = [], []
    local = [t for t in targets if not is_dtensor(t.param)]
    on_cpu = all(t.param.device.type == "cpu" for t in local)
    workers = min(torch.get_num_threads(), len(local)) if on_cpu else 1
    # On a GPU, launches and synchronizations, not arithmetic, set the time of small solves: batch them by shape.
    batched = _fire_batched(local, options, record_spectra) if local and not on_cpu else {}
    sharded = [t for t in targets if is_dtensor(t.param)]  # FSDP2: a collective over all of them at once
    sharded = dict(zip(map(id, sharded), sharded_fire(sharded, options, record_spectra) if sharded else []))
    with _thread_pool(workers) as pool:
        pending = {id(t): pool.submit(_fire_target, t, options, record_spectra) for t in local} if pool else {}
        for target in targets:
            if is_dtensor(target.param):  # FSDP2: each rank wrote its own rows above
                done = sharded[id(target)]
            elif id(target) in batched:
                done = batched[id(target)]
            elif pool:
                done = pending[id(target)].result()
            else:
                done = _fire_target(target, options, record_spectra)
            records.extend(done)
            if any(r.skipped is None for r in done):
                fired.extend(target.trainable())
    if options.reset_optimizer and optimizers is not None and fired:
        reset_optimizer_state(optimizers, fired)
    return records


def _fire_target(target: WeightView, options: FIREOptions, record_spectra: bool) -> list[FireRecord]:
    """FIRE on one (unsharded) weight, one row block at a time, written back in place."""
    records = []
    with torch.no_grad():
        weight = target.read()  # (out, in, *k); a view of the parameter unless factorized
        blocks = target.block_list()
        for block in blocks:
            name = target.name if len(blocks) == 1 else f"{target.name}[{block.label}]"
            rows = block.take(weight)  # a view for contiguous rows, else a copy put back below
            records.append(fire_matrix(name, rows, options, record_spectra, target.groups))
            block.put(weight, rows)
        target.write(weight)
    return records


def _fire_batched(targets: list[WeightView], options: FIREOptions, record_spectra: bool) -> dict[int, list[FireRecord]]:
    """FIRE on every row block of ``targets`` in one :func:`fire_matrices` call (batched by shape), written back;
    the records by ``id`` of the target. Every weight is checked before any changes."""
    opened, items = [], []
    with torch.no_grad():
        for target in targets:
            weight = target.read()  # (out, in, *k); a view of the parameter unless factorized
            blocks = target.block_list()
            rows = [block.take(weight) for block in blocks]  # views for contiguous rows, else copies put back below
            opened.append((target, weight, blocks, rows))
            items += [FireItem(target.name if len(blocks) == 1 else f"{target.name}[{block.label}]", part, target.groups)
                      for block, part in zip(blocks, rows)]
        records = fire_matrices(items, options, record_spectra)
        by_target, start = {}, 0
        for target, weight, blocks, rows in opened:
            for block, part in zip(blocks, rows):
                block.put(weight, part)
            target.write(weight)
            by_target[id(target)] = records[start:start + len(blocks)]
            start += len(blocks)
    return by_target


@contextlib.contextmanager
def _thread_pool(workers: int):
    """``workers`` threads of one intra-op thread each (None when ``workers <= 1``); the thread count is
    restored after."""
    if workers <= 1:
        yield None
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    pool = ThreadPoolExecutor(workers, initializer=torch.set_num_threads, initargs=(1,))
    try:
        yield pool
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        torch.set_num_threads(threads)
