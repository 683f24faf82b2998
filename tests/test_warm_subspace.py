"""Warm-started minor triplets against the full SVD (float64, matrices with known subspaces), and the switch's
warm cycle: the same decisions, the fallback counted, resume."""
import math

import pytest
import torch

from plasticity_callbacks import AdaptiveSVDSwitch
from plasticity_callbacks.callbacks import adaptive_svd
from plasticity_callbacks.functional import switch_cycle
from plasticity_callbacks.callbacks.schedule import Schedule
from plasticity_callbacks.functional import subspace
from plasticity_callbacks.functional.subspace import (
    as_matrix, decide_mode, subspace_angle, svd_triplets, tail_energy_rank,
)
from plasticity_callbacks.functional.warm_subspace import warm_minor_triplets, warm_tall_triplets
from tiny import build, cpu_trainer


def frame(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64)).Q


def known_matrix(d_out, d_in, minor, seed):
    """``U diag(S) Vᵀ`` with fresh random frames: principal σ in [1, 2], the ``minor`` smallest in [0.01, 0.05]."""
    g = min(d_out, d_in)
    gen = torch.Generator().manual_seed(seed + 100)
    S = torch.cat([1 + torch.rand(g - minor, generator=gen, dtype=torch.float64),
                   0.01 + 0.04 * torch.rand(minor, generator=gen, dtype=torch.float64)]).sort(descending=True).values
    return frame(d_out, seed)[:, :g] * S @ frame(d_in, seed + 1)[:, :g].mT


def projector(U):
    return U @ U.mT


@pytest.mark.parametrize("shape", [(48, 48), (40, 96)])
def test_warm_cycles_give_the_full_svds_subspaces_values_and_decisions(shape):
    d_out, d_in = shape
    count, r = 6, 5
    W = known_matrix(d_out, d_in, minor=count, seed=3)
    drift = torch.randn(*shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    grad = torch.randn(*shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    U_warm = U_full = svd_triplets(W, "full", dtype=torch.float64).U
    S_prev = svd_triplets(W, "full", dtype=torch.float64).S
    for cycle in range(4):  # slowly perturbed across cycles, each warm start from the last warm result
        W = W + 1e-3 * drift * (cycle + 1)
        full = svd_triplets(W, "full", dtype=torch.float64)
        warm = warm_minor_triplets(W, U_warm, count, dtype=torch.float64, seed=cycle)
        assert warm is not None
        assert warm.U.shape == (d_out, d_out) and warm.S.shape == (count,) and warm.V.shape == (d_in, count)
        torch.testing.assert_close(warm.U.mT @ warm.U, torch.eye(d_out, dtype=torch.float64), atol=1e-12, rtol=0)
        torch.testing.assert_close(warm.S, full.S[-count:], atol=1e-12, rtol=0)
        for k in (count, r):  # the minor spans, and the principal one as their complement
            torch.testing.assert_close(projector(warm.U[:, -k:]), projector(full.U[:, -k:]), atol=1e-8, rtol=0)
        torch.testing.assert_close(projector(warm.U[:, :-count]), projector(full.U[:, :-count]), atol=1e-8, rtol=0)
        # the minor right vectors are W's: W v = σ u
        torch.testing.assert_close(W @ warm.V, warm.U[:, -count:] * warm.S, atol=1e-10, rtol=0)
        expected = decide_mode(W, full, U_full, S_prev, grad, r, "full", r_min=2, dtype=torch.float64, exact=True)
        got = decide_mode(W, warm, U_warm, S_prev, grad, r, "full", r_min=2, dtype=torch.float64, exact=True)
        assert got[:2] == expected[:2]
        for key in ("subspace_angle", "principal_alignment", "minor_alignment", "reconstruction_error"):
            assert got[2][key] == pytest.approx(expected[2][key], abs=1e-8), key
        assert got[2]["reason"] == expected[2]["reason"]
        U_warm, U_full, S_prev = warm.U, full.U, full.S


@pytest.mark.parametrize("shape,count", [((160, 48), 6), ((300, 120), 11)])
def test_a_tall_weights_warm_cycles_give_the_full_svds_values_subspaces_and_decisions(shape, count):
    """A tall W (its U does not span the output space): minor triplets from its right vectors' iteration, principal
    basis from W V_p through the Gram matrix; σ, both sides' minor projectors, the principal projector and every
    decision equal a float64 full SVD's over chained, slowly perturbed cycles."""
    m, n = shape
    r = count - 1
    W = known_matrix(m, n, minor=count, seed=80)
    drift = torch.randn(m, n, generator=torch.Generator().manual_seed(81), dtype=torch.float64)
    grad = torch.randn(m, n, generator=torch.Generator().manual_seed(82), dtype=torch.float64)
    first = svd_triplets(W, "full", dtype=torch.float64)
    V_warm, U_warm, U_full, S_prev = first.V, first.U, first.U, first.S
    for cycle in range(4):
        W = W + 1e-3 * drift * (cycle + 1)
        full = svd_triplets(W, "full", dtype=torch.float64)
        warm = warm_tall_triplets(W, V_warm, count, dtype=torch.float64, seed=cycle)
        assert warm is not None
        assert warm.U.shape == (m, n) and warm.S.shape == (count,) and warm.V.shape == (n, n)
        torch.testing.assert_close(warm.U.mT @ warm.U, torch.eye(n, dtype=torch.float64), atol=1e-9, rtol=0)
        torch.testing.assert_close(warm.V.mT @ warm.V, torch.eye(n, dtype=torch.float64), atol=1e-12, rtol=0)
        torch.testing.assert_close(warm.S, full.S[-count:], atol=1e-12, rtol=0)
        for k in (count, r):
            torch.testing.assert_close(projector(warm.U[:, -k:]), projector(full.U[:, -k:]), atol=1e-8, rtol=0)
            torch.testing.assert_close(projector(warm.V[:, -k:]), projector(full.V[:, -k:]), atol=1e-8, rtol=0)
        # the principal left subspace lies in range(W), not in the complement of the minor one
        torch.testing.assert_close(projector(warm.U[:, :-count]), projector(full.U[:, :-count]), atol=1e-8, rtol=0)
        torch.testing.assert_close(W @ warm.V[:, -count:], warm.U[:, -count:] * warm.S, atol=1e-10, rtol=0)
        expected = decide_mode(W, full, U_full, S_prev, grad, r, "full", r_min=2, dtype=torch.float64, exact=True)
        got = decide_mode(W, warm, U_warm, S_prev, grad, r, "full", r_min=2, dtype=torch.float64, exact=True)
        assert got[:2] == expected[:2] and got[2]["reason"] == expected[2]["reason"]
        for key in ("subspace_angle", "principal_alignment", "minor_alignment", "reconstruction_error"):
            assert got[2][key] == pytest.approx(expected[2][key], abs=1e-8), key
        V_warm, U_warm, U_full, S_prev = warm.V, warm.U, full.U, full.S


def test_a_tall_weights_warm_cycle_refuses_what_it_cannot_make_accurate():
    """None where a float32 principal basis from the Gram matrix would not be orthonormal (principal σ near rounding
    of σ_max²), where the right vectors moved to another span, and bad input by name."""
    m, n, count = 160, 48, 6
    gen = torch.Generator().manual_seed(90)
    S = torch.cat([torch.logspace(0, -4, n - count, dtype=torch.float64), torch.full((count,), 1e-5)])
    W = frame(m, 91)[:, :n] * S @ frame(n, 92).mT
    V = svd_triplets(W, "full", dtype=torch.float64).V
    assert warm_tall_triplets(W, V, count, dtype=torch.float64) is not None  # float64 resolves it
    assert warm_tall_triplets(W.float(), V.float(), count) is None
    slow = torch.linspace(2.0, 1.0, n, dtype=torch.float64)  # (σ_count / σ_{b+1})² near 1: only a close start
    W = frame(m, 93)[:, :n] * slow @ frame(n, 94).mT
    assert warm_tall_triplets(W, svd_triplets(W, "full", dtype=torch.float64).V, count, dtype=torch.float64,
                              iterations=1) is not None
    assert warm_tall_triplets(W, frame(n, 95), count, dtype=torch.float64) is None  # another span: gives up
    with pytest.raises(ValueError, match="d_out > d_in"):
        warm_tall_triplets(torch.randn(10, 20, generator=gen), torch.eye(20), 2)
    with pytest.raises(ValueError, match=r"V_prev has shape \(20, 20\), expected \(10, 10\)"):
        warm_tall_triplets(torch.randn(30, 10, generator=gen), torch.eye(20), 2)


@pytest.mark.parametrize("d,c", [(7, 1), (7, 6), (64, 6), (600, 40)])
def test_the_complement_is_the_complete_qrs_trailing_columns(d, c):
    """The principal basis of a warm cycle, from the reflectors' compact WY form: LAPACK's complete QR's trailing
    columns to rounding (float64, fresh orthonormal columns), orthonormal and orthogonal to the minor ones."""
    from plasticity_callbacks.functional.warm_subspace import _complement

    U_minor = frame(d, seed=d + c)[:, :c]
    got = _complement(U_minor)
    want = torch.linalg.qr(U_minor, mode="complete").Q[:, c:]
    torch.testing.assert_close(got, want, atol=1e-13, rtol=0)
    whole = torch.cat([got, U_minor], 1)
    torch.testing.assert_close(whole.mT @ whole, torch.eye(d, dtype=torch.float64), atol=1e-13, rtol=0)
    single = _complement(U_minor.float())
    assert single.dtype == torch.float32
    torch.testing.assert_close(single.double(), want, atol=1e-5, rtol=0)


def test_an_unchanged_matrix_converges_in_one_step_and_a_replaced_one_falls_back():
    n, count = 64, 6
    gen = torch.Generator().manual_seed(7)
    # a slowly decaying spectrum: (σ_count / σ_{b+1})² near 1, so only a close start converges in time
    S = torch.linspace(2.0, 1.0, n, dtype=torch.float64)
    W = frame(n, 8) * S @ frame(n, 9).mT
    U = svd_triplets(W, "full", dtype=torch.float64).U
    assert warm_minor_triplets(W, U, count, dtype=torch.float64, iterations=1) is not None
    replaced = frame(n, 10) * S @ frame(n, 11).mT
    assert warm_minor_triplets(replaced, U, count, dtype=torch.float64) is None
    assert warm_minor_triplets(torch.zeros(n, n, dtype=torch.float64), U, count, dtype=torch.float64) is None
    assert warm_minor_triplets(torch.randn(n, n, generator=gen), U, count=n // 2) is None  # no cheaper than an SVD


def clustered_wide(d_out, d_in, seed):
    """A wide matrix whose smallest σ form a tight cluster (within 15 %), as a 4:1 weight's do, fresh frames."""
    gen = torch.Generator().manual_seed(seed + 200)
    S = torch.cat([1 + torch.rand(d_out - 24, generator=gen, dtype=torch.float64),
                   0.02 * (1 + 0.15 * torch.rand(24, generator=gen, dtype=torch.float64))]).sort(descending=True).values
    return frame(d_out, seed)[:, :d_out] * S @ frame(d_in, seed + 1)[:, :d_out].mT


def test_a_spectrum_start_gives_the_full_svds_triplets_where_the_previous_vectors_are_too_far():
    d_out, d_in, count, r = 64, 160, 6, 5
    W = clustered_wide(d_out, d_in, seed=21)
    drift = torch.randn(d_out, d_in, generator=torch.Generator().manual_seed(22), dtype=torch.float64)
    grad = torch.randn(d_out, d_in, generator=torch.Generator().manual_seed(23), dtype=torch.float64)
    turned = svd_triplets(clustered_wide(d_out, d_in, seed=24), "full", dtype=torch.float64).U  # another minor span
    # the cluster's minor span from an unrelated one: the previous start gives up, the spectrum start converges
    assert warm_minor_triplets(W, turned, count, dtype=torch.float64) is None
    U_warm = U_full = turned
    S_prev = svd_triplets(W, "full", dtype=torch.float64).S
    for cycle in range(3):  # chained, slowly perturbed cycles, each from the spectrum
        W = W + 1e-4 * drift * (cycle + 1)
        full = svd_triplets(W, "full", dtype=torch.float64)
        warm = warm_minor_triplets(W, U_warm if cycle else None, count, dtype=torch.float64, start="spectrum")
        assert warm is not None and warm.U.shape == (d_out, d_out) and warm.V.shape == (d_in, count)
        torch.testing.assert_close(warm.U.mT @ warm.U, torch.eye(d_out, dtype=torch.float64), atol=1e-12, rtol=0)
        torch.testing.assert_close(warm.S, full.S[-count:], atol=1e-12, rtol=0)
        for k in (count, r):
            torch.testing.assert_close(projector(warm.U[:, -k:]), projector(full.U[:, -k:]), atol=1e-8, rtol=0)
        torch.testing.assert_close(W @ warm.V, warm.U[:, -count:] * warm.S, atol=1e-10, rtol=0)
        expected = decide_mode(W, full, U_full, S_prev, grad, r, "full", r_min=2, dtype=torch.float64, exact=True)
        got = decide_mode(W, warm, U_warm, S_prev, grad, r, "full", r_min=2, dtype=torch.float64, exact=True)
        assert got[:2] == expected[:2] and got[2]["reason"] == expected[2]["reason"]
        for key in ("subspace_angle", "principal_alignment", "minor_alignment", "reconstruction_error"):
            assert got[2][key] == pytest.approx(expected[2][key], abs=1e-8), key
        U_warm, U_full, S_prev = warm.U, full.U, full.S


def test_a_spectrum_start_falls_back_where_the_gram_matrix_is_singular():
    d_out, d_in = 48, 120
    assert warm_minor_triplets(torch.zeros(d_out, d_in, dtype=torch.float64), None, 4, dtype=torch.float64,
                               start="spectrum") is None
    low_rank = frame(d_out, 30)[:, :20] @ frame(d_in, 31)[:, :20].mT  # rank 20 < 48: λ_min = 0 up to rounding
    assert warm_minor_triplets(low_rank, None, 4, dtype=torch.float64, start="spectrum") is None
    # a minor block near half the space (block min(4·count, 24) < count + 4): an SVD costs no more
    W = clustered_wide(d_out, d_in, 32)
    assert warm_minor_triplets(W, None, 21, dtype=torch.float64, start="spectrum") is None
    assert warm_minor_triplets(W, None, 20, dtype=torch.float64, start="spectrum") is not None


def test_a_near_tie_at_the_split_takes_the_next_values_in():
    """float32: σ_count and σ_count+1 equal to 1e-6 leave the span of the smallest count unresolvable by any
    float32 method; the warm start returns the smallest count + 1 (a span with a clear gap above), as the SVD has
    them, rather than giving up."""
    d_out, d_in, count = 96, 256, 6
    gen = torch.Generator().manual_seed(70)
    S = torch.cat([1 + torch.rand(d_out - 12, generator=gen, dtype=torch.float64),
                   torch.linspace(0.05, 0.03, 5, dtype=torch.float64),  # the 7th smallest, then a clear gap
                   torch.tensor([0.02 * (1 + 1e-6), 0.02], dtype=torch.float64),  # the 6th and 5th smallest tie
                   torch.linspace(0.015, 0.01, 5, dtype=torch.float64)])
    W = frame(d_out, 71)[:, :d_out] * S @ frame(d_in, 72)[:, :d_out].mT
    full = svd_triplets(W, "full", dtype=torch.float64)
    warm = warm_minor_triplets(W.float(), None, count, start="spectrum")
    assert warm is not None and warm.S.numel() == count + 1 and warm.U.shape == (d_out, d_out)
    torch.testing.assert_close(warm.S.double(), full.S[-count - 1:], atol=1e-6, rtol=0)
    for k in (count + 1, count - 1):  # the returned span, and the decision's smaller ones below the tie
        torch.testing.assert_close(projector(warm.U[:, -k:].double()), projector(full.U[:, -k:]), atol=1e-4, rtol=0)


def test_a_wide_weight_starts_from_its_spectrum_while_its_minor_span_keeps_turning(monkeypatch):
    """The switch's warm cycle for a wide weight: previous vectors, then the spectrum where they give up (counted),
    the spectrum straight away while the span turns, the previous vectors again once it settles; a spectrum start
    that does not converge falls back to the full SVD."""
    d_out, d_in, count = 64, 160, 6
    switch = AdaptiveSVDSwitch(r_min=2, svd={"dtype": "float64"})
    m = switch_cycle.SubspaceMemory(g=d_out)
    starts = []
    real = switch_cycle.warm_minor_triplets
    spectrum_starts = []

    def warm_cycle(m, W, U_prev, count, dtype, step, right_vectors):
        svd, from_spectrum = switch_cycle.warm_triplets(m, W, U_prev, count, dtype, step, right_vectors)
        spectrum_starts.append(from_spectrum)
        return svd

    def recorded(*args, **kwargs):
        starts.append(kwargs["start"])
        return real(*args, **kwargs)
    monkeypatch.setattr(switch_cycle, "warm_minor_triplets", recorded)
    W = clustered_wide(d_out, d_in, seed=41)
    turned = svd_triplets(clustered_wide(d_out, d_in, seed=42), "full", dtype=torch.float64).U
    svd = warm_cycle(m, W, turned, count, torch.float64, step=3, right_vectors=False)
    assert starts == ["previous", "spectrum"] and svd is not None
    assert sum(spectrum_starts) == 1 and m.warm_start == "spectrum"  # the span turned by far more than 1e-2
    torch.testing.assert_close(svd.S, svd_triplets(W, "full", dtype=torch.float64).S[-count:], atol=1e-12, rtol=0)
    starts.clear()
    W = W + 1e-9 * torch.randn(d_out, d_in, generator=torch.Generator().manual_seed(43), dtype=torch.float64)
    again = warm_cycle(m, W, svd.U, count, torch.float64, step=4, right_vectors=False)
    assert starts == ["spectrum"] and again is not None and sum(spectrum_starts) == 2
    assert m.warm_start == "previous"  # it barely moved: the cheaper start next time
    starts.clear()
    # a last spectrum (from a full SVD) whose bottom cluster makes the previous start crawl: spectrum straight away
    m.S_prev = svd_triplets(W, "full", dtype=torch.float64).S
    assert switch_cycle.previous_start_rate(m.S_prev, count - 2) >= 0.5
    warm_cycle(m, W, again.U, count - 2, torch.float64, step=5, right_vectors=False)
    assert starts == ["spectrum"]
    starts.clear()
    m.warm_start, m.S_prev = "previous", svd_triplets(known_matrix(d_out, d_in, 6, 46), "full", dtype=torch.float64).S
    assert switch_cycle.previous_start_rate(m.S_prev, count) < 0.1  # separated minor values: the previous start
    warm_cycle(m, W, again.U, count, torch.float64, step=5, right_vectors=False)
    assert starts[0] == "previous"
    starts.clear()
    square = clustered_wide(d_out, d_in, seed=44)[:, :d_out]  # a square weight never starts from its spectrum
    warm_cycle(m, square, turned, count, torch.float64, step=5, right_vectors=False)
    assert starts == ["previous"]
    monkeypatch.setattr(switch_cycle, "warm_minor_triplets", lambda *args, **kwargs: None)  # neither converges
    monkeypatch.setattr(switch_cycle, "WARM_MIN_ORDER", 0)  # a matrix this small takes the warm path
    W = clustered_wide(d_out, d_in, seed=45)
    m.warm_start, m.r, m.S_prev = "spectrum", 5, svd_triplets(W, "full", dtype=torch.float64).S  # a warm cycle
    fallbacks, cycles = switch.warm_fallbacks, switch.warm_cycles
    m = adaptive_svd._Matrix(target=None, attr="weight", g=d_out, warm_start="spectrum", r=5, S_prev=m.S_prev)
    svd, state, r_next, diag = switch._decide(m, W, None, turned, step=6, warm=True)
    full = svd_triplets(W, "gram", top=d_out - m.r, dtype=torch.float64)
    assert switch.warm_cycles == cycles + 1 and switch.warm_fallbacks == fallbacks + 1  # the full SVD, counted
    assert svd.S.shape == (d_out,)
    torch.testing.assert_close(svd.S, full.S, atol=1e-12, rtol=0)


@pytest.mark.parametrize("d,g,k", [(240, 60, 52), (600, 200, 180)])  # eigvalsh; Lanczos (k > 2·LANCZOS_STEPS)
def test_a_tall_weights_angle_from_its_cosines_matches_the_sine_route(d, g, k):
    """A tall weight's principal subspaces (k columns of a (d, g) basis, no complement to use): at large angles
    the angle is read off the cosines; it must equal the float64 sine-route reference, small angles as well, with
    the extreme eigenvalue from eigvalsh or, for k past 2·LANCZOS_STEPS, from Lanczos."""
    base = frame(d, 50)[:, :g]
    skew = torch.randn(d, d, generator=torch.Generator().manual_seed(51), dtype=torch.float64)
    skew = skew - skew.mT
    for scale in (0.3, 0.05, 0.002, 1e-6):  # the largest angles from ~1 rad down to below the cosine route
        other = torch.linalg.matrix_exp(scale * skew) @ base
        A, B = base[:, :k], other[:, :k]
        sine = float(torch.linalg.matrix_norm(B - A @ (A.mT @ B), 2))
        cosine = float(torch.linalg.svdvals(A.mT @ B).min())
        want = math.atan2(sine, cosine)
        assert subspace_angle(base, other, k, torch.float64) == pytest.approx(want, rel=1e-9, abs=1e-14), scale
        assert subspace_angle(base.float(), other.float(), k) == pytest.approx(want, rel=2e-3, abs=1e-6), scale
        routed = subspace._largest_sine2_estimate((A.mT @ B)) >= subspace.COSINE_ROUTE_SINE2
        assert routed == (scale >= 0.05), scale  # both routes are exercised


def test_a_tall_weights_decisions_over_chained_cycles_match_a_float64_reference():
    """A tall weight keeps the full SVD (gram route, float32) over slowly perturbed cycles; its decisions and
    diagnostics (the angle now from the cosines where it is large) equal those of a float64 SVD."""
    d_out, d_in, r = 160, 40, 5
    W = known_matrix(d_out, d_in, minor=6, seed=60)
    drift = torch.randn(d_out, d_in, generator=torch.Generator().manual_seed(61), dtype=torch.float64)
    grad = torch.randn(d_out, d_in, generator=torch.Generator().manual_seed(62), dtype=torch.float64)
    ref_prev = svd_triplets(W, "full", dtype=torch.float64)
    got_prev = svd_triplets(W.float(), "gram", top=d_in - r)
    for cycle, size in enumerate((0.3, 0.01, 0.3)):  # large and small angles
        W = W + size * drift / torch.linalg.matrix_norm(drift, 2)
        ref = svd_triplets(W, "full", dtype=torch.float64)
        got = svd_triplets(W.float(), "gram", top=d_in - r)
        want = decide_mode(W, ref, ref_prev.U, ref_prev.S, grad, r, "full", r_min=2, dtype=torch.float64, exact=True)
        have = decide_mode(W.float(), got, got_prev.U, got_prev.S, grad.float(), r, "full", r_min=2, exact=True)
        assert have[:2] == want[:2] and have[2]["reason"] == want[2]["reason"]
        for key in ("subspace_angle", "principal_alignment", "minor_alignment", "reconstruction_error"):
            assert have[2][key] == pytest.approx(want[2][key], rel=1e-3, abs=1e-4), (cycle, key)
        ref_prev, got_prev = ref, got


def test_a_weight_with_nan_or_inf_is_refused_and_a_large_finite_one_is_not():
    W = torch.randn(30, 50)
    switch_cycle.require_finite(W * 1e37, "w", 3)  # finite, though its sum would overflow
    for bad in (math.nan, math.inf, -math.inf):
        broken = W.clone()
        broken[7, 11] = bad
        with pytest.raises(FloatingPointError, match="NaN or Inf"):
            switch_cycle.require_finite(broken, "w", 3)


@pytest.mark.parametrize("kwargs,match", [
    (dict(W=torch.randn(20, 10), U_prev=torch.eye(20), count=2), "d_out <= d_in"),
    (dict(W=torch.randn(10, 20), U_prev=torch.eye(20), count=2), "U_prev has shape"),
    (dict(W=torch.randn(10, 20), U_prev=torch.eye(10), count=10), "count=10"),
    (dict(W=torch.randn(10, 20), U_prev=None, count=2), "needs U_prev"),
    (dict(W=torch.randn(10, 20), U_prev=torch.eye(10), count=2, start="cold"), "start='cold'"),
])
def test_bad_input_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        warm_minor_triplets(**kwargs)


def test_tail_energy_rank_matches_the_whole_spectrum_or_says_it_cannot():
    gen = torch.Generator().manual_seed(12)
    for _ in range(50):
        S = (torch.rand(40, generator=gen, dtype=torch.float64) ** 3).sort(descending=True).values
        t = int(torch.randint(1, 40, (), generator=gen))
        got = tail_energy_rank(S[-t:], float((S ** 2).sum()), 40)
        reference = float(torch.searchsorted((S ** 2).cumsum(0), 0.95 * (S ** 2).sum())) + 1
        if math.isnan(got):
            assert reference <= 40 - t
        else:
            assert got == reference


def fit_with_switch(monkeypatch, steps, **options):
    monkeypatch.setattr(switch_cycle, "WARM_MIN_ORDER", 0)  # the tiny model's matrices take the warm path
    torch.manual_seed(0)  # the same model and data in every fit
    module, loader = build("mlp")
    options = {"svd": {"dtype": "float64"}, "minor_training": "project", **options}
    switch = AdaptiveSVDSwitch(schedule=Schedule(every_n_steps=2, start_step=2), r_min=2,
                               thresholds={"clobber_alignment": 0.0}, save_figure=False, **options)
    trainer = cpu_trainer(max_steps=steps, callbacks=[switch])
    trainer.fit(module, loader)
    return switch, trainer, module


@pytest.mark.parametrize("minor_training", ["project", "factorize"])
def test_the_switch_decides_alike_warm_or_full_and_counts_fallbacks(monkeypatch, minor_training):
    warm, trainer, _ = fit_with_switch(monkeypatch, 9, minor_training=minor_training)
    full, *_ = fit_with_switch(monkeypatch, 9, minor_training=minor_training,
                                svd={"dtype": "float64", "warm": False})
    for a, b in zip(warm.matrices, full.matrices):  # the same training either way (B, A: up to a sign per triplet)
        torch.testing.assert_close(a.target.read(), b.target.read(), atol=1e-5, rtol=1e-5)
    assert warm.warm_cycles > warm.warm_fallbacks and full.warm_cycles == 0  # some cycles warm, some may fall back
    assert warm.history == full.history
    assert trainer.callback_metrics["adaptive_svd/warm_fallbacks"] == warm.warm_fallbacks
    monkeypatch.setattr(switch_cycle, "warm_minor_triplets", lambda *args, **kwargs: None)  # never converges
    fallen, trainer, _ = fit_with_switch(monkeypatch, 9, minor_training=minor_training)
    assert fallen.warm_fallbacks == fallen.warm_cycles > 0
    assert trainer.callback_metrics["adaptive_svd/warm_fallbacks"] == fallen.warm_fallbacks
    assert fallen.history == full.history


def test_resume_carries_the_warm_start(monkeypatch):
    switch, _, module = fit_with_switch(monkeypatch, 5)
    switch.matrices[0].warm_start = "spectrum"  # a wide weight's hint, and the run's counts so far
    switch.warm_cycles, switch.warm_fallbacks, switch.warm_spectrum_starts = 7, 2, 3
    resumed = AdaptiveSVDSwitch(minor_training="project", r_min=2, svd={"dtype": "float64"})
    resumed.load_state_dict(switch.state_dict())
    resumed.check_targets(None, module)  # the targets found at setup: the saved U and S apply to them
    assert [m.warm_start for m in resumed.matrices] == ["spectrum"] + ["previous"] * (len(switch.matrices) - 1)
    assert (resumed.warm_cycles, resumed.warm_fallbacks, resumed.warm_spectrum_starts) == (7, 2, 3)
    for old, new in zip(switch.matrices, resumed.matrices):
        torch.testing.assert_close(new.U_prev, old.U_prev)
        torch.testing.assert_close(new.S_prev, old.S_prev, equal_nan=True)
        W = as_matrix(old.target.read().detach())
        cycles = switch.warm_cycles
        expected = switch._decide(old, W, None, old.U_prev, 7, warm=True)
        warmed, cycles = switch.warm_cycles - cycles, resumed.warm_cycles
        got = resumed._decide(new, W, None, new.U_prev, 7, warm=True)
        assert got[1:3] == expected[1:3]
        assert resumed.warm_cycles == cycles + warmed  # a warm cycle where the unbroken run had one
        assert warmed or W.shape[0] > W.shape[1]  # a tall weight's Gram route may resolve it instead
        if W.shape[0] > W.shape[1]:
            torch.testing.assert_close(new.V_prev, old.V_prev)
