"""FIRE on many weights at once: one batched polar factor per group of equal shape, dtype and scale.

On a GPU, FIRE on a model is a few hundred small solves whose kernel launches and host synchronizations,
not their arithmetic, set the time: on an H100, ``fire_matrix`` one weight at a time takes about 14 ms per
768×768 weight whatever its size up to 1024, so 1.0 s for the 72 weights of a GPT-2-small-sized model, 30
training steps. Stacking the weights of one shape into one ``(B, m, n)`` batch runs each step's products for
all of them at once (``orthogonalize`` works per slice: its own normalization, Polar Express schedule,
convergence test and SVD fallback) and reads every record back in one transfer per group. The result per
weight is :func:`~functional.isometry.fire_matrix`'s, up to the iteration's rounding (checked in
``tests/test_fire_batch.py``). The batch is a copy: at most ``max_batch_bytes`` of weights are stacked at a
time, so the extra memory is a few times that, not the model's.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

import torch

from .isometry import FIREOptions, FireRecord, _skip_degenerate, as_matrices, target_scale
from .spectral import (
    deviation_from_isometry,
    estimated_deviation_from_isometry,
    largest_entry,
    orthogonalize,
    singular_values,
)


@dataclass
class FireItem:
    """One weight (or row block of one) for :func:`fire_matrices`: ``param`` in ``(out, in, *k)`` orientation,
    written in place; ``groups`` of a grouped conv (one polar factor per group and tap)."""

    name: str
    param: torch.Tensor
    groups: int = 1


def fire_matrices(items: list[FireItem], options: FIREOptions, record_spectra: bool = False,
                  max_batch_bytes: int = 1 << 30) -> list[FireRecord]:
    """FIRE on every item, batched by matrix shape, dtype, device and target scale; one record per item, in order.

    Args:
        items: the weights, each changed in place (a degenerate one is skipped or raises as
            ``options.on_degenerate`` says, exactly as :func:`~functional.isometry.fire_matrix` does).
        options: how to orthogonalize and rescale.
        record_spectra: keep singular values before/after in each record.
        max_batch_bytes: the most bytes of weights stacked into one batch.

    Example:
        >>> items = [FireItem(f"w{i}", torch.randn(64, 32)) for i in range(8)]
        >>> records = fire_matrices(items, FIREOptions(method="polar_express"))   # one batched solve
    """
    records = [FireRecord(item.name, tuple(item.param.shape)) for item in items]
    groups: dict[tuple, list[int]] = {}
    for i, item in enumerate(items):
        param, record = item.param, records[i]
        if param.dim() < 2:
            record.skipped = f"{param.dim()}-D parameter"
            continue
        if param.numel() == 0:
            records[i] = _skip_degenerate(record, f"FIRE: {item.name} has shape {tuple(param.shape)}, no entries "
                                          "(no polar factor)", "empty", options.on_degenerate)
            continue
        peak = float(largest_entry(param.flatten(1)))  # one pass: NaN/Inf and all-zero alike
        if not math.isfinite(peak):
            records[i] = _skip_degenerate(record, f"FIRE: {item.name} contains NaN/Inf", "non-finite",
                                          options.on_degenerate)
            continue
        if peak == 0.0:
            records[i] = _skip_degenerate(record, f"FIRE: {item.name} is all zero (no polar factor)", "zero",
                                          options.on_degenerate)
            continue
        record.scale = target_scale(param, options.scale, item.groups)
        matrices = as_matrices(param, item.groups)
        key = (tuple(matrices.shape[-2:]), param.dtype, param.device, record.scale)
        groups.setdefault(key, []).append(i)
    for indices in groups.values():
        for chunk in _chunks(indices, items, max_batch_bytes):
            _fire_group([items[i] for i in chunk], [records[i] for i in chunk], options, record_spectra)
    return records


def _chunks(indices: list[int], items: list[FireItem], max_batch_bytes: int):
    chunk, size = [], 0
    for i in indices:
        nbytes = items[i].param.numel() * items[i].param.element_size()
        if chunk and size + nbytes > max_batch_bytes:
            yield chunk
            chunk, size = [], 0
        chunk.append(i)
        size += nbytes
    if chunk:
        yield chunk


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fire_group(items: list[FireItem], records: list[FireRecord], options: FIREOptions, record_spectra: bool) -> None:
    """One batched solve for weights of one matrix shape, dtype and scale; fills their records."""
    views = [as_matrices(item.param, item.groups) for item in items]  # views: writing them writes the weights
    counts = [math.prod(v.shape[:-2]) for v in views]
    m, n = views[0].shape[-2:]
    s, dtype, device = records[0].scale, options.torch_dtype, items[0].param.device
    _synchronize(device)
    started = time.perf_counter()
    X = torch.cat([v.reshape(-1, m, n) for v in views])  # (B, m, n), a copy
    # An all-zero conv tap inside a weight that is not all zero stays as it is, without a warning.
    polar, info = orthogonalize(X, replace(options, on_degenerate="skip"), return_info=True, warn_degenerate=False)
    exact = info.singular_values is not None  # svd / eigh: the spectrum came with the polar factor
    if exact:
        dfi_before = (info.singular_values.square() - s * s).square().sum(-1)
        squared_norm = info.singular_values.square().sum(-1)
    else:
        dfi_before = deviation_from_isometry(X, s, dtype)
    spectra_before = (info.singular_values.flip(-1).float() if exact else singular_values(X)) if record_spectra else None
    polar.mul_(s)
    # As fire_matrix: the difference in float32 (or float64), squares of entries beyond 1e±15 in float64.
    wide = torch.float64 if X.dtype == torch.float64 else torch.float32
    peak = float(largest_entry(X.flatten(1)).max())
    norm_dtype = None if 1e-15 < peak < 1e15 else torch.float64
    sfe = torch.linalg.vector_norm(X.to(wide) - polar.to(wide), dim=(-2, -1), dtype=norm_dtype).double().square()
    if not exact:
        squared_norm = torch.linalg.vector_norm(X.to(wide), dim=(-2, -1), dtype=norm_dtype).double().square()
    del X
    for view, part in zip(views, polar.split(counts)):
        view.copy_(part.reshape(view.shape))
    _synchronize(device)
    seconds = time.perf_counter() - started
    dfi_after = estimated_deviation_from_isometry(polar, s) if exact else deviation_from_isometry(polar, s, dtype)
    fell_back = (info.fell_back_slices.double() if info.fell_back_slices is not None
                 else torch.zeros_like(sfe))
    table = torch.stack([dfi_before.double(), sfe, squared_norm.double(), dfi_after.double(), fell_back], 1).cpu()
    spectra_after = singular_values(polar).cpu() if record_spectra else None
    total = sum(counts)
    start = 0
    for record, count, view in zip(records, counts, views):
        before, error, norm, after, missed = table[start:start + count].sum(0).tolist()
        record.dfi_before, record.sfe, record.dfi_after, record.fell_back = before, error, after, int(missed)
        record.sfe_normalized = error / norm if norm > 0 else float("nan")
        record.iterations, record.matmuls = info.iterations, info.matmuls
        record.seconds = seconds * count / total  # the batch's time, shared by slice count
        if record_spectra:
            record.spectrum_before = spectra_before[start:start + count].reshape(*view.shape[:-2], -1).cpu()
            record.spectrum_after = spectra_after[start:start + count].reshape(*view.shape[:-2], -1)
        start += count
