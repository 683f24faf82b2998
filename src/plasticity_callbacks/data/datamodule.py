"""``CodeCorpusDataModule``: text files packed into fixed-length next-token windows."""
from __future__ import annotations

import os
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader, Dataset

from .corpus import glob_files, read_text, split_files, stdlib_dir, stdlib_files
from .sampler import ResumableDataLoader
from .tokenizer import ByteTokenizer

SOURCES = ("stdlib", "files")


class PackedWindows(Dataset):
    """Non-overlapping windows of a token stream: item i is ``(x, y)``, both ``(T,)``, ``y`` = ``x`` shifted by one."""

    def __init__(self, tokens: torch.Tensor, sequence_len: int):
        self.tokens, self.sequence_len = tokens, sequence_len

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.sequence_len)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.sequence_len
        chunk = self.tokens[start : start + self.sequence_len + 1].long()
        return chunk[:-1], chunk[1:]


def pack_files(files: list[Path], tokenizer: ByteTokenizer, max_tokens: int | None = None) -> torch.Tensor:
    """``[bos] file [eos]`` for every file, concatenated into one int16 stream."""
    bos = torch.tensor([tokenizer.bos], dtype=torch.int16)
    eos = torch.tensor([tokenizer.eos], dtype=torch.int16)
    parts, total = [], 0
    for path in files:
        parts += [bos, tokenizer.encode_tensor(read_text(path)), eos]
        total += len(parts[-2]) + 2
        if max_tokens is not None and total >= max_tokens:
            break
    stream = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int16)
    return stream[:max_tokens] if max_tokens is not None else stream


class TrainValDataModule(L.LightningDataModule):
    """Loaders shared by the data modules here: subclasses set ``train_set``, ``val_set``,
    ``batch_size`` and ``num_workers`` in ``__init__``/``setup``."""

    def train_dataloader(self) -> DataLoader:
        # Shuffled from (run seed, epoch) and split over ranks; its position is saved in checkpoints,
        # so a mid-epoch resume sees exactly the batches the uninterrupted run would have.
        trainer = self.trainer
        replicas, rank = (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)
        return ResumableDataLoader(self.train_set, batch_size=self.batch_size, drop_last=True,
                                   num_replicas=replicas, rank=rank, num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers)


class CodeCorpusDataModule(TrainValDataModule):
    """Next-token windows over the standard library's source (default) or your own files.

    Args:
        source: ``stdlib`` (the interpreter's standard library) or ``files`` (``paths`` globs).
        paths: glob(s) for ``source="files"``, e.g. ``"~/corpus/**/*.txt"``.
        packages / exclude_packages: ``fnmatch`` patterns on stdlib top-level packages.
        sequence_len: tokens per training window.
        val_fraction: share of files held out for validation (split by file, deterministic).
        max_train_tokens / max_val_tokens: caps, for quick runs.

    Example:
        >>> dm = CodeCorpusDataModule(packages=["json", "email"], sequence_len=128, batch_size=8)
        >>> trainer.fit(module, datamodule=dm)
    """

    def __init__(
        self,
        source: str = "stdlib",
        paths: str | list[str] | None = None,
        packages: list[str] | None = None,
        exclude_packages: list[str] | None = None,
        sequence_len: int = 256,
        batch_size: int = 16,
        val_fraction: float = 0.05,
        max_train_tokens: int | None = None,
        max_val_tokens: int | None = None,
        num_workers: int = 0,
    ):
        super().__init__()
        if source not in SOURCES:
            raise ValueError(f"data.source={source!r} is not one of {SOURCES}")
        if source == "files" and not paths:
            raise ValueError("data.paths is required when data.source='files'")
        if sequence_len <= 0 or batch_size <= 0:
            raise ValueError(f"data.sequence_len and data.batch_size must be positive, got {sequence_len}, {batch_size}")
        if not 0 <= val_fraction < 1:
            raise ValueError(f"data.val_fraction must be in [0, 1), got {val_fraction}")
        self.save_hyperparameters()
        self.source, self.paths = source, paths
        self.packages = None if packages is None else list(packages)
        self.exclude_packages = None if exclude_packages is None else list(exclude_packages)
        self.sequence_len, self.batch_size, self.val_fraction = sequence_len, batch_size, val_fraction
        self.max_train_tokens, self.max_val_tokens = max_train_tokens, max_val_tokens
        self.num_workers = num_workers
        self.tokenizer = ByteTokenizer()
        self.train_set: PackedWindows | None = None
        self.val_set: PackedWindows | None = None

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def files(self) -> tuple[list[Path], Path | None]:
        if self.source == "stdlib":
            files, root = stdlib_files(self.packages, self.exclude_packages), stdlib_dir()
            if not files:
                raise ValueError(f"the stdlib corpus is empty for packages={self.packages}, "
                                 f"exclude_packages={self.exclude_packages} under {root}")
            return files, root
        files = glob_files(self.paths)
        if not files:
            raise ValueError(f"data.paths={self.paths!r} matches no files")
        # Split by the path below the files' common folder, so moving that folder keeps the split.
        return files, Path(os.path.commonpath([f.parent for f in files]))

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        files, root = self.files()
        train_files, val_files = split_files(files, self.val_fraction, root)
        train = pack_files(train_files, self.tokenizer, self.max_train_tokens)
        val = pack_files(val_files, self.tokenizer, self.max_val_tokens)
        self.train_set = PackedWindows(train, self.sequence_len)
        self.val_set = PackedWindows(val, self.sequence_len)
        if len(self.train_set) == 0:
            raise ValueError(f"the training corpus ({len(train)} tokens) is shorter than one window of "
                             f"data.sequence_len={self.sequence_len}")
        rank_zero_info(f"corpus: {len(train_files)} train files ({len(train):,} tokens), "
                       f"{len(val_files)} val files ({len(val):,} tokens)")

