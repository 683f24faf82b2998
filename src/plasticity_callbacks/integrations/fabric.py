"""Run the package's Lightning callbacks in a Lightning Fabric loop (litgpt's trainer shape).

A Fabric loop is the user's own ``for`` loop, so :class:`FabricPlasticity` is called at its few points
and drives each callback through its ordinary hooks, handing it a small view of the loop in place of
``lightning.Trainer``: the optimizer steps taken, the optimizers, ranks and the strategy's collective,
Fabric's loggers. The callback's schedule, math, logging and state are the very ones a ``Trainer`` run uses.

Calls (loop → Lightning hooks):
    fit_start()              → setup("fit"), load_state_dict (after load_state_dict here), on_fit_start,
                               on_train_start
    batch_start(batch_idx)   → on_train_batch_start          (``global_step`` = optimizer steps taken)
    before_optimizer_step()  → on_before_optimizer_step      (after ``fabric.backward``, before ``optimizer.step``)
    batch_end(batch_idx)     → on_train_batch_end            (after ``optimizer.step``: counts the step)
    epoch_start()            → on_train_epoch_start          (optional: epoch triggers)
    validation_end(metrics)  → on_validation_end             (optional: ``Schedule(monitor=...)`` reads them)
    fit_end()                → on_train_end, on_fit_end, teardown("fit")
    save(path) / load(path)  the callbacks' states in their own verified file (call load before fit_start)

Saving and resuming: :meth:`FabricPlasticity.save` writes ``{"global_step", "callbacks"}`` through a temporary
file with its ``.sha256`` beside it (rank 0; the states are the same on every rank), and
:meth:`FabricPlasticity.load` reads it back through ``read_checkpoint``: checked against the checksum and unpickled
with ``weights_only=True``, so a damaged, altered or hostile file is one :class:`~plasticity_callbacks.errors.
CheckpointError` naming it, and no code in it runs. ``fabric.save``/``fabric.load`` keep the model and optimizer;
``fabric.load`` is torch's reader (no checksum), so the callbacks' states do not travel through it.
``state_dict()`` / ``load_state_dict(state)`` remain for a loop that stores the states itself; ``load_state_dict``
checks the state's shape and refuses anything else in one line.
"""
from __future__ import annotations

import io
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn

from ..app.runs.checkpoints import read_checkpoint
from ..app.runs.verified_files import write_verified
from ..arguments import check_int
from ..errors import CheckpointError
from .lightning_hooks import TaskBoundaries, run_hook

STATE_KEY = "fabric_plasticity"  # the one entry of a file written by FabricPlasticity.save


class FabricPlasticity:
    """Drive the package's callbacks (``FIREReinit``, ``ReDoMonitor``, ``DASHPeriodic``, …) from a Fabric loop.

    Args:
        fabric: the ``lightning.Fabric`` of the loop (its strategy, ranks, loggers, collectives).
        model: the model as returned by ``fabric.setup`` (or the plain module).
        optimizers: the optimizer(s) from ``fabric.setup`` / ``fabric.setup_optimizers``.
        callbacks: Lightning callbacks of this package, run in the order given.
        training_step: ``training_step(batch, batch_idx) -> loss``, for callbacks that run their own gradient
            pass (``DASHShrink``); with ``train_dataloader``.
        train_dataloader: the loop's training batches, for that pass.
        task_boundary_steps: global steps where a new task starts, for ``Schedule(at_task_boundaries=True)``.
        log_every_n_steps: the cadence of callbacks that log every k steps by the trainer's setting.
        max_steps: the loop's length in optimizer steps, if known: a schedule that can never act within it is
            warned about at fit start (None: at fit end, if it never acted).

    Raises:
        TypeError: a callback is not a Lightning callback.
        ValueError: no callback, or two with the same ``state_key`` (their checkpointed states would collide).

    Example:
        >>> fire = FIREReinit(schedule=Schedule(steps=[500]))
        >>> with FabricPlasticity(fabric, model, optimizer, fire) as plasticity:   # fit_start ... fit_end
        ...     for batch_idx, batch in enumerate(loader):
        ...         plasticity.batch_start(batch_idx)
        ...         fabric.backward(loss_fn(model, batch))
        ...         plasticity.before_optimizer_step()
        ...         optimizer.step(); optimizer.zero_grad()
        ...         plasticity.batch_end(batch_idx)
    """

    def __init__(self, fabric, model: nn.Module, optimizers, *callbacks: L.Callback,
                 training_step: Callable[[Any, int], torch.Tensor] | None = None, train_dataloader=None,
                 task_boundary_steps: list[int] | None = None, log_every_n_steps: int = 50,
                 max_steps: int | None = None):
        check_int("FabricPlasticity log_every_n_steps", log_every_n_steps)
        check_int("FabricPlasticity max_steps", max_steps, optional=True, hint="(the loop's optimizer steps)")
        if not callbacks:
            raise ValueError("FabricPlasticity needs at least one callback, e.g. FabricPlasticity(fabric, model, "
                             "optimizer, FIREReinit())")
        for callback in callbacks:
            if not isinstance(callback, L.Callback):
                raise TypeError("FabricPlasticity runs Lightning callbacks of plasticity_callbacks (e.g. FIREReinit), "
                                f"got {type(callback).__name__}")
        keys = [callback.state_key for callback in callbacks]
        if len(set(keys)) < len(keys):
            raise ValueError(f"FabricPlasticity: two callbacks share a state key ({keys}); their checkpointed states "
                             "would overwrite each other: give them different arguments")
        self.callbacks = list(callbacks)
        self._restored: Mapping[str, Any] | None = None
        self.module = getattr(model, "_original_module", model)  # the user's module: its own names and classes
        optimizers = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
        self.view = _LoopView(fabric, self.module, [getattr(o, "optimizer", o) for o in optimizers],
                              training_step, train_dataloader, task_boundary_steps, log_every_n_steps, self.callbacks)
        self.view.max_steps = -1 if max_steps is None else max_steps

    def __repr__(self) -> str:
        return f"FabricPlasticity({', '.join(type(c).__name__ for c in self.callbacks)})"

    @property
    def global_step(self) -> int:
        """Optimizer steps taken (counted by :meth:`batch_end`; restored by :meth:`load_state_dict`)."""
        return self.view.global_step

    def __enter__(self) -> FabricPlasticity:
        """``with FabricPlasticity(...) as plasticity:`` runs :meth:`fit_start` on entry, :meth:`fit_end` on exit."""
        self.fit_start()
        return self

    def __exit__(self, *exc) -> None:
        self.fit_end()

    # ------------------------------------------------------------------------------------ the loop's calls
    def fit_start(self) -> None:
        self._call("setup", "fit")
        if self._restored is not None:  # Lightning's order: setup, then the checkpoint's states, then fit start
            for callback in self.callbacks:
                callback.load_state_dict(self._restored["callbacks"][callback.state_key])
            self._restored = None
        self._call("on_fit_start")
        self._call("on_train_start")

    def epoch_start(self) -> None:
        self._call("on_train_epoch_start")

    def batch_start(self, batch_idx: int) -> None:
        self._call("on_train_batch_start", None, batch_idx)

    def before_optimizer_step(self) -> None:
        for optimizer in self.view.optimizers:
            self._call("on_before_optimizer_step", optimizer)

    def batch_end(self, batch_idx: int, stepped: bool = True) -> None:
        """After the batch; ``stepped=False`` for a gradient-accumulation micro-batch (no optimizer step)."""
        self.view.global_step += int(stepped)
        self._call("on_train_batch_end", None, None, batch_idx)

    def validation_end(self, metrics: Mapping[str, float] | None = None) -> None:
        self.view.callback_metrics.update({k: torch.as_tensor(float(v)) for k, v in (metrics or {}).items()})
        self._call("on_validation_end")

    def fit_end(self) -> None:
        for hook in ("on_train_end", "on_fit_end"):
            self._call(hook)
        self._call("teardown", "fit")

    def state_dict(self) -> dict[str, Any]:
        """``{"global_step", "callbacks": {state_key: state}}``, for ``fabric.save(path, {..., "plasticity": ...})``."""
        return {"global_step": self.view.global_step,
                "callbacks": {c.state_key: c.state_dict() for c in self.callbacks}}

    def load_state_dict(self, state: Mapping[str, Any], source: str = "the state") -> None:
        """Restore what :meth:`state_dict` gave, before :meth:`fit_start` (as Lightning restores before fit start).

        Args:
            state: ``{"global_step": int, "callbacks": {state_key: dict}}``.
            source: what the state was read from, for the error (:meth:`load` passes the file).

        Raises:
            CheckpointError: the state is not of that shape, or holds no entry for one of the callbacks (other
                callbacks or arguments than the saved run's); one line naming ``source``.
        """
        if not isinstance(state, Mapping) or not isinstance(state.get("callbacks"), Mapping) or isinstance(
                state.get("global_step"), bool) or not isinstance(state.get("global_step"), int) or \
                state["global_step"] < 0:
            shown = sorted(map(str, state))[:4] if isinstance(state, Mapping) else type(state).__name__
            raise CheckpointError(f"{self!r}: {source} is not a FabricPlasticity state ({shown}); expected "
                                  "{'global_step': int >= 0, 'callbacks': {state_key: state}} as state_dict() gives")
        bad = [key for key, value in state["callbacks"].items() if not isinstance(value, Mapping)]
        if bad:
            raise CheckpointError(f"{self!r}: {source} holds a state for {bad} that is not a mapping; it was not "
                                  "written by FabricPlasticity.state_dict()")
        missing = [c.state_key for c in self.callbacks if c.state_key not in state["callbacks"]]
        if missing:
            raise CheckpointError(f"{self!r}: {source} holds no entry for {missing}; it holds "
                                  f"{sorted(state['callbacks'])} (callbacks or their arguments differ from the saved "
                                  "run's: give the run's callbacks with the same arguments)")
        self.view.global_step = int(state["global_step"])
        self._restored = state  # loaded into the callbacks by fit_start, after their setup

    def save(self, path: str | Path) -> Path:
        """Write :meth:`state_dict` to ``path`` with its ``.sha256`` (rank 0 writes; every rank waits for it).

        Example:
            >>> fabric.save("ckpt/step-500.ckpt", {"model": model, "optimizer": optimizer})
            >>> plasticity.save("ckpt/step-500.plasticity.pt")
        """
        path = Path(path)
        if self.view.is_global_zero:
            buffer = io.BytesIO()
            torch.save({STATE_KEY: self.state_dict()}, buffer)
            write_verified(buffer.getvalue(), path)
        self.view.strategy.barrier("FabricPlasticity.save")
        return path

    def load(self, path: str | Path, trust: bool | None = None) -> None:
        """Read a file written by :meth:`save` (checksum verified, ``weights_only``) and restore it before
        :meth:`fit_start`; a missing, damaged, altered, foreign or hostile file is one ``CheckpointError`` naming it.

        Args:
            path: the file :meth:`save` wrote.
            trust: full unpickling, for a file from a source you trust (None: ``PLASTICITY_TRUST_CHECKPOINTS``).

        Example:
            >>> fabric.load("ckpt/step-500.ckpt", {"model": model, "optimizer": optimizer})
            >>> plasticity.load("ckpt/step-500.plasticity.pt")
            >>> with plasticity: ...
        """
        saved = read_checkpoint(path, trust=trust)
        if STATE_KEY not in saved:
            raise CheckpointError(f"checkpoint {path} holds no FabricPlasticity state (keys {sorted(map(str, saved))[:4]}): "
                                  "it was not written by FabricPlasticity.save; load the file that save() wrote")
        self.load_state_dict(saved[STATE_KEY], source=f"checkpoint {path}")

    # ------------------------------------------------------------------------------- internals
    def _call(self, hook: str, *args) -> None:
        run_hook(self.callbacks, hook, self.view, self.module, *args)


class _LoopStrategy:
    """``trainer.strategy`` for the callbacks: Fabric's collectives; named like Fabric's strategy (set per
    instance) so that the callbacks' sharding check sees FSDP, DeepSpeed or ModelParallel as such."""

    def __init__(self, fabric):
        self.fabric = fabric
        self.root_device = fabric.device

    def reduce(self, tensor: torch.Tensor, reduce_op: str = "mean") -> torch.Tensor:
        return self.fabric.all_reduce(tensor, reduce_op=reduce_op) if self.fabric.world_size > 1 else tensor

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Lightning's: True when every rank (``all``) or any rank decided True (the non-finite rule's skip)."""
        votes = int(self.reduce(torch.tensor(int(decision), device=self.root_device), reduce_op="sum"))
        return votes == self.fabric.world_size if all else votes > 0

    def barrier(self, name: str | None = None) -> None:
        self.fabric.barrier(name)

    def batch_to_device(self, batch):
        return self.fabric.to_device(batch)


class _Precision:
    """Batches as the loop feeds them; the forward under Fabric's autocast."""

    def __init__(self, fabric):
        self.fabric, self.scaler = fabric, None

    def convert_input(self, batch):
        return batch

    def train_step_context(self):
        return self.fabric.autocast()


class _LoopView:
    """What the callbacks read from a ``lightning.Trainer``, answered from the Fabric loop."""

    def __init__(self, fabric, module, optimizers, training_step, train_dataloader, task_boundary_steps,
                 log_every_n_steps, callbacks):
        self.fabric, self.model, self.optimizers, self.callbacks = fabric, module, optimizers, callbacks
        self._training_step, self.train_dataloader = training_step, train_dataloader
        self.global_step, self.current_epoch, self.max_steps = 0, 0, -1
        self.callback_metrics: dict[str, torch.Tensor] = {}
        self.global_rank, self.local_rank, self.world_size = fabric.global_rank, fabric.local_rank, fabric.world_size
        self.is_global_zero = fabric.is_global_zero
        self.log_every_n_steps = log_every_n_steps
        self.sanity_checking = False
        self.lr_scheduler_configs: list = []
        self.precision_plugin = _Precision(fabric)
        self.strategy = type(type(fabric.strategy).__name__, (_LoopStrategy,), {})(fabric)
        self.loggers = list(fabric.loggers)
        self.logger = self.loggers[0] if self.loggers else None
        self.default_root_dir = getattr(self.logger, "log_dir", None) or "."
        self.datamodule = TaskBoundaries(task_boundary_steps)

    @property
    def device(self) -> torch.device:
        return self.fabric.device

    def log(self, name: str, value, **ignored) -> None:
        """``pl_module.log``: kept in ``callback_metrics`` and written to Fabric's loggers at this step."""
        value = float(value.detach()) if torch.is_tensor(value) else float(value)
        self.callback_metrics[name] = torch.tensor(value)
        self.fabric.log(name, value, step=self.global_step)

    def log_dict(self, metrics: dict, **options) -> None:
        for name, value in metrics.items():
            self.log(name, value, **options)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        if self._training_step is None:
            raise RuntimeError("this callback runs its own gradient pass: pass FabricPlasticity(..., "
                               "training_step=lambda batch, batch_idx: loss, train_dataloader=loader)")
        return self._training_step(batch, batch_idx)
