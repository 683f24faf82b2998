"""Driving the package's Lightning callbacks from a loop that is not Lightning's: each hook gets the loop's view of a
``lightning.Trainer`` and the model itself as its ``pl_module``."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import lightning as L
from torch import nn


def run_hook(callbacks: Sequence[L.Callback], hook: str, view, model: nn.Module, *args) -> None:
    """Call ``hook`` (``"on_train_batch_end"``, say) of every callback in order, as Lightning does.

    Args:
        callbacks: the callbacks, each a ``lightning.Callback``.
        hook: the name of the hook.
        view: what the callbacks read as ``trainer`` (its ``log``/``log_dict``, ``device`` and ``training_step``
            stand in for the model's while the hook runs).
        model: the model, handed over as ``pl_module``.
        *args: the hook's own arguments after ``(trainer, pl_module)``.

    Example:
        >>> run_hook(callbacks, "on_train_batch_start", view, model, None, batch_idx)
    """
    with as_lightning_module(model, view):
        for callback in callbacks:
            getattr(callback, hook)(view, model, *args)


@contextlib.contextmanager
def as_lightning_module(model: nn.Module, view) -> Iterator[nn.Module]:
    """The model itself as the callbacks' ``pl_module``, its names, classes and parameters unchanged, with
    ``log``/``log_dict`` (and what DASH's gradient pass reads) present for the block's duration; attributes of the
    model's own that these shadow are put back after it."""
    added = {"log": view.log, "log_dict": view.log_dict}
    for name, value in (("training_step", view.training_step), ("automatic_optimization", True),
                        ("device", view.device)):
        if not hasattr(model, name):
            added[name] = value
    shadowed = {name: model.__dict__[name] for name in added if name in model.__dict__}
    for name, value in added.items():
        object.__setattr__(model, name, value)
    try:
        yield model
    finally:
        for name in added:
            model.__dict__.pop(name, None)
        model.__dict__.update(shadowed)


class TaskBoundaries:
    """``trainer.datamodule`` for ``Schedule(at_task_boundaries=True)``: the steps at which a new task begins,
    or no attribute where none are known."""

    def __init__(self, steps: Sequence[int] | None):
        if steps is not None:
            self.task_boundary_steps = list(steps)
