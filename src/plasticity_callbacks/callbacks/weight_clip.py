"""``WeightClip``: after every optimizer step, every layer's weights stay within ``±κ`` times their init bound."""
from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn

from ..arguments import check_number
from ..model_map import Selection, is_conv1d
from ..model_map.parametrized import ParametrizedWeight, parametrized_weight
from ..model_map.patterns import name_selection
from ..model_map.select import weight_views
from ..model_map.stacks import expert_bias_of
from ..model_map.weights import CONV_TRANSPOSE, is_layer
from ..distributed.sharding import fraction_over_shards, local_part
from ..distributed.strategy import is_dtensor
from ..functional.anchors import clip_to_bounds_, fan_in_bound
from .base import PlasticityCallback


# Why WeightClip leaves a parametrization alone: it clips the weight the forward computes, and only weight norm
# can carry the clipped weight back (g = row norms, v = the weight); the others would move it off the box again.
CLIP_THROUGH = {
    "weight norm": "",
    "spectral norm": "the forward divides the clipped original by its largest singular value, which moves it off "
                     "the box again",
    "orthogonal": "an orthogonal weight's entries are fixed by its isometry and cannot be clipped",
}


def clip_bounds(model: nn.Module) -> tuple[dict[str, tuple[nn.Parameter, float]], dict[str, str]]:
    """``({name: (parameter, init bound)}, {name: why not clipped})`` over every trainable parameter of ``model``.

    Bounds: ``1/√fan_in`` of one ``(out, in)`` matrix (Linear, conv, transposed conv as PyTorch inits it, HF
    ``Conv1D``, ``nn.MultiheadAttention``'s ``in_proj_weight`` and ``q/k/v_proj_weight``, a router, each expert
    matrix of a 3-D stack), shared by the layer's bias (an expert's bias by its matrix's); ``1/√hidden_size`` for
    every weight and bias of ``nn.LSTM``/``GRU``/``RNN`` (PyTorch's init of each).

    Example:
        >>> bounds, left = clip_bounds(model)
        >>> left["model.norm.weight"]
        'no fan-in bound (norm, embedding or 1-D parameter)'
    """
    bounds, _, left = _clip_bounds(model)
    return bounds, left


def parametrized_clip_bounds(model: nn.Module) -> dict[str, tuple[ParametrizedWeight, float]]:
    """``{name: (its parametrization, init bound)}`` of every weight :func:`clip_bounds` bounds that a
    parametrization computes (weight norm, spectral norm, ...), by the effective weight's name.

    Example:
        >>> parametrized_clip_bounds(model)["fc.weight"][0].kind
        'weight norm'
    """
    return _clip_bounds(model)[1]


def _clip_bounds(model: nn.Module):
    bounds: dict[str, tuple[nn.Parameter, float]] = {}
    computed: dict[str, tuple[ParametrizedWeight, float]] = {}

    def add(module_name: str, attr: str, bound: float) -> None:
        module = model.get_submodule(module_name)
        param, name = module._parameters.get(attr), f"{module_name}.{attr}" if module_name else attr
        if isinstance(param, nn.Parameter):
            bounds.setdefault(name, (param, bound))
        elif (through := parametrized_weight(module, attr)) is not None:
            computed.setdefault(name, (through, bound))

    for module_name, module in model.named_modules():
        if is_layer(module) or isinstance(module, CONV_TRANSPOSE):
            bound = fan_in_bound(module.weight, stored_in_out=is_conv1d(module))  # transposed conv: as PyTorch inits
            add(module_name, "weight", bound)
            add(module_name, "bias", bound)
        elif isinstance(module, nn.MultiheadAttention):
            add(module_name, "in_proj_weight", 1 / math.sqrt(module.embed_dim))
            add(module_name, "in_proj_bias", 1 / math.sqrt(module.embed_dim))
            for attr in ("q_proj_weight", "k_proj_weight", "v_proj_weight"):
                weight = module._parameters.get(attr)
                if weight is not None:
                    add(module_name, attr, 1 / math.sqrt(weight.shape[1]))
        elif isinstance(module, nn.RNNBase):
            for attr, _ in module.named_parameters(recurse=False):
                add(module_name, attr, 1 / math.sqrt(module.hidden_size))
    for module_name, view in weight_views(model):
        if view.kind != "matrix" or view.name in bounds or view.through is not None:
            continue  # a parametrized matrix: add() above recorded it by its effective weight
        module = view.module
        bound = 1 / math.sqrt(view.shape[1])  # one matrix's fan-in: an expert's own, not the stack's
        bounds[view.name] = (view.param, bound)
        add(module_name, "bias", bound)  # a router's bias
        for attr, param in module.named_parameters(recurse=False):
            if expert_bias_of(module, param) is view.param:
                add(module_name, attr, bound)
    originals = {id(p): name for name, (through, _) in computed.items() for p in through.originals}
    left = {}
    for name, param in model.named_parameters():
        if id(param) in originals:
            continue  # WeightClip clips or refuses the weight it computes, by that weight's name
        if name not in bounds and param.requires_grad:
            left[name] = ("no fan-in bound (norm, embedding or 1-D parameter)" if param.dim() < 2 or "norm" in name
                          or _is_embedding(model, name) else "not a linear map the model map knows (see its "
                          "coverage table)")
    return bounds, computed, left


def _is_embedding(model: nn.Module, name: str) -> bool:
    owner = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
    return isinstance(owner, (nn.Embedding, nn.EmbeddingBag))


class WeightClip(PlasticityCallback):
    """Weight clipping (Elsayed, Lan, Lyle & Mahmood, 2024): ``θ ← clamp(θ, ±κ·b)`` after each optimizer step.

    ``b`` is the layer's init bound ``1/√fan_in`` (PyTorch's default uniform init of a Linear/conv weight
    and of its bias; fan-in over the kernel for a conv, the rows of a Hugging Face ``Conv1D``), the
    reference code's (``mohmdelsayed/weight-clipping``, ``InitBounds``) choice. Clipped, the output head
    too (the reference's ``clip_last_layer=True``): every ``nn.Linear``, conv, transposed conv and
    ``Conv1D`` weight and bias; ``nn.MultiheadAttention``'s ``in_proj_weight`` (or ``q/k/v_proj_weight``)
    and ``in_proj_bias``; every ``nn.LSTM``/``GRU``/``RNN`` weight and bias (bound ``1/√hidden_size``, their
    init); mixture-of-experts routers and 3-D expert stacks with their biases (the bound from one expert
    matrix's own fan-in), see :func:`clip_bounds`. Norms, embeddings and other parameters have no fan-in
    bound and are left alone; the fit-start message names them. A weight under weight norm is clipped as the
    forward computes it (``g·v/‖v‖``) and written back through ``g`` and ``v``; one under spectral norm or
    orthogonal is refused by name in a warning (:data:`CLIP_THROUGH` says why). Acts in ``on_train_batch_end`` of every batch whose
    optimizer stepped (so once per accumulated step); deterministic, hence identical on every DDP rank (under FSDP2 each rank clips its shard);
    stateless across a resume (the bounds follow from the shapes). Logs ``weight_clip/clipped``, the
    fraction of clipped entries that were outside their box before the step's clip.

    Args:
        kappa: ``κ`` > 0, the box in units of the init bound (the paper sweeps 1 to 4; the reference code's
            default is 1).
        selection: name patterns (a Selection or a mapping with ``include``/``exclude``, ``fnmatch`` on
            parameter names) of the weights and biases to clip; None: every layer weight and bias.

    Example:
        >>> trainer = L.Trainer(callbacks=[WeightClip(kappa=2.0)], max_steps=10_000)
        >>> trainer.fit(module, datamodule)   # |w| <= 2/√fan_in in every layer after every step
    """

    supports_fsdp2 = True  # FSDP2: elementwise on each rank's shard
    every_step_hook = "on_train_batch_end"  # clips after every optimizer step
    quick_settings = {"kappa": 0.1}  # a bound the first steps reach
    summary_metrics = ("weight_clip/clipped",)
    default_schedule = None  # clips after every optimizer step

    def __init__(self, kappa: float = 2.0, selection: Selection | Mapping | None = None):
        check_number("kappa", kappa, 0.0, hint="(paper: 1 to 4)", low_open=True)
        super().__init__(selection=name_selection(selection, "WeightClip"))
        self.kappa = float(kappa)
        self._params: list[torch.nn.Parameter] = []
        self._bounds: list[float] = []
        self._through: list[tuple[ParametrizedWeight, float]] = []  # weight norm: clipped as the forward uses it
        self._last_step = -1

    @property
    def state_key(self) -> str:
        return self._generate_state_key(kappa=self.kappa, include=self.selection.include,
                                        exclude=self.selection.exclude)

    def check_targets(self, trainer, pl_module) -> None:
        left, refused = self._resolve(pl_module)
        if refused:
            rank_zero_warn("WeightClip leaves alone " + "; ".join(f"{name} ({why})" for name, why in refused.items()))
        others = ", ".join(f"{name} ({why})" for name, why in sorted(left.items()))
        rank_zero_info(f"WeightClip keeps {len(self._params)} weights/biases within ±{self.kappa}·init bound "
                       f"(1/√fan_in); not clipped: {others or 'nothing'}")

    def _resolve(self, pl_module) -> tuple[dict[str, str], dict[str, str]]:
        """The clipped parameters and their bounds, as the model holds them now (FSDP2 replaces them in
        ``configure_model``, after setup); returns the trainable ones left alone, with why, and the parametrized
        weights refused (:data:`CLIP_THROUGH`), with why and the fix."""
        bounds, computed, left = _clip_bounds(pl_module)
        self._params, self._bounds, self._through, refused = [], [], [], {}
        for name, (through, bound) in computed.items():
            if not any(p.requires_grad for p in through.originals) or not self.selection.matches(name):
                continue
            if any(is_dtensor(p) for p in through.originals):
                raise NotImplementedError(f"WeightClip: {name} is computed by a parametrization ({through.kind}) and "
                                          "sharded by FSDP2; remove the parametrization or exclude the weight")
            why = CLIP_THROUGH.get(through.kind, f"WeightClip does not act through a {through.kind} parametrization")
            if why:
                refused[name] = f"{through.kind}: {why}; to clip it, {through.removal()} first, or exclude it"
            else:
                self._through.append((through, bound))
        for name, (param, bound) in bounds.items():
            if not param.requires_grad:
                continue
            if self.selection.matches(name):
                self._params.append(param)
                self._bounds.append(bound)
            else:
                left[name] = "excluded by the selection"
        if not self._params and not self._through:
            raise ValueError(f"WeightClip found no weight with an init bound matching "
                             f"include={self.selection.include}, exclude={self.selection.exclude}"
                             + (f"; left alone: {refused}" if refused else ""))
        return left, refused

    def attach(self, trainer, pl_module) -> None:
        self._resolve(pl_module)
        self._last_step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if trainer.global_step == self._last_step:  # an accumulating batch: the optimizer did not step
            return
        self._last_step = trainer.global_step
        if self.skip_nonfinite(trainer, pl_module, "the clipping"):
            return
        shards = [local_part(p)[0] for p in self._params]  # FSDP2: each rank clips the rows it holds
        clipped = fraction_over_shards(clip_to_bounds_(shards, self._bounds, self.kappa), shards, self._params)
        if self._through:
            outside, computed = 0, 0
            for through, bound in self._through:
                weight = through.read()  # as the forward computes it
                limit = self.kappa * bound
                over = int((weight.abs() > limit).sum())
                if over:  # rewritten only when clipped: a write rescales v, which sets the step size of g·v/‖v‖
                    through.write(weight.clamp_(-limit, limit))  # weight norm carries it exactly
                outside, computed = outside + over, computed + weight.numel()
            plain = sum(p.numel() for p in self._params)
            clipped = (clipped.double().cpu() * plain + outside) / (plain + computed)
        # measured at every optimizer step: Lightning writes the series at its log_every_n_steps cadence
        pl_module.log("weight_clip/clipped", clipped.float(), on_step=True, on_epoch=False)
