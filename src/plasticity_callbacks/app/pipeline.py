"""Multi-phase training from one Hydra config: pretrain → SFT, continual pretraining, ...

A phase is a block under ``phases:`` (in order)::

    phases:
      pretrain: {steps: 600, data: {...}, optimizer: {lr: 3e-3}}
      sft:      {steps: 300, data: {_target_: ...SFTDataModule}, optimizer: {lr: 1.5e-3}}

Each phase gets its own ``Trainer``, optimizer and LR schedule; the weights always carry over,
the optimizer's moments only with ``carry_optimizer: true``. A phase's ``data`` / ``optimizer``
/ ``trainer`` blocks are merged onto the top-level ones (a ``data`` block naming another
``_target_`` replaces it). The plasticity *method* (``+method=fire_lm``, else ``default_method``)
acts at every boundary: its callbacks join every phase after the first, and it may reset the
optimizer or the whole model there. Later phases also validate on earlier phases' validation
sets, logged as ``retention/<phase>/loss``.

Run directory::

    checkpoints/<phase>/last.ckpt    mid-phase (every checkpoint.every_n_train_steps)
    checkpoints/<phase>/final.ckpt   end of the phase (weights, optimizer, callbacks)
    logs/<phase>/metrics.csv         the phase's metrics (steps count from 0 in every phase)
    pipeline.json                    per-phase summary, step offsets, method and seed

Resuming: ``pipeline.resume=true hydra.run.dir=<run>`` skips completed phases and continues an
interrupted one from its ``last.ckpt``; ``pipeline.start_phase=sft`` re-runs from a completed
phase's checkpoint (``pipeline.init_from=<ckpt>`` takes the weights from another run).
A resume is refused (one-line ``ResumeError``) when the run directory holds no run, when the
configuration differs from the one recorded in ``pipeline.json`` at the start (unless listed in
``resume_allow_changes``), or while another process holds the directory's lock. Every checkpoint
is written through ``VerifiedCheckpointIO`` (read back, SHA-256 beside it, checked on load), and a
phase is recorded complete only once its ``final.ckpt`` is verified on disk.
"""
from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import torch
from hydra.utils import instantiate
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only, rank_zero_warn
from omegaconf import DictConfig, OmegaConf

from .runs.checkpoint_folders import load_sharded, save_folder
from ..distributed.strategy import saves_folders
from ..errors import CheckpointError
from .runs.checkpoints import (VerifiedCheckpointIO, newest_last_checkpoint, read_checkpoint, stop_signals_deferred,
                               verify_file)
from .runs.verified_files import hashes_remembered, replace_synced, write_synced
from .runs.resume import ResumeError, ResumeGuard, RunLock, changed_keys, refuse_changes, run_fingerprint
from ..data.sft import MultiValidationDataModule
from ..data.tokenizer import IGNORE_INDEX
from ..models.lightning_module import GPTLightningModule, check_data_fits_model
from ..errors import ConfigError
from .methods import check_method, check_method_targets, user_config_dirs, with_method_settings
from .progress import progress_callbacks
from .time_estimate import TimeEstimate
from .runs.resumed_logs import LogPosition, restore_logs

PHASE_KEYS = {"data", "steps", "optimizer", "trainer", "callbacks", "carry_optimizer", "retention"}
STATE_FILE = "pipeline.json"


@dataclass
class Phase:
    name: str
    index: int
    data: DictConfig
    steps: int
    optimizer: dict[str, Any]
    trainer: DictConfig
    callbacks: dict[str, Any]
    carry_optimizer: bool
    retention: list[str] = field(default_factory=list)  # earlier phases whose validation sets are measured


def resolve_method(cfg: DictConfig) -> DictConfig:
    """``+method=X`` if given, else ``default_method``; an empty method (no callbacks) when neither exists."""
    method = cfg.get("method") or cfg.get("default_method") or OmegaConf.create({"name": "warm"})
    check_method(method)
    check_method_targets(method, user_config_dirs())  # before any of its targets is imported
    return method


def build_phases(cfg: DictConfig, method: DictConfig) -> list[Phase]:
    if not cfg.get("phases"):
        raise ConfigError("no phases: set `phases:` (e.g. experiment=pretrain_sft)")
    phases = []
    for index, (name, block) in enumerate(cfg.phases.items()):
        block = block or {}
        unknown = set(block) - PHASE_KEYS
        if unknown:
            raise ConfigError(f"phases.{name} has unknown keys {sorted(unknown)}; allowed: {sorted(PHASE_KEYS)}")
        steps = block.get("steps")
        if not isinstance(steps, int) or steps <= 0:
            raise ConfigError(f"phases.{name}.steps must be a positive integer, got {steps!r}")
        data = block.get("data") or {}
        if data.get("_target_", cfg.data._target_) == cfg.data._target_:
            data = OmegaConf.merge(cfg.data, data)
        callbacks = dict(cfg.get("callbacks") or {})
        callbacks.update(block.get("callbacks") or {})
        carry = bool(block.get("carry_optimizer", False))
        if index > 0:  # the method acts at the boundary into this phase
            callbacks.update(method.get("callbacks") or {})
            if method.get("carry_optimizer") is not None:
                carry = bool(method.carry_optimizer)
        earlier = [p.name for p in phases]
        retention = block.get("retention", True)
        retention = earlier if retention is True else [] if not retention else list(retention)
        if set(retention) - set(earlier):
            raise ConfigError(f"phases.{name}.retention={retention} names phases that do not come before it: {earlier}")
        # the method's optimizer settings last: a method that is a setting (l2's weight decay) holds in every phase
        optimizer = OmegaConf.to_container(OmegaConf.merge(cfg.optimizer, block.get("optimizer") or {},
                                                           method.get("optimizer") or {}), resolve=True)
        trainer = OmegaConf.merge(cfg.trainer, block.get("trainer") or {})
        phases.append(Phase(name, index, data, steps, optimizer, trainer, callbacks, carry, retention))
    return phases


class PhaseModule(GPTLightningModule):
    """The GPT module, validating on several sets: dataloader 0 logs ``val/loss``, dataloader k
    logs ``retention/<name>/loss`` (weighted by supervised tokens, like ``val/loss``)."""

    def __init__(self, *args, retention_names: list[str] = (), **kwargs):
        super().__init__(*args, **kwargs)
        from torchmetrics import MeanMetric

        self.retention_names = list(retention_names)
        self.retention_loss = torch.nn.ModuleList(MeanMetric() for _ in self.retention_names)

    def validation_step(self, batch, batch_idx: int, dataloader_idx: int = 0) -> None:
        if dataloader_idx == 0 and not self.retention_names:
            return super().validation_step(batch, batch_idx)
        x, y = batch
        logits = self.model(x)
        loss, weight = self.loss(logits, y), (y != IGNORE_INDEX).sum()
        if dataloader_idx == 0:
            self.val_loss.update(loss, weight=weight)
            self.val_ppl.update(logits, y)
            self.log("val/loss", self.val_loss, prog_bar=True, add_dataloader_idx=False)
            self.log("val/ppl", self.val_ppl, add_dataloader_idx=False)
        else:
            metric = self.retention_loss[dataloader_idx - 1]
            metric.update(loss, weight=weight)
            self.log(f"retention/{self.retention_names[dataloader_idx - 1]}/loss", metric, add_dataloader_idx=False)


class CarryOptimizerState(L.Callback):
    """At fit start, loads the previous phase's optimizer moments into this phase's fresh optimizer,
    keeping this phase's learning rates and schedule. Listed first, so that a method acting in
    ``on_fit_start`` (e.g. FIRE resetting the state of the weights it treated) acts after it.

    Args:
        optimizer_states: the previous checkpoint's ``optimizer_states`` (a file checkpoint).
        folder: the previous phase's distributed checkpoint (FSDP2): each rank reads its shards of the moments.
    """

    def __init__(self, optimizer_states: list[dict] | None = None, folder: str | Path | None = None):
        self.optimizer_states = optimizer_states
        self.folder = folder

    def on_fit_start(self, trainer, pl_module) -> None:
        if self.folder is not None:
            for index, optimizer in enumerate(trainer.optimizers):
                load_sharded_moments(pl_module, optimizer, Path(self.folder), f"optimizer_{index}")
            return
        if len(trainer.optimizers) != len(self.optimizer_states):
            raise ConfigError(f"carry_optimizer: the previous phase had {len(self.optimizer_states)} optimizers, "
                              f"this one has {len(trainer.optimizers)}")
        for optimizer, saved in zip(trainer.optimizers, self.optimizer_states):
            optimizer.load_state_dict(with_saved_moments(optimizer.state_dict(), saved))


def load_sharded_moments(module: torch.nn.Module, optimizer, folder: Path, key: str) -> None:
    """Load the moments saved under ``key`` in the distributed checkpoint ``folder`` into ``optimizer`` (each rank
    its shards, by parameter name), keeping ``optimizer``'s own param groups (learning rates, schedule)."""
    import copy

    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    # get_optimizer_state_dict creates the moments of a fresh optimizer (a zero step at lr 0) for dcp.load to fill
    current = get_optimizer_state_dict(module, optimizer)
    groups = copy.deepcopy(current["param_groups"])  # before dcp.load overwrites them with the saved ones
    saved = {key: current}
    try:
        load_sharded(saved, folder)  # its param-group settings read as data, never unpickled with code
    except CheckpointError:
        raise
    except Exception as err:  # another optimizer, other parameters: DCP names the missing keys
        first = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
        raise ConfigError(f"carry_optimizer: the optimizer state in {folder} does not fit this phase's optimizer "
                          f"({first}); set carry_optimizer: false") from err
    set_optimizer_state_dict(module, optimizer, {"state": saved[key]["state"], "param_groups": groups})


def with_saved_moments(current: dict, saved: dict) -> dict:
    """``current`` (fresh param groups: LRs, schedule) with ``saved``'s per-parameter state."""
    if "optimizers" in current:  # optim.CombinedOptimizer (Muon + AdamW)
        if len(saved.get("optimizers", [])) != len(current["optimizers"]):
            raise ConfigError("carry_optimizer: the previous phase used a different optimizer")
        return {"optimizers": [with_saved_moments(c, s) for c, s in zip(current["optimizers"], saved["optimizers"])]}
    if "param_groups" not in saved:
        raise ConfigError("carry_optimizer: the previous phase used a different optimizer")
    if [len(g["params"]) for g in current["param_groups"]] != [len(g["params"]) for g in saved["param_groups"]]:
        raise ConfigError("carry_optimizer: the previous phase's optimizer has different parameter groups")
    return {**current, "state": saved["state"]}


def load_checkpoint(path: Path) -> dict:
    # Our own phase checkpoints: they hold optimizer and callback state, not only tensors; verified first.
    return read_checkpoint(path, map_location="cpu")


NUMBER_OR_NULL = {"type": ["number", "null"]}
# What pipeline.json must hold to be resumed from; keys beyond these are kept as they are.
STATE_SCHEMA = {
    "type": "object",
    "required": ["phases"],
    "properties": {
        "method": {"type": "string"},
        "seed": {"type": "integer"},
        "phase_order": {"type": "array", "items": {"type": "string"}},
        "config": {"type": "object"},
        "phases": {"type": "object", "additionalProperties": {
            "type": "object",
            "required": ["index", "steps", "step_offset"],
            "properties": {
                "index": {"type": "integer", "minimum": 0},
                "steps": {"type": "integer", "minimum": 1},
                "step_offset": {"type": "integer", "minimum": 0},
                "metrics": {"type": "object", "additionalProperties": NUMBER_OR_NULL},
                "summary": {"type": "object", "additionalProperties": NUMBER_OR_NULL},
                "checkpoint": {"type": "string"},
                **{key: NUMBER_OR_NULL for key in ("train_loss", "val_loss_before", "val_loss", "retention_loss",
                                                  "dormant_fraction", "dfi_before", "dfi_after", "minutes")},
            },
        }},
    },
}


def read_state(path: Path) -> dict:
    """``pipeline.json``, checked against ``STATE_SCHEMA``, or ``{}`` when there is none; a damaged or
    edited file is a one-line :class:`CheckpointError` before anything trains."""
    import jsonschema

    pending = path.with_name(path.name + ".writing")
    if not path.is_file() and pending.is_file():  # a first write interrupted before its rename
        with contextlib.suppress(json.JSONDecodeError, UnicodeDecodeError, OSError):
            json.loads(pending.read_text())
            pending.replace(path)
    if not path.is_file():
        return {}
    try:
        state = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path} is not valid JSON ({err}): truncated or edited; restore it, or start a new "
                              "run directory") from None
    error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(STATE_SCHEMA).iter_errors(state))
    if error is not None:
        where = "/".join(str(part) for part in error.absolute_path) or "the top level"
        raise CheckpointError(f"{path} is not a pipeline state: at {where}, {error.message[:160]}; restore it, or "
                              "start a new run directory")
    return state


def write_state(path: Path, state: dict) -> None:
    """Atomically and durably: a reader (or a resume after a kill or a power cut) sees the old file or the
    new one, never half of one; SIGTERM and SIGINT wait until the file is in place."""
    pending = path.with_name(path.name + ".writing")
    try:
        with stop_signals_deferred():
            write_synced(pending, json.dumps(state, indent=2).encode())
            replace_synced(pending, path)
    except OSError as err:
        raise CheckpointError(f"could not write {path}: {err.strerror or err}") from err


class Pipeline:
    """Runs ``cfg.phases`` in order; see the module docstring."""

    def __init__(self, cfg: DictConfig):
        self.method = resolve_method(cfg)
        self.cfg = cfg = with_method_settings(cfg, self.method)  # its model/optimizer settings: the whole run's
        self.phases = build_phases(cfg, self.method)
        self.run_dir = Path(cfg.paths.output_dir)
        self.options = cfg.get("pipeline") or {}
        names = [p.name for p in self.phases]
        for key in ("start_phase", "stop_phase"):
            if self.options.get(key) is not None and self.options[key] not in names:
                raise ConfigError(f"pipeline.{key}={self.options[key]!r} is not one of the phases {names}")
        state_path = self.run_dir / STATE_FILE
        old = read_state(state_path)
        self.fingerprint = run_fingerprint(cfg)
        if self.options.get("resume"):
            self.check_resume(old)
        self.state = {"method": str(self.method.get("name", "custom")), "seed": int(cfg.seed), "phase_order": names,
                      "phases": {p: old["phases"][p] for p in names if p in old.get("phases", {})},
                      "config": self.fingerprint}

    def check_resume(self, old: dict) -> None:
        """Refuse to resume what is not there, or what was started with another configuration."""
        where = f"{self.run_dir} (pipeline.resume=true)"
        if not old:
            raise ResumeError(f"cannot resume {where}: it holds no {STATE_FILE}, so no run was started there; check "
                              "hydra.run.dir, or drop pipeline.resume=true to start a new run")
        if "config" in old:
            allow = list(self.cfg.get("resume_allow_changes") or [])
            refuse_changes(where, changed_keys(old["config"], self.fingerprint, allow))

    def check_before_start(self) -> None:
        """Every refusal that the files on disk decide, before anything is written (``plasticity-train``
        calls it before Hydra creates the run directory): the run to resume and its configuration
        (checked on construction), a checkpoint that needs arbitrary code to load or is damaged, and a
        checkpoint of another phase or run in the place of the one the run would load."""
        names = [p.name for p in self.phases]
        start = names.index(self.options.get("start_phase") or names[0])
        if self.options.get("init_from") is not None and Path(self.options.init_from).exists():
            read_checkpoint(self.options.init_from, mmap=True)  # mmap: checked without reading every tensor
        elif start > 0 and self.final_checkpoint(self.phases[start - 1]).exists():
            previous = self.final_checkpoint(self.phases[start - 1])
            ResumeGuard(phase=names[start - 1]).check_origin(read_checkpoint(previous, mmap=True), str(previous),
                                                             compare_config=False)
        if not self.options.get("resume"):
            return
        allow = list(self.cfg.get("resume_allow_changes") or [])
        for phase in self.phases[start:]:
            if phase.name in self.state["phases"] and self.final_checkpoint(phase).exists():
                verify_file(self.final_checkpoint(phase))
                continue
            last = newest_last_checkpoint(self.checkpoint_dir(phase))
            if last is not None:  # the interrupted phase: also its model's shapes and its callbacks
                guard = ResumeGuard(config=self.fingerprint, allow_changes=allow, phase=phase.name)
                interrupted = read_checkpoint(last, mmap=True)
                module = module_on_meta(lambda: self.build_module(phase))
                if module is None:
                    guard.check_origin(interrupted, str(last))
                else:
                    callbacks = [guard, *instantiate_callbacks(phase.callbacks),
                                 instantiate(self.cfg.checkpoint, dirpath=str(self.checkpoint_dir(phase)))]
                    guard.check(interrupted, callbacks, module, str(last))
            return

    def checkpoint_dir(self, phase: Phase) -> Path:
        return self.run_dir / "checkpoints" / phase.name

    def final_checkpoint(self, phase: Phase) -> Path:
        return self.checkpoint_dir(phase) / "final.ckpt"

    def run(self) -> dict[str, Any]:
        with hashes_remembered():  # each checkpoint hashed once, though checked at start-up and again at its load
            self.check_before_start()  # a refusal writes nothing, not even the lock or pipeline.json
            with RunLock(self.run_dir):
                return self._run()

    def is_complete(self, phase: Phase) -> bool:
        """Recorded complete in pipeline.json and its final.ckpt present (integrity checked when loaded)."""
        if phase.name not in self.state["phases"]:
            return False
        if not self.final_checkpoint(phase).exists():
            rank_zero_warn(f"phase {phase.name}: {STATE_FILE} records it complete but {self.final_checkpoint(phase)} "
                           "is missing; running it again (from its last.ckpt when there is one)")
            return False
        return True

    def _run(self) -> dict[str, Any]:
        names = [p.name for p in self.phases]
        start = names.index(self.options.get("start_phase") or names[0])
        stop = names.index(self.options.get("stop_phase") or names[-1])
        previous, previous_phase = self.options.get("init_from"), None  # init_from: another run's weights
        if previous is None and start > 0:
            previous, previous_phase = self.final_checkpoint(self.phases[start - 1]), names[start - 1]
        if previous is not None and not Path(previous).exists():
            raise ConfigError(f"cannot start at phase {names[start]!r}: no checkpoint {previous} "
                              "(run the earlier phase first or set pipeline.init_from)")
        offset = sum(self.phases[i].steps for i in range(start))
        self.save_state()  # the run exists from now on: a resume after an early kill finds it
        for phase in self.phases[start : stop + 1]:
            final = self.final_checkpoint(phase)
            if self.options.get("resume") and self.is_complete(phase):
                verify_file(final)
                rank_zero_info(f"phase {phase.name}: already complete, skipped")
            else:
                self.state["phases"][phase.name] = self.run_phase(phase, previous, offset, previous_phase)
                self.save_state()
            previous, previous_phase, offset = final, phase.name, offset + phase.steps
        rank_zero_info(format_table(self.state))
        return self.state

    def save_state(self) -> None:
        if rank_zero_only.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            write_state(self.run_dir / STATE_FILE, self.state)

    def build_data(self, phase: Phase) -> L.LightningDataModule:
        # _convert_="all": plain lists and dicts in the data's hyperparameters, so checkpoints load with weights_only.
        main = instantiate(phase.data, _convert_="all")
        if not phase.retention:
            return main
        earlier = {p.name: p for p in self.phases}
        return MultiValidationDataModule(main, {name: instantiate(earlier[name].data, _convert_="all")
                                                for name in phase.retention})

    def build_module(self, phase: Phase) -> PhaseModule:
        model = OmegaConf.to_container(self.cfg.model, resolve=True)
        return PhaseModule(model, optimizer=dict(phase.optimizer), retention_names=phase.retention)

    def run_phase(self, phase: Phase, previous: Path | str | None, offset: int,
                  previous_phase: str | None = None) -> dict[str, Any]:
        started = time.perf_counter()  # the phase's minutes and its time estimate count its set-up too
        cfg, ckpt_dir = self.cfg, self.checkpoint_dir(phase)
        resume_from = newest_last_checkpoint(ckpt_dir) if self.options.get("resume") else None
        L.seed_everything(cfg.seed + phase.index, workers=True)
        datamodule, module = self.build_data(phase), self.build_module(phase)
        check_data_fits_model(datamodule, module.config)
        callbacks = instantiate_callbacks(phase.callbacks)
        if previous is not None and resume_from is None:
            saved = load_checkpoint(Path(previous))
            if previous_phase is not None:  # this run's previous phase, not a copy of another phase's file
                ResumeGuard(phase=previous_phase).check_origin(saved, str(previous), compare_config=False)
            module.load_state_dict(saved["state_dict"])
            if phase.carry_optimizer:
                callbacks.insert(0, CarryOptimizerState(folder=previous) if Path(previous).is_dir()
                                 else CarryOptimizerState(saved["optimizer_states"]))
        # The configuration was compared when the pipeline started; the guard checks shapes and callback states,
        # here before the logger empties the phase's metrics file, and again as Lightning loads the checkpoint.
        guard = ResumeGuard(config=self.fingerprint, allow_changes=list(cfg.get("resume_allow_changes") or []),
                            phase=phase.name)
        names = [p.name for p in self.phases]
        to_run = self.phases[phase.index : names.index(self.options.get("stop_phase") or names[-1]) + 1]
        estimate = TimeEstimate([(p.name, p.steps) for p in to_run], started=started)
        callbacks = [guard, *callbacks, LogPosition(), estimate, *progress_callbacks(phase.trainer, phase.name),
                     instantiate(cfg.checkpoint, dirpath=str(ckpt_dir))]
        interrupted = read_checkpoint(resume_from, mmap=True) if resume_from is not None else None
        if interrupted is not None:
            guard.check(interrupted, callbacks, module, str(resume_from))
        logger = instantiate(cfg.logger, version=phase.name)
        restore_logs(logger, interrupted)  # the rows logged up to the checkpoint, once (resumed_logs.py)
        quiet = {"enable_model_summary": False} if phase.index > 0 else {}  # the same model: summarized once
        trainer: L.Trainer = instantiate(phase.trainer, max_steps=phase.steps, logger=logger, callbacks=callbacks,
                                         plugins=[VerifiedCheckpointIO()], **quiet)
        rank_zero_info(f"phase {phase.index + 1}/{len(self.phases)} {phase.name!r}: {phase.steps} steps, method "
                       f"{self.state['method']!r}{' (resumed from ' + str(resume_from) + ')' if resume_from else ''}")
        if resume_from is None and cfg.get("validate_before_fit", True):
            before = merged(trainer.validate(module, datamodule=datamodule, verbose=False))
            guard.carried["val_loss_before"] = before.get("val/loss")
        trainer.fit(module, datamodule=datamodule, ckpt_path=str(resume_from) if resume_from else None)
        metrics = guard.metrics_with_restored(trainer)  # with what was logged before an interruption
        train_loss = metrics.get("train/loss")
        after = merged(trainer.validate(module, datamodule=datamodule, verbose=False))
        if saves_folders(trainer):  # a distributed checkpoint: written aside, checksummed, renamed (all ranks)
            save_folder(trainer, self.final_checkpoint(phase))
        else:
            trainer.save_checkpoint(self.final_checkpoint(phase), weights_only=False)
        metrics.update({k: float(v) for k, v in after.items()})
        first = self.phases[0].name
        return {
            "index": phase.index, "steps": phase.steps, "step_offset": offset,
            "train_loss": None if train_loss is None else float(train_loss),
            "val_loss_before": guard.carried.get("val_loss_before"), "val_loss": after.get("val/loss"),
            "retention_loss": after.get("val/loss") if phase.index == 0 else after.get(f"retention/{first}/loss"),
            "dormant_fraction": metrics.get("redo/dormant"),
            "summary": summary_values(trainer.callbacks, metrics),
            "minutes": (time.perf_counter() - started) / 60,
            "metrics": metrics, "log_dir": logger.log_dir if hasattr(logger, "log_dir") else None,
            "checkpoint": str(self.final_checkpoint(phase)),
        }


def module_on_meta(build) -> L.LightningModule | None:
    """``build()``'s module with its tensors on the meta device (shapes without memory or initialization, for
    the checks before a resume starts), or None when it cannot be built there (the run checks it again)."""
    try:
        with torch.device("meta"):
            return build()
    except Exception:
        return None


def merged(results: list[dict[str, float]]) -> dict[str, float]:
    """``trainer.validate`` returns one dict per validation dataloader; one dict of all."""
    return {key: float(value) for result in results for key, value in result.items()}


def summary_values(callbacks, metrics: dict[str, float]) -> dict[str, float]:
    """What each plasticity method names as its summary (``summary_metrics``), as this phase logged it."""
    names = dict.fromkeys(name for callback in callbacks for name in getattr(callback, "summary_metrics", ()))
    values = {name: first_metric(metrics, name) for name in names}
    return {name: value for name, value in values.items() if value is not None}


def first_metric(metrics: dict[str, float], prefix: str) -> float | None:
    """The metric named ``prefix`` or, failing that, its ``/mean`` variant."""
    for key in (prefix, f"{prefix}/mean", f"{prefix}_mean"):
        if key in metrics:
            return metrics[key]
    return None


def format_table(state: dict[str, Any]) -> str:
    """The end-of-run table: one row per phase."""
    summaries = dict.fromkeys(name for row in state["phases"].values() for name in row.get("summary", {}))
    columns = [("phase", None), ("steps", "steps"), ("train loss", "train_loss"), ("val loss", "val_loss"),
               ("retention", "retention_loss"), *((name, name) for name in summaries), ("minutes", "minutes")]

    def cell(value) -> str:
        return "-" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)

    rows = [[name] + [cell({**row, **row.get("summary", {})}.get(key)) for _, key in columns[1:]]
            for name, row in state["phases"].items()]
    widths = [max(len(c[0]), *(len(r[i]) for r in rows)) for i, c in enumerate(columns)]
    lines = ["  ".join(h.ljust(w) for (h, _), w in zip(columns, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in rows]
    retention = "retention = loss on the first phase's validation set"
    return "\n".join(["", f"pipeline summary (method {state['method']}, seed {state['seed']}; {retention})", *lines])


def callback_specs(group) -> list:
    """The callback specs in ``group`` (a mapping of name -> spec, null, or a nested group), in order.
    An entry without ``_target_`` is a group of entries (a task-stream method is one: ``{name: spec}``)."""
    specs = []
    for spec in (group or {}).values():
        if spec is not None:
            specs.extend([spec] if "_target_" in spec else callback_specs(spec))
    return specs


def instantiate_callbacks(group) -> list[L.Callback]:
    """Every callback in ``group``, built one way for a single fit and for each pipeline phase."""
    return [instantiate(spec, _convert_="all") for spec in callback_specs(group)]
