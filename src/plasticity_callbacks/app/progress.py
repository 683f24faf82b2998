"""``StepLines``: progress as plain lines, for a console that is not a terminal (a log file, a pipe, a batch job).

Lightning's progress bars redraw themselves with ``\\r`` and cursor codes; written to a file, every redraw stays,
and the lines that matter (the coverage table, the time estimate, the summary) drown in them. When standard
output is not a terminal, ``plasticity-train`` uses this instead: one line every ``every_n_steps`` optimizer
steps (default: a tenth of the fit), through the logging that also writes ``train.log``.

Example:
    >>> trainer = L.Trainer(max_steps=400, callbacks=[StepLines("pretrain")])
    # pretrain: step 40/400 (10 %), 1.52 s a step, train/loss 3.214
"""
from __future__ import annotations

import math
import sys
import time
from typing import Any

from lightning.pytorch.callbacks.progress.progress_bar import ProgressBar
from lightning.pytorch.utilities import rank_zero_info


class StepLines(ProgressBar):
    """One line per ``every_n_steps`` optimizer steps, and one at the last step: step, share done, seconds a
    step since the previous line, and the metrics logged with ``prog_bar=True``. Rank zero only.

    Args:
        name: what the lines call the fit (a pipeline phase's name).
        every_n_steps: steps between lines; None: a tenth of the fit's steps (every 50 when the fit has no end).
    """

    def __init__(self, name: str = "fit", every_n_steps: int | None = None):
        super().__init__()
        if every_n_steps is not None and (isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int)
                                          or every_n_steps < 1):
            raise ValueError(f"StepLines every_n_steps={every_n_steps!r} must be a positive integer or None")
        self.name, self.every_n_steps = name, every_n_steps
        self.enabled = True
        self._previous: tuple[int, float] | None = None  # (step, time) of the previous line or the fit's start

    def disable(self) -> None:
        self.enabled = False

    def enable(self) -> None:
        self.enabled = True

    def print(self, *args: Any, **kwargs: Any) -> None:
        if self.enabled:
            rank_zero_info(" ".join(map(str, args)))

    def on_train_start(self, trainer, pl_module) -> None:
        self._previous = (trainer.global_step, time.perf_counter())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        step, total = trainer.global_step, self.total_steps(trainer)
        every = self.every_n_steps or (max(1, round(total / 10)) if math.isfinite(total) else 50)
        if not self.enabled or self._previous is None or step == self._previous[0]:
            return  # disabled, or the same optimizer step (gradient accumulation)
        if step % every and step != total:
            return
        now = time.perf_counter()
        per_step = (now - self._previous[1]) / (step - self._previous[0])
        self._previous = (step, now)
        of = f"/{total} ({100 * step / total:.0f} %)" if math.isfinite(total) and total > 0 else ""
        metrics = {k: v for k, v in self.get_metrics(trainer, pl_module).items() if k != "v_num"}
        shown = "".join(f", {k} {v:.4g}" if isinstance(v, float) else f", {k} {v}" for k, v in metrics.items())
        rank_zero_info(f"{self.name}: step {step}{of}, {per_step:.2f} s a step{shown}")

    @staticmethod
    def total_steps(trainer) -> float:
        """The optimizer steps this fit ends at (``inf`` when it has no end)."""
        if trainer.max_steps is not None and trainer.max_steps > 0:
            return trainer.max_steps
        return trainer.estimated_stepping_batches


def progress_callbacks(trainer_settings, name: str = "fit") -> list[ProgressBar]:
    """``[StepLines(name)]`` when the run shows progress (``trainer.enable_progress_bar``, true unless set) and
    standard output is not a terminal; else none: Lightning's own bar in a terminal, nothing when disabled."""
    if not trainer_settings.get("enable_progress_bar", True) or sys.stdout.isatty():
        return []
    return [StepLines(name)]
