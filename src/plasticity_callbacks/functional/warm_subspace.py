"""The minor singular triplets of a slowly changing weight, warm-started from the previous cycle's vectors.

``AdaptiveSVDSwitch`` decides on the ``r`` smallest singular triplets of each weight (their values, their
left subspace, the gradient's share in it) and on the angle between principal subspaces from one cycle to
the next. For ``W (d_out, d_in)`` with ``d_out ≤ d_in``, ``U`` is an orthonormal basis of all of
``R^{d_out}``, so the principal subspace is exactly the orthogonal complement of the minor one: only the
minor triplets have to be computed, and the principal columns can be any orthonormal basis of the
complement. Between cycles ``W`` changes little, so the previous minor vectors are a close start.

Why inverse iteration: the bottom of a spectrum is where power iteration on ``W Wᵀ`` converges slowest (the
ratio of neighbouring eigenvalues, seen from ``λ_max``, is close to 1), while iteration with ``(W Wᵀ)⁻¹``
converges at ``(σ_i / σ_{b+1})²`` per step, ``b`` the block size: fast for the few smallest ones. The
operator is only an accelerator: every iterate's triplets come from a Rayleigh–Ritz step on ``W`` itself, so
the values are ``W``'s to an SVD's accuracy once the subspace is right.

Why the stopping test is the subspace's movement and not the residual ``‖W v − σ u‖``: in float32 the right
vector of a small ``σ`` carries an error of about ``eps·σ_max/σ`` (for any method that reads it off ``Wᵀ u``),
so that residual stalls near ``eps·σ_max²/σ`` however good ``u`` is, while the left subspace, which the decision
reads, keeps converging.

Why a second start, from the spectrum: a wide weight's smallest σ sit in a tight cluster (4:1, a few hundred steps
in: the bottom 40 within 15 % of each other), and while the weight still moves fast its minor span turns within
that cluster from one cycle to the next, too far for the previous vectors to be a start. The Gram matrix that
the iteration factorizes anyway then gives one: its ``eigh`` puts the block within about ``eps·σ_max²`` over the
cluster's spread of the minor span, and its smallest eigenvalue a shift just below the bottom, so two or three
steps converge, for about a third of the full SVD such a weight needs (its Gram route cannot resolve the bottom).
"""
from __future__ import annotations

import torch

from .subspace import GRAM_SEPARATION, SVD, as_matrix, gram_matrix, thin_svd

WARM_ITERATIONS = 8  # from the last cycle's vectors (minor spans ~1e-2 apart) float32 needs 3–5 (square), 5–8 (wide)
SHIFT = 0.9  # a wide W's Gram matrix is shifted by this share of the start's smallest Rayleigh quotient
STARTS = ("previous", "spectrum")
SPECTRUM_BLOCK = 4  # a spectrum start's block, in units of count: the cluster's next eigenvalues stay out of it
SPECTRUM_SHIFT = 0.99  # of the Gram's smallest eigenvalue, which eigh gives to about eps·λ_max


def warm_minor_triplets(W: torch.Tensor, U_prev: torch.Tensor | None, count: int, dtype: torch.dtype = torch.float32,
                        iterations: int = WARM_ITERATIONS, tolerance: float | None = None, seed: int = 0,
                        right_vectors: bool = True, start: str = "previous") -> SVD | None:
    """The ``count`` smallest singular triplets of ``W`` and a complete ``U``, from the previous ``U``; None
    where they did not converge (the caller computes a full SVD then).

    A block of ``b = min(2·count + 8, d_out // 2)`` vectors (the previous ``U``'s trailing columns and a few
    random ones, for a direction the previous cycle did not have) goes through at most ``iterations`` steps
    of inverse subspace iteration with ``(W Wᵀ)⁻¹`` (an LU of a square ``W``, a Cholesky factor of the Gram
    matrix of a wide one); after each, a Rayleigh–Ritz step on ``W`` gives the block's triplets. Converged when
    the span of the ``count`` smallest moved by at most ``tolerance`` (the sine of the largest principal angle)
    in the last step, the first step measured from the previous ``U``'s. The iteration shrinks the distance to
    ``W``'s minor subspace by ``ρ = (σ_count / σ_{b+1})²`` per step, so what is left is about
    ``ρ / (1 − ρ)`` times the last movement: below ``tolerance`` wherever ``ρ < ½``. From the fourth step on (the
    first ones still sort the block) it gives up as soon as the last step's rate would not reach ``tolerance``
    within the steps left: the fallback then costs less. ``start="spectrum"`` starts instead from the bottom
    ``b = min(4·count, d_out // 2)`` eigenvectors of the Gram matrix ``W Wᵀ`` (one ``eigh``), the first step
    measured from its bottom ``count``, the Cholesky factor shifted to 0.99 of its smallest eigenvalue: for a
    minor span that moved too far since the previous cycle (see the module's docstring). A tall ``W`` goes to
    :func:`warm_tall_triplets`.

    Args:
        W: the weight as its ``(d_out, d_in)`` matrix, ``d_out ≤ d_in`` (``U`` spans all of ``R^{d_out}``).
        U_prev: the previous cycle's ``(d_out, d_out)`` left vectors, descending ``σ``.
        count: how many trailing triplets are wanted (the minor ones the decision and the next phase read).
        dtype: the working precision.
        iterations: the most inverse-iteration steps before giving up.
        tolerance: the largest movement of the minor span in the last step; None: ``√eps`` of ``dtype``
            (3.5e-4 in float32, 1.5e-8 in float64), well below the decision's angle and alignment thresholds.
        seed: the random columns' seed (a private generator: the training RNG is untouched).
        right_vectors: also return the minor right vectors (a factorized split's ``A``).
        start: ``"previous"`` (``U_prev``'s trailing columns) or ``"spectrum"`` (the Gram matrix's bottom
            eigenvectors; ``U_prev`` is then only checked, and may be None).

    Returns:
        ``SVD(U, S, V)``: ``U (d_out, d_out)`` whose last ``count`` columns are the minor left vectors
        (descending ``σ``) and whose leading columns are an orthonormal basis of their complement, the
        principal subspace (not singular vectors); ``S (count,)`` the minor singular values; ``V (d_in, count)``
        or None; a few more than ``count`` where ``σ_count`` all but ties the next one (see the loop). None: not
        converged, a singular ``W``, or a block too large to be cheaper than an SVD.

    Raises:
        ValueError: a tall ``W``, ``U_prev`` of the wrong shape, ``count`` outside ``[1, d_out − 1]``, or an unknown
            ``start``.

    Example:
        >>> svd = warm_minor_triplets(W_now, U_last_cycle, count=16)
        >>> if svd is None:
        ...     svd = svd_triplets(W_now, "full")
    """
    W = as_matrix(W).to(dtype)
    g, n = W.shape
    if g > n:
        raise ValueError(f"warm_minor_triplets needs d_out <= d_in (U spanning the whole output space); got {g}x{n}: "
                         "a tall W's warm cycle is warm_tall_triplets")
    found = _minor_block(W, U_prev, count, dtype, iterations, tolerance, seed, start, "U_prev")
    if found is None:
        return None
    U_minor, S_minor, V_minor, _ = found
    return SVD(torch.cat([_complement(U_minor), U_minor], 1), S_minor, V_minor if right_vectors else None)


def warm_tall_triplets(W: torch.Tensor, V_prev: torch.Tensor | None, count: int, dtype: torch.dtype = torch.float32,
                       iterations: int = WARM_ITERATIONS, tolerance: float | None = None, seed: int = 0,
                       start: str = "previous") -> SVD | None:
    """The ``count`` smallest singular triplets of a tall ``W (m, n)``, ``m > n``, and a basis of its principal
    left subspace, from the previous cycle's right vectors; None where they did not converge or the basis would
    not be accurate (the caller computes a full SVD then).

    A tall weight's ``U`` does not span ``R^m``: its principal subspace is the part of ``range(W)`` outside the
    minor one, not a complement to read off. Its *right* vectors do span ``R^n``, so the minor triplets come from
    :func:`warm_minor_triplets`' iteration on ``Wᵀ`` (the ``n × n`` Gram matrix ``WᵀW``, warm-started from the
    previous ``V``; the Rayleigh–Ritz step on ``W`` itself gives ``σ`` and the minor left vectors), and the
    principal right subspace is the complement ``V_p`` of the minor right vectors. ``span(W V_p)`` is the
    principal left subspace; its orthonormal basis is the QR of ``W V_p`` taken through the Gram matrix the
    iteration already formed: ``R = chol(V_pᵀ WᵀW V_p)`` (float64, ``k × k``), ``U_p = W (V_p R⁻¹)``, one
    ``m × n × k`` product instead of a Householder QR of the ``m × k`` matrix (5× its time). Its orthonormality is
    good to about ``eps·σ_max² / σ_k²`` (``σ_k`` the smallest principal value), like the Gram route's ``U``
    (:func:`~functional.subspace.gram_triplets`); so, as there, None where ``σ_k² < GRAM_SEPARATION·eps·σ_max²``
    (bounded by ``σ_k ≥`` the largest minor value and ``σ_max² ≤ ‖WᵀW‖_F``).

    Args:
        W: the weight as its ``(m, n)`` matrix, ``m > n``.
        V_prev: the previous cycle's ``(n, n)`` right vectors, descending ``σ`` (its leading columns may be any
            orthonormal basis of the principal right subspace); None only with ``start="spectrum"``.
        count, dtype, iterations, tolerance, seed, start: as in :func:`warm_minor_triplets`.

    Returns:
        ``SVD(U, S, V)``: ``U (m, n)``, its leading ``n − count`` columns an orthonormal basis of the principal
        left subspace (not singular vectors), its last ``count`` the minor left vectors (descending ``σ``);
        ``S (count,)``; ``V (n, n)``, its last ``count`` columns the minor right vectors and its leading ones an
        orthonormal basis of their complement (the next cycle's ``V_prev``). ``count`` may grow by a few, as in
        :func:`warm_minor_triplets`.

    Raises:
        ValueError: ``W`` not tall, ``V_prev`` of the wrong shape, ``count`` outside ``[1, n − 1]``, or an unknown
            ``start``.

    Example:
        >>> svd = warm_tall_triplets(W_now, V_last_cycle, count=16)   # W_now (4096, 1024)
        >>> if svd is None:
        ...     svd = svd_triplets(W_now, "full")
    """
    W = as_matrix(W).to(dtype)
    m, n = W.shape
    if m <= n:
        raise ValueError(f"warm_tall_triplets needs d_out > d_in; got {m}x{n}: use warm_minor_triplets")
    found = _minor_block(W.mT, V_prev, count, dtype, iterations, tolerance, seed, start, "V_prev")
    if found is None:
        return None
    V_minor, S_minor, U_minor, gram = found  # Wᵀ's minor left vectors are W's minor right ones, and vice versa
    count = S_minor.numel()
    V_principal = _complement(V_minor)  # (n, k)
    if float(S_minor[0]) ** 2 < GRAM_SEPARATION * torch.finfo(dtype).eps * float(torch.linalg.matrix_norm(gram)):
        return None  # the principal basis from the Gram matrix would not be orthonormal to an SVD's accuracy
    inner = (V_principal.mT @ (gram @ V_principal)).double()  # (k, k): (W V_p)ᵀ (W V_p)
    R, info = torch.linalg.cholesky_ex(inner, upper=True)
    if int(info) != 0:
        return None
    Z = torch.linalg.solve_triangular(R, V_principal.double(), upper=True, left=False)  # V_p R⁻¹, (n, k)
    U_principal = W @ Z.to(dtype)  # (m, k), orthonormal: Rᵀ R = (W V_p)ᵀ (W V_p)
    return SVD(torch.cat([U_principal, U_minor], 1), S_minor, torch.cat([V_principal, V_minor], 1))


def _minor_block(W: torch.Tensor, U_prev: torch.Tensor | None, count: int, dtype: torch.dtype, iterations: int,
                 tolerance: float | None, seed: int, start: str, name: str):
    """The iteration of :func:`warm_minor_triplets` on ``W (g, n)``, ``g ≤ n``: ``(U_minor (g, c), S_minor (c,),
    V_minor (n, c), gram)`` (``c ≥ count``; ``gram`` the ``W Wᵀ`` it formed, None for a square ``W``), or None."""
    g, n = W.shape
    if start not in STARTS:
        raise ValueError(f"start={start!r} is not one of {STARTS}")
    if U_prev is None and start == "previous":
        raise ValueError(f"start='previous' needs {name}")
    if U_prev is not None and tuple(U_prev.shape) != (g, g):
        raise ValueError(f"{name} has shape {tuple(U_prev.shape)}, expected ({g}, {g})")
    if not 1 <= count <= g - 1:
        raise ValueError(f"count={count} must be in [1, {g - 1}]")
    block = min((2 * count + 8) if start == "previous" else SPECTRUM_BLOCK * count, g // 2)
    if block < count + 4:
        return None  # the minor block is near half the space: an SVD costs no more
    tolerance = torch.finfo(dtype).eps ** 0.5 if tolerance is None else tolerance
    gram = gram_matrix(W) if g < n else None  # a square W is factorized itself (see _inverse_gram)
    if start == "spectrum":
        if gram is None:
            gram = gram_matrix(W)
        lam, Q = torch.linalg.eigh(gram)  # ascending
        if not bool(torch.isfinite(lam).all()) or not lam[0] > 0:
            return None
        U_minor, X = Q[:, :block].flip(1), Q[:, :block]  # U_minor: the reference spans, descending σ
        inverse_gram = _cholesky_inverse(gram, (SPECTRUM_SHIFT * float(lam[0]), 0.0))
    else:
        U_minor = U_prev[:, g - block:].to(dtype)  # the start's trailing spans: an unchanged W stops after one step
        inverse_gram = _inverse_gram(W, U_minor[:, -count:], gram)
        generator = torch.Generator(device=W.device).manual_seed(seed)
        spare = max(2, (block - count) // 2)
        fresh = torch.randn(g, spare, generator=generator, device=W.device, dtype=dtype)
        X = torch.cat([U_prev[:, g - block + spare:].to(dtype), fresh], 1)  # (g, block)
    if inverse_gram is None:
        return None
    last, eps, Q = None, torch.finfo(dtype).eps, _orthonormal(X)
    for step in range(iterations):
        X = inverse_gram(Q)
        if not bool(torch.isfinite(X).all()):
            return None
        Q = _orthonormal(X)  # the Rayleigh–Ritz basis, and the next step's input
        U_block, S_block, V_block = _rayleigh_ritz(W, Q)
        # A near-tie at the split leaves the span of the smallest ``count`` unresolved to ~eps·σ_b / gap by the
        # Rayleigh–Ritz step (σ_b its block's largest): take the next values in while that is not well below
        # tolerance, so the test measures a span that can converge (the decision reads fewer, all of them exact).
        size, floor = count, eps * float(S_block[0]) * 4 / tolerance
        while size < block - 4 and floor > float(S_block[-size - 1] - S_block[-size]):
            size += 1
        new, reference = U_block[:, -size:], U_minor[:, -size:]
        moved = float(torch.linalg.matrix_norm(new - reference @ (reference.mT @ new), 2))
        U_minor = U_block
        if moved <= tolerance:
            break
        if step >= 3 and moved * min(1.0, moved / last) ** (iterations - 1 - step) > tolerance:
            return None  # at the rate of the last step it would not converge in the steps left: stop paying
        last = moved
    else:
        return None
    return U_block[:, -size:], S_block[-size:], V_block[:, -size:], gram


def _complement(U_minor: torch.Tensor) -> torch.Tensor:
    """An orthonormal basis of the orthogonal complement of ``U_minor``'s columns: the last ``d − c`` columns of a
    complete QR of it, ``Q [0; I]``. ``Q = H_1 ⋯ H_c = I − Y T Yᵀ`` (the compact WY form of its Householder
    reflectors, ``Y (d, c)``, ``T (c, c)`` upper triangular) gives them as one rank-``c`` update of ``[0; I]``:
    the same columns as LAPACK's ``orgqr`` to rounding, for a fifth of its time at ``d = 1024`` (which builds all
    of ``Q`` reflector by reflector)."""
    d, c = U_minor.shape
    Y, tau = torch.geqrf(U_minor)
    Y = Y.tril(-1)
    Y.diagonal().fill_(1)  # the reflectors' implied unit diagonal
    inner, tau = (Y.mT @ Y).double(), tau.double()  # (c, c): T in float64 from a recurrence of c small steps
    T = inner.new_zeros(c, c)
    for i in range(c):
        T[i, i] = tau[i]
        T[:i, i] = -tau[i] * (T[:i, :i] @ inner[:i, i])
    complement = U_minor.new_zeros(d, d - c)
    complement[c:].fill_diagonal_(1)
    return complement.addmm_(Y, T.to(Y.dtype) @ Y[c:].mT, alpha=-1)  # (I − Y T Yᵀ)[:, c:]


def _orthonormal(X: torch.Tensor) -> torch.Tensor:
    return torch.linalg.qr(X).Q


def _inverse_gram(W: torch.Tensor, U_start: torch.Tensor, gram: torch.Tensor | None):
    """``X ↦ (W Wᵀ − μ I)⁻¹ X`` (up to a change of basis within the span), or None where it cannot be factorized.

    A square ``W`` is factorized itself (LU: ``W⁻ᵀ W⁻¹``, ``μ = 0``, no squared condition number). A wide one
    goes through the Cholesky factor of its Gram matrix shifted by ``μ = SHIFT·λ``, ``λ`` the smallest Rayleigh
    quotient of the start's minor vectors: a wide matrix's smallest ``σ`` sit well above 0 and close together,
    where the unshifted ratio ``λ_i / λ_{b+1}`` is near 1; moving the origin toward them shrinks it. ``λ`` is at
    least ``λ_min``, so a shift above ``λ_min`` shows as a failed Cholesky and is retried unshifted. The Gram
    matrix's rounding only slows the iteration: the triplets come from ``W`` itself."""
    g, n = W.shape
    if g == n:
        LU, pivots, info = torch.linalg.lu_factor_ex(W)
        if int(info) != 0:
            return None

        def apply(X):
            Y = _orthonormal(torch.linalg.lu_solve(LU, pivots, X))  # W⁻¹ X: rescaled, same span
            return torch.linalg.lu_solve(LU, pivots, Y, adjoint=True)  # W⁻ᵀ
        return apply
    quotient = float((torch.linalg.vector_norm(W.mT @ U_start, dim=0) ** 2).min())
    return _cholesky_inverse(gram, (SHIFT * quotient, 0.0))


def _cholesky_inverse(gram: torch.Tensor, shifts: tuple[float, ...]):
    """``X ↦ (gram − μ I)⁻¹ X`` up to a change of basis, with the first shift ``μ`` whose Cholesky factor exists;
    None where none does."""
    eye = torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)
    for shift in shifts:
        L, info = torch.linalg.cholesky_ex(gram - shift * eye)
        if int(info) == 0:
            break
    else:
        return None

    def apply(X):
        Y = _orthonormal(torch.linalg.solve_triangular(L, X, upper=False))
        return torch.linalg.solve_triangular(L.mT, Y, upper=True)
    return apply


def _rayleigh_ritz(W: torch.Tensor, Q: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The triplets of ``W`` restricted to ``span(Q)`` on the left: ``Wᵀ Q = P Σ Hᵀ`` (from ``W`` itself, so the
    small ``σ`` keep an SVD's accuracy; :func:`~.subspace.thin_svd`) gives ``u = Q H``, ``σ = Σ``, ``v = P``."""
    P, S, H = thin_svd(W.mT @ Q)  # (n, b) tall
    return Q @ H, S, P
