"""Task streams on scikit-learn's bundled 8×8 digits (shipped inside the wheel: nothing downloads).

A stream is a sequence of tasks that one ``Trainer`` trains in order, ``steps_per_task``
batches each, from a single training loader. Loss of plasticity shows as a network that fits
the later tasks worse than the first ones (Lyle et al. 2023; Dohare et al. 2024):

- :class:`RandomLabelDigits`: memorization; each task draws ``samples_per_task`` images and
  gives them random labels. Plasticity = accuracy on the task's own (training) data.
- :class:`FreshRandomLabelDigits`: the same, each task on images no earlier task saw (disjoint
  subsets of the 1797), so nothing learned on earlier images can carry over.
- :class:`PermutedDigits`: the true labels, the pixels shuffled by a new permutation per task.
  Plasticity = accuracy on the task's held-out split (the same images, permuted alike).
- :class:`WarmStartDigits`: nested growing subsets of one training split (default 10 %, then
  all of it; Ash & Adams 2020). Accuracy on a held-out split; "from scratch" is the full reset.

Task boundaries reach callbacks through ``task_boundary_steps``: the global steps at which a
new task starts (task 0 at step 0 is not a boundary). Everything is a function of ``seed``:
the batch of global step ``k`` depends on ``(seed, k)`` only, so a resumed run, or a side pass
over the loader (DASH reads the new task's first batches), sees exactly the batches an
uninterrupted run trains on.

Example:
    >>> stream = RandomLabelDigits(num_tasks=20, steps_per_task=300, seed=0)
    >>> stream.task_boundary_steps[:2]
    [300, 600]
    >>> trainer = L.Trainer(max_epochs=1, callbacks=[TaskMetrics()])  # one epoch = the whole stream
    >>> trainer.fit(DigitsClassifier(), datamodule=stream)
"""
from __future__ import annotations

from dataclasses import dataclass

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

PIXELS, CLASSES = 64, 10

# Separate random streams per purpose, so e.g. changing the batch order never changes a task's labels.
_SPLIT, _TASK, _ORDER, _PROBE = 0, 1, 2, 3


def generator(seed: int, *keys: int) -> torch.Generator:
    """A torch generator seeded from ``(seed, *keys)`` by numpy's ``SeedSequence`` (well-mixed, stable)."""
    state = np.random.SeedSequence([seed, *keys]).generate_state(2, dtype=np.uint32)
    return torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))


def load_digits_tensors() -> tuple[torch.Tensor, torch.Tensor]:
    """All 1797 images as ``(1797, 64)`` float32, each pixel standardized over the images (zero mean, unit
    variance; always-blank pixels stay 0), and their labels ``(1797,)`` int64.

    Standardized inputs matter here: on raw [0, 1] pixels the MLP memorizes 1024 random labels to about
    50 % in 300 steps, on standardized ones to about 97 %, so the first tasks start from a fitted network.
    """
    from ..extras import require_module

    datasets = require_module("sklearn.datasets", "digits", "the digits task streams")
    digits = datasets.load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32)
    x = (x - x.mean(0)) / x.std(0).clamp_min(1e-6)  # (1797, 64)
    return x, torch.tensor(digits.target, dtype=torch.int64)


def held_out_split(n: int, fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Disjoint (train, held-out) index sets of ``range(n)``, the held-out one ``round(fraction·n)`` long,
    drawn from ``seed`` alone."""
    order = torch.randperm(n, generator=generator(seed, _SPLIT))
    n_held = round(fraction * n)
    return order[n_held:], order[:n_held]


@dataclass(frozen=True)
class Task:
    """One task's data: ``train_*`` is what it trains on, ``eval_*`` what its plasticity is measured on."""

    train_x: torch.Tensor  # (N, 64) float32
    train_y: torch.Tensor  # (N,) int64
    eval_x: torch.Tensor  # (M, 64)
    eval_y: torch.Tensor  # (M,)


class StreamBatches(Dataset):
    """Item ``k`` is the training batch of global step ``k``: ``(x (B, 64), y (B,))``, or this rank's
    share of it, rows ``rank, rank + world, …`` (``B / world`` of them), when ``world`` ranks train together.

    Within a task, batches walk through the task's data in epochs, each a fresh permutation
    drawn from ``(seed, task, epoch)``; the last incomplete batch of an epoch is dropped.
    """

    def __init__(self, stream: "DigitsTaskStream", rank: int = 0, world: int = 1):
        self.stream, self.rank, self.world = stream, rank, world
        self._order: tuple[tuple[int, int], torch.Tensor] | None = None  # the current (task, epoch)'s permutation

    def __len__(self) -> int:
        return self.stream.total_steps

    def __getitem__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        stream = self.stream
        index, within = divmod(step, stream.steps_per_task)
        task = stream.task(index)
        n, size = len(task.train_y), stream.batch_size
        epoch, batch = divmod(within, n // size)
        if self._order is None or self._order[0] != (index, epoch):
            self._order = (index, epoch), torch.randperm(n, generator=generator(stream.seed, _ORDER, index, epoch))
        rows = self._order[1][batch * size:(batch + 1) * size][self.rank::self.world]
        return task.train_x[rows], task.train_y[rows]


class FromCurrentStep(DistributedSampler):
    """Global steps ``position() … total − 1``: every new iterator starts where training is now.

    Every rank iterates every step (its :class:`StreamBatches` deals it its share of each batch), so
    this is a ``DistributedSampler`` of one replica: Lightning then leaves it in place instead of
    splitting the steps between ranks. Its length stays the whole stream, because Lightning counts a
    resumed epoch's batches from its own restored progress and expects only the remaining ones.
    """

    def __init__(self, total: int, position):
        super().__init__(range(total), num_replicas=1, rank=0, shuffle=False)
        self.total, self.position = total, position

    def __iter__(self):
        return iter(range(self.position(), self.total))

    def __len__(self) -> int:
        return self.total


class StreamLoader(DataLoader):
    """The stream's training loader: batch ``k`` is ``dataset[k]``, iterated from the current global step.

    Resumable without saving anything: its position is the trainer's global step, which the
    checkpoint restores with the loops. ``state_dict`` / ``load_state_dict`` exist so Lightning
    knows it (it otherwise warns that a mid-epoch checkpoint cannot resume this loader).
    """

    def __init__(self, dataset: "StreamBatches", position):
        super().__init__(dataset, batch_size=None, sampler=FromCurrentStep(len(dataset), position))

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class DigitsTaskStream(L.LightningDataModule):
    """A stream of tasks on the digits, one training loader for all of them (one epoch = the stream).

    Subclasses define :meth:`make_task`. A global step is one batch of the stream: no gradient
    accumulation; on several ranks (DDP, FSDP2) each rank trains on its share of the step's batch
    (``batch_size`` must divide evenly), so the averaged gradient is one process's.

    Args:
        num_tasks: tasks in the stream.
        steps_per_task: optimizer steps (batches) on each task.
        batch_size: images per batch.
        seed: everything random in the stream (tasks, splits, batch order) derives from it.
    """

    sample_name = "images"  # what one training example is, in error messages

    def __init__(self, num_tasks: int = 20, steps_per_task: int = 300, batch_size: int = 128, seed: int = 0):
        super().__init__()
        for name, value in (("num_tasks", num_tasks), ("steps_per_task", steps_per_task), ("batch_size", batch_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"data.{name}={value!r} must be a positive integer")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"data.seed={seed!r} must be an integer")
        self.num_tasks, self.steps_per_task, self.batch_size, self.seed = num_tasks, steps_per_task, batch_size, seed
        self.images: torch.Tensor | None = None
        self.labels: torch.Tensor | None = None
        self._tasks: dict[int, Task] = {}

    @property
    def task_boundary_steps(self) -> list[int]:
        """Global steps at which a new task starts; task 0 at step 0 is not a boundary."""
        return [t * self.steps_per_task for t in range(1, self.num_tasks)]

    @property
    def total_steps(self) -> int:
        return self.num_tasks * self.steps_per_task

    def task_at(self, step: int) -> int:
        """Index of the task that the batch of global step ``step`` belongs to."""
        return min(step // self.steps_per_task, self.num_tasks - 1)

    @property
    def chance(self) -> float | None:
        """The accuracy of a uniform guess at the labels (1/10 for the digits), which ``TaskMetrics`` records
        in ``stream.json`` and ``plasticity-report`` draws; None where a stream has no such level."""
        return 1 / CLASSES

    def make_task(self, index: int) -> Task:
        raise NotImplementedError

    def load_data(self) -> None:
        """Read the data the tasks are cut from, once (subclasses over other data override it)."""
        if self.images is None:
            self.images, self.labels = load_digits_tensors()

    def task(self, index: int) -> Task:
        if not 0 <= index < self.num_tasks:
            raise IndexError(f"task {index} is outside the stream's {self.num_tasks} tasks")
        self.load_data()
        if index not in self._tasks:
            task = self.make_task(index)
            if len(task.train_y) < self.batch_size:
                raise ValueError(f"task {index} has {len(task.train_y)} training {self.sample_name}, fewer than "
                                 f"data.batch_size={self.batch_size}; lower the batch size")
            self._tasks[index] = task
        return self._tasks[index]

    def setup(self, stage: str | None = None) -> None:
        trainer = self.trainer
        if trainer is not None and trainer.accumulate_grad_batches != 1:
            raise ValueError(f"{type(self).__name__} runs without gradient accumulation (a global step is one batch "
                             f"of the stream); got accumulate_grad_batches={trainer.accumulate_grad_batches}")
        if trainer is not None and self.batch_size % trainer.world_size:
            raise ValueError(f"data.batch_size={self.batch_size} does not split evenly over {trainer.world_size} "
                             "ranks (each trains on its share of every batch); use a multiple of the rank count")
        self.task(0)  # loads the digits and checks the sizes before training starts

    def train_dataloader(self) -> DataLoader:
        trainer = self.trainer

        def position() -> int:
            return trainer.global_step if trainer is not None else 0

        rank, world = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
        return StreamLoader(StreamBatches(self, rank, world), position)

    def probe_data(self, samples: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
        """A fixed probe task, the same for every method of a seed: ``samples`` images with random
        labels (Lyle et al. 2023 probe plasticity by fitting random labels from a trained network)."""
        self.load_data()
        g = generator(self.seed, _PROBE)
        rows = torch.randperm(len(self.labels), generator=g)[:samples]
        return self.images[rows], torch.randint(0, CLASSES, (len(rows),), generator=g)

    def eval_data(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The data on which task ``index``'s plasticity is measured: ``(x (M, 64), y (M,))``."""
        task = self.task(index)
        return task.eval_x, task.eval_y


class RandomLabelDigits(DigitsTaskStream):
    """Memorization: each task draws ``samples_per_task`` images and labels them at random.

    Args:
        samples_per_task: images per task (at most 1797), drawn without replacement.
        (and the stream's arguments, see :class:`DigitsTaskStream`)

    Example:
        >>> stream = RandomLabelDigits(num_tasks=20, samples_per_task=1024, steps_per_task=300)
    """

    def __init__(self, num_tasks: int = 20, steps_per_task: int = 300, batch_size: int = 128, seed: int = 0,
                 samples_per_task: int = 1024):
        super().__init__(num_tasks, steps_per_task, batch_size, seed)
        n = samples_per_task
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 1797:
            raise ValueError(f"data.samples_per_task={samples_per_task!r} must be an integer in [1, 1797]")
        self.samples_per_task = samples_per_task

    def make_task(self, index: int) -> Task:
        g = generator(self.seed, _TASK, index)
        rows = torch.randperm(len(self.labels), generator=g)[: self.samples_per_task]
        labels = torch.randint(0, CLASSES, (self.samples_per_task,), generator=g)
        x = self.images[rows]
        return Task(x, labels, x, labels)


class FreshRandomLabelDigits(RandomLabelDigits):
    """Memorization on fresh images: task ``t`` relabels at random the ``t``-th block of ``samples_per_task``
    images of one shuffled order of the digits, so the tasks' image sets are disjoint and no image is seen twice.
    Accuracy on an image an earlier task trained on is not there to be carried over: only plasticity is measured.

    Args:
        samples_per_task: images per task; ``num_tasks × samples_per_task`` must not exceed the 1797 digits
            (20 tasks: at most 89 each).
        (and the stream's arguments, see :class:`DigitsTaskStream`)

    Example:
        >>> stream = FreshRandomLabelDigits(num_tasks=20, samples_per_task=89, steps_per_task=50, batch_size=32)
    """

    def __init__(self, num_tasks: int = 20, steps_per_task: int = 300, batch_size: int = 128, seed: int = 0,
                 samples_per_task: int = 89):
        super().__init__(num_tasks, steps_per_task, batch_size, seed, samples_per_task)
        if num_tasks * samples_per_task > 1797:
            raise ValueError(f"data.num_tasks={num_tasks} × data.samples_per_task={samples_per_task} = "
                             f"{num_tasks * samples_per_task} fresh images, more than the 1797 digits; at most "
                             f"{1797 // num_tasks} per task for {num_tasks} tasks")

    def rows(self, index: int) -> torch.Tensor:
        """The indices (into the 1797 digits) of task ``index``'s images: one block of one shuffled order."""
        self.load_data()
        order = torch.randperm(len(self.labels), generator=generator(self.seed, _SPLIT))
        return order[index * self.samples_per_task:(index + 1) * self.samples_per_task]

    def make_task(self, index: int) -> Task:
        labels = torch.randint(0, CLASSES, (self.samples_per_task,), generator=generator(self.seed, _TASK, index))
        x = self.images[self.rows(index)]
        return Task(x, labels, x, labels)


class PermutedDigits(DigitsTaskStream):
    """True labels, pixels permuted by a new random permutation per task (task 0 included).

    Args:
        held_out_fraction: share of the images kept out of training (the same split for every task).
        split_seed: the seed of that split; None: ``seed``. Set apart from ``seed``, the split varies while the
            initialization, the permutations and the batch order stay (split-to-split against seed-to-seed spread).
        (and the stream's arguments, see :class:`DigitsTaskStream`)

    Example:
        >>> stream = PermutedDigits(num_tasks=10, steps_per_task=200, split_seed=7)
    """

    def __init__(self, num_tasks: int = 20, steps_per_task: int = 300, batch_size: int = 128, seed: int = 0,
                 held_out_fraction: float = 0.2, split_seed: int | None = None):
        super().__init__(num_tasks, steps_per_task, batch_size, seed)
        if not 0 < held_out_fraction < 1:
            raise ValueError(f"data.held_out_fraction={held_out_fraction!r} must be in (0, 1)")
        if split_seed is not None and (isinstance(split_seed, bool) or not isinstance(split_seed, int)):
            raise ValueError(f"data.split_seed={split_seed!r} must be an integer or null (null: data.seed)")
        self.held_out_fraction = held_out_fraction
        self.split_seed = seed if split_seed is None else split_seed

    def permutation(self, index: int) -> torch.Tensor:
        return torch.randperm(PIXELS, generator=generator(self.seed, _TASK, index))

    def make_task(self, index: int) -> Task:
        train, held = held_out_split(len(self.labels), self.held_out_fraction, self.split_seed)
        x = self.images[:, self.permutation(index)]
        return Task(x[train], self.labels[train], x[held], self.labels[held])


class WarmStartDigits(DigitsTaskStream):
    """Warm starting (Ash & Adams 2020): task ``t`` trains on the first ``fractions[t]`` of one shuffled
    training split, so every task's data contains the previous task's; all are measured on one held-out split.

    Args:
        fractions: increasing shares of the training split, one per task (``num_tasks`` follows).
        held_out_fraction: share of the images kept out of training.
        (and ``steps_per_task``, ``batch_size``, ``seed``, see :class:`DigitsTaskStream`)

    Example:
        >>> stream = WarmStartDigits(fractions=[0.1, 1.0], steps_per_task=500)
    """

    def __init__(self, fractions: list[float] = (0.1, 1.0), steps_per_task: int = 300, batch_size: int = 128,
                 seed: int = 0, held_out_fraction: float = 0.2):
        fractions = [float(f) for f in fractions]
        if not fractions or any(not 0 < f <= 1 for f in fractions) or fractions != sorted(set(fractions)):
            raise ValueError(f"data.fractions={fractions} must be strictly increasing shares in (0, 1], "
                             "e.g. [0.1, 1.0]")
        if not 0 < held_out_fraction < 1:
            raise ValueError(f"data.held_out_fraction={held_out_fraction!r} must be in (0, 1)")
        super().__init__(len(fractions), steps_per_task, batch_size, seed)
        self.fractions, self.held_out_fraction = fractions, held_out_fraction

    def make_task(self, index: int) -> Task:
        train, held = held_out_split(len(self.labels), self.held_out_fraction, self.seed)
        rows = train[: max(1, round(self.fractions[index] * len(train)))]  # a prefix: nested subsets
        return Task(self.images[rows], self.labels[rows], self.images[held], self.labels[held])
