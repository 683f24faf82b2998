"""FIRE (Han et al., arXiv 2602.08040) on weights: ``scale · polar(W)``, its options and its record.

:func:`plasticity_callbacks.ops.fire.apply_fire` walks a model with it. Each selected weight is
replaced by ``scale · polar(W)`` in its ``(out, in)`` orientation (HF ``Conv1D`` is transposed first;
conv kernels: one polar factor per spatial tap, as the reference code does, and per group for a grouped
or depthwise conv, whose operator is block-diagonal over groups; a fused matrix such as Q/K/V, gate/up
or an LSTM's gates: one polar factor per row block, as the reference code splits GPT-2's ``c_attn``),
then the optimizer state of exactly those weights is dropped. A factorized weight (``W_p + BA``) is
treated as its effective weight. On CPU weights are processed one at a time per thread (``apply_fire``
runs one per torch thread), so the extra memory is that of a few matrices' solves (about 3× the largest
matrix each), not of the model.

:func:`fire_matrices` solves many weights as one batch per group of equal shape, dtype and scale (what
``apply_fire`` does on a GPU): a small solve on a GPU costs its kernel launches and host synchronizations,
not its arithmetic (on an H100 about 14 ms per weight up to 1024², so 1.0 s one weight at a time for the
72 weights of a GPT-2-small-sized model, 0.15 s batched). Each slice of a batch keeps its own
normalization, Polar Express schedule, convergence test and SVD fallback; at most ``max_batch_bytes`` of
weights are stacked at a time.

The diagnostics cost no second factorization: with an exact method (SVD, ``eigh``) DfI before comes
from the singular values the solver computed, SFE from one pass over the difference, and DfI after
from a few probe vectors (the result is an isometry by construction); an iteration's (possibly
partial) result is measured with Gram matrices.
"""
from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, field, replace

import torch

from ..arguments import refuse_unknown_fields

from .spectral import (
    DegenerateMatrixError,
    PolarOptions,
    deviation_from_isometry,
    estimated_deviation_from_isometry,
    largest_entry,
    orthogonalize,
    singular_values,
)

SCALES = ("sqrt_dout_din", "unit", "preserve_norm")


@dataclass
class FireRecord:
    """What FIRE did to one parameter. DfI is measured against the target scale (0 = isometry at that scale)."""

    name: str
    shape: tuple[int, ...]
    scale: float = float("nan")
    dfi_before: float = float("nan")  # from the solver's singular values where it computed them (svd, eigh)
    dfi_after: float = float("nan")  # exact methods: an 8-probe estimate (spectral.estimated_deviation_from_isometry)
    sfe: float = float("nan")  # ‖W − W̃‖²_F
    sfe_normalized: float = float("nan")  # SFE / ‖W‖²_F
    iterations: int = 0
    matmuls: int = 0
    fell_back: int = 0  # slices solved by SVD after missing tol
    seconds: float = 0.0
    skipped: str | None = None  # why the parameter was left unchanged, if it was
    spectrum_before: torch.Tensor | None = field(default=None, repr=False)
    spectrum_after: torch.Tensor | None = field(default=None, repr=False)


def as_matrices(param: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """A view of a weight as a batch of matrices: ``(d_out, d_in)`` stays; a conv kernel
    ``(C_out, C_in/groups, *k)`` becomes ``(groups, *k, C_out/groups, C_in/groups)`` (no group axis
    when ``groups == 1``), one matrix per group and spatial tap."""
    if param.dim() == 2:
        return param
    if groups == 1:
        return param.permute(*range(2, param.dim()), 0, 1)
    grouped = param.unflatten(0, (groups, -1))  # (groups, C_out/groups, C_in/groups, *k)
    return grouped.permute(0, *range(3, grouped.dim()), 1, 2)


def target_scale(param: torch.Tensor, rule: str | float, groups: int = 1) -> float:
    """``sqrt_dout_din``: ``√(d_out/d_in)`` (conv: ``√(C_out/C_in)/(k_h·k_w)``, the reference's; per group
    for a grouped conv); ``unit``: 1 (a pure isometry); ``preserve_norm``: keep ``‖W‖_F``; a number: that scale."""
    if not isinstance(rule, str):
        return float(rule)
    d_out, d_in = param.shape[0] // groups, param.shape[1]
    taps = math.prod(param.shape[2:]) * groups if rule == "preserve_norm" else math.prod(param.shape[2:])
    if rule == "sqrt_dout_din":
        return math.sqrt(d_out / d_in) / taps
    if rule == "unit":
        return 1.0
    rank = min(d_out, d_in) * taps  # ‖scale·Q‖_F² = scale²·rank
    peak = param.detach().abs().amax().double()  # divide first: squares of 1e20 or 1e-25 leave float32's range
    return float(peak * torch.linalg.vector_norm(param.detach().double() / peak)) / math.sqrt(rank)


@refuse_unknown_fields
@dataclass(frozen=True)
class FIREOptions(PolarOptions):
    """How FIRE orthogonalizes and rescales each weight; checked once, when built. The polar-factor
    fields are :class:`~functional.spectral.PolarOptions`' (``method``, ``normalize``,
    ``steps`` or ``max_steps``/``tol``, ``check_every``, ``dtype``, ``on_degenerate``), and the object goes
    to ``orthogonalize`` as it is.

    Args:
        scale: ``sqrt_dout_din`` | ``unit`` | ``preserve_norm`` | a positive number (see :func:`target_scale`).
        reset_optimizer: drop the optimizer state of exactly the weights that changed.

    Example:
        >>> options = FIREOptions(method="newton_schulz", normalize="frobenius", steps=10)  # the authors' continual
        >>> options = FIREOptions(method="newton_schulz", normalize="frobenius", steps=5)   # ... and LM recipe
        >>> records = apply_fire(model, optimizer, options)
        >>> FIREReinit(options=options)   # the same object configures the callback
    """

    scale: str | float = "sqrt_dout_din"
    reset_optimizer: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.rcond is not None:
            raise ValueError(f"rcond={self.rcond!r}: FIRE's result is a full isometry; a partial one is "
                             "orthogonalize's option, not FIRE's")
        known_rule = isinstance(self.scale, str) and self.scale in SCALES
        positive_number = (isinstance(self.scale, (int, float)) and not isinstance(self.scale, bool)
                           and 0 < self.scale < math.inf)
        if not (known_rule or positive_number):
            raise ValueError(f"scale={self.scale!r} is not one of {SCALES} or a positive finite number")
        if not isinstance(self.reset_optimizer, bool):
            raise ValueError(f"reset_optimizer={self.reset_optimizer!r} must be true or false")


def _skip_degenerate(record: FireRecord, message: str, reason: str, on_degenerate: str) -> FireRecord:
    """A matrix with no polar factor is never written: raise, or warn and record why it was skipped."""
    if on_degenerate == "raise":
        raise DegenerateMatrixError(message)
    warnings.warn(message + "; left unchanged", stacklevel=4)  # point at apply_fire's caller
    record.skipped = reason
    return record


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
        items: the weights, each changed in place (a degenerate one, empty, all zero or with NaN/Inf, is
            skipped with a warning or raises as ``options.on_degenerate`` says; all are checked before any
            is written).
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


def fire_matrix(name: str, param: torch.Tensor, options: FIREOptions, record_spectra: bool = False,
                groups: int = 1) -> FireRecord:
    """FIRE on one matrix (or conv kernel of ``groups`` groups) ``param`` in ``(out, in, *k)`` orientation,
    written in place: :func:`fire_matrices` of that one weight.

    Args:
        name: the weight's name, for the record and warnings.
        param: the weight (or one row block of it), changed in place.
        options: how to orthogonalize and rescale.
        record_spectra: keep singular values before/after in the record.
        groups: a grouped conv's groups: one polar factor per group and tap.

    Example:
        >>> record = fire_matrix("w", torch.randn(64, 32), FIREOptions(method="svd"))
    """
    return fire_matrices([FireItem(name, param, groups)], options, record_spectra)[0]


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
    # One weight is solved in place of its own view (no extra memory); several are stacked, a (B, m, n) copy.
    X = views[0] if len(views) == 1 else torch.cat([v.reshape(-1, m, n) for v in views])
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
    # W and sW̃ are of one magnitude: their difference in float32 (or float64) is exact to its rounding (Sterbenz
    # where they are close); squares of entries beyond 1e±15 (outside float32's range) are taken in float64.
    wide = torch.float64 if X.dtype == torch.float64 else torch.float32
    peak = float(largest_entry(X.flatten(1)).max())
    norm_dtype = None if 1e-15 < peak < 1e15 else torch.float64
    sfe = torch.linalg.vector_norm(X.to(wide) - polar.to(wide), dim=(-2, -1), dtype=norm_dtype).double().square()
    if not exact:
        squared_norm = torch.linalg.vector_norm(X.to(wide), dim=(-2, -1), dtype=norm_dtype).double().square()
    del X
    for view, part in zip(views, polar.reshape(-1, m, n).split(counts)):
        view.copy_(part.reshape(view.shape))
    _synchronize(device)
    seconds = time.perf_counter() - started
    dfi_after = estimated_deviation_from_isometry(polar, s) if exact else deviation_from_isometry(polar, s, dtype)
    fell_back = (info.fell_back_slices.double() if info.fell_back_slices is not None
                 else torch.zeros_like(sfe))
    per_slice = (dfi_before.double(), sfe, squared_norm.double(), dfi_after.double(), fell_back)
    table = torch.stack([column.reshape(-1) for column in per_slice], 1).cpu()  # (B, 5): one transfer
    if record_spectra:
        spectra_before = spectra_before.reshape(-1, spectra_before.shape[-1])
        spectra_after = singular_values(polar).cpu().reshape(-1, spectra_before.shape[-1])
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
