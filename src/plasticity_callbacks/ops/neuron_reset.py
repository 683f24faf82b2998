"""Recycling dormant neurons in a model (ReDo): fresh incoming rows, zero outgoing columns, their optimizer state.

A neuron ``i`` of a layer is row ``i`` of its incoming weight ``up`` (and ``gate``) and column ``i`` of its
outgoing weight ``down``; which neurons are dormant comes from :mod:`plasticity_callbacks.functional.dormancy`.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from ..functional.dormancy import Init, fresh_weights
from ..model_map.experts import ExpertMatrix
from ..model_map.neurons import in_features, out_features, stores_in_out
from .optimizer_state import zero_optimizer_state_slices
from ..distributed.sharding import local_part


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
    """Re-sample the masked rows of ``up`` (and ``gate``), zero their biases, reset ``norm``'s channels and
    those slices' optimizer moments; return how many neurons (a 0-D tensor, no host sync).

    Args:
        up: the layer whose output units are the neurons (``nn.Linear``, conv, transposed conv, HF ``Conv1D``,
            one expert's :class:`~model_map.experts.ExpertMatrix`).
        mask: ``(hidden,)`` bool, the neurons to recycle.
        gate: the gate projection of a gated MLP (its rows are re-sampled too).
        init: how to draw a fresh row (see :func:`~functional.dormancy.fresh_weights`);
            a pair ``(up_init, gate_init)`` gives each layer its own.
        optimizer: an optimizer, a list of them or None: the moments of exactly those rows are zeroed
            (``step`` is kept: PyTorch keeps one counter per tensor, so resetting it would restart
            Adam's bias correction for every row of the layer, as the ReDo reference also avoids).
        generator: the random generator of the fresh rows.
        norm: a BatchNorm between ``up`` and the activation; the recycled channels start as a fresh layer's.

    When several layers are recycled at once and one layer's ``down`` is the next one's ``up`` (a
    plain MLP), call this for every layer first and :func:`zero_outgoing` after, as the ReDo
    reference does: a weight ``down[j, i]`` whose neurons ``i`` and ``j`` are both recycled then ends at
    0, not re-sampled. Rows are those of each weight's ``(out, in)`` orientation (HF ``Conv1D`` is
    transposed here).

    Example:
        >>> mask = dormant_mask(dormancy_scores(mean_abs), 0.025)
        >>> reinit_incoming(fc1, mask, optimizer=opt); zero_outgoing(fc2, mask, optimizer=opt)
    """
    inits = list(init) if isinstance(init, (list, tuple)) else [init, init]
    if len(inits) != 2:
        raise ValueError(f"init must be one init or a pair (up_init, gate_init), got {init!r}")
    incoming = [(up, inits[0])] + ([(gate, inits[1])] if gate is not None else [])
    hidden = out_features(up)
    mask = mask.to(device=up.weight.device, dtype=torch.bool)
    if mask.shape != (hidden,):
        raise ValueError(f"mask has shape {tuple(mask.shape)}, expected ({hidden},) = up's output width")
    for layer, _ in incoming[1:]:
        if out_features(layer) != hidden:
            raise ValueError(f"gate has {out_features(layer)} outputs, up has {hidden}")
    for layer, layer_init in incoming:
        dim = int(stores_in_out(layer))  # the units' dim of the stored weight ((in, out) layouts: 1)
        # The whole weight's fresh draw, as on one process; under FSDP2 each rank keeps its own rows of it.
        fresh = fresh_weights(layer.weight.transpose(0, 1) if dim else layer.weight, layer_init, generator)
        local, rows = local_part(layer.weight)
        units = mask[rows] if dim == 0 else mask
        local.copy_(torch.where(_along(units, local.dim(), dim), (fresh.transpose(0, 1) if dim else fresh)[rows],
                                local))
        zero_unit_state(optimizer, layer, "weight", mask, dim)
        if getattr(layer, "bias", None) is not None:
            bias, rows = local_part(layer.bias)
            bias.masked_fill_(mask[rows], 0)
            zero_unit_state(optimizer, layer, "bias", mask, 0)
    if norm is not None:
        reset_norm_channels(norm, mask, optimizer)
    return mask.sum()


@torch.no_grad()
def zero_outgoing(down: nn.Module, mask: torch.Tensor, optimizer=None, down_offset: int = 0, group: int = 1) -> None:
    """Zero the inputs ``down_offset + i`` (``group`` per unit) of ``down.weight`` for the masked units ``i``,
    and those columns' optimizer moments. With zero outgoing columns the network's output does not
    change when the incoming rows are re-sampled; ``down.bias`` is left alone.

    Example:
        >>> zero_outgoing(fc2, mask, optimizer=opt)   # after reinit_incoming(fc1, mask, ...)
    """
    hidden = mask.shape[0]
    mask = mask.to(device=down.weight.device, dtype=torch.bool)
    down_width = in_features(down)
    if down_width < down_offset + hidden * group:
        raise ValueError(f"down reads {down_width} inputs, fewer than down_offset + up's "
                         f"{hidden} x group {group} = {down_offset + hidden * group}; grouped convs are not supported")
    down_mask = mask.repeat_interleave(group) if group > 1 else mask
    if down_width != down_mask.numel():  # pad to down's width: a slice copy, still no host sync
        padded = torch.zeros(down_width, dtype=torch.bool, device=mask.device)
        padded[down_offset:down_offset + down_mask.numel()] = down_mask
        down_mask = padded
    read_dim = 0 if stores_in_out(down) else 1
    local, rows = local_part(down.weight)  # FSDP2: each rank zeroes the columns in its own rows
    here = down_mask[rows] if read_dim == 0 else down_mask
    local.masked_fill_(_along(here, local.dim(), read_dim), 0)
    zero_unit_state(optimizer, down, "weight", down_mask, read_dim)


def zero_unit_state(optimizer, layer, attr: str, mask: torch.Tensor, dim: int) -> None:
    """Zero the optimizer moments of ``layer.<attr>`` where ``mask`` is set along ``dim``; for one expert's
    matrix, those of its slice of the stacked parameter only."""
    if isinstance(layer, ExpertMatrix):
        stack = layer.stack if attr == "weight" else layer.bias_stack
        zero_optimizer_state_slices(optimizer, stack, mask, dim=dim + 1, index=layer.expert)
    else:
        zero_optimizer_state_slices(optimizer, getattr(layer, attr), mask, dim=dim)


def reset_norm_channels(norm: nn.Module, mask: torch.Tensor, optimizer) -> None:
    """A recycled channel's BatchNorm starts as a fresh layer's: scale 1, shift 0, mean 0, variance 1; the
    optimizer state of its scale and shift is zeroed there (``optimizer=None``: left as it is). Under FSDP2
    each rank writes the channels it holds."""
    for name, fresh in (("weight", 1.0), ("bias", 0.0), ("running_mean", 0.0), ("running_var", 1.0)):
        tensor = getattr(norm, name, None)
        if tensor is not None:
            local, rows = local_part(tensor)
            local.masked_fill_(mask[rows], fresh)
            if isinstance(tensor, nn.Parameter):
                zero_optimizer_state_slices(optimizer, tensor, mask, dim=0)


def _along(mask: torch.Tensor, ndim: int, dim: int) -> torch.Tensor:
    shape = [1] * ndim
    shape[dim] = -1
    return mask.reshape(shape)
