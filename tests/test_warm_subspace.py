"""Warm-started minor triplets against the full SVD (float64, matrices with known subspaces), and the switch's
warm cycle: the same decisions, the fallback counted, resume."""
import math

import pytest
import torch

from plasticity_callbacks import AdaptiveSVDSwitch
from plasticity_callbacks.callbacks import adaptive_svd
from plasticity_callbacks.callbacks.schedule import Schedule
from plasticity_callbacks.functional.subspace import as_matrix, decide_mode, svd_triplets, tail_energy_rank
from plasticity_callbacks.functional.warm_subspace import warm_minor_triplets
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


@pytest.mark.parametrize("kwargs,match", [
    (dict(W=torch.randn(20, 10), U_prev=torch.eye(20), count=2), "d_out <= d_in"),
    (dict(W=torch.randn(10, 20), U_prev=torch.eye(20), count=2), "U_prev has shape"),
    (dict(W=torch.randn(10, 20), U_prev=torch.eye(10), count=10), "count=10"),
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
    monkeypatch.setattr(adaptive_svd, "WARM_MIN_ORDER", 0)  # the tiny model's matrices take the warm path
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
    monkeypatch.setattr(adaptive_svd, "warm_minor_triplets", lambda *args, **kwargs: None)  # never converges
    fallen, trainer, _ = fit_with_switch(monkeypatch, 9, minor_training=minor_training)
    assert fallen.warm_fallbacks == fallen.warm_cycles > 0
    assert trainer.callback_metrics["adaptive_svd/warm_fallbacks"] == fallen.warm_fallbacks
    assert fallen.history == full.history


def test_resume_carries_the_warm_start(monkeypatch):
    switch, _, module = fit_with_switch(monkeypatch, 5)
    resumed = AdaptiveSVDSwitch(minor_training="project", r_min=2, svd={"dtype": "float64"})
    resumed.load_state_dict(switch.state_dict())
    resumed.check_targets(None, module)  # the targets found at setup: the saved U and S apply to them
    for old, new in zip(switch.matrices, resumed.matrices):
        torch.testing.assert_close(new.U_prev, old.U_prev)
        torch.testing.assert_close(new.S_prev, old.S_prev, equal_nan=True)
        W = as_matrix(old.target.read().detach())
        expected = switch._decide(old, W, None, old.U_prev, 7, warm=True)
        cycles = resumed.warm_cycles
        got = resumed._decide(new, W, None, new.U_prev, 7, warm=True)
        assert got[1:3] == expected[1:3]
        assert resumed.warm_cycles == cycles + (W.shape[0] <= W.shape[1])
