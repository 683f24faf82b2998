"""A file written so that a reader never sees half of it, with its SHA-256 beside it, and read as data only.

The pieces every checkpoint path shares (files: ``checkpoints.py``; FSDP2 folders: ``checkpoint_folders.py``):
the checksum side file (``<path>.sha256``), the pending name a write goes to first (``<path>.writing``),
a hash remembered across verifications of an unchanged file, and ``torch.load`` with ``weights_only=True``
whose refusal is one line naming the file.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
import re
from pathlib import Path
from typing import Any, BinaryIO

import torch

from ...errors import CheckpointError

CHECKSUM_SUFFIX = ".sha256"
PENDING_SUFFIX = ".writing"  # the new bytes, renamed over the checkpoint once its checksum is recorded


def sha256_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_of_file(path: Path, chunk: int = 1 << 24) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):  # 16 MiB at a time: a large checkpoint is never held twice in memory
            digest.update(block)
    return digest.hexdigest()


_REMEMBERED: dict | None = None  # inside hashes_remembered(): a file's identity and times -> its SHA-256


@contextlib.contextmanager
def hashes_remembered():
    """Inside, verifying a file that is unchanged since it was last verified (same path, inode, size and
    modification and change times) reuses its hash: a pipeline verifies a completed phase's checkpoint when it
    starts and again when it loads it, and a large checkpoint is then read once. A rewrite (new bytes, or a
    rename into place) changes the times or the inode. The read-back after a write always hashes."""
    global _REMEMBERED
    outer = _REMEMBERED
    _REMEMBERED = {} if outer is None else outer
    try:
        yield
    finally:
        _REMEMBERED = outer


def verified_hash(path: Path) -> str:
    """The SHA-256 of ``path`` for a verification (see :func:`hashes_remembered`)."""
    if _REMEMBERED is None:
        return sha256_of_file(path)
    stat = os.stat(path)
    key = (os.path.realpath(path), stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)
    if key not in _REMEMBERED:
        _REMEMBERED[key] = sha256_of_file(path)
    return _REMEMBERED[key]


def checksum_path(path: Path) -> Path:
    return path.with_name(path.name + CHECKSUM_SUFFIX)


def pending_path(path: Path) -> Path:
    return path.with_name(path.name + PENDING_SUFFIX)


def write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def replace_synced(pending: Path, path: Path) -> None:
    """Rename ``pending`` (a file or a folder) over ``path`` and sync the folder holding them, so that the rename
    itself survives a crash or a power cut.

    Example:
        >>> write_synced(pending_path(path), data)
        >>> replace_synced(pending_path(path), path)
    """
    os.replace(pending, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def recorded_checksum(path: Path) -> tuple[str, int] | None:
    """``(sha256, size)`` from the file beside ``path``, or None when there is none."""
    side = checksum_path(path)
    if not side.is_file():
        return None
    fields = side.read_text().split()
    if len(fields) < 2 or len(fields[0]) != 64 or not fields[1].isdigit():
        raise CheckpointError(f"checkpoint checksum file {side} is malformed; delete it to load {path.name} unverified")
    return fields[0], int(fields[1])


def write_verified(data: bytes, path: str | Path) -> None:
    """Write ``data`` to ``path`` so that a reader never sees a partial file, verify it, record its checksum.

    Order: the bytes go to ``<path>.writing`` (synced), the checksum file is replaced, then the
    pending file is renamed over ``path``. An interruption between the last two leaves a pending
    file that matches the checksum; :func:`verify_file` finishes that rename.
    """
    path = Path(path)
    digest = sha256_of(data)
    pending, side = pending_path(path), checksum_path(path)
    side_pending = pending_path(side)
    recorded = False
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_synced(pending, data)
        if sha256_of_file(pending) != digest:
            raise OSError("the bytes read back differ from the bytes written")
        write_synced(side_pending, f"{digest}  {len(data)}  {path.name}\n".encode())
        os.replace(side_pending, side)
        recorded = True
        os.replace(pending, path)
        if path.stat().st_size != len(data):
            raise OSError(f"{path.stat().st_size} bytes on disk, {len(data)} written")
    except OSError as err:
        for leftover in ([side_pending] if recorded else [side_pending, pending]):  # keep what recovery needs
            with contextlib.suppress(OSError):
                leftover.unlink(missing_ok=True)
        raise CheckpointError(f"could not write checkpoint {path}: {err.strerror or err}; the run stops here so that "
                              "it does not go on without checkpoints (free space or fix permissions, then resume)") from err


TRUST_ENV = "PLASTICITY_TRUST_CHECKPOINTS"  # =1: load checkpoints with full unpickling (runs code they carry)


def trusted_by_environment() -> bool:
    return os.environ.get(TRUST_ENV, "").strip().lower() in ("1", "true", "yes")


def load_trusted_or_weights_only(path: Path, map_location: Any = "cpu", trust: bool = False, **load_kwargs) -> dict:
    """``torch.load`` with ``weights_only=not trust``; every failure a one-line :class:`CheckpointError`."""
    checkpoint = load_as_data(path, str(path), map_location=map_location, trust=trust, **load_kwargs)
    if not isinstance(checkpoint, dict):
        raise CheckpointError(f"checkpoint {path} holds a {type(checkpoint).__name__}, not a checkpoint dict")
    return checkpoint


def load_as_data(source: Path | BinaryIO, where: str, trust: bool = False, **load_kwargs) -> Any:
    """``torch.load(source, weights_only=not trust)``: tensors and plain data only. A pickle that needs code, or
    bytes that are not a torch file, is a one-line :class:`CheckpointError` naming ``where`` (the file, or the
    file and item a distributed checkpoint's entry comes from)."""
    try:
        return torch.load(source, weights_only=not trust, **load_kwargs)
    except pickle.UnpicklingError as err:
        if "weights only" not in str(err).lower() and "weights_only" not in str(err).lower():
            raise unreadable(where, err) from err
        found = re.search(r"GLOBAL ([\w.]+)", str(err)) or re.search(r"global:? ([\w.]+)", str(err))
        what = found.group(1) if found else "an object that is not a tensor or plain data"
        raise CheckpointError(f"checkpoint {where} needs arbitrary code to load ({what}) and was refused; only if you "
                              f"trust its source, load it with {TRUST_ENV}=1") from None
    except Exception as err:  # EOFError, OSError, RuntimeError ...: whatever a damaged file raises
        raise unreadable(where, err) from err


def unreadable(path: Path | str, err: Exception) -> CheckpointError:
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return CheckpointError(f"checkpoint {path} is not a readable torch checkpoint (truncated or another format): "
                           f"{first[:200]}")
