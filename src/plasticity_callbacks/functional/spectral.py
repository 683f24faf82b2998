"""Polar factors and spectral diagnostics of weight matrices: the math behind FIRE. No Lightning.

The polar factor ``Q = U Vᵀ = W (WᵀW)^(-1/2)`` of ``W = U S Vᵀ`` is the matrix with orthonormal
columns closest to ``W`` in Frobenius norm (orthogonal Procrustes). It is a *full* isometry whatever
the singular values: where some are zero it is not unique, and any orthonormal completion of those
null directions is an equally near isometry. ``orthogonalize(W, PolarOptions(...))`` computes it for a
matrix or a batch ``(..., m, n)``, working on the tall orientation (wide matrices through their
transpose), by one of:

* ``svd`` — LAPACK / cuSOLVER ``U Vᵀ`` (``torch.linalg.polar`` does not exist).
* ``eigh`` — ``X (XᵀX)^(-1/2)`` from an ``eigh`` of the Gram matrix of the smaller side, for oblong
  matrices (the Gram matrix is then the small side). Its error is about ``eps·κ²`` of the precision the
  Gram matrix is formed in: float32 where a cheap Lanczos estimate of ``κ²`` says that is below a float32
  SVD's own rounding (``κ ≤ 4``: a Gaussian 4:1 matrix has ``κ = 3``), else float64; slices that are
  numerically rank-deficient get the SVD answer. :func:`polar_from_gram` is the same map for a ``W``
  split by rows.
* ``polar_express`` / ``newton_schulz`` — matrix products only (the GPU's strength): an odd polynomial
  applied to every singular value at once, ``X ← X·q(XᵀX)``. Cubic Newton–Schulz
  ``p(σ) = 1.5σ − 0.5σ³`` grows tiny singular values only 1.5× per step (~30 steps on a square Gaussian
  matrix, ALGORITHMS.md §1); Polar Express (Amsel et al., arXiv 2505.16932) takes per-step optimal
  quintics built for ``[ℓ, 1]`` (:func:`polar_express_coefficients`), with ``ℓ`` read off the matrix
  (a Lanczos estimate of ``σ_min`` from the Gram matrix), so the step count follows ``log κ``, not a
  fixed bound that large matrices fall below.
* ``auto`` (default) — :func:`choose_method`: the fastest of these for the device and shape.

Normalization maps the singular values of an iteration into its basin ``(0, 1]``: ``frobenius`` (the
FIRE reference code), ``spectral`` (power-iteration estimate of ``‖W‖₂``; Newton–Schulz only, since an
estimate from below is harmless for the cubic but not for the quintics) and ``gram`` (the upper bound
``‖(WᵀW)^k‖_F^(1/2k) ≥ ‖W‖₂`` from the Gram powers the first step needs anyway; ``‖W‖_F`` is 14× above
``‖W‖₂`` on a 768² Gaussian).

An iteration either runs exactly ``steps`` steps (a partial orthogonalization, the FIRE reference) or
stops once the orthogonality error ``‖XᵀX − I‖_F / (2√n)`` (≈ the relative distance to the exact polar
factor, read off the Gram matrix each step computes anyway) is below ``tol``, at most ``max_steps``
steps; a slice still above ``tol`` then (exactly rank-deficient: an odd polynomial keeps zero singular
values at zero) gets the exact SVD answer, so the result is always a converged or an exact isometry.
Once one cubic step provably lands below ``tol`` the iteration takes it and stops without a Gram
matrix to confirm (:func:`_error_after_one_cubic_step`). All-zero and non-finite slices are never touched.
"""
from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..arguments import refuse_unknown_fields

METHODS = ("auto", "svd", "eigh", "polar_express", "newton_schulz")
ITERATIVE = ("polar_express", "newton_schulz")
NORMALIZATIONS = ("frobenius", "spectral", "gram")
ON_DEGENERATE = ("skip", "raise")
DTYPES = {"float32": torch.float32, "float64": torch.float64}
DEFAULT_NORMALIZE = {"newton_schulz": "frobenius", "polar_express": "gram"}
DEFAULT_MAX_STEPS = {"newton_schulz": 60, "polar_express": 30}
DEFAULT_TOL = 1e-5
# On one CPU thread, eigh of the n×n Gram matrix beats LAPACK's SVD once m ≥ 1.5·n and loses to it on
# square matrices, whose Gram matrix is as large as the matrix and squares its condition (benchmarks/fire.py).
EIGH_MIN_ASPECT = 1.5
# A float32 Gram matrix moves the polar factor by about 3·u·κ² (u = 2⁻²⁴, the float32 unit roundoff;
# measured on 4:1 matrices, κ = 3 … 100); up to u·κ² = 1e-6 (κ ≤ 4) that is the rounding of a float32
# SVD itself (2e-6 at 3072×768), at 0.6× the float64 route's time.
FLOAT32_GRAM_MAX_ERROR = 1e-6
_UNIT_ROUNDOFF32 = torch.finfo(torch.float32).eps / 2


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


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@refuse_unknown_fields
@dataclass(frozen=True)
class PolarOptions:
    """How :func:`orthogonalize` computes a polar factor; checked once, when built.

    Args:
        method: ``auto`` (the fastest exact method for the device and shape, see :func:`choose_method`)
            | ``svd`` (LAPACK / cuSOLVER ``U Vᵀ``) | ``eigh`` (float64 ``eigh`` of the Gram matrix of the
            smaller side) | ``polar_express`` | ``newton_schulz`` (matrix-product iterations).
        normalize: iterations only: ``frobenius`` | ``spectral`` (Newton–Schulz only) | ``gram``;
            None: ``gram`` for Polar Express, ``frobenius`` for Newton–Schulz (the FIRE reference).
        steps: iterations only: run exactly this many steps, no check, no exact fallback (a partial
            orthogonalization, as the FIRE reference code runs it). Excludes ``max_steps`` and ``tol``.
        max_steps: iterations only: stop on ``tol``, at most this many steps (None: 30 Polar Express,
            60 Newton–Schulz); a slice still above ``tol`` then gets the exact SVD answer.
        tol: target orthogonality error ``‖XᵀX − I‖_F/(2√n)`` of an iteration (None: 1e-5).
        check_every: steps between two checks of ``tol`` (each costs a host sync, no matrix product).
        dtype: compute dtype, ``"float32"`` or ``"float64"``; the result keeps the input's dtype.
        on_degenerate: an all-zero or non-finite slice is ``skip``-ped with a warning, or ``raise``-s.
        rcond: ``svd`` only: the partial isometry ``U_r V_rᵀ`` that drops ``σ < rcond·σ_max``
            (None, the default: the full isometry).

    Example:
        >>> Q = orthogonalize(W)                                                   # exact, fastest
        >>> Q = orthogonalize(W, PolarOptions(method="newton_schulz", steps=5))   # 5 fixed steps: a partial factor
    """

    method: str = "auto"
    normalize: str | None = None
    steps: int | None = None
    max_steps: int | None = None
    tol: float | None = None
    check_every: int = 1
    dtype: str = "float32"
    on_degenerate: str = "skip"
    rcond: float | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method={self.method!r} is not one of {METHODS}")
        iterative = self.method in ITERATIVE
        if self.normalize is not None and (not iterative or self.normalize not in NORMALIZATIONS):
            raise ValueError(f"normalize={self.normalize!r}: one of {NORMALIZATIONS} or None, for the iterative "
                             f"methods {ITERATIVE} only")
        if self.method == "polar_express" and self.normalize == "spectral":
            raise ValueError("normalize='spectral' is an estimate from below, unsafe for polar_express's quintics; "
                             "use normalize='gram' or 'frobenius' (both upper bounds)")
        for name in ("steps", "max_steps", "tol"):
            if getattr(self, name) is not None and not iterative:
                raise ValueError(f"{name}={getattr(self, name)!r} applies to the iterative methods {ITERATIVE}, "
                                 f"not method={self.method!r}")
        if self.steps is not None and (self.max_steps is not None or self.tol is not None):
            raise ValueError(f"steps={self.steps!r} is a fixed count; max_steps/tol stop on a tolerance: "
                             "give one or the other")
        for name in ("steps", "max_steps"):
            if getattr(self, name) is not None and not (_is_int(getattr(self, name)) and getattr(self, name) >= 0):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a non-negative integer or None")
        if self.tol is not None and (isinstance(self.tol, bool) or not isinstance(self.tol, (int, float))
                                     or not 0 < self.tol < math.inf):
            raise ValueError(f"tol={self.tol!r} must be a positive number or None")
        if not (_is_int(self.check_every) and self.check_every >= 1):
            raise ValueError(f"check_every={self.check_every!r} must be a positive integer")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not one of {tuple(DTYPES)}")
        if self.on_degenerate not in ON_DEGENERATE:
            raise ValueError(f"on_degenerate={self.on_degenerate!r} is not one of {ON_DEGENERATE}")
        if self.rcond is not None and (self.method != "svd" or not 0 <= self.rcond < 1):
            raise ValueError(f"rcond={self.rcond!r} (a partial isometry) needs method='svd' and 0 <= rcond < 1")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


@dataclass
class PolarInfo:
    """How ``orthogonalize`` got its answer."""

    method: str  # the method that ran (``auto`` resolved)
    iterations: int = 0  # steps of the iteration (0 for svd / eigh)
    matmuls: int = 0  # matrix-matrix products (power-iteration mat-vecs not counted)
    error: float = float("nan")  # largest ‖XᵀX − I‖_F/(2√n) over slices when last checked; NaN if never
    fell_back: int = 0  # slices solved by SVD: an iteration missed tol, or eigh found them rank-deficient
    fell_back_slices: torch.Tensor | None = None  # which slices those were (bool, the batch's shape); None if none
    skipped: int = 0  # degenerate slices (zero / NaN / Inf) returned unchanged
    lower: float = float("nan")  # Polar Express: the smallest σ bound a slice's schedule was built for
    # Singular values of W per slice (float64, ascending) where the method computed them (svd, eigh); None else.
    singular_values: torch.Tensor | None = None


def choose_method(shape: tuple[int, ...] | torch.Size, device: torch.device | str, dtype: torch.dtype) -> str:
    """The fastest exact polar-factor method for one ``(…, m, n)`` shape on ``device`` (what ``auto`` runs).

    GPU: ``polar_express`` (matrix products only, with a schedule fitted to the matrix's σ_min; SVD and
    ``eigh`` are slow there). CPU: ``eigh`` (float64, Gram of the smaller side) once the longer side is at
    least ``EIGH_MIN_ASPECT`` times the shorter and the compute dtype is float32 (its accuracy in float64,
    ``eps₆₄·κ²``, is below a float64 SVD's), else ``svd``.

    Example:
        >>> choose_method((3072, 768), "cpu", torch.float32)
        'eigh'
    """
    if torch.device(device).type == "cuda":
        return "polar_express"
    m, n = max(shape[-2:]), min(shape[-2:])
    return "eigh" if dtype == torch.float32 and m >= EIGH_MIN_ASPECT * n else "svd"


def orthogonalize(W: torch.Tensor, options: PolarOptions | None = None, return_info: bool = False, *,
                  warn_degenerate: bool = True):
    """The (unscaled) polar factor of ``W`` (``(m, n)`` or a batch ``(..., m, n)``), same shape and dtype.

    A full isometry (every singular value 1, orthogonality error ``‖QᵀQ − I‖_F/(2√n)`` within ``tol``)
    unless ``options`` asks for a fixed step count or a partial isometry (``rcond``).

    Args:
        W: the matrix or batch of matrices.
        options: a :class:`PolarOptions` (None: its defaults, the fastest exact method).
        return_info: also return a :class:`PolarInfo` (with the singular values of ``W`` where the method
            computed them: the diagnostics need no second factorization).
        warn_degenerate: warn about skipped slices (``on_degenerate='skip'``); a caller that has checked
            the whole weight and reports it itself passes False (a warning filter is not thread-safe).

    Example:
        >>> Q, info = orthogonalize(torch.randn(256, 64), return_info=True)
        >>> torch.allclose(Q.T @ Q, torch.eye(64), atol=1e-4), info.method
    """
    options = PolarOptions() if options is None else options
    if not isinstance(options, PolarOptions):
        raise ValueError(f"orthogonalize options={options!r} must be a PolarOptions")
    if W.dim() < 2 or not W.is_floating_point():
        raise ValueError(f"orthogonalize needs a floating-point matrix (..., m, n), got shape {tuple(W.shape)} "
                         f"and dtype {W.dtype}")
    if W.numel() == 0:
        raise ValueError(f"orthogonalize got an empty matrix of shape {tuple(W.shape)}: a layer without inputs or "
                         "outputs has no polar factor; leave it out of the selection")
    dtype = options.torch_dtype
    method = choose_method(W.shape, W.device, dtype) if options.method == "auto" else options.method
    wide = W.shape[-2] < W.shape[-1]
    tall = (W.mT if wide else W).detach()  # work on the tall orientation: the Gram is the small one
    # Divide by the largest entry first: the squares behind every norm and Gram matrix then neither
    # overflow (weights of 1e20) nor underflow (1e-25) in float32.
    peak = largest_entry(W.detach()).to(dtype)
    bad = ~torch.isfinite(peak) | (peak == 0)
    info = PolarInfo(method=method, skipped=int(bad.sum()))
    if info.skipped:
        what = (f"{info.skipped} of {bad.numel()} slice(s) of shape {tuple(W.shape[-2:])} are all zero or "
                "contain NaN/Inf")
        if options.on_degenerate == "raise":
            raise DegenerateMatrixError(f"orthogonalize: {what}; they have no polar factor")
        if warn_degenerate:
            warnings.warn(f"orthogonalize: {what}; left unchanged (no polar factor)", stacklevel=2)
        peak = torch.where(bad, torch.ones_like(peak), peak)

    def scaled() -> torch.Tensor:  # a fresh copy each time, never held here: peak memory
        X = tall.to(dtype) / peak[..., None, None]
        return X.masked_fill_(bad[..., None, None], 0.0) if info.skipped else X  # zero: a fixed point

    if method == "svd":  # LAPACK scales a matrix of extreme magnitude itself: no divided copy needed
        X = tall.to(dtype)
        Q, spectrum = _svd_polar(X.masked_fill(bad[..., None, None], 0.0) if info.skipped else X, options.rcond)
        info.singular_values = spectrum.to(torch.float64).flip(-1)
        converged = bad | True
    elif method == "eigh":
        Q, converged, eigenvalues = _eigh_polar(scaled(), bad)
        info.singular_values = eigenvalues.to(torch.float64).clamp_min(0.0).sqrt() * peak.double()[..., None]
    else:
        Q, converged = _iterate(scaled(), bad, method, options, info)
    missed = ~(converged | bad)
    if bool(missed.any()):  # rank-deficient or extremely ill-conditioned: solve those exactly
        info.fell_back, info.fell_back_slices = int(missed.sum()), missed
        Q[missed] = _svd_polar(scaled()[missed])[0]
    if info.skipped:
        Q = torch.where(bad[..., None, None], tall.to(dtype), Q)
    Q = (Q.mT if wide else Q).to(W.dtype).contiguous()
    return (Q, info) if return_info else Q


def largest_entry(W: torch.Tensor) -> torch.Tensor:
    """Largest ``|entry|`` of each ``(m, n)`` slice (NaN where a slice holds a NaN), in one pass without an
    ``|W|`` copy (``aminmax``; an inf-norm reduction is 20× slower on CPU).

    Example:
        >>> largest_entry(torch.tensor([[1.0, -3.0], [2.0, 0.5]]))   # tensor(3.)
    """
    low, high = torch.aminmax(W) if W.dim() == 2 else torch.aminmax(W.flatten(-2), dim=-1)
    return torch.maximum(-low, high)


def _eigh_polar(X: torch.Tensor, bad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``X (XᵀX)^(-1/2)`` of a tall ``X`` from an ``eigh`` of its Gram matrix; per slice whether it is
    trustworthy (numerically full rank, else the caller completes it by SVD); and the eigenvalues (``σ²``).

    The error is about ``eps·κ²`` of the Gram matrix's precision, plus ``eps·κ`` from the products after.
    A float32 ``X`` whose Lanczos estimate of ``κ²`` keeps ``u·κ²`` (float32 unit roundoff ``u``) under
    ``FLOAT32_GRAM_MAX_ERROR`` stays in float32 (checked again on the exact eigenvalues); otherwise the Gram
    matrix and ``eigh`` are float64, and the products run in float64 whenever their float32 rounding
    (``≈ eps₃₂·κ``, within 2× of a float32 SVD's own error) would pass ``DEFAULT_TOL``."""
    if X.dtype == torch.float32 and X.shape[-1] > 1:
        G = _symmetric_gram(X)  # float32: half a float64 Gram matrix's time
        if bool((_condition_squared_estimate(G, bad) * _UNIT_ROUNDOFF32 <= FLOAT32_GRAM_MAX_ERROR).all()):
            eigenvalues, V = torch.linalg.eigh(G)  # ascending
            well_conditioned = eigenvalues[..., 0] * FLOAT32_GRAM_MAX_ERROR >= _UNIT_ROUNDOFF32 * eigenvalues[..., -1]
            if bool((well_conditioned | bad).all()):  # the estimate was right: κ² is known now, not guessed
                inverse_root = eigenvalues.clamp_min(torch.finfo(torch.float32).tiny).rsqrt()
                return X @ ((V * inverse_root[..., None, :]) @ V.mT), bad | True, eigenvalues
        del G
    X64 = X.to(torch.float64)
    eigenvalues, V = torch.linalg.eigh(_symmetric_gram(X64))  # ascending
    n = X.shape[-1]
    full_rank = eigenvalues[..., 0] > n * torch.finfo(torch.float64).eps * eigenvalues[..., -1]
    inverse_root = eigenvalues.clamp_min(torch.finfo(torch.float64).tiny).rsqrt()
    condition = (eigenvalues[..., -1] / eigenvalues[..., 0].clamp_min(torch.finfo(torch.float64).tiny)).sqrt()
    if X.dtype == torch.float64 or bool((torch.where(bad | ~full_rank, 0.0, condition) * 1.2e-7 > DEFAULT_TOL).any()):
        Q = (X64 @ ((V * inverse_root[..., None, :]) @ V.mT)).to(X.dtype)
    else:  # float32 products lose eps₃₂·κ ≤ DEFAULT_TOL: V Λ^(-1/2) Vᵀ and X·(it) at float32 speed
        V32 = V.to(X.dtype)
        Q = X @ ((V32 * inverse_root.to(X.dtype)[..., None, :]) @ V32.mT)
    return Q, bad | full_rank, eigenvalues


def _symmetric_gram(X: torch.Tensor) -> torch.Tensor:
    """``XᵀX`` from three products of column halves (the fourth block is a transpose): 3/4 of the
    multiply-adds of ``X.mT @ X``, since torch has no ``syrk``."""
    n = X.shape[-1]
    if n < 256:
        return X.mT @ X
    left, right = X[..., :n // 2], X[..., n // 2:]
    cross = left.mT @ right
    return torch.cat([torch.cat([left.mT @ left, cross], -1), torch.cat([cross.mT, right.mT @ right], -1)], -2)


def _condition_squared_estimate(G: torch.Tensor, bad: torch.Tensor, steps: int = 24) -> torch.Tensor:
    """Per slice, ``λ_max/λ_min`` of the symmetric positive semi-definite ``G`` from the extreme Ritz values of
    a short Lanczos run (float64, full re-orthogonalization, a fixed start): an estimate from below, so the
    caller checks the exact eigenvalues after; inf where the smallest Ritz value is not positive, 1 on ``bad``."""
    G64 = G.to(torch.float64)
    ritz = _lanczos_ritz_values(lambda q: G64 @ q, G, steps, tol=1e-12, every_slice=True)  # ascending
    ratio = torch.where(ritz[..., 0] > 0, ritz[..., -1] / ritz[..., 0], torch.full_like(ritz[..., 0], math.inf))
    return torch.where(bad, torch.ones_like(ratio), ratio)


def _lanczos_ritz_values(apply: Callable[[torch.Tensor], torch.Tensor], like: torch.Tensor, steps: int, tol: float,
                         every_slice: bool) -> torch.Tensor:
    """Per slice, the ascending Ritz values of a short Lanczos run on the symmetric operator ``apply``
    (float64 ``(..., n, 1) -> (..., n, 1)``; ``n`` and the slices are ``like``'s last dimension and batch),
    from a fixed start (every rank, every run: the same route and schedule), with full re-orthogonalization.
    The run ends after ``min(steps, n)`` steps, or at an invariant subspace (``β ≤ tol·|α₁|``; in every slice
    with ``every_slice``, else in any), where the Ritz values are exact.

    Example:
        >>> _lanczos_ritz_values(lambda q: G @ q, G, steps=24, tol=1e-12, every_slice=True)[..., -1]  # ≈ λ_max(G)
    """
    n = like.shape[-1]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(n, 1, generator=g, dtype=torch.float64).to(like.device).expand(*like.shape[:-2], n, 1)
    basis, alphas, betas = [q / torch.linalg.vector_norm(q, dim=(-2, -1), keepdim=True)], [], []
    for _ in range(min(steps, n)):
        w = apply(basis[-1])
        alphas.append((basis[-1] * w).sum((-2, -1)))
        Qk = torch.cat(basis, dim=-1)
        w = w - Qk @ (Qk.mT @ w)  # twice: Lanczos vectors lose orthogonality as Ritz values converge
        w = w - Qk @ (Qk.mT @ w)
        beta = torch.linalg.vector_norm(w, dim=(-2, -1))
        invariant = beta <= tol * alphas[0].abs()
        if bool(invariant.all() if every_slice else invariant.any()):
            break
        betas.append(beta)
        basis.append(w / beta.clamp_min(torch.finfo(torch.float64).tiny)[..., None, None])
    k = len(alphas)
    T = torch.diag_embed(torch.stack(alphas, -1))
    if k > 1:
        off = torch.diag_embed(torch.stack(betas[:k - 1], -1), offset=1)
        T = T + off + off.mT
    return torch.linalg.eigvalsh(T)


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
    inverse_sqrt, _ = gram_inverse_sqrt(gram, m, rcond, partial)
    compute = torch.float64 if rows.dtype == torch.float64 else torch.float32
    return (rows.detach().to(compute) @ inverse_sqrt.to(compute)).to(rows.dtype)


def gram_inverse_sqrt(gram: torch.Tensor, total_rows: int, rcond: float, partial: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(G^(-1/2), eigenvalues)`` of ``gram = WᵀW`` (``W`` of ``total_rows`` rows), float64, by ``eigh``: the
    right factor of :func:`polar_from_gram`, ``polar(W) = W G^(-1/2)``, which one rank can compute and send to
    the others. ``rcond``, ``partial`` and the errors are :func:`polar_from_gram`'s; eigenvalues ascending.

    Example:
        >>> inverse_sqrt, eigenvalues = gram_inverse_sqrt(W.double().mT @ W.double(), W.shape[0], 1e-13)
        >>> torch.allclose(W.double() @ inverse_sqrt, orthogonalize(W.double()))
    """
    m, n = total_rows, gram.shape[-1]
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
    return (V * inverse_root[..., None, :]) @ V.mT, eigenvalues  # V diag(λ^(-1/2)) Vᵀ on the range



def _iterate(X, bad, method, options, info):
    """Polynomial steps on ``X`` (tall, largest entry 1; ``bad`` slices all zero): ``options.steps`` of
    them, or up to ``max_steps`` until ``tol``; return the iterate and, per slice, whether it reached
    ``tol`` (all True for a fixed count)."""
    normalize = options.normalize or DEFAULT_NORMALIZE[method]
    fixed = options.steps is not None
    limit = options.steps if fixed else (options.max_steps if options.max_steps is not None
                                         else DEFAULT_MAX_STEPS[method])
    tol = None if fixed else (options.tol if options.tol is not None else DEFAULT_TOL)
    X, A, A2 = _normalized(X, method, normalize, info)
    schedule = POLAR_EXPRESS_COEFFICIENTS
    for step in range(limit + 1):
        if fixed and step == limit:  # a fixed count: no Gram matrix to judge the last iterate
            return X, bad | True
        if A is None:  # the Gram matrix: the step needs it, and the error is read off it for free
            A = X.mT @ X
            info.matmuls += 1
        if step == 0 and method == "polar_express" and not fixed:  # fit each slice's schedule to its σ_min
            lower = _lower_singular_bound(X, bad)
            info.lower = float(lower.min())
            schedule = _polar_express_schedules(lower, X)
        if tol is not None and (step % options.check_every == 0 or step == limit):
            error = _isometry_error(A)
            info.error = float(torch.where(bad, 0.0, error).max())
            converged = bad | (error <= tol)
            if bool(converged.all()) or step == limit:
                return X, converged
            bound = _error_after_one_cubic_step(error, X.shape[-1])
            if bool((bad | (bound <= tol)).all()):  # finish with that step; no Gram needed to confirm it
                info.error = float(torch.where(bad, 0.0, bound).max())  # a bound, not a measurement
                return _polynomial_step(X, A, None, "newton_schulz", schedule, step, info), bad | True
        X = _polynomial_step(X, A, A2, method, schedule, step, info)
        A = A2 = None


def _lower_singular_bound(X: torch.Tensor, bad: torch.Tensor, lanczos_steps: int = 12) -> torch.Tensor:
    """Per slice, a bound ``ℓ`` for the smallest singular value of the tall ``X`` (σ ≤ 1) that its Polar
    Express schedule is built for: ``√λ`` for an estimate ``λ`` of ``λ_min(A)``, ``A = XᵀX`` in float64 (a
    float32 Gram matrix hides σ below ``√eps₃₂ ≈ 3e-4``, where large matrices sit), from the largest Ritz
    value of a short Lanczos run on ``(A + δI)⁻¹`` (Cholesky solves; the top of that spectrum stands
    apart, so a few steps find it), rounded down to a power of 2 (the margin for an estimate from above).
    ``δ``, ``A``'s rounding level, keeps the Cholesky factor finite and sets the floor. Too high a bound
    costs steps, never accuracy: the ``tol`` check decides when to stop, and an SVD finishes a slice
    that does not converge."""
    n = X.shape[-1]
    shift = n * torch.finfo(torch.float64).eps
    eye = torch.eye(n, dtype=torch.float64, device=X.device)
    X64 = X.detach().to(torch.float64)
    A64 = torch.where(bad[..., None, None], eye, X64.mT @ X64 + shift * eye)
    L, failed = torch.linalg.cholesky_ex(A64)
    L = torch.where((failed > 0)[..., None, None], eye, L)
    def solve(q: torch.Tensor) -> torch.Tensor:  # (A + δI)⁻¹ q
        return torch.cholesky_solve(q, L)

    largest = _lanczos_ritz_values(solve, X, lanczos_steps, tol=1e-10, every_slice=False)[..., -1]
    smallest = largest.reciprocal() - shift  # λ_min(A) estimate
    smallest = torch.where((failed > 0) | bad, torch.full_like(smallest, shift), smallest)
    estimate = smallest.clamp(shift / 4, 1.0).sqrt()
    return torch.exp2(estimate.clamp(2.0 ** -26, 0.25).log2().floor()).cpu()


@functools.lru_cache(maxsize=32)
def _polar_express_schedule(lower: float) -> tuple:
    return polar_express_coefficients(lower, steps=12, safety=_PE_SAFETY)


def _polar_express_schedules(lower: torch.Tensor, X: torch.Tensor) -> torch.Tensor | tuple:
    """Per slice, the coefficients of the schedule built for its ``lower``, as a tensor
    ``(steps, ..., 1, 1, 3)``; shorter schedules repeat their last quintic. One shared schedule: its tuple."""
    tables = {value: _polar_express_schedule(value) for value in set(lower.flatten().tolist())}
    if len(tables) == 1:  # one schedule for all: plain numbers, the cheaper in-place products
        return next(iter(tables.values()))
    steps = max(len(table) for table in tables.values())
    padded = {value: table + (table[-1],) * (steps - len(table)) for value, table in tables.items()}
    coefficients = torch.tensor([padded[value] for value in lower.flatten().tolist()], dtype=X.dtype)
    return coefficients.transpose(0, 1).reshape(steps, *lower.shape, 1, 1, 3).to(X.device)


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


def _polynomial_step(X, A, A2, method, schedule, step, info):
    """One step ``X ← X·q(A)`` with ``A = XᵀX``; in place where it saves an n×n or m×n buffer (peak memory)."""
    if method == "newton_schulz":  # X ← 1.5·X − 0.5·X·A
        info.matmuls += 1
        info.iterations += 1
        return (X @ A).mul_(-0.5).add_(X, alpha=1.5)
    coefficients = schedule[min(step, len(schedule) - 1)]  # (a, b, c), or per slice a (..., 1, 1, 3) tensor
    a, b, c = coefficients if isinstance(coefficients, tuple) else coefficients.unbind(-1)
    if A2 is None:
        A2 = A @ A
        info.matmuls += 1
    if isinstance(a, float):
        B = A2.mul_(c).add_(A, alpha=b)  # b·A + c·A², in A²'s buffer
        XB = (X @ B).add_(X, alpha=a)
    else:
        B = A2.mul_(c).addcmul_(A, b)
        XB = (X @ B).addcmul_(X, a)
    info.matmuls += 1
    info.iterations += 1
    return XB  # X ← a·X + X·(b·A + c·A²)


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


def _svd_polar(X: torch.Tensor, rcond: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``U Vᵀ`` of a tall ``X`` and its singular values: orthonormal columns whatever the singular values
    (LAPACK completes the null directions); with ``rcond`` the directions of ``σ < rcond·σ_max`` are dropped."""
    try:
        U, S, Vh = torch.linalg.svd(X, full_matrices=False)
    except torch.linalg.LinAlgError:  # LAPACK's divide and conquer can miss on clustered σ (a near-isometry)
        U, S, Vh = (t.to(X.dtype) for t in torch.linalg.svd(X.to(torch.float64), full_matrices=False))
    if rcond is not None:
        U = U * (S > rcond * S[..., :1]).to(X.dtype)[..., None, :]
    return U @ Vh, S


# ---------------------------------------------------------------------------------- diagnostics


def deviation_from_isometry(W: torch.Tensor, scale: float = 1.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """DfI ``‖WᵀW − s²I‖²_F`` (``WWᵀ`` for wide ``W``) per slice of ``(..., m, n)``, as float64.

    0 exactly when every singular value equals ``scale``. Any magnitude of ``W`` works: the Gram
    matrix is taken of ``W`` divided by its largest entry. Example: ``deviation_from_isometry(W).item()``.
    """
    X = W.detach().to(dtype)
    X = X.mT if X.shape[-2] < X.shape[-1] else X
    peak = largest_entry(X).clamp_min(torch.finfo(dtype).tiny)
    X = X / peak[..., None, None]
    peak = peak.double()
    error = _isometry_error(X.mT @ X, (scale / peak) ** 2)  # ‖X̂ᵀX̂ − (s/p)²I‖_F / (2√n)
    return (error * (2 * math.sqrt(X.shape[-1]))).square() * peak**4


def estimated_deviation_from_isometry(W: torch.Tensor, scale: float = 1.0, probes: int = 8) -> torch.Tensor:
    """DfI ``‖WᵀW − s²I‖²_F`` (``WWᵀ`` for wide ``W``) per slice of ``(..., m, n)``, as float64, estimated
    from ``probes`` Gaussian vectors ``z`` (Hutchinson: the mean of ``‖(WᵀW − s²I)z‖²`` is exact in expectation,
    with a relative spread of at most ``√(2/probes)``). Costs ``2·probes`` products of ``W`` with a vector, in
    float64, instead of a Gram matrix (``n`` times as many): for checking an isometry that is exact by
    construction. Same probes on every call (a fixed generator).

    Example:
        >>> estimated_deviation_from_isometry(orthogonalize(torch.randn(300, 200)))   # ≈ 1e-10
    """
    X = W.detach()
    X = X.mT if X.shape[-2] < X.shape[-1] else X
    g = torch.Generator().manual_seed(0)
    Z = torch.randn(X.shape[-1], probes, generator=g, dtype=torch.float64).to(X.device)
    gram_times_probes = torch.zeros(*X.shape[:-2], *Z.shape, dtype=torch.float64, device=X.device)
    for start in range(0, X.shape[-2], 256):  # float64 a row block at a time: no float64 copy of W, cache-sized
        rows = X[..., start:start + 256, :].to(torch.float64)
        gram_times_probes += rows.mT @ (rows @ Z)
    residual = gram_times_probes - scale**2 * Z  # (WᵀW − s²I) z, (..., n, probes)
    return residual.square().sum((-2, -1)) / probes


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
