"""Shrink rules as plain tensor functions: DASH's direction-aware factors and Shrink & Perturb; no Lightning.

Two rules, both "shrink a neuron whose weights point against where the loss wants them":

* Paper rule (Shin et al., NeurIPS 2024): ``factor = clamp(cos(G, W), lam, 1)`` with ``G`` an
  EMA of the **negative** gradient. A neuron whose weights agree with the descent direction
  (cos = 1) is kept; one that disagrees (cos <= lam) is scaled down to ``lam``.
* Periodic rule: ``factor = clamp(1 - rate * clamp(cos(W, g) - alpha, 0), floor, 1)``
  with ``g`` the **plain** gradient. cos(W, g) = -cos(W, -g), so this shrinks the same kind of
  neuron (weights against the descent direction), but only past the threshold ``alpha``, and
  only by a small step ``rate`` (floored at ``floor``).

Grouping (one cosine, one factor per group), the same for both rules, as the paper's code does:

* 2-D weight ``(d_out, d_in)`` (Linear): one factor per row (output neuron) -> shape ``(d_out,)``.
* conv weight ``(C_out, C_in, *kernel)``: one factor per (out, in) kernel slice, the cosine taken
  over the ``prod(kernel)`` spatial taps -> shape ``(C_out, C_in)``.
* 1-D tensor (a bias vector): one cosine over the whole vector -> a 0-d factor.

A zero group has no direction: its cosine is defined as 0 (as ``torch.cosine_similarity``
gives), never NaN. So a zero row of ``W`` stays zero under any factor, the periodic rule leaves
rows with a zero gradient alone, and the paper rule shrinks a row with no gradient signal to
``lam`` (what the reference code does).
"""
from __future__ import annotations

import torch


def _groups(t: torch.Tensor) -> torch.Tensor:
    """View ``t`` as ``(*groups, group_size)``: rows, (out, in) kernel slices, or one whole vector."""
    if t.dim() == 0:
        raise ValueError("a 0-d tensor has no direction to compare")
    if t.dim() <= 2:
        return t
    return t.flatten(2)  # (C_out, C_in, k_h * k_w ...)


def _unit_max(g: torch.Tensor) -> torch.Tensor:
    """Scale each group so its largest entry is ±1: squares of tiny weights (1e-30) would underflow to 0."""
    peak = g.abs().amax(dim=-1, keepdim=True)
    return g / peak.clamp_min(torch.finfo(g.dtype).tiny)


def group_cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Cosine between ``a`` and ``b`` per group (see the module docstring), in at least float32.

    Returns ``(d_out,)`` for 2-D, ``(C_out, C_in)`` for conv, 0-d for 1-D inputs; 0 where either
    group is all zeros.
    """
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    dtype = torch.promote_types(a.dtype, torch.float32)  # bf16 dot products lose the small rows
    ga, gb = _unit_max(_groups(a).to(dtype)), _unit_max(_groups(b).to(dtype))
    dot = (ga * gb).sum(-1)
    norms = torch.linalg.vector_norm(ga, dim=-1) * torch.linalg.vector_norm(gb, dim=-1)
    # A zero group makes dot = 0 exactly; dividing by a tiny positive number keeps that 0, not NaN.
    cos = dot / norms.clamp_min(torch.finfo(dtype).tiny)
    return cos.clamp(-1.0, 1.0)  # rounding can leave |cos| a hair above 1


def dash_shrink_factors(weight: torch.Tensor, direction: torch.Tensor, lam: float = 0.3) -> torch.Tensor:
    """Paper rule: ``clamp(cos(direction, weight), lam, 1)`` per group.

    ``direction`` is the EMA of the negative gradient, ``G <- (1 - a) G + a (-grad)``.

    Example:
        >>> factors = dash_shrink_factors(layer.weight, -layer.weight.grad, lam=0.3)
        >>> apply_shrink_(layer.weight, factors)
    """
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"lam={lam!r} must lie in [0, 1]")
    return group_cosine(direction, weight).clamp(lam, 1.0)


def penalty_shrink_factors(weight: torch.Tensor, grad: torch.Tensor, alpha: float = 0.05, rate: float = 0.005,
                           floor: float = 0.5) -> torch.Tensor:
    """Seed rule: ``clamp(1 - rate * clamp(cos(weight, grad) - alpha, min=0), floor, 1)`` per group.

    Example:
        >>> factors = penalty_shrink_factors(layer.weight, layer.weight.grad, alpha=0.05, rate=0.005)
        >>> apply_shrink_(layer.weight, factors)
    """
    if not -1.0 <= alpha <= 1.0:
        raise ValueError(f"alpha={alpha!r} must lie in [-1, 1] (it is a cosine threshold)")
    if rate < 0:
        raise ValueError(f"rate={rate!r} must be >= 0")
    if not 0.0 <= floor <= 1.0:
        raise ValueError(f"floor={floor!r} must lie in [0, 1]")
    penalty = (group_cosine(weight, grad) - alpha).clamp_min(0.0)
    return (1.0 - rate * penalty).clamp(floor, 1.0)


@torch.no_grad()
def apply_shrink_(tensor: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """Multiply ``tensor`` in place by ``factors`` (as returned above), broadcast over each group."""
    expected = _groups(tensor).shape[:-1] if tensor.dim() > 1 else torch.Size([])
    if factors.shape != expected:
        raise ValueError(f"factors of shape {tuple(factors.shape)} do not match groups {tuple(expected)} "
                         f"of a tensor shaped {tuple(tensor.shape)}")
    scale = factors.reshape(factors.shape + (1,) * (tensor.dim() - factors.dim()))
    return tensor.mul_(scale.to(tensor.dtype))


def shrink_perturb_(params: list[torch.Tensor], fresh: list[torch.Tensor], shrink: float, perturb: float) -> None:
    """In place: ``p ← shrink·p + perturb·f`` for every pair (the pure math, no Lightning)."""
    with torch.no_grad():
        for p, f in zip(params, fresh, strict=True):
            p.mul_(shrink).add_(f.to(device=p.device, dtype=p.dtype), alpha=perturb)
