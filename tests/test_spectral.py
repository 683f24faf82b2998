"""spectral.orthogonalize, the diagnostics and fire.apply_fire against float64 SVD and hand-built cases."""
import math
import warnings

import pytest
import torch
from torch import nn

from plasticity_callbacks.ops.fire import apply_fire
from plasticity_callbacks.model_map import Selection, declare_plasticity
from plasticity_callbacks.functional.isometry import FIREOptions
from plasticity_callbacks.ops.optimizer_state import leaf_optimizers
from plasticity_callbacks.functional.spectral import (
    POLAR_EXPRESS_COEFFICIENTS, DegenerateMatrixError, PolarOptions, RankDeficientError, choose_method,
    deviation_from_isometry, effective_rank, orthogonalize, polar_express_coefficients, polar_from_gram,
    singular_value_summary, squared_frobenius_error, stable_rank,
)
from tiny import TinyMLPModule, make_optimizer


def exact_polar(W: torch.Tensor, rank: int | None = None) -> torch.Tensor:
    """U_r V_rᵀ from a float64 SVD (the first ``rank`` components, all if None)."""
    U, S, Vh = torch.linalg.svd(W.double(), full_matrices=False)
    r = rank or S.shape[-1]
    return U[..., :r] @ Vh[..., :r, :]


def with_spectrum(m: int, n: int, sigmas: torch.Tensor) -> torch.Tensor:
    U, _ = torch.linalg.qr(torch.randn(m, m, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(n, n, dtype=torch.float64))
    k = sigmas.numel()
    return (U[:, :k] * sigmas) @ V[:, :k].T


def rel(a, b):
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())


MATRICES = {
    "square": lambda: torch.randn(64, 64),
    "tall": lambda: torch.randn(96, 40),
    "wide": lambda: torch.randn(40, 96),
    "ill_conditioned": lambda: with_spectrum(64, 48, torch.logspace(0, -4, 48, dtype=torch.float64)).float(),
}
METHOD_CONFIGS = {  # method, normalize, accepted relative error vs the exact polar factor (tol=1e-5)
    "ns_frobenius": ("newton_schulz", "frobenius", 5e-5),
    "ns_spectral": ("newton_schulz", "spectral", 5e-5),
    "ns_gram": ("newton_schulz", "gram", 5e-5),
    "pe_frobenius": ("polar_express", "frobenius", 5e-5),
    "pe_gram": ("polar_express", "gram", 5e-5),
    "svd": ("svd", None, 1e-5),
    "eigh": ("eigh", None, 1e-5),
    "auto": ("auto", None, 1e-5),
}


@pytest.mark.parametrize("kind", list(MATRICES))
@pytest.mark.parametrize("config", list(METHOD_CONFIGS))
def test_each_method_matches_the_exact_polar_factor(kind, config):
    method, normalize, accepted = METHOD_CONFIGS[config]
    W = MATRICES[kind]()
    Q, info = orthogonalize(W, PolarOptions(method, normalize), return_info=True)
    assert Q.shape == W.shape and Q.dtype == W.dtype
    if kind == "ill_conditioned":  # float32 rounding alone moves the polar factor by ~eps·κ (κ = 1e4)
        accepted = 4e-4
    assert rel(Q, exact_polar(W)) < accepted
    assert float(deviation_from_isometry(Q)) < 1e-6 * min(W.shape)  # DfI ≈ 0 (Σ over min(m,n) σ's)
    assert info.fell_back == 0
    if method in ("newton_schulz", "polar_express"):
        assert 0 < info.iterations < 60 and info.error <= 1e-5


def test_float64_compute_is_near_exact_and_casts_back():
    W = torch.randn(50, 30, dtype=torch.float32)
    Q = orthogonalize(W, PolarOptions("polar_express", tol=1e-12, dtype="float64"))
    assert Q.dtype == torch.float32
    for method in ("newton_schulz", "eigh", "svd"):
        options = PolarOptions(method, tol=1e-12 if method == "newton_schulz" else None, dtype="float64")
        assert rel(orthogonalize(W.double(), options), exact_polar(W)) < 1e-11


def low_rank(m, n, rank, dtype):
    return torch.randn(m, rank, dtype=torch.float64) @ torch.randn(rank, n, dtype=torch.float64)


HARD_MATRICES = {  # the directions FIRE exists to restore are the weak ones: none may be dropped
    "kappa_1e4": lambda: with_spectrum(64, 48, torch.logspace(0, -4, 48, dtype=torch.float64)),
    "kappa_1e8": lambda: with_spectrum(64, 48, torch.logspace(0, -8, 48, dtype=torch.float64)),
    "low_rank_product": lambda: low_rank(64, 48, 10, torch.float64),  # float32 rounding: σ ≈ 1e-7 instead of 0
    "zero_columns": lambda: torch.cat([torch.randn(64, 40, dtype=torch.float64),
                                       torch.zeros(64, 8, dtype=torch.float64)], 1),  # exactly rank 40
    "wide_rank_deficient": lambda: low_rank(30, 70, 12, torch.float64).T.contiguous().T,
}


@pytest.mark.parametrize("kind", list(HARD_MATRICES))
@pytest.mark.parametrize("method", ["newton_schulz", "polar_express", "svd", "eigh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_always_a_full_isometry_and_a_nearest_one(kind, method, dtype, seed):
    torch.manual_seed(seed)
    W = HARD_MATRICES[kind]().to(dtype)
    tol = (1e-5 if dtype == torch.float32 else 1e-11) if method in ("newton_schulz", "polar_express") else None
    Q = orthogonalize(W, PolarOptions(method, tol=tol, dtype=str(dtype).removeprefix("torch.")))
    assert Q.dtype == dtype and torch.isfinite(Q).all()
    assert float(deviation_from_isometry(Q, dtype=torch.float64)) <= (1e-4 if dtype == torch.float32 else 1e-8)
    # Any completion of the null directions is a nearest isometry: ‖W − Q‖² = ‖W‖² − 2Σσ + n for all of
    # them, so compare the distance with the float64 SVD polar factor's, not the factor itself.
    exact = float(squared_frobenius_error(W.double(), exact_polar(W)))
    assert abs(float(squared_frobenius_error(W.double(), Q.double())) - exact) <= 1e-4 * (1 + exact)
    U, S, Vh = torch.linalg.svd(W.double(), full_matrices=False)  # on the well-determined directions: U Vᵀ itself
    strong = S > 1e-3 * S[0]
    mine = (Q.double() @ Vh[strong].T) if W.shape[0] >= W.shape[1] else (Vh[strong] @ Q.double().T).T
    assert rel(mine, U[:, strong]) < (5e-3 if dtype == torch.float32 else 1e-8)


def test_partial_isometry_is_an_explicit_option_of_the_svd_path():
    W = low_rank(64, 48, 10, torch.float64).float()
    Q = orthogonalize(W, PolarOptions("svd", rcond=1e-4))
    assert rel(Q, exact_polar(W, rank=10)) < 1e-4
    assert torch.linalg.matrix_rank(Q.double(), rtol=1e-3) == 10
    with pytest.raises(ValueError, match="rcond"):
        PolarOptions("polar_express", rcond=1e-4)


def test_polar_express_coefficients_equioscillate_on_their_interval():
    l, u = 3e-4, 1.0
    for a, b, c in POLAR_EXPRESS_COEFFICIENTS[:3]:
        a, b, c = a * 1.01, b * 1.01**3, c * 1.01**5  # undo the safety margin
        x = torch.linspace(l, u, 20001, dtype=torch.float64)
        deviation = 1 - (a * x + b * x**3 + c * x**5)
        E = float(deviation.abs().max())
        assert math.isclose(float(deviation[0]), E, rel_tol=1e-6)
        assert math.isclose(float(-deviation[-1]), E, rel_tol=1e-6)
        assert float(deviation.min()) == pytest.approx(-E, rel=1e-4)  # interior extrema reach ±E too
        l, u = 1 - E, 1 + E
    assert POLAR_EXPRESS_COEFFICIENTS[-1] == (15 / 8, -10 / 8, 3 / 8)
    published = polar_express_coefficients(1e-3, safety=1.0)[0]  # the paper's first step, before its own cushioning
    assert all(abs(x - y) / abs(y) < 0.1 for x, y in zip(published, (8.287, -23.596, 17.300)))


def test_exact_zero_rows_stay_zero_in_the_iteration():
    W = torch.randn(40, 24)
    W[[3, 17, 30]] = 0.0  # dead neurons: zero is a fixed point of every odd polynomial
    Q = orthogonalize(W, PolarOptions("polar_express", steps=20))
    assert torch.equal(Q[[3, 17, 30]], torch.zeros(3, 24))
    assert rel(Q, exact_polar(W)) < 1e-4


def test_fixed_iteration_newton_schulz_is_the_reference_code():
    W = torch.randn(80, 32)
    X = W / W.norm()
    for _ in range(5):  # isaac7778/FIRE: Frobenius normalization, cubic step, no epsilon
        X = 1.5 * X - 0.5 * X @ (X.T @ X)
    Q, info = orthogonalize(W, PolarOptions("newton_schulz", "frobenius", steps=5), return_info=True)
    assert torch.allclose(Q, X, atol=1e-6) and info.iterations == 5
    assert float(deviation_from_isometry(Q)) > 1e-3  # 5 steps do not reach an isometry (spec §1)


def test_batched_equals_one_matrix_at_a_time():
    W = torch.randn(3, 2, 20, 12)
    W[1, 0, :, 7:] = 0.0  # exactly rank 7: this slice takes the SVD route, the others do not
    for method in ("polar_express", "eigh", "svd"):
        Q, info = orthogonalize(W, PolarOptions(method), return_info=True)
        assert info.fell_back == (1 if method != "svd" else 0)
        for i in range(3):
            for j in range(2):
                assert float(deviation_from_isometry(Q[i, j])) < 1e-8  # a full isometry, every slice
                if (i, j) != (1, 0):
                    assert rel(Q[i, j], exact_polar(W[i, j])) < 5e-5
        assert rel(Q[1, 0, :, :7], exact_polar(W[1, 0, :, :7])) < 1e-5  # U Vᵀ on the range, completed beyond


def test_zero_matrix_is_skipped_with_a_warning_or_raises():
    with pytest.warns(UserWarning, match="all zero"):
        Q = orthogonalize(torch.zeros(16, 8))
    assert torch.equal(Q, torch.zeros(16, 8))
    with pytest.raises(DegenerateMatrixError):
        orthogonalize(torch.zeros(16, 8), PolarOptions(on_degenerate="raise"))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_slices_are_untouched_and_others_solved(bad):
    W = torch.randn(3, 16, 8)
    W[1, 2, 3] = bad
    with pytest.warns(UserWarning, match="NaN/Inf"):
        Q, info = orthogonalize(W, PolarOptions("polar_express"), return_info=True)
    assert info.skipped == 1
    assert torch.equal(Q[1].isnan(), W[1].isnan()) and torch.isfinite(Q[[0, 2]]).all()
    assert rel(Q[0], exact_polar(W[0])) < 5e-5


def test_invalid_options_name_the_option():
    pe = {"method": "polar_express"}
    for kwargs, name in [({"method": "qr"}, "method"), ({**pe, "normalize": "l1"}, "normalize"),
                         ({"normalize": "gram"}, "normalize='gram'.*iterative"),
                         ({**pe, "normalize": "spectral"}, "spectral"), ({**pe, "tol": 0}, "tol"),
                         ({"tol": 1e-5}, "tol=1e-05 applies to the iterative"), ({**pe, "check_every": 0}, "check_every"),
                         ({**pe, "steps": -1}, "steps=-1"), ({**pe, "max_steps": 2.5}, "max_steps=2.5"),
                         ({**pe, "steps": 5, "max_steps": 9}, "steps=5 is a fixed count"),
                         ({**pe, "steps": 5, "tol": 1e-3}, "give one or the other"),
                         ({"dtype": "float16"}, "dtype"), ({"dtype": torch.float32}, "dtype"),
                         ({"on_degenerate": "ignore"}, "on_degenerate"), ({"rcond": 0.1}, "rcond")]:
        with pytest.raises(ValueError, match=name):
            PolarOptions(**kwargs)
    with pytest.raises(ValueError, match="matrix"):
        orthogonalize(torch.randn(5))
    with pytest.raises(ValueError, match="must be a PolarOptions"):
        orthogonalize(torch.randn(5, 3), {"method": "svd"})


def test_diagnostics_match_their_svd_definitions():
    sigmas = torch.tensor([3.0, 2.0, 0.5, 0.1], dtype=torch.float64)
    W = with_spectrum(10, 4, sigmas)
    s = 1.7
    assert math.isclose(float(deviation_from_isometry(W, s, torch.float64)), float(((sigmas**2 - s**2) ** 2).sum()),
                        rel_tol=1e-9)
    assert math.isclose(float(deviation_from_isometry(W.T, s, torch.float64)),
                        float(((sigmas**2 - s**2) ** 2).sum()), rel_tol=1e-9)  # wide: WWᵀ
    assert math.isclose(float(stable_rank(W)), float((sigmas**2).sum() / 9.0), rel_tol=1e-9)
    p = sigmas / sigmas.sum()
    assert math.isclose(float(effective_rank(W)), float(torch.exp(-(p * p.log()).sum())), rel_tol=1e-9)
    summary = singular_value_summary(W)
    assert math.isclose(summary["condition"], 30.0, rel_tol=1e-6) and math.isclose(summary["sigma_min"], 0.1,
                                                                                    rel_tol=1e-6)
    V = torch.randn(7, 5)
    assert math.isclose(float(squared_frobenius_error(W[:7, :4], V[:, :4])),
                        float((W[:7, :4] - V[:, :4].double()).square().sum()), rel_tol=1e-9)
    assert math.isclose(float(squared_frobenius_error(V, 2 * V, normalized=True)), 1.0, rel_tol=1e-9)


def test_polar_factor_is_the_closest_isometry_and_fire_moves_less_than_a_reinit():
    layer = nn.Linear(48, 32)
    with torch.no_grad():  # a "trained" layer: init plus a low-rank drift
        layer.weight += 0.3 * torch.randn(32, 3) @ torch.randn(3, 48) / math.sqrt(48)
    W = layer.weight.detach().clone()
    Q = orthogonalize(W)
    for _ in range(5):  # orthogonal Procrustes: no other isometry is closer
        R = exact_polar(torch.randn(32, 48)).float()
        assert float(squared_frobenius_error(W, Q)) < float(squared_frobenius_error(W, R))
    model = nn.Sequential(layer, nn.ReLU(), nn.Linear(32, 2))
    record = apply_fire(model)[0]
    fresh = nn.Linear(48, 32)
    assert record.name == "0.weight" and record.sfe < float(squared_frobenius_error(W, fresh.weight))
    assert math.isclose(record.sfe, float(squared_frobenius_error(W, layer.weight)), rel_tol=1e-6)
    assert record.dfi_after < 1e-6 < record.dfi_before


def test_apply_fire_scales_skips_and_touches_only_weights():
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 2))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        model[2].weight.zero_()
    with pytest.warns(UserWarning, match="all zero"):
        records = apply_fire(model, options=FIREOptions(method="svd"))
    assert [r.name for r in records] == ["0.weight", "2.weight"]
    assert records[1].skipped == "zero" and torch.equal(model[2].weight, torch.zeros(16, 32))
    W = model[0].weight.double()
    assert torch.allclose(W.T @ W, 4.0 * torch.eye(8, dtype=torch.float64), atol=1e-5)  # √(32/8)² = 4
    for name in ("0.bias", "2.bias", "4.weight", "4.bias"):  # biases and the head untouched
        assert torch.equal(dict(model.named_parameters())[name], before[name])
    one_d = nn.Parameter(torch.randn(5))
    from plasticity_callbacks.model_map import WeightView
    assert apply_fire(model, targets=[WeightView("v", model, one_d, "other", "matrix")])[0].skipped == "1-D parameter"


def test_apply_fire_on_nan_weight_warns_and_writes_nothing():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    with torch.no_grad():
        model[0].weight[0, 0] = float("nan")
    before = model[0].weight.detach().clone()
    with pytest.warns(UserWarning, match="NaN/Inf"):
        record = apply_fire(model)[0]
    assert record.skipped == "non-finite" and torch.equal(model[0].weight.isnan(), before.isnan())
    with pytest.raises(DegenerateMatrixError):
        apply_fire(model, options=FIREOptions(on_degenerate="raise"))


def test_conv_kernels_are_orthogonalized_per_tap_with_the_reference_scale():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3), nn.Flatten(), nn.Linear(4, 2))
    kernels = [model[0].weight.detach().clone(), model[2].weight.detach().clone()]
    records = apply_fire(model)
    assert [r.name for r in records] == ["0.weight", "2.weight"]
    for conv, W in zip((model[0], model[2]), kernels):
        c_out, c_in = W.shape[:2]
        scale = math.sqrt(c_out / c_in) / 9
        for i in range(3):
            for j in range(3):
                assert rel(conv.weight[:, :, i, j] / scale, exact_polar(W[:, :, i, j])) < 5e-5
    assert all(r.dfi_after < 1e-8 for r in records)


def test_bf16_weights_stay_bf16_and_close_to_the_polar_factor():
    model = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 2)).to(torch.bfloat16)
    W = model[0].weight.detach().clone()
    record = apply_fire(model)[0]
    assert model[0].weight.dtype == torch.bfloat16 and torch.isfinite(model[0].weight).all()
    assert rel(model[0].weight.float() / record.scale, exact_polar(W.float())) < 1e-2


def test_gpt_at_init_skips_zero_projections_without_nan():
    from plasticity_callbacks.models import GPT, GPTConfig

    model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, n_kv_head=2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        records = apply_fire(model, selection=Selection(scope="attention"))
    skipped = sorted(r.name for r in records if r.skipped)
    assert skipped == ["blocks.0.attn.c_proj.weight", "blocks.1.attn.c_proj.weight"]
    assert sum("all zero" in str(w.message) for w in caught) == 2
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert all(r.dfi_after < 1e-8 for r in records if not r.skipped)


@pytest.mark.parametrize("optimizer", ["adamw", "muon", "sgd"])
def test_optimizer_reset_touches_exactly_the_fired_parameters(optimizer):
    module = TinyMLPModule(optimizer=optimizer)
    opt = make_optimizer(module, optimizer, lr=1e-2)
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    for _ in range(2):
        opt.zero_grad()
        torch.nn.functional.mse_loss(module(x), y).backward()
        opt.step()
    leaves = list(leaf_optimizers(opt))
    states = {p: {k: v.clone() if torch.is_tensor(v) else v for k, v in o.state[p].items()}
              for o in leaves for p in o.state}
    assert len(states) == len(list(module.parameters()))
    records = apply_fire(module, opt)
    fired = {id(t) for t in (module.net[0].weight, module.net[2].weight)}
    assert {r.name for r in records} == {"net.0.weight", "net.2.weight"}
    for p, old in states.items():
        owner = next(o for o in leaves if any(q is p for g in o.param_groups for q in g["params"]))
        if id(p) in fired:
            assert p not in owner.state
        else:
            assert set(owner.state[p]) == set(old)
            assert all(torch.equal(owner.state[p][k], v) if torch.is_tensor(v) else owner.state[p][k] == v
                       for k, v in old.items())
    opt.zero_grad()
    torch.nn.functional.mse_loss(module(x), y).backward()
    opt.step()  # the optimizer takes the reset parameters as new
    assert all(p in o.state for o in leaves for g in o.param_groups for p in g["params"])


@pytest.mark.parametrize("method", ["newton_schulz", "polar_express", "svd", "eigh"])
@pytest.mark.parametrize("magnitude", [1e-25, 1e-15, 1e15, 1e20])
def test_polar_factor_is_scale_invariant_at_extreme_magnitudes(method, magnitude):
    W = torch.randn(48, 32)
    for normalize in ((None,) if method in ("svd", "eigh") else ("frobenius", "gram")):
        Q = orthogonalize(W * magnitude, PolarOptions(method, normalize))
        assert torch.isfinite(Q).all() and rel(Q, exact_polar(W)) < 5e-5


@pytest.mark.parametrize("magnitude", [1e-25, 1e20])
def test_apply_fire_really_orthogonalizes_tiny_and_huge_weights(magnitude):
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))
    with torch.no_grad():
        model[0].weight.mul_(magnitude)
    W = model[0].weight.detach().clone()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing may be skipped
        record = apply_fire(model)[0]
    assert record.skipped is None and math.isfinite(record.dfi_before) and record.dfi_after < 1e-8
    assert rel(model[0].weight / math.sqrt(2), exact_polar(W)) < 5e-5
    assert math.isclose(record.sfe, float(squared_frobenius_error(W, model[0].weight)), rel_tol=1e-6)


@pytest.mark.parametrize("scale", [float("inf"), float("nan"), 0.0, -1.0, True])
def test_apply_fire_refuses_a_scale_that_is_not_a_positive_finite_number(scale):
    with pytest.raises(ValueError, match="scale"):
        FIREOptions(scale=scale)


@pytest.mark.parametrize("method", ["newton_schulz", "polar_express", "svd", "eigh", "auto"])
def test_apply_fire_restores_weak_directions_of_a_trained_like_layer(method):
    """A Gaussian layer whose input directions were damped down to 1e-2 (condition number ~1e4):
    every direction comes back at the target scale, and the result is the nearest isometry."""
    layer = nn.Linear(256, 256, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(256, 256) * torch.logspace(0, -2, 256))
    W = layer.weight.detach().clone()
    record = apply_fire(nn.Sequential(layer, nn.ReLU(), nn.Linear(256, 2)), options=FIREOptions(method=method))[0]
    assert record.dfi_after < 1e-4 and record.fell_back == 0
    S = torch.linalg.svdvals(layer.weight.detach().double())
    assert float((S - 1).abs().max()) < 1e-3  # no direction dropped or left short
    exact = float(squared_frobenius_error(W.double(), exact_polar(W)))
    assert abs(float(squared_frobenius_error(W, layer.weight)) - exact) <= 1e-4 * exact


# ------------------------------------------------------------------------ polar_from_gram (row-split W)


def gram64(W: torch.Tensor) -> torch.Tensor:
    X = W.double()
    return X.mT @ X


GRAM_MATRICES = {
    "square": lambda: torch.randn(80, 80, dtype=torch.float64),
    "tall": lambda: torch.randn(120, 48, dtype=torch.float64),
    "wide": lambda: torch.randn(36, 90, dtype=torch.float64),
    "ill_conditioned": lambda: with_spectrum(70, 50, torch.logspace(0, -5, 50, dtype=torch.float64)),
}


@pytest.mark.parametrize("kind", list(GRAM_MATRICES))
def test_polar_from_gram_of_row_shards_assembles_the_svd_polar_factor(kind):
    W = GRAM_MATRICES[kind]()
    cuts = sorted(torch.randperm(W.shape[0] - 1)[:2].add(1).tolist())
    shards = [W[:cuts[0]], W[cuts[0]:cuts[1]], W[cuts[1]:]]
    G = sum(gram64(s) for s in shards)  # what an all-reduce of each shard's Gram matrix gives
    Q = torch.cat([polar_from_gram(s, G, total_rows=W.shape[0]) for s in shards])
    assert Q.dtype == torch.float64 and Q.shape == W.shape
    accepted = 1e-6 if kind == "ill_conditioned" else 1e-10  # a float64 Gram: exact up to ~eps·κ² (κ = 1e5)
    assert rel(Q, exact_polar(W)) < accepted


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_polar_from_gram_keeps_the_dtype_of_the_rows(dtype):
    W = torch.randn(64, 32).to(dtype)
    Q = polar_from_gram(W, gram64(W))
    assert Q.dtype == dtype
    accepted = 1e-5 if dtype == torch.float32 else 1e-2  # the cast back to bfloat16 alone is ~4e-3
    assert rel(Q, exact_polar(W)) < accepted
    assert float((Q.double().mT @ Q.double() - torch.eye(32, dtype=torch.float64)).abs().max()) < 50 * accepted


def test_polar_from_gram_of_a_batch_equals_one_matrix_at_a_time():
    W = torch.randn(3, 40, 24, dtype=torch.float64)
    Q = polar_from_gram(W, gram64(W))
    for i in range(3):
        assert torch.allclose(Q[i], polar_from_gram(W[i], gram64(W[i])), atol=1e-12)
        assert rel(Q[i], exact_polar(W[i])) < 1e-10


def test_polar_from_gram_refuses_rank_deficiency_or_returns_the_partial_isometry():
    W = low_rank(60, 30, 20, torch.float64)
    with pytest.raises(RankDeficientError, match="rank 20 < min\\(m, n\\) = 30.*orthogonalize.*partial=True"):
        polar_from_gram(W, gram64(W))
    Q = polar_from_gram(W, gram64(W), partial=True)
    assert rel(Q, exact_polar(W, rank=20)) < 1e-9  # U_r V_rᵀ: the null directions map to zero
    # A shard that holds fewer rows than n is fine when the whole W has full column rank.
    W = torch.randn(60, 30, dtype=torch.float64)
    assert rel(polar_from_gram(W[:10], gram64(W), total_rows=60), exact_polar(W)[:10]) < 1e-10
    with pytest.raises(RankDeficientError, match="rank 10 < min"):  # a shard's own Gram, not the all-reduced one
        polar_from_gram(W[:10], gram64(W[:10]), total_rows=60)
    assert rel(polar_from_gram(W[:10], gram64(W[:10])), exact_polar(W[:10])) < 1e-10  # 10 rows alone: a wide W


@pytest.mark.parametrize("bad", [0.0, math.nan, math.inf])
def test_polar_from_gram_refuses_a_zero_or_non_finite_gram(bad):
    W = torch.randn(20, 10, dtype=torch.float64)
    G = torch.zeros(10, 10, dtype=torch.float64) if bad == 0.0 else gram64(W).index_fill(0, torch.tensor([3]), bad)
    with pytest.raises(DegenerateMatrixError, match="zero or has NaN/Inf"):
        polar_from_gram(W, G)


def test_polar_from_gram_names_bad_arguments():
    W = torch.randn(20, 10)
    with pytest.raises(ValueError, match="rows \\(..., r, n\\) and gram"):
        polar_from_gram(W, torch.eye(9))
    with pytest.raises(ValueError, match="total_rows=5"):
        polar_from_gram(W, gram64(W), total_rows=5)
    with pytest.raises(ValueError, match="rcond=2"):
        polar_from_gram(W, gram64(W), rcond=2)


# ------------------------------------------------------------------------ method choice and adaptive schedule


def test_auto_picks_eigh_for_oblong_float32_on_cpu_svd_otherwise_and_polar_express_on_gpu():
    assert choose_method((3072, 768), "cpu", torch.float32) == "eigh"
    assert choose_method((4, 768, 3072), "cpu", torch.float32) == "eigh"  # wide, batched: the shape counts
    assert choose_method((768, 768), "cpu", torch.float32) == "svd"
    assert choose_method((3072, 768), "cpu", torch.float64) == "svd"  # eigh's eps64·κ² loses to SVD in float64
    assert choose_method((768, 768), "cuda", torch.float32) == "polar_express"
    _, info = orthogonalize(torch.randn(90, 30), return_info=True)
    assert info.method == "eigh" and info.iterations == 0


@pytest.mark.parametrize("decades", [2, 5])
def test_polar_express_schedule_is_fitted_to_the_smallest_singular_value(decades):
    """The schedule's lower bound follows σ_min of the normalized matrix (not a fixed 3e-4), so a well
    conditioned matrix takes fewer steps and an ill-conditioned one is not run on a bound above its σ_min."""
    sigmas = torch.logspace(0, -decades, 96, dtype=torch.float64)
    W = with_spectrum(96, 96, sigmas).float()
    Q, info = orthogonalize(W, PolarOptions("polar_express"), return_info=True)
    ratio = 10.0 ** -decades  # σ_min/σ_max; the normalization bound is within 2x of σ_max here
    assert ratio / 8 <= info.lower <= ratio
    assert info.fell_back == 0 and info.iterations <= (6 if decades == 2 else 11)
    assert rel(Q, exact_polar(W)) < 5e-5 * 10 ** max(0, decades - 3)  # float32: ~eps·κ


def test_slices_of_a_batch_get_their_own_schedule():
    good = with_spectrum(48, 48, torch.logspace(0, -1, 48, dtype=torch.float64)).float()
    bad = with_spectrum(48, 48, torch.logspace(0, -5, 48, dtype=torch.float64)).float()
    _, alone = orthogonalize(good, PolarOptions("polar_express"), return_info=True)
    Q, batch = orthogonalize(torch.stack([good, bad]), PolarOptions("polar_express"), return_info=True)
    assert batch.lower <= 1e-5 < alone.lower  # the batch's smallest bound is the ill-conditioned slice's
    assert rel(Q[0], exact_polar(good)) < 5e-6  # the well-conditioned slice is not run on the tiny bound's
    assert rel(Q[1], exact_polar(bad)) < 5e-3   # huge first coefficients (float32 rounding × κ)


def test_svd_that_fails_to_converge_in_float32_is_retried_in_float64(monkeypatch):
    """LAPACK's divide-and-conquer SVD can fail on clustered singular values (a weight FIRE already made
    a near-isometry); the polar factor then comes from a float64 SVD instead of an exception."""
    svd = torch.linalg.svd

    def flaky(X, *args, **kwargs):
        if X.dtype == torch.float32:
            raise torch.linalg.LinAlgError("linalg.svd: The algorithm failed to converge")
        return svd(X, *args, **kwargs)

    monkeypatch.setattr(torch.linalg, "svd", flaky)
    W = torch.randn(40, 40)
    Q = orthogonalize(W, PolarOptions("svd"))
    assert Q.dtype == torch.float32 and rel(Q, exact_polar(W)) < 1e-6


# ------------------------------------------------------------------------ the fast exact routes and their diagnostics


def eigh_dtypes(monkeypatch) -> list:
    """Record the dtype of every Gram matrix ``torch.linalg.eigh`` is given."""
    seen, eigh = [], torch.linalg.eigh

    def recording(A, *args, **kwargs):
        seen.append(A.dtype)
        return eigh(A, *args, **kwargs)

    monkeypatch.setattr(torch.linalg, "eigh", recording)
    return seen


@pytest.mark.parametrize("seed", [0, 1])
def test_eigh_takes_the_float32_gram_only_where_its_error_is_a_float32_svds(monkeypatch, seed):
    """4:1 Gaussian (κ ≈ 3): float32 Gram and eigh, as accurate as a float32 SVD; κ = 30: float64 Gram."""
    torch.manual_seed(seed)
    dtypes = eigh_dtypes(monkeypatch)
    kappa_30 = with_spectrum(512, 128, torch.logspace(0, -1.5, 128, dtype=torch.float64)).float()
    for W, route in [(torch.randn(1024, 256), torch.float32), (torch.randn(256, 1024), torch.float32),
                     (kappa_30, torch.float64)]:
        dtypes.clear()
        Q, info = orthogonalize(W, return_info=True)
        U, _, Vh = torch.linalg.svd(W, full_matrices=False)
        assert info.method == "eigh" and dtypes == [route]
        assert rel(Q, exact_polar(W)) <= 2 * rel(U @ Vh, exact_polar(W)) + 1e-6
        assert float(deviation_from_isometry(Q, dtype=torch.float64)) < 1e-8


def test_eigh_checks_a_wrong_condition_estimate_on_the_exact_eigenvalues(monkeypatch):
    """The Lanczos estimate of κ² is from below; were it far off, the float32 eigenvalues still catch it."""
    import plasticity_callbacks.functional.spectral as spectral

    monkeypatch.setattr(spectral, "_condition_squared_estimate", lambda G, bad: torch.ones(G.shape[:-2]))
    dtypes = eigh_dtypes(monkeypatch)
    W = with_spectrum(400, 100, torch.logspace(0, -3, 100, dtype=torch.float64)).float()  # κ = 1e3
    Q = orthogonalize(W, PolarOptions("eigh"))
    assert dtypes == [torch.float32, torch.float64]  # tried, rejected, redone in float64
    U, _, Vh = torch.linalg.svd(W, full_matrices=False)
    assert rel(Q, exact_polar(W)) <= 2 * rel(U @ Vh, exact_polar(W))


@pytest.mark.parametrize("method", ["svd", "eigh"])
@pytest.mark.parametrize("shape", [(96, 96), (160, 40), (40, 160), (3, 90, 30)])
@pytest.mark.parametrize("magnitude", [1e-25, 1.0, 1e20])
def test_exact_methods_return_the_singular_values_they_computed(method, shape, magnitude):
    W = torch.randn(*shape) * magnitude
    W[..., :, 0] = 0.0  # rank-deficient: a zero singular value, to the SVD answer for eigh
    _, info = orthogonalize(W, PolarOptions(method), return_info=True)
    exact = torch.linalg.svdvals(W.double()).flip(-1)  # ascending
    assert info.singular_values.shape == exact.shape and info.singular_values.dtype == torch.float64
    assert float((info.singular_values - exact).abs().max()) <= 1e-5 * float(exact.max())
    assert orthogonalize(W, PolarOptions("polar_express"), return_info=True)[1].singular_values is None


@pytest.mark.parametrize("method", ["auto", "svd", "eigh"])
@pytest.mark.parametrize("shape", [(128, 128), (256, 64), (64, 256)])
def test_fire_diagnostics_of_an_exact_method_need_no_gram_matrix(monkeypatch, method, shape):
    """DfI before from the solver's singular values, SFE from one difference, DfI after from probes: each
    equal to its float64 definition, and no Gram matrix of the weight is formed for them."""
    import plasticity_callbacks.functional.isometry as isometry
    from plasticity_callbacks.functional.isometry import fire_matrix

    W = torch.randn(*shape) * torch.logspace(0, -1, shape[1])  # spread singular values: DfI well above 0
    param = W.clone()
    monkeypatch.setattr(isometry, "deviation_from_isometry", lambda *a, **k: pytest.fail("a Gram matrix for DfI"))
    record = fire_matrix("w", param, FIREOptions(method=method))
    s = math.sqrt(shape[0] / shape[1])
    assert math.isclose(record.dfi_before, float(deviation_from_isometry(W.double(), s, torch.float64)), rel_tol=1e-5)
    assert math.isclose(record.sfe, float(squared_frobenius_error(W, param)), rel_tol=1e-6)
    assert math.isclose(record.sfe_normalized, record.sfe / float(W.double().square().sum()), rel_tol=1e-6)
    assert 0 <= record.dfi_after < 1e-8 and rel(param / s, exact_polar(W)) < 1e-5


def test_estimated_deviation_from_isometry_is_unbiased():
    from plasticity_callbacks.functional.spectral import estimated_deviation_from_isometry

    for W in (torch.randn(200, 50, dtype=torch.float64), torch.randn(2, 30, 90, dtype=torch.float64)):
        exact = deviation_from_isometry(W, 1.5, torch.float64)
        estimate = estimated_deviation_from_isometry(W, 1.5, probes=400)
        assert torch.allclose(estimate, exact, rtol=0.25)
    Q = exact_polar(torch.randn(300, 100)).float()
    assert float(estimated_deviation_from_isometry(Q)) < 1e-9  # a float32 isometry: rounding only


def test_apply_fire_on_several_threads_equals_one_thread_and_restores_the_count():
    """On CPU with T threads the weights are solved T at a time; the result, the records and their order,
    the warnings and the thread count afterwards are those of one thread."""
    def model():
        torch.manual_seed(0)
        layers = [nn.Linear(48, 48), nn.Linear(48, 192), nn.Linear(192, 48), nn.Conv2d(4, 8, 3), nn.Linear(48, 2)]
        with torch.no_grad():
            layers[1].weight.zero_()
        net = nn.Sequential(*layers)  # no input runs through it: each matrix declared whole
        declare_plasticity(net, fused={"0.weight": [48], "1.weight": [192], "2.weight": [48]})
        return net

    threads = torch.get_num_threads()
    results = []
    for count in (1, 3):
        torch.set_num_threads(count)
        try:
            net = model()
            with pytest.warns(UserWarning, match="1.weight is all zero"):
                records = apply_fire(net, selection=Selection(exclude=("4.*",)))
            assert torch.get_num_threads() == count
            results.append((net, records))
        finally:
            torch.set_num_threads(threads)
    (one, one_records), (many, many_records) = results
    assert [r.name for r in many_records] == [r.name for r in one_records] == ["0.weight", "1.weight", "2.weight",
                                                                                "3.weight"]
    for a, b in zip(one.parameters(), many.parameters()):
        assert torch.allclose(a, b, atol=1e-6)
    assert [r.skipped for r in many_records] == [None, "zero", None, None]


def test_apply_fire_on_several_threads_restores_the_count_when_a_weight_raises():
    net = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 2))
    with torch.no_grad():
        net[1].weight[0, 0] = float("nan")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with pytest.raises(DegenerateMatrixError, match="1.weight contains NaN"):
            apply_fire(net, options=FIREOptions(on_degenerate="raise"))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
