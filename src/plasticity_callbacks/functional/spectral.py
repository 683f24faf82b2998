"""Polar factors and spectral diagnostics of weight matrices: the math behind FIRE. No Lightning.

The polar factor ``Q = U Vᵀ`` of ``W = U S Vᵀ`` is the matrix with orthonormal columns closest
to ``W`` in Frobenius norm (orthogonal Procrustes). ``orthogonalize`` computes it for a matrix
or a batch ``(..., m, n)``; wide matrices are handled through their transpose.

Iterative methods apply an odd polynomial ``p`` to every singular value at once, ``X ← X·q(XᵀX)``:

* ``newton_schulz`` — cubic ``p(σ) = 1.5σ − 0.5σ³``. Tiny singular values grow only 1.5× per
  step, so a Frobenius-normalized square Gaussian matrix needs ~30 steps (ALGORITHMS.md §1).
* ``polar_express`` — the per-step optimal quintics of Amsel et al. (arXiv 2505.16932); they
  grow tiny singular values up to 8× per step and need about a third of the steps.
* ``svd`` — exact, via ``torch.linalg.svd`` (``torch.linalg.polar`` does not exist).

Normalization maps the singular values into the iteration's basin ``(0, 1]``:
``frobenius`` (the FIRE reference code), ``spectral`` (power-iteration estimate of ``‖W‖₂``;
Newton–Schulz only, because an estimate from below is harmless for the cubic but not for
the aggressive quintics) and ``gram`` (the upper bound ``‖(WᵀW)^k‖_F^(1/2k)`` on ``‖W‖₂``:
``k = 1`` for Newton–Schulz, free from its first Gram matrix; ``k = 4`` for Polar Express, one
extra product on top of the ``A²`` its first step needs, and much tighter than ``‖W‖_F``).

With ``tol`` set, the orthogonality error ``‖XᵀX − I‖_F / (2√n)`` (≈ the relative distance to
the exact polar factor) is read off the Gram matrix each step already computes, every
``check_every`` steps. A slice that does not reach ``tol`` within ``iters`` steps (a
rank-deficient or extremely ill-conditioned matrix) gets the exact SVD answer instead, so the
result is always either converged or exact. Zero / NaN / Inf slices are never touched.
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
DEFAULT_MAX_ITERS = {"newton_schulz": 60, "polar_express": 30}  # caps when stopping on `tol`
DEFAULT_FIXED_ITERS = {"newton_schulz": 15, "polar_express": 10}  # with tol=None (seed default: 15)

# Polar Express coefficients (a, b, c) of p(x) = a·x + b·x³ + c·x⁵, as published. The first seven
# are divided by (1.01, 1.01³, 1.01⁵): the polynomial then stays safe for σ up to 1.01, which
# absorbs rounding in the normalization. The last one is repeated for further steps.
_POLAR_EXPRESS_PUBLISHED = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)
POLAR_EXPRESS_COEFFICIENTS = tuple(
    (a / 1.01, b / 1.01**3, c / 1.01**5) for a, b, c in _POLAR_EXPRESS_PUBLISHED[:-1]
) + (_POLAR_EXPRESS_PUBLISHED[-1],)
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
    check_every: int = 2,
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
        iters: with ``tol``, the most steps before the SVD fallback (default 60 NS / 30 PE);
            with ``tol=None``, exactly this many steps (default 15 NS / 10 PE) and no fallback.
        tol: target orthogonality error ``‖XᵀX − I‖_F/(2√n)``, checked every ``check_every`` steps.
        dtype: compute dtype (float32 or float64); the result is cast back to ``W.dtype``.
        on_degenerate: ``skip`` (warn, return those slices unchanged) or ``raise``.
        rcond: singular values below ``rcond·σ_max`` count as zero in the SVD path
            (default ``64·eps(dtype)``), so a rank-deficient matrix gets a partial isometry ``U_r V_rᵀ``.
        return_info: also return a :class:`PolarInfo`.

    The faithful FIRE reference is ``orthogonalize(W, "newton_schulz", "frobenius", iters=5, tol=None)``
    (10 in most of its experiments); the seed design log's is ``normalize="spectral", iters=15, tol=None``.

    Example:
        >>> Q, info = orthogonalize(torch.randn(256, 64), return_info=True)
        >>> torch.allclose(Q.T @ Q, torch.eye(64), atol=1e-4), info.iterations
    """
    method, normalize, iters = _validate(W, method, normalize, iters, tol, check_every, dtype, on_degenerate)
    X = W.detach().to(dtype)
    wide = X.shape[-2] < X.shape[-1]
    if wide:
        X = X.mT  # iterate on the tall orientation: the Gram matrix is the small one
    norms = torch.linalg.matrix_norm(X)  # (...,) Frobenius
    bad = ~torch.isfinite(norms) | (norms == 0)
    n_bad = int(bad.sum())
    if n_bad:
        what = f"{n_bad} of {bad.numel()} slice(s) of shape {tuple(W.shape[-2:])} are all zero or contain NaN/Inf"
        if on_degenerate == "raise":
            raise DegenerateMatrixError(f"orthogonalize: {what}; they have no polar factor")
        warnings.warn(f"orthogonalize: {what}; left unchanged (no polar factor)", stacklevel=2)
        mask = bad[..., None, None]
        X = torch.where(mask, torch.zeros((), dtype=dtype, device=X.device), X)  # zeros stay zero
        norms = torch.where(bad, torch.ones_like(norms), norms)
    info = PolarInfo(method=method, skipped=n_bad, slices=max(1, bad.numel()))
    if method == "svd":
        Q = _svd_polar(X, rcond)
    else:
        Q, reached = _iterate(X, norms, bad, method, normalize, iters, tol, check_every, rcond, info)
        if not bool(reached.all()):  # missed tol within `iters`: solve those slices exactly
            Q = _fallback(W, Q, ~reached, dtype, wide, rcond, info)
    if n_bad:
        original = W.detach().to(dtype)
        Q = torch.where(bad[..., None, None], original.mT if wide else original, Q)
    if wide:
        Q = Q.mT
    Q = Q.to(W.dtype).contiguous()
    return (Q, info) if return_info else Q


def check_polar_options(method, normalize, iters, tol, check_every, dtype, on_degenerate) -> None:
    """Raise a ValueError naming the first bad option of :func:`orthogonalize` (the one place they are checked)."""
    if method not in METHODS:
        raise ValueError(f"method={method!r} is not one of {METHODS}")
    if normalize is not None and normalize not in NORMALIZATIONS:
        raise ValueError(f"normalize={normalize!r} is not one of {NORMALIZATIONS} or None "
                         f"(default per method: {DEFAULT_NORMALIZE})")
    if method == "polar_express" and normalize == "spectral":
        raise ValueError("normalize='spectral' is an estimate from below, unsafe for polar_express's quintics; "
                         "use normalize='gram' or 'frobenius' (both upper bounds)")
    if iters is not None and (isinstance(iters, bool) or not isinstance(iters, int) or iters < 1):
        raise ValueError(f"iters={iters!r} must be an integer >= 1 or None (with tol: the most steps; "
                         "without: exactly this many)")
    if tol is not None and (isinstance(tol, bool) or not isinstance(tol, (int, float)) or not tol > 0):
        raise ValueError(f"tol={tol!r} must be a positive number or None")
    if isinstance(check_every, bool) or not isinstance(check_every, int) or check_every < 1:
        raise ValueError(f"check_every={check_every!r} must be a positive integer")
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"dtype={dtype} must be torch.float32 or torch.float64")
    if on_degenerate not in ON_DEGENERATE:
        raise ValueError(f"on_degenerate={on_degenerate!r} is not one of {ON_DEGENERATE}")


def _validate(W, method, normalize, iters, tol, check_every, dtype, on_degenerate):
    check_polar_options(method, normalize, iters, tol, check_every, dtype, on_degenerate)
    normalize = normalize or DEFAULT_NORMALIZE[method]
    if W.dim() < 2 or not W.is_floating_point():
        raise ValueError(f"orthogonalize needs a floating-point matrix (..., m, n), got shape {tuple(W.shape)} "
                         f"and dtype {W.dtype}")
    if method != "svd" and iters is None:
        iters = (DEFAULT_FIXED_ITERS if tol is None else DEFAULT_MAX_ITERS)[method]
    return method, normalize, iters


def _iterate(X, norms, bad, method, normalize, iters, tol, check_every, rcond, info):
    """Run the iteration; return the iterate and, per slice, whether it reached ``tol``."""
    n = X.shape[-1]
    A = A2 = None
    if normalize == "frobenius":
        X = X / (norms * (_PE_SAFETY if method == "polar_express" else 1.0))[..., None, None]
    elif normalize == "spectral":
        X = X / _power_iteration_norm(X)[..., None, None]
    else:  # gram: an upper bound on ‖X‖₂ from the Gram powers step 0 needs anyway
        X = X / norms[..., None, None]  # first to unit Frobenius norm: A⁴ of 1e15-sized (or 1e-20) entries overflows
        A = X.mT @ X
        info.matmuls += 1
        if method == "polar_express":
            A2 = A @ A
            # (Σσ¹⁶)^(1/16) = ‖A⁴‖_F^(1/8) ≥ σ_max: within 1.2× of σ_max on a square Gaussian
            # (‖W‖_F is 14× off at 768), which saves a Polar Express step for one extra product.
            bound = _frobenius_norm_of_square(A2).pow(0.125) * _PE_SAFETY
            info.matmuls += 2
        else:
            bound = torch.linalg.matrix_norm(A).sqrt()  # (Σσ⁴)^(1/4) ≥ σ_max
        bound = torch.where(bad, torch.ones_like(bound), bound)
        X.div_(bound[..., None, None])
        A.div_(bound.square()[..., None, None])  # in place: peak memory
        A2 = None if A2 is None else A2.div_(bound.pow(4)[..., None, None])
    reached = torch.ones_like(bad) if tol is None else bad.clone()
    previous, final_step = None, False
    # Rank: σ below rcond·σ_max count as zero. Follow one such σ (from a lower bound on the
    # normalized σ_max) through the same polynomials: a few steps after it would have converged,
    # any slice still off tol holds smaller σ — numerical noise of a rank-deficient matrix, which
    # further steps would blow up into arbitrary directions. Stop there and let the SVD decide.
    rcond = 64 * torch.finfo(X.dtype).eps if rcond is None else rcond
    sigma_max_floor = (torch.linalg.matrix_norm(X) / math.sqrt(n))[~bad]
    smallest_kept = rcond * float(sigma_max_floor.min()) if sigma_max_floor.numel() else 1.0
    last = iters
    for step in range(iters + (tol is not None)):  # with tol: one more Gram to judge the last iterate
        if A is None:
            A = X.mT @ X
            info.matmuls += 1
        if tol is not None and (step % check_every == 0 or step == last):
            error = _isometry_error(A)
            reached = bad | (error <= tol)
            if previous is not None:
                # Near 1 the error falls quadratically or faster. Once every σ is within ~10% of 1
                # (error < 0.1/√n) and the error stops halving, it sits on the rounding floor.
                reached |= (error < 0.1 / math.sqrt(n)) & (error > 0.5 * previous)
            info.error = float(error[~bad].max()) if bool((~bad).any()) else 0.0
            if bool(reached.all()):
                break
            previous = error
            predicted = _predicted_error(error, method, step, n)
            if predicted is not None and bool((reached | (predicted <= tol / 2)).all()):
                final_step = True  # one more step provably lands below tol: skip the Gram that would check it
                info.error = float(predicted[~bad].max())
        if step == last:
            break
        if method == "newton_schulz":
            Y = X @ A  # X ← 1.5·X − 0.5·X·XᵀX
            info.matmuls += 1
            del A
            X = Y.mul_(-0.5).add_(X, alpha=1.5)
        else:
            a, b, c = POLAR_EXPRESS_COEFFICIENTS[min(step, len(POLAR_EXPRESS_COEFFICIENTS) - 1)]
            if A2 is None:
                A2 = A @ A
                info.matmuls += 1
            B = A2.mul_(c).add_(A, alpha=b)  # b·A + c·A², in A²'s buffer (peak memory)
            del A, A2
            Y = X @ B  # X ← a·X + X·(b·A + c·A²)
            info.matmuls += 1
            del B
            X = Y.add_(X, alpha=a)
        A = A2 = None
        info.iterations += 1
        smallest_kept = _step_scalar(smallest_kept, method, step)
        if tol is not None and smallest_kept > 0.9 and last == iters:
            last = min(iters, step + 4)
        if final_step:
            return X, torch.ones_like(bad)
    return X, reached


def _step_scalar(sigma: float, method: str, step: int) -> float:
    if method == "newton_schulz":
        return 1.5 * sigma - 0.5 * sigma**3
    a, b, c = POLAR_EXPRESS_COEFFICIENTS[min(step, len(POLAR_EXPRESS_COEFFICIENTS) - 1)]
    return a * sigma + b * sigma**3 + c * sigma**5


def _predicted_error(error, method, step, n):
    """A bound on the error after one more step, once every σ is within ~10% of 1 and the step's
    polynomial converges locally: Newton–Schulz maps σ = 1 + δ to 1 − 1.5δ² + O(δ³); Polar
    Express's final quintic to 1 + 2.5δ³ + O(δ⁴). With e ≈ ‖δ‖/√n and the worst case of all
    the error in one σ: e' ≤ 1.5·e²·√n (cubic NS) or 2.5·e³·n (quintic). None if not applicable."""
    if bool((error >= 0.1 / math.sqrt(n)).any()):
        return None
    if method == "newton_schulz":
        return 1.5 * error.square() * math.sqrt(n) * 1.1  # 10% for the higher-order terms
    if step >= len(POLAR_EXPRESS_COEFFICIENTS) - 1:
        return 2.5 * error.pow(3) * n * 1.1
    return None


def _frobenius_norm_of_square(A: torch.Tensor) -> torch.Tensor:
    """``‖A·A‖_F`` per slice, by blocks of rows, never holding the whole product (peak memory)."""
    n = A.shape[-1]
    block = max(16, n // 8)
    total = torch.zeros(A.shape[:-2], dtype=torch.float64, device=A.device)
    for start in range(0, n, block):
        total += torch.linalg.matrix_norm(A[..., start:start + block, :] @ A).double().square()
    return total.sqrt().to(A.dtype)


def _isometry_error(A: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """``‖A − I‖_F / (2√n)`` per slice, summed in float64 over row blocks (no n×n temporary:
    the check must not raise the peak memory of the iteration)."""
    n = A.shape[-1]
    block = block or max(16, n // 16)
    total = torch.zeros(A.shape[:-2], dtype=torch.float64, device=A.device)
    for start in range(0, n, block):
        rows = A[..., start:start + block, :].to(torch.float64)
        rows.diagonal(offset=start, dim1=-2, dim2=-1).sub_(1.0)
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


def _svd_polar(X: torch.Tensor, rcond: float | None) -> torch.Tensor:
    U, S, Vh = torch.linalg.svd(X, full_matrices=False)
    rcond = 64 * torch.finfo(X.dtype).eps if rcond is None else rcond
    keep = (S > rcond * S[..., :1]).to(X.dtype)  # numerically zero σ → 0: a partial isometry
    return (U * keep[..., None, :]) @ Vh


def _fallback(W, Q, missed, dtype, wide, rcond, info) -> torch.Tensor:
    """Replace the slices that missed ``tol`` within ``iters`` steps by their exact polar factor."""
    info.fell_back = int(missed.sum())
    X = W.detach().to(dtype)
    X = X.mT if wide else X
    if Q.dim() == 2:
        return _svd_polar(X, rcond)
    Q = Q.clone()
    Q[missed] = _svd_polar(X[missed], rcond)
    return Q


# ---------------------------------------------------------------------------------- diagnostics


def _tall(W: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    X = W.detach().to(dtype)
    return X.mT if X.shape[-2] < X.shape[-1] else X


def deviation_from_isometry(W: torch.Tensor, scale: float = 1.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """DfI ``‖WᵀW − s²I‖²_F`` (``WWᵀ`` for wide ``W``), per slice of ``(..., m, n)``.

    0 exactly when every singular value equals ``scale``. Example: ``deviation_from_isometry(W).item()``.
    """
    X = _tall(W, dtype)
    gram = (X.mT @ X).div_(scale**2)  # scale the Gram, not a copy of W (peak memory)
    return (_isometry_error(gram) * (2 * math.sqrt(X.shape[-1]))).square() * scale**4


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
