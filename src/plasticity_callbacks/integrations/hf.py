"""Run any of the package's Lightning callbacks inside a Hugging Face ``transformers.Trainer``.

:class:`HFTrainerCallback` is a ``TrainerCallback`` that drives one Lightning callback through its
ordinary hooks (``setup``, ``on_train_start``, ``on_train_batch_start``, ``on_before_optimizer_step``,
…), handing it a small view of the Hugging Face trainer in place of ``lightning.Trainer``: the
global step, epoch, optimizer, task boundaries, ranks and a collective, a logger. The callback's
schedule, math, logging and state are therefore the very ones a Lightning run uses.

Hook map (Hugging Face → Lightning):
    on_train_begin      → setup("fit"), load_state_dict (on a resume), on_fit_start, on_train_start
    on_epoch_begin/end  → on_train_epoch_start / on_train_epoch_end
    on_step_begin       → on_train_batch_start        (``global_step`` = optimizer steps taken)
    on_substep_end      → on_train_batch_end, on_train_batch_start (gradient accumulation micro-batches)
    on_pre_optimizer_step → on_before_optimizer_step  (gradients accumulated, all-reduced and clipped)
    on_step_end         → on_train_batch_end          (after the optimizer step)
    on_evaluate         → on_validation_end           (``Schedule(monitor="eval_loss")`` reads its metrics)
    on_save             → state_dict, into ``<checkpoint>/plasticity_callbacks.pt``: written whole or not at
                          all, its SHA-256 beside it, read back on a resume as data only (``weights_only``)
    on_train_end        → on_train_end, on_fit_end, teardown("fit")

Metrics the callback logs (``pl_module.log``, and an action's metrics, written to ``trainer.loggers``)
go through ``Trainer.log`` at the end of the step, so they reach ``trainer.state.log_history`` and
every ``report_to`` integration. Under ``accelerate`` DDP every process runs the callback on its full
copy of the model, as under Lightning's DDP.
"""
from __future__ import annotations

import contextlib
import io
import math
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn

from ..app.runs.checkpoints import read_checkpoint
from ..app.runs.verified_files import write_verified
from ..arguments import sorted_int_list
from ..errors import CheckpointError, ResumeError
from ..extras import require_module
from .lightning_hooks import TaskBoundaries, run_hook

transformers = require_module("transformers", "hf", "plasticity_callbacks.integrations.hf")
TrainerCallback = transformers.TrainerCallback
PREFIX_CHECKPOINT_DIR = transformers.trainer_utils.PREFIX_CHECKPOINT_DIR

STATE_FILE = "plasticity_callbacks.pt"
DRIVEN_HOOKS = ("setup", "on_fit_start", "on_train_start", "on_train_epoch_start", "on_train_batch_start",
                "on_before_optimizer_step", "on_train_batch_end", "on_train_epoch_end", "on_validation_end",
                "on_train_end", "on_fit_end", "teardown", "state_dict", "load_state_dict")


class HFTrainerCallback(TrainerCallback):
    """A ``transformers.TrainerCallback`` that runs the package's Lightning callbacks, in the order given.

    Args:
        callbacks: Lightning callbacks of this package (``FIREReinit``, ``ReDoMonitor``, ``DASHShrink``, …).
        trainer: the ``transformers.Trainer`` it is added to; with it, metrics go through ``Trainer.log``
            (log history and every ``report_to`` integration). Without it they reach ``state.log_history`` only.
        task_boundary_steps: global steps where a new task starts, for ``Schedule(at_task_boundaries=True)``;
            None: the training dataset's ``task_boundary_steps`` attribute, if any.

    Example:
        >>> trainer = Trainer(model=GPT2LMHeadModel(GPT2Config(n_layer=2)), args=args, train_dataset=data)
        >>> fire = FIREReinit(schedule=Schedule(steps=[500]), selection={"scope": "attention"})
        >>> trainer.add_callback(HFTrainerCallback(fire, ReDoMonitor(), trainer=trainer))
        >>> trainer.train()   # FIRE at step 500; fire/dfi_before, redo/dormant, … in trainer.state.log_history
    """

    def __init__(self, *callbacks, trainer=None, task_boundary_steps: list[int] | None = None):
        import lightning as L

        if not callbacks:
            raise ValueError("HFTrainerCallback() needs at least one callback, e.g. HFTrainerCallback(FIREReinit())")
        for callback in callbacks:
            if not isinstance(callback, L.Callback):
                raise TypeError("HFTrainerCallback runs Lightning callbacks of plasticity_callbacks (e.g. FIREReinit), "
                                f"got {type(callback).__name__}")
            if not any(getattr(type(callback), hook) is not getattr(L.Callback, hook) for hook in DRIVEN_HOOKS):
                raise ValueError(f"HFTrainerCallback: {type(callback).__name__}() overrides none of the hooks it drives "
                                 f"({', '.join(DRIVEN_HOOKS)}), so it would do nothing; pass a callback that acts, "
                                 "e.g. FIREReinit()")
        if trainer is not None and not isinstance(trainer, transformers.Trainer):
            raise ValueError(f"HFTrainerCallback: trainer={trainer!r} must be the transformers.Trainer the adapter is "
                             "added to, or None")
        if task_boundary_steps is not None:
            task_boundary_steps = sorted_int_list("HFTrainerCallback task_boundary_steps", task_boundary_steps)
        keys = [callback.state_key for callback in callbacks]
        if len(set(keys)) < len(keys):
            raise ValueError(f"HFTrainerCallback: two callbacks share a state key ({keys}); their checkpointed states "
                             "would overwrite each other: give them different arguments")
        self.callbacks, self.hf_trainer, self.task_boundary_steps = list(callbacks), trainer, task_boundary_steps
        self.view: _TrainerView | None = None
        self._batch_idx = 0
        self._warned_unbound = False

    def __repr__(self) -> str:
        return f"HFTrainerCallback({', '.join(type(c).__name__ for c in self.callbacks)})"

    # ------------------------------------------------------------------------------------ hooks
    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.view = _TrainerView(self, args, state, model, optimizer, kwargs.get("train_dataloader"))
        self._batch_idx = 0
        self._call("setup", model, "fit")
        if state.global_step > 0:  # Trainer.train(resume_from_checkpoint=...) restored the trainer's state
            saved = self._saved_states(args, state)
            for callback in self.callbacks:
                callback.load_state_dict(saved[callback.state_key])
        self._call("on_fit_start", model)
        self._call("on_train_start", model)

    def on_epoch_begin(self, args, state, control, model=None, **kwargs):
        self._call("on_train_epoch_start", model)

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self._call("on_train_batch_start", model, None, self._batch_idx)
        self._flush_metrics(args, state)  # what acts at global step N is logged at step N

    def on_substep_end(self, args, state, control, model=None, **kwargs):
        self._call("on_train_batch_end", model, None, None, self._batch_idx)
        self._batch_idx += 1
        self._call("on_train_batch_start", model, None, self._batch_idx)

    def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kwargs):
        self._call("on_before_optimizer_step", model, _unwrap(optimizer))
        self._flush_metrics(args, state)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self._call("on_train_batch_end", model, None, None, self._batch_idx)
        self._batch_idx += 1
        self._flush_metrics(args, state)

    def on_epoch_end(self, args, state, control, model=None, **kwargs):
        self._call("on_train_epoch_end", model)

    def on_evaluate(self, args, state, control, model=None, metrics=None, **kwargs):
        if self.view is None:  # trainer.evaluate() outside of train(): no schedule is running
            return
        self.view.callback_metrics.update({k: torch.tensor(float(v)) for k, v in (metrics or {}).items()
                                           if isinstance(v, (int, float))})
        self._call("on_validation_end", model)

    def on_save(self, args, state, control, **kwargs):
        if not args.should_save or self.view is None:
            return
        path = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}" / STATE_FILE
        states = {callback.state_key: callback.state_dict() for callback in self.callbacks}
        # One file for every adapter of the trainer: each keeps its own group, the others' are kept as read.
        groups = [group for group in read_state_file(path) if not set(group) & set(states)] if path.exists() else []
        buffer = io.BytesIO()
        torch.save({"adapters": [*groups, states]}, buffer)
        write_verified(buffer.getvalue(), path)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        for hook in ("on_train_end", "on_fit_end"):
            self._call(hook, model)
        self._call("teardown", model, "fit")
        self._flush_metrics(args, state)

    # ------------------------------------------------------------------------------- internals
    def _call(self, hook: str, model, *args) -> None:
        if self.view is None:
            raise RuntimeError(f"{self!r}: {hook} before on_train_begin; add the adapter before trainer.train()")
        run_hook(self.callbacks, hook, self.view, model, *args)

    def _saved_states(self, args, state) -> dict[str, Any]:
        folder = args.resume_from_checkpoint if isinstance(args.resume_from_checkpoint, str) else None
        folder = Path(folder or Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        path = folder / STATE_FILE
        if not path.is_file():
            raise FileNotFoundError(
                f"{self!r}: training resumes at global step {state.global_step}, but {path} does not exist; resume "
                f"from a checkpoint written with this callback attached, or set TrainingArguments(resume_from_"
                f"checkpoint=<that checkpoint folder>)")
        keys = {callback.state_key for callback in self.callbacks}
        saved = next((group for group in read_state_file(path) if set(group) & keys), {})
        missing, dropped = sorted(keys - set(saved)), sorted(set(saved) - keys)
        differences = ([f"no state for {', '.join(missing)}"] if missing else []) + \
            ([f"state of callbacks this run does not have: {', '.join(dropped)}"] if dropped else [])
        if differences:
            raise ResumeError(f"cannot resume from {path}: {'; '.join(differences)}; give the adapter the checkpointed "
                              "run's callbacks with the same arguments, or start a new run")
        return saved

    def _flush_metrics(self, args, state) -> None:
        metrics, self.view.pending = self.view.pending, {}
        if not metrics:
            return
        if self.hf_trainer is not None:
            self.hf_trainer.log(metrics)
            return
        state.log_history.append({**metrics, "epoch": state.epoch, "step": state.global_step})
        if not self._warned_unbound and [r for r in (args.report_to or []) if r != "none"]:
            self._warned_unbound = True
            rank_zero_warn(f"{self!r} has no trainer: its metrics reach trainer.state.log_history but not "
                           f"report_to={args.report_to}; pass HFTrainerCallback(callback, trainer)")


def read_state_file(path: Path) -> list[dict[str, Any]]:
    """The callback states in ``path`` (``plasticity_callbacks.pt``), one group per adapter: verified against its
    ``.sha256`` and read as data (``weights_only``); a damaged, truncated, empty or hostile file is a one-line
    :class:`~plasticity_callbacks.errors.CheckpointError` naming it."""
    saved = read_checkpoint(path)
    groups = saved.get("adapters")
    if not isinstance(groups, list) or not all(isinstance(group, dict) for group in groups):
        raise CheckpointError(f"checkpoint {path} holds no adapter states (keys {sorted(saved)[:4]}): it was not "
                              f"written by HFTrainerCallback; resume from a checkpoint folder written with it")
    return groups


class _HFStrategy:
    """The collectives the callbacks call on ``trainer.strategy``, over ``torch.distributed`` (``accelerate``'s)."""

    def __init__(self, args, world_size: int):
        self.args, self.world_size = args, world_size
        self.root_device = args.device

    def reduce(self, tensor: torch.Tensor, reduce_op: str = "mean") -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        tensor = tensor.clone()
        torch.distributed.all_reduce(tensor)
        return tensor / self.world_size if reduce_op == "mean" else tensor

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Lightning's: True when every rank (``all``) or any rank decided True."""
        votes = int(self.reduce(torch.tensor(int(decision), device=self.root_device), reduce_op="sum"))
        return votes == self.world_size if all else votes > 0

    def barrier(self, name: str | None = None) -> None:
        if self.world_size > 1:
            torch.distributed.barrier()

    def batch_to_device(self, batch):
        return _to_device(batch, self.root_device)


class _HFShardedStrategy(_HFStrategy):
    """Named like Lightning's FSDP strategy so the callbacks' sharding check refuses it with its usual message."""


_HFShardedStrategy.__name__ = "HFTrainerFSDPStrategy"


class _HFDeepSpeedStrategy(_HFStrategy):
    pass


_HFDeepSpeedStrategy.__name__ = "HFTrainerDeepSpeedStrategy"


class _HFPrecision:
    """Inputs as the Trainer feeds them; the forward under the Trainer's autocast."""

    def __init__(self, hf_trainer):
        self.hf_trainer, self.scaler = hf_trainer, None

    def convert_input(self, batch):
        return batch

    def train_step_context(self):
        if self.hf_trainer is not None:
            return self.hf_trainer.autocast_smart_context_manager()
        return contextlib.nullcontext()


class _HFLogger:
    """``trainer.logger`` for the callbacks: figures under the run's logging folder, metrics to the Trainer's log."""

    def __init__(self, view: _TrainerView, folder: str):
        self.view, self.log_dir = view, folder
        self.save_dir = folder

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.view.pending.update({k: float(v) for k, v in metrics.items()})

    def save(self) -> None:
        """Nothing to write: the Trainer's ``log`` does, at the end of the hook."""


class _TrainerView:
    """What the callbacks read from a ``lightning.Trainer``, answered from the Hugging Face trainer's state."""

    def __init__(self, adapter: HFTrainerCallback, args, state, model, optimizer, train_dataloader):
        self.args, self.state, self.model = args, state, model
        self._optimizer = _unwrap(optimizer)
        self.train_dataloader = train_dataloader
        self.hf_trainer = adapter.hf_trainer
        self.callbacks = adapter.callbacks
        self.callback_metrics: dict[str, torch.Tensor] = {}
        self.pending: dict[str, float] = {}
        self.global_rank, self.local_rank, self.world_size = args.process_index, args.local_process_index, \
            args.world_size
        self.is_global_zero = self.global_rank == 0
        self.default_root_dir = args.output_dir
        self.log_every_n_steps = max(1, int(args.logging_steps)) if args.logging_steps >= 1 else 1
        self.sanity_checking = False
        self.lr_scheduler_configs: list = []
        self.precision_plugin = _HFPrecision(self.hf_trainer)
        strategy = _HFStrategy
        if getattr(args, "fsdp", None):
            strategy = _HFShardedStrategy
        if getattr(args, "deepspeed", None):
            strategy = _HFDeepSpeedStrategy
        self.strategy = strategy(args, self.world_size)
        self.logger = _HFLogger(self, getattr(args, "logging_dir", None) or args.output_dir)
        self.loggers = [self.logger]
        steps = adapter.task_boundary_steps
        if steps is None and train_dataloader is not None:
            steps = getattr(getattr(train_dataloader, "dataset", None), "task_boundary_steps", None)
        self.datamodule = TaskBoundaries(steps)

    @property
    def global_step(self) -> int:
        return self.state.global_step

    @property
    def current_epoch(self) -> int:
        return math.floor((self.state.epoch or 0.0) + 1e-6)  # HF counts fractional epochs

    @property
    def max_steps(self) -> int:
        return self.state.max_steps

    @property
    def optimizers(self) -> list:
        return [self._optimizer] if self._optimizer is not None else []

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def log(self, name: str, value, **ignored) -> None:
        """``pl_module.log``: the value (a float or a one-element tensor) waits for the step's ``Trainer.log``."""
        self.pending[name] = float(value.detach()) if torch.is_tensor(value) else float(value)

    def log_dict(self, metrics: dict, **options) -> None:
        for name, value in metrics.items():
            self.log(name, value, **options)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        """The Trainer's loss on ``batch`` (``compute_loss``), for callbacks that run their own gradient pass."""
        if self.hf_trainer is not None:
            return self.hf_trainer.compute_loss(self.model, batch)
        return self.model(**batch).loss


def _unwrap(optimizer):
    """The torch optimizer inside ``accelerate``'s ``AcceleratedOptimizer`` (whose ``step`` runs the inner one's)."""
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


def _to_device(batch, device):
    if torch.is_tensor(batch):
        return batch.to(device)
    if isinstance(batch, dict) or hasattr(batch, "items"):
        return type(batch)({k: _to_device(v, device) for k, v in batch.items()})
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(v, device) for v in batch)
    return batch
