"""One matrix's SVD cycle for the adaptive full / minor switch: its triplets (warm-started or whole) and the decision.

``AdaptiveSVDSwitch`` (:mod:`~callbacks.adaptive_svd`) decides *when* a cycle runs and *what* it changes (gradient
projection, a factorized split, the optimizer's moments); this module is the rule it applies to each matrix: which
SVD route gives its triplets (:mod:`.warm_subspace` from the previous cycle where that is cheaper, else
:func:`~.subspace.svd_triplets`), and :func:`~.subspace.decide_mode` on them. Plain tensors, no Lightning. What a
matrix keeps from one cycle to the next is a :class:`SubspaceMemory`.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import NamedTuple

import torch

from ..arguments import check_bool, check_int, check_number, refuse_unknown_fields
from .subspace import (
    SVD, SVD_METHODS, decide_mode, gram_triplets, largest_next_rank, next_rank, rank_bounds, subspace_angle,
    svd_triplets,
)
from .warm_subspace import SHIFT, warm_minor_triplets, warm_tall_triplets

_DTYPES = {"float32": torch.float32, "float64": torch.float64}
# Below this g the full SVD is cheaper than the warm start's many small LAPACK calls (one CPU thread: at 256×256
# 4 ms against 7 ms; at 1024×1024 about 350 ms against 60 ms; benchmarks/adaptive_svd_overhead.py --warm-vs-full).
WARM_MIN_ORDER = 512
# A wide weight whose minor span moved at most this far (sine) since the last cycle starts its next warm cycle from
# its previous vectors again; farther, from its spectrum (the previous start would give up: WARM_ITERATIONS steps at
# its rate of ~0.6 per step bring a start only about 1e-2 closer).
PREVIOUS_START_DRIFT = 1e-2


@refuse_unknown_fields
@dataclass(frozen=True)
class SwitchThresholds:
    """When a matrix switches between full and minor training (see ``functional.subspace.decide_mode``).

    Args:
        clobber_alignment: principal gradient share above which a matrix goes ``"minor"``.
        stable_angle: subspace angle (radians) below which, with the next two, it goes ``"minor"``.
        safe_minor_alignment: minor gradient share above which it may go ``"minor"``.
        max_reconstruction_error: at or above this, the matrix goes back to ``"full"``.

    Example:
        >>> AdaptiveSVDSwitch(thresholds=SwitchThresholds(clobber_alignment=0.0))   # always minor when safe
    """

    clobber_alignment: float = 0.4
    stable_angle: float = 0.1
    safe_minor_alignment: float = 0.6
    max_reconstruction_error: float = 0.01

    def __post_init__(self) -> None:
        for name in ("clobber_alignment", "safe_minor_alignment", "max_reconstruction_error"):
            check_number(name, getattr(self, name), 0.0, 1.0)
        check_number("stable_angle", self.stable_angle, 0.0, math.pi / 2, "(radians)")


@refuse_unknown_fields
@dataclass(frozen=True)
class SVDOptions:
    """How each SVD cycle computes the singular triplets.

    Args:
        method: ``gram`` (``eigh`` of the smaller Gram matrix, the minor triplets recomputed from the
            weight; ``full`` wherever that is not accurate), ``full`` (``torch.linalg.svd``) or
            ``randomized`` (two ``torch.svd_lowrank`` blocks); see ``functional.subspace.svd_triplets``.
        niter: power iterations of ``method="randomized"``.
        dtype: ``float32`` or ``float64``.
        warm: from the second cycle on, compute a matrix's minor triplets from its previous ones
            (:func:`~functional.warm_subspace.warm_minor_triplets`; a tall matrix from its previous right vectors,
            :func:`~functional.warm_subspace.warm_tall_triplets`) rather than its whole SVD, falling back to
            ``method`` where they do not converge (counted in ``adaptive_svd/warm_fallbacks``); a non-square matrix
            whose minor span turned too far for its previous vectors starts from its Gram matrix's spectrum instead
            (counted in ``adaptive_svd/warm_spectrum_starts``). For ``method`` ``gram`` or ``full`` and matrices
            with ``g ≥ WARM_MIN_ORDER`` (512) on one process: a smaller one's full SVD is cheaper, and under FSDP2
            the rank computing a matrix's SVD broadcasts all ``g`` singular values.

    Example:
        >>> AdaptiveSVDSwitch(svd=SVDOptions(method="randomized", niter=4))
    """

    method: str = "gram"
    niter: int = 2
    dtype: str = "float32"
    warm: bool = True

    def __post_init__(self) -> None:
        if self.method not in SVD_METHODS:
            raise ValueError(f"svd method={self.method!r} is not one of {SVD_METHODS}")
        check_int("svd niter", self.niter, minimum=0)
        if self.dtype not in _DTYPES:
            raise ValueError(f"svd dtype={self.dtype!r} is not one of {tuple(_DTYPES)}")
        check_bool("svd warm", self.warm)

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]


@dataclass
class SubspaceMemory:
    """What one matrix keeps from one SVD cycle to the next.

    Args:
        g: its number of singular values, ``min(d_out, d_in)``.
        state: ``"full"`` or ``"minor"``: how it trains in the current phase.
        r: minor components of the current phase (None before the first cycle).
        U_prev, S_prev: the last cycle's ``U (d_out, g)`` and ``S (g,)`` (NaN in front where a warm cycle computed
            only the trailing values, see :func:`padded`).
        V_prev: a tall matrix's last ``(d_in, d_in)`` right vectors, its next warm cycle's start.
        warm_start: where a non-square matrix's next warm cycle starts (``"previous"`` or ``"spectrum"``).
    """

    g: int
    state: str = "full"
    r: int | None = None
    U_prev: torch.Tensor | None = None
    S_prev: torch.Tensor | None = None
    V_prev: torch.Tensor | None = None
    warm_start: str = "previous"


class Cycle(NamedTuple):
    """One matrix's cycle: its triplets, the decision, and how the triplets were found."""

    svd: SVD
    state: str  # "full" | "minor" for the next phase
    r_next: int
    diagnostics: dict
    warm: bool  # a warm start was tried
    fallback: bool  # it was, and did not converge: the whole SVD gave the triplets
    spectrum_start: bool  # a non-square matrix's warm cycle started from its Gram matrix's spectrum


def matrix_cycle(memory: SubspaceMemory, W: torch.Tensor, grad: torch.Tensor | None, U_prev: torch.Tensor | None,
                 step: int, svd: SVDOptions, thresholds: SwitchThresholds, r_min: int, initial_rank: int | None,
                 right_vectors: bool = False, warm: bool = False) -> Cycle:
    """One matrix's SVD and decision (it changes nothing but ``memory.warm_start``, the next warm start's hint).

    Args:
        memory: the matrix's last cycle.
        W: the weight as its ``(out, in)`` matrix; grad: the step's gradient alike (None: alignments 0).
        U_prev: the previous ``U`` (``memory.U_prev``, or a gathered copy of a sharded one).
        step: the optimizer step (seeds the random vectors).
        svd, thresholds, r_min, initial_rank: the switch's options (see :class:`SVDOptions`, :class:`SwitchThresholds`).
        right_vectors: the next phase needs the minor right vectors (a factorized split).
        warm: the caller stores an ``S`` of any length, so a warm start may be tried (``svd.warm``, ``g ≥
            WARM_MIN_ORDER``, a previous cycle; a tall matrix also needs ``memory.V_prev``).

    Returns:
        A :class:`Cycle`.

    Example:
        >>> cycle = matrix_cycle(SubspaceMemory(g=64), W, W_grad, None, 100, SVDOptions(), SwitchThresholds(), 8, None)
        >>> cycle.state, cycle.r_next
    """
    r = memory.r if memory.r is not None else initial_minor_rank(W, memory.g, r_min, initial_rank, svd.torch_dtype)
    dtype = svd.torch_dtype
    tall = W.shape[0] > W.shape[1]
    triplets, tried, spectrum = None, False, False
    if tall and svd.method == "gram":
        # A tall weight's Gram route (one eigh of the d_in × d_in Gram matrix) is cheaper than its warm start, whose
        # iteration needs several Rayleigh–Ritz steps on W and a principal basis; the warm start is for a spectrum
        # too wide for that route, which would otherwise cost a full SVD (benchmarks/adaptive_svd_overhead.py).
        q = max(1, min(memory.g, memory.g - r))
        triplets = gram_triplets(W.to(dtype), block=2 * (memory.g - q) + 8, right_vectors=right_vectors)
    if (triplets is None and warm and svd.warm and svd.method != "randomized" and U_prev is not None and memory.S_prev is not None
            and (not tall or memory.V_prev is not None) and memory.g >= WARM_MIN_ORDER):
        # the decision reads the r minor triplets, the next phase up to largest_next_rank of them
        count = largest_next_rank(r, memory.g, r_min)
        triplets, spectrum = warm_triplets(memory, W, U_prev, count, dtype, step, right_vectors)
        tried = True
    fallback = tried and triplets is None
    if triplets is None:  # where the Gram route was just refused, straight to LAPACK
        method = "full" if tall and svd.method == "gram" else svd.method
        triplets = svd_triplets(W, method, top=memory.g - r, niter=svd.niter, dtype=dtype, seed=step,
                                right_vectors=right_vectors)
    state, r_next, diagnostics = decide_mode(W, triplets, U_prev, memory.S_prev, grad, r, memory.state, r_min=r_min,
                                             dtype=dtype, exact=svd.method != "randomized", **asdict(thresholds))
    if memory.r is None and initial_rank is not None:
        r_next = r  # a given initial_rank replaces the spectral first guess for the first phase
    return Cycle(triplets, state, r_next, diagnostics, tried, fallback, spectrum)


def warm_triplets(memory: SubspaceMemory, W: torch.Tensor, U_prev: torch.Tensor, count: int, dtype: torch.dtype,
                  step: int, right_vectors: bool) -> tuple[SVD | None, bool]:
    """The warm minor triplets or None, and whether they started from the spectrum. A non-square weight (a tall
    one iterates on its wide transpose, from ``memory.V_prev``) starts from its previous vectors unless its last
    warm cycle found its minor span turned farther than ``PREVIOUS_START_DRIFT`` or its last spectrum shows them
    converging at a rate of ½ or slower (:func:`previous_start_rate`); where the previous start gives up, it starts
    again from its spectrum. A square weight's spectrum start would cost its Gram matrix's ``eigh`` on top of the
    LU, as much as its full SVD. Sets ``memory.warm_start`` after a spectrum start.

    Example:
        >>> svd, from_spectrum = warm_triplets(memory, W, memory.U_prev, count=16, dtype=torch.float32, step=300,
        ...                                    right_vectors=False)
    """
    wide = W.shape[0] != W.shape[1]
    tall = W.shape[0] > W.shape[1]
    start = memory.warm_start if wide else "previous"
    if start == "previous" and wide and previous_start_rate(memory.S_prev, count) >= 0.5:
        start = "spectrum"  # the last spectrum says the previous start would crawl (see previous_start_rate)

    def triplets(start, seed=0):
        if tall:  # started from the right vectors, which span the input space
            return warm_tall_triplets(W, memory.V_prev, count, dtype=dtype, seed=seed, start=start)
        return warm_minor_triplets(W, U_prev, count, dtype=dtype, seed=seed, right_vectors=right_vectors, start=start)

    found = triplets(start, seed=step)
    if found is None and wide and start == "previous":
        start = "spectrum"
        found = triplets(start)
    if found is None or start != "spectrum":
        return found, False
    # between the minor spans, in the space the iteration ran in (square bases: U, or a tall weight's V)
    before, after = (memory.V_prev, found.V) if tall else (U_prev, found.U)
    drift = subspace_angle(before, after, memory.g - count, dtype)
    memory.warm_start = "previous" if math.sin(drift) <= PREVIOUS_START_DRIFT else "spectrum"
    return found, True


def initial_minor_rank(W: torch.Tensor, g: int, r_min: int, initial_rank: int | None, dtype: torch.dtype) -> int:
    """The first phase's ``r``: ``initial_rank`` within :func:`~.subspace.rank_bounds`, or from the spectrum's
    structure (:func:`~.subspace.next_rank`'s first guess).

    Example:
        >>> initial_minor_rank(torch.randn(64, 128), 64, r_min=8, initial_rank=None, dtype=torch.float32)
    """
    if initial_rank is not None:
        lo, hi = rank_bounds(g, r_min)
        return max(lo, min(initial_rank, hi))
    W = W.to(dtype)
    S = torch.linalg.svdvals(W.mT if W.shape[0] < W.shape[1] else W)  # LAPACK is slower on wide input
    return next_rank(S, None, g // 2, r_min)[0]  # the initial r from the spectral structure


def previous_start_rate(S_prev: torch.Tensor | None, count: int) -> float:
    """The rate per step ``ρ = (λ_count − μ) / (λ_{b+1} − μ)`` at which a wide weight's warm start from its
    previous vectors would converge, read off its last spectrum (``λ = σ²``, ``b`` the block, ``μ`` the shift
    at ``SHIFT·λ_min``); 0 where there is no spectrum or it does not reach ``σ_{b+1}`` (a warm cycle's trailing
    values). At ``ρ ≥ ½`` the stopping test is no longer sure (what is left exceeds the last movement) and the steps needed
    pass ``WARM_ITERATIONS`` for any start more than ~1e-2 away.

    Example:
        >>> previous_start_rate(torch.linspace(2.0, 1.0, 256), count=16)   # a flat bottom: 0.50
    """
    if S_prev is None:
        return 0.0
    g = S_prev.numel()
    block = min(2 * count + 8, g // 2)
    lam = S_prev.double() ** 2
    above, minor, low = float(lam[g - block - 1]), float(lam[g - count]), float(lam[-1])
    if math.isnan(above) or not above > low:
        return 0.0
    shift = SHIFT * low
    return (minor - shift) / (above - shift)


def padded(S: torch.Tensor, g: int) -> torch.Tensor:
    """All ``g`` singular values, NaN in front where a warm cycle computed only the trailing ones: the next cycle
    compares the bottom ones (``next_rank``), and a stored spectrum keeps its length."""
    return S if S.numel() == g else torch.cat([S.new_full((g - S.numel(),), math.nan), S])


def require_finite(W: torch.Tensor, name: str, step: int) -> None:
    low, high = torch.aminmax(W)  # NaN anywhere makes both NaN, an infinity shows in one: a pass without a mask
    if not bool(torch.isfinite(low) & torch.isfinite(high)):
        raise FloatingPointError(f"AdaptiveSVDSwitch: weight {name!r} has NaN or Inf entries at step {step}; no "
                                 "subspace can be computed from it (lower the learning rate or clip gradients, then "
                                 "resume from an earlier checkpoint)")
