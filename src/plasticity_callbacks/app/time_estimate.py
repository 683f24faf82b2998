"""``TimeEstimate``: a run says up front how long it will take on this machine, from its own first steps.

After a few optimizer steps (the first ones left out: they pay for warm-up) the callback measures the
seconds per step, adds the validations the fit will run at the duration of the last one it saw (the
pipeline validates before each phase, and after it), and prints one line: this phase's remaining time,
and for a pipeline the phases still to come at this phase's step time, each with this phase's set-up time
(reading its data, building the model, loading the previous phase, the validation before it: measured from
``started`` to the first training step). A later phase whose steps or data cost more (longer sequences, a
larger corpus) takes longer than said.

Example:
    >>> trainer = L.Trainer(max_steps=400, callbacks=[TimeEstimate([("fit", 400)])])
    # after step 7: "time estimate for this machine: 'fit' set up in 12 s and takes 1.52 s a step (measured over
    # steps 2-7) -> ..."
"""
from __future__ import annotations

import time
from datetime import datetime, timedelta

import lightning as L
from lightning.pytorch.utilities import rank_zero_info


class TimeEstimate(L.Callback):
    """Print this phase's (and the remaining phases') expected wall time once, after its first steps.

    Args:
        phases: ``(name, optimizer steps)`` of every phase still to run, this one first.
        skip: steps left out of the measurement (compilation, caches, allocator warm-up).
        measure: steps measured after those.
        started: ``time.perf_counter()`` when the phase began, before its data and model were built; None: when
            the trainer sets this callback up (the data's and model's construction then go unmeasured).
    """

    def __init__(self, phases: list[tuple[str, int]], skip: int = 2, measure: int = 5, started: float | None = None):
        if not phases or skip < 0 or measure < 1:
            raise ValueError(f"TimeEstimate needs a phase and measure >= 1, skip >= 0; got {phases=}, {skip=}, "
                             f"{measure=}")
        self.phases, self.skip, self.measure = list(phases), skip, measure
        self.started_at: tuple[int, float] | None = None  # (step, time) where the measurement starts
        self.validation_seconds: float | None = None
        self.started = started
        self.setup_seconds: float | None = None  # from ``started`` to the first training step
        self._validation_started = 0.0
        self.line: str | None = None  # what was printed

    def setup(self, trainer, pl_module, stage: str) -> None:
        if self.started is None:
            self.started = time.perf_counter()

    def on_train_start(self, trainer, pl_module) -> None:
        if self.setup_seconds is None:
            self.setup_seconds = time.perf_counter() - self.started

    def on_validation_start(self, trainer, pl_module) -> None:
        self._validation_started = time.perf_counter()

    def on_validation_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self.validation_seconds = time.perf_counter() - self._validation_started
            if self.started_at is not None and self.line is None:  # a validation inside the window: start again
                self.started_at = (trainer.global_step, time.perf_counter())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if self.line is not None or step < self.skip:
            return
        if self.started_at is None:
            self.started_at = (step, time.perf_counter())
        elif step - self.started_at[0] >= self.measure:
            first, began = self.started_at
            self.line = self.describe((time.perf_counter() - began) / (step - first), first, step, trainer)
            rank_zero_info(self.line)

    def describe(self, per_step: float, first: int, last: int, trainer) -> str:
        """The line: this phase's remaining time, then the later phases' at this phase's step time and set-up time."""
        (name, steps), later = self.phases[0], self.phases[1:]
        val_seconds = self.validation_seconds or 0.0
        # a later phase sets up as this one did; that includes its validation before the fit where this one had one
        setup = self.setup_seconds if self.setup_seconds is not None else val_seconds

        def seconds(start: int, end: int) -> float:  # steps start+1..end, their validations and the one after
            return (end - start) * per_step + self.validations(trainer, start, end) * val_seconds

        left = seconds(min(last, steps), steps)
        total = left + sum(setup + seconds(0, n) for _, n in later)
        set_up = f"set up in {minutes(self.setup_seconds)} and " if self.setup_seconds is not None else ""
        line = (f"time estimate for this machine: {name!r} {set_up}takes {per_step:.2f} s a step (measured over steps "
                f"{first}-{last}) -> about {minutes(left)} more for its remaining {max(steps - last, 0)} of {steps} "
                "steps")
        if val_seconds:
            line += f", validations ({val_seconds:.1f} s each) included"
        if later:
            line += (f"; the whole run about {minutes(total)} more (later phases at this phase's step time and "
                     "set-up time)")
        return line + f"; done around {datetime.now() + timedelta(seconds=total):%H:%M}"

    @staticmethod
    def validations(trainer, start: int, end: int) -> int:
        """Validations after step ``start`` up to step ``end`` at the trainer's ``val_check_interval`` (an int:
        every n steps), plus the one after the fit; 0 when it does not validate."""
        interval = trainer.val_check_interval
        if not trainer.enable_validation or not isinstance(interval, int) or interval <= 0:
            return 0
        return end // interval - start // interval + 1


def minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"
