"""SVD comparison metrics and the decision rule, on matrices with known answers (float64 references)."""
import math

import pytest
import torch

from plasticity_callbacks.ops.factorization import project_onto
from plasticity_callbacks.functional.subspace import (
    GRAM_SEPARATION, SVD, concentration_ratio, decide_mode, energy_rank, gradient_alignment, gram_matrix, gram_triplets,
    mode_rule, next_rank, reconstruction_error, subspace_angle, svd_triplets,
)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def orthonormal(n, k, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(n, k, generator=g, dtype=dtype)).Q


def reference_angle(A, B):
    """arccos of the smallest cosine, in float64 (the seed's formula, fine away from 0)."""
    return float(torch.arccos(torch.linalg.svdvals(A.double().mT @ B.double()).min().clamp(-1, 1)))


@pytest.mark.parametrize("device", DEVICES)
def test_angle_identical_orthogonal_and_known_rotation(device):
    n, k = 20, 4
    Q = orthonormal(n, n, seed=1).to(device)  # a fresh random frame: the answers must not depend on it
    U1 = Q[:, :k].float()
    mix = orthonormal(k, k, seed=2).to(device).float()  # another basis of the same subspace
    assert subspace_angle(U1, U1 @ mix, k) == pytest.approx(0.0, abs=1e-5)
    assert subspace_angle(U1, Q[:, k:2 * k].float(), k) == pytest.approx(math.pi / 2, abs=1e-6)
    thetas = torch.tensor([0.05, 0.3, 0.7, 0.2], dtype=torch.float64, device=device)
    U2 = Q[:, :k] * thetas.cos() + Q[:, k:2 * k] * thetas.sin()  # column i turned by θ_i toward the complement
    assert subspace_angle(U1, U2.float(), k) == pytest.approx(0.7, abs=1e-6)
    assert subspace_angle(U1, U2.float(), k) == pytest.approx(reference_angle(U1, U2), abs=1e-6)


def test_small_angle_is_accurate_in_float32():
    Q = orthonormal(16, 16, seed=3)
    theta = 3e-5  # cos θ rounds to 1 in float32: the seed's arccos would return 0
    U2 = Q[:, :3].clone()
    U2[:, 1] = Q[:, 1] * math.cos(theta) + Q[:, 7] * math.sin(theta)
    assert subspace_angle(Q[:, :3].float(), U2.float(), 3) == pytest.approx(theta, rel=0.05)
    assert subspace_angle(Q[:, :3], U2, 3, dtype=torch.float64) == pytest.approx(theta, rel=1e-6)


def test_energy_rank_and_concentration():
    S = torch.tensor([50.0, 30.0, 15.0, 4.0, 1.0]).sqrt()  # energies sum to 100
    assert energy_rank(S, 0.5) == 1
    assert energy_rank(S, 0.95) == 3  # exactly 95 counts as reached
    assert energy_rank(S, 0.96) == 4
    assert energy_rank(S, 1.0) == 5
    assert concentration_ratio(S, 0.95) == pytest.approx(3 / 5)
    assert energy_rank(torch.zeros(4), 0.9) == 0
    S = torch.rand(30, generator=torch.Generator().manual_seed(4)).sort(descending=True).values
    e = (S.double() ** 2).cumsum(0) / (S.double() ** 2).sum()
    assert energy_rank(S, 0.9) == int((e < 0.9).sum()) + 1  # the seed's counting
    with pytest.raises(ValueError, match="share"):
        energy_rank(S, 0.0)


def test_reconstruction_error_of_a_rank_k_matrix():
    g = torch.Generator().manual_seed(5)
    d_out, d_in, k = 12, 20, 4
    W = torch.randn(d_out, k, generator=g) @ torch.randn(k, d_in, generator=g)  # rank 4, g = 12
    U, S, V = svd_triplets(W)
    for r in range(0, 12 - k + 1):
        assert reconstruction_error(W, U, S, V, r) < 1e-5
    assert reconstruction_error(W, U, S, V, 12 - k + 1) > 1e-2
    W = torch.randn(d_out, d_in, generator=g, dtype=torch.float64)
    U, S, V = svd_triplets(W, dtype=torch.float64)
    tail = float((S[-5:] ** 2).sum().sqrt() / (S ** 2).sum().sqrt())
    assert reconstruction_error(W, U, S, V, 5, dtype=torch.float64) == pytest.approx(tail, rel=1e-10)
    assert reconstruction_error(torch.zeros(3, 4), *svd_triplets(torch.zeros(3, 4)), 1) == 0.0


@pytest.mark.parametrize("device", DEVICES)
def test_gradient_alignment(device):
    g = torch.Generator().manual_seed(6)
    W = torch.randn(10, 16, generator=g).to(device)
    U, S, V = svd_triplets(W)
    r = 3
    inside = U[:, :7] @ torch.randn(7, 16, generator=g).to(device)  # built inside the principal subspace
    assert gradient_alignment(inside, U, r) == pytest.approx((1.0, 0.0), abs=1e-5)
    minor = U[:, 7:] @ torch.randn(3, 16, generator=g).to(device)
    assert gradient_alignment(minor, U, r) == pytest.approx((0.0, 1.0), abs=1e-5)
    G = torch.randn(10, 16, generator=g, dtype=torch.float64).to(device)
    U64 = svd_triplets(W, dtype=torch.float64).U
    expect = [float(torch.linalg.matrix_norm(P @ P.mT @ G) / torch.linalg.matrix_norm(G))
              for P in (U64[:, :7], U64[:, 7:])]
    p, m = gradient_alignment(G, U64, r, dtype=torch.float64)
    assert (p, m) == pytest.approx(expect, rel=1e-10)
    assert p ** 2 + m ** 2 == pytest.approx(1.0)  # square-or-wide: U spans the output space
    assert gradient_alignment(torch.zeros(10, 16), U, r) == (0.0, 0.0)


def test_next_rank_first_call_uses_the_spectral_structure():
    # 64 values: a gap after index 39 (ratio 10), 99.9% energy well inside the first 40
    S = torch.cat([torch.linspace(10, 5, 40), torch.linspace(0.5, 0.01, 24)])
    r, why = next_rank(S, None, r=32, r_min=8)
    energy_cut = 64 - energy_rank(S, 0.999)
    assert r == min(64 - 40, energy_cut, 32) and "initial" in why
    r, _ = next_rank(torch.ones(16), None, r=8, r_min=8)  # flat spectrum, no gap: g//2 or the bounds
    assert 8 <= r <= 15


def test_next_rank_grows_when_the_bottom_moves_and_shrinks_when_stable():
    S_prev = torch.linspace(10, 1, 100)
    moved = S_prev.clone()
    moved[-20:] *= 1.3  # bottom 25% changed by 30% > 10%
    assert next_rank(moved, S_prev, r=40)[0] == 48 and "grow" in next_rank(moved, S_prev, r=40)[1]
    stable = S_prev.clone()
    stable[-20:] *= 1.05
    assert next_rank(stable, S_prev, r=40)[0] == 32
    assert next_rank(stable, S_prev, r=9)[0] == 8  # r_min bound
    assert next_rank(moved, S_prev, r=99)[0] == 99  # g − 1 bound
    assert next_rank(stable, S_prev[:50], r=9)[1].startswith("initial")  # incomparable previous spectrum


@pytest.mark.parametrize("angle,principal,minor,error,mode,expected", [
    (0.5, 0.41, 0.2, 0.5, "full", ("minor", "gradient_clobbering_risk")),  # clobbering wins over everything
    (0.5, 0.40, 0.2, 0.5, "minor", ("full", "reconstruction_unsafe")),  # 0.4 is not > 0.4
    (0.09, 0.3, 0.61, 0.009, "full", ("minor", "optimal_minor_conditions")),
    (0.10, 0.3, 0.61, 0.009, "full", ("full", "continue_current_mode")),  # angle not < 0.1
    (0.09, 0.3, 0.60, 0.009, "minor", ("minor", "continue_current_mode")),  # minor not > 0.6
    (0.09, 0.3, 0.61, 0.010, "minor", ("full", "reconstruction_unsafe")),  # error not < 0.01
    (math.nan, 0.3, 0.9, 0.001, "full", ("full", "continue_current_mode")),  # no previous SVD
])
def test_mode_rule_table(angle, principal, minor, error, mode, expected):
    assert mode_rule(angle, principal, minor, error, mode) == expected


def test_decide_mode_on_constructed_matrices():
    gen = torch.Generator().manual_seed(7)
    U0, V0 = orthonormal(16, 16, 8).float(), orthonormal(24, 16, 9).float()
    S = torch.cat([torch.linspace(10, 4, 12), torch.full((4,), 1e-3)])
    W = (U0 * S) @ V0.mT  # the 4 minor components carry ~1e-7 of the energy
    svd = svd_triplets(W)
    minor_grad = svd.U[:, 12:] @ torch.randn(4, 24, generator=gen)
    mode, r_next, d = decide_mode(W, svd, svd.U, svd.S, minor_grad, r=4, mode="full")
    assert (mode, d["reason"]) == ("minor", "optimal_minor_conditions")
    assert d["subspace_angle"] < 1e-3 and d["minor_alignment"] > 0.99 and d["reconstruction_error"] < 1e-3
    principal_grad = svd.U[:, :12] @ torch.randn(12, 24, generator=gen)
    assert decide_mode(W, svd, None, None, principal_grad, 4, "full")[2]["reason"] == "gradient_clobbering_risk"
    noisy = svd_triplets(torch.randn(16, 24, generator=gen))
    mode, _, d = decide_mode(torch.randn(16, 24, generator=gen), noisy, None, None, minor_grad * 0, 4, "minor")
    assert (mode, d["reason"]) == ("full", "reconstruction_unsafe")
    with pytest.raises(ValueError, match="mode"):
        decide_mode(W, svd, None, None, None, 4, "half")
    with pytest.raises(ValueError, match="'lowrank' is now called 'minor'"):
        decide_mode(W, svd, None, None, None, 4, "lowrank")


@pytest.mark.parametrize("device", DEVICES)
def test_svd_triplets_randomized_matches_full_and_keeps_global_rng(device):
    U0, V0 = orthonormal(40, 30, 11), orthonormal(30, 30, 12)
    S0 = torch.cat([torch.linspace(20, 10, 10), torch.linspace(1, 0.1, 20)]).double()
    W = ((U0 * S0) @ V0.mT).float().to(device)
    torch.manual_seed(123)
    expected_draw = torch.rand(3)
    torch.manual_seed(123)
    U, S, V = svd_triplets(W, "randomized", top=10, niter=4)
    assert torch.equal(torch.rand(3), expected_draw)  # the sketch used a private stream
    assert U.shape == (40, 30) and S.shape == (30,) and V.shape == (30, 30)
    assert torch.allclose((U * S) @ V.mT, W, atol=1e-4)
    assert torch.allclose(S.cpu().double(), S0, rtol=1e-3)
    assert subspace_angle(U, U0.float().to(device), 10) < 1e-3
    full = svd_triplets(W, dtype=torch.float64)
    assert full.U.dtype == torch.float64 and isinstance(full, SVD)
    with pytest.raises(ValueError, match="'lowrank' is now called 'randomized'"):
        svd_triplets(W, "lowrank")


def test_overhead_benchmark_drives_the_switch_through_real_hooks():
    """benchmarks/adaptive_svd_overhead.py times SVD cycles that really ran inside trainer.fit (a wrapper
    that skipped the switch's on_train_start / on_train_batch_start measured none)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from adaptive_svd_overhead import measure

    shape = dict(width=32, batch_size=1, every=3, cycles=1, layers=1, sequence_len=16)  # a tapped step: 5
    result = measure(**shape, skip_full_gradient=True)  # tapped in the backward, small as the weights are
    assert result["cycles"] >= 1 and result["matrices"] == 6  # Q, K, V, attention out, MLP in and out
    assert result["cycle"] > 0 and result["projection"] > 0 and 0 < result["share"] < math.inf
    # projecting the full gradient after the backward: the same decisions, the same weights up to rounding
    after = measure(**shape, minor_training="project-after")
    assert after["cycles"] == result["cycles"] and after["history"] == result["history"]
    for a, b in zip(after["weights"], result["weights"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    factorized = measure(**shape, minor_training="factorize")
    assert factorized["cycles"] >= 1 and factorized["minor"] == 6 and factorized["minor_step"] > 0


def known_svd(d_out, d_in, S, seed):
    """``W = U0 diag(S) V0ᵀ`` in float64 with fresh random singular frames."""
    g = min(d_out, d_in)
    U0, V0 = orthonormal(d_out, g, seed), orthonormal(d_in, g, seed + 1)
    return (U0 * S) @ V0.mT, U0, V0


def spectra(g, seed):
    """Spectra the switch meets: a random-matrix-like square one down to σ_min/σ_max = 1e-3 (where the
    Gram matrix alone loses the bottom), a flat 4:1-like one, and one with a gap before the minor block."""
    gen = torch.Generator().manual_seed(seed)
    bottom_heavy = torch.linspace(1, 1e-3, g, dtype=torch.float64) ** 1.5
    flat = torch.linspace(3, 1, g, dtype=torch.float64)
    gapped = torch.cat([torch.linspace(10, 2, g - 8, dtype=torch.float64),
                        torch.linspace(0.05, 0.01, 8, dtype=torch.float64)])
    jitter = 1 + 0.01 * torch.rand(g, generator=gen, dtype=torch.float64)
    return {name: (S * jitter).sort(descending=True).values
            for name, S in (("bottom_heavy", bottom_heavy), ("flat", flat), ("gapped", gapped))}


@pytest.mark.parametrize("shape", [(96, 96), (192, 48), (48, 192)])
def test_gram_route_matches_a_float64_svd_on_known_spectra(shape):
    """The default 'gram' route: σ to SVD accuracy at the bottom too, the minor subspace, and the same decisions."""
    r = 8
    g = min(shape)
    for i, (name, S0) in enumerate(spectra(g, seed=20).items()):
        W64, U0, V0 = known_svd(*shape, S0, seed=30 + i)
        W = W64.float()
        # the route under test, not the fallback, except where a tall W's U (= Wv/σ) would lose accuracy
        separation = GRAM_SEPARATION * torch.finfo(torch.float32).eps
        falls_back = shape[0] > shape[1] and float(S0[-1] / S0[0]) ** 2 < separation
        assert (gram_triplets(W, block=2 * r + 8) is None) == falls_back, name
        U, S, V = svd_triplets(W, "gram", top=g - r)
        assert U.shape == (shape[0], g) and S.shape == (g,) and V.shape == (shape[1], g)
        assert torch.allclose(S.double(), S0, rtol=2e-5, atol=2e-6 * float(S0[0])), name
        # at the bottom: relative 1e-4, or within a float32 SVD's own guarantee of a few eps·σ_max (where the
        # fallback runs, LAPACK builds differ: one gave 4e-4 relative at σ_min/σ_max = 3e-5); the Gram matrix
        # alone would be off by eps·σ_max²/σ_min, thousands of times more
        bottom_atol = 4 * torch.finfo(torch.float32).eps * float(S0[0])
        assert torch.allclose(S[-r:].double(), S0[-r:], rtol=1e-4, atol=bottom_atol), name
        assert subspace_angle(U.double(), U0, g - r, torch.float64) < 1e-4, name  # principal / minor split
        # V's minor columns (a factorized split's A; W_p absorbs their error): about eps·σ_max/σ_i
        assert subspace_angle(V[:, g - r:].double(), V0[:, g - r:], r, torch.float64) < 1e-5 * float(S0[0] / S0[-1])
        assert torch.allclose(U.mT @ U, torch.eye(g), atol=1e-5) and torch.allclose((U * S) @ V.mT, W, atol=1e-5)
        exact = SVD(U0, S0, V0)
        grad = torch.randn(shape, generator=torch.Generator().manual_seed(40 + i), dtype=torch.float64)
        for clobber in (0.0, 0.99):  # the gradient rule fires, or the reconstruction rule decides
            want = decide_mode(W64, exact, U0, S0 * 1.05, grad, r, "full", clobber_alignment=clobber,
                               dtype=torch.float64, exact=True)
            got = decide_mode(W, SVD(U, S, V), U0.float(), (S0 * 1.05).float(), grad.float(), r, "full",
                              clobber_alignment=clobber, exact=True)
            assert got[:2] == want[:2], (name, clobber)
            for key in ("principal_alignment", "minor_alignment", "reconstruction_error", "subspace_angle"):
                assert got[2][key] == pytest.approx(want[2][key], rel=1e-3, abs=1e-4), (name, key)


@pytest.mark.parametrize("shape", [(96, 96), (64, 160)])
def test_gram_route_widens_its_block_over_tiny_singular_values(shape):
    """30 singular values near rounding (below √(1e4·eps)·σ_max) and a minimal block of 24: the block grows
    to hold them all, so the route is still taken, and every σ stays within the float32 SVD's error."""
    g = min(shape)
    S0 = torch.cat([torch.linspace(5, 1, g - 30, dtype=torch.float64), torch.logspace(-3, -4, 30, dtype=torch.float64)])
    W64, U0, V0 = known_svd(*shape, S0, seed=45)
    W = W64.float()
    svd = gram_triplets(W, block=24)
    assert svd is not None
    U, S, V = svd
    float32_svd = torch.linalg.svdvals(W).double()
    assert (S.double() - S0).abs().max() <= 2 * (float32_svd - S0).abs().max() + 1e-6
    assert subspace_angle(U.double(), U0, g - 30, torch.float64) < 1e-5  # the tiny subspace as a whole
    assert torch.allclose(U.mT @ U, torch.eye(g), atol=1e-5) and torch.allclose((U * S) @ V.mT, W, atol=1e-5)
    if shape[0] < shape[1]:  # its transpose is tall, whose U = Wv/σ would lose the tiny σ: the SVD instead
        assert gram_triplets(W.mT.contiguous(), block=24) is None


@pytest.mark.parametrize("shape", [(96, 96), (64, 160), (160, 64)])
def test_gram_route_without_right_vectors_gives_the_same_u_and_s(shape):
    """``right_vectors=False`` (project mode) leaves out ``V`` where ``U`` is the Gram's eigenvectors (square and
    wide ``W``) and changes nothing else; a tall ``W``'s ``U`` is ``Wv/σ``, so its ``V`` comes anyway."""
    g = min(shape)
    for i, S0 in enumerate(spectra(g, seed=60).values()):
        W = known_svd(*shape, S0, seed=70 + i)[0].float()
        full, lean = gram_triplets(W, block=24), gram_triplets(W, block=24, right_vectors=False)
        if full is None:
            assert lean is None
            continue
        assert torch.equal(full.U, lean.U) and torch.equal(full.S, lean.S)
        assert (lean.V is None) == (shape[0] <= shape[1])


def test_gram_route_falls_back_to_the_svd_where_it_would_be_inexact():
    g = torch.Generator().manual_seed(50)
    rank_deficient = torch.randn(64, 20, generator=g) @ torch.randn(20, 64, generator=g)  # 44 zero σ: no separation
    assert gram_triplets(rank_deficient, block=24) is None
    U, S, V = svd_triplets(rank_deficient, "gram", top=56)
    reference = torch.linalg.svdvals(rank_deficient.double())
    assert torch.allclose(S.double(), reference, atol=1e-4)
    assert torch.allclose((U * S) @ V.mT, rank_deficient, atol=1e-3)
    assert gram_triplets(torch.randn(32, 32, generator=g), block=24) is None  # most of g: the SVD is cheaper
    assert gram_triplets(torch.full((40, 40), float("nan")), block=8) is None
    assert gram_triplets(torch.zeros(40, 40), block=8) is None
    # the trusted separation scales with the precision: a spectrum down to 1e-4 is refused in float32 only
    W64, U0, _ = known_svd(64, 96, torch.logspace(0, -4, 64, dtype=torch.float64), seed=51)
    assert gram_triplets(W64.float(), block=24) is None
    U, S, V = gram_triplets(W64, block=24)
    assert torch.allclose(S, torch.logspace(0, -4, 64, dtype=torch.float64), rtol=1e-9)
    assert subspace_angle(U, U0, 56, torch.float64) < 1e-9


@pytest.mark.parametrize("d", [40, 24])
def test_angle_on_the_minor_complement_of_a_square_basis(d):
    """Square bases: the top-k angle is measured on the d − k trailing columns; it must equal the float64
    top-k reference, for large and tiny angles, and the tall (non-square) case keeps the k-column form."""
    k = d - 5
    Q = orthonormal(d, d, seed=60)
    skew = torch.randn(d, d, dtype=torch.float64, generator=torch.Generator().manual_seed(61))
    skew = skew - skew.mT
    for scale in (0.02, 2e-6):
        turned = Q @ torch.linalg.matrix_exp(scale * skew)
        # float64 sine form: the arccos reference is itself imprecise at tiny angles
        want = subspace_angle(Q[:, :k].contiguous(), turned[:, :k].contiguous(), k, torch.float64)
        assert want == pytest.approx(reference_angle(Q[:, :k], turned[:, :k]), rel=1e-6, abs=1e-7)
        assert subspace_angle(Q.float(), turned.float(), k) == pytest.approx(want, rel=0.02)
    tall = orthonormal(3 * d, d, seed=62)
    other = torch.linalg.qr(tall + 0.05 * orthonormal(3 * d, d, seed=63)).Q
    assert subspace_angle(tall.float(), other.float(), k) == pytest.approx(reference_angle(tall[:, :k], other[:, :k]),
                                                                         abs=1e-5)


def test_alignment_of_a_square_basis_in_both_regimes():
    U = orthonormal(30, 30, seed=70)
    gen = torch.Generator().manual_seed(71)
    for minor_share in (0.1, 0.9, 1.0):  # sqrt(1 − minor²) below, the explicit residual above √½
        principal_part = U[:, :25] @ torch.randn(25, 40, generator=gen, dtype=torch.float64)
        minor_part = U[:, 25:] @ torch.randn(5, 40, generator=gen, dtype=torch.float64)
        G = (math.sqrt(1 - minor_share ** 2) * principal_part / principal_part.norm()
             + minor_share * minor_part / minor_part.norm())
        p, m = gradient_alignment(G.float(), U.float(), r=5)
        assert (p, m) == pytest.approx((math.sqrt(1 - minor_share ** 2), minor_share), abs=2e-6)


def test_reconstruction_error_from_the_spectrum_equals_the_measured_one():
    S0 = torch.logspace(0, -3, 20, dtype=torch.float64)
    W, U0, V0 = known_svd(20, 35, S0, seed=80)
    for r in (1, 5, 19):
        measured = reconstruction_error(W, U0, S0, V0, r, torch.float64)
        assert reconstruction_error(W, U0, S0, V0, r, exact=True) == pytest.approx(measured, rel=1e-10)
    assert reconstruction_error(torch.zeros(4, 4), torch.eye(4), torch.zeros(4), torch.eye(4), 2, exact=True) == 0.0


def test_wide_full_svd_through_the_transpose():
    W = torch.randn(20, 70, generator=torch.Generator().manual_seed(90))
    U, S, V = svd_triplets(W, "full")
    assert U.shape == (20, 20) and V.shape == (70, 20)
    assert torch.allclose((U * S) @ V.mT, W, atol=1e-5) and torch.allclose(S, torch.linalg.svdvals(W), atol=1e-5)


@pytest.mark.parametrize("layout", ["linear", "conv1d_transposed", "conv_kernel", "float64_state"])
def test_in_place_projection_in_every_layout(layout):
    """project_onto writes U_m U_mᵀ T into the tensor itself, whatever its layout (the per-step path)."""
    gen = torch.Generator().manual_seed(100)
    U_minor = orthonormal(12, 12, seed=101)[:, 9:].float().contiguous()  # (d_out, r)
    stored = {"linear": torch.randn(12, 30, generator=gen), "conv1d_transposed": torch.randn(30, 12, generator=gen),
              "conv_kernel": torch.randn(12, 3, 2, 5, generator=gen),
              "float64_state": torch.randn(12, 30, generator=gen, dtype=torch.float64)}[layout]
    view = stored.mT if layout == "conv1d_transposed" else stored  # (out, in) orientation, as the callback passes it
    before = view.reshape(12, -1).double()
    expected = U_minor.double() @ (U_minor.double().mT @ before)
    storage = stored.data_ptr()
    project_onto(view, U_minor)
    assert stored.data_ptr() == storage
    assert torch.allclose(view.reshape(12, -1).double(), expected, atol=1e-5)


@pytest.mark.parametrize("shape", [(2, 5), (3, 3), (37, 50), (64, 16)])
def test_gram_matrix_is_the_symmetric_product(shape):
    A = torch.randn(*shape, generator=torch.Generator().manual_seed(90), dtype=torch.float64)
    G = gram_matrix(A)
    torch.testing.assert_close(G, A @ A.mT, atol=1e-12, rtol=0)
    assert torch.equal(G, G.mT)


def test_largest_eigenvalue_matches_eigvalsh_and_falls_back_where_lanczos_cannot_certify(monkeypatch):
    """Lanczos' top Ritz value against eigvalsh on fresh PSD matrices past the eigvalsh size: a separated top, a
    tight cluster at the top, a bulk near 0 with one large value (the angle's shape), a zero matrix; with too few
    steps to certify, eigvalsh answers."""
    from plasticity_callbacks.functional import subspace

    gen = torch.Generator().manual_seed(200)
    k = 300
    Q = torch.linalg.qr(torch.randn(k, k, generator=gen, dtype=torch.float64)).Q
    spectra = {
        "separated": torch.rand(k, generator=gen, dtype=torch.float64),
        "clustered": torch.cat([1 + 1e-9 * torch.rand(5, generator=gen, dtype=torch.float64),
                                torch.rand(k - 5, generator=gen, dtype=torch.float64)]),
        "one large": torch.cat([torch.tensor([3e-6], dtype=torch.float64), 1e-12 * torch.rand(k - 1, generator=gen,
                                                                                            dtype=torch.float64)]),
    }
    for name, lam in spectra.items():
        M = (Q * lam) @ Q.mT
        want = float(torch.linalg.eigvalsh(M)[-1])
        assert subspace.largest_eigenvalue(M) == pytest.approx(want, rel=1e-6), name
        assert subspace.largest_eigenvalue(M.float()) == pytest.approx(want, rel=1e-5), name
    assert subspace.largest_eigenvalue(torch.zeros(k, k)) == 0.0
    calls = []
    real = torch.linalg.eigvalsh
    monkeypatch.setattr(torch.linalg, "eigvalsh", lambda A: calls.append(A.shape) or real(A))
    M = (Q * spectra["separated"]) @ Q.mT
    assert subspace.largest_eigenvalue(M, steps=150, tolerance=0.0) == pytest.approx(float(real(M)[-1]), rel=1e-12)
    assert calls == [(k, k)]  # not certified in its steps: the whole solver answered


def test_largest_eigenvalue_gives_up_early_on_a_bulk_edge_and_not_on_a_separated_top(monkeypatch):
    """A top at the edge of a bulk (the angle of a subspace turned a little in every direction: no certificate in
    LANCZOS_STEPS) goes to eigvalsh after LANCZOS_PATIENCE + 1 products instead of all of them, with eigvalsh's
    value; a separated top is still certified by Lanczos alone. Fresh matrices, float64 and float32."""
    from plasticity_callbacks.functional import subspace

    gen = torch.Generator().manual_seed(210)
    k = 400
    Q = torch.linalg.qr(torch.randn(k, k, generator=gen, dtype=torch.float64)).Q
    edge = torch.linalg.svdvals(torch.randn(4 * k, k, generator=gen, dtype=torch.float64)) ** 2 / (4 * k)  # MP bulk
    separated = torch.cat([torch.tensor([2.0], dtype=torch.float64), torch.rand(k - 1, generator=gen, dtype=torch.float64)])
    real_eigvalsh, real_eigh = torch.linalg.eigvalsh, torch.linalg.eigh
    for lam, gives_up in ((edge, True), (separated, False)):
        M = (Q * lam) @ Q.mT
        for dtype in (torch.float64, torch.float32):
            calls, products = [], []
            monkeypatch.setattr(torch.linalg, "eigvalsh", lambda A: calls.append(A.dtype) or real_eigvalsh(A))
            monkeypatch.setattr(torch.linalg, "eigh", lambda T: products.append(1) or real_eigh(T))
            got = subspace.largest_eigenvalue(M.to(dtype))
            monkeypatch.undo()
            assert got == pytest.approx(float(lam.max()), rel=1e-6 if dtype == torch.float64 else 1e-5)
            assert calls == ([dtype] if gives_up else [])  # the whole solver, in the matrix's own dtype
            assert len(products) <= (subspace.LANCZOS_PATIENCE + 1 if gives_up else subspace.LANCZOS_STEPS)
