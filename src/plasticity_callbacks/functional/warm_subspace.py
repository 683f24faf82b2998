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

from .subspace import SVD, as_matrix, gram_matrix

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
    minor span that moved too far since the previous cycle (see the module's docstring).

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
        or None; a few more than ``count`` where ``σ_count`` all but ties the next one (see the loop). None: not converged, a singular ``W``, or a block too large to be cheaper than an SVD.

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
        raise ValueError(f"warm_minor_triplets needs d_out <= d_in (U spanning the whole output space); got {g}x{n}")
    if start not in STARTS:
        raise ValueError(f"start={start!r} is not one of {STARTS}")
    if U_prev is None and start == "previous":
        raise ValueError("start='previous' needs U_prev")
    if U_prev is not None and tuple(U_prev.shape) != (g, g):
        raise ValueError(f"U_prev has shape {tuple(U_prev.shape)}, expected ({g}, {g})")
    if not 1 <= count <= g - 1:
        raise ValueError(f"count={count} must be in [1, {g - 1}]")
    block = min((2 * count + 8) if start == "previous" else SPECTRUM_BLOCK * count, g // 2)
    if block < count + 4:
        return None  # the minor block is near half the space: an SVD costs no more
    tolerance = torch.finfo(dtype).eps ** 0.5 if tolerance is None else tolerance
    if start == "spectrum":
        gram = gram_matrix(W)
        lam, Q = torch.linalg.eigh(gram)  # ascending
        if not bool(torch.isfinite(lam).all()) or not lam[0] > 0:
            return None
        U_minor, X = Q[:, :block].flip(1), Q[:, :block]  # U_minor: the reference spans, descending σ
        inverse_gram = _cholesky_inverse(gram, (SPECTRUM_SHIFT * float(lam[0]), 0.0))
    else:
        U_minor = U_prev[:, g - block:].to(dtype)  # the start's trailing spans: an unchanged W stops after one step
        inverse_gram = _inverse_gram(W, U_minor[:, -count:])
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
    count = size
    U_minor = U_block[:, -count:]
    S_minor = S_block[-count:]
    # An orthonormal basis of the complement: the last g − count columns of a complete QR of U_minor.
    complement = torch.linalg.qr(U_minor, mode="complete").Q[:, count:]
    V = V_block[:, -count:] if right_vectors else None
    return SVD(torch.cat([complement, U_minor], 1), S_minor, V)


def _orthonormal(X: torch.Tensor) -> torch.Tensor:
    return torch.linalg.qr(X).Q


def _inverse_gram(W: torch.Tensor, U_start: torch.Tensor):
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
    return _cholesky_inverse(gram_matrix(W), (SHIFT * quotient, 0.0))


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
    """The triplets of ``W`` restricted to ``span(Q)`` on the left: ``Qᵀ W = H Σ Pᵀ`` gives ``u = Q H``,
    ``σ = Σ``, ``v = P`` (descending, ``Wᵀ u = σ v`` exactly)."""
    P, S, Hh = torch.linalg.svd(W.mT @ Q, full_matrices=False)  # (n, b) tall: LAPACK is faster than on its transpose
    return Q @ Hh.mT, S, P
