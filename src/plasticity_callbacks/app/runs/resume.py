"""Resume only the run that was interrupted: same configuration, same model, same callbacks, one process.

* :func:`run_fingerprint` flattens a Hydra config into ``{"model.n_embd": 64, ...}``; a resume
  compares it with the one stored when the run started (:func:`changed_keys`) and refuses any
  difference the user did not allow (``resume_allow_changes=[seed, callbacks.redo.*]``).
* :class:`ResumeGuard`, a callback, checks a checkpoint before Lightning restores it: the stored
  fingerprint, every parameter's shape, and that no callback state in it would be dropped.
* :class:`RunLock` holds an exclusive lock on a run directory while a run writes into it.

Every refusal is a :class:`ResumeError` with a one-line message naming what differs.

Example:
    >>> guard = ResumeGuard(config=run_fingerprint(cfg), allow_changes=["trainer.max_steps"], run_dir="outputs/run")
    >>> trainer = L.Trainer(callbacks=[guard, ...], plugins=[VerifiedCheckpointIO()])
    >>> trainer.fit(module, datamodule=data, ckpt_path="outputs/run/checkpoints/last.ckpt")
"""
from __future__ import annotations

import fnmatch
import json
import os
import socket
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.utilities import rank_zero_only

from ...distributed.strategy import saves_folders
from ...errors import CheckpointError, ResumeError
from .checkpoints import VerifiedCheckpointIO, newest_last_checkpoint
from .model_parallel import VerifiedModelParallelStrategy

# Keys a resume may always change: where files go, how the resume itself is asked for, and how long
# training runs (extending a run is what resuming is for). Everything else must match.
ALWAYS_ALLOWED = ("hydra.*", "paths.*", "pipeline.*", "ckpt_path", "resume_allow_changes", "validate_before_fit",
                  "trainer.max_steps", "phases.*.steps", "trainer.default_root_dir", "checkpoint.dirpath",
                  "logger.save_dir", "trainer.enable_progress_bar")
LOCK_FILE = ".run.lock"
_ABSENT = "<absent>"


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts → ``{"a.b.c": leaf}``; lists are leaves (compared whole)."""
    if isinstance(tree, Mapping) and tree:
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: tree} if prefix else {}


def run_fingerprint(cfg) -> dict[str, Any]:
    """The run's resolved configuration, flattened, without the keys a resume may always change."""
    from omegaconf import OmegaConf

    container = OmegaConf.to_container(cfg, resolve=True) if not isinstance(cfg, Mapping) else dict(cfg)
    flat = flatten(container)
    # JSON round trip: the fingerprint is stored in pipeline.json and checkpoints and compared as stored.
    return json.loads(json.dumps({k: v for k, v in flat.items() if not _matches(k, ALWAYS_ALLOWED)}, default=str))


def _matches(key: str, patterns: Sequence[str]) -> bool:
    """``key`` matches a pattern (``*`` spans dots), or lies under one (``callbacks.redo`` covers its arguments)."""
    return any(fnmatch.fnmatchcase(key, p) or key.startswith(p + ".") for p in patterns)


def changed_keys(stored: Mapping[str, Any], current: Mapping[str, Any],
                 allow: Sequence[str] = ()) -> list[tuple[str, Any, Any]]:
    """``(key, stored value, current value)`` for every key that differs and no ``allow`` pattern covers;
    changed values first, then whole blocks added or removed, each named once by its outermost key
    (``callbacks.redo`` rather than each of its arguments)."""
    keys = sorted(set(stored) | set(current))
    changed = [k for k in keys if stored.get(k, _ABSENT) != current.get(k, _ABSENT)
               and not _matches(k, [*ALWAYS_ALLOWED, *allow])]
    values = [(k, stored[k], current[k]) for k in changed if k in stored and k in current]
    blocks: dict[str, tuple[Any, Any]] = {}
    for key in (k for k in changed if (k in stored) != (k in current)):
        side = stored if key not in stored else current  # the side without the key
        prefixes = [".".join(key.split(".")[:i]) for i in range(1, key.count(".") + 2)]
        outside = [p for p in prefixes if not any(k == p or k.startswith(p + ".") for k in side)]
        if not outside:  # an empty block (``callbacks: {}``) on one side, filled on the other: named below
            continue
        blocks[outside[0]] = (_ABSENT, "<added>") if side is stored else ("<present>", _ABSENT)
    return values + [(k, old, new) for k, (old, new) in blocks.items()]


def describe_changes(changes: list[tuple[str, Any, Any]], limit: int = 8) -> str:
    def short(value) -> str:
        text = value if value in (_ABSENT, "<added>", "<present>") else repr(value)
        return text if len(text) <= 40 else text[:37] + "..."

    parts = [f"{key} {short(old)} -> {short(new)}" for key, old, new in changes[:limit]]
    more = f" and {len(changes) - limit} more" if len(changes) > limit else ""
    return ", ".join(parts) + more


def refuse_changes(where: str, changes: list[tuple[str, Any, Any]]) -> None:
    if changes:
        keys = ",".join(k for k, _, _ in changes[:8])
        raise ResumeError(f"cannot resume {where}: the configuration differs from the interrupted run's: "
                          f"{describe_changes(changes)}; undo the change, start a new run directory, or allow it "
                          f"with resume_allow_changes=[{keys}]")


class RunLock:
    """An exclusive lock on ``run_dir`` (``fcntl.flock`` on ``run_dir/.run.lock``), released when the
    process ends, also by SIGKILL. Rank 0 only: the ranks of one DDP run share their directory.

    Example:
        >>> with RunLock("outputs/run"):
        ...     trainer.fit(module)
    """

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self._file = None

    def acquire(self) -> RunLock:
        if rank_zero_only.rank != 0 or self._file is not None:
            return self
        try:
            import fcntl
        except ImportError:  # no flock on this platform: run unlocked
            return self
        self.run_dir.mkdir(parents=True, exist_ok=True)
        lock_file = open(self.run_dir / LOCK_FILE, "a+")
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock_file.seek(0)
            holder = lock_file.read().strip() or "another process"
            lock_file.close()
            raise ResumeError(f"run directory {self.run_dir} is in use by a live run ({holder}); wait for it to end, "
                              "or give this run its own hydra.run.dir") from None
        lock_file.seek(0)
        lock_file.truncate()
        lock_file.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        lock_file.flush()
        self._file = lock_file
        return self

    def release(self) -> None:
        if self._file is not None:
            import fcntl

            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
            self._file = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


class ResumeGuard(L.Callback):
    """Checks that the checkpoint a fit resumes from (``ckpt_path``) belongs to this run, as the
    trainer's ``VerifiedCheckpointIO`` loads it and before Lightning restores anything from it:

    * the configuration stored in it (``config``, saved in this callback's state) equals this run's,
      except keys matched by ``allow_changes`` (fnmatch patterns on dotted keys) or ``ALWAYS_ALLOWED``;
    * with ``phase``, that it was written by that phase (a pipeline's checkpoints carry their phase's name);
    * every parameter has the same shape (a changed width is named, not a ``size mismatch`` traceback);
    * every callback state in it has a callback in this run to go to (a removed callback, or one with
      changed arguments and so another ``state_key``, would silently lose its state).

    It also carries what a resumed fit would otherwise forget: the last value of every scalar metric
    logged up to the checkpoint (``restored_metrics`` after a resume; a summary merges them under
    the resumed fit's own) and ``carried``, values the caller computed outside the fit (the
    validation before it) and reads back after a resume.

    With another checkpoint IO plugin, or a strategy that loads its distributed checkpoint itself (FSDP2),
    the checks run in ``on_load_checkpoint``, after the model's weights were restored (a changed shape is
    then Lightning's own error; :func:`~.checkpoints.read_checkpoint` before the fit names it). With ``run_dir`` it also
    holds a :class:`RunLock` on that directory from ``setup`` to ``teardown``.

    Args:
        config: the run's configuration, flat or nested (e.g. :func:`run_fingerprint`); None: not checked.
        allow_changes: patterns of configuration keys a resume may change.
        run_dir: a directory to lock for the duration of the fit.
        phase: the pipeline phase this fit trains; stored in its checkpoints and required of the one resumed.

    Example:
        >>> trainer = L.Trainer(callbacks=[ResumeGuard(config={"lr": 1e-3}, run_dir="runs/a"), ...])
        >>> trainer.fit(module, ckpt_path="runs/a/checkpoints/last.ckpt")   # ResumeError if lr changed
    """

    def __init__(self, config: Mapping[str, Any] | None = None, allow_changes: Sequence[str] = (),
                 run_dir: str | Path | None = None, phase: str | None = None):
        if isinstance(allow_changes, str) or not all(isinstance(p, str) for p in allow_changes):
            raise ValueError(f"allow_changes={allow_changes!r} must be a list of key patterns, e.g. ['seed', 'model.*']")
        self.config = None if config is None else json.loads(json.dumps(flatten(dict(config)), default=str))
        self.allow_changes = list(allow_changes)
        self.phase = phase
        self.lock = RunLock(run_dir) if run_dir is not None else None
        self._checked = False  # this fit's checkpoint was already checked (as it was loaded, or before the fit)
        self.carried: dict[str, float | None] = {}
        self.restored_metrics: dict[str, float] = {}
        self._trainer = None  # the fit's trainer (from its setup): its metrics go into checkpoints

    def state_dict(self) -> dict[str, Any]:
        metrics = {} if self._trainer is None else scalar_metrics(self._trainer.callback_metrics)
        return {"config": self.config, "phase": self.phase, "carried": dict(self.carried),
                "metrics": {**self.restored_metrics, **metrics}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.carried = {**dict(state_dict.get("carried") or {}), **self.carried}
        self.restored_metrics = dict(state_dict.get("metrics") or {})

    def metrics_with_restored(self, trainer) -> dict[str, float]:
        """Every scalar metric of the fit: those restored from the checkpoint under this fit's own."""
        return {**self.restored_metrics, **scalar_metrics(trainer.callback_metrics)}

    def setup(self, trainer, pl_module, stage: str) -> None:
        if self.lock is not None:
            self.lock.acquire()
        self._checked = False
        if stage == "fit":
            self._trainer = trainer
        if stage == "fit" and saves_folders(trainer) and not isinstance(trainer.strategy, VerifiedModelParallelStrategy):
            raise CheckpointError(f"{type(trainer.strategy).__name__} resumes distributed checkpoints through "
                                  "torch.distributed.checkpoint's default planner, which unpickles the items in their "
                                  "shards (runs code they carry); use plasticity_callbacks.app.runs.model_parallel."
                                  "VerifiedModelParallelStrategy (trainer=fsdp2 does) with the same arguments")
        io = getattr(trainer.strategy, "checkpoint_io", None)
        if stage == "fit" and isinstance(io, VerifiedCheckpointIO):
            io.inspect_on_load = lambda checkpoint, path: self.check(checkpoint, trainer.callbacks, pl_module, path)

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        if not self._checked:
            self.check(checkpoint, trainer.callbacks, pl_module, str(trainer.ckpt_path))

    def teardown(self, trainer, pl_module, stage: str) -> None:
        io = getattr(trainer.strategy, "checkpoint_io", None)
        if isinstance(io, VerifiedCheckpointIO):
            io.inspect_on_load = None
        if self.lock is not None:
            self.lock.release()

    def check(self, checkpoint: dict, callbacks: Sequence[L.Callback], pl_module, where: str) -> None:
        """Raise ResumeError unless ``checkpoint`` fits this run (its ``callbacks`` and ``pl_module``).
        Call it before building the trainer to refuse before a logger touches the run directory."""
        self._checked = True
        self.check_origin(checkpoint, where)
        saved_callbacks = checkpoint.get("callbacks") or {}
        if "state_dict" in checkpoint:  # absent as a distributed checkpoint's strategy hands it over: weights loaded
            check_shapes(checkpoint["state_dict"], pl_module, where)
        present = {callback.state_key for callback in callbacks}
        dropped = [key for key in saved_callbacks if key not in present and not key.split("{")[0].endswith("Checkpoint")]
        if dropped:
            raise ResumeError(f"cannot resume {where}: it holds state of callbacks this run does not have: "
                              f"{', '.join(dropped)}; this run's callbacks: {', '.join(sorted(present))}. Restore the "
                              "callback with the same arguments, or start a new run")


    def check_origin(self, checkpoint: dict, where: str, compare_config: bool = True) -> None:
        """Raise ResumeError unless ``checkpoint`` was written by this phase (with ``phase``) of a run with
        this configuration (with ``config`` and ``compare_config``)."""
        saved_callbacks = checkpoint.get("callbacks") if isinstance(checkpoint.get("callbacks"), Mapping) else {}
        stored = saved_callbacks.get(self.state_key)
        stored = stored if isinstance(stored, Mapping) else {}
        if self.phase is not None and stored.get("phase") != self.phase:
            origin = f"phase {stored['phase']!r}" if stored.get("phase") else "no pipeline phase"
            raise ResumeError(f"cannot use {where}: it was written by {origin}, not by phase {self.phase!r} of this "
                              "run; put back this phase's own checkpoint, or start a new run directory")
        if compare_config and self.config is not None and stored.get("config") is not None:
            refuse_changes(where, changed_keys(stored["config"], self.config, self.allow_changes))


def scalar_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if getattr(v, "numel", lambda: 1)() == 1}


def check_shapes(saved: Mapping[str, Any], module, where: str) -> None:
    """One-line ResumeError when ``saved`` (a checkpoint's ``state_dict``) does not fit ``module``."""
    current = module.state_dict()
    # a 0-d scalar loads into a 1-element parameter (the blocks' gates: models.blocks.gates)
    fits = {((), (1,))}
    mismatched = [f"{k} {tuple(saved[k].shape)} in the checkpoint, {tuple(v.shape)} here" for k, v in current.items()
                  if k in saved and hasattr(saved[k], "shape") and tuple(saved[k].shape) != tuple(v.shape)
                  and (tuple(saved[k].shape), tuple(v.shape)) not in fits]
    if mismatched:
        raise ResumeError(f"cannot resume {where}: the model has other shapes than the checkpoint's: "
                          f"{'; '.join(mismatched[:4])}{' ...' if len(mismatched) > 4 else ''} (was the model "
                          "configuration changed?)")
    if getattr(module, "strict_loading", True):
        missing, unexpected = sorted(set(current) - set(saved)), sorted(set(saved) - set(current))
        if missing or unexpected:
            raise ResumeError(f"cannot resume {where}: the model's parameters differ from the checkpoint's: missing "
                              f"{missing[:4]}, unexpected {unexpected[:4]} (was the model configuration changed?)")


def resume_checkpoint(ckpt_path: str | Path | None, checkpoint_dir: str | Path) -> str | None:
    """The checkpoint a fit resumes from: None, an existing file or distributed checkpoint folder, or ``"last"`` =
    the newest last checkpoint in ``checkpoint_dir`` (:func:`~.checkpoints.newest_last_checkpoint`). A missing one
    is a ResumeError (Lightning would warn and start a fresh run)."""
    if ckpt_path is None:
        return None
    path = newest_last_checkpoint(checkpoint_dir) if str(ckpt_path) == "last" else Path(ckpt_path)
    path = Path(checkpoint_dir) / "last.ckpt" if path is None else path
    if not (path.is_file() or path.is_dir()):
        raise ResumeError(f"cannot resume: ckpt_path={ckpt_path} but {path} does not exist; check hydra.run.dir "
                          "(or paths.checkpoint_dir), or drop ckpt_path to start a new run")
    return str(path)
