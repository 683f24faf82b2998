"""``L2Init``: regenerative regularization, a pull ``(λ/2)‖θ - θ₀‖²`` toward the initial parameters."""
from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn
from lightning.pytorch.utilities import rank_zero_info

from ..arguments import check_number
from ..model_map import Selection
from ..model_map.patterns import matching_parameters, name_selection
from ..distributed.sharded_state import copies_of, squared_distance, state_copy
from .step_logging import log_at_step
from ..functional.anchors import l2_init_grad_
from .base import PlasticityCallback

NORMS = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase)


class L2Init(PlasticityCallback):
    """L2-Init (Kumar, Marklund & Van Roy, 2023): training minimizes ``loss + (λ/2)‖θ - θ₀‖²``.

    The user's ``training_step`` is unchanged: in ``on_before_optimizer_step`` (gradients are then
    complete, all-reduced under DDP and unscaled under mixed precision, and gradient clipping has not
    run yet, so the term is clipped with the loss's gradient as it would be inside the loss) every
    selected parameter's gradient gets ``λ(θ - θ₀)``. ``θ₀`` is the parameters at the start of the
    first fit (identical on every rank: DDP broadcasts rank 0's weights before any callback runs), kept
    in ``state_dict``, so a resumed run pulls toward the same point. Under FSDP2 each rank keeps ``θ₀`` of its
    own shard and pulls its gradient shard (:mod:`~distributed.sharded_state`: how it is saved). The ``½`` and the
    parameters follow the authors' code (``skumar9876/L2_Init``, ``L2InitAgent``: ``λ·0.5·Σ(θ - θ₀)²``, so the
    paper's λ sweeps mean the same here): every trainable parameter except those of normalization layers (LayerNorm, RMSNorm,
    BatchNorm, GroupNorm; ``include_norms=True`` pulls them too); ``selection``'s name patterns narrow it.
    Logs ``l2_init/distance`` (``‖θ - θ₀‖``, before the step's update) at the global steps that are multiples of
    ``trainer.log_every_n_steps``, once each (:func:`~callbacks.step_logging.log_at_step`).

    Args:
        strength: ``λ`` > 0 (the paper sweeps 1e-2 to 1e-5).
        include_norms: also pull the parameters of normalization layers.
        selection: name patterns (a Selection or a mapping with ``include``/``exclude``, ``fnmatch`` on
            parameter names); None: every trainable parameter.

    Example:
        >>> trainer = L.Trainer(callbacks=[L2Init(strength=1e-3)], max_steps=10_000)
        >>> trainer.fit(module, datamodule)   # as if the loss had + 0.5e-3·‖θ - θ₀‖²
    """

    supports_fsdp2 = True  # FSDP2: θ₀ is sharded like its parameter
    every_step_hook = "on_before_optimizer_step"  # the pull, added to every step's gradient
    summary_metrics = ("l2_init/distance",)
    default_schedule = None  # the pull acts at every optimizer step
    extra_state_types = {"names": list, "anchors": list}
    parameter_state_keys = ("anchors",)

    def __init__(self, strength: float = 1e-3, include_norms: bool = False,
                 selection: Selection | Mapping | None = None):
        check_number("strength", strength, 0.0, hint="(0 does nothing; paper: 1e-2 to 1e-5)", low_open=True)
        if not isinstance(include_norms, bool):
            raise ValueError(f"L2Init include_norms={include_norms!r} must be true or false")
        super().__init__(selection=name_selection(selection, "L2Init"))
        self.strength, self.include_norms = float(strength), include_norms
        self.names: list[str] = []
        self.anchors: list[torch.Tensor] = []
        self._params: list[torch.nn.Parameter] = []

    @property
    def state_key(self) -> str:
        return self._generate_state_key(strength=self.strength, include=self.selection.include,
                                        exclude=self.selection.exclude)

    def chosen(self, pl_module) -> list[tuple[str, torch.nn.Parameter]]:
        """The pulled ``(name, parameter)`` pairs: the selection's, minus normalization layers' unless included."""
        skipped = set() if self.include_norms else {id(p) for m in pl_module.modules() if _is_norm(m)
                                                    for p in m.parameters(recurse=False)}
        chosen = [(n, p) for n, p in matching_parameters(pl_module, self.selection, self.owner) if id(p) not in skipped]
        if not chosen:
            raise ValueError("L2Init: every selected parameter belongs to a normalization layer; pass include_norms=True")
        return chosen

    def check_targets(self, trainer, pl_module) -> None:
        chosen = self.chosen(pl_module)  # fails before any training
        rank_zero_info(f"L2Init pulls {len(chosen)} parameters toward their initial values with λ={self.strength}")

    def attach(self, trainer, pl_module) -> None:
        """Pair the selected parameters with their anchors, placed like them (a no-op when they already are)."""
        # a restored checkpoint keeps the θ₀ of the first fit
        self.names, self.anchors, self._params = copies_of(trainer, self.chosen(pl_module), self.names, self.anchors,
                                                           "L2Init anchors")

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        super().on_before_optimizer_step(trainer, pl_module, optimizer)
        if self.skip_nonfinite(trainer, pl_module, "the pull toward the initial weights"):
            return
        l2_init_grad_(self._params, self.anchors, self.strength)  # FSDP2: shard by shard, gradients already reduced
        every = trainer.log_every_n_steps  # 0: the trainer logs nothing
        if every and trainer.global_step % every == 0:  # measured at these steps only: written at them only
            log_at_step(trainer, {"l2_init/distance": squared_distance(self._params, self.anchors).sqrt()})

    def extra_state(self) -> dict:
        return {"names": list(self.names), "anchors": [state_copy(a) for a in self.anchors]}

    def load_extra_state(self, state: dict) -> None:
        self.names, self.anchors = list(state["names"]), list(state["anchors"])


def _is_norm(module: nn.Module) -> bool:
    """torch's norm layers, and model code's own (Hugging Face ``LlamaRMSNorm``, this package's ``RMSNorm``)."""
    return isinstance(module, NORMS) or type(module).__name__.endswith("Norm")
