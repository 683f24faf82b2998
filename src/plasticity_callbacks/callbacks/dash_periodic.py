"""``DASHPeriodic``: every few steps, shrink neurons whose weights point against the current gradient's descent."""
from __future__ import annotations

from collections.abc import Mapping

import torch

from ..arguments import check_number
from ..model_map import Selection
from .schedule import Schedule
from ..functional.shrink import penalty_shrink_factors
from .dash import DirectionalShrink


class DASHPeriodic(DirectionalShrink):
    """Direction-aware shrinking on the step's own gradient, at step triggers (the per-step DASH rule).

    When: ``schedule``, step triggers only (``steps``, ``every_n_steps``, task boundaries; default
    ``Schedule(every_n_steps=2000)``), in ``on_before_optimizer_step`` of the step taken when
    ``trainer.global_step`` reaches one (counted in optimizer steps, so once per real step under
    gradient accumulation). Every trigger acts once, also across a resume.

    What changes: every row (conv: every (out, in) kernel slice) of a selected weight is multiplied
    by ``clamp(1 − shrink_rate·clamp(cos(W, grad) − cosine_threshold, 0), min_factor, 1)`` using the
    current gradient. At that hook the gradients are already all-reduced under DDP and, with
    ``precision="16-mixed"``, already unscaled by Lightning's AMP plugin (it calls
    ``scaler.unscale_`` before the hook; an optimizer that unscales inside its own ``step`` would
    leave them scaled, which a cosine does not notice). A scheduled step whose gradients (any
    parameter's) are not all finite is skipped, not postponed: the AMP scaler would skip it too.

    Muon: with ``skip_muon_params=False`` the weights Muon optimizes are shrunk as well: Muon's next
    updates keep their fixed, norm-independent size and the momentum buffer still holds pre-shrink
    gradients, so a shrunk row receives a relatively larger update; accept this only with rare
    shrinks (``every_n_steps`` of 2000 or more).

    Logs (prefix ``dash_periodic/``) what :class:`~.dash.DASHShrink` logs, the per-layer factors only with
    ``log_per_layer=True``. Under FSDP2 each rank
    shrinks the rows it holds from its shard of ``.grad`` (a DTensor sharded like the weight); FSDP1
    and DeepSpeed are refused at setup.

    Args:
        schedule: when to act (step triggers; a Schedule or a mapping); None: ``Schedule(every_n_steps=2000)``.
        cosine_threshold: a row whose cosine with the gradient exceeds this, in [-1, 1], is shrunk.
        shrink_rate: shrink per unit of cosine above ``cosine_threshold``, in (0, 1].
        min_factor: the smallest factor in one event, in (0, 1] (0 would zero a row).
        selection: which weights (:class:`~model_map.Selection` or a mapping);
            None: every weight but the head.
        shrink_bias: also shrink a selected layer's bias, by one factor from the whole bias vector.
        skip_muon_params: leave alone the weights that ``torch.optim.Muon`` optimizes.
        log_per_layer: also log each layer's factors (three keys per layer and action; off by default, as a
            logger that prints every key, such as the Hugging Face ``Trainer``'s, would print them all).

    Example:
        >>> dash = DASHPeriodic(schedule=Schedule(every_n_steps=2000), cosine_threshold=0.05)
        >>> trainer = L.Trainer(max_steps=10_000, callbacks=[dash])
        >>> trainer.fit(module, datamodule=data)
    """

    supports_fsdp2 = True  # FSDP2: each rank's rows from its shard of .grad
    quick_settings = {"schedule": {"every_n_steps": 2}, "cosine_threshold": -1.0, "shrink_rate": 0.2,
                      "skip_muon_params": False}  # every row shrinks, every 2 steps
    prefix = "dash_periodic"
    summary_metrics = ("dash_periodic/shrunk_fraction",)
    default_schedule = Schedule(every_n_steps=2000)
    step_hook = "on_before_optimizer_step"  # the step's gradients exist, the optimizer has not used them yet
    reads_gradients = True

    def __init__(
        self,
        schedule: Schedule | Mapping | None = None,
        cosine_threshold: float = 0.05,
        shrink_rate: float = 0.005,
        min_factor: float = 0.5,
        selection: Selection | Mapping | None = None,
        shrink_bias: bool = True,
        skip_muon_params: bool = True,
        log_per_layer: bool = False,
    ):
        super().__init__(schedule, selection, shrink_bias, skip_muon_params, log_per_layer)
        self.schedule.require_step_triggers("DASHPeriodic", "uses the step's gradient (DASHShrink acts at any "
                                            "trigger)")
        check_number("cosine_threshold", cosine_threshold, -1.0, 1.0, "(a cosine threshold)")
        check_number("shrink_rate", shrink_rate, 0.0, 1.0, "(0 never shrinks; default 0.005)", low_open=True)
        check_number("min_factor", min_factor, 0.0, 1.0, "(0 would zero a row: a dead neuron)", low_open=True)
        self.cosine_threshold, self.shrink_rate, self.min_factor = cosine_threshold, shrink_rate, min_factor

    def act(self, trainer, pl_module, reason: str) -> dict[str, torch.Tensor | float]:
        def factors(weight: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
            return penalty_shrink_factors(weight, grad, self.cosine_threshold, self.shrink_rate, self.min_factor)

        return self.shrink(trainer, lambda param: param.grad, factors)
