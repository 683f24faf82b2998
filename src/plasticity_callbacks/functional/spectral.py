"""Polar factors and spectral diagnostics of weight matrices: the math behind FIRE. No Lightning.

The polar factor ``Q = U Vᵀ`` of ``W = U S Vᵀ`` is the matrix with orthonormal columns closest
to ``W`` in Frobenius norm (orthogonal Procrustes). It is a *full* isometry whatever the singular
values: where some are zero it is not unique, and any orthonormal completion of those null
directions is an equally near isometry. ``orthogonalize`` computes it for a matrix or a batch
``(..., m, n)``; wide matrices are handled through their transpose.

Iterative methods apply an odd polynomial ``p`` to every singular value at once, ``X ← X·q(XᵀX)``:

* ``newton_schulz`` — cubic ``p(σ) = 1.5σ − 0.5σ³``. Tiny singular values grow only 1.5× per
  step, so a Frobenius-normalized square Gaussian matrix needs ~30 steps (ALGORITHMS.md §1).
* ``polar_express`` — the per-step optimal quintics of Amsel et al. (arXiv 2505.16932); they
  grow tiny singular values up to 8× per step and need about a third of the steps
  (coefficients: :func:`polar_express_coefficients`).
* ``svd`` — exact, via ``torch.linalg.svd`` (``torch.linalg.polar`` does not exist).

Normalization maps the singular values into the iteration's basin ``(0, 1]``:
``frobenius`` (the FIRE reference code), ``spectral`` (power-iteration estimate of ``‖W‖₂``;
Newton–Schulz only, because an estimate from below is harmless for the cubic but not for
the aggressive quintics) and ``gram`` (the upper bound ``‖(WᵀW)^k‖_F^(1/2k) ≥ ‖W‖₂``, read off
the Gram powers the first step needs anyway: ``k = 1`` for Newton–Schulz, ``k = 2`` for Polar
Express, far tighter than ``‖W‖_F``, which is 14× above ``‖W‖₂`` on a 768² Gaussian).

The iteration runs at most ``iters`` steps. With ``tol`` it stops once the orthogonality error
``‖XᵀX − I‖_F / (2√n)`` (≈ the relative distance to the exact polar factor, read off the Gram
matrix each step computes anyway) is below ``tol``, and a slice still above ``tol`` after ``iters``
steps (exactly rank-deficient: zero singular values stay zero under an odd polynomial) gets the
exact SVD answer, so the result is always a converged or an exact isometry. Once one cubic step
provably lands below ``tol`` the iteration takes it and stops, without a Gram matrix to confirm
(:func:`_error_after_one_cubic_step`). With ``tol=None``
exactly ``iters`` steps run and the result is whatever they reach (the FIRE reference code).
All-zero and non-finite slices are never touched.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch

METHODS = ("newton_schulz", "polar_express", "svd")
NORMALIZATIONS = ("frobenius", "spectral", "gram")
ON_DEGENERATE = ("skip", "raise")
DEFAULT_NORMALIZE = {"newton_schulz": "frobenius", "polar_express": "gram", "svd": "frobenius"}
DEFAULT_ITERS = {"newton_schulz": 60, "polar_express": 30}


def polar_express_coefficients(lower: float = 3e-4, steps: int = 10, safety: float = 1.01) -> tuple:
    """Polar Express's per-step optimal odd quintics ``p(x) = a·x + b·x³ + c·x⁵`` (Amsel et al.,
    arXiv 2505.16932, greedy construction) for singular values in ``[lower, 1]``.

    Step ``t`` takes the quintic closest to 1 in max-norm on the current interval ``[l, u]``; it maps
    the interval to ``[1 − E, 1 + E]``, the next step's. Each ``(a, b, c)`` is then divided by
    ``(s, s³, s⁵)`` with ``s = safety`` so that σ up to ``safety`` (rounding in the normalization)
    stays in the basin; the last, repeated for further steps, is the construction's limit
    ``(15/8, −10/8, 3/8)``, unscaled so that its fixed point is exactly 1. The paper publishes the
    schedule for ``lower = 1e-3``; a trained matrix normalized by a bound on ``‖W‖₂`` sits lower
    (a heavy-tailed 768² spectrum starts near 4e-4), and ``3e-4`` saves a step there at no cost on
    Gaussian matrices (benchmarks/fire.py).

    Args:
        lower: the smallest normalized singular value the schedule is built for.
        steps: most polynomials built before the repeated limit (fewer once the interval has converged).
        safety: largest normalized singular value tolerated (rounding in the normalization).

    Example:
        >>> a, b, c = polar_express_coefficients()[0]   # ≈ (8.3, -23.5, 17.0)
    """
    coefficients, l, u = [], lower, 1.0
    while len(coefficients) < steps and u - l > 1e-6:
        a, b, c, E = _minimax_quintic(l, u)
        coefficients.append((a / safety, b / safety**3, c / safety**5))
        l, u = 1 - E, 1 + E
    # The limit of the construction, unscaled: its fixed point is exactly 1 (a scaled one's is not).
    return tuple(coefficients) + ((15 / 8, -10 / 8, 3 / 8),)


def _minimax_quintic(l: float, u: float) -> tuple[float, float, float, float]:
    """The odd quintic ``p`` minimizing ``E = max |1 − p(x)|`` over ``[l, u]`` (Remez exchange):
    ``1 − p`` equioscillates at ``l``, its two interior extrema ``q < r``, and ``u``."""
    q, r = l + (u - l) / 4, l + 3 * (u - l) / 4
    for _ in range(100):
        points = torch.tensor([l, q, r, u], dtype=torch.float64)
        signs = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
        system = torch.stack([points, points**3, points**5, signs], dim=1)  # p(x) + sign·E = 1
        a, b, c, E = torch.linalg.solve(system, torch.ones(4, dtype=torch.float64)).tolist()
        root = math.sqrt(max(9 * b * b - 20 * a * c, 0.0))  # p'(x) = a + 3b·x² + 5c·x⁴ = 0
        q_next, r_next = math.sqrt((-3 * b - root) / (10 * c)), math.sqrt((-3 * b + root) / (10 * c))
        if abs(q_next - q) + abs(r_next - r) < 1e-15:
            break
        q, r = q_next, r_next
    return a, b, c, abs(E)


POLAR_EXPRESS_COEFFICIENTS = polar_express_coefficients()  # the last one repeats for further steps
_PE_SAFETY = 1.01
_POWER_ITERS = 10


class DegenerateMatrixError(ValueError):
    """A matrix with no polar factor (all zero) or with NaN/Inf entries, and ``on_degenerate='raise'``."""


@dataclass
class PolarInfo:
    """How ``orthogonalize`` got its answer."""

    method: str
    iterations: int = 0  # steps of the iteration (0 for svd)
    matmuls: int = 0  # matrix-matrix products (power-iteration mat-vecs not counted)
    error: float = float("nan")  # largest ‖XᵀX − I‖_F/(2√n) over slices when last checked; NaN if never
    fell_back: int = 0  # slices that missed tol within `iters` and were solved by SVD
    skipped: int = 0  # degenerate slices (zero / NaN / Inf) returned unchanged
    slices: int = 1


def orthogonalize(
    W: torch.Tensor,
    method: str = "polar_express",
    normalize: str | None = None,
    iters: int | None = None,
    tol: float | None = 1e-5,
    check_every: int = 1,
    dtype: torch.dtype = torch.float32,
    on_degenerate: str = "skip",
    rcond: float | None = None,
    return_info: bool = False,
):
    """The (unscaled) polar factor of ``W`` (``(m, n)`` or a batch ``(..., m, n)``), same shape and dtype.

    Args:
        method: ``newton_schulz`` | ``polar_express`` | ``svd``.
        normalize: ``frobenius`` | ``spectral`` (Newton–Schulz only) | ``gram``; default:
            ``frobenius`` for Newton–Schulz (the reference), ``gram`` for Polar Express.
        iters: the most steps the iteration takes (default 60 Newton–Schulz, 30 Polar Express).
        tol: stop once the orthogonality error ``‖XᵀX − I‖_F/(2√n)`` is below it; slices above it
            after ``iters`` steps are solved by SVD. ``None``: run all ``iters`` steps, no check,
            no SVD (a partial orthogonalization).
        check_every: steps between error checks (each costs a host sync, no matrix product).
        dtype: compute dtype (float32 or float64); the result is cast back to ``W.dtype``.
        on_degenerate: ``skip`` (warn, return all-zero / NaN / Inf slices unchanged) or ``raise``.
        rcond: ``svd`` only. ``None`` (default): the full isometry ``U Vᵀ``. A number: the partial
            isometry ``U_r V_rᵀ`` that maps singular values below ``rcond·σ_max`` to 0.
        return_info: also return a :class:`PolarInfo`.

    The FIRE reference code is ``orthogonalize(W, "newton_schulz", "frobenius", iters=5, tol=None)``
    (10 in most of its experiments); the seed design log's is ``normalize="spectral", iters=15, tol=None``.

    Example:
        >>> Q, info = orthogonalize(torch.randn(256, 64), return_info=True)
        >>> torch.allclose(Q.T @ Q, torch.eye(64), atol=1e-4), info.iterations
    """
    normalize, iters = _validate(W, method, normalize, iters, tol, check_every, dtype, on_degenerate, rcond)
    wide = W.shape[-2] < W.shape[-1]
    tall = (W.mT if wide else W).detach()  # iterate on the tall orientation: the Gram is the small one
    # Divide by the largest entry first: the squares behind every norm and Gram matrix then neither
    # overflow (weights of 1e20) nor underflow (1e-25) in float32.
    peak = tall.abs().amax(dim=(-2, -1)).to(dtype)
    bad = ~torch.isfinite(peak) | (peak == 0)
    info = PolarInfo(method=method, skipped=int(bad.sum()), slices=max(1, bad.numel()))
    if info.skipped:
        what = (f"{info.skipped} of {bad.numel()} slice(s) of shape {tuple(W.shape[-2:])} are all zero or "
                "contain NaN/Inf")
        if on_degenerate == "raise":
            raise DegenerateMatrixError(f"orthogonalize: {what}; they have no polar factor")
        warnings.warn(f"orthogonalize: {what}; left unchanged (no polar factor)", stacklevel=2)
        peak = torch.where(bad, torch.ones_like(peak), peak)

    def scaled() -> torch.Tensor:  # a fresh copy each time, never held here: peak memory
        X = tall.to(dtype) / peak[..., None, None]
        return X.masked_fill_(bad[..., None, None], 0.0) if info.skipped else X  # zero: a fixed point

    if method == "svd":
        Q = _svd_polar(scaled(), rcond)
    else:
        Q, converged = _iterate(scaled(), bad, method, normalize, iters, tol, check_every, info)
        missed = ~(converged | bad)
        if bool(missed.any()):  # rank-deficient or extremely ill-conditioned: solve those exactly
            info.fell_back = int(missed.sum())
            Q[missed] = _svd_polar(scaled()[missed])
    if info.skipped:
        Q = torch.where(bad[..., None, None], tall.to(dtype), Q)
    Q = (Q.mT if wide else Q).to(W.dtype).contiguous()
    return (Q, info) if return_info else Q


class RankDeficientError(ValueError):
    """A Gram matrix whose rank is below ``min(m, n)``: ``W (WᵀW)^(-1/2)`` is then only a partial
    isometry, and the rows alone cannot complete it to a full one."""


def polar_from_gram(rows: torch.Tensor, gram: torch.Tensor, total_rows: int | None = None,
                    rcond: float | None = None, partial: bool = False) -> torch.Tensor:
    """``rows @ gram^(-1/2)``: the rows of the polar factor of ``W`` that ``rows`` holds, given ``gram = WᵀW``.

    ``W`` (``(m, n)``, or a batch ``(..., m, n)``) may be split by rows, e.g. across ranks: each part
    holds some of its rows, ``gram`` is the sum of every part's ``rowsᵀ rows`` (an all-reduce), and each
    part multiplies its own rows; together they form ``U Vᵀ``, as ``orthogonalize`` would. The inverse
    square root comes from a float64 ``eigh`` of ``gram``. A wide ``W`` (``m < n``, ``gram`` of rank
    ``m``) works too: the inverse square root is taken on the range of ``gram`` (a pseudo-inverse),
    which for a full-row-rank ``W`` is exactly its polar factor.

    Accuracy: the result is as accurate as ``gram``; its rounding error is amplified by ``κ(W)²``, so
    build it in float64 (``rows.double().mT @ rows.double()``) unless ``W`` is well conditioned.
    ``rows`` are multiplied in float64 when they are float64, else in float32; the result has
    ``rows.dtype``.

    Rank deficiency: eigenvalues at most ``rcond·λ_max`` count as zero (default ``rcond``:
    ``n·eps`` of ``gram``'s dtype). A rank below ``min(total_rows, n)`` means ``W`` has no unique
    polar factor, and completing the null directions needs all of ``W``: this raises
    :class:`RankDeficientError` (gather ``W`` and use :func:`orthogonalize`, which completes them),
    unless ``partial=True``, which returns the partial isometry ``U_r V_rᵀ`` (null directions map to 0).
    A zero or non-finite ``gram`` raises :class:`DegenerateMatrixError`.

    Args:
        rows: ``(..., r, n)`` rows of ``W`` (all of ``W`` when it is not split).
        gram: ``(..., n, n)`` symmetric positive semi-definite ``WᵀW`` of the whole ``W``.
        total_rows: ``m``, the rows of the whole ``W`` (default: ``rows`` is all of ``W``).
        rcond: relative eigenvalue threshold below which a direction counts as null.
        partial: return the partial isometry instead of raising on rank deficiency.

    Example:
        >>> W = torch.randn(512, 128)
        >>> top, bottom = W[:300], W[300:]                       # two shards of rows
        >>> G = top.double().mT @ top.double() + bottom.double().mT @ bottom.double()
        >>> Q_top = polar_from_gram(top, G, total_rows=512)       # == orthogonalize(W)[:300]
    """
    n = gram.shape[-1]
    if gram.dim() < 2 or gram.shape[-2] != n or rows.shape[-1] != n or rows.shape[:-2] != gram.shape[:-2]:
        raise ValueError(f"polar_from_gram needs rows (..., r, n) and gram (..., n, n) with the same batch and n; "
                         f"got rows {tuple(rows.shape)} and gram {tuple(gram.shape)}")
    if not (rows.is_floating_point() and gram.is_floating_point()):
        raise ValueError(f"polar_from_gram needs floating-point tensors, got {rows.dtype} and {gram.dtype}")
    m = rows.shape[-2] if total_rows is None else total_rows
    if isinstance(m, bool) or not isinstance(m, int) or m < rows.shape[-2]:
        raise ValueError(f"total_rows={total_rows!r} must be an integer >= the {rows.shape[-2]} rows given")
    if rcond is None:
        rcond = n * torch.finfo(gram.dtype).eps
    elif not 0 <= rcond < 1:
        raise ValueError(f"rcond={rcond!r} must be in [0, 1)")
    G = gram.detach().to(torch.float64)
    if not bool(torch.isfinite(G).all()) or bool((G.diagonal(dim1=-2, dim2=-1).amax(-1) <= 0).any()):
        raise DegenerateMatrixError("polar_from_gram: a Gram matrix is zero or has NaN/Inf entries; "
                                    "W has no polar factor (skip it)")
    G = (G + G.mT) / 2  # a Gram matrix summed over ranks may be asymmetric in the last bit
    eigenvalues, V = torch.linalg.eigh(G)  # ascending
    kept = eigenvalues > rcond * eigenvalues[..., -1:]
    rank, needed = kept.sum(-1), min(m, n)
    if not partial and bool((rank < needed).any()):
        raise RankDeficientError(
            f"polar_from_gram: rank {int(rank.min())} < min(m, n) = {needed} (eigenvalues below rcond={rcond:.1e} "
            "of the largest): no full isometry from rows alone; gather W and use orthogonalize (it completes "
            "the null directions), or pass partial=True for the partial isometry U_r V_rᵀ")
    inverse_root = torch.where(kept, eigenvalues.clamp_min(torch.finfo(torch.float64).tiny).rsqrt(), 0.0)
    compute = torch.float64 if rows.dtype == torch.float64 else torch.float32
    inverse_sqrt = (V * inverse_root[..., None, :]) @ V.mT  # V diag(λ^(-1/2)) Vᵀ on the range
    return (rows.detach().to(compute) @ inverse_sqrt.to(compute)).to(rows.dtype)


def check_polar_options(method, normalize, iters, tol, check_every, dtype, on_degenerate, rcond=None) -> None:
    """Raise a ValueError naming the first bad option of :func:`orthogonalize` (the one place they are checked)."""
    if method not in METHODS:
        raise ValueError(f"method={method!r} is not one of {METHODS}")
    if normalize is not None and normalize not in NORMALIZATIONS:
        raise ValueError(f"normalize={normalize!r} is not one of {NORMALIZATIONS} or None "
                         f"(default per method: {DEFAULT_NORMALIZE})")
    if method == "polar_express" and normalize == "spectral":
        raise ValueError("normalize='spectral' is an estimate from below, unsafe for polar_express's quintics; "
                         "use normalize='gram' or 'frobenius' (both upper bounds)")
    if iters is not None and (isinstance(iters, bool) or not isinstance(iters, int) or iters < 0):
        raise ValueError(f"iters={iters!r} must be a non-negative integer or None (the method's default)")
    if tol is not None and (isinstance(tol, bool) or not isinstance(tol, (int, float)) or not tol > 0):
        raise ValueError(f"tol={tol!r} must be a positive number or None")
    if isinstance(check_every, bool) or not isinstance(check_every, int) or check_every < 1:
        raise ValueError(f"check_every={check_every!r} must be a positive integer")
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"dtype={dtype} must be torch.float32 or torch.float64")
    if on_degenerate not in ON_DEGENERATE:
        raise ValueError(f"on_degenerate={on_degenerate!r} is not one of {ON_DEGENERATE}")
    if rcond is not None and (method != "svd" or not 0 <= rcond < 1):
        raise ValueError(f"rcond={rcond!r} (a partial isometry) needs method='svd' and 0 <= rcond < 1")


def _validate(W, method, normalize, iters, tol, check_every, dtype, on_degenerate, rcond):
    check_polar_options(method, normalize, iters, tol, check_every, dtype, on_degenerate, rcond)
    normalize = normalize or DEFAULT_NORMALIZE[method]
    if W.dim() < 2 or not W.is_floating_point():
        raise ValueError(f"orthogonalize needs a floating-point matrix (..., m, n), got shape {tuple(W.shape)} "
                         f"and dtype {W.dtype}")
    if W.numel() == 0:
        raise ValueError(f"orthogonalize got an empty matrix of shape {tuple(W.shape)}: a layer without inputs or "
                         "outputs has no polar factor; leave it out of the selection")
    return normalize, DEFAULT_ITERS.get(method, 0) if iters is None else iters


def _iterate(X, bad, method, normalize, iters, tol, check_every, info):
    """Up to ``iters`` polynomial steps on ``X`` (tall, largest entry 1; ``bad`` slices all zero);
    return the iterate and, per slice, whether it reached ``tol`` (all True when ``tol`` is None)."""
    X, A, A2 = _normalized(X, method, normalize, info)
    for step in range(iters + 1):
        if tol is None and step == iters:  # a fixed count: no Gram matrix to judge the last iterate
            return X, bad | True
        if A is None:  # the Gram matrix: the step needs it, and the error is read off it for free
            A = X.mT @ X
            info.matmuls += 1
        if tol is not None and (step % check_every == 0 or step == iters):
            error = _isometry_error(A)
            info.error = float(torch.where(bad, 0.0, error).max())
            converged = bad | (error <= tol)
            if bool(converged.all()) or step == iters:
                return X, converged
            bound = _error_after_one_cubic_step(error, X.shape[-1])
            if bool((bad | (bound <= tol)).all()):  # finish with that step; no Gram needed to confirm it
                info.error = float(torch.where(bad, 0.0, bound).max())  # a bound, not a measurement
                return _polynomial_step(X, A, None, "newton_schulz", step, info), bad | True
        X = _polynomial_step(X, A, A2, method, step, info)
        A = A2 = None


def _error_after_one_cubic_step(error: torch.Tensor, n: int) -> torch.Tensor:
    """A bound on the error after one cubic Newton–Schulz step (inf where it does not apply).

    With ``d_i = (σ_i² − 1)/2`` the error is ``‖d‖/√n`` and the cubic step maps ``d`` to
    ``−1.5d² + d³``; once every ``|d_i| ≤ ‖d‖ ≤ 0.1``, ``|d'_i| ≤ 1.65·d_i²``, so the error after
    is at most ``1.65·‖d‖²/√n = 1.65·error²·√n``. Finishing on that bound saves the Gram matrix
    that would only confirm convergence (one of about 25 products)."""
    bound = 1.65 * error.square() * math.sqrt(n)
    return torch.where(error * math.sqrt(n) <= 0.1, bound, torch.full_like(bound, math.inf))


def _normalized(X, method, normalize, info):
    """``X`` scaled in place so that every singular value lies in ``(0, 1]`` (up to 1.01 for Polar Express's
    safety margin), with the Gram matrix ``A`` and ``A²`` where the normalization computed them."""
    A = A2 = None
    frobenius = torch.linalg.matrix_norm(X).clamp_min(torch.finfo(X.dtype).tiny)[..., None, None]
    if normalize == "frobenius":
        return X.div_(frobenius * (_PE_SAFETY if method == "polar_express" else 1.0)), A, A2
    if normalize == "spectral":
        return X.div_(_power_iteration_norm(X)[..., None, None]), A, A2
    X.div_(frobenius)  # A² of unnormalized entries would overflow
    A = X.mT @ X
    info.matmuls += 1
    if method == "polar_express":  # (Σσ⁸)^(1/8) = ‖A²‖_F^(1/4), from the A² the first step needs anyway
        A2 = A @ A
        info.matmuls += 1
        bound = torch.linalg.matrix_norm(A2).pow(0.25) * _PE_SAFETY
    else:  # (Σσ⁴)^(1/4) = ‖A‖_F^(1/2)
        bound = torch.linalg.matrix_norm(A).sqrt()
    bound = bound.clamp_min(torch.finfo(X.dtype).tiny)[..., None, None]
    return X.div_(bound), A.div_(bound**2), None if A2 is None else A2.div_(bound**4)


def _polynomial_step(X, A, A2, method, step, info):
    """One step ``X ← X·q(A)`` with ``A = XᵀX``; in place where it saves an n×n or m×n buffer (peak memory)."""
    if method == "newton_schulz":  # X ← 1.5·X − 0.5·X·A
        info.matmuls += 1
        info.iterations += 1
        return (X @ A).mul_(-0.5).add_(X, alpha=1.5)
    a, b, c = POLAR_EXPRESS_COEFFICIENTS[min(step, len(POLAR_EXPRESS_COEFFICIENTS) - 1)]
    if A2 is None:
        A2 = A @ A
        info.matmuls += 1
    B = A2.mul_(c).add_(A, alpha=b)  # b·A + c·A², in A²'s buffer
    info.matmuls += 1
    info.iterations += 1
    return (X @ B).add_(X, alpha=a)  # X ← a·X + X·(b·A + c·A²)


def _isometry_error(A: torch.Tensor, target: torch.Tensor | float = 1.0) -> torch.Tensor:
    """``‖A − target·I‖_F / (2√n)`` per slice, in float64, summed over row blocks (no n×n
    temporary: the check must not raise the peak memory of the iteration)."""
    n = A.shape[-1]
    block = max(16, n // 16)
    target = torch.as_tensor(target, dtype=torch.float64, device=A.device)[..., None]
    total = torch.zeros(A.shape[:-2], dtype=torch.float64, device=A.device)
    for start in range(0, n, block):
        rows = A[..., start:start + block, :].to(torch.float64, copy=True)  # never write into A
        rows.diagonal(offset=start, dim1=-2, dim2=-1).sub_(target)
        total += torch.linalg.matrix_norm(rows).square()
    return total.sqrt() / (2 * math.sqrt(n))


def _power_iteration_norm(X: torch.Tensor) -> torch.Tensor:
    """Estimate of ``‖X‖₂`` (from below) by power iteration on ``XᵀX`` from a fixed start vector,
    so every rank and every run gets the same number."""
    g = torch.Generator().manual_seed(0)
    v = torch.randn(X.shape[-1], 1, generator=g, dtype=X.dtype).to(X.device).expand(*X.shape[:-2], -1, -1)
    for _ in range(_POWER_ITERS):
        v = X.mT @ (X @ v)
        v = v / torch.linalg.vector_norm(v, dim=(-2, -1), keepdim=True).clamp_min(torch.finfo(X.dtype).tiny)
    return torch.linalg.vector_norm(X @ v, dim=(-2, -1)).clamp_min(torch.finfo(X.dtype).tiny)


def _svd_polar(X: torch.Tensor, rcond: float | None = None) -> torch.Tensor:
    """``U Vᵀ`` of a tall ``X``: orthonormal columns whatever the singular values (LAPACK completes
    the null directions); with ``rcond`` the directions of ``σ < rcond·σ_max`` are dropped instead."""
    U, S, Vh = torch.linalg.svd(X, full_matrices=False)
    if rcond is not None:
        U = U * (S > rcond * S[..., :1]).to(X.dtype)[..., None, :]
    return U @ Vh


# ---------------------------------------------------------------------------------- diagnostics


def deviation_from_isometry(W: torch.Tensor, scale: float = 1.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """DfI ``‖WᵀW − s²I‖²_F`` (``WWᵀ`` for wide ``W``) per slice of ``(..., m, n)``, as float64.

    0 exactly when every singular value equals ``scale``. Any magnitude of ``W`` works: the Gram
    matrix is taken of ``W`` divided by its largest entry. Example: ``deviation_from_isometry(W).item()``.
    """
    X = W.detach().to(dtype)
    X = X.mT if X.shape[-2] < X.shape[-1] else X
    peak = X.abs().amax(dim=(-2, -1)).clamp_min(torch.finfo(dtype).tiny)
    X = X / peak[..., None, None]
    peak = peak.double()
    error = _isometry_error(X.mT @ X, (scale / peak) ** 2)  # ‖X̂ᵀX̂ − (s/p)²I‖_F / (2√n)
    return (error * (2 * math.sqrt(X.shape[-1]))).square() * peak**4


def squared_frobenius_error(W: torch.Tensor, W_new: torch.Tensor, normalized: bool = False,
                            chunk: int = 1 << 20) -> torch.Tensor:
    """SFE ``‖W − W̃‖²_F`` (divided by ``‖W‖²_F`` when ``normalized``): how far a reinit moved the weights.

    Summed in float64 over chunks of ``chunk`` elements, so it costs no full-size temporary."""
    a, b = W.detach().reshape(-1), W_new.detach().reshape(-1)
    chunk = min(chunk, max(4096, a.numel() // 16))  # float64 temporaries stay a fraction of W
    diff = torch.zeros((), dtype=torch.float64, device=a.device)
    norm = torch.zeros((), dtype=torch.float64, device=a.device)
    for start in range(0, a.numel(), chunk):
        x = a[start:start + chunk].double()
        diff += torch.linalg.vector_norm(x - b[start:start + chunk].double()).square()
        norm += torch.linalg.vector_norm(x).square()
    return diff / norm.clamp_min(1e-300) if normalized else diff


def singular_values(W: torch.Tensor) -> torch.Tensor:
    """Singular values of each slice, descending, computed in float32 (float64 inputs kept)."""
    X = W.detach()
    return torch.linalg.svdvals(X if X.dtype == torch.float64 else X.float())


def stable_rank(W: torch.Tensor) -> torch.Tensor:
    """``‖W‖²_F / ‖W‖²₂`` per slice (0 for a zero matrix)."""
    S = singular_values(W)
    return (S.square().sum(-1) / S[..., 0].square()).nan_to_num(0.0)


def effective_rank(W: torch.Tensor) -> torch.Tensor:
    """``exp(H(p))`` with ``p_i = σ_i / Σσ`` per slice (Roy & Vetterli); 0 for a zero matrix."""
    S = singular_values(W)
    p = S / S.sum(-1, keepdim=True)
    entropy = -(p * p.clamp_min(1e-30).log()).sum(-1)
    return torch.where(S.sum(-1) > 0, entropy.exp(), torch.zeros_like(entropy))


def singular_value_summary(W: torch.Tensor) -> dict[str, float]:
    """min / max / mean / median singular value, condition number, stable and effective rank
    (over all slices of a batch taken together)."""
    S = singular_values(W).flatten()
    smin, smax = float(S.min()), float(S.max())
    return {
        "sigma_min": smin, "sigma_max": smax, "sigma_mean": float(S.mean()), "sigma_median": float(S.median()),
        "condition": smax / smin if smin > 0 else float("inf"),
        "stable_rank": float(stable_rank(W).mean()), "effective_rank": float(effective_rank(W).mean()),
    }
