"""Dormant neurons (ReDo, Sokar et al., ICML 2023): scores, masks and fresh rows, as plain tensor functions.

A *neuron* is hidden unit ``i`` between two layers: row ``i`` of the incoming weight ``up``
(and of ``gate`` in a gated MLP, where the unit is ``act(gate x) * up x``) and column ``i`` of
the outgoing weight ``down``. For conv layers a channel is a neuron: output channel ``i`` of
``up`` (dim 0 of its kernel) and input channel ``i`` of ``down`` (dim 1).

Score of neuron ``i`` among ``H``: ``s_i = E|h_i| / ((1/H) Σ_k E|h_k|)``, so scores average 1;
the neuron is τ-dormant if ``s_i ≤ τ``, and ``τ = 0`` means exactly dead.

Everything here keeps shapes static (masks and ``torch.where``, never boolean indexing) and
never reads a device value on the host, so it can run inside a training step on any device.
No Lightning import.
"""
from __future__ import annotations

import math
from typing import Union

import torch


INITS = ("weight_std", "default", "xavier_uniform")
Init = Union[str, float, torch.Tensor]  # a name in INITS, or the std of a normal


_CPU_CHUNK_ELEMENTS = 1 << 17  # 512 KiB of fp32: a chunk's |h| stays in L2


def mean_abs_activation(h: torch.Tensor, unit_dim: int = -1) -> torch.Tensor:
    """``E|h_i|`` per unit (float32), averaged over every dim but ``unit_dim`` (batch, time, space).

    On CPU the activation is reduced in cache-sized row chunks: ``h.abs()`` of the whole tensor
    writes and re-reads a temporary as large as ``h``, and that traffic, not the arithmetic, is the
    cost (chunked: ~3x faster, measured on a 16x256x512 fp32 activation). Other devices and
    compiled graphs fuse it.
    """
    unit_dim = unit_dim % h.dim()
    count = h.numel() // h.shape[unit_dim]
    if unit_dim != h.dim() - 1:  # conv channels
        return h.abs().sum(dim=tuple(d for d in range(h.dim()) if d != unit_dim), dtype=torch.float32) / count
    rows = h.reshape(-1, h.shape[-1])  # (tokens, units)
    if rows.device.type != "cpu" or torch.compiler.is_compiling():  # a compiled graph fuses abs into the sum
        return rows.abs().sum(dim=0, dtype=torch.float32) / count
    total = torch.zeros(rows.shape[1], dtype=torch.float32)
    for chunk in rows.split(max(1, _CPU_CHUNK_ELEMENTS // rows.shape[1])):
        total += chunk.abs().sum(dim=0, dtype=torch.float32)
    return total / count


SCORE_EPS = 1e-9  # the references' divisor is ``mean + 1e-9``


def dormancy_scores(mean_abs_activation: torch.Tensor) -> torch.Tensor:
    """``E|h_i|`` per neuron (last dim) → score ``E|h_i| / (mean_k E|h_k| + 1e-9)`` (scores average ≈ 1).

    The ``+ 1e-9`` is the ReDo reference code's (dopamine and its PyTorch port): it keeps an
    all-dead layer at scores 0 instead of NaN, and it makes a layer whose activations are all
    tiny (mean ≲ 1e-8) count as dormant, as the references do.
    """
    a = mean_abs_activation.float()
    return a / (a.mean(dim=-1, keepdim=True) + SCORE_EPS)


def dormant_mask(scores: torch.Tensor, tau: float) -> torch.Tensor:
    """Boolean mask of τ-dormant neurons: ``s ≤ τ``; ``τ = 0`` means exactly dead (``isclose(s, 0)``)."""
    if tau < 0:
        raise ValueError(f"tau={tau} must be >= 0")
    if tau == 0:
        return torch.isclose(scores, torch.zeros_like(scores))
    return scores <= tau


def dormant_fraction(scores: torch.Tensor, tau: float) -> torch.Tensor:
    """Fraction (0-D tensor) of the neurons in ``scores`` that are τ-dormant."""
    return dormant_mask(scores, tau).float().mean()


def _fan_in_out(weight: torch.Tensor) -> tuple[int, int]:
    receptive = math.prod(weight.shape[2:])  # 1 for a Linear
    return weight.shape[1] * receptive, weight.shape[0] * receptive


def finite_std(weight: torch.Tensor) -> torch.Tensor:
    """Std (float32, 0-D, on device) of the finite entries of ``weight``; PyTorch's default scale
    ``1/√fan_in`` when fewer than two are finite. One NaN row must not make every re-sampled row NaN."""
    w = weight.detach()
    w = (w.full_tensor() if hasattr(w, "full_tensor") else w).float()  # a DTensor (FSDP2): the whole matrix's
    finite = torch.isfinite(w)
    count = finite.sum()
    w = torch.where(finite, w, 0.0)
    mean = w.sum() / count.clamp_min(1)
    variance = torch.where(finite, (w - mean) ** 2, 0.0).sum() / (count - 1).clamp_min(1)
    fallback = torch.tensor(1 / math.sqrt(_fan_in_out(weight)[0]), device=w.device)
    return torch.where(count > 1, variance.sqrt(), fallback)


def fresh_weights(weight: torch.Tensor, init: Init, generator: torch.Generator | None = None) -> torch.Tensor:
    """A new tensor shaped like ``weight``, drawn from ``init``:

    - ``"weight_std"``: ``N(0, σ)`` with σ the std of ``weight``'s finite entries (:func:`finite_std`, no host sync);
    - ``"default"``: PyTorch's Linear/conv default, ``U(±1/√fan_in)``;
    - ``"xavier_uniform"``: ``U(±√(6/(fan_in+fan_out)))``, the ReDo reference code's choice;
    - a number or 0-D tensor: ``N(0, init)``;
    - a tensor shaped like ``weight``: that draw, as is (e.g. the model's own init of the layer).
    """
    if torch.is_tensor(init) and init.dim() > 0:
        if init.shape != weight.shape:
            raise ValueError(f"an init tensor of shape {tuple(init.shape)} does not fit a weight of "
                             f"{tuple(weight.shape)}")
        return init.to(device=weight.device, dtype=weight.dtype)
    fan_in, fan_out = _fan_in_out(weight)
    if isinstance(init, str):
        if init not in INITS:
            raise ValueError(f"init={init!r} is not one of {INITS} or a std (number / 0-D tensor)")
        if init == "weight_std":
            std = finite_std(weight)
        else:
            bound = 1 / math.sqrt(fan_in) if init == "default" else math.sqrt(6 / (fan_in + fan_out))
            uniform = torch.rand(weight.shape, generator=generator, device=weight.device, dtype=torch.float32)
            return ((2 * uniform - 1) * bound).to(weight.dtype)
    else:
        std = init
    normal = torch.randn(weight.shape, generator=generator, device=weight.device, dtype=torch.float32)
    return (normal * std).to(weight.dtype)
