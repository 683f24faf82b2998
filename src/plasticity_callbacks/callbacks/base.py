"""``PlasticityCallback``: the base of every method that acts on a :class:`~callbacks.schedule.Schedule`."""
from __future__ import annotations

import importlib
import pkgutil
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, ClassVar

import lightning as L
import torch
from torch import nn

from .state import check_state
from ..distributed.strategy import is_dtensor, require_full_parameters
from ..model_map import Selection, require_patterns_match, require_targets, select_targets
from ..model_map.coverage import log_coverage
from ..ops.fresh import fresh_values
from ..ops.optimizer_state import reset_optimizer_state
from .schedule import Schedule, ScheduleState
from ..distributed.sharded_state import pack_for_checkpoint, reshard
from .step_logging import log_at_step, write_to_loggers

STEP_HOOKS = ("on_train_batch_start", "on_before_optimizer_step", "on_train_batch_end")


def nonfinite_parameters(module: torch.nn.Module, gradients: bool = False) -> list[str]:
    """Names of ``module``'s trainable parameters holding NaN or Inf (with ``gradients``: or whose gradient
    does); under FSDP2 each rank looks at its own shards. One device sync when every value is finite.

    Example:
        >>> nonfinite_parameters(model, gradients=True)
        ['layers.0.mlp.up.weight']
    """
    named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    tensors = [(name, t) for name, p in named for t in ((p, p.grad) if gradients else (p,)) if t is not None]
    if not tensors:
        return []
    finite = [torch.isfinite(t.to_local() if is_dtensor(t) else t).all() for _, t in tensors]
    if bool(torch.stack(finite).all()):
        return []
    return list(dict.fromkeys(name for (name, _), ok in zip(tensors, finite) if not bool(ok)))


class PlasticityCallback(L.Callback):
    """A plasticity method: the base owns *when* (hooks, schedule, resume), the subclass writes *what* in ``act``.

    Set-up: ``setup`` starts a new fit's schedule state, checks the strategy (sharded parameters are refused
    unless ``supports_fsdp2``) and that the selection finds weights (:meth:`check_targets`); :meth:`attach`
    (hooks, per-fit tensors placed like the parameters) runs at ``on_fit_start`` and again at
    ``on_train_start``, after a checkpoint restore and the strategy's set-up.

    When: ``on_train_start`` (fit start), ``on_train_epoch_start`` (epochs), ``step_hook``
    (steps, task boundaries; ``on_train_batch_start`` unless a subclass names another) and
    ``on_validation_end`` (plateaus) ask the :class:`ScheduleState` whether the schedule is due and,
    if so, call ``act(trainer, pl_module, reason)``. The metrics ``act`` returns are an event
    (:meth:`log_event`): one row in every logger, at the step of the action, whatever ``log_every_n_steps``,
    and the latest value of each in ``trainer.callback_metrics`` (for ``Schedule(monitor=...)``,
    ``ModelCheckpoint``).
    An action at a validation end is written at the next training hook, at the same step, so the
    checkpoint written after that validation keeps it (``pending_logs``) and a resume logs it once.
    An action of an every-step schedule (``every_n_steps=1``) is a series, not an event: its metrics are written
    at the steps that are multiples of ``log_every_n_steps`` (and kept in ``callback_metrics`` at every step).
    A series measured at every step goes through ``pl_module.log`` in the subclass's own hook (Lightning
    writes it at ``log_every_n_steps``); one measured only at some steps goes through
    :func:`~callbacks.step_logging.log_at_step`, which writes it at those steps only.
    ``state_dict`` holds the schedule's state plus :meth:`extra_state`, checked on load with
    ``check_state`` against ``extra_state_types``. A subclass that needs more hooks overrides them
    and calls ``super()``. :meth:`fresh_values` (a fresh draw by the model's own init code) and
    :meth:`reset_optimizer_state` are shared helpers for ``act``; :meth:`targets` gives the selected weights.

    Non-finite values, one rule for every method: a method never acts on a model whose trainable weights
    (or, for a method that reads them, ``reads_gradients``, their gradients) hold NaN or Inf. The action is
    skipped with a warning naming those parameters (:meth:`skip_nonfinite`; the same decision on every
    rank), so a NaN is never moved into another parameter, an EMA or a logged metric. ``act_if`` applies
    it before every scheduled action; a method acting every step calls it in its own hook.

    Class attributes a subclass sets:
        supports_fsdp2: ``act`` works on FSDP2's sharded ``DTensor`` parameters (each rank its own rows);
            False: ``ModelParallelStrategy`` is refused at setup with the fix.
        summary_metrics: logged names a pipeline or report summarizes for this method.
        every_step_hook: the hook in which the method also works at every step outside its schedule (an EMA, a
            pull towards the initial weights, a clip); None: it works only in ``act``. The cross-cutting tests
            read it to know where the method acts.
        quick_settings: arguments under which the method acts within the first few steps of a small model, where
            its defaults wait longer (every 1000 steps, a threshold no unit reaches); the cross-cutting tests
            (resume, DDP, FSDP2, NaN) build the method with them.
        default_schedule: the schedule when none is given (None: the method needs no schedule).
        step_hook: the hook whose step triggers call ``act`` (one of ``STEP_HOOKS``).
        extra_state_types: ``{key: type}`` of :meth:`extra_state`, checked on load.
        optional_state_types: keys :meth:`extra_state` may leave out, with their types.
        parameter_state_keys: keys of :meth:`extra_state` holding lists of tensors shaped like parameters
            (sharded like them under FSDP2, written by :func:`~distributed.sharded_state.pack_for_checkpoint`).
        reads_gradients: the method's action reads gradients, so a NaN/Inf gradient skips it too.
        acts_through: ``{parametrization kind: why the method leaves it alone}``, ``""`` for a kind it acts
            through (:func:`~model_map.refuse_parametrized`); a weight of any other kind is refused by name at setup.

    Args:
        schedule: when to act (a Schedule or a mapping of its fields); None: ``default_schedule``.
        selection: which weights (a :class:`Selection` or a mapping of its fields), checked at setup (fit start,
            before any step: a selection that finds no weight fails there) and read in ``act`` with
            :meth:`targets`; None: the method does not select weights.

    Example:
        >>> class HalveWeights(PlasticityCallback):
        ...     summary_metrics = ("halve/norm",)
        ...     extra_state_types = {"halvings": int}
        ...
        ...     def __init__(self, schedule=None, selection=Selection()):
        ...         super().__init__(schedule, selection)
        ...         self.halvings = 0
        ...
        ...     def act(self, trainer, pl_module, reason):
        ...         targets = require_targets(select_targets(pl_module, self.selection), self.owner, self.selection)
        ...         for t in targets:
        ...             t.write(0.5 * t.read())  # the effective weight (factorized: W_p + BA)
        ...         self.halvings += 1
        ...         return {"halve/norm": float(sum(t.read().norm() for t in targets))}
        ...
        ...     def extra_state(self):
        ...         return {"halvings": self.halvings}
        ...
        ...     def load_extra_state(self, state):
        ...         self.halvings = state["halvings"]
        >>> trainer = L.Trainer(callbacks=[HalveWeights(Schedule(every_n_steps=100))], max_steps=1000)
    """

    supports_fsdp2: ClassVar[bool] = False
    summary_metrics: ClassVar[tuple[str, ...]] = ()
    every_step_hook: ClassVar[str | None] = None
    quick_settings: ClassVar[Mapping[str, Any]] = {}
    default_schedule: ClassVar[Schedule | None] = Schedule(at_fit_start=True)
    step_hook: ClassVar[str] = "on_train_batch_start"
    extra_state_types: ClassVar[Mapping[str, type | tuple[type, ...]]] = {}
    optional_state_types: ClassVar[Mapping[str, type | tuple[type, ...]]] = {}
    parameter_state_keys: ClassVar[tuple[str, ...]] = ()
    reads_gradients: ClassVar[bool] = False
    acts_through: ClassVar[Mapping[str, str]] = {}

    def __init_subclass__(cls, abstract: bool = False, **kwargs: Any) -> None:
        """Check the class's declarations once, where it is defined, and register it (:func:`callback_classes`):
        a public subclass in a module of ``plasticity_callbacks.callbacks`` is exported by the package and found
        by every cross-cutting test. ``abstract=True`` (``class DirectionalShrink(PlasticityCallback,
        abstract=True)``) marks a shared base that is not a method of its own."""
        super().__init_subclass__(**kwargs)
        for name, value in (("step_hook", cls.step_hook), ("every_step_hook", cls.every_step_hook)):
            if value not in STEP_HOOKS and not (name == "every_step_hook" and value is None):
                raise TypeError(f"{cls.__name__}.{name}={value!r} is not one of {STEP_HOOKS}")
        if not abstract:
            register(cls)

    def __init__(self, schedule: Schedule | Mapping | None = None, selection: Selection | Mapping | None = None):
        super().__init__()
        self.schedule = self.default_schedule if schedule is None else Schedule.build(schedule, self.owner)
        self.selection = None if selection is None else Selection.build(selection, self.owner)
        self.firing = None if self.schedule is None else ScheduleState(self.schedule, self.owner)
        self._pending_logs: dict[str, float] = {}

    @property
    def owner(self) -> str:
        """The name used in messages and state keys: the class name."""
        return type(self).__name__

    # ------------------------------------------------------------------ what a subclass writes
    def act(self, trainer: L.Trainer, pl_module: L.LightningModule, reason: str) -> dict[str, float]:
        """Change the model now (``reason`` says why: ``"fit start"``, ``"step 100"``); return the metrics of this
        action (numbers or 0-d tensors), logged once at the current step by :meth:`log_event`."""
        raise NotImplementedError(f"{self.owner} must implement act(trainer, pl_module, reason)")

    def extra_state(self) -> dict[str, Any]:
        """The method's own state that must survive a resume (keys of ``extra_state_types``)."""
        return {}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`extra_state` (already checked against ``extra_state_types``)."""

    def attach(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Set up what ``act`` needs for this fit (forward hooks, tensors paired with parameters); called at
        ``on_fit_start`` (optimizers exist, their checkpointed state is not loaded yet) and again at
        ``on_train_start`` (after FSDP2's late checkpoint restore and parameter set-up), so it must be
        idempotent: remove what a previous call attached, or keep it when it is still current."""

    def check_strategy(self, trainer: L.Trainer) -> None:
        """Refuse strategies the method cannot act under: FSDP1 and DeepSpeed always, FSDP2 unless
        ``supports_fsdp2``. A subclass with further rules overrides this and calls ``super()``."""
        require_full_parameters(trainer, self.owner, fsdp2=self.supports_fsdp2, fsdp2_capable=fsdp2_callbacks)

    def check_targets(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Fail at setup, before any training, when the selection finds no weight; show what it treats and
        why every other weight is left alone (the model map's coverage table)."""
        if self.selection is not None:
            require_targets(select_targets(pl_module, self.selection), self.owner, self.selection, self.acts_through)
            if trainer.is_global_zero:
                log_coverage(pl_module, self.selection, self.owner)

    # ------------------------------------------------------------------ hooks the base owns
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.firing is not None:
            self.firing.begin_fit(stage)
        self.check_strategy(trainer)
        if isinstance(self.selection, Selection):  # a pattern that matches no parameter is a typo, whatever the method
            require_patterns_match(pl_module, self.owner, include=self.selection.include,
                                   exclude=self.selection.exclude)
        self.check_targets(trainer, pl_module)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.attach(trainer, pl_module)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.attach(trainer, pl_module)
        self.write_pending_logs(trainer)  # a resume at a checkpoint written after a validation end's action
        if self.firing is not None:
            self.act_if(self.firing.due_at_train_start(trainer), trainer, pl_module)

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.firing is not None:
            self.act_if(self.firing.due_at_epoch_start(trainer), trainer, pl_module)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        self._step_trigger("on_train_batch_start", trainer, pl_module)

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer) -> None:
        self._step_trigger("on_before_optimizer_step", trainer, pl_module)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch,
                           batch_idx: int) -> None:
        self._step_trigger("on_train_batch_end", trainer, pl_module)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.firing is not None:
            self.act_if(self.firing.due_at_validation_end(trainer, pl_module), trainer, pl_module, defer=True)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.firing is not None:  # a fit that never acted says so (the length may be unknown at its start)
            self.firing.warn_if_never_fired(trainer)

    def state_dict(self) -> dict[str, Any]:
        return {"schedule": None if self.firing is None else self.firing.state_dict(),
                "pending_logs": dict(self._pending_logs), **self.extra_state()}

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        if self.parameter_state_keys:  # FSDP2 shards: to the distributed checkpoint, or gathered for one file
            pack_for_checkpoint(trainer, checkpoint, self.state_key, self.parameter_state_keys)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        check_state(self, state_dict, {"schedule": type(None) if self.firing is None else dict,
                                       **self.extra_state_types}, {**self.optional_state_types, "pending_logs": dict})
        if self.firing is not None:
            self.firing.load_state_dict(state_dict["schedule"])
        self._pending_logs = {str(k): float(v) for k, v in (state_dict.get("pending_logs") or {}).items()}
        self.load_extra_state({k: v for k, v in state_dict.items() if k not in ("schedule", "pending_logs")})

    # ------------------------------------------------------------------ helpers for act
    def targets(self, pl_module: nn.Module) -> list:
        """The weights ``selection`` picks in ``pl_module`` (weight views: ``.name``, ``.param``, ``.shape``); the
        base checked at setup that there is at least one, so a bad selection fails before the first step.

        Raises:
            TypeError: the method passed no selection to ``PlasticityCallback.__init__``.
        """
        if self.selection is None:
            raise TypeError(f"{self.owner} calls self.targets() but passed no selection to PlasticityCallback.__init__: "
                            "pass one (Selection() is every weight but the head), so that setup checks it")
        return select_targets(pl_module, self.selection)

    def fresh_values(self, pl_module: nn.Module, names: Iterable[str], seed: int) -> dict[str, torch.Tensor]:
        """``{name: fresh value}`` of the named parameters, drawn by the model's own init code (Hugging Face
        ``_init_weights``, ``init_weights``, each layer's ``reset_parameters``) from ``seed``; the same values on
        every rank. A parameter that no init reaches is an error naming it and the fix, never a silent copy
        (:func:`~ops.fresh.fresh_values`)."""
        return fresh_values(pl_module, names, seed, self.owner)

    def reset_optimizer_state(self, trainer: L.Trainer, params: Iterable[torch.Tensor]) -> int:
        """Drop the optimizer state of exactly ``params`` (the optimizer then treats them as new: zero moments,
        ``step`` 0); return how many entries were dropped."""
        return reset_optimizer_state(trainer.optimizers, params)

    # ------------------------------------------------------------------ plumbing
    def skip_nonfinite(self, trainer: L.Trainer, pl_module: L.LightningModule, what: str) -> bool:
        """True, with a warning naming the parameters, when a trainable weight (a gradient too, with
        ``reads_gradients``) of ``pl_module`` holds NaN or Inf on any rank: then ``what`` must not happen.

        Example:
            >>> if self.skip_nonfinite(trainer, pl_module, "the EMA update"):
            ...     return
        """
        names = nonfinite_parameters(pl_module, gradients=self.reads_gradients)
        skip = trainer.strategy.reduce_boolean_decision(bool(names), all=False)  # FSDP2: shards differ
        if names:
            values = "weights or gradients" if self.reads_gradients else "weights"
            shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
            warnings.warn(f"{self.owner}: {what} skipped at step {trainer.global_step}: the {values} of {shown} hold "
                          "NaN/Inf (the training diverged: lower the learning rate, clip gradients, or resume from "
                          "an earlier checkpoint)", RuntimeWarning, stacklevel=2)
        return skip

    def act_if(self, reason: str | None, trainer: L.Trainer, pl_module: L.LightningModule, defer: bool = False) -> None:
        """Call :meth:`act` when ``reason`` is not None (and no weight is NaN/Inf: :meth:`skip_nonfinite`) and log
        its metrics as an event."""
        if reason is not None and not self.skip_nonfinite(trainer, pl_module, f"the action of {reason}"):
            # FSDP2 keeps the root unit gathered after an evaluation forward (a validation just ran); the next
            # forward would use that copy and the write to the shards would be lost. No-op without FSDP2.
            reshard(pl_module)
            metrics = self.act(trainer, pl_module, reason) or {}
            if self._every_step_off_cadence(trainer, reason):  # a per-step series: kept, written at the cadence
                log_at_step(trainer, metrics, write=False)
            else:
                self.log_event(trainer, metrics, defer)

    def log_event(self, trainer: L.Trainer, metrics: Mapping[str, Any], defer: bool = False) -> None:
        """Write ``metrics`` once to every logger at ``trainer.global_step`` and keep each in ``callback_metrics``
        (:func:`~callbacks.step_logging.log_at_step`: an action happens once, at its own step, whatever
        ``log_every_n_steps``).

        Args:
            metrics: ``{name: number or 0-d tensor}``; nothing is written when empty.
            defer: keep them (in ``state_dict`` too) for the next training hook, which writes them at the same
                step: at a validation end, whose checkpoint follows, so that a resume logs them once.

        Example:
            >>> self.log_event(trainer, {"fire/dfi_after": 0.01})   # one row, at this step
        """
        self._pending_logs.update(log_at_step(trainer, metrics, write=False))
        if not defer:
            self.write_pending_logs(trainer)

    def write_pending_logs(self, trainer: L.Trainer) -> None:
        """Write the kept metrics to every logger at ``trainer.global_step``, once."""
        values, self._pending_logs = self._pending_logs, {}
        write_to_loggers(trainer, values)

    def _every_step_off_cadence(self, trainer: L.Trainer, reason: str) -> bool:
        """Whether this action is one of an every-step schedule (``every_n_steps=1``) at a step where Lightning
        writes no row (not a multiple of ``log_every_n_steps``): its metrics are then a per-step series, kept in
        ``callback_metrics`` but written only every ``log_every_n_steps`` steps, as ``pl_module.log`` would.
        An action for another reason (fit start, a task boundary) is an event and always written."""
        cadence = getattr(trainer, "log_every_n_steps", 1) or 1
        return (self.schedule is not None and self.schedule.every_n_steps == 1 and cadence > 1
                and reason == f"step {trainer.global_step}" and trainer.global_step % cadence != 0)

    def _step_trigger(self, hook: str, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if hook == self.step_hook and self.firing is not None:
            self.act_if(self.firing.due_at_step(trainer), trainer, pl_module)
        self.write_pending_logs(trainer)  # those of a validation end: no optimizer step since, the same global step


# ---------------------------------------------------------------------- the registry
_REGISTERED: dict[str, type] = {}


def register(cls: type) -> type:
    """Put a callback class of this package in the registry (:func:`callback_classes`). ``PlasticityCallback``
    subclasses register themselves; an observer that is a plain ``L.Callback`` (``GateLogger``) uses this as a
    class decorator. A class outside ``plasticity_callbacks.callbacks`` (a user's, a test's) or with a leading
    underscore is left out: it is not the package's to export.

    Raises:
        TypeError: another class of the package already registered the same name.
    """
    if not cls.__module__.startswith(f"{__package__}.") or cls.__name__.startswith("_"):
        return cls
    known = _REGISTERED.get(cls.__name__, cls)
    if (known.__module__, known.__qualname__) != (cls.__module__, cls.__qualname__):
        raise TypeError(f"two callbacks are named {cls.__name__}: {known.__module__} and {cls.__module__}; rename one")
    _REGISTERED[cls.__name__] = cls  # a module imported again (importlib.reload) replaces its classes
    return cls


def callback_classes() -> dict[str, type]:
    """``{name: class}`` of every callback of this package, from the registry: the one list the package's exports,
    :func:`fsdp2_callbacks`, the report and the cross-cutting tests read. Its modules (every file of
    :mod:`plasticity_callbacks.callbacks`) are imported here, once, so a new file is found without an edit.

    Example:
        >>> sorted(callback_classes())[:3]
        ['AdaptiveSVDSwitch', 'ContinualBackprop', 'DASHPeriodic']
    """
    for info in pkgutil.iter_modules([str(Path(__file__).parent)]):
        importlib.import_module(f"{__package__}.{info.name}")
    return dict(sorted(_REGISTERED.items()))


def plasticity_methods() -> dict[str, type]:
    """``{name: class}`` of the registered :class:`PlasticityCallback` subclasses: the package's methods."""
    return {name: cls for name, cls in callback_classes().items() if issubclass(cls, PlasticityCallback)}


def fsdp2_callbacks() -> list[str]:
    """The names of the registered callbacks that act under FSDP2 (``supports_fsdp2 = True``)."""
    return sorted(name for name, cls in callback_classes().items() if getattr(cls, "supports_fsdp2", False))
