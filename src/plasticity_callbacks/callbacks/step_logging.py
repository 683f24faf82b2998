"""Log values measured at one step once, at that step, whatever Lightning's logging cadence.

``pl_module.log(name, value, on_step=True)`` suits a value measured at every step: Lightning writes it
at its own cadence (``log_every_n_steps``). A value measured only at some steps (a method's action, a
monitor that measures every k steps, a task's end) must not go that way: Lightning keeps a logged step
value in its results and writes it again in every later row of the epoch, so a reader sees it as if
measured at those later steps, and a resumed fit, whose results start empty, writes different rows.
:func:`log_at_step` writes such values straight to the loggers, once, at ``trainer.global_step``, and
keeps them in ``trainer.callback_metrics`` (what ``Schedule(monitor=...)``, ``ModelCheckpoint(monitor=...)``
and the pipeline's summaries read).

Example:
    >>> log_at_step(trainer, {"redo/dormant": 0.12, "redo/dead": 0.03})   # one row, at this step
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def log_at_step(trainer, metrics: Mapping[str, Any], write: bool = True) -> dict[str, float]:
    """Keep ``metrics`` in ``trainer.callback_metrics`` and write them once to every logger at ``trainer.global_step``.

    Call it on every rank: each keeps the values in its ``callback_metrics``; Lightning's loggers write on
    rank zero only (their ``log_metrics`` is ``rank_zero_only``), as for ``pl_module.log``.

    Args:
        trainer: a ``lightning.Trainer`` (or an object with ``global_step``, ``loggers``, ``callback_metrics``).
        metrics: ``{name: number or one-element tensor}`` (a host sync per tensor); nothing is written when empty.
        write: False keeps them in ``callback_metrics`` only; the caller writes them later with
            :func:`write_to_loggers` (at the same step: see ``PlasticityCallback.log_event``'s ``defer``).

    Returns:
        The values as floats.

    Raises:
        ValueError: a value is a tensor of more than one element.

    Example:
        >>> log_at_step(trainer, {"l2_init/distance": torch.tensor(3.2)})
        {'l2_init/distance': 3.2}
    """
    values = {name: _number(name, value) for name, value in metrics.items()}
    for name, value in values.items():
        trainer.callback_metrics[name] = torch.tensor(value)
    if write:
        write_to_loggers(trainer, values)
    return values


def write_to_loggers(trainer, values: Mapping[str, float]) -> None:
    """Write ``values`` once to every logger of ``trainer`` at ``trainer.global_step`` (nothing when empty)."""
    if not values:
        return
    for logger in trainer.loggers:
        logger.log_metrics(dict(values), step=trainer.global_step)
        logger.save()  # on disk now, not at the logger's next flush: a fit stopped before then keeps the row


def _number(name: str, value: Any) -> float:
    if torch.is_tensor(value):
        if value.numel() != 1:
            raise ValueError(f"log_at_step: {name!r} is a tensor of shape {tuple(value.shape)}; log one number "
                             "per name (reduce it, or log each element under its own name)")
        return float(value.detach())
    return float(value)
