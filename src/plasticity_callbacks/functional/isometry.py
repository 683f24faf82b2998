"""FIRE (Han et al., arXiv 2602.08040) on one weight: ``scale · polar(W)``, its options and its record.

:func:`plasticity_callbacks.ops.fire.apply_fire` walks a model with it. Each selected weight is
replaced by ``scale · polar(W)`` in its ``(out, in)`` orientation (HF ``Conv1D`` is transposed first;
conv kernels: one polar factor per spatial tap, as the reference code does, and per group for a grouped
or depthwise conv, whose operator is block-diagonal over groups; a fused matrix such as Q/K/V, gate/up
or an LSTM's gates: one polar factor per row block, as the reference code splits GPT-2's ``c_attn``),
then the optimizer state of exactly those weights is dropped. A factorized weight (``W_p + BA``) is
treated as its effective weight. On CPU weights are processed one at a time per thread (``apply_fire``
runs one per torch thread), so the extra memory is that of a few matrices' solves (about 3× the largest
matrix each), not of the model; on a GPU ``apply_fire`` batches the weights of one shape
(:mod:`~functional.fire_batch`, at most 1 GiB of them at a time).

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


def fire_matrix(name: str, param: torch.Tensor, options: FIREOptions, record_spectra: bool = False,
                groups: int = 1) -> FireRecord:
    """FIRE on one matrix (or conv kernel of ``groups`` groups) ``param`` in ``(out, in, *k)`` orientation,
    written in place.

    Args:
        name: the weight's name, for the record and warnings.
        param: the weight (or one row block of it), changed in place.
        options: how to orthogonalize and rescale.
        record_spectra: keep singular values before/after in the record.
        groups: a grouped conv's groups: one polar factor per group and tap.

    Example:
        >>> record = fire_matrix("w", torch.randn(64, 32), FIREOptions(method="svd"))
    """
    dtype, on_degenerate = options.torch_dtype, options.on_degenerate
    record = FireRecord(name, tuple(param.shape))
    if param.dim() < 2:
        record.skipped = f"{param.dim()}-D parameter"
        return record
    if param.numel() == 0:
        return _skip_degenerate(record, f"FIRE: {name} has shape {tuple(param.shape)}, no entries (no polar factor)",
                                "empty", on_degenerate)
    if param.is_cuda:
        torch.cuda.synchronize(param.device)
    started = time.perf_counter()
    peak = float(largest_entry(param.flatten(1)))  # one pass: NaN/Inf and all-zero alike
    if not math.isfinite(peak):
        return _skip_degenerate(record, f"FIRE: {name} contains NaN/Inf", "non-finite", on_degenerate)
    matrices = as_matrices(param, groups)  # a view: writing into it writes the parameter
    if peak == 0.0:
        return _skip_degenerate(record, f"FIRE: {name} is all zero (no polar factor)", "zero", on_degenerate)
    s = target_scale(param, options.scale, groups)
    record.scale = s
    # The whole weight was checked above; an all-zero conv tap inside it stays as it is, without a warning.
    polar, info = orthogonalize(matrices, replace(options, on_degenerate="skip"), return_info=True,
                                warn_degenerate=False)
    exact = info.singular_values is not None  # svd / eigh: the spectrum came with the polar factor
    if exact:
        record.dfi_before = float((info.singular_values.square() - s * s).square().sum())
    else:
        record.dfi_before = float(deviation_from_isometry(matrices, s, dtype).sum())
    if record_spectra:
        record.spectrum_before = (info.singular_values.flip(-1).float().cpu() if exact
                                  else singular_values(matrices).cpu())
    polar.mul_(s)
    # W and sW̃ of one magnitude: their difference in float32 (or float64) is exact to its rounding (Sterbenz
    # where they are close); the norm accumulates in double on CPU, and squares of entries beyond 1e±15
    # (outside float32's range) are taken in float64.
    wide = torch.float64 if matrices.dtype == torch.float64 else torch.float32
    norm_dtype = None if 1e-15 < peak < 1e15 else torch.float64
    record.sfe = float(torch.linalg.vector_norm(matrices.to(wide) - polar.to(wide), dtype=norm_dtype).double()) ** 2
    squared_norm = (float(info.singular_values.square().sum()) if exact
                    else float(torch.linalg.vector_norm(matrices.to(wide), dtype=norm_dtype).double()) ** 2)
    record.sfe_normalized = record.sfe / squared_norm if squared_norm > 0 else float("nan")
    matrices.copy_(polar)
    del polar
    if param.is_cuda:
        torch.cuda.synchronize(param.device)
    record.seconds = time.perf_counter() - started
    # An exact method's result is an isometry by construction: a probe estimate checks it at the cost of a few
    # matrix-vector products; an iteration's (possibly partial) result is measured exactly.
    deviation = estimated_deviation_from_isometry(matrices, s) if exact else deviation_from_isometry(matrices, s, dtype)
    record.dfi_after = float(deviation.sum())
    if record_spectra:
        record.spectrum_after = singular_values(matrices).cpu()
    record.iterations, record.matmuls, record.fell_back = info.iterations, info.matmuls, info.fell_back
    return record
