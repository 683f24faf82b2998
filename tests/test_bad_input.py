"""Bad input for every callback and every pure function.

1. Every constructor argument is validated up front: a ValueError that names the argument and says
   what is allowed (a number typed as a string, as Hydra passes ``alpha=abc``, included; not a
   TypeError from a comparison deep inside).
2. An empty target set fails in ``setup``/``on_fit_start`` with a ValueError, never silently.
3. Degenerate tensors (zero, rank-1, 1×N / N×1, huge aspect ratios, tiny and huge magnitudes,
   fp16/bf16) through the math modules: no NaN from finite input, documented invariants hold
   (orthonormal singular vectors, cosines in [-1, 1], factors in their ranges, output unchanged
   when dead neurons are recycled); NaN/Inf input gives NaN out or a ValueError / LinAlgError,
   never a crash from an unrelated place.
"""
from __future__ import annotations

import re
import math
import warnings
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch import nn

from plasticity_callbacks.ops import factorization
from plasticity_callbacks.functional import dormancy, shrink, spectral, subspace

from tiny import TinyMLPModule, recycle

FAST = settings(max_examples=25, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])

# ------------------------------------------------------------------ 1. constructor arguments
# (callback, kwargs, the argument the message must name)
BAD_ARGUMENTS = [
    ("ReDoMonitor", dict(tau=-0.1), "tau"),
    ("ReDoMonitor", dict(tau=1.5), "tau"),
    ("ReDoMonitor", dict(tau="0.1"), "tau"),
    ("ReDoMonitor", dict(collect_every_n_steps=0), "collect_every_n_steps"),
    ("ReDoMonitor", dict(log_every_n_steps=-1), "log_every_n_steps"),
    ("ReDoMonitor", dict(ema_decay=1.0), "ema_decay"),
    ("ReDoMonitor", dict(schedule={"every_n_steps": -100}), "every_n_steps"),
    ("ReDoMonitor", dict(schedule={"every_n_steps": True}), "every_n_steps"),
    ("ReDoMonitor", dict(schedule={"steps": [1], "start_step": -1}), "start_step"),
    ("ReDoMonitor", dict(schedule={"steps": [1], "start_step": 10, "end_step": 5}), "end_step"),
    ("ReDoMonitor", dict(schedule={"at_fit_start": True}), "at_fit_start"),
    ("ReDoMonitor", dict(schedule="every 100 steps"), "schedule"),
    ("ReDoMonitor", dict(init="kaiming"), "init"),
    ("ReDoMonitor", dict(selection={"exclude": "blocks.*"}), "exclude"),
    ("ReDoMonitor", dict(layer_map={}), "layer_map"),
    ("ReDoMonitor", dict(seed="zero"), "seed"),
    ("DASHPeriodic", dict(schedule={"every_n_steps": 0}), "every_n_steps"),
    ("DASHPeriodic", dict(schedule={"every_n_steps": -2000}), "every_n_steps"),
    ("DASHPeriodic", dict(schedule={"every_n_steps": True}), "every_n_steps"),
    ("DASHPeriodic", dict(cosine_threshold=1.5), "cosine_threshold"),
    ("DASHPeriodic", dict(cosine_threshold="0.05"), "cosine_threshold"),
    ("DASHPeriodic", dict(shrink_rate=-0.1), "shrink_rate"),
    ("DASHPeriodic", dict(min_factor=1.5), "min_factor"),
    ("DASHPeriodic", dict(min_factor=None), "min_factor"),
    ("DASHShrink", dict(min_factor=-0.1), "min_factor"),
    ("DASHShrink", dict(min_factor="0.3"), "min_factor"),
    ("DASHShrink", dict(gradient_ema_weight=0.0), "gradient_ema_weight"),
    ("DASHShrink", dict(n_batches=0), "n_batches"),
    ("DASHShrink", dict(selection=dict(scope="attn")), "scope"),
    ("DASHShrink", dict(schedule={"epochs": [-1]}), "epochs"),
    ("DASHShrink", dict(schedule={"epochs": 5}), "epochs"),
    ("DASHPeriodic", dict(schedule={"epochs": [2]}), "epochs"),
    ("DASHShrink", dict(schedule={"at_fit_start": False}), "at_fit_start"),
    ("DASHShrink", dict(schedule={"at_start": True}), "at_start"),
    ("DASHShrink", dict(selection=dict(include="blocks.*")), "include"),
    ("AdaptiveSVDSwitch", dict(minor_training="svd"), "minor_training"),
    ("AdaptiveSVDSwitch", dict(schedule={"every_n_steps": 0}), "every_n_steps"),
    ("AdaptiveSVDSwitch", dict(schedule={"at_fit_start": True}), "only at steps"),
    ("AdaptiveSVDSwitch", dict(schedule={"steps": [1], "start_step": -1}), "start_step"),
    ("AdaptiveSVDSwitch", dict(r_min=0), "r_min"),
    ("AdaptiveSVDSwitch", dict(initial_rank=0), "initial_rank"),
    ("AdaptiveSVDSwitch", dict(svd={"niter": -1}), "niter"),
    ("AdaptiveSVDSwitch", dict(selection=dict(scope="everything")), "scope"),
    ("AdaptiveSVDSwitch", dict(thresholds={"clobber_alignment": 1.5}), "clobber_alignment"),
    ("AdaptiveSVDSwitch", dict(thresholds={"clobber_alignment": "0.4"}), "clobber_alignment"),
    ("AdaptiveSVDSwitch", dict(thresholds={"safe_minor_alignment": -0.1}), "safe_minor_alignment"),
    ("AdaptiveSVDSwitch", dict(thresholds={"max_reconstruction_error": 2.0}), "max_reconstruction_error"),
    ("AdaptiveSVDSwitch", dict(thresholds={"stable_angle": -0.1}), "stable_angle"),
    ("AdaptiveSVDSwitch", dict(thresholds={"stable_angle": 2.0}), "stable_angle"),
    ("AdaptiveSVDSwitch", dict(svd={"method": "qr"}), "method"),
    ("AdaptiveSVDSwitch", dict(svd={"dtype": "float16"}), "dtype"),
    ("AdaptiveSVDSwitch", dict(selection=dict(include="blocks.*")), "include"),
    ("ShrinkPerturb", dict(shrink=-0.1), "shrink"),
    ("ShrinkPerturb", dict(shrink=1.1), "shrink"),
    ("ShrinkPerturb", dict(shrink="0.5"), "shrink"),
    ("ShrinkPerturb", dict(perturb=-1.0), "perturb"),
    ("ShrinkPerturb", dict(selection=dict(include="blocks.*")), "include"),
    ("ShrinkPerturb", dict(reset_optimizer="yes"), "reset_optimizer"),
    ("ShrinkPerturb", dict(seed=1.5), "seed"),
]
FIRE_CASES = [
    ("FIREReinit", dict(schedule={"steps": [-1]}), "steps"),
    ("FIREReinit", dict(schedule={"every_n_epochs": 0}), "every_n_epochs"),
    ("FIREReinit", dict(schedule={"monitor": "val/loss", "patience": 0}), "patience"),
    ("FIREReinit", dict(schedule={"monitor": "val/loss", "mode": "up"}), "mode"),
    ("FIREReinit", dict(schedule={"monitor": "val/loss", "min_delta": -1}), "min_delta"),
    ("FIREReinit", dict(schedule={"monitor": "val/loss", "min_delta": "0.1"}), "min_delta"),
    ("FIREReinit", dict(schedule={"at_fit_start": False}), "at_fit_start"),
    ("FIREReinit", dict(selection=dict(scope="heads")), "scope"),
    ("FIREReinit", dict(options={"normalize": "l2"}), "normalize"),
    ("FIREReinit", dict(options={"dtype": "float16"}), "dtype"),
    ("FIREReinit", dict(options={"tol": 0}), "tol"),
    ("FIREReinit", dict(options={"method": "polar_express", "max_steps": -1}), "max_steps"),
    ("FIREReinit", dict(options={"method": "qr"}), "method"),
    ("FIREReinit", dict(options={"scale": "big"}), "scale"),
    ("FIREReinit", dict(options={"on_degenerate": "ignore"}), "on_degenerate"),
    ("FIREReinit", dict(options={"check_every": True}), "check_every"),
    ("FIREReinit", dict(options={"reset_optimizer": "yes"}), "reset_optimizer"),
    ("FIREReinit", dict(options=5), "options"),
    ("FIREReinit", dict(options={"scale": float("inf")}), "scale"),
    ("FIREReinit", dict(rewarmup_steps=-1), "rewarmup_steps"),
    ("FIREReinit", dict(selection=dict(include="blocks.*")), "include"),
    ("ShrinkPerturb", dict(schedule={"every_n_steps": 0}), "every_n_steps"),
]


def _callback(name: str):
    import plasticity_callbacks

    return getattr(plasticity_callbacks, name)


@pytest.mark.parametrize("name,kwargs,arg", BAD_ARGUMENTS + FIRE_CASES,
                         ids=[f"{n}-{'-'.join(f'{k}={v!r}' for k, v in kw.items())}" for n, kw, _ in BAD_ARGUMENTS + FIRE_CASES])
def test_bad_constructor_argument_gives_a_value_error_naming_it(name, kwargs, arg):
    with pytest.raises(ValueError) as err:
        _callback(name)(**kwargs)
    message = str(err.value)
    assert arg in message, message
    assert any(hint in message for hint in ("must", "one of", "needs", "applies", "set ", "[", "(")), message


def _fake_trainer(module: nn.Module):
    optimizer = torch.optim.AdamW(module.parameters())
    return SimpleNamespace(strategy=SingleDeviceStrategy(torch.device("cpu")), optimizers=[optimizer],
                           global_step=0, world_size=1, global_rank=0, logger=None)


EMPTY_SELECTIONS = [
    ("ReDoMonitor", dict(selection={"exclude": ["*"]}), "setup"),
    ("DASHShrink", dict(selection=dict(include=["no_such_layer.*"])), "on_fit_start"),
    ("DASHShrink", dict(selection=dict(scope="attention")), "on_fit_start"),  # the MLP declares no attention
    ("AdaptiveSVDSwitch", dict(selection=dict(exclude=["*"])), "setup"),
    ("AdaptiveSVDSwitch", dict(selection=dict(scope="mlp")), "setup"),
    ("FIREReinit", dict(selection=dict(exclude=["*"])), "setup"),
    ("ShrinkPerturb", dict(selection=dict(include=["no_such_layer.*"])), "on_fit_start"),
]


@pytest.mark.parametrize("name,kwargs,hook", EMPTY_SELECTIONS)
def test_an_empty_target_set_is_an_error_not_a_silent_no_op(name, kwargs, hook):
    module = TinyMLPModule()
    callback = _callback(name)(**kwargs)
    trainer = _fake_trainer(module)
    with pytest.raises(ValueError, match="(?i)no .*(weights|layers|parameters)|matches no parameter"):
        callback.setup(trainer, module, "fit")
        if hook == "on_fit_start":
            callback.on_fit_start(trainer, module)


# ------------------------------------------------------------------ 3. degenerate tensors
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
SHAPES = st.sampled_from([(1, 1), (1, 7), (7, 1), (1, 64), (64, 1), (2, 48), (48, 2), (3, 3), (5, 4), (4, 9)])
KINDS = st.sampled_from(["normal", "zero", "rank1", "tiny", "huge", "one_hot_row"])


def make_matrix(shape, kind: str, seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(shape, generator=g, dtype=torch.float64)
    if kind == "zero":
        W = torch.zeros(shape, dtype=torch.float64)
    elif kind == "rank1":
        W = torch.randn(shape[0], 1, generator=g, dtype=torch.float64) @ torch.randn(1, shape[1], generator=g,
                                                                                        dtype=torch.float64)
    elif kind == "tiny":
        W = W * 1e-20
    elif kind == "huge":
        W = W * 1e15
    elif kind == "one_hot_row":
        W = torch.zeros(shape, dtype=torch.float64)
        W[0, 0] = 1.0
    if dtype in (torch.float16, torch.bfloat16):  # keep within the format's range: finite input only
        W = W.clamp(-6e4, 6e4)
    return W.to(dtype)


matrices = st.builds(make_matrix, SHAPES, KINDS, st.integers(0, 10_000), st.sampled_from(DTYPES))


def finite(*xs) -> bool:
    return all(math.isfinite(x) if isinstance(x, float) else bool(torch.isfinite(x).all()) for x in xs)


@FAST
@given(matrices)
def test_svd_is_orthonormal_and_reconstructs_without_nan(W):
    U, S, V = subspace.svd_triplets(W.float())
    g = min(W.shape)
    assert U.shape == (W.shape[0], g) and V.shape == (W.shape[1], g) and finite(U, S, V)
    eye = torch.eye(g)
    assert torch.allclose(U.mT @ U, eye, atol=1e-4) and torch.allclose(V.mT @ V, eye, atol=1e-4)
    scale = W.float().abs().max().clamp_min(1e-30)
    assert torch.allclose((U * S) @ V.mT / scale, W.float() / scale, atol=1e-4)
    assert bool((S[:-1] >= S[1:]).all()) and bool((S >= 0).all())


@FAST
@given(matrices, st.sampled_from(spectral.METHODS))
def test_polar_factor_is_a_finite_full_isometry(W, method):
    """Every singular value of ``orthogonalize(W)`` is 1, also on W's null directions; zero W is left alone."""
    Q = spectral.orthogonalize(W, spectral.PolarOptions(method=method))
    assert Q.shape == W.shape and Q.dtype == W.dtype and finite(Q)
    if not bool(W.any()):
        assert torch.equal(Q, W)
        return
    S = torch.linalg.svdvals(Q.double())
    tol = 1e-2 if W.dtype in (torch.float16, torch.bfloat16) else 1e-3
    assert bool(((S - 1).abs() < tol).all()), S
    assert finite(spectral.deviation_from_isometry(Q), spectral.stable_rank(W), spectral.effective_rank(W))


@FAST
@given(matrices, matrices, st.integers(0, 8))
def test_subspace_metrics_stay_in_range(W, G, r):
    W = W.float()
    svd = subspace.svd_triplets(W)
    g = svd.S.numel()
    r = min(r, g)
    other = subspace.svd_triplets(W + 1e-3 * torch.ones_like(W))
    angle = subspace.subspace_angle(svd.U, other.U, g - r)
    assert 0.0 <= angle <= math.pi / 2 + 1e-6
    assert 0 <= subspace.energy_rank(svd.S) <= g
    error = subspace.reconstruction_error(W, *svd, r)
    assert finite(error) and -1e-6 <= error <= 1 + 1e-4
    G = G.float() if G.shape == W.shape else torch.randn_like(W)
    principal, minor = subspace.gradient_alignment(G, svd.U, r)
    assert finite(principal, minor) and principal ** 2 + minor ** 2 <= 1 + 1e-4
    r_next, _ = subspace.next_rank(svd.S, None, max(r, 1), r_min=2)
    lo, hi = subspace.rank_bounds(g, 2)
    assert lo <= r_next <= max(hi, lo)


@FAST
@given(matrices, st.integers(1, 4))
def test_minor_projection_is_an_idempotent_projector(W, r):
    W = W.float()
    if min(W.shape) < 2:
        return
    svd = subspace.svd_triplets(W)
    r = min(r, min(W.shape) - 1)
    U_minor = svd.U[:, -r:]
    T = torch.randn(W.shape)
    factorization.project_onto(T, U_minor)
    again = T.clone()
    factorization.project_onto(again, U_minor)
    assert finite(T) and torch.allclose(again, T, atol=1e-5)
    B, A = factorization.minor_factors(svd, r, torch.float32)
    assert finite(B, A) and B.shape == (W.shape[0], r) and A.shape == (r, W.shape[1])


@FAST
@given(matrices, matrices, st.floats(0, 1), st.floats(-1, 1), st.floats(0, 10), st.floats(0, 1))
def test_shrink_factors_are_finite_and_in_range(W, D, lam, alpha, rate, floor):
    D = D if D.shape == W.shape else torch.randn(W.shape).to(W.dtype)
    cos = shrink.group_cosine(W, D)
    assert finite(cos) and bool((cos.abs() <= 1).all())
    paper = shrink.dash_shrink_factors(W, D, lam)
    assert finite(paper) and bool(((paper >= lam - 1e-6) & (paper <= 1)).all())
    seed_rule = shrink.penalty_shrink_factors(W, D, alpha, rate, floor)
    assert finite(seed_rule) and bool(((seed_rule >= floor - 1e-6) & (seed_rule <= 1)).all())
    before = W.clone()
    shrink.apply_shrink_(W, paper)
    assert finite(W) and bool((W.abs() <= before.abs()).all())  # shrinking never grows a weight


@FAST
@given(st.integers(1, 40), st.sampled_from(["normal", "zero", "one_alive", "tiny", "huge"]), st.integers(0, 999),
       st.floats(0, 1))
def test_dormancy_scores_are_finite_and_average_one(width, kind, seed, tau):
    g = torch.Generator().manual_seed(seed)
    a = torch.rand(width, generator=g)
    # (1e-38 is subnormal and 40 x 1e38 overflows the float32 mean: both give wrong scores, see the issue-9 note)
    a = {"zero": a * 0, "tiny": a * 1e-30, "huge": a * 1e30, "one_alive": torch.eye(width)[0]}.get(kind, a)
    scores = dormancy.dormancy_scores(a)
    assert finite(scores) and bool((scores >= 0).all())
    if kind not in ("zero", "tiny") and float(a.sum()) > 0:
        assert abs(float(scores.double().mean()) - 1) < 1e-3
    if kind == "tiny":  # the references' divisor mean + 1e-9: a nearly silent layer scores ~0 (dormant)
        assert float(scores.max()) < 1e-12
    fraction = float(dormancy.dormant_fraction(scores, tau))
    assert 0 <= fraction <= 1
    if kind == "zero":
        assert float(dormancy.dormant_fraction(scores, 0.0)) == 1.0  # all dead, not NaN


@FAST
@given(st.integers(1, 12), st.integers(2, 6), st.integers(1, 6), st.integers(0, 999),
       st.sampled_from(["weight_std", "default", "xavier_uniform", 0.5]), st.booleans(),
       st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_recycling_dead_neurons_leaves_the_output_unchanged(hidden, d_in, d_out, seed, init, gated, dtype):
    torch.manual_seed(seed)
    up, down, gate = nn.Linear(d_in, hidden), nn.Linear(hidden, d_out), nn.Linear(d_in, hidden) if gated else None
    for layer in (up, down, gate):
        if layer is not None:
            layer.to(dtype)
    dead = torch.rand(hidden) < 0.5
    with torch.no_grad():  # dead neurons: never fire (ReLU of a negative pre-activation for every input)
        up.weight[dead] = 0
        up.bias[dead] = -1
    x = torch.randn(16, d_in).to(dtype)

    def forward():
        h = torch.relu(up(x))
        return down(h * torch.sigmoid(gate(x)) if gate is not None else h)

    before = forward()
    count = recycle(up, down, dead, gate, init, generator=torch.Generator().manual_seed(seed))
    assert int(count) == int(dead.sum())
    assert finite(up.weight, down.weight) and torch.equal(forward(), before)


def test_weight_std_init_of_a_one_element_layer_is_not_nan():
    """``init="weight_std"`` (and ReDoMonitor's recorded ``init_std``) take ``std()`` of the weight: with one
    element that is NaN (Bessel's correction divides by 0), so the recycled row becomes NaN."""
    up, down = nn.Linear(1, 1), nn.Linear(1, 1)
    recycle(up, down, torch.ones(1, dtype=torch.bool), init="weight_std")
    assert finite(up.weight), up.weight


@pytest.mark.parametrize("fn", ["svd", "cosine", "scores", "reconstruction"])
def test_non_finite_input_gives_nan_or_a_clear_error(fn):
    W = torch.randn(4, 5)
    W[1, 2] = float("nan")
    W[0, 0] = float("inf")
    try:
        if fn == "svd":
            out = subspace.svd_triplets(W).S
        elif fn == "cosine":
            out = shrink.group_cosine(W, torch.randn(4, 5))
        elif fn == "scores":
            out = dormancy.dormancy_scores(W[0].abs())
        else:
            svd = subspace.svd_triplets(torch.randn(4, 5))
            out = torch.tensor(subspace.reconstruction_error(W, *svd, 2))
    except (ValueError, torch.linalg.LinAlgError) as err:
        assert any(word in str(err).lower() for word in ("finite", "nan", "inf", "converge")), str(err)
        return
    assert not bool(torch.isfinite(out).all()) or fn == "cosine"  # the damage is visible, not hidden


def test_shape_mismatches_name_the_shapes():
    with pytest.raises(ValueError, match=r"\(3, 4\).*\(4, 3\)"):
        shrink.group_cosine(torch.ones(3, 4), torch.ones(4, 3))
    with pytest.raises(ValueError, match="mask has shape"):
        recycle(nn.Linear(2, 3), nn.Linear(3, 2), torch.ones(4, dtype=torch.bool))
    with pytest.raises(ValueError, match="method="):
        subspace.svd_triplets(torch.ones(2, 2), method="qr")
    with pytest.raises(ValueError, match="tau"):
        dormancy.dormant_mask(torch.ones(3), -0.5)


# ------------------------------------------------------------------ 4. one clear line for each bad input
def _fitted_redo_state() -> dict:
    from plasticity_callbacks import ReDoMonitor
    from tiny import cpu_trainer, regression_loader

    redo = ReDoMonitor(collect_every_n_steps=1, log_every_n_steps=1)
    cpu_trainer(max_steps=2, callbacks=[redo]).fit(TinyMLPModule(), regression_loader())
    return redo.state_dict()


def _load_redo(state: dict) -> None:
    from plasticity_callbacks import ReDoMonitor

    ReDoMonitor().load_state_dict(state)


def _shrunk(key: str, state: dict) -> dict:
    return {**state, key: state[key][:-1]}


def _bad_inputs():
    from plasticity_callbacks.ops.fire import apply_fire
    from plasticity_callbacks.errors import CheckpointError
    from plasticity_callbacks.model_map import Selection

    model = TinyMLPModule()
    state = _fitted_redo_state()
    return [
        ("orthogonalize 0x4", lambda: spectral.orthogonalize(torch.zeros(0, 4)), ValueError, "empty matrix"),
        ("orthogonalize 4x0", lambda: spectral.orthogonalize(torch.zeros(4, 0)), ValueError, "empty matrix"),
        ("orthogonalize 3x0x2", lambda: spectral.orthogonalize(torch.zeros(3, 0, 2), spectral.PolarOptions(method="svd")), ValueError, "(3, 0, 2)"),
        ("apply_fire optimizers=object()", lambda: apply_fire(model, optimizers=object()), TypeError, "optimizers"),
        ("apply_fire optimizers=[adam, 'sgd']",
         lambda: apply_fire(model, optimizers=[torch.optim.Adam(model.parameters()), "sgd"]), TypeError, "str"),
        ("apply_fire include=['nomatch*']",
         lambda: apply_fire(model, selection=Selection(include=["nomatch*"])), ValueError, "nomatch*"),
        *[(f"ReDo state {key} shape", (lambda k=key: _load_redo(_shrunk(k, state))), CheckpointError, key)
          for key in ("ema", "observed", "recycled", "init_std", "nonfinite_batches")],
        ("ReDo state widths", lambda: _load_redo({**state, "widths": [w + 1 for w in state["widths"]]}),
         CheckpointError, "ema"),
    ]


def test_each_bad_input_is_one_clear_line():
    """The issue's bad inputs and their neighbours: the right error type, one line naming the thing (that a
    refused ``apply_fire`` leaves every weight as it was: the next test)."""
    cases = _bad_inputs()
    for name, call, error, mentions in cases:
        with pytest.raises(error) as raised:
            call()
        message = str(raised.value)
        assert "\n" not in message and mentions in message, (name, message)


def test_a_refused_apply_fire_changes_no_weight():
    from plasticity_callbacks.ops.fire import apply_fire

    model = TinyMLPModule()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(TypeError):
        apply_fire(model, optimizers=object())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


# ------------------------------------------------------------------ 5. strides and magnitudes of the functional API
def _strided(base: torch.Tensor, how: str) -> torch.Tensor:
    """A view of ``base`` with the same values as ``base`` but other strides."""
    if how == "transposed":
        return base.mT.contiguous().mT
    if how == "every_other_column":
        wide = torch.zeros(base.shape[0], 2 * base.shape[1], dtype=base.dtype)
        wide[:, ::2] = base
        return wide[:, ::2]
    return base


@settings(max_examples=20, deadline=None, database=None)
@given(st.integers(1, 9), st.integers(1, 9), st.sampled_from(["contiguous", "transposed", "every_other_column"]),
       st.integers(-20, 20), st.sampled_from([torch.float32, torch.float64]), st.sampled_from(spectral.METHODS),
       st.integers(0, 10_000))
def test_polar_factor_of_any_layout_and_magnitude_is_the_float64_svd_polar_factor(m, n, how, exponent, dtype, method,
                                                                                  seed):
    g = torch.Generator().manual_seed(seed)
    # singular values in [1, 2]: well conditioned, so every method must reach the exact factor
    U, _ = torch.linalg.qr(torch.randn(max(m, n), max(m, n), generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(min(m, n), min(m, n), generator=g, dtype=torch.float64))
    S = 1 + torch.rand(min(m, n), generator=g, dtype=torch.float64)
    base = (U[:, : min(m, n)] * S) @ V.mT
    base = (base if m >= n else base.mT) * 10.0 ** exponent
    W = _strided(base.to(dtype), how)
    assert torch.equal(W, base.to(dtype))
    Q = spectral.orthogonalize(W, spectral.PolarOptions(method=method))
    u, _, vh = torch.linalg.svd(W.double(), full_matrices=False)
    assert Q.shape == W.shape and Q.dtype == dtype
    assert torch.allclose(Q.double(), u @ vh, atol=2e-4)  # the iterations stop at an orthogonality error of 1e-5


# ------------------------------------------------------------------ 4. every public argument, swept
def _exported_methods() -> list[str]:
    import plasticity_callbacks
    from plasticity_callbacks.callbacks.base import PlasticityCallback

    return sorted(n for n in plasticity_callbacks.__all__ if isinstance(getattr(plasticity_callbacks, n), type)
                  and issubclass(getattr(plasticity_callbacks, n), PlasticityCallback)
                  and getattr(plasticity_callbacks, n) is not PlasticityCallback)


def _swept_arguments() -> list[tuple[str, str, object]]:
    """``(method, argument, bad value)`` for every argument of every exported method whose default says its kind:
    a number gets Inf, NaN and a word; a flag gets a word and a number; a choice gets an unknown word."""
    import inspect

    cases = []
    for name in _exported_methods():
        for arg, p in inspect.signature(_callback(name).__init__).parameters.items():
            default = p.default
            if isinstance(default, bool):
                bad = ["yes", 3]
            elif isinstance(default, (int, float)):
                bad = [math.inf, math.nan, "abc"]
            elif isinstance(default, str):
                bad = ["no-such-choice", 5]
            else:
                continue
            cases += [(name, arg, value) for value in bad]
    return cases


@pytest.mark.parametrize("name,arg,value", _swept_arguments(), ids=lambda v: repr(v) if not isinstance(v, str) else v)
def test_every_argument_of_every_method_refuses_a_value_of_the_wrong_kind_by_name(name, arg, value):
    with pytest.raises(ValueError) as err:
        _callback(name)(**{arg: value})
    message = str(err.value)
    assert arg in message and "\n" not in message, message


def test_the_sweep_reaches_the_arguments_the_issue_found_accepted():
    swept = {(n, a) for n, a, _ in _swept_arguments()}
    assert {("L2Init", "strength"), ("FIREReinit", "save_spectra"), ("ReDoMonitor", "plot_scores")} <= swept
    assert len({n for n, _ in swept}) == len(_exported_methods())


def test_continual_backprop_layer_map_of_the_wrong_kind_is_named():
    with pytest.raises(ValueError, match=r"layer_map=5 must be a mapping"):
        _callback("ContinualBackprop")(layer_map=5)


@pytest.mark.parametrize("kwargs, words", [
    (dict(fused=[1, 2]), "fused=[1, 2]) must be a mapping"),
    (dict(neurons=("fc1", "fc2")), "neurons=('fc1', 'fc2')) must be a mapping"),
    (dict(roles="attention"), "roles='attention') must be a mapping"),
])
def test_declare_plasticity_arguments_of_the_wrong_kind_are_named(kwargs, words):
    from plasticity_callbacks import declare_plasticity

    with pytest.raises(ValueError) as err:
        declare_plasticity(nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 4)), **kwargs)
    assert words in str(err.value), str(err.value)


@pytest.mark.parametrize("rows, words", [
    ({"a": [0, 1, 2], "b": [3, 4, 9]}, "row(s) 9 out of range (the rows are 0..5); row(s) 5 in no block"),
    ({"a": [0, 1, 2, 3], "b": [3, 4, 5]}, "row(s) 3 in more than one block"),
])
def test_a_declared_row_split_that_does_not_fit_names_the_rows(rows, words):
    from plasticity_callbacks import declare_plasticity, select_targets

    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 4))
    with pytest.raises(ValueError) as err:  # when it is made, not at the next selection
        declare_plasticity(model, fused={"0.weight": rows})
    assert words in str(err.value) and "0.weight" in str(err.value), str(err.value)
    assert len(select_targets(model, None)) == 1  # nothing stored: the model is as it was (its head is excluded)


def test_fire_on_a_weight_with_no_entries_is_skipped_by_name_or_refused():
    from plasticity_callbacks.functional.isometry import DegenerateMatrixError, FIREOptions
    from plasticity_callbacks.ops.fire import apply_fire

    with pytest.warns(UserWarning):  # torch: initializing a zero-element tensor
        model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 0), nn.Linear(0, 3), nn.Linear(3, 3))
    before = model[0].weight.detach().clone()
    with pytest.warns(UserWarning, match=r"FIRE: 1.weight has shape \(0, 8\), no entries"):
        records = apply_fire(model)
    assert {r.name: r.skipped for r in records} == {"0.weight": None, "1.weight": "empty", "2.weight": "empty"}
    assert not torch.equal(model[0].weight, before)  # the others were treated
    with pytest.raises(DegenerateMatrixError, match="no entries"):
        apply_fire(model, options=FIREOptions(on_degenerate="raise"))


def test_hf_adapter_arguments_of_the_wrong_kind_are_named():
    pytest.importorskip("transformers")
    import lightning as L
    from plasticity_callbacks import FIREReinit
    from plasticity_callbacks.integrations.hf import HFTrainerCallback

    for kwargs, words in [(dict(task_boundary_steps=[-1]), "task_boundary_steps=[-1] must be"),
                          (dict(task_boundary_steps="abc"), "task_boundary_steps='abc' must be"),
                          (dict(trainer="x"), "trainer='x' must be the transformers.Trainer")]:
        with pytest.raises(ValueError) as err:
            HFTrainerCallback(FIREReinit(), **kwargs)
        assert words in str(err.value), str(err.value)
    with pytest.raises(ValueError, match=r"Callback\(\) overrides none of the hooks it drives"):
        HFTrainerCallback(FIREReinit(), L.Callback())
    assert HFTrainerCallback(FIREReinit(), task_boundary_steps=[20, 10]).task_boundary_steps == [10, 20]


@pytest.mark.parametrize("override, words", [
    ("trainer.max_steps=abc", "trainer.max_steps='abc' must be an integer >= -1, e.g. trainer.max_steps=300"),
    ("trainer.accumulate_grad_batches=0", "trainer.accumulate_grad_batches=0 must be an integer >= 1"),
    ("optimizer.lr=-1", "optimizer.lr=-1 must be finite and >= 0, e.g. optimizer.lr=0.003"),
    ("optimizer.weight_decay=-0.1", "optimizer.weight_decay=-0.1 must be finite and >= 0"),
    ("optimizer.betas=[0.9,-1]", "optimizer.betas=[0.9, -1] must be finite and >= 0"),
])
def test_hydra_values_lightning_or_torch_would_reject_deep_inside_are_named_with_the_fix(override, words):
    from hydra import compose, initialize_config_dir

    from plasticity_callbacks.app.config_checks import check_config
    from plasticity_callbacks.app.train import config_dir
    from plasticity_callbacks.errors import ConfigError

    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        cfg = compose("config", overrides=["paths.output_dir=/tmp/plasticity-compose", "experiment=smoke", override])
    with pytest.raises(ConfigError) as err:
        check_config(cfg, [override])
    assert words in str(err.value), str(err.value)


def test_a_monitor_schedule_in_a_fit_without_validation_says_it_will_never_act():
    from plasticity_callbacks import ShrinkPerturb

    from tiny import cpu_trainer, regression_loader

    method = ShrinkPerturb(schedule={"monitor": "val/loss", "patience": 1})
    with pytest.warns(UserWarning, match=r"Schedule\(monitor='val/loss'\) .* runs no validation .* never act"):
        cpu_trainer(max_steps=2, callbacks=[method]).fit(TinyMLPModule(), regression_loader())
    assert method.firing.fired == []
    validated = ShrinkPerturb(schedule={"monitor": "val/loss", "patience": 1})
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*runs no validation.*")
        cpu_trainer(max_steps=4, val_check_interval=2, callbacks=[validated]).fit(
            TinyMLPModule(), regression_loader(), regression_loader())


# ------------------------------------------------------------------ 6. domains, names that match nothing, never-firing
# A value at an open bound the math cannot take (a rate of 0 that does nothing, a decay of 1 that never moves, a
# factor of 0 that kills a row), and its allowed neighbour: (callback, kwargs, the words of the one line or None).
DOMAINS = [
    ("DASHPeriodic", dict(shrink_rate=2), "shrink_rate=2 must be a finite number in (0, 1]"),
    ("DASHPeriodic", dict(shrink_rate=0), "shrink_rate=0 must be a finite number in (0, 1]"),
    ("DASHPeriodic", dict(shrink_rate=1.0), None),
    ("DASHPeriodic", dict(min_factor=0), "min_factor=0 must be a finite number in (0, 1]"),
    ("DASHPeriodic", dict(min_factor=1.0), None),
    ("DASHShrink", dict(min_factor=0.0), "min_factor=0.0 must be a finite number in (0, 1]"),
    ("DASHShrink", dict(gradient_ema_weight=0.0), "gradient_ema_weight=0.0 must be a finite number in (0, 1]"),
    ("WeightClip", dict(kappa=0.0), "kappa=0.0 must be a finite number > 0"),
    ("WeightClip", dict(kappa=1e-6), None),
    ("L2Init", dict(strength=0.0), "strength=0.0 must be a finite number > 0"),
    ("HareTortoise", dict(decay=1.0), "decay=1.0 must be a finite number in [0, 1)"),
    ("HareTortoise", dict(decay=0.0), None),
    ("ContinualBackprop", dict(replacement_rate=0.0), "replacement_rate=0.0 must be a finite number in (0, 1]"),
    ("ContinualBackprop", dict(decay_rate=1.0), "decay_rate=1.0 must be a finite number in [0, 1)"),
    ("ContinualBackprop", dict(decay_rate=0.0), None),
    ("ReDoMonitor", dict(ema_decay=1.0), "ema_decay=1.0 must be a finite number in [0, 1)"),
    ("ShrinkPerturb", dict(shrink=1.0, perturb=0.0), "shrink=1 with perturb=0 leaves every weight as it is"),
    ("ShrinkPerturb", dict(shrink=1.0, perturb=0.0, reset_optimizer=True), None),  # the optimizer reset alone
    ("ContinualBackprop", dict(layer_map={"mlp": "fc1"}), "layer_map['mlp']='fc1' must be (up_name"),
    ("PlasticityMonitor", dict(layer_map={"mlp": ("a",)}), "PlasticityMonitor layer_map['mlp']=('a',) must be"),
]


@pytest.mark.parametrize("name,kwargs,words", DOMAINS, ids=[f"{n}-{kw}" for n, kw, _ in DOMAINS])
def test_a_value_outside_the_domain_the_math_needs_is_one_line_and_its_neighbour_is_accepted(name, kwargs, words):
    if words is None:
        _callback(name)(**kwargs)
        return
    with pytest.raises(ValueError) as err:
        _callback(name)(**kwargs)
    assert words in str(err.value) and "\n" not in str(err.value), str(err.value)


@pytest.mark.parametrize("low,high,low_open,high_open,inside,outside,shown", [
    (0.0, 1.0, True, False, [1e-300, 1.0], [0.0, 1.0000001], "in (0, 1]"),
    (0.0, 1.0, False, True, [0.0, 0.999999], [1.0, -1e-9], "in [0, 1)"),
    (0.0, 1.0, True, True, [0.5], [0.0, 1.0], "in (0, 1)"),
    (0.0, 1.0, False, False, [0.0, 1.0], [-0.1, 1.1], "in [0, 1]"),
    (0.0, math.inf, True, False, [1e-300, 1e300], [0.0, -1.0, math.inf], "> 0"),
    (2.0, math.inf, False, False, [2.0], [1.999], ">= 2"),
])
def test_check_number_open_and_closed_bounds(low, high, low_open, high_open, inside, outside, shown):
    from plasticity_callbacks.arguments import check_number

    for value in inside:
        check_number("x", value, low, high, low_open=low_open, high_open=high_open)
    for value in [*outside, math.nan, "0.5", True]:
        with pytest.raises(ValueError, match=re.escape(f"x={value!r} must be a finite number {shown}")):
            check_number("x", value, low, high, low_open=low_open, high_open=high_open)


def _options_classes() -> list[type]:
    """Every options dataclass a user builds: the package's exported dataclasses, and those the exported callbacks
    take as arguments (found in their constructors' annotations, so a new one is covered without an edit)."""
    import dataclasses
    import inspect
    import typing

    import plasticity_callbacks as pc
    from callback_table import exported_callbacks

    found = {getattr(pc, n) for n in pc.__all__ if dataclasses.is_dataclass(getattr(pc, n))}
    for cls in exported_callbacks().values():
        module = inspect.getmodule(cls)
        for annotation in typing.get_type_hints(cls.__init__, vars(module)).values():
            found.update(a for a in typing.get_args(annotation) if dataclasses.is_dataclass(a))
    return sorted(found, key=lambda c: c.__name__)


def test_the_options_classes_are_found():
    names = {c.__name__ for c in _options_classes()}
    assert {"Schedule", "Selection", "FIREOptions", "SwitchThresholds", "SVDOptions", "GPTConfig"} <= names, names


@pytest.mark.parametrize("cls", _options_classes(), ids=lambda c: c.__name__)
def test_an_unknown_field_of_an_options_class_is_one_line_naming_it_and_the_nearest(cls):
    import dataclasses

    first = next(f.name for f in dataclasses.fields(cls) if f.init)
    with pytest.raises(ValueError) as err:
        cls(bogus=1)
    message = str(err.value)
    assert f"{cls.__name__} has no argument bogus=1" in message and first in message and "\n" not in message
    with pytest.raises(ValueError, match=f"did you mean '{first}'"):
        cls(**{first + "x": 1})  # a typo of a real field


def test_schedule_bogus_is_named_not_pythons_type_error():
    from plasticity_callbacks import Schedule

    with pytest.raises(ValueError, match=r"Schedule has no argument bogus=1; its arguments: at_fit_start, "):
        Schedule(bogus=1)


def _takes(cls, argument: str) -> bool:
    import inspect

    return argument in inspect.signature(cls.__init__).parameters


def _name_cases() -> list[tuple[str, dict, str]]:
    """For every exported method with a ``selection``, ``exclude`` or ``layer_map`` argument: a name that matches
    nothing in TinyMLPModule (``net.0`` … ``net.4``), and the words its one-line refusal at setup must hold."""
    from callback_table import methods

    cases = []
    for name, cls in sorted(methods().items()):
        if _takes(cls, "selection"):
            cases.append((name, dict(selection={"exclude": ["net.O.*"]}), "exclude pattern 'net.O.*' matches no"))
        if _takes(cls, "exclude"):
            cases.append((name, dict(exclude=["nett.*"]), "exclude pattern 'nett.*' matches no parameter"))
        if _takes(cls, "layer_map"):
            cases.append((name, dict(layer_map={"mlp": ("net.O", "net.2")}),
                          f"{name} layer_map['mlp']: the model has no module 'net.O' (did you mean"))
    return cases


@pytest.mark.parametrize("name,kwargs,words", _name_cases(), ids=lambda v: v if isinstance(v, str) else None)
def test_a_name_that_matches_nothing_is_refused_at_setup_with_the_close_matches(name, kwargs, words):
    module = TinyMLPModule()
    callback = _callback(name)(**{**kwargs, **_acting_arguments(name)})
    trainer = _fake_trainer(module)
    with pytest.raises(ValueError) as err:
        callback.setup(trainer, module, "fit")
        callback.on_fit_start(trainer, module)
    assert words in str(err.value) and "\n" not in str(err.value), str(err.value)


def _acting_arguments(name: str) -> dict:
    """Arguments a method needs to be built at all in these tests (none so far: every default builds)."""
    return {}


def test_the_name_sweep_reaches_every_method_with_a_selection_or_a_layer_map():
    from callback_table import methods

    swept = {n for n, _, _ in _name_cases()}
    assert {"ContinualBackprop", "ReDoMonitor", "PlasticityMonitor", "FIREReinit", "WeightClip"} <= swept
    assert swept == {n for n, cls in methods().items()
                     if any(_takes(cls, a) for a in ("selection", "exclude", "layer_map"))}


@pytest.mark.parametrize("kwargs, words", [
    (dict(fused={"0.bias": {"a": 3, "b": 3}}), "'0.bias' is a 1-D parameter (6,) (a bias?); fused describes a "
                                               "weight matrix's rows: name '0.weight'"),
    (dict(fused={"0.weigth": {"a": 3, "b": 3}}), "no parameter '0.weigth' (did you mean '0.weight'"),
    (dict(head="3"), "no submodule '3'"),
    (dict(neurons={"mlp": ("00", "2")}), "no submodule '00' (did you mean '0'"),
])
def test_declare_plasticity_names_a_bias_or_a_name_that_matches_nothing(kwargs, words):
    from plasticity_callbacks import declare_plasticity

    with pytest.raises(ValueError) as err:
        declare_plasticity(nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 4)), **kwargs)
    assert words in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_a_trigger_that_can_never_fire_within_the_fit_is_warned_once():
    """At fit start when ``max_steps`` says the fit ends before the trigger; at fit end when only the epochs
    bound the fit; a schedule that acts says nothing."""
    from plasticity_callbacks import FIREReinit, Schedule

    from tiny import cpu_trainer, regression_loader

    def fit(schedule, **limits):
        fire = FIREReinit(schedule=schedule)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cpu_trainer(callbacks=[fire], **limits).fit(TinyMLPModule(), regression_loader())
        return fire, [str(w.message) for w in caught if "FIREReinit: Schedule(" in str(w.message)]

    fire, said = fit(Schedule(steps=[100]), max_steps=3)
    assert fire.history == [] and len(said) == 1 and "can never act in this fit (max_steps=3" in said[0], said
    fire, said = fit(Schedule(steps=[1000]), max_epochs=1, max_steps=-1)
    assert fire.history == [] and len(said) == 1 and "never acted in this fit, which ended at step" in said[0], said
    fire, said = fit(Schedule(every_n_steps=2, start_step=10), max_steps=4)
    assert len(said) == 1 and "start_step=10" in said[0], said
    fire, said = fit(Schedule(steps=[2]), max_steps=3)
    assert len(fire.history) == 1 and said == []
