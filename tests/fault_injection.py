"""Faults the trust tests and ``benchmarks/faults.py`` inject: a hostile checkpoint and a stop signal mid-phase."""
from __future__ import annotations

import io
import os
import signal
from pathlib import Path

import lightning as L
import torch

from plasticity_callbacks.app.runs.verified_files import write_verified


class Payload:
    """Unpickling this runs ``open(marker, "w")``: the file appears iff the pickle was trusted."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def hostile_checkpoint(path: Path, marker: Path, global_step: int = 2) -> Path:
    """A checkpoint-shaped dict carrying the payload, with a matching ``.sha256`` (anyone who swaps the file can)."""
    buffer = io.BytesIO()
    torch.save({"state_dict": {}, "global_step": global_step, "callbacks": {}, "payload": Payload(marker)}, buffer)
    write_verified(buffer.getvalue(), path)
    return path


class SignalAt(L.Callback):
    """Sends ``signal`` to this process after training step ``step`` (before the checkpoint callback runs);
    with ``rank``, only the process of that global rank is signalled (a scheduler's signal that reaches one)."""

    def __init__(self, step: int, signal_name: str = "SIGTERM", rank: int | None = None):
        self.step, self.signal_name, self.rank = step, signal_name, rank

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if trainer.global_step == self.step and self.rank in (None, trainer.global_rank):
            os.kill(os.getpid(), getattr(signal, self.signal_name))


def signal_spec(step: int, name: str) -> str:
    """The override that adds :class:`SignalAt` to the SFT phase (this module must be importable: tests/ on the path)."""
    return f"+phases.sft.callbacks.stop={{_target_: fault_injection.SignalAt, step: {step}, signal_name: {name}}}"


class Crash(Exception):
    """The injected crash of :class:`CrashAt`."""


class CrashAt(L.Callback):
    """Raises :class:`Crash` when training step ``step`` starts: a run that dies (SIGKILL, OOM) after logging
    the steps since its last checkpoint, which the resumed run trains and logs again."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if trainer.global_step == self.step:
            raise Crash(f"crashed at step {self.step}")


def hostile_shard_item(folder: Path, marker: Path, item: str = "optimizer_0.param_groups.0.lr") -> Path:
    """A distributed checkpoint folder whose non-tensor ``item`` (pickled bytes inside a ``.distcp`` shard) is the
    payload: appended to its shard, the index pointed at it, and the folder's ``.sha256`` recomputed to match."""
    import dataclasses
    import pickle

    from plasticity_callbacks.app.runs.checkpoint_folders import commit_folder, read_index

    index = read_index(folder)
    key = next(k for k in index.storage_data if k.fqn == item)
    shard = folder / index.storage_data[key].relative_path
    buffer = io.BytesIO()
    torch.save(Payload(marker), buffer)
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(buffer.getvalue())
    index.storage_data[key] = dataclasses.replace(index.storage_data[key], offset=offset, length=len(buffer.getvalue()))
    (folder / ".metadata").write_bytes(pickle.dumps(index))
    staged = folder.with_name(folder.name + ".writing")
    folder.rename(staged)
    commit_folder(staged, folder)  # the checksums an attacker who can write the folder recomputes
    return folder


class SignalRanksAt(L.Callback):
    """Sends ``signal`` to the processes of ``ranks`` only (a scheduler's preemption reaching one of them) after
    training step ``step``."""

    def __init__(self, step: int, ranks: list[int], signal_name: str = "SIGTERM"):
        self.step, self.ranks, self.signal_name = step, list(ranks), signal_name

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if trainer.global_step == self.step and trainer.global_rank in self.ranks:
            os.kill(os.getpid(), getattr(signal, self.signal_name))
