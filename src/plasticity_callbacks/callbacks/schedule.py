"""When a callback acts: one :class:`Schedule` for every callback, and its firing state across a resume.

A :class:`Schedule` says *when* (fit start, epochs, steps, task boundaries, a metric plateau);
a :class:`ScheduleState` remembers what already fired, so a resumed fit neither repeats nor
skips a trigger. A callback owns one state per schedule and asks it from its own hooks::

    setup                 -> self.firing.begin_fit(stage)
    on_train_start        -> reason = self.firing.due_at_train_start(trainer)
    on_train_epoch_start  -> reason = self.firing.due_at_epoch_start(trainer)
    a step hook           -> reason = self.firing.due_at_step(trainer)
    on_validation_end     -> reason = self.firing.due_at_validation_end(trainer, pl_module)

A threshold (:class:`Threshold`) is a step trigger too: ``due_at_step`` reads a logged metric from
``trainer.callback_metrics`` (a :class:`~callbacks.monitor.PlasticityMonitor` metric or any the user logs).

Each ``due_*`` returns a short reason (``"epoch 3"``, ``"step 100"``) when the callback should act
now, else ``None``.

What a step is: ``trainer.global_step``, the number of optimizer steps taken so far. Under
gradient accumulation it advances once per ``accumulate_grad_batches`` batches, so a step
trigger fires at the first micro-batch of that step and not again for the others. With several
optimizers (manual optimization) every ``optimizer.step()`` counts, so it can advance by more
than one per batch; a step trigger ``s`` therefore fires at the first check where
``global_step >= s`` (it is never skipped because the count jumped over it).

Task boundaries: the data module (``trainer.datamodule``) exposes ``task_boundary_steps``, the
global steps at which a new task starts (task 0 starts at step 0 and is not a boundary).
"""
from __future__ import annotations

import math
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn

from ..arguments import build_options, check_int, check_number, refuse_unknown_fields, sorted_int_list
from .state import OPTIONAL_INT, OPTIONAL_NUMBER, check_state
from ..distributed.strategy import all_reduce_mean

MODES = ("min", "max")
_STATE_TYPES = {"fit_start_fired": bool, "last_epoch": OPTIONAL_INT, "last_step": OPTIONAL_INT,
                "last_fired_step": OPTIONAL_INT, "fired": list, "best": OPTIONAL_NUMBER, "wait": int,
                "cooldown_left": int, "plateau_fires": int}
_THRESHOLD_STATE_TYPES = {"threshold_fires": int, "threshold_fired_step": OPTIONAL_INT,
                          "threshold_acted_on": OPTIONAL_NUMBER, "threshold_value": OPTIONAL_NUMBER}


@refuse_unknown_fields
@dataclass(frozen=True)
class Threshold:
    """Act when a logged metric is beyond a threshold: a trigger on what the run measures, not on a clock.

    Read at every check of the step trigger (``ScheduleState.due_at_step``) from ``trainer.callback_metrics``
    (the mean over ranks), so it works with :class:`~callbacks.monitor.PlasticityMonitor`'s metrics and with any
    metric logged by ``pl_module.log`` or ``log_at_step``. It acts when the value is ``< below`` (or
    ``> above``). After acting it waits, with ``cooldown=None``, for a new value of the metric: one that differs
    from the value it acted on (the action changed the model, so that measurement is stale; a new measurement
    equal to it to the last bit also waits); with ``cooldown=n``, for ``n`` optimizer steps, then it reads
    whatever is logged. It acts at most ``max_actions`` times per fit. A metric that is still not logged
    ``warn_after_steps`` steps into the fit is warned about once (a misspelt name or a monitor that is off), rather
    than never firing silently.

    Args:
        metric: the logged name, e.g. ``"monitor/weight_srank/layers.0.mlp.up.weight"`` or ``"monitor/dormant"``.
        below: act when the value falls below this.
        above: act when the value rises above this (set exactly one of ``below`` and ``above``).
        cooldown: optimizer steps after an action before the next may come (set it to at least the interval the
            metric is logged at); None: until the metric's value changes.
        max_actions: at most this many actions per fit (None: no limit).
        warn_after_steps: warn once when the metric is still not logged this many steps after ``start_step``
            (set it to the interval the metric is logged at).

    Example:
        >>> fire = FIREReinit(schedule=Schedule(threshold=Threshold("monitor/weight_srank", below=20.0,
        ...                                                         cooldown=1000)))
        >>> redo = ReDoMonitor(schedule={"threshold": {"metric": "monitor/dormant", "above": 0.1}})
    """

    metric: str
    below: float | None = None
    above: float | None = None
    cooldown: int | None = None
    max_actions: int | None = None
    warn_after_steps: int = 100

    def __post_init__(self) -> None:
        if not isinstance(self.metric, str) or not self.metric:
            raise ValueError(f"Threshold metric={self.metric!r} must be a logged metric's name")
        if (self.below is None) == (self.above is None):
            raise ValueError(f"Threshold(metric={self.metric!r}) needs exactly one of below= and above= "
                             f"(got below={self.below!r}, above={self.above!r})")
        for name in ("below", "above"):
            if getattr(self, name) is not None:
                check_number(f"Threshold {name}", getattr(self, name))
        check_int("Threshold cooldown", self.cooldown, optional=True)
        check_int("Threshold max_actions", self.max_actions, minimum=1, optional=True)
        check_int("Threshold warn_after_steps", self.warn_after_steps, minimum=1)

    @classmethod
    def build(cls, value: Threshold | Mapping, owner: str) -> Threshold:
        return build_options(cls, value, owner, "schedule threshold")

    def crossed(self, value: float) -> bool:
        """Whether ``value`` is beyond the threshold (NaN never is)."""
        return value < self.below if self.below is not None else value > self.above

    def describe(self, value: float) -> str:
        return (f"{self.metric}={value:.4g} < {self.below:g}" if self.below is not None
                else f"{self.metric}={value:.4g} > {self.above:g}")


@refuse_unknown_fields
@dataclass(frozen=True)
class Schedule:
    """When a callback acts. Any combination of triggers; several falling on the same optimizer step act once.

    Args:
        at_fit_start: act in ``on_train_start`` of every fit (a phase boundary: the fit continues
            from earlier weights); a fit resumed from a checkpoint written after it does not act again.
        epochs: act at the start of these epochs (0-based).
        every_n_epochs: act at the start of epochs ``n, 2n, …`` (not epoch 0).
        steps: act once ``trainer.global_step`` (optimizer steps taken) reaches each of these.
        every_n_steps: act at global steps ``n, 2n, …``; ``1``: at every step, step 0 included, so a method that
            must act at every optimizer step acts before (or after, with a batch-end hook) each one of the fit.
            For ``n > 1`` step 0 is not a multiple that counts: it is the fit's start, before anything was
            measured (use ``at_fit_start`` to act there too).
        at_task_boundaries: act when ``global_step`` reaches one of the data module's
            ``task_boundary_steps``.
        monitor: act when this logged metric (mean over ranks) has not improved by ``min_delta``
            for ``patience`` validations in a row (EarlyStopping's rule).
        mode: ``"min"`` (lower is better) or ``"max"``.
        patience: validations without improvement before acting.
        min_delta: smallest change that counts as an improvement.
        cooldown: validations ignored after a plateau firing; the best value then restarts.
        max_plateau_fires: at most this many plateau firings per fit (None: no limit).
        start_step: no trigger acts before this global step.
        end_step: no trigger acts after this global step (None: no end).
        threshold: act when a logged metric crosses a threshold (a :class:`Threshold` or a mapping of its
            fields), checked at the step trigger.

    Example:
        >>> fire = FIREReinit(schedule=Schedule(at_fit_start=True, every_n_steps=1000))
        >>> redo = ReDoMonitor(schedule=Schedule(every_n_steps=1000, end_step=8000))
        >>> trainer = L.Trainer(callbacks=[fire, redo], max_steps=10_000)
        >>> fire = FIREReinit(schedule=Schedule(threshold=Threshold("monitor/weight_srank", below=20.0)))
    """

    at_fit_start: bool = False
    epochs: tuple[int, ...] = ()
    every_n_epochs: int | None = None
    steps: tuple[int, ...] = ()
    every_n_steps: int | None = None
    at_task_boundaries: bool = False
    monitor: str | None = None
    mode: str = "min"
    patience: int = 3
    min_delta: float = 0.0
    cooldown: int = 0
    max_plateau_fires: int | None = None
    start_step: int = 0
    end_step: int | None = None
    threshold: Threshold | None = None

    def __post_init__(self) -> None:
        for name in ("at_fit_start", "at_task_boundaries"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Schedule {name}={getattr(self, name)!r} must be true or false")
        # Any sequence (a config system's list type too) is stored as a plain sorted tuple: hashable, picklable.
        object.__setattr__(self, "epochs", tuple(sorted_int_list("Schedule epochs", _listed(self.epochs))))
        object.__setattr__(self, "steps", tuple(sorted_int_list("Schedule steps", _listed(self.steps))))
        check_int("Schedule every_n_epochs", self.every_n_epochs, minimum=1, optional=True)
        check_int("Schedule every_n_steps", self.every_n_steps, minimum=1, optional=True)
        if self.monitor is not None and (not isinstance(self.monitor, str) or not self.monitor):
            raise ValueError(f"Schedule monitor={self.monitor!r} must be a logged metric's name or None")
        if self.mode not in MODES:
            raise ValueError(f"Schedule mode={self.mode!r} is not one of {MODES}")
        check_int("Schedule patience", self.patience, minimum=1)
        check_number("Schedule min_delta", self.min_delta, 0.0)
        check_int("Schedule cooldown", self.cooldown, minimum=0)
        check_int("Schedule max_plateau_fires", self.max_plateau_fires, minimum=1, optional=True)
        check_int("Schedule start_step", self.start_step, minimum=0)
        check_int("Schedule end_step", self.end_step, minimum=self.start_step, optional=True, hint="(>= start_step)")
        if self.threshold is not None:
            object.__setattr__(self, "threshold", Threshold.build(self.threshold, "Schedule"))
        if not self.has_trigger:
            raise ValueError("Schedule has no trigger: set at_fit_start, epochs, every_n_epochs, steps, every_n_steps, "
                             "at_task_boundaries, monitor or threshold")

    @property
    def has_trigger(self) -> bool:
        return bool(self.at_fit_start or self.epochs or self.every_n_epochs or self.steps or self.every_n_steps
                    or self.at_task_boundaries or self.monitor or self.threshold)

    @property
    def acts_on_epochs(self) -> bool:
        return bool(self.epochs or self.every_n_epochs)

    def require_step_triggers(self, owner: str, why: str) -> None:
        """Refuse fit-start, epoch and plateau triggers for a callback that can only act inside a step."""
        if self.at_fit_start or self.acts_on_epochs or self.monitor:
            raise ValueError(f"{owner} {why}, so it acts only at steps: schedule=({self.describe()}) may set steps, "
                             "every_n_steps, at_task_boundaries, threshold, start_step and end_step")

    @classmethod
    def build(cls, value: Schedule | Mapping, owner: str) -> Schedule:
        """``value`` as a Schedule: a Schedule is kept, a mapping of its fields becomes one."""
        return build_options(cls, value, owner, "schedule")

    def describe(self) -> str:
        """The non-default fields, e.g. ``"at_fit_start=True, every_n_steps=1000"`` (for state keys and logs)."""
        default = {f.name: f.default for f in fields(self)}
        return ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self)
                         if getattr(self, f.name) != default[f.name])


def _listed(values):
    if values is None:
        return None
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        return values  # sorted_int_list names the field and refuses it
    return list(values)


class ScheduleState:
    """The firing state of one :class:`Schedule` in one callback, with one resume rule.

    ``begin_fit`` (from the callback's ``setup``) forgets the previous fit; a checkpoint restored
    afterwards (``load_state_dict``) brings back what this fit had already done. Epochs and steps
    are checked as "reached since the last check": the last epoch and step seen are saved, so a
    fit resumed in the middle of epoch 3 does not fire epoch 3 again, and a trigger between the
    last check and the checkpoint fires at the first check after the resume.

    Args:
        schedule: when to fire.
        owner: the callback's name, used in error messages.

    Example:
        >>> firing = ScheduleState(Schedule(every_n_steps=100), "MyCallback")
        >>> firing.begin_fit("fit"); firing.due_at_train_start(trainer)
        >>> reason = firing.due_at_step(trainer)   # "step 100" when global_step reaches 100
    """

    def __init__(self, schedule: Schedule, owner: str):
        self.schedule, self.owner = schedule, owner
        self._boundaries: tuple[int, ...] = ()
        self._reset()

    def _reset(self) -> None:
        self.fit_start_fired = False
        self.last_epoch: int | None = None  # the last epoch whose start was checked in this fit
        self.last_step: int | None = None  # the last global step checked in this fit
        self.last_fired_step: int | None = None
        self.fired: list[tuple[int, str]] = []  # (global_step, reason), this fit
        self.best: float | None = None
        self.wait = 0
        self.cooldown_left = 0
        self.plateau_fires = 0
        self.threshold_fires = 0
        self.threshold_fired_step: int | None = None
        self.threshold_acted_on: float | None = None  # the value the last threshold action read
        self._restored_value: float | None = None  # the metric's value when the checkpoint was written
        self._warned_missing = False
        self._warned_unreachable = False

    # ------------------------------------------------------------------ hooks
    def begin_fit(self, stage: str | None) -> None:
        """Call from ``setup``: a new fit starts with nothing fired (``trainer.validate`` etc. change nothing)."""
        if stage in (None, "fit"):
            self._reset()

    def due_at_train_start(self, trainer) -> str | None:
        """Call from ``on_train_start``; reads the task boundaries and marks the fit's first step as checked."""
        if self.schedule.at_task_boundaries:
            self._boundaries = task_boundary_steps(trainer, self.owner)
        self._trainer = weakref.ref(trainer)  # state_dict reads the threshold's metric as the checkpoint is written
        if self.schedule.monitor is not None and not runs_validation(trainer):
            rank_zero_warn(f"{self.owner}: Schedule(monitor={self.schedule.monitor!r}) acts at validation ends, and this "
                           "fit runs no validation (no val dataloader, or limit_val_batches=0), so it will never act: "
                           "pass val_dataloaders to trainer.fit, or use a step or epoch trigger")
        if self.last_step is None:  # a fresh fit (a resumed one keeps its saved clock)
            self.last_step = trainer.global_step - 1
        self._warn_if_unreachable(trainer)
        if self.schedule.at_fit_start and not self.fit_start_fired:
            self.fit_start_fired = True
            return self._fire(trainer, "fit start")
        return None

    def warn_if_never_fired(self, trainer) -> None:
        """Call at the fit's end (``on_train_end``): a clock trigger that never acted in this fit, not already
        warned about at its start (a fit whose length was not known then), is one warning naming it and the fit's
        last step, never a silent no-op."""
        schedule = self.schedule
        if self.fired or self._warned_unreachable or not self._clock_triggers() or schedule.monitor or \
                schedule.threshold:  # a metric that never crossed is a finding, not a schedule beyond the fit
            return
        self._warned_unreachable = True
        rank_zero_warn(f"{self.owner}: Schedule({schedule.describe()}) never acted in this fit, which ended at step "
                       f"{trainer.global_step}: {self._fix()}")

    def _warn_if_unreachable(self, trainer) -> None:
        """At fit start, when the fit's length is known (``max_steps``, or ``max_epochs`` for epoch triggers): warn
        once when no clock trigger of a schedule that has only clock triggers can act before the fit ends."""
        schedule, first = self.schedule, self.last_step + 1
        if self._warned_unreachable or not self._clock_triggers() or schedule.monitor or schedule.threshold:
            return
        if schedule.at_fit_start and not self.fit_start_fired and first >= schedule.start_step:
            return
        max_steps = getattr(trainer, "max_steps", -1)
        max_epochs = getattr(trainer, "max_epochs", None)
        if not isinstance(max_steps, int) or max_steps < 0:
            max_steps = None
        if not isinstance(max_epochs, int) or max_epochs < 0:
            max_epochs = None
        if max_steps is None and (max_epochs is None or not schedule.acts_on_epochs):
            return  # the fit's length is not known yet: warn_if_never_fired says it at the end
        end = min(max_steps if max_steps is not None else math.inf, schedule.end_step if schedule.end_step is not None
                  else math.inf)
        low = max(first, schedule.start_step)
        n = schedule.every_n_steps
        steps = [s for s in (*schedule.steps, *self._boundaries) if s >= first]
        if any(low <= s <= end for s in steps) or (n is not None and _multiple_in(low - 1, end, n)):
            return
        if schedule.acts_on_epochs:
            if max_steps is not None and low <= end and max_epochs is None:
                return  # epoch lengths unknown: an epoch may start within the steps left
            start_epoch = getattr(trainer, "current_epoch", 0)
            last_epoch = (max_epochs - 1) if max_epochs is not None else math.inf
            epochs = [e for e in schedule.epochs if start_epoch <= e <= last_epoch]
            every = schedule.every_n_epochs
            if (epochs or (every is not None and _multiple_in(start_epoch - 1, last_epoch, every))) and low <= end:
                return
        self._warned_unreachable = True
        length = (f"max_steps={max_steps}" if max_steps is not None else "") + \
            (", " if max_steps is not None and max_epochs is not None else "") + \
            (f"max_epochs={max_epochs}" if max_epochs is not None else "")
        rank_zero_warn(f"{self.owner}: Schedule({schedule.describe()}) can never act in this fit ({length}, starting "
                       f"at step {first}): {self._fix()}")

    def _clock_triggers(self) -> bool:
        schedule = self.schedule
        return bool(schedule.at_fit_start or schedule.steps or schedule.every_n_steps or schedule.acts_on_epochs
                    or schedule.at_task_boundaries)

    def _fix(self) -> str:
        return ("move its steps/epochs inside the fit (or start_step/end_step around them), or raise the trainer's "
                "max_steps/max_epochs")

    def due_at_epoch_start(self, trainer) -> str | None:
        """Call from ``on_train_epoch_start``."""
        epoch, last = trainer.current_epoch, self.last_epoch
        if last is not None and epoch <= last:  # the same epoch again: a fit resumed in its middle
            return None
        self.last_epoch = epoch
        low = epoch - 1 if last is None else last  # first check of the fit: only this epoch counts
        reached = [e for e in self.schedule.epochs if low < e <= epoch]
        n = self.schedule.every_n_epochs
        if n is not None and _multiple_in(low, epoch, n):
            reached.append(epoch - epoch % n)
        return self._fire(trainer, f"epoch {max(reached)}") if reached else None

    def due_at_step(self, trainer) -> str | None:
        """Call from the callback's step hook (batch start, before the optimizer step, or batch end)."""
        step = trainer.global_step
        last = step - 1 if self.last_step is None else self.last_step
        if step <= last:
            return None
        self.last_step = step
        if any(last < b <= step for b in self._boundaries):
            task = sum(b <= step for b in self._boundaries)
            return self._fire(trainer, f"task {task} starts (step {step})")
        n = self.schedule.every_n_steps
        every = n is not None and (n == 1 or _multiple_in(last, step, n))  # n == 1: every step, step 0 too
        if every or any(last < s <= step for s in self.schedule.steps):
            return self._fire(trainer, f"step {step}")
        return self._threshold_due(trainer, step) if self.schedule.threshold is not None else None

    def _threshold_due(self, trainer, step: int) -> str | None:
        rule = self.schedule.threshold
        value = self._threshold_value(trainer)
        if value is None:
            if not self._warned_missing and step >= self.schedule.start_step + rule.warn_after_steps:
                self._warned_missing = True
                rank_zero_warn(f"{self.owner}: Schedule(threshold={rule.metric!r}) has read no value at step {step}: "
                               f"the metric is not logged (logged: {sorted(trainer.callback_metrics)[:12]}); add "
                               "PlasticityMonitor with the group that logs it, or fix the name")
            return None
        if self.threshold_fired_step is not None:
            if rule.cooldown is None and value == self.threshold_acted_on:  # the measurement already acted on
                return None
            if rule.cooldown is not None and step - self.threshold_fired_step < rule.cooldown:
                return None
        if (rule.max_actions is not None and self.threshold_fires >= rule.max_actions) or not rule.crossed(value):
            return None
        reason = self._fire(trainer, rule.describe(value))
        if reason is not None:
            self.threshold_fires += 1
            self.threshold_fired_step, self.threshold_acted_on = step, value
        return reason

    def _threshold_value(self, trainer) -> float | None:
        """The threshold's metric (mean over ranks; None when not logged). A resumed fit whose metric is not
        logged yet reads the value it had when the checkpoint was written, so a crossing logged just before
        that checkpoint is acted on once, after the resume as before it."""
        value = trainer.callback_metrics.get(self.schedule.threshold.metric)
        value = float(value) if value is not None else self._restored_value
        if trainer.world_size > 1:  # ranks may log different local values: every rank decides on the mean
            local = torch.tensor(math.nan if value is None else value, dtype=torch.float64,
                                 device=trainer.strategy.root_device)
            value = float(all_reduce_mean(trainer, local))
        return None if value is None or math.isnan(value) else value

    def due_at_validation_end(self, trainer, pl_module) -> str | None:
        """Call from ``on_validation_end`` on every rank (the metric is averaged over ranks)."""
        schedule = self.schedule
        if schedule.monitor is None or trainer.sanity_checking:
            return None
        value = trainer.callback_metrics.get(schedule.monitor)
        if value is None:
            raise RuntimeError(f"{self.owner}: Schedule(monitor={schedule.monitor!r}) is not logged; logged metrics: "
                               f"{sorted(trainer.callback_metrics)}")
        # Ranks may log different local values: decide on the mean so every rank acts alike.
        value = float(all_reduce_mean(trainer, torch.as_tensor(value, dtype=torch.float64, device=pl_module.device)))
        if self.cooldown_left > 0:
            self.cooldown_left -= 1
            self.best = value if self._improved(value) else self.best
            return None
        if self._improved(value):
            self.best, self.wait = value, 0
            return None
        self.wait += 1
        limit = schedule.max_plateau_fires
        if self.wait < schedule.patience or (limit is not None and self.plateau_fires >= limit):
            return None
        reason = self._fire(trainer, f"plateau of {schedule.monitor}")
        if reason is not None:
            self.plateau_fires += 1
            self.best, self.wait, self.cooldown_left = None, 0, schedule.cooldown
        return reason

    # ------------------------------------------------------------------ resume
    def state_dict(self) -> dict[str, Any]:
        return {"fit_start_fired": self.fit_start_fired, "last_epoch": self.last_epoch, "last_step": self.last_step,
                "last_fired_step": self.last_fired_step, "fired": [list(f) for f in self.fired], "best": self.best,
                "wait": self.wait, "cooldown_left": self.cooldown_left, "plateau_fires": self.plateau_fires,
                **self._threshold_state()}

    def _threshold_state(self) -> dict[str, Any]:
        if self.schedule.threshold is None:
            return {}
        trainer = self._trainer() if getattr(self, "_trainer", None) is not None else None
        value = trainer.callback_metrics.get(self.schedule.threshold.metric) if trainer is not None else None
        return {"threshold_fires": self.threshold_fires, "threshold_fired_step": self.threshold_fired_step,
                "threshold_acted_on": self.threshold_acted_on,
                "threshold_value": float(value) if value is not None else self._restored_value}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        check_state(f"{self.owner} schedule", state, _STATE_TYPES, _THRESHOLD_STATE_TYPES)
        self.fit_start_fired = bool(state["fit_start_fired"])
        self.last_epoch, self.last_step = state["last_epoch"], state["last_step"]
        self.last_fired_step = state["last_fired_step"]
        self.fired = [(int(step), str(reason)) for step, reason in state["fired"]]
        self.best, self.wait = state["best"], int(state["wait"])
        self.cooldown_left, self.plateau_fires = int(state["cooldown_left"]), int(state["plateau_fires"])
        self.threshold_fires = int(state.get("threshold_fires", 0))
        self.threshold_fired_step = state.get("threshold_fired_step")
        self.threshold_acted_on, self._restored_value = state.get("threshold_acted_on"), state.get("threshold_value")

    def __getstate__(self) -> dict[str, Any]:  # a copy or pickle of a callback carries no trainer
        return {k: v for k, v in self.__dict__.items() if k != "_trainer"}

    # ------------------------------------------------------------------ internals
    def _fire(self, trainer, reason: str) -> str | None:
        step = trainer.global_step
        schedule = self.schedule
        if step < schedule.start_step or (schedule.end_step is not None and step > schedule.end_step):
            return None
        if self.last_fired_step == step:  # another trigger already acted at this very step
            return None
        self.last_fired_step = step
        self.fired.append((step, reason))
        return reason

    def _improved(self, value: float) -> bool:
        if self.best is None:
            return not math.isnan(value)
        delta = self.schedule.min_delta
        return value < self.best - delta if self.schedule.mode == "min" else value > self.best + delta


def _multiple_in(low: int, high: int, n: int) -> bool:
    """Whether a positive multiple of ``n`` lies in ``(low, high]``."""
    first = max(n, (low // n + 1) * n)
    return first <= high


def runs_validation(trainer) -> bool:
    """Whether a Lightning fit will validate (True where the trainer does not say: another loop's view)."""
    if not hasattr(trainer, "val_dataloaders") or not hasattr(trainer, "limit_val_batches"):
        return True
    return trainer.val_dataloaders is not None and trainer.limit_val_batches != 0


def task_boundary_steps(trainer, owner: str) -> tuple[int, ...]:
    """The data module's ``task_boundary_steps`` (global steps where a new task starts), checked."""
    datamodule = getattr(trainer, "datamodule", None)
    steps = getattr(datamodule, "task_boundary_steps", None)
    if steps is None:
        raise ValueError(f"{owner}: Schedule(at_task_boundaries=True) needs trainer.datamodule to expose "
                         f"task_boundary_steps (the global steps where a new task starts); "
                         f"{type(datamodule).__name__} has none. Pass a task-stream data module to trainer.fit")
    if isinstance(steps, (str, bytes)) or not isinstance(steps, Sequence) or not all(
            isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in steps):
        raise ValueError(f"{owner}: {type(datamodule).__name__}.task_boundary_steps={steps!r} must be a list of "
                         "positive integers (task 0 starts at step 0 and is not a boundary)")
    return tuple(sorted(set(steps)))
