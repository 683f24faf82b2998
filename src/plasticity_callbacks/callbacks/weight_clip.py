"""``WeightClip``: after every optimizer step, every layer's weights stay within ``±κ`` times their init bound."""
from __future__ import annotations

from collections.abc import Mapping

import torch
from lightning.pytorch.utilities import rank_zero_info

from ..arguments import check_number
from ..distributed.strategy import require_full_parameters
from ..model_map import Selection, is_conv1d
from ..model_map.weights import is_layer
from ..model_map.patterns import name_selection
from ..distributed.sharding import fraction_over_shards, local_part
from ..functional.anchors import clip_to_bounds_, fan_in_bound
from .base import PlasticityCallback


class WeightClip(PlasticityCallback):
    """Weight clipping (Elsayed, Lan, Lyle & Mahmood, 2024): ``θ ← clamp(θ, ±κ·b)`` after each optimizer step.

    ``b`` is the layer's init bound ``1/√fan_in`` (PyTorch's default uniform init of a Linear/conv weight
    and of its bias; fan-in over the kernel for a conv, the rows of a Hugging Face ``Conv1D``), the
    reference code's (``mohmdelsayed/weight-clipping``, ``InitBounds``) choice. Every ``nn.Linear``,
    conv and ``Conv1D`` weight and bias is clipped, the output head too (the reference's
    ``clip_last_layer=True``); norms, embeddings and other parameters have no fan-in bound and are left
    alone (the fit-start message counts them). Acts in ``on_train_batch_end`` of every batch whose
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

    summary_metrics = ("weight_clip/clipped",)
    default_schedule = None  # clips after every optimizer step

    def __init__(self, kappa: float = 2.0, selection: Selection | Mapping | None = None):
        check_number("kappa", kappa, 1e-12, hint="(paper: 1 to 4)")
        super().__init__(selection=name_selection(selection, "WeightClip"))
        self.kappa = float(kappa)
        self._params: list[torch.nn.Parameter] = []
        self._bounds: list[float] = []
        self._last_step = -1

    @property
    def state_key(self) -> str:
        return self._generate_state_key(kappa=self.kappa, include=self.selection.include,
                                        exclude=self.selection.exclude)

    def check_strategy(self, trainer) -> None:
        require_full_parameters(trainer, self.owner, fsdp2=True)  # FSDP2: elementwise on each rank's shard

    def check_targets(self, trainer, pl_module) -> None:
        self._resolve(pl_module)
        chosen = {id(p) for p in self._params}
        others = sum(1 for p in pl_module.parameters() if p.requires_grad and id(p) not in chosen)
        rank_zero_info(f"WeightClip keeps {len(self._params)} layer weights/biases within ±{self.kappa}/√fan_in; "
                       f"{others} other trainable tensors (norms, embeddings, excluded) are not clipped")

    def _resolve(self, pl_module) -> None:
        """The clipped parameters and their bounds, as the model holds them now (FSDP2 replaces them in
        ``configure_model``, after setup)."""
        self._params, self._bounds = [], []
        for module_name, module in pl_module.named_modules():
            if not is_layer(module):
                continue
            bound = fan_in_bound(module.weight, stored_in_out=is_conv1d(module))
            for attr in ("weight", "bias"):
                param = getattr(module, attr, None)
                name = f"{module_name}.{attr}" if module_name else attr
                if isinstance(param, torch.nn.Parameter) and param.requires_grad and self.selection.matches(name):
                    self._params.append(param)
                    self._bounds.append(bound)
        if not self._params:
            raise ValueError(f"WeightClip found no Linear/conv/Conv1D weight matching include={self.selection.include}, "
                             f"exclude={self.selection.exclude}")

    def on_train_start(self, trainer, pl_module) -> None:
        super().on_train_start(trainer, pl_module)
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
        # measured at every optimizer step: Lightning writes the series at its log_every_n_steps cadence
        pl_module.log("weight_clip/clipped", clipped.float(), on_step=True, on_epoch=False)
