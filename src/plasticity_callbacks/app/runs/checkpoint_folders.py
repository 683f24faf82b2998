"""Distributed checkpoints (a folder of shards, ``torch.distributed.checkpoint``) with a file checkpoint's guarantees.

Under FSDP2 (Lightning's ``ModelParallelStrategy``, ``save_distributed_checkpoint=True``) a checkpoint is a
folder: every rank writes its shards (``__<rank>_0.distcp``), rank 0 the index (``.metadata``) and the rest of
Lightning's checkpoint dict (``meta.pt``). That strategy bypasses the ``CheckpointIO`` plugin, so here:

* :func:`save_folder` has the strategy write ``<path>.writing/``, records the SHA-256 and size of every file
  in ``<path>.sha256`` (the same side file a file checkpoint has), then renames the folder over ``path``: a
  reader sees the old checkpoint or the new one, never a half-written one. An interruption between the
  record and the rename leaves a pending folder that matches it; :func:`verify_folder` finishes the rename.
* :func:`verify_folder` refuses a missing, incomplete, truncated or altered folder in one line.
* :func:`read_folder` returns what ``torch.load`` of a file checkpoint returns, without running code the
  folder could carry: ``meta.pt`` with ``weights_only=True``, the index through an unpickler that admits
  only the classes an index is made of, and ``state_dict`` either as shapes (tensors on the meta device,
  read from the index alone, for the checks before a resume) or as whole tensors (for a phase that
  starts from another's weights), read without a process group.

Example:
    >>> save_folder(trainer, "ckpt/final.ckpt")                        # all ranks
    >>> checkpoint = read_folder(Path("ckpt/final.ckpt"), tensors=False)
    >>> checkpoint["state_dict"]["model.wte.weight"].shape             # torch.Size([264, 64]), nothing loaded
"""
from __future__ import annotations

import io
import os
import pickle
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, StorageMeta, TensorStorageMetadata

from ...errors import CheckpointError
from .verified_files import (TRUST_ENV, checksum_path, load_as_data, load_trusted_or_weights_only, pending_path,
                             replace_synced, sha256_of_file, unreadable, verified_hash, write_synced)

INDEX_FILE = ".metadata"  # torch.distributed.checkpoint's index of the shards
REST_FILE = "meta.pt"  # Lightning's checkpoint dict less weights and optimizer states (rank 0)
STATE_DICT_PREFIX = "state_dict."  # the model's entries in the index (Lightning saves {"state_dict": ...})


def save_folder(trainer, path: str | Path, weights_only: bool = False) -> None:
    """``trainer.save_checkpoint(path)`` for a strategy that writes folders, so that a reader never sees a
    partial folder and its files' checksums are recorded (see the module). Call it on every rank."""

    path = Path(path)
    pending = pending_path(path)
    if trainer.is_global_zero and pending.is_dir():  # left by a write that was interrupted
        shutil.rmtree(pending)
    trainer.strategy.barrier("checkpoint_folder_start")
    trainer.save_checkpoint(pending, weights_only=weights_only)
    trainer.strategy.barrier("checkpoint_folder_written")
    if trainer.is_global_zero:
        try:
            commit_folder(pending, path)
        except OSError as err:
            raise CheckpointError(f"could not write checkpoint {path}: {err.strerror or err}; the run stops here so "
                                  "that it does not go on without checkpoints (free space or fix permissions, then "
                                  "resume)") from err
    trainer.strategy.barrier("checkpoint_folder_committed")


def commit_folder(pending: Path, path: Path) -> None:
    """Record ``pending``'s files in ``path``'s checksum file, then put ``pending`` in the place of ``path``."""

    lines = []
    for file in folder_files(pending):
        with open(pending / file, "rb") as f:
            os.fsync(f.fileno())
        lines.append(f"{sha256_of_file(pending / file)}  {(pending / file).stat().st_size}  {file}\n")
    side = checksum_path(path)
    write_synced(pending_path(side), "".join(lines).encode())
    os.replace(pending_path(side), side)
    replace_folder(pending, path)


def replace_folder(pending: Path, path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
    replace_synced(pending, path)


def folder_files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def recorded_files(path: Path) -> dict[str, tuple[str, int]] | None:
    """``{file: (sha256, size)}`` from the checksum file beside the folder ``path``; None when there is none."""

    side = checksum_path(path)
    if not side.is_file():
        return None
    recorded = {}
    for line in side.read_text().splitlines():
        fields = line.split(maxsplit=2)
        if len(fields) != 3 or len(fields[0]) != 64 or not fields[1].isdigit():
            raise CheckpointError(f"checkpoint checksum file {side} is malformed; delete it to load {path.name} "
                                  "unverified")
        recorded[fields[2]] = (fields[0], int(fields[1]))
    return recorded


def mismatch(folder: Path, recorded: dict[str, tuple[str, int]]) -> str | None:
    """What in ``folder`` differs from ``recorded`` (one phrase), or None when every file matches."""

    for name, (digest, size) in recorded.items():
        file = folder / name
        if not file.is_file():
            return f"lacks {name}, which its checksum file lists: incomplete"
        if file.stat().st_size != size:
            return f"has {file.stat().st_size} bytes in {name}, its checksum file records {size}: truncated or replaced"
        if verified_hash(file) != digest:
            return f"does not match its recorded SHA-256 in {name}: altered or damaged on disk"
    return None


def verify_folder(path: str | Path) -> Path:
    """Check the checkpoint folder ``path`` is complete and matches the checksums beside it (when there are some);
    a one-line :class:`CheckpointError` otherwise."""

    path = Path(path)
    pending = pending_path(path)
    recorded = recorded_files(path)
    if recorded is not None and pending.is_dir() and mismatch(pending, recorded) is None:
        replace_folder(pending, path)  # finish a write interrupted between its checksums and its rename
    if not path.is_dir():
        raise CheckpointError(f"no checkpoint at {path}")
    if recorded is None:
        rank_zero_warn(f"checkpoint folder {path} has no .sha256 file beside it: its integrity is not verified")
    else:
        problem = mismatch(path, recorded)
        if problem is not None:
            raise CheckpointError(f"checkpoint folder {path} {problem}; use an earlier checkpoint")
    for name in (INDEX_FILE, REST_FILE):
        if not (path / name).is_file():
            raise CheckpointError(f"checkpoint folder {path} has no {name}: it is not a complete distributed "
                                  "checkpoint; use an earlier checkpoint")
    index = read_index(path)
    for item in index.storage_data.values():  # unverified folders too: every shard the index points into is whole
        shard = path / item.relative_path
        if not shard.is_file() or shard.stat().st_size < item.offset + item.length:
            raise CheckpointError(f"checkpoint folder {path}: {item.relative_path} is missing or shorter than its "
                                  "index says (truncated); use an earlier checkpoint")
    return path


class IndexUnpickler(pickle.Unpickler):
    """Unpickles a ``.metadata`` index admitting only what an index is made of (no arbitrary code)."""

    ALLOWED = {
        "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                                  "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                                  "_MEM_FORMAT_ENCODING", "StorageMeta"},
        "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
        "torch.serialization": {"_get_layout"},
        "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
        "collections": {"OrderedDict"},
        "torch": {"Size"},
    }

    def find_class(self, module: str, name: str):
        dtype = getattr(torch, name, None) if module == "torch" else None
        if name in self.ALLOWED.get(module, ()) or isinstance(dtype, torch.dtype):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"weights only: GLOBAL {module}.{name} is not part of a checkpoint index")


def read_index(path: Path, trust: bool = False):
    """The folder's ``torch.distributed.checkpoint`` index (tensor shapes, dtypes, where each shard lies)."""

    index_file = path / INDEX_FILE
    try:
        with open(index_file, "rb") as f:
            return pickle.load(f) if trust else IndexUnpickler(f).load()
    except pickle.UnpicklingError as err:
        if "weights only" in str(err):
            raise CheckpointError(f"checkpoint {index_file} needs arbitrary code to load "
                                  f"({str(err).split('GLOBAL ')[-1].split(' ')[0]}) and was refused; only if you "
                                  f"trust its source, load it with {TRUST_ENV}=1") from None
        raise unreadable(index_file, err) from err
    except Exception as err:  # EOFError, OSError ...: a damaged index
        raise unreadable(index_file, err) from err


class DataOnlyReader(FileSystemReader):
    """``torch.distributed.checkpoint``'s file reader whose index goes through :class:`IndexUnpickler` (torch's
    own reader unpickles ``.metadata`` with plain ``pickle.load``)."""

    def __init__(self, path: str | Path, trust: bool = False):
        super().__init__(path)
        self.trust = trust

    def read_metadata(self, *args, **kwargs):
        metadata = read_index(Path(self.path), self.trust)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class DataOnlyLoadPlanner(DefaultLoadPlanner):
    """``torch.distributed.checkpoint``'s default load planner, whose non-tensor items (an optimizer's
    param-group settings, saved as pickled bytes inside the shards) are read with ``weights_only=True``: torch's
    own planner unpickles them with ``weights_only=False``, so a payload planted in a shard would run. An item
    that needs code is a one-line :class:`CheckpointError` naming the shard file and the item."""

    def __init__(self, folder: str | Path, trust: bool = False):
        super().__init__()
        self.folder, self.trust = Path(folder), trust

    def load_bytes(self, read_item, value) -> None:
        fqn = read_item.dest_index.fqn
        shard = self.metadata.storage_data[read_item.storage_index].relative_path
        item = load_as_data(value, f"{self.folder / shard} (item {fqn})", trust=self.trust)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], item)
        else:
            self.state_dict[fqn] = item


def load_sharded(state: dict[str, Any], folder: str | Path, trust: bool = False, no_dist: bool = False) -> None:
    """``torch.distributed.checkpoint.load(state, folder)`` that reads tensors and plain data only (see
    :class:`DataOnlyReader`, :class:`DataOnlyLoadPlanner`); ``no_dist``: without a process group."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # its note that no process group runs: none is meant to
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            dcp.load(state, storage_reader=DataOnlyReader(folder, trust), planner=DataOnlyLoadPlanner(folder, trust),
                     no_dist=no_dist)
        except CheckpointException as err:  # torch gathers each rank's failure: ours is the one line to show
            refusals = [failure[0] for failure in err.failures.values() if isinstance(failure[0], CheckpointError)]
            if refusals:
                raise refusals[0] from None
            raise


def check_items_are_data(path: Path, index, trust: bool = False) -> None:
    """Read every non-tensor item of the folder (a few bytes each: param-group settings) as data, straight from
    its shard, so that one that needs code is refused before a resume starts any rank."""
    if trust:
        return
    encoded = []  # items written through a storage transform (compression): torch's reader decodes them
    for key, where in index.storage_data.items():
        if not isinstance(index.state_dict_metadata.get(key.fqn), BytesStorageMetadata):
            continue
        if where.transform_descriptors:
            encoded.append(key.fqn)
            continue
        with open(path / where.relative_path, "rb") as f:
            f.seek(where.offset)
            load_as_data(io.BytesIO(f.read(where.length)), f"{path / where.relative_path} (item {key.fqn})")
    if encoded:
        load_sharded(dict.fromkeys(encoded), path, no_dist=True)


def read_folder(path: Path, map_location: Any = "cpu", trust: bool = False, tensors: bool = True) -> dict:
    """The checkpoint dict of a verified folder, as ``torch.load`` of a file checkpoint gives it; ``state_dict``
    holds whole tensors (``tensors=True``) or tensors on the meta device with the saved shapes and dtypes.
    Optimizer states stay in the folder (Lightning's strategy restores them into its sharded optimizer)."""
    checkpoint = load_trusted_or_weights_only(path / REST_FILE, map_location=map_location, trust=trust)
    index = read_index(path, trust)
    check_items_are_data(path, index, trust)
    entries = {fqn[len(STATE_DICT_PREFIX):]: entry for fqn, entry in index.state_dict_metadata.items()
               if fqn.startswith(STATE_DICT_PREFIX) and isinstance(entry, TensorStorageMetadata)}
    device = "cpu" if tensors else "meta"
    state = {name: torch.empty(entry.size, dtype=entry.properties.dtype, device=device)
             for name, entry in entries.items()}
    if tensors:
        load_sharded({"state_dict": state}, path, trust, no_dist=True)
    checkpoint["state_dict"] = state
    return checkpoint
