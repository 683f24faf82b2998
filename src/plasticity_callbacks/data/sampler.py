"""A training loader that a checkpoint can stop and restart mid-epoch without changing the batches.

The order of an epoch is a function of ``(seed, epoch)`` only (a seeded permutation, split over
ranks like ``DistributedSampler``), so nothing about it has to be saved except how far into the
epoch training got. Lightning 2.x saves that for us: its fit loop stores ``state_dict()`` of every
training DataLoader that has ``state_dict``/``load_state_dict`` (``CombinedLoader._state_dicts``)
under ``checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"]`` and hands it back to
``load_state_dict`` before the resumed epoch's first batch; it then calls ``set_epoch`` with the
restored epoch. Without this, Lightning warns that the loader is "not resumable" and a resumed run
replays the epoch from its first batch.

Where the position is counted, and why there: batches handed out by the DataLoader's iterator,
not indices drawn from the sampler. Worker processes draw indices ahead of time
(``prefetch_factor``), so the sampler is always ahead of training; Lightning's own one-batch
prefetch is skipped for loaders with a length, which this one always has.
"""
from __future__ import annotations

import os

from torch.utils.data import DataLoader, Dataset, DistributedSampler


def default_seed() -> int:
    """The run's seed as ``L.seed_everything`` records it (what Lightning's own sampler uses), else 0."""
    return int(os.environ.get("PL_GLOBAL_SEED", 0))


class ResumableSampler(DistributedSampler):
    """``DistributedSampler`` (order from ``seed + epoch``, this rank's share) that starts ``start``
    indices into the epoch after a resume. ``set_epoch`` to another epoch starts from 0 again.

    Lightning does not wrap it in its own distributed sampler: it already is one.
    """

    def __init__(self, dataset: Dataset, num_replicas: int = 1, rank: int = 0, shuffle: bool = True, seed: int = 0):
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"rank={rank} must be in [0, num_replicas={num_replicas})")
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=False)
        self.start = 0  # indices of the current epoch this rank consumed before the resume

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.start = 0
        super().set_epoch(epoch)

    def __iter__(self):
        # len(self) stays the whole epoch: Lightning counts the resumed epoch's batches from its own
        # progress counters and expects exactly the remaining ones from the iterator.
        return iter(list(super().__iter__())[self.start:])

    def state_dict(self, batches_done: int = 0, batch_size: int = 1) -> dict:
        return {"epoch": self.epoch, "seed": self.seed, "shuffle": self.shuffle,
                "samples_seen": batches_done * batch_size * self.num_replicas}  # over all ranks

    def load_state_dict(self, state: dict) -> None:
        self.seed, self.shuffle = int(state["seed"]), bool(state["shuffle"])  # continue the interrupted order
        self.set_epoch(int(state["epoch"]))
        # Each rank takes every num_replicas-th index of the epoch's permutation, so after n samples
        # over all ranks each rank has consumed n / num_replicas: exact when the world size is unchanged.
        self.start = int(state["samples_seen"]) // self.num_replicas


class ResumableDataLoader(DataLoader):
    """A shuffling training DataLoader whose position in the epoch is saved in Lightning checkpoints.

    Example:
        >>> loader = ResumableDataLoader(dataset, batch_size=16, seed=0)
        >>> trainer.fit(module, train_dataloaders=loader, ckpt_path="last")  # resumes mid-epoch exactly
    """

    def __init__(self, dataset: Dataset, batch_size: int, seed: int | None = None, shuffle: bool = True,
                 drop_last: bool = True, num_replicas: int = 1, rank: int = 0, **kwargs):
        for name in ("sampler", "batch_sampler"):
            if kwargs.get(name) is not None:
                raise ValueError(f"ResumableDataLoader builds its own sampler; got {name}={kwargs[name]!r}")
        kwargs.pop("sampler", None)
        kwargs.pop("batch_sampler", None)
        sampler = ResumableSampler(dataset, num_replicas, rank, shuffle, default_seed() if seed is None else seed)
        super().__init__(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last, **kwargs)
        self._position = (sampler.epoch, 0)  # (epoch, batches this rank has handed out in it)
        self._live: list[object] = []  # iterators in progress; the newest is the training loop's

    def __iter__(self):
        # A generator, so the sampler's epoch is read at the first batch: Lightning calls iter() before
        # set_epoch. A side pass over the loader (DASHShrink reads batches before training starts) runs
        # in its own iterator and stops reporting once the training loop's iterator has begun.
        token = object()
        self._live.append(token)
        epoch, done = self.sampler.epoch, self.sampler.start // self.batch_size
        try:
            for batch in super().__iter__():
                done += 1
                if self._live[-1] is token:
                    self._position = (epoch, done)
                yield batch
        finally:
            self._live.remove(token)

    def state_dict(self) -> dict:
        epoch, done = self._position
        if epoch != self.sampler.epoch:  # set_epoch moved on and this epoch has not started yet
            epoch, done = self.sampler.epoch, 0
        return self.sampler.state_dict(done, self.batch_size) | {"epoch": epoch}

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)
        self._position = (self.sampler.epoch, self.sampler.start // self.batch_size)
