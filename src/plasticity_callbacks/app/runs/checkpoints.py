"""Checkpoints that are verified when written and when read, and saved after the validation of their step.

``VerifiedCheckpointIO`` (a Lightning ``CheckpointIO`` plugin) writes every checkpoint through a
temporary file, reads it back, compares its SHA-256 with the bytes it meant to write, and puts the
checksum beside it (``last.ckpt.sha256``). Loading checks the file against that checksum first.
A distributed checkpoint (FSDP2: a folder of shards) gets the same: see ``checkpoint_folders.py``.
Any failure is a :class:`CheckpointError` with a one-line message naming the file: a checkpoint
that could not be written stops the run instead of leaving it without one.

``ModelCheckpointAfterValidation`` is Lightning's ``ModelCheckpoint`` that, at a step where a
validation follows, saves after that validation instead of before it: the checkpoint then holds
the state every ``on_validation_end`` hook (plateau counters, ``val/loss``) reached at that step,
and an interruption between the two cannot lose the validation.

Example:
    >>> trainer = L.Trainer(plugins=[VerifiedCheckpointIO()],
    ...                     callbacks=[ModelCheckpointAfterValidation(dirpath="ckpt", every_n_train_steps=100,
    ...                                                               save_last=True)])
    >>> trainer.fit(module, datamodule=data, ckpt_path="ckpt/last.ckpt")   # verified on load
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any
from weakref import proxy

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_warn

from ...distributed.strategy import saves_folders
from ...errors import CheckpointError, ResumeError
from .checkpoint_folders import read_folder, save_folder, verify_folder
from .verified_files import (CHECKSUM_SUFFIX, PENDING_SUFFIX, checksum_path, load_trusted_or_weights_only, pending_path,
                             recorded_checksum, trusted_by_environment, verified_hash, write_verified)


class RunInterrupted(SystemExit):
    """SIGTERM or SIGINT stopped a fit after saving (and verifying) the checkpoint of the step it reached.

    Its exit status is the conventional ``128 + signal`` (143 for SIGTERM, 130 for SIGINT), so a
    scheduler records the run as stopped, not as finished; ``str()`` is the one line to print. Under
    DDP / FSDP2 every rank raises it at the same step, with the same signal.

    Args:
        signum: the stop signal (the one any rank received).
        path: the checkpoint saved and verified.
        step: the global step it holds.
        other_ranks: the rank processes this one launched (Lightning's launcher on rank 0), which
            :meth:`wait_for_other_ranks` waits for before this process exits.
    """

    def __init__(self, signum: int, path: Path, step: int, other_ranks: list[subprocess.Popen] = ()):
        super().__init__(128 + signum)
        self.signum, self.path, self.step = signum, Path(path), step
        self.other_ranks = list(other_ranks)

    def __str__(self) -> str:
        return (f"stopped by {signal.Signals(self.signum).name} at step {self.step}; checkpoint {self.path} saved and "
                "verified: resume with the same command and ckpt_path=last (a pipeline: pipeline.resume=true)")

    def wait_for_other_ranks(self, timeout: float = 120) -> None:
        """Exit after the ranks this process launched (they stop at the same step), so a scheduler waiting on
        this process sees the whole job stopped; a rank still running after ``timeout`` seconds is killed, and
        a rank that ended otherwise than this one is named on stderr."""
        for rank, process in enumerate(self.other_ranks, start=1):
            try:
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                process.kill()
            if process.wait() != self.code:
                print(f"rank {rank} exited with status {process.returncode}, not {self.code}", file=sys.stderr)


@contextlib.contextmanager
def stop_signals_deferred():
    """SIGTERM and SIGINT that arrive inside the block act when it ends (a file write is never cut in half).

    Example:
        >>> with stop_signals_deferred():
        ...     path.write_text(text)
    """
    if threading.current_thread() is not threading.main_thread():  # handlers can only be set there
        yield
        return
    received: list[int] = []
    stops = (signal.SIGTERM, signal.SIGINT)
    previous = {signum: signal.signal(signum, lambda signum, frame: received.append(signum)) for signum in stops}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for signum in dict.fromkeys(received):
            signal.raise_signal(signum)


def verify_file(path: str | Path) -> Path:
    """Check ``path`` exists, is not empty and matches the checksum beside it (when there is one); a
    distributed checkpoint (a folder) through :func:`~.checkpoint_folders.verify_folder`."""
    path = Path(path)
    pending = pending_path(path)
    if path.is_dir() or pending.is_dir():
        return verify_folder(path)
    recorded = recorded_checksum(path) if path.is_file() or pending.is_file() else None
    if recorded is not None and pending.is_file() and verified_hash(pending) == recorded[0]:
        os.replace(pending, path)  # finish a write interrupted between its checksum and its rename
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}")
    size = path.stat().st_size
    if size == 0:
        raise CheckpointError(f"checkpoint {path} is empty (0 bytes): its write was interrupted; use an earlier one")
    if recorded is None:
        rank_zero_warn(f"checkpoint {path} has no {CHECKSUM_SUFFIX} file beside it: its integrity is not verified")
        return path
    digest, expected = recorded
    if size != expected:
        raise CheckpointError(f"checkpoint {path} has {size} bytes, its checksum file records {expected}: "
                              "truncated or replaced; use an earlier checkpoint")
    if verified_hash(path) != digest:
        raise CheckpointError(f"checkpoint {path} does not match its recorded SHA-256: the file was altered or "
                              "damaged on disk; use an earlier checkpoint")
    return path


def read_checkpoint(path: str | Path, map_location: Any = "cpu", trust: bool | None = None, **load_kwargs) -> dict:
    """``torch.load`` of a verified checkpoint with ``weights_only=True``: loading never runs code.

    A checkpoint whose pickle names anything beyond tensors, containers, numbers and strings (a class,
    a function: what arbitrary code rides on) is refused in one line naming the file and the opt-in;
    an unreadable file is a one-line :class:`CheckpointError` too.

    Args:
        path: the checkpoint file (its ``.sha256`` is checked first when there is one), or a distributed
            checkpoint's folder (its ``state_dict`` then holds whole tensors, or with ``mmap=True`` shapes only:
            tensors on the meta device; see ``checkpoint_folders.py``).
        map_location: as for ``torch.load``.
        trust: load with full unpickling (``weights_only=False``); None: the ``PLASTICITY_TRUST_CHECKPOINTS``
            environment variable decides. Only for checkpoints from a source you trust.
        load_kwargs: more ``torch.load`` arguments (``mmap=True``); ``weights_only`` is not one of them.

    Example:
        >>> checkpoint = read_checkpoint("outputs/run/checkpoints/last.ckpt")
        >>> module.load_state_dict(checkpoint["state_dict"])
    """
    if "weights_only" in load_kwargs:
        raise TypeError("read_checkpoint loads with weights_only=True; pass trust=True for a checkpoint you trust")
    path = verify_file(path)
    trust = trusted_by_environment() if trust is None else trust
    if path.is_dir():  # a distributed checkpoint; mmap: the checks need shapes, not weights
        return read_folder(path, map_location=map_location, trust=trust, tensors=not load_kwargs.get("mmap"))
    return load_trusted_or_weights_only(path, map_location=map_location, trust=trust, **load_kwargs)


LAST_CHECKPOINT = re.compile(r"last(-v\d+)?\.ckpt")  # Lightning's last.ckpt, and last-v1.ckpt ... beside it


def newest_last_checkpoint(dirpath: str | Path) -> Path | None:
    """The last checkpoint in ``dirpath`` a resume continues from, or None when there is none.

    Lightning writes ``last-v1.ckpt`` (``-v2`` ...) beside a ``last.ckpt`` it does not know as its own: one in a
    run directory that was moved, copied or restored before :class:`ModelCheckpointAfterValidation` rebased its
    paths. Of several, the one at the highest global step (then the most recently written) is the run's newest;
    each is verified as it is read, and a damaged one is a one-line :class:`CheckpointError`.
    """
    dirpath = Path(dirpath)
    if not dirpath.is_dir():
        return None
    names = {entry.name.removesuffix(PENDING_SUFFIX) for entry in dirpath.iterdir()}
    candidates = sorted(dirpath / name for name in names if LAST_CHECKPOINT.fullmatch(name))
    for path in candidates:
        if not path.exists():  # only its pending write is there: finished when it matches its checksum
            verify_file(path)
    if len(candidates) <= 1:
        return candidates[0] if candidates else None  # verified when it is loaded
    steps = {path: read_checkpoint(path, mmap=True).get("global_step", -1) for path in candidates}
    return max(candidates, key=lambda path: (steps[path], path.stat().st_mtime_ns, path.name))


def rebased_paths(state: dict[str, Any], saved_dir: str, dirpath: str) -> dict[str, Any]:
    """A ``ModelCheckpoint`` state saved in ``saved_dir`` with its checkpoint paths moved to ``dirpath``."""

    def rebase(value):
        if isinstance(value, str) and value and Path(value).is_relative_to(saved_dir):
            return str(Path(dirpath) / Path(value).relative_to(saved_dir))
        return value

    moved = {key: rebase(value) for key, value in state.items()}
    moved["best_k_models"] = {rebase(path): score for path, score in (state.get("best_k_models") or {}).items()}
    moved["dirpath"] = dirpath
    return moved


def remove_with_checksum(path: str | Path) -> None:
    if Path(path).is_dir():  # a distributed checkpoint
        shutil.rmtree(path, ignore_errors=True)
    for file in (Path(path), checksum_path(Path(path))):
        file.unlink(missing_ok=True)


class VerifiedCheckpointIO(TorchCheckpointIO):
    """Lightning's ``TorchCheckpointIO`` with verified writes and checksummed reads (local paths).

    ``save_checkpoint`` serializes, writes through :func:`write_verified` and raises
    :class:`CheckpointError` when the file on disk is not what was meant (Lightning's own atomic
    save ignores a ``PermissionError``). ``load_checkpoint`` checks the checksum beside the file and
    turns an empty, truncated, altered or foreign file into a one-line :class:`CheckpointError`;
    then ``inspect_on_load(checkpoint, path)``, when set (``ResumeGuard`` sets it), may refuse the
    checkpoint before Lightning restores anything from it. Loading never unpickles arbitrary objects
    (``weights_only=True``, whatever ``Trainer.fit(weights_only=...)`` says) unless ``trust`` is set.

    Args:
        trust: load checkpoints with full unpickling; None: the ``PLASTICITY_TRUST_CHECKPOINTS`` environment
            variable decides (see :func:`read_checkpoint`).

    Example:
        >>> trainer = L.Trainer(plugins=[VerifiedCheckpointIO()], ...)
    """

    def __init__(self, trust: bool | None = None):
        super().__init__()
        self.trust = trust
        self.inspect_on_load = None

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("VerifiedCheckpointIO.save_checkpoint takes no storage_options")
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        write_verified(buffer.getvalue(), path)

    def load_checkpoint(self, path, map_location: Any = lambda storage, loc: storage,
                        weights_only: bool | None = None) -> dict[str, Any]:
        # ``weights_only`` from Lightning is ignored: only ``trust`` / PLASTICITY_TRUST_CHECKPOINTS unlock pickles.
        checkpoint = read_checkpoint(path, map_location=map_location, trust=self.trust)
        if self.inspect_on_load is not None:
            self.inspect_on_load(checkpoint, str(path))
        return checkpoint

    def remove_checkpoint(self, path) -> None:
        remove_with_checksum(path)


def validation_follows(trainer) -> bool:
    """Whether the fit loop runs a validation right after the current training batch."""
    if getattr(trainer, "_val_check_time_interval", None) is not None:
        return False  # time-based: a second look could answer differently, so save where Lightning saves
    loop = trainer.fit_loop.epoch_loop
    try:
        return bool(loop._should_check_val_fx(trainer.fit_loop._data_fetcher))
    except (AttributeError, TypeError):  # another Lightning version: save where Lightning saves
        return False


def agreed_stop_signal(trainer, received: int | None) -> int | None:
    """The stop signal any rank holds at this step boundary, or None: every rank asks at the same boundary
    (one all-reduce of one integer per step under DDP / FSDP2), so a signal that reached one rank stops all
    of them at the same step, and none waits alone in a collective the others never join."""
    if trainer.world_size == 1:
        return received
    held = torch.tensor(received or 0, device=trainer.strategy.root_device)
    return int(trainer.strategy.reduce(held, reduce_op="max")) or None


def detach_launched_ranks(trainer) -> list[subprocess.Popen]:
    """The rank processes Lightning's launcher started from this one, taken out of its watch list.

    Lightning's process observer kills the whole job when a launched rank exits with a non-zero status;
    on a stop every rank exits with 128 + signal, so this process waits for them instead
    (:meth:`RunInterrupted.wait_for_other_ranks`) and exits last.
    """
    launched = getattr(trainer.strategy.launcher, "procs", None)
    if not isinstance(launched, list):
        return []
    detached = list(launched)
    launched.clear()  # the observer holds this very list: it now sees no rank to watch
    return detached


def write_step_row(trainer) -> None:
    """Log the current training step's metrics row now, as Lightning does right after the ``on_train_batch_end``
    hooks: a stop raised in one of them would lose that row, and the resumed fit starts at the next step."""
    try:
        trainer._logger_connector.update_train_step_metrics()
    except AttributeError:  # another Lightning version
        rank_zero_warn(f"stopping at step {trainer.global_step}: could not log that step's metrics before the "
                       "checkpoint (this Lightning version has no logger_connector.update_train_step_metrics); "
                       "its row is missing from the logs after the resume")
        return
    for logger in trainer.loggers:
        logger.save()


class ModelCheckpointAfterValidation(ModelCheckpoint):
    """``ModelCheckpoint`` whose step-triggered save waits for the validation of the same step.

    Lightning saves ``every_n_train_steps`` checkpoints in ``on_train_batch_end``, before the
    validation that ``val_check_interval`` runs after that batch; a resumed run then skips that
    validation, and a callback acting in ``on_validation_end`` (a plateau trigger) counts one
    validation fewer than the uninterrupted run. Here, when a validation follows the batch, the
    same save rule is applied in ``on_validation_end`` instead (after every other callback's
    ``on_validation_end``: Lightning runs checkpoint callbacks last), and Lightning's loop restores
    such a checkpoint without repeating the validation. The saved checkpoint can also rank by
    ``val/loss`` (``monitor``) at that step. ``fit(ckpt_path="last")`` with no last checkpoint in
    ``dirpath`` is a :class:`ResumeError` (Lightning would warn and start a fresh run).

    SIGTERM or SIGINT during the fit is held until the current step ends (after its validation when
    one follows); then ``last.ckpt`` of that step is saved, verified, and the fit stops with
    :class:`RunInterrupted` (exit status 128 + signal). Under DDP / FSDP2 the ranks agree at every step
    boundary (one all-reduce of the signal each holds), so a signal to any one rank, or to all, stops
    every rank at the same step with one checkpoint. A second signal to the same process stops it at
    once. Same arguments as ``ModelCheckpoint``.

    Example:
        >>> checkpoint = ModelCheckpointAfterValidation(dirpath="ckpt", every_n_train_steps=100, save_last=True)
        >>> L.Trainer(callbacks=[checkpoint], val_check_interval=100)
    """

    STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._save_after_validation = False
        self._received: int | None = None  # the stop signal this process holds until the current step ends
        self._stopping: int | None = None  # the stop signal the ranks agreed on
        self._previous_handlers: dict[int, Any] = {}

    def setup(self, trainer, pl_module, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self._received = self._stopping = None
        if stage == "fit" and threading.current_thread() is threading.main_thread():
            self._previous_handlers = {s: signal.getsignal(s) for s in self.STOP_SIGNALS}

    def on_sanity_check_start(self, trainer, pl_module) -> None:
        super().on_sanity_check_start(trainer, pl_module)
        self._hold_stop_signals()

    def on_train_start(self, trainer, pl_module) -> None:
        super().on_train_start(trainer, pl_module)
        self._hold_stop_signals()

    def _hold_stop_signals(self) -> None:
        # Here, not in setup: Lightning registers its own SIGTERM handler after setup, and that one would
        # stop the run (mid-validation too) with exit status 0. Lightning's teardown restores the handlers
        # from before the fit, on an exception as well; ``teardown`` below does the same otherwise.
        if self._previous_handlers:
            for signum in self.STOP_SIGNALS:
                signal.signal(signum, self._hold_signal)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)
        self._previous_handlers = {}
        super().teardown(trainer, pl_module, stage)

    def _hold_signal(self, signum: int, frame) -> None:
        if self._received is not None:  # asked twice: stop now, from the last checkpoint written
            raise KeyboardInterrupt
        self._received = signum
        # Every rank says so (a scheduler's signal may reach one): rank_zero_info would hide rank 1's.
        print(f"{signal.Signals(signum).name} received: saving a checkpoint when this step ends, then stopping",
              file=sys.stderr, flush=True)

    def _save_checkpoint(self, trainer, filepath: str) -> None:
        if not saves_folders(trainer):
            return super()._save_checkpoint(trainer, filepath)
        # The strategy writes a folder without the CheckpointIO plugin: written aside, checksummed, renamed.
        save_folder(trainer, filepath, self.save_weights_only)
        self._last_global_step_saved = trainer.global_step
        self._last_checkpoint_saved = filepath
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.after_save_checkpoint(proxy(self))

    def _save_and_stop(self, trainer) -> None:
        path = Path(self.dirpath) / f"{self.CHECKPOINT_NAME_LAST}{self.FILE_EXTENSION}"
        # Recorded before the save, so the checkpoint's own state names it: a stop before the first interval's
        # save would otherwise leave last_model_path empty and the resumed run write last-v1.ckpt beside it.
        self.last_model_path = str(path)
        self._save_checkpoint(trainer, str(path))
        trainer.strategy.barrier("stop_signal_checkpoint")
        verify_file(path)
        raise RunInterrupted(self._stopping, path, trainer.global_step, detach_launched_ranks(trainer))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if pl_module.automatic_optimization and validation_follows(trainer):
            self._save_after_validation = True
            return
        # Decided once, here: a signal arriving after the agreement waits for the next step boundary.
        self._stopping = agreed_stop_signal(trainer, self._received)
        if self._stopping is not None:
            write_step_row(trainer)  # the fit stops in this hook, before Lightning logs the step
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if self._stopping is not None:
            self._save_and_stop(trainer)

    def _find_last_checkpoints(self, trainer) -> set[str]:
        # Lightning asks this only to resolve ckpt_path="last": the newest one (not the latest modified), and a
        # resume with nothing to resume from is an error.
        found = super()._find_last_checkpoints(trainer)
        newest = newest_last_checkpoint(Path(next(iter(found))).parent) if found else None
        if newest is None:
            raise ResumeError(f'cannot resume: ckpt_path="last" but {self.dirpath} holds no last checkpoint; check '
                              "the directory, or pass ckpt_path=None to start a new run")
        return {str(newest)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # A run directory moved, copied or restored elsewhere: its checkpoints are this run's own, at their new
        # place (Lightning would forget them and write last-v1.ckpt beside the last.ckpt just resumed).
        saved_dir = state_dict.get("dirpath")
        if saved_dir and self.dirpath and os.path.normpath(saved_dir) != os.path.normpath(self.dirpath):
            state_dict = rebased_paths(state_dict, saved_dir, self.dirpath)
        super().load_state_dict(state_dict)

    def on_validation_end(self, trainer, pl_module) -> None:
        if self._save_after_validation and not trainer.sanity_checking:
            self._save_after_validation = False
            super().on_train_batch_end(trainer, pl_module, None, None, trainer.fit_loop.epoch_loop.batch_idx)
        super().on_validation_end(trainer, pl_module)
        if trainer.sanity_checking:
            return
        self._stopping = agreed_stop_signal(trainer, self._received)
        if self._stopping is not None:
            self._save_and_stop(trainer)
