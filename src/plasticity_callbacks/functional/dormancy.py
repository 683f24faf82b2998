"""Dormant neurons (ReDo, Sokar et al., ICML 2023): scores, masks and recycling, as plain tensor functions.

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
from typing import Sequence, Union

import torch
from torch import nn

from ..core.optimizer_state import zero_optimizer_state_slices

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
    w = weight.detach().float()
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


def _along(mask: torch.Tensor, ndim: int, dim: int) -> torch.Tensor:
    shape = [1] * ndim
    shape[dim] = -1
    return mask.reshape(shape)


@torch.no_grad()
def recycle_neurons(
    up: nn.Module,
    down: nn.Module,
    mask: torch.Tensor,
    gate: nn.Module | None = None,
    init: Init | Sequence[Init] = "weight_std",
    optimizer=None,
    generator: torch.Generator | None = None,
    down_offset: int = 0,
    group: int = 1,
    norm: nn.Module | None = None,
) -> torch.Tensor:
    """Recycle the neurons where ``mask`` is set; return how many (a 0-D tensor, no host sync).

    Rows and columns are those of each weight's ``(out, in)`` orientation (HF ``Conv1D`` stores
    ``(in, out)`` and is transposed here). ``group`` inputs of ``down`` per unit (a conv channel
    flattened into a Linear); ``norm``, a BatchNorm between ``up`` and the activation, gets the
    recycled channels' affine parameters and running statistics reset to a fresh layer's.

    For each masked neuron ``i``: row ``i`` of ``up.weight`` (and ``gate.weight``) is re-sampled
    from ``init`` (see :func:`fresh_weights`; a pair ``(up_init, gate_init)`` gives each layer
    its own), its bias is zeroed, and column ``down_offset + i`` of ``down.weight`` is zeroed (an offset
    lets several up projections feed slices of one down projection). A neuron's
    contribution to the output is its activation times its outgoing column, so with zero
    columns the network's output is unchanged by the recycling (up to the contribution the
    dormant neurons made before, which is zero for dead ones); ``down.bias`` is left alone.

    When several layers are recycled at once and one layer's ``down`` is the next one's ``up``
    (a plain MLP), call :func:`reinit_incoming` for every layer first and :func:`zero_outgoing`
    after, as the ReDo reference does: a weight ``down[j, i]`` whose neuron ``i`` and neuron ``j``
    are both recycled then ends at 0, not re-sampled.

    With ``optimizer`` (any ``torch.optim.Optimizer``, a list, a LightningOptimizer or our
    CombinedOptimizer), the optimizer moments of exactly those rows and columns are zeroed
    (Adam's ``exp_avg``/``exp_avg_sq``, SGD's and Muon's ``momentum_buffer``); all other entries
    are untouched. ``step`` is kept: PyTorch keeps one counter per *tensor*, so resetting it
    would restart Adam's bias correction for every row of the layer, not only the recycled
    ones (the ReDo reference code keeps it too). The price: a recycled row's first Adam update
    is ``(1-β1)/√(1-β2)`` times a fresh one (≈3.2 with betas 0.9/0.999, ≈0.9 with 0.8/0.95).

    Example:
        >>> scores = dormancy_scores(mean_abs)                  # (H,)
        >>> recycle_neurons(fc1, fc2, dormant_mask(scores, 0.025), optimizer=opt)
    """
    count = reinit_incoming(up, mask, gate, init, optimizer, generator, norm)
    zero_outgoing(down, mask, optimizer, down_offset, group)
    return count


@torch.no_grad()
def reinit_incoming(
    up: nn.Module,
    mask: torch.Tensor,
    gate: nn.Module | None = None,
    init: Init | Sequence[Init] = "weight_std",
    optimizer=None,
    generator: torch.Generator | None = None,
    norm: nn.Module | None = None,
) -> torch.Tensor:
    """The first half of :func:`recycle_neurons`: re-sample the masked rows of ``up`` (and ``gate``),
    zero their biases, reset ``norm``'s channels and those slices' optimizer moments. Returns the count."""
    from ..core.model_map import is_conv1d

    inits = list(init) if isinstance(init, (list, tuple)) else [init, init]
    if len(inits) != 2:
        raise ValueError(f"init must be one init or a pair (up_init, gate_init), got {init!r}")
    incoming = [(up, inits[0])] + ([(gate, inits[1])] if gate is not None else [])
    hidden = up.weight.shape[1] if is_conv1d(up) else up.weight.shape[0]
    mask = mask.to(device=up.weight.device, dtype=torch.bool)
    if mask.shape != (hidden,):
        raise ValueError(f"mask has shape {tuple(mask.shape)}, expected ({hidden},) = up's output width")
    for layer, _ in incoming[1:]:
        if layer.weight.shape[int(is_conv1d(layer))] != hidden:
            raise ValueError(f"gate has {layer.weight.shape[int(is_conv1d(layer))]} outputs, up has {hidden}")
    for layer, layer_init in incoming:
        w = layer.weight.mT if is_conv1d(layer) else layer.weight  # (out, in, *k): a view
        rows = _along(mask, w.dim(), 0)
        w.copy_(torch.where(rows, fresh_weights(w, layer_init, generator), w))
        zero_optimizer_state_slices(optimizer, layer.weight, mask, dim=int(is_conv1d(layer)))
        if getattr(layer, "bias", None) is not None:
            layer.bias.masked_fill_(mask, 0)
            zero_optimizer_state_slices(optimizer, layer.bias, mask, dim=0)
    if norm is not None:
        _reset_norm_channels(norm, mask, optimizer)
    return mask.sum()


@torch.no_grad()
def zero_outgoing(down: nn.Module, mask: torch.Tensor, optimizer=None, down_offset: int = 0, group: int = 1) -> None:
    """The second half of :func:`recycle_neurons`: zero the inputs ``down_offset + i`` (``group`` per
    unit) of ``down.weight`` for the masked units ``i``, and those columns' optimizer moments."""
    from ..core.model_map import is_conv1d

    hidden = mask.shape[0]
    mask = mask.to(device=down.weight.device, dtype=torch.bool)
    down_width = down.weight.shape[0] if is_conv1d(down) else down.weight.shape[1]
    if down_width < down_offset + hidden * group:
        raise ValueError(f"down reads {down_width} inputs, fewer than down_offset + up's "
                         f"{hidden} x group {group} = {down_offset + hidden * group}; groups/transposed convs are "
                         "not supported")
    down_mask = mask.repeat_interleave(group) if group > 1 else mask
    if down_width != down_mask.numel():  # pad to down's width: a slice copy, still no host sync
        padded = torch.zeros(down_width, dtype=torch.bool, device=mask.device)
        padded[down_offset:down_offset + down_mask.numel()] = down_mask
        down_mask = padded
    read_dim = 0 if is_conv1d(down) else 1
    down.weight.masked_fill_(_along(down_mask, down.weight.dim(), read_dim), 0)
    zero_optimizer_state_slices(optimizer, down.weight, down_mask, dim=read_dim)


def _reset_norm_channels(norm: nn.Module, mask: torch.Tensor, optimizer) -> None:
    """A recycled channel's BatchNorm starts as a fresh layer's: scale 1, shift 0, mean 0, variance 1."""
    for name, fresh in (("weight", 1.0), ("bias", 0.0), ("running_mean", 0.0), ("running_var", 1.0)):
        tensor = getattr(norm, name, None)
        if tensor is not None:
            tensor.masked_fill_(mask, fresh)
            if isinstance(tensor, nn.Parameter):
                zero_optimizer_state_slices(optimizer, tensor, mask, dim=0)
