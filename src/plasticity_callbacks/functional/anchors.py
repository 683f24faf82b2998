"""Keeping weights near an anchor: L2-Init's pull, weight clipping's box, the tortoise's slow average.

- :func:`l2_init_grad_`: ``g ← g + λ(θ - θ₀)``, the gradient of ``(λ/2)‖θ - θ₀‖²`` (Kumar et al. 2023);
- :func:`fan_in_bound` and :func:`clip_to_bounds_`: ``θ ← clamp(θ, ±κ·b)`` with ``b`` the layer's
  uniform init bound (Elsayed et al. 2024);
- :func:`ema_toward_`: ``θ_slow ← η·θ_slow + (1-η)·θ_fast`` (the tortoise of Lee et al. 2024).

Example:
    >>> l2_init_grad_(params, anchors, strength=1e-2)     # every p.grad gets λ(p - p₀)
    >>> fraction = clip_to_bounds_(params, [fan_in_bound(w) for w in weights], kappa=2.0)
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch


@torch.no_grad()
def l2_init_grad_(params: Sequence[torch.Tensor], anchors: Sequence[torch.Tensor], strength: float) -> None:
    """Add ``λ(θ - θ₀)``, the gradient of ``(λ/2)‖θ - θ₀‖²``, to every ``θ.grad`` (a missing gradient becomes
    that term alone, as the loss term would make it). ``anchors`` are the ``θ₀`` in the same order."""
    for p, p0 in zip(params, anchors, strict=True):
        pull = (p.detach() - p0.to(device=p.device, dtype=p.dtype)).mul_(strength)
        if p.grad is None:
            p.grad = pull
        else:
            p.grad.add_(pull.to(p.grad.dtype))


def fan_in_bound(weight: torch.Tensor, stored_in_out: bool = False) -> float:
    """``1/√fan_in``: the bound of PyTorch's default uniform init of a Linear/conv weight and its bias.

    Args:
        weight: ``(out, in, *kernel)``, or ``(in, out)`` with ``stored_in_out`` (Hugging Face ``Conv1D``).
    """
    fan_in = weight.shape[0] if stored_in_out else weight.shape[1] * math.prod(weight.shape[2:])
    return 1.0 / math.sqrt(fan_in)


@torch.no_grad()
def clip_to_bounds_(params: Sequence[torch.Tensor], bounds: Sequence[float], kappa: float) -> torch.Tensor:
    """``θ ← clamp(θ, -κ·b, κ·b)`` per tensor; returns the fraction of entries that were outside (0-D)."""
    outside = torch.zeros((), dtype=torch.float64)
    total = 0
    for p, bound in zip(params, bounds, strict=True):
        limit = kappa * bound
        outside += (p.abs() > limit).sum().to(outside.device)
        total += p.numel()
        p.clamp_(-limit, limit)
    return outside / max(total, 1)


@torch.no_grad()
def ema_toward_(slow: Sequence[torch.Tensor], fast: Sequence[torch.Tensor], decay: float) -> None:
    """``slow ← decay·slow + (1 - decay)·fast`` in place, per pair."""
    for s, f in zip(slow, fast, strict=True):
        s.lerp_(f.to(s.dtype), 1 - decay)
