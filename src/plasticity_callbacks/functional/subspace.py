"""SVD comparison metrics and the adaptive full / minor-component decision.

A weight ``W (d_out, d_in)`` with ``g = min(d_out, d_in)`` has the reduced SVD ``W = U diag(S) Vᵀ``
(``U (d_out, g)``, ``V (d_in, g)``, ``S`` descending). With ``r`` minor components, the top
``k = g − r`` columns of ``U`` span the *principal* output subspace and the last ``r`` the *minor*
one. Everything here is plain tensor math (no Lightning), computed in float32 unless a caller asks
for float64, on whatever device the inputs live on.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

MODES = ("full", "minor")  # train the whole matrix, or only its r minor components
SVD_METHODS = ("gram", "full", "randomized")
RENAMED = {"lowrank": "minor"}  # old mode name -> new, refused with a hint


class SVD(NamedTuple):
    """Singular triplets, descending ``σ``. A warm cycle (:mod:`~functional.warm_subspace`) holds only the last
    ``t < g`` values in ``S`` and the last ``t`` right vectors in ``V``; its ``U`` is whole, its leading ``g − t``
    columns an orthonormal basis of the principal subspace rather than singular vectors."""

    U: torch.Tensor  # (d_out, g) left singular vectors, the output-space basis that is tracked
    S: torch.Tensor  # (g,) singular values, descending; or the trailing (t,) of them
    V: torch.Tensor | None  # (d_in, g) or (d_in, t) right singular vectors (columns, not Vᵀ); None where not asked for


def as_matrix(weight: torch.Tensor) -> torch.Tensor:
    """A conv kernel ``(out, in, *k)`` viewed as the ``(out, in·∏k)`` matrix it applies."""
    return weight.reshape(weight.shape[0], -1)


def svd_triplets(W: torch.Tensor, method: str = "gram", top: int | None = None, niter: int = 2,
                 dtype: torch.dtype = torch.float32, seed: int = 0, right_vectors: bool = True) -> SVD:
    """All ``g`` singular triplets of ``W``.

    Args:
        W: the ``(d_out, d_in)`` matrix.
        method: ``"gram"`` (default) — the eigendecomposition of the smaller Gram matrix, with the
            bottom ``2·(g − top) + 8`` triplets recomputed from ``W`` itself (:func:`gram_triplets`);
            it falls back to ``"full"`` where that would not be accurate or not cheaper.
            ``"full"`` — ``torch.linalg.svd`` (LAPACK / cuSOLVER), exact.
            ``"randomized"`` — two ``torch.svd_lowrank`` blocks built from matmuls and small SVDs: the
            top ``top`` triplets of ``W``, then the ``g − top`` triplets of the remainder
            ``W − U_top S_top V_topᵀ``. Its accuracy depends on the spectral gap at ``top`` and on
            ``niter`` power iterations; a low-rank split built from it stays exact because
            ``W_p = W − BA`` absorbs any error. The random sketch comes from a private RNG stream
            (``seed``), so the training RNG is untouched and every rank draws the same sketch.
        top: how many leading triplets are principal (``g − top`` are minor); None: ``g // 2``.
        niter: power iterations of ``"randomized"``.
        dtype: the working precision.
        seed: the sketch's seed (``"randomized"``).
        right_vectors: False: ``V`` may be None where leaving it out saves work (``"gram"`` on a square or
            wide ``W``, whose ``U`` are the Gram's eigenvectors: no ``Wᵀ U`` product).

    Example:
        >>> U, S, V = svd_triplets(torch.randn(64, 256), top=56)   # U (64, 64), S (64,), V (256, 64)
    """
    if method not in SVD_METHODS:
        hint = " ('lowrank' is now called 'randomized')" if method == "lowrank" else ""
        raise ValueError(f"method={method!r} is not one of {SVD_METHODS}{hint}")
    W = W.to(dtype)
    g = min(W.shape)
    q = g // 2 if top is None else max(1, min(g, int(top)))
    if method == "gram":
        svd = gram_triplets(W, block=2 * (g - q) + 8, right_vectors=right_vectors)
        if svd is not None:
            return svd
        method = "full"
    if method == "full":
        if W.shape[0] < W.shape[1]:  # LAPACK's SVD of a wide matrix is up to 2× slower than of its transpose
            V, S, Uh = torch.linalg.svd(W.mT, full_matrices=False)
            return SVD(Uh.mT, S, V)
        U, S, Vh = torch.linalg.svd(W, full_matrices=False)
        return SVD(U, S, Vh.mT)
    q = g if top is None else q
    devices = [W.device] if W.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        U, S, V = torch.svd_lowrank(W, q=q, niter=niter)
        if q < g:
            rest = W - (U * S) @ V.mT
            U2, S2, V2 = torch.svd_lowrank(rest, q=g - q, niter=niter)
            U, S, V = torch.cat([U, U2], 1), torch.cat([S, S2]), torch.cat([V, V2], 1)
    return SVD(U, S, V)


GRAM_BLOCKS = 4  # block rows of gram_matrix: 10 of 16 block products, ~5/8 of the full product's work


def gram_matrix(A: torch.Tensor, blocks: int = GRAM_BLOCKS) -> torch.Tensor:
    """``A Aᵀ``, symmetric: each block row multiplied only up to the diagonal, the upper blocks mirrored from the
    lower ones (a plain product computes both halves; LAPACK's ``syrk`` is not exposed).

    Example:
        >>> torch.testing.assert_close(gram_matrix(A), A @ A.mT)
    """
    g = A.shape[0]
    edges = [g * i // blocks for i in range(blocks + 1)]
    out = A.new_empty(g, g)
    for a, b in zip(edges[:-1], edges[1:]):
        out[a:b, :b] = A[a:b] @ A[:b].mT
        out[:a, a:b] = out[a:b, :a].mT
        diagonal = out[a:b, a:b]
        diagonal.copy_(diagonal.tril() + diagonal.tril(-1).mT)  # exactly symmetric, as a solver may read either half
    return out


GRAM_SEPARATION = 1e4  # in units of eps: λ_{block+1} / λ_max below 1e4·eps (1.2e-3 in float32) is not trusted


@torch.no_grad()  # its products write into preallocated outputs; eigenvector gradients mean little here anyway
def gram_triplets(W: torch.Tensor, block: int, separation: float | None = None,
                  right_vectors: bool = True) -> SVD | None:
    """The SVD of ``W`` from ``eigh`` of the Gram matrix of its smaller side, or None where that is inexact.

    Squaring ``W`` squares its condition number: the Gram matrix's eigenvalues carry an absolute
    error of about ``eps·σ_max²``, so ``σ_i`` taken from them is good only where ``σ_i² ≫ eps·σ_max²``
    — not for the smallest singular values, which the adaptive switch compares from cycle to cycle.
    So the bottom ``block`` eigenvectors are a starting basis only: the bottom triplets are recomputed
    by a Rayleigh–Ritz step on ``W`` itself (the SVD of ``W`` restricted to that basis, a
    ``block × n`` problem), which gets ``σ`` to the accuracy of an SVD of ``W`` as long as the basis
    holds the bottom directions, i.e. as long as the eigenvalue just above the block is well separated
    from rounding (``λ_{block+1} ≥ separation·λ_max``: the block grows to every eigenvalue below that,
    and None if it would pass ``g / 2``; for a tall ``W``, whose ``U`` is the other side,
    ``λ_min ≥ separation·λ_max`` or None). Then a bottom vector's error from directions outside the
    block is at most ``σ_max / (σ_i + σ_j) ≤ 1 / (2√separation)`` (≈ 14 in float32) times the float32
    SVD's own, and inside the block it is the SVD's. The other side's bottom vectors
    (``V`` of a square or wide ``W``) are accurate to about ``eps·σ_max/σ_i`` (they only shape a
    factorized split's ``A``, whose error ``W_p = W − BA`` absorbs). The top triplets come from the
    eigenpairs (the other side's vectors as ``Wᵀu/σ`` or ``Wv/σ``, accurate to ``eps·σ_max²/σ²``).
    None as well where the block is more than half of ``g`` (an SVD is cheaper then) or ``W`` is not finite
    or zero.

    Args:
        W: the ``(d_out, d_in)`` matrix, float32 or float64.
        block: at least how many bottom triplets to recompute from ``W`` (the minor ones and a margin).
        separation: the smallest trusted ``λ_{block+1} / λ_max``; None: ``GRAM_SEPARATION·eps`` of ``W``'s dtype.
        right_vectors: False: ``V`` is None for a square or wide ``W`` (its top right vectors, ``Wᵀ u / σ``, are
            a ``d_in × g × g`` product that only a factorized split needs).

    Example:
        >>> svd = gram_triplets(torch.randn(128, 512), block=24)   # None would mean: use the SVD
    """
    g = min(W.shape)
    block = max(1, min(g, block))
    if 2 * block > g:
        return None
    if separation is None:
        separation = GRAM_SEPARATION * torch.finfo(W.dtype).eps
    A = W if W.shape[0] <= W.shape[1] else W.mT  # (g, n), g <= n: A's left vectors are the Gram's eigenvectors
    lam, Q = torch.linalg.eigh(gram_matrix(A))  # ascending
    top_lam = lam[-1]
    if not bool(torch.isfinite(top_lam)) or not top_lam > 0:
        return None
    # The block grows past the eigenvalues too close to rounding (cheap: a block × n problem), so a
    # square matrix with a few tiny σ still takes this route. A tall W's U is the other side, Wv/σ,
    # whose error grows as eps·σ_max/σ: there the whole spectrum must be separated from rounding.
    unresolved = int((lam < separation * top_lam).sum())
    if A is not W and unresolved:
        return None
    block = max(block, unresolved)
    if 2 * block > g:
        return None
    # W restricted to the bottom basis, as the tall (n, block) Aᵀ Q_b = X S Yᵀ (LAPACK is slower on wide input)
    X, S_bottom, Y = thin_svd(A.mT @ Q[:, :block])
    Xh = X.mT  # X (n, block): the other side's bottom vectors
    left = torch.cat([Q[:, block:].flip(1), Q[:, :block] @ Y], 1)  # (g, g), descending σ
    right = None  # the other side's vectors: V of a square or wide W (wanted or not), U of a tall one
    if A is W:
        S_top = lam[block:].flip(0).sqrt()
    if A is not W or right_vectors:
        # the other side's vectors, (n, g), built in place: for a tall W these are a 4096 × 1024 U, where every
        # temporary of that size (a product's copy, a concatenation) costs as much as a tenth of the product
        right = A.new_empty(A.shape[1], g)
        right_top = torch.matmul(A.mT, left[:, :g - block], out=right[:, :g - block])  # the top vectors, times σ
        if A is not W:
            # Tall W: these are U, which the switch compares and projects with. An eigenvector just above
            # the block can lean into the block (a close eigenvalue across the edge) and tilt Wv toward
            # the block's U (X): remove that, so U stays orthonormal, and read σ as the norm (a column norm
            # as a sum of squares: vector_norm over dim 0 of a row-major matrix is 10× slower).
            right_top.addmm_(X, Xh @ right_top, alpha=-1)
            S_top = right_top.square().sum(0).sqrt()
        right_top.div_(S_top)
        right[:, g - block:] = X
    S = torch.cat([S_top, S_bottom])
    if not bool(S_top[-1] >= S_bottom[0]):  # a near-tie at the block's edge swapped places
        S, order = S.sort(descending=True, stable=True)
        left, right = left[:, order], (right[:, order] if right is not None else None)
    return SVD(left, S, right) if A is W else SVD(right, S, left)


def thin_svd(Y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``Y = X diag(S) Hᵀ`` for a tall ``Y (n, b)`` with few columns, descending: ``eigh`` of its ``b × b`` Gram
    matrix in float64 gives ``H`` and ``S``, and ``X = Y H / S``. In float64 that Gram matrix is exact to
    ``1e-16·σ_1²``, so ``S`` is as accurate as an SVD's and ``X`` carries ``Y``'s own rounding (``eps·σ_1/σ_i``
    relative, as any vectors read from ``Y`` do) — for about a third of LAPACK's SVD time on such a shape.

    Example:
        >>> X, S, H = thin_svd(torch.randn(4096, 160))   # torch.linalg.svd(Y, full_matrices=False), H = Vhᵀ
    """
    Y64 = Y.double()
    lam, H = torch.linalg.eigh(Y64.mT @ Y64)  # ascending
    S = lam.flip(0).clamp_min(0).sqrt().to(Y.dtype)
    H = H.flip(1).to(Y.dtype)
    return (Y @ H) / S.clamp_min(torch.finfo(Y.dtype).tiny), S, H


COSINE_ROUTE_SINE2 = 0.01  # sin² of the largest angle from which subspace_angle reads it off the cosines


def _largest_sine2_estimate(cross: torch.Tensor, steps: int = 8) -> float:
    """A few power steps on ``I − crossᵀ cross`` (``k²`` each): about its largest eigenvalue, the largest sin², to
    route :func:`subspace_angle` without paying a ``k × k`` eigensolver where the answer is the sine route."""
    x = torch.ones(cross.shape[1], 1, dtype=cross.dtype, device=cross.device)
    estimate = 0.0
    for _ in range(steps):
        x = x / torch.linalg.vector_norm(x).clamp_min(torch.finfo(cross.dtype).tiny)
        y = x - cross.mT @ (cross @ x)
        estimate = float((x * y).sum())
        x = y
    return estimate


LANCZOS_STEPS = 40  # largest_eigenvalue: at most this many Lanczos steps; matrices up to twice this size: eigvalsh
LANCZOS_TOLERANCE = 1e-7  # relative residual of the top Ritz pair at which its value is taken
# From this step on, Lanczos gives up where its residual's rate over the last four steps would not reach the
# tolerance in the steps left: a top at the edge of a bulk (a weight whose whole subspace turned a little, as early in
# training) shrinks it by ~0.9 a step and never certifies in LANCZOS_STEPS, while a separated top falls by 10× a step.
LANCZOS_PATIENCE = 8


def largest_eigenvalue(M: torch.Tensor, steps: int = LANCZOS_STEPS, tolerance: float = LANCZOS_TOLERANCE) -> float:
    """The largest eigenvalue of a symmetric positive semidefinite ``M (k, k)``: Lanczos in float64 with full
    reorthogonalization from a fixed random start (a private generator), stopped when the top Ritz pair's residual
    ``β_j |y_j|`` is at most ``tolerance·θ`` (plus the matrix's rounding): then an eigenvalue lies within that of
    ``θ``. Where it does not get there in ``steps`` steps (or, from step ``LANCZOS_PATIENCE`` on, would not at the
    rate of its last four), and for ``k ≤ 2·steps``, ``eigvalsh`` in ``M``'s dtype answers.

    Why: :func:`subspace_angle` of a tall weight needs the extreme eigenvalue of a ``k × k`` matrix with
    ``k`` near ``g`` (its principal subspace); the symmetric solver reduces the whole matrix to tridiagonal form
    (``~4k³/3``), while ``steps`` products with it (``2k²`` each) find its largest one, which stands apart from
    the rest (the largest angle's sin², over a bulk near 0).

    Args:
        M: the symmetric PSD matrix (any float dtype; the iteration runs in float64).
        steps: the most Lanczos steps.
        tolerance: the relative residual at which the top Ritz value is taken.

    Example:
        >>> A = torch.randn(300, 200); largest_eigenvalue(A.mT @ A)   # torch.linalg.eigvalsh(A.mT @ A)[-1]
    """
    k = M.shape[0]
    if k <= 2 * steps:
        return float(torch.linalg.eigvalsh(M).max())
    A = M.double()
    floor = 64 * torch.finfo(torch.float64).eps * float(torch.linalg.matrix_norm(A))
    generator = torch.Generator(device=A.device).manual_seed(0)
    Q = A.new_zeros(k, steps + 1)
    q = torch.randn(k, generator=generator, dtype=A.dtype, device=A.device)
    Q[:, 0] = q / torch.linalg.vector_norm(q)
    alphas, betas, residuals = [], [], []  # residuals: the top Ritz pair's, relative to θ
    for j in range(steps):
        w = A @ Q[:, j]
        alphas.append(float(Q[:, j] @ w))
        basis = Q[:, :j + 1]
        for _ in range(2):  # twice is enough (Kahan): the Krylov basis stays orthonormal to rounding
            w = w - basis @ (basis.mT @ w)
        beta = float(torch.linalg.vector_norm(w))
        T = torch.diag(torch.tensor(alphas, dtype=torch.float64))
        if j:
            off = torch.tensor(betas, dtype=torch.float64)
            T += torch.diag(off, 1) + torch.diag(off, -1)
        theta, Y = torch.linalg.eigh(T)
        residual = beta * abs(float(Y[-1, -1]))
        if residual <= tolerance * float(theta[-1]) + floor:
            return float(theta[-1])  # also an invariant subspace found (β = 0): θ is exact
        residuals.append(residual / max(float(theta[-1]), torch.finfo(torch.float64).tiny))
        if j >= LANCZOS_PATIENCE:  # at the rate of its last steps it would not certify in the steps left: stop paying
            rate = min(1.0, (residuals[-1] / residuals[-5]) ** 0.25)
            if residuals[-1] * rate ** (steps - 1 - j) > tolerance:
                break
        betas.append(beta)
        Q[:, j + 1] = w / beta
    # in M's own dtype: its entries carry that rounding (eps·‖M‖), which a float64 solve cannot take back; a
    # float32 k × k eigvalsh costs half the float64 one
    return float(torch.linalg.eigvalsh(M).max())


def subspace_angle(U1: torch.Tensor, U2: torch.Tensor, k: int, dtype: torch.dtype = torch.float32) -> float:
    """Largest principal angle (radians, in ``[0, π/2]``) between the spans of ``U1[:, :k]`` and ``U2[:, :k]``.

    The seed takes ``arccos`` of the smallest singular value of ``U1_kᵀ U2_k``; near 0 that loses
    everything below ~1e-4 rad in float32 (cos θ = 1 − θ²/2 rounds to 1). The sine of the same
    angle, ``‖U2_k − U1_k U1_kᵀ U2_k‖₂``, is accurate there: ``asin`` of it below 45°, ``atan2``
    with the cosine above. When ``U1, U2`` are square (orthonormal bases of the whole space, as
    ``U`` of a square or wide matrix), the angle between the top-``k`` spans equals the one between
    their orthogonal complements, the last ``d − k`` columns: a ``(d − k)``-column problem instead
    of a ``k``-column one, which is what makes it cheap for few minor components. Where the largest angle is
    not small (``sin ≥ 0.1``) the cosines alone give it as accurately, and the residual is not formed.

    Args:
        U1, U2: ``(d, g)`` matrices with orthonormal columns.
        k: how many leading columns span each subspace.
        dtype: the working precision.

    Example:
        >>> Q = torch.linalg.qr(torch.randn(8, 8)).Q
        >>> subspace_angle(Q, Q, 3)   # 0.0
    """
    d, g = U1.shape
    if k <= 0:
        return 0.0
    if d == g and U2.shape == U1.shape and 0 < d - k < k:
        A, B = U1[:, k:].to(dtype), U2[:, k:].to(dtype)
    else:
        A, B = U1[:, :k].to(dtype), U2[:, :k].to(dtype)
    cross = A.mT @ B  # (k, k)
    if _largest_sine2_estimate(cross) >= COSINE_ROUTE_SINE2:
        # The cosine route: sin² = 1 − σ_min(cross)² is off by about the inputs' orthonormality defect δ (float32
        # vectors: ~1e-6, whatever the working dtype), so where sin² ≥ 0.01 the angle is within 5δ of the sine
        # route's; it saves the (d, k) residual and the two d·k² products that form and square it (a tall
        # weight's whole principal subspace).
        coupling = gram_matrix(cross.mT)  # crossᵀ cross: cos² of the angles
        eye = torch.eye(coupling.shape[0], dtype=coupling.dtype, device=coupling.device)
        cos2 = min(1.0, max(0.0, 1.0 - largest_eigenvalue(eye - coupling)))
        if 1 - cos2 >= COSINE_ROUTE_SINE2:
            return math.atan2(math.sqrt(1 - cos2), math.sqrt(cos2))
    residual = B - A @ cross  # (d, k): the part of span(B) outside span(A)
    sin = min(1.0, max(0.0, largest_eigenvalue(gram_matrix(residual.mT)))) ** 0.5
    if sin <= math.sqrt(0.5):
        return math.asin(sin)
    cos = float(torch.linalg.svdvals(cross).min().clamp(0, 1))
    return math.atan2(sin, cos)


def energy_rank(S: torch.Tensor, share: float = 0.95) -> int:
    """How many leading singular values hold ``share`` of ``Σσ²`` (0 for an all-zero spectrum)."""
    if not 0 < share <= 1:
        raise ValueError(f"share={share} must be in (0, 1]")
    energy = S.double() ** 2  # float64 sums; a share reached up to the input's rounding counts as reached
    total = energy.sum()
    if total <= 0:
        return 0
    slack = 4 * S.numel() * torch.finfo(S.dtype).eps if S.is_floating_point() else 0.0
    reached = torch.cumsum(energy, 0) >= share * total * (1 - slack)
    return int(reached.nonzero()[0, 0]) + 1


def concentration_ratio(S: torch.Tensor, share: float = 0.95) -> float:
    """``energy_rank / g``: the fraction of singular values needed for ``share`` of the energy."""
    return energy_rank(S, share) / max(1, S.numel())


def tail_energy_rank(S_tail: torch.Tensor, total: float, g: int, share: float = 0.95) -> float:
    """:func:`energy_rank` of a spectrum of ``g`` values of which only the trailing ``S_tail`` and the total
    ``Σσ² = total`` (``‖W‖_F²``) are known: exact where the cut falls among the known values, NaN where it
    falls above them (then it is at most ``g − len(S_tail)``).

    Example:
        >>> tail_energy_rank(torch.tensor([1.0, 1.0]), total=7.0, g=4)   # S = (2, 1, 1, 1): 4.0
    """
    t = S_tail.numel()
    if total <= 0:
        return 0.0
    slack = 4 * g * torch.finfo(S_tail.dtype).eps if S_tail.is_floating_point() else 0.0
    # tails[j] = Σ of the last t − j known σ²; the head before it, total − tails[j], holds g − t + j values
    tails = torch.cat([(S_tail.double() ** 2).flip(0).cumsum(0).flip(0), torch.zeros(1, dtype=torch.float64)])
    reached = (total - tails >= share * total * (1 - slack)).nonzero()
    j = int(reached[0, 0])
    return math.nan if j == 0 else float(g - t + j)


def squared_norm(W: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``‖W‖_F²`` as a float64 scalar, summed in ``dtype`` (a float64 copy of a large ``W`` costs 40× the sum, whose
    rounding, about ``eps`` relative, is far below what the energies built on it resolve)."""
    return torch.linalg.vector_norm(as_matrix(W).to(dtype)).double() ** 2


def reconstruction_error(W: torch.Tensor, U: torch.Tensor, S: torch.Tensor, V: torch.Tensor, r: int,
                         dtype: torch.dtype = torch.float32, exact: bool = False) -> float:
    """``‖W − W_k‖_F / ‖W‖_F`` for ``W_k`` built from the top ``k = g − r`` triplets (0 for ``W = 0``).

    With ``exact`` (the triplets are an SVD of ``W``, not a sketch) it is read from the spectrum,
    ``√(Σ_{i>k} σ_i²) / √(Σ σ_i²)``, with no ``d_out × d_in`` product (``Σ σ_i² = ‖W‖_F²`` where ``S`` holds only
    the trailing values); otherwise it is measured on ``W``, so it also counts what an inexact factorization
    missed.

    Args:
        W: the matrix; U, S, V: its triplets (``U (d_out, g)``, ``S (g,)``, ``V (d_in, g)``).
        r: how many trailing triplets are left out.
        dtype: the working precision.
        exact: read the error from ``S``.

    Example:
        >>> reconstruction_error(W, *svd_triplets(W), r=8, exact=True)
    """
    k = S.numel() - r
    if exact:
        energy = S.double() ** 2
        total = energy.sum() if S.numel() == U.shape[1] else squared_norm(W, dtype)
        return float((energy[k:].sum() / total).sqrt()) if total > 0 else 0.0
    W = as_matrix(W).to(dtype)
    U_k, S_k, V_k = U[:, :k].to(dtype), S[:k].to(dtype), V[:, :k].to(dtype)
    norm = torch.linalg.matrix_norm(W)
    if norm == 0:
        return 0.0
    return float(torch.linalg.matrix_norm(W - (U_k * S_k) @ V_k.mT) / norm)


def gradient_alignment(grad: torch.Tensor, U: torch.Tensor, r: int,
                       dtype: torch.dtype = torch.float32) -> tuple[float, float]:
    """``(‖U_p U_pᵀ G‖/‖G‖, ‖U_m U_mᵀ G‖/‖G‖)``, ``U_p = U[:, :g−r]``, ``U_m = U[:, g−r:g]``.

    The squares sum to 1 when ``U`` spans the whole output space (``d_out ≤ d_in``); then only the
    ``r`` minor columns are used: the principal share is ``√(1 − minor²)`` while that is at least
    ``√½`` (no cancellation), else the norm of the residual ``G − U_m U_mᵀ G``. A tall matrix's
    gradient can also point outside ``W``'s column space, and that share is in neither. A zero
    gradient gives ``(0, 0)``.

    Args:
        grad: ``∇W`` in ``(d_out, ·)`` orientation.
        U: ``(d_out, g)`` left singular vectors, descending σ.
        r: how many trailing columns of ``U`` are minor.
        dtype: the working precision.

    Example:
        >>> principal, minor = gradient_alignment(W.grad, svd_triplets(W).U, r=8)
    """
    G, U = as_matrix(grad).to(dtype), U.to(dtype)
    d, g = U.shape
    k = g - r
    norm = torch.linalg.matrix_norm(G)
    if norm == 0:
        return 0.0, 0.0
    if d == g:
        minor_coeff = U[:, k:].mT @ G  # (r, d_in)
        minor = float(torch.linalg.matrix_norm(minor_coeff) / norm)
        if minor ** 2 <= 0.5:
            return math.sqrt(1.0 - minor ** 2), minor
        return float(torch.linalg.matrix_norm(G - U[:, k:] @ minor_coeff) / norm), minor
    coeff = U.mT @ G  # (g, d_in): coordinates of G in the U basis; ‖U_p U_pᵀ G‖ = ‖U_pᵀ G‖
    principal = torch.linalg.matrix_norm(coeff[:k]) / norm
    minor = torch.linalg.matrix_norm(coeff[k:]) / norm
    return float(principal), float(minor)


def rank_bounds(g: int, r_min: int) -> tuple[int, int]:
    """``r`` stays in ``[min(r_min, g − 1), g − 1]``: at least one principal component is kept."""
    return min(r_min, g - 1), g - 1


def largest_next_rank(r: int, g: int, r_min: int = 8, grow: float = 1.2) -> int:
    """The most minor components :func:`next_rank` can give after a phase with ``r`` (when it compares spectra):
    how many trailing triplets a cycle needs for the decision and the next phase."""
    lo, hi = rank_bounds(g, r_min)
    return max(lo, min(max(r, int(r * grow)), hi))


def next_rank(S: torch.Tensor, S_prev: torch.Tensor | None, r: int, r_min: int = 8,
              change_threshold: float = 0.1, grow: float = 1.2, shrink: float = 0.8,
              g: int | None = None) -> tuple[int, str]:
    """The number of minor components for the next phase, and why.

    First call (no comparable ``S_prev``): the smallest of the spectral-gap cut (the components
    after the largest ``σ_i/σ_{i+1}``), the 99.9%-energy cut and ``g // 2``. Later calls: if the
    bottom ``min(r, g // 4)`` singular values moved by more than ``change_threshold`` (relative
    norm), keep or grow ``r`` by ``grow``, else shrink it by ``shrink``. Bounded by
    :func:`rank_bounds`. The gap cut after index ``i`` is ``g − i − 1``: the ``i + 1`` components
    above the gap stay principal. ``S`` may hold only trailing values (a warm cycle's, ``g`` then given) as
    long as it holds the bottom ones compared, and ``S_prev`` NaN in place of the values not computed; the
    first call needs all of ``S``.
    """
    g = S.numel() if g is None else g
    lo, hi = rank_bounds(g, r_min)
    S64 = S.double()
    bottom = max(1, min(r, g // 4))
    if S_prev is not None and S_prev.numel() == g:
        prev, curr = S_prev.double()[-bottom:], S64[-bottom:]
        denom = torch.linalg.vector_norm(prev)
        change = float(torch.linalg.vector_norm(curr - prev) / denom) if denom > 0 else math.inf
        if change > change_threshold:
            r_next = max(r, int(r * grow))
            why = f"minor components changing ({change:.1%} > {change_threshold:.0%}): keep/grow r"
        else:
            r_next = int(r * shrink)
            why = f"minor components stable ({change:.1%} <= {change_threshold:.0%}): shrink r"
    else:
        if S.numel() != g:
            raise ValueError(f"next_rank: a first guess of r needs all {g} singular values, not the last {S.numel()}")
        ratios = S64[:-1] / S64[1:].clamp_min(torch.finfo(torch.float64).tiny)
        gap_cut = g - int(torch.argmax(ratios)) - 1 if g > 1 else 0
        energy_cut = g - energy_rank(S, 0.999)
        r_next = min(gap_cut, energy_cut, g // 2)
        why = f"initial r from spectral structure (gap cut {gap_cut}, 99.9% energy cut {energy_cut}, g//2 {g // 2})"
    r_next = max(lo, min(r_next, hi))
    return r_next, f"{why} -> r={r_next}"


def mode_rule(angle: float, principal: float, minor: float, error: float, mode: str,
              clobber_alignment: float = 0.4, stable_angle: float = 0.1, safe_minor_alignment: float = 0.6,
              max_reconstruction_error: float = 0.01) -> tuple[str, str]:
    """The decision on already measured metrics: ``(mode, reason)``; see :func:`decide_mode`."""
    if principal > clobber_alignment:
        return "minor", "gradient_clobbering_risk"
    if angle < stable_angle and minor > safe_minor_alignment and error < max_reconstruction_error:
        return "minor", "optimal_minor_conditions"
    if not error < max_reconstruction_error:
        return "full", "reconstruction_unsafe"
    return mode, "continue_current_mode"


def decide_mode(
    W: torch.Tensor,
    svd: SVD,
    U_prev: torch.Tensor | None,
    S_prev: torch.Tensor | None,
    grad: torch.Tensor | None,
    r: int,
    mode: str,
    r_min: int = 8,
    clobber_alignment: float = 0.4,
    stable_angle: float = 0.1,
    safe_minor_alignment: float = 0.6,
    max_reconstruction_error: float = 0.01,
    dtype: torch.dtype = torch.float32,
    exact: bool = False,
) -> tuple[str, int, dict]:
    """The switching rule: train the full matrix or only its ``r`` minor components next?

    With metrics measured at the current ``r`` (``k = g − r`` principal components):
    1. principal alignment > ``clobber_alignment`` → ``minor`` (the gradient would clobber the principal subspace);
    2. angle to the previous SVD < ``stable_angle`` and minor alignment > ``safe_minor_alignment``
       and reconstruction error < ``max_reconstruction_error`` → ``minor``;
    3. reconstruction error ≥ ``max_reconstruction_error`` → ``full``;
    4. otherwise keep ``mode``.
    Without a previous SVD the angle is unknown (NaN) and rule 2 cannot fire; without a gradient
    both alignments are 0.

    Args:
        W: the weight as its ``(d_out, ·)`` matrix; svd: its triplets (:func:`svd_triplets`).
        U_prev, S_prev: the previous cycle's ``U`` and ``S`` (None on the first cycle).
        grad: the step's ``∇W`` in the same orientation (None: alignments 0).
        r: minor components of the current phase; mode: the current mode.
        r_min: fewest minor components for :func:`next_rank`.
        clobber_alignment, stable_angle, safe_minor_alignment, max_reconstruction_error: the rule's thresholds.
        dtype: the working precision of the metrics.
        exact: ``svd`` is an SVD of ``W`` (method ``"gram"`` or ``"full"``, not a sketch), so the
            reconstruction error is read from its spectrum.

    Returns:
        ``(mode, r_next, diagnostics)``; ``r_next`` comes from :func:`next_rank`.

    Example:
        >>> svd = svd_triplets(W, top=W.shape[0] - 8)
        >>> mode, r_next, diag = decide_mode(W, svd, None, None, W.grad, r=8, mode="full", exact=True)
    """
    if mode not in MODES:
        hint = f" ({mode!r} is now called {RENAMED[mode]!r})" if mode in RENAMED else ""
        raise ValueError(f"mode={mode!r} is not one of {MODES}{hint}")
    U, S, V = svd
    k = U.shape[1] - r  # S may hold only the trailing values
    angle = subspace_angle(U_prev, U, k, dtype) if U_prev is not None else math.nan
    principal, minor = gradient_alignment(grad, U, r, dtype) if grad is not None else (0.0, 0.0)
    error = reconstruction_error(W, U, S, V, r, dtype, exact=exact)
    g = U.shape[1]
    r_next, rationale = next_rank(S, S_prev, r, r_min, g=g)
    if S.numel() == g:
        effective = energy_rank(S, 0.95)
    else:  # trailing values only: known where the last 5 % of the energy lies among them
        effective = tail_energy_rank(S, float(squared_norm(W, dtype)), g, 0.95)
    new_mode, reason = mode_rule(angle, principal, minor, error, mode, clobber_alignment, stable_angle,
                                 safe_minor_alignment, max_reconstruction_error)
    diagnostics = {
        "subspace_angle": angle, "principal_alignment": principal, "minor_alignment": minor,
        "reconstruction_error": error, "effective_rank": effective,
        "concentration": effective / g, "r": r, "r_next": r_next,
        "reason": reason, "r_rationale": rationale,
    }
    return new_mode, r_next, diagnostics
