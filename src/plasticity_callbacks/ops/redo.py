"""ReDo on a model, as plain calls: collect the neurons' activity, score it, recycle the dormant ones.

:class:`ActivationStats` (a context manager) watches the inputs of every neuron layer's ``down`` during the
forwards inside its block; :func:`redo_` recycles the neurons whose score is at most ``tau``;
:func:`recycle_` is the recycling alone, shared with :class:`~callbacks.redo.ReDoMonitor`.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn
from torch.nn.utils import parametrize

from ..distributed.strategy import rank_identical_generator
from ..functional.dormancy import INITS, Init, dormancy_scores, dormant_mask, mean_abs_activation
from ..model_map import HiddenUnits, Selection, find_neuron_layers, fresh_layer_weight
from ..model_map.experts import ExpertMatrix, expert_hidden
from ..model_map.neurons import candidates_hint, stores_in_out
from .neuron_reset import reinit_incoming, zero_outgoing

RECYCLE_INITS = ("model", *INITS)  # "model": rows of a fresh draw by the layer's own init code


class ActivationStats:
    """Mean ``|h|`` per neuron of every neuron layer, over the training-mode forwards run inside the block.

    ``h`` is what enters each layer's ``down`` (the activation's output, ``act(gate x) * up x`` for a gated
    MLP), read by a forward pre-hook, so no activation is re-implemented. Layers are found by the model map
    (:func:`~model_map.find_neuron_layers`: Hugging Face and torch MLPs, ``Linear/conv → act → Linear/conv``
    chains, declared layouts) or given. Hooks are removed on exit; the statistics stay readable. Eval-mode
    forwards are not counted, and a batch with NaN/Inf activations is skipped.

    Args:
        model: the module to watch (not compiled yet: a compiled graph never calls hooks added later).
        layers: the neuron layers; None: found by the model map.
        exclude: ``fnmatch`` patterns on parameter names whose layers are not watched.
        selection: which layers are watched (a :class:`~model_map.Selection` or a mapping of its fields).

    Raises:
        ValueError: the model map finds no neuron layer (pass ``layers`` or declare them).

    Example:
        >>> with ActivationStats(model) as stats:
        ...     for x, y in batches:
        ...         loss_fn(model(x), y).backward()
        >>> redo_(model, optimizer, stats, tau=0.1)
    """

    def __init__(self, model: nn.Module, layers: Sequence[HiddenUnits] | None = None,
                 exclude: Sequence[str] | None = None, selection: Selection | Mapping | None = None):
        self.layers = list(layers) if layers is not None else find_neuron_layers(model, None, exclude, selection)
        if not self.layers:
            raise ValueError(f"ActivationStats found no neuron layers: {candidates_hint(model)}. Pass "
                             "layers=find_neuron_layers(model, layer_map={name: (up, down)}) or "
                             "declare_plasticity(model, neurons=...)")
        self._sums = [torch.zeros(layer.width, device=layer.up.weight.device) for layer in self.layers]
        self._counts = [torch.zeros(layer.width, device=layer.up.weight.device) for layer in self.layers]
        self._hooks: list = []

    def __enter__(self) -> ActivationStats:
        experts: dict[int, tuple[nn.Module, ExpertMatrix, dict[int, int]]] = {}  # id(module) -> (module, up, {e: i})
        for index, layer in enumerate(self.layers):
            if layer.experts is not None:  # one hook on the experts module measures every routed expert
                experts.setdefault(id(layer.experts), (layer.experts, layer.up, {}))[2][layer.up.expert] = index
            else:
                self._hooks.append(layer.down.register_forward_pre_hook(self._collector(index)))
        for module, up, indices in experts.values():
            self._hooks.append(module.register_forward_pre_hook(self._expert_collector(up, indices), with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def _collector(self, index: int) -> Callable:
        @torch.no_grad()
        def collect(module: nn.Module, args: tuple) -> None:
            if module.training and args and torch.is_tensor(args[0]):
                self._add(index, args[0].detach())
        return collect

    def _expert_collector(self, up: ExpertMatrix, indices: Mapping[int, int]) -> Callable:
        @torch.no_grad()
        def collect(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if module.training:  # each routed expert's units, on the tokens routed to it
                for expert, h in expert_hidden(module, args, kwargs, up.attr, up.transposed):
                    if expert in indices:
                        self._add(indices[expert], h)
        return collect

    def _add(self, index: int, h: torch.Tensor) -> None:
        units, unit = self.layers[index].unit_activity(h)
        activity = mean_abs_activation(units, unit).float()
        finite = torch.isfinite(activity).all()  # a mask, not an `if`: no host sync per forward
        self._sums[index] += torch.where(finite, activity, 0.0)
        self._counts[index] += finite.float()

    def scores(self) -> dict[str, torch.Tensor]:
        """``{layer name: score per neuron}``: mean ``|h|`` over the layer's mean (1 = an average neuron); a
        neuron never observed scores NaN, which no ``tau`` counts as dormant."""
        scores = {}
        for layer, total, count in zip(self.layers, self._sums, self._counts):
            seen = count > 0  # the layer's mean is over the neurons observed (a recycled one: not yet)
            score = torch.full_like(total, float("nan"))
            score[seen] = dormancy_scores(total[seen] / count[seen])
            scores[layer.name] = score
        return scores

    def forget(self, masks: Mapping[str, torch.Tensor]) -> None:
        """Start the masked neurons' statistics over (recycled neurons are new neurons)."""
        for layer, total, count in zip(self.layers, self._sums, self._counts):
            if layer.name in masks:
                total.masked_fill_(masks[layer.name].to(total.device), 0.0)
                count.masked_fill_(masks[layer.name].to(count.device), 0.0)


def recycle_(model: nn.Module, layers: Sequence[HiddenUnits], masks: Mapping[str, torch.Tensor], optimizers=None,
             init: str | Callable[[int, HiddenUnits], Init | Sequence[Init]] = "weight_std", seed: int = 0,
             owner: str = "redo_") -> dict[str, torch.Tensor]:
    """Recycle the masked neurons of each layer: fresh incoming rows (and gate rows), zero biases, zero outgoing
    columns and zero optimizer moments of exactly those slices; return ``{layer name: how many}`` (0-d tensors).

    Every layer's incoming rows are re-drawn before any outgoing column is zeroed (the ReDo reference's
    order): where one layer's ``down`` is the next one's ``up``, a weight joining two recycled neurons ends at 0.

    Args:
        model: the model the layers belong to (``init="model"`` draws with its init code).
        layers: the neuron layers (e.g. :attr:`ActivationStats.layers`).
        masks: ``{layer name: (width,) bool}``, the neurons to recycle.
        optimizers: an optimizer, a list of them, or None (no moments to zero).
        init: a name in ``RECYCLE_INITS`` (``"model"``: rows of a fresh draw by the layer's own init code), or
            ``init(index, layer)`` giving :func:`~ops.neuron_reset.reinit_incoming`'s ``init``.
        seed: mixed with the layer's index into the draw's generator; pass the same on every rank.
        owner: the caller's name, for messages.

    Raises:
        RuntimeError: a layer is factorized (``W_p + BA``), whose recycled rows would not reach the weight.
    """
    factorized = [layer.name for layer in layers
                  if any(m is not None and parametrize.is_parametrized(m, "weight")
                         for m in (layer.up, layer.gate, layer.down))]
    if factorized:
        raise RuntimeError(f"{owner}: layers {factorized} are factorized by "
                           "AdaptiveSVDSwitch(minor_training='factorize'), so recycled rows and columns would not "
                           "reach the effective weight; use AdaptiveSVDSwitch(minor_training='project') or exclude "
                           "them from one of the two")
    if not callable(init) and init not in RECYCLE_INITS:
        raise ValueError(f"{owner}: init={init!r} is not one of {RECYCLE_INITS}")
    counts = {}
    for index, layer in enumerate(layers):
        generator = rank_identical_generator(seed, index, device=layer.up.weight.device)
        if callable(init):
            layer_init = init(index, layer)
        elif init == "model":
            layer_init = [model_draw(model, m, generator.initial_seed() + i)
                          for i, m in enumerate((layer.up, layer.gate or layer.up))]
        else:
            layer_init = init
        reinit_incoming(layer.up, layer.incoming_mask(masks[layer.name]), layer.gate, layer_init, optimizers,
                        generator, norm=layer.norm)
        counts[layer.name] = masks[layer.name].sum()
    for layer in layers:  # outgoing columns only after every re-initialization
        zero_outgoing(layer.down, masks[layer.name], optimizers, layer.down_offset, group=layer.group)
    return counts


def redo_(model: nn.Module, optimizers, stats: ActivationStats, tau: float = 0.1, init: str = "weight_std",
          seed: int = 0) -> dict[str, torch.Tensor]:
    """ReDo (Sokar et al., 2023) in place: recycle every neuron whose score in ``stats`` is at most ``tau``,
    then start those neurons' statistics over.

    Args:
        model: the model ``stats`` watched.
        optimizers: an optimizer, a list of them, or None; the recycled slices' moments are zeroed.
        stats: the activity collected by :class:`ActivationStats`.
        tau: dormancy threshold on the score (ReDo: 0.025 or 0.1; 0 = exactly dead).
        init: how fresh rows are drawn: ``weight_std`` (``N(0, σ)``, σ the layer's std now), ``model`` (the
            layer's own init code), ``default`` (``reset_parameters``) or ``xavier_uniform``.
        seed: the draw's seed (vary it between calls, e.g. the step); the same on every rank.

    Returns:
        ``{layer name: neurons recycled}`` (0-d tensors: no host sync).

    Example:
        >>> with ActivationStats(model) as stats:
        ...     train_some_steps(model)
        >>> recycled = redo_(model, optimizer, stats, tau=0.1, seed=step)
    """
    masks = {name: dormant_mask(score, tau) for name, score in stats.scores().items()}
    counts = recycle_(model, stats.layers, masks, optimizers, init, seed)
    stats.forget(masks)
    return counts


def model_draw(model: nn.Module, layer: nn.Module, seed: int) -> torch.Tensor:
    """A fresh weight of ``layer`` by its model's init, in ``(out, in)`` orientation (recycling's rows)."""
    if isinstance(layer, ExpertMatrix):  # the experts module's own init draws the whole stack
        weight = fresh_layer_weight(model, layer.owner, seed, attr=layer.attr)[layer.expert]
    else:
        weight = fresh_layer_weight(model, layer, seed)
    return weight.transpose(0, 1) if stores_in_out(layer) else weight
