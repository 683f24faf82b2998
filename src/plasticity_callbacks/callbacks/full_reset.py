"""``FullReset``: every layer re-initialized and the optimizer's state dropped: training from scratch, mid-run."""
from __future__ import annotations

from collections.abc import Mapping

from ..model_map import Selection
from .shrink_perturb import ShrinkPerturb


class FullReset(ShrinkPerturb):
    """Re-initialize every parameter by the model's own init code and drop its optimizer state.

    The "from scratch" baseline of a task stream, in the same run as the other methods: Shrink &
    Perturb with ``shrink = 0`` and ``perturb = 1`` (``θ ← θ_fresh``) and ``reset_optimizer=True``,
    so it acts exactly when and where :class:`ShrinkPerturb` would (see its docstring).

    Frozen parameters (``requires_grad=False``: a frozen backbone, PEFT's base weights) stay as they
    are; PEFT LoRA adapters are drawn by PEFT's init (``lora_B`` zeros), so the model returns to its base.

    Args:
        schedule: when to reset (a :class:`~callbacks.schedule.Schedule` or a mapping).
        seed: mixed with the global step into the fresh draw.
        selection: name patterns (``exclude``: parameters kept as they are, e.g. one that no init code
            draws; ``include``: only those, frozen ones too), or ``scope="head"``: the output head alone
            (its weight and bias drawn afresh, their optimizer state dropped, everything else kept);
            None: every trainable parameter.

    Example:
        >>> reset = FullReset(schedule=Schedule(at_task_boundaries=True))
        >>> new_head = FullReset(schedule=Schedule(at_task_boundaries=True), selection={"scope": "head"})
        >>> trainer = L.Trainer(max_epochs=1, callbacks=[reset])
        >>> trainer.fit(DigitsClassifier(), datamodule=RandomLabelDigits())
    """

    def __init__(self, schedule=None, seed: int = 0, selection: Selection | Mapping | None = None):
        super().__init__(shrink=0.0, perturb=1.0, reset_optimizer=True, seed=seed, schedule=schedule,
                         selection=selection)
