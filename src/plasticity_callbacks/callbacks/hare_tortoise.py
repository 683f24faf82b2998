"""``HareTortoise``: a slow EMA copy of the network (the tortoise) that the fast one (the hare) is reset to."""
from __future__ import annotations

from collections.abc import Mapping
from contextlib import contextmanager

import torch
from lightning.pytorch.utilities import rank_zero_info

from ..arguments import check_number
from ..model_map import Selection
from ..ops.optimizer_state import reset_optimizer_state
from ..model_map.patterns import matching_parameters, name_selection
from .schedule import Schedule
from ..distributed.sharded_state import copies_of, reshard, squared_distance, state_copy
from ..functional.anchors import ema_toward_
from .base import PlasticityCallback


class HareTortoise(PlasticityCallback):
    """Hare & Tortoise networks (Lee, Cho, Kim, Lee, Choo & Hwang, ICML 2024).

    The trained network is the hare. The tortoise is an exponential moving average of it, updated in
    ``on_train_batch_end`` after every optimizer step: ``θ_T ← η·θ_T + (1-η)·θ_H`` (it starts as the hare
    at the first fit). When the ``schedule`` is due (default every 1000 steps; task boundaries are the
    usual alternative), the hare is reset to the tortoise: ``θ_H ← θ_T``; ``reset_optimizer`` also drops
    the optimizer state of the reset parameters. The tortoise is the network evaluated, as in the paper:
    with ``evaluate_tortoise`` its weights are swapped in for Lightning's validation and test loops
    (``on_validation_start``/``on_test_start``) and the hare's swapped back at their end, and for an
    evaluation run inside a training hook that asks for them (:meth:`evaluation_weights`: a task stream's
    TaskMetrics measures every task end on the tortoise, this step's EMA update included). Buffers (BatchNorm
    statistics) are the hare's. Deterministic, so identical on every DDP rank; the tortoise is in ``state_dict``.
    Under FSDP2 the tortoise is sharded like the hare: each rank averages, resets and swaps its own shards
    (:mod:`~distributed.sharded_state`: how it is saved).
    Logs ``hare_tortoise/distance`` (``‖θ_H - θ_T‖`` just before a reset).

    Args:
        decay: ``η`` in [0, 1), the tortoise's EMA decay (paper: 0.999).
        schedule: when the hare is reset to the tortoise (a Schedule or a mapping of its fields);
            None: ``Schedule(every_n_steps=1000)``.
        reset_optimizer: also drop the optimizer state of the reset parameters.
        evaluate_tortoise: run Lightning's validation and test loops on the tortoise's weights.
        selection: name patterns (a Selection or a mapping with ``include``/``exclude``, ``fnmatch`` on
            parameter names) of the parameters in the pair; None: every trainable parameter.

    Example:
        >>> ht = HareTortoise(decay=0.999, schedule=Schedule(at_task_boundaries=True))
        >>> trainer = L.Trainer(callbacks=[ht], max_steps=10_000)
        >>> trainer.fit(module, datamodule)   # hare reset to the tortoise at every task boundary
    """

    supports_fsdp2 = True  # FSDP2: the tortoise is sharded like the hare
    every_step_hook = "on_train_batch_end"  # the tortoise's EMA, after every optimizer step
    quick_settings = {"decay": 0.5, "schedule": {"every_n_steps": 2}}
    summary_metrics = ("hare_tortoise/distance",)
    default_schedule = Schedule(every_n_steps=1000)
    extra_state_types = {"names": list, "tortoise": list, "resets": int}
    parameter_state_keys = ("tortoise",)

    def __init__(self, decay: float = 0.999, schedule: Schedule | Mapping | None = None, reset_optimizer: bool = False,
                 evaluate_tortoise: bool = True, selection: Selection | Mapping | None = None):
        check_number("decay", decay, 0.0, 1.0, "(1 never moves the tortoise; paper: 0.999)", high_open=True)
        for name, value in (("reset_optimizer", reset_optimizer), ("evaluate_tortoise", evaluate_tortoise)):
            if not isinstance(value, bool):
                raise ValueError(f"HareTortoise {name}={value!r} must be true or false")
        super().__init__(schedule, name_selection(selection, "HareTortoise"))
        self.decay, self.reset_optimizer, self.evaluate_tortoise = float(decay), reset_optimizer, evaluate_tortoise
        self._hare_saved: list[torch.Tensor] | None = None  # the hare's weights while the tortoise is evaluated
        self.names: list[str] = []
        self.tortoise: list[torch.Tensor] = []
        self.resets = 0
        self._hare: list[torch.nn.Parameter] = []
        self._last_step = -1

    @property
    def state_key(self) -> str:
        return self._generate_state_key(decay=self.decay, schedule=self.schedule.describe(),
                                        include=self.selection.include, exclude=self.selection.exclude)

    def check_targets(self, trainer, pl_module) -> None:
        chosen = matching_parameters(pl_module, self.selection, self.owner)  # fails before any training
        rank_zero_info(f"HareTortoise: tortoise EMA (η={self.decay}) of {len(chosen)} parameters; the hare is reset "
                       f"to it on {self.schedule.describe()}")

    def attach(self, trainer, pl_module) -> None:
        """Pair the hare's parameters with the tortoise, placed like them (a no-op when it already is); also at
        the first validation, which can come before ``on_train_start``."""
        chosen = matching_parameters(pl_module, self.selection, self.owner)
        # a restored checkpoint brings its tortoise
        self.names, self.tortoise, self._hare = copies_of(trainer, chosen, self.names, self.tortoise,
                                                          "HareTortoise tortoise")
        self._last_step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self._update_tortoise(trainer, pl_module)
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def _update_tortoise(self, trainer, pl_module) -> None:
        """The EMA step, once per optimizer step (whichever of this hook and an evaluation asks first)."""
        if self._hare and trainer.global_step != self._last_step:  # the optimizer stepped in this batch
            self._last_step = trainer.global_step
            if not self.skip_nonfinite(trainer, pl_module, "the tortoise's EMA update"):  # it would keep the NaN
                ema_toward_(self.tortoise, self._hare, self.decay)

    @contextmanager
    def evaluation_weights(self, trainer, pl_module):
        """The tortoise's weights in ``pl_module`` while the block runs (with ``evaluate_tortoise``; else the
        hare's, untouched), the hare's put back after, even when the block raises. For an evaluation run from a
        training hook (Lightning's own loops swap in ``on_validation_start``): the tortoise first takes this
        step's EMA update, so it is the same whichever callback's hook runs first.

        Example:
            >>> with hare_tortoise.evaluation_weights(trainer, pl_module):
            ...     accuracy = accuracy_on(pl_module, x, y)   # the tortoise's accuracy
        """
        self._update_tortoise(trainer, pl_module)
        nested = self._hare_saved is not None  # inside a validation loop: the tortoise is in already
        self._swap_in_tortoise(pl_module)
        try:
            yield
        finally:
            if not nested:
                self._swap_back_hare(pl_module)

    @torch.no_grad()
    def _swap_in_tortoise(self, pl_module) -> None:
        if self.evaluate_tortoise and self._hare and self._hare_saved is None:
            reshard(pl_module)  # FSDP2: a unit gathered by an earlier evaluation would not see the write
            self._hare_saved = [h.detach().clone() for h in self._hare]
            for hare, tortoise in zip(self._hare, self.tortoise):
                hare.copy_(tortoise)

    @torch.no_grad()
    def _swap_back_hare(self, pl_module) -> None:
        if self._hare_saved is not None:
            reshard(pl_module)  # FSDP2: the evaluation left the root unit gathered with the tortoise's weights
            for hare, saved in zip(self._hare, self._hare_saved):
                hare.copy_(saved)
            self._hare_saved = None

    def on_validation_start(self, trainer, pl_module) -> None:
        if self._hare:  # in a fit
            self.attach(trainer, pl_module)
        self._swap_in_tortoise(pl_module)

    def on_validation_end(self, trainer, pl_module) -> None:
        self._swap_back_hare(pl_module)  # before a plateau trigger may reset the hare
        super().on_validation_end(trainer, pl_module)

    def on_test_start(self, trainer, pl_module) -> None:
        self._swap_in_tortoise(pl_module)

    def on_test_end(self, trainer, pl_module) -> None:
        self._swap_back_hare(pl_module)

    def act(self, trainer, pl_module, reason: str) -> dict[str, float]:
        with torch.no_grad():
            distance = squared_distance(self._hare, self.tortoise).sqrt()
            for hare, tortoise in zip(self._hare, self.tortoise):
                hare.copy_(tortoise)
        if self.reset_optimizer:
            reset_optimizer_state(trainer.optimizers, self._hare)
        self.resets += 1
        rank_zero_info(f"HareTortoise ({reason}): hare reset to the tortoise, ‖θ_H - θ_T‖ was {float(distance):.4g}")
        return {"hare_tortoise/distance": float(distance)}

    def extra_state(self) -> dict:
        return {"names": list(self.names), "tortoise": [state_copy(t) for t in self.tortoise],
                "resets": self.resets}

    def load_extra_state(self, state: dict) -> None:
        self.names, self.tortoise, self.resets = list(state["names"]), list(state["tortoise"]), state["resets"]
