"""``ShrinkPerturb``: Ash & Adams' warm-starting fix, ``θ ← λ·θ + p·θ_fresh``, on a schedule."""
from __future__ import annotations

from collections.abc import Mapping

from lightning.pytorch.utilities import rank_zero_info

from ..arguments import check_number
from ..distributed.strategy import rank_identical_generator
from ..model_map import Selection
from ..ops.shrink_perturb import selected_parameters, shrink_perturb_
from .schedule import Schedule
from .base import PlasticityCallback


class ShrinkPerturb(PlasticityCallback):
    """Shrink & Perturb (Ash & Adams, NeurIPS 2020): ``θ ← shrink·θ + perturb·θ_fresh``.

    When: ``schedule`` (:class:`~callbacks.schedule.Schedule`; default: once at fit
    start, in ``on_train_start``, after a checkpoint is restored and before the first step). Epoch
    triggers act in ``on_train_epoch_start``, step triggers and task boundaries in
    ``on_train_batch_start``, plateaus in ``on_validation_end``; each trigger acts once, also across
    a resume. What changes: every selected trainable parameter (a frozen one, ``requires_grad=False``,
    only when an ``include`` pattern names it); ``θ_fresh`` is a fresh initialization of the
    same model by its own init code (:func:`plasticity_callbacks.model_map.fresh_parameters`:
    Hugging Face ``_init_weights``, ``init_weights``, a model built by ``self.apply(self._init_weights)``
    rebuilt from its config, ``_reset_parameters`` (MHA, ``nn.Transformer``), each layer's
    ``reset_parameters``, PEFT's LoRA init: ``lora_B`` fresh is zeros), drawn from a generator seeded
    from ``seed`` and the global step, identically on every rank. A selected parameter that no init
    reaches (a bare ``nn.Parameter`` of the LightningModule) and a matrix whose fresh draw equals its
    current value are named: the first is an error (exclude it or give it init code), the second a
    warning. A weight factorized by ``AdaptiveSVDSwitch(minor_training="factorize")`` is treated as its
    effective weight ``W_p + BA`` (its frozen ``W_p`` absorbs the change; ``B, A`` are kept); one
    computed by a parametrization (weight norm, spectral norm) through its ``original`` parameters,
    drawn fresh as the parametrization makes them from a fresh weight; ``orthogonal``, which keeps the
    weight in a buffer, is refused by name (exclude it).
    Logs ``shrink_perturb/norm_ratio`` (‖θ‖ after / before). Under FSDP2 every rank draws the whole
    fresh model, the values one process draws for the same seed, and treats the rows it holds
    (peak extra memory: one full copy of the largest unit its init draws at once).

    Args:
        shrink: λ in [0, 1] (paper default 0.4; the FIRE paper's language runs used 0.5 or 0.8).
        perturb: p >= 0, scale of the fresh initialization (paper default 0.1).
        schedule: when to act (a Schedule or a mapping of its fields); None: ``Schedule(at_fit_start=True)``.
        selection: which parameters, by name: a :class:`~model_map.Selection`
            (or a mapping of its fields) whose ``include``/``exclude`` patterns are matched against
            parameter names (``model.blocks.*``); ``scope="head"``: only the parameters of the output
            head(s) (:func:`~model_map.output_heads`: weight and bias), then the patterns; None: every
            parameter, biases, norms and the head too.
        reset_optimizer: also drop the optimizer state of the changed parameters.
        seed: mixed with the global step into the fresh draw.

    Raises:
        ValueError: a bad argument; at setup, no parameter matches the selection.
        RuntimeError: a selected parameter that no init code draws (exclude it or give it ``reset_parameters``).
        MisconfigurationException: at setup, under FSDP1 or DeepSpeed (flat shards), with the fix.

    Example:
        >>> sp = ShrinkPerturb(shrink=0.4, perturb=0.1, schedule=Schedule(every_n_epochs=10))
        >>> trainer = L.Trainer(callbacks=[sp], max_epochs=100)
        >>> trainer.fit(module, datamodule=data)  # shrinks and perturbs at epochs 10, 20, ...
    """

    supports_fsdp2 = True  # each rank's rows of the fresh draw
    summary_metrics = ("shrink_perturb/norm_ratio",)
    extra_state_types = {"applications": int}

    def __init__(self, shrink: float = 0.4, perturb: float = 0.1, schedule: Schedule | Mapping | None = None,
                 selection: Selection | Mapping | None = None, reset_optimizer: bool = False, seed: int = 0):
        check_number("shrink", shrink, 0.0, 1.0, "(paper: 0.4)")
        check_number("perturb", perturb, 0.0, hint="(paper: 0.1)")
        if shrink == 1 and perturb == 0 and reset_optimizer is False:  # with it: the optimizer-state reset alone
            raise ValueError(f"{self.owner} shrink=1 with perturb=0 leaves every weight as it is: lower shrink "
                             "(paper: 0.4), raise perturb (paper: 0.1), or set reset_optimizer=true")
        if not isinstance(reset_optimizer, bool):
            raise ValueError(f"{self.owner} reset_optimizer={reset_optimizer!r} must be true or false")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"{self.owner} seed={seed!r} must be an integer")
        super().__init__(schedule, _name_patterns(Selection.build(selection, self.owner), self.owner))
        self.shrink, self.perturb, self.seed = float(shrink), float(perturb), seed
        self.reset_optimizer = reset_optimizer
        self.applications = 0

    @property
    def state_key(self) -> str:
        head = {"scope": "head"} if self.selection.scope == "head" else {}  # keys of earlier runs stay as they were
        return self._generate_state_key(shrink=self.shrink, perturb=self.perturb, include=self.selection.include,
                                        exclude=self.selection.exclude, schedule=self.schedule.describe(), **head)

    def check_targets(self, trainer, pl_module) -> None:
        selected_parameters(pl_module, self.selection, self.owner)  # an empty selection fails before any training

    def act(self, trainer, pl_module, reason: str) -> dict[str, float]:
        seed = rank_identical_generator(self.seed, trainer.global_step).initial_seed()
        done = shrink_perturb_(pl_module, trainer.optimizers, self.shrink, self.perturb, self.selection, seed,
                               self.reset_optimizer, self.owner)
        self.applications += 1
        rank_zero_info(f"{self.owner} ({reason}): θ ← {self.shrink}·θ + {self.perturb}·θ_fresh on "
                       f"{done['parameters']} parameters at step {trainer.global_step}; norm "
                       f"{done['norm_before']:.4g} → {done['norm_after']:.4g}")
        return {"shrink_perturb/norm_ratio": done["norm_after"] / max(done["norm_before"], 1e-12)}

    def extra_state(self) -> dict:
        return {"applications": self.applications}

    def load_extra_state(self, state: dict) -> None:
        self.applications = int(state["applications"])


def _name_patterns(selection: Selection, owner: str) -> Selection:
    """Shrink & Perturb treats every parameter (biases, norms, the head): name patterns narrow it, and
    ``scope="head"`` to the output head's own parameters, whatever the model calls them."""
    if selection.scope not in ("all", "head") or (selection.include_conv, selection.include_head) != (True, False):
        raise ValueError(f"{owner} selection={selection}: this method selects parameters by name, or the output "
                         "head alone (scope: head); set include/exclude patterns (scope attention/mlp, "
                         "include_conv and include_head do not apply)")
    return selection

