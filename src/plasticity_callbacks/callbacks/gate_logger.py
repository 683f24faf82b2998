"""``GateLogger``: log the learned skip gates of reciprocal blocks during training."""
from __future__ import annotations

from typing import ClassVar

import lightning as L
import torch
from torch import nn

from ..arguments import check_int
from ..distributed.strategy import gather_full, require_full_parameters
from .base import register
from .step_logging import log_at_step


def gated_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every submodule exposing ``gate_values() -> {name: scalar tensor}`` (the reciprocal blocks)."""
    return [(name, m) for name, m in model.named_modules() if callable(getattr(m, "gate_values", None))]


@register
class GateLogger(L.Callback):
    """Logs each gated block's ``sigmoid(skip)`` gates, pathway weights and ``α`` as
    ``gates/<module>/<name>`` (e.g. ``gates/model.blocks.0.attn/gate_rec``), plus the binary
    decision ``gates/<module>/<pathway>_on`` (gate > 0.5). The forward pass always gates softly;
    the decisions exist only here, for reading.

    Acts in ``on_train_batch_end`` every ``every_n_steps`` optimizer steps, writing the values once at that
    global step (:func:`~callbacks.step_logging.log_at_step`; the latest stay in ``callback_metrics``); changes
    nothing. Stateless, so resuming needs no saved state. Gates are parameters, identical on every rank under
    DDP; under FSDP2 (``ModelParallelStrategy``) each is a 1-element ``DTensor`` held by one rank, and
    every rank gathers it (``full_tensor``, a collective of one number), so all ranks log the same value.

    Args:
        every_n_steps: optimizer steps between two logs (a logging cadence, not a plasticity action).
        log_decisions: also log the binary ``<pathway>_on`` decisions.

    Example:
        >>> module = GPTLightningModule({"attention": "reciprocal", "mlp": "reciprocal"})
        >>> trainer = L.Trainer(callbacks=[GateLogger(every_n_steps=50)])
        >>> trainer.fit(module, datamodule=CodeCorpusDataModule())
    """

    supports_fsdp2: ClassVar[bool] = True  # each gate gathered from its shard

    def __init__(self, every_n_steps: int = 50, log_decisions: bool = True):
        check_int("every_n_steps", every_n_steps)
        if not isinstance(log_decisions, bool):
            raise ValueError(f"log_decisions must be true or false, got {log_decisions!r}")
        self.every_n_steps, self.log_decisions = every_n_steps, log_decisions
        self._modules: list[tuple[str, nn.Module]] = []
        self._logged_step = -1

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        require_full_parameters(trainer, "GateLogger", fsdp2=self.supports_fsdp2)
        self._modules = gated_modules(pl_module)
        if not self._modules:
            raise ValueError("GateLogger: the model has no gated blocks (modules with gate_values()); "
                             "use model/attention=reciprocal or model/mlp=reciprocal, or drop the callback")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        step = trainer.global_step
        if step % self.every_n_steps or step == self._logged_step:  # accumulating batches share their step
            return
        self._logged_step = step
        values = {}
        for name, module in self._modules:
            for key, value in module.gate_values().items():
                value = gather_full(value).reshape(())  # (1,) or a DTensor shard of it -> a scalar
                values[f"gates/{name}/{key}"] = value
                if self.log_decisions and key.startswith("gate_"):
                    values[f"gates/{name}/{key[5:]}_on"] = (value > 0.5).to(torch.float32)
        # read every every_n_steps only: written at this step, never repeated in later rows
        log_at_step(trainer, values)
