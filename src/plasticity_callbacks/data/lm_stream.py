"""A language-model task stream on the standard library's source bytes (nothing downloads).

One ``Trainer`` trains every task in order, ``steps_per_task`` batches of ``(x, y)`` byte windows
each, exactly like the digits streams (:mod:`plasticity_callbacks.data.digits`, whose step-indexed
loader this reuses): ``task_boundary_steps`` tells the methods where a task starts, ``eval_data(t)``
is what task ``t``'s plasticity is measured on. Targets equal to ``IGNORE_INDEX`` are not trained
or measured. The ``design`` picks what changes from task to task:

- ``random_last_byte``: ``windows_per_task`` windows of ``window`` bytes; the target of the last
  position is a byte drawn at random per task (the others are ignored): memorization, the analogue
  of random labels. ``fresh_windows=false`` keeps the same windows in every task (only the bytes
  to recall change), ``true`` draws new ones per task. Measured on the task's own windows.
- ``permuted_vocab``: next-byte prediction on fresh training windows, every byte (inputs and
  targets) relabelled by a permutation drawn per task; measured on held-out windows (files the
  training never reads), permuted alike.
- ``slices``: next-byte prediction on disjoint slices of the training bytes, task ``t`` on
  ``slice_bytes[t]`` bytes (the FIRE paper's "overtrain on a small slice, then a large new one"
  with ``[small, large]``); measured on held-out windows.

Each design's own settings travel in one :class:`LMDesign` (``design={"name": "slices", "slice_bytes": [...]}``).

Example:
    >>> stream = LMTaskStream(design={"name": "random_last_byte", "fresh_windows": True}, num_tasks=20)
    >>> trainer = L.Trainer(max_epochs=1, callbacks=[TaskMetrics()])  # one epoch = the whole stream
    >>> trainer.fit(GPTLightningModule({"n_layer": 2, "n_embd": 64}), datamodule=stream)
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..arguments import build_options, refuse_unknown_fields

from .corpus import read_text, split_files, stdlib_dir, stdlib_files
from .digits import DigitsTaskStream, Task, generator
from .tokenizer import IGNORE_INDEX

DESIGNS = ("random_last_byte", "permuted_vocab", "slices")
BYTES = 256
# Separate random streams per purpose (the digits streams use 0-3 for theirs).
_WINDOWS, _TARGETS, _PERMUTATION, _PROBE, _HELD_OUT = 10, 11, 12, 13, 14


@refuse_unknown_fields
@dataclass(frozen=True)
class LMDesign:
    """What changes from task to task in an :class:`LMTaskStream`, with that design's own settings (the module
    docstring describes each design).

    Example:
        >>> LMDesign(name="slices", slice_bytes=(20_000, 2_000_000))
    """

    name: str = "random_last_byte"  # random_last_byte | permuted_vocab | slices
    windows_per_task: int = 256  # random_last_byte: the windows each task memorizes
    fresh_windows: bool = True  # random_last_byte: new windows per task (else the same windows every task)
    eval_windows: int = 256  # permuted_vocab / slices: held-out windows each task is measured on
    slice_bytes: tuple[int, ...] | None = None  # slices: the bytes of each task's slice, in task order

    def __post_init__(self) -> None:
        if self.name not in DESIGNS:
            raise ValueError(f"data.design.name={self.name!r} is not one of {DESIGNS}")
        for field in ("windows_per_task", "eval_windows"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 2:
                raise ValueError(f"data.design.{field}={value!r} must be an integer of at least 2")
        if not isinstance(self.fresh_windows, bool):
            raise ValueError(f"data.design.fresh_windows={self.fresh_windows!r} must be true or false")
        if self.slice_bytes is not None:
            if isinstance(self.slice_bytes, (str, bytes)) or not hasattr(self.slice_bytes, "__iter__"):
                raise ValueError(f"data.design.slice_bytes={self.slice_bytes!r} must be a list of slice sizes in bytes")
            object.__setattr__(self, "slice_bytes", tuple(self.slice_bytes) or None)

    @classmethod
    def build(cls, value: LMDesign | Mapping | str) -> LMDesign:
        """``value`` as an LMDesign: kept, a design's name, or a mapping of the fields."""
        return cls(name=value) if isinstance(value, str) else build_options(cls, value, "LMTaskStream", "design")


def corpus_bytes(max_bytes: int, val_fraction: float = 0.05) -> tuple[torch.Tensor, torch.Tensor]:
    """The standard library's training and held-out files as two 1-D uint8 tensors (UTF-8 bytes, files
    in sorted order, each followed by a newline), each cut at ``max_bytes``; the held-out files are
    :func:`~data.corpus.split_files`'s, the same on every machine with the same Python."""
    train_files, val_files = split_files(stdlib_files(), val_fraction, stdlib_dir())

    def concatenate(files) -> torch.Tensor:
        chunks, size = [], 0
        for path in files:
            data = (read_text(path) + "\n").encode("utf-8")
            chunks.append(data)
            size += len(data)
            if size >= max_bytes:
                break
        return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8)

    return concatenate(train_files), concatenate(val_files)


def windows_at(data: torch.Tensor, starts: torch.Tensor, length: int) -> torch.Tensor:
    """``data[s : s + length]`` for every start, as ``(len(starts), length)`` int64."""
    return data[starts[:, None] + torch.arange(length)].long()


class LMTaskStream(DigitsTaskStream):
    """A stream of byte-level language-model tasks (see the module docstring for the designs).

    Args:
        design: what changes from task to task and that design's settings: an :class:`LMDesign`, a mapping of its
            fields, or a design's name (``random_last_byte`` | ``permuted_vocab`` | ``slices``) with the defaults.
        num_tasks: tasks in the stream; None: 20, or with ``slices`` one per ``slice_bytes``.
        steps_per_task: optimizer steps (batches) on each task.
        batch_size: windows per batch.
        seed: everything random in the stream derives from it.
        window: bytes per window; a batch is ``x (B, window)``, ``y (B, window)`` (``y`` = ``x`` shifted by one).
        corpus_max_bytes: bytes of training files read (the held-out files are cut at the same size).

    Example:
        >>> LMTaskStream(design={"name": "slices", "slice_bytes": [20_000, 2_000_000]}, steps_per_task=500).num_tasks
        2
    """

    sample_name = "windows"

    def __init__(self, design: LMDesign | Mapping | str = "random_last_byte", num_tasks: int | None = None,
                 steps_per_task: int = 100, batch_size: int = 64, seed: int = 0, window: int = 32,
                 corpus_max_bytes: int = 4_000_000):
        options = LMDesign.build(design)
        design, windows_per_task, fresh_windows = options.name, options.windows_per_task, options.fresh_windows
        eval_windows, slice_bytes = options.eval_windows, options.slice_bytes
        if design == "slices":
            sizes_ok = slice_bytes and all(isinstance(b, int) and not isinstance(b, bool) and b > window + 1
                                           for b in slice_bytes)
            if not sizes_ok:
                raise ValueError(f"data.design.slice_bytes={slice_bytes!r}: design.name=slices needs a list of slice sizes in "
                                 f"bytes, each more than data.window + 1 = {window + 1}")
            if num_tasks not in (None, len(slice_bytes)):
                raise ValueError(f"data.num_tasks={num_tasks} disagrees with the {len(slice_bytes)} slice_bytes "
                                 "(leave it null: one task per slice)")
            num_tasks = len(slice_bytes)
        elif num_tasks is None:
            num_tasks = 20
        super().__init__(num_tasks, steps_per_task, batch_size, seed)
        for name, value in (("window", window), ("corpus_max_bytes", corpus_max_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 2:
                raise ValueError(f"data.{name}={value!r} must be an integer of at least 2")
        if design == "slices" and sum(slice_bytes) > corpus_max_bytes:
            raise ValueError(f"data.design.slice_bytes add up to {sum(slice_bytes)}, more than data.corpus_max_bytes="
                             f"{corpus_max_bytes}; raise corpus_max_bytes")
        self.design, self.window, self.windows_per_task = design, window, windows_per_task
        self.fresh_windows, self.eval_windows = bool(fresh_windows), eval_windows
        self.corpus_max_bytes = corpus_max_bytes
        self.slice_bytes = list(slice_bytes) if slice_bytes else None
        self.sequence_len, self.vocab_size = window, BYTES  # read by the GPT's check_data_fits_model
        self.train_bytes: torch.Tensor | None = None
        self.held_out_bytes: torch.Tensor | None = None

    @property
    def chance(self) -> float | None:
        """1/256 for ``random_last_byte`` (the byte to recall is uniform); None for next-byte prediction on
        text, where guessing the frequent bytes already beats a uniform guess."""
        return 1 / BYTES if self.design == "random_last_byte" else None

    def load_data(self) -> None:
        if self.train_bytes is None:
            self.train_bytes, self.held_out_bytes = corpus_bytes(self.corpus_max_bytes)
            if len(self.held_out_bytes) <= self.window + 1:
                raise ValueError(f"data.corpus_max_bytes={self.corpus_max_bytes} leaves too few held-out bytes")

    def random_windows(self, data: torch.Tensor, count: int, *keys: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``count`` windows at random offsets of ``data``: inputs and next-byte targets, ``(count, window)`` each."""
        starts = torch.randint(0, len(data) - self.window - 1, (count,), generator=generator(self.seed, *keys))
        both = windows_at(data, starts, self.window + 1)
        return both[:, :-1], both[:, 1:].clone()

    def make_task(self, index: int) -> Task:
        if self.design == "random_last_byte":
            x, y = self.random_windows(self.train_bytes, self.windows_per_task, _WINDOWS,
                                       index if self.fresh_windows else 0)
            y.fill_(IGNORE_INDEX)
            y[:, -1] = torch.randint(0, BYTES, (len(y),), generator=generator(self.seed, _TARGETS, index))
            return Task(x, y, x, y)
        held_x, held_y = self.random_windows(self.held_out_bytes, self.eval_windows, _HELD_OUT)
        if self.design == "permuted_vocab":
            count = self.steps_per_task * self.batch_size  # every step a fresh batch of windows
            x, y = self.random_windows(self.train_bytes, count, _WINDOWS, index)
            permutation = torch.randperm(BYTES, generator=generator(self.seed, _PERMUTATION, index))
            return Task(permutation[x], permutation[y], permutation[held_x], permutation[held_y])
        start = sum(self.slice_bytes[:index])
        part = self.train_bytes[start:start + self.slice_bytes[index]]
        count = min(self.steps_per_task * self.batch_size, len(part) // self.window)
        x, y = self.random_windows(part, max(count, self.batch_size), _WINDOWS, index)
        return Task(x, y, held_x, held_y)

    def probe_data(self, samples: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
        """A fixed probe task, the same for every method of a seed: ``samples`` training windows whose
        last byte is replaced by a random one (the others ignored), as in ``random_last_byte``."""
        self.load_data()
        x, y = self.random_windows(self.train_bytes, samples, _PROBE)
        y.fill_(IGNORE_INDEX)
        y[:, -1] = torch.randint(0, BYTES, (samples,), generator=generator(self.seed, _PROBE, 1))
        return x, y
