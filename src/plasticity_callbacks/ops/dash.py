"""DASH's shrink on a model: each selected weight row scaled by a factor from its direction (no Lightning).

The factor rules are :mod:`plasticity_callbacks.functional.shrink`'s; this module picks the layers through the
model map and writes the shrink back (a grouped transposed conv's ``(out, in)`` view, FSDP2's rows). A weight a
parametrization computes is shrunk through weight norm's ``g`` (each output row of ``g·v/‖v‖`` by its factor, from
the forward's weight and its descent direction) and refused by name under any other (:data:`DASH_THROUGH`).
"""
from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from ..distributed.sharding import sharded_shrink_, sharded_vector_shrink_
from ..distributed.strategy import is_dtensor, warn_on_rank_zero
from ..functional.shrink import apply_shrink_, dash_shrink_factors
from ..model_map import Selection, WeightView, refuse_factorized, require_targets, select_targets
from .optimizer_state import owning_optimizer

FactorRule = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (weight, direction) -> one factor per row
# How DASH meets each parametrization: "" acts through it, else why it is left alone. Its factors compare a row of
# the forward's weight with that row's descent direction, and the shrink must reach the forward's weight.
DASH_THROUGH = {
    "weight norm": "",  # g scales each row; the weight's direction is rebuilt from g's and v's (_weight_norm_shrink_)
    "spectral norm": "the forward divides the original by its largest singular value, which undoes a shrink",
    "orthogonal": "an orthogonal weight cannot be shrunk",
}


@dataclass(frozen=True)
class ShrinkLayer:
    """One layer DASH treats: its weight's ``(out, in)`` view (one factor per output neuron) and its bias."""

    name: str  # module name, e.g. "net.0" (metric names use it)
    view: WeightView
    bias: nn.Parameter | None  # shrunk with one scalar factor from the whole bias vector

    @property
    def weight(self) -> nn.Parameter:
        return self.view.param


def shrink_layers(model: nn.Module, selection: Selection | None = None, optimizers=None, shrink_bias: bool = True,
                  skip_muon_params: bool = True, owner: str = "dash_") -> list[ShrinkLayer]:
    """The layers a DASH rule shrinks: the weights ``selection`` picks (every hidden weight but the head by
    default), each with its bias when ``shrink_bias``, without the weights ``torch.optim.Muon`` optimizes when
    ``skip_muon_params`` (``optimizers`` tells which).

    Raises:
        ValueError: the selection finds nothing, or only Muon-optimized weights with ``skip_muon_params``.
    """
    selection = selection or Selection()
    targets = require_targets(select_targets(model, selection), owner, selection, DASH_THROUGH)
    rowless = [t for t in targets if t.through is not None and (t.transposed or t.through.norm_dim != 0)]
    if rowless:  # weight norm over another dim (an (in, out) layer, dim=1, dim=None): g scales no output row
        warnings.warn(f"{owner} leaves alone " + "; ".join(
            f"{t.name} (weight norm over dim {t.through.norm_dim}: its g scales no output row; to treat it, "
            f"{t.through.removal()} first, or exclude it)" for t in rowless), stacklevel=2)
        targets = [t for t in targets if t not in rowless]
        if not targets:
            raise ValueError(f"{owner}: every selected weight is left alone (see the warning above)")
    if skip_muon_params and optimizers is not None:
        targets = [t for t in targets if not isinstance(owning_optimizer(optimizers, t.param), torch.optim.Muon)]
        if not targets:
            raise ValueError(f"{owner}: every selected weight is optimized by torch.optim.Muon and "
                             "skip_muon_params=True; set skip_muon_params=False, or select AdamW-managed "
                             "weights (e.g. selection={include_head: true})")
    module_names = {id(m): n for n, m in model.named_modules()}
    layers = []
    for t in targets:
        bias = getattr(t.module, "bias", None) if t.kind in ("linear", "conv") and shrink_bias else None
        bias = bias if isinstance(bias, nn.Parameter) and bias.requires_grad else None
        layers.append(ShrinkLayer(module_names[id(t.module)] if t.kind != "matrix" else t.name, t, bias))
    return layers


@torch.no_grad()
def shrink_layers_(layers: list[ShrinkLayer], direction_of: Callable[[torch.Tensor], torch.Tensor | None],
                   factor_rule: FactorRule, owner: str = "dash_") -> list[tuple[str, torch.Tensor]]:
    """Shrink every layer in place by ``factor_rule(weight, direction)``; return ``(layer name, row factors)``
    of the layers that had a direction.

    Args:
        layers: from :func:`shrink_layers`.
        direction_of: the gradient-like tensor stored like a parameter (``None``: skip it); compared with the
            weight in ``(out, in)`` orientation, one factor per output neuron.
        factor_rule: e.g. :func:`~functional.shrink.dash_shrink_factors` with its ``lam`` bound.
        owner: the caller's name, for messages.

    Raises:
        RuntimeError: a layer is factorized (``W_p + BA``) or parametrized (weight norm, ...), whose effective weight
            has no gradient of its own.
    """
    refuse_factorized([layer.view for layer in layers], owner, "DASH needs the gradient of the effective weight")
    refused = [layer.view.name for layer in layers if layer.view.through is not None and (
        DASH_THROUGH.get(layer.view.through.kind) != "" or layer.view.transposed or layer.view.through.norm_dim != 0
        or is_dtensor(layer.weight))]
    if refused:  # shrink_layers leaves them out; a hand-built list must too
        raise RuntimeError(f"{owner}: {refused} are computed by a parametrization DASH does not act through here "
                           "(DASH_THROUGH; weight norm over dim 0 of an (out, in) weight, unsharded, is shrunk)")
    stats = []
    for layer in layers:
        direction = direction_of(layer.weight)
        if direction is None:
            continue
        if layer.view.through is not None:  # weight norm: through g
            weight_factors = _weight_norm_shrink_(layer.view, direction_of, factor_rule)
            if weight_factors is None:
                continue
        elif is_dtensor(layer.weight):  # FSDP2: each rank scales the rows it holds
            weight_factors = sharded_shrink_(layer.view, direction, factor_rule)
        else:
            weight = layer.view.read()  # a view: shrinking it shrinks the parameter
            weight_factors = factor_rule(weight, layer.view.oriented(direction))
            apply_shrink_(weight, weight_factors)
            layer.view.write(weight)  # a grouped transposed conv's (out, in) view is a copy
        if layer.bias is not None and (bias_direction := direction_of(layer.bias)) is not None:
            if is_dtensor(layer.bias):
                sharded_vector_shrink_(layer.bias, bias_direction, factor_rule)
            else:
                apply_shrink_(layer.bias, factor_rule(layer.bias, bias_direction))
        stats.append((layer.name, weight_factors.detach().flatten()))
    return stats


def _weight_norm_shrink_(view: WeightView, direction_of: Callable[[torch.Tensor], torch.Tensor | None],
                         factor_rule: FactorRule) -> torch.Tensor | None:
    """Shrink each row of ``W = g·v/‖v‖`` (norm per output row) by its factor, through ``g``; None without directions.

    ``W``'s own direction is rebuilt from ``g``'s and ``v``'s by the chain rule through ``W_i = g_i·v_i/‖v_i‖``:
    ``∂L/∂g_i = ⟨G_i, v̂_i⟩`` and ``∂L/∂v_i = (g_i/‖v_i‖)·(G_i − ⟨G_i, v̂_i⟩·v̂_i)`` give
    ``G_i = (‖v_i‖/g_i)·∂L/∂v_i + ∂L/∂g_i·v̂_i`` (a row with ``g_i = 0`` is zero: its factor changes nothing). A
    direction is linear in the gradients, so an EMA of them rebuilds the EMA of ``G`` while ``g, v`` stay fixed.
    """
    g, v = view.through.originals
    g_direction, v_direction = direction_of(g), direction_of(v)
    if g_direction is None or v_direction is None:
        return None
    norms = torch.norm_except_dim(v, 2, 0)  # (out, 1, ...), shaped like g
    scale = torch.where(g == 0, torch.zeros_like(g), norms / torch.where(g == 0, torch.ones_like(g), g))
    direction = v_direction * scale + g_direction * (v / norms)
    factors = factor_rule(view.read(), direction)  # one per output row; (out, in) is the stored orientation here
    g.mul_(factors.reshape(g.shape).to(g.dtype))
    return factors


def dash_(model: nn.Module, optimizers=None, min_factor: float = 0.3, selection: Selection | None = None,
          directions: Mapping[torch.Tensor, torch.Tensor] | None = None, shrink_bias: bool = True,
          skip_muon_params: bool = True) -> dict[str, torch.Tensor]:
    """DASH (Shin et al., 2024) in place: each row of a selected weight times ``clamp(cos(G, W), min_factor, 1)``.

    ``G`` is the descent direction: by default the negative of the gradient each parameter holds now (call it
    after ``loss.backward()``, before ``optimizer.step()``); the paper's is an EMA of ``−grad`` over some
    batches, which ``directions`` can pass. The optimizer state is left alone, as in the paper.

    Args:
        model: any ``nn.Module`` the model map reads.
        optimizers: an optimizer, a list of them or None: only to leave Muon's weights alone
            (``skip_muon_params``).
        min_factor: the smallest factor λ in [0, 1] (paper: 0.3).
        selection: which weights (a :class:`~model_map.Selection`); None: every hidden weight but the head.
        directions: ``{parameter: G}`` stored like the parameter; None: ``−p.grad``.
        shrink_bias: also shrink a selected layer's bias, by one factor from the whole bias vector.
        skip_muon_params: leave alone the weights ``torch.optim.Muon`` optimizes.

    Returns:
        ``{layer name: its row factors}`` (1: untouched); empty, with a warning, when no weight had a direction.

    Raises:
        ValueError: the selection finds no weight.

    Example:
        >>> loss.backward()
        >>> dash_(model, optimizer, min_factor=0.3)   # before optimizer.step()
    """
    layers = shrink_layers(model, selection, optimizers, shrink_bias, skip_muon_params)
    if directions is None:
        def direction_of(p):
            return None if p.grad is None else -p.grad
    else:
        direction_of = directions.get
    stats = shrink_layers_(layers, direction_of, lambda w, d: dash_shrink_factors(w, d, min_factor))
    if not stats:
        warn_on_rank_zero("dash_: no selected weight had a gradient (or a direction), nothing was shrunk; call it "
                          "after loss.backward(), with the weights trainable")
    return dict(stats)
