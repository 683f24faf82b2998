"""The DASH shrink formulas against hand-computed values and an independent float64 computation."""
import math

import pytest
import torch
import torch.nn.functional as F

from plasticity_callbacks.functional.shrink import apply_shrink_, dash_shrink_factors, group_cosine, penalty_shrink_factors

# Rows: aligned, orthogonal, opposite, zero weight row, 45 degrees.
W = torch.tensor([[3.0, 4.0], [1.0, 0.0], [0.0, 2.0], [0.0, 0.0], [1.0, 1.0]])
G = torch.tensor([[6.0, 8.0], [0.0, 5.0], [0.0, -1.0], [1.0, 1.0], [2.0, 0.0]])
COS = [1.0, 0.0, -1.0, 0.0, 1 / math.sqrt(2)]


def test_group_cosine_by_hand_and_zero_rows_give_zero_not_nan():
    assert torch.allclose(group_cosine(W, G), torch.tensor(COS))
    assert torch.equal(group_cosine(torch.zeros(3, 4), torch.zeros(3, 4)), torch.zeros(3))


def test_dash_factors_by_hand():
    # clamp(cos, 0.3, 1): aligned kept, orthogonal / opposite / zero rows down to lambda, 45 degrees in between.
    expected = torch.tensor([1.0, 0.3, 0.3, 0.3, 1 / math.sqrt(2)])
    assert torch.allclose(dash_shrink_factors(W, G, lam=0.3), expected)
    assert torch.allclose(dash_shrink_factors(W, G, lam=0.0), torch.tensor([1.0, 0.0, 0.0, 0.0, 1 / math.sqrt(2)]))


def test_penalty_factors_by_hand_including_both_clamps():
    # alpha=0.05, rate=0.5: 1 - 0.5 * max(cos - 0.05, 0); rows with cos <= alpha untouched.
    expected = torch.tensor([1 - 0.5 * 0.95, 1.0, 1.0, 1.0, 1 - 0.5 * (1 / math.sqrt(2) - 0.05)])
    assert torch.allclose(penalty_shrink_factors(W, G, alpha=0.05, rate=0.5, floor=0.5), expected)
    # rate=2 pushes the aligned row below the floor; the 45-degree row lands at 1 - 2*0.657 < 0.5 as well.
    got = penalty_shrink_factors(W, G, alpha=0.05, rate=2.0, floor=0.5)
    assert torch.allclose(got, torch.tensor([0.5, 1.0, 1.0, 1.0, 0.5]))
    # The seed defaults barely move: 1 - 0.005 * 0.95.
    assert torch.allclose(penalty_shrink_factors(W, G)[0], torch.tensor(1 - 0.005 * 0.95))


def test_the_two_rules_shrink_the_same_kind_of_row():
    """Weights against the descent direction: the paper sees cos(-g, W) = -1, the seed cos(W, g) = +1."""
    weight = torch.tensor([[1.0, 2.0], [1.0, 2.0]])
    grad = torch.tensor([[1.0, 2.0], [-1.0, -2.0]])  # row 0 against descent, row 1 along it
    assert torch.allclose(dash_shrink_factors(weight, -grad, lam=0.3), torch.tensor([0.3, 1.0]))
    assert torch.allclose(penalty_shrink_factors(weight, grad, alpha=0.0, rate=0.5), torch.tensor([0.5, 1.0]))


def _reference_cosines(a, b):
    """Independent float64 computation with torch's own cosine, group by group."""
    a, b = a.double(), b.double()
    if a.dim() == 1:
        return F.cosine_similarity(a[None], b[None], eps=1e-30)[0]
    if a.dim() == 2:
        return F.cosine_similarity(a, b, dim=1, eps=1e-30)
    return torch.tensor([[F.cosine_similarity(a[o, i].flatten(), b[o, i].flatten(), dim=0, eps=1e-30).item()
                          for i in range(a.shape[1])] for o in range(a.shape[0])], dtype=torch.float64)


@pytest.mark.parametrize("shape", [(16, 8), (8, 5, 3, 3), (6, 4, 5), (12,)])
def test_random_inputs_match_an_independent_computation(shape):
    g = torch.Generator().manual_seed(sum(shape))
    weight, grad = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    cos = _reference_cosines(weight, grad)
    got_dash = dash_shrink_factors(weight, -grad, lam=0.1)
    assert got_dash.shape == cos.shape
    assert torch.allclose(got_dash.double(), (-cos).clamp(0.1, 1.0), atol=1e-6)
    got_pen = penalty_shrink_factors(weight, grad, alpha=-0.2, rate=0.7, floor=0.4)
    assert torch.allclose(got_pen.double(), (1 - 0.7 * (cos + 0.2).clamp_min(0)).clamp(0.4, 1.0), atol=1e-6)
    assert ((got_pen < 1).any() and (got_pen == 1).any()) or shape == (12,)  # both branches exercised


def test_apply_shrink_multiplies_each_group_in_place():
    g = torch.Generator().manual_seed(1)
    linear = torch.randn(4, 3, generator=g)
    factors = torch.tensor([1.0, 0.5, 0.3, 0.9])
    expected = linear * factors[:, None]
    assert apply_shrink_(linear, factors) is linear and torch.allclose(linear, expected)
    conv = torch.randn(3, 2, 3, 3, generator=g)
    conv_factors = torch.rand(3, 2, generator=g)
    expected = conv * conv_factors[:, :, None, None]
    apply_shrink_(conv, conv_factors)
    assert torch.allclose(conv, expected)
    bias = torch.randn(5, generator=g)
    expected = bias * 0.25
    apply_shrink_(bias, torch.tensor(0.25))
    assert torch.allclose(bias, expected)
    with pytest.raises(ValueError, match="do not match"):
        apply_shrink_(linear, torch.ones(3))


def test_low_precision_and_degenerate_inputs_stay_finite():
    weight = torch.randn(8, 16).bfloat16()
    weight[3] = 0
    grad = torch.randn(8, 16).bfloat16()
    grad[5] = 0
    for factors in (dash_shrink_factors(weight, grad), penalty_shrink_factors(weight, grad)):
        assert factors.dtype == torch.float32 and torch.isfinite(factors).all()
    tiny = torch.full((2, 4), 1e-30)
    assert torch.allclose(group_cosine(tiny, tiny), torch.ones(2))  # tiny but non-zero rows keep their cosine
    apply_shrink_(weight, dash_shrink_factors(weight, grad))
    assert torch.equal(weight[3], torch.zeros(16, dtype=torch.bfloat16))


def test_arguments_are_validated():
    with pytest.raises(ValueError, match="lam"):
        dash_shrink_factors(W, G, lam=1.5)
    with pytest.raises(ValueError, match="alpha"):
        penalty_shrink_factors(W, G, alpha=2.0)
    with pytest.raises(ValueError, match="rate"):
        penalty_shrink_factors(W, G, rate=-1.0)
    with pytest.raises(ValueError, match="floor"):
        penalty_shrink_factors(W, G, floor=1.5)
    with pytest.raises(ValueError, match="shapes differ"):
        group_cosine(W, G[:2])
