"""A run says up front how long it will take: TimeEstimate's line from the steps it measured."""
import re
import time

import lightning as L
import pytest
from tiny import TinyMLPModule, cpu_trainer, regression_loader

from plasticity_callbacks.app.time_estimate import TimeEstimate


class SlowSteps(L.Callback):
    """Each training step takes at least ``seconds`` more: a step time the estimate must find."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        time.sleep(self.seconds)


def test_the_estimate_is_printed_once_from_the_measured_step_time(caplog):
    estimate = TimeEstimate([("pretrain", 40), ("sft", 20)], skip=1, measure=3)
    trainer = cpu_trainer(max_steps=8, callbacks=[SlowSteps(0.05), estimate], limit_val_batches=0)
    with caplog.at_level("INFO"):
        trainer.fit(TinyMLPModule(), regression_loader())
    lines = [r.getMessage() for r in caplog.records if "time estimate" in r.getMessage()]
    assert lines == [estimate.line]  # once, however many steps follow
    per_step = float(re.search(r"takes ([\d.]+) s a step \(measured over steps 1-4\)", estimate.line)[1])
    assert 0.05 <= per_step < 0.5
    left = re.search(r"about (\d+) s more for its remaining 36 of 40 steps", estimate.line)
    assert left and int(left[1]) == pytest.approx(36 * per_step, abs=1)
    whole = re.search(r"the whole run about (\d+) s more", estimate.line)
    assert whole and int(whole[1]) == pytest.approx(56 * per_step, abs=1)  # sft at pretrain's step time


def test_validations_inside_the_fit_are_counted_at_their_measured_length():
    estimate = TimeEstimate([("fit", 30)])
    trainer = cpu_trainer(max_steps=2, val_check_interval=10, callbacks=[estimate])
    trainer.validate(TinyMLPModule(), regression_loader())  # as the pipeline validates before a phase
    assert estimate.validation_seconds is not None
    assert estimate.validations(trainer, 0, 30) == 4  # steps 10, 20, 30 and the one after the fit
    assert estimate.validations(trainer, 7, 30) == 4 and estimate.validations(trainer, 10, 30) == 3
    estimate.validation_seconds = 2.0
    line = estimate.describe(per_step=1.0, first=2, last=7, trainer=trainer)
    assert "about 31 s more for its remaining 23 of 30 steps, validations (2.0 s each) included" in line


@pytest.mark.parametrize("bad", [dict(phases=[]), dict(phases=[("fit", 10)], measure=0)])
def test_bad_arguments_are_refused(bad):
    with pytest.raises(ValueError, match="TimeEstimate"):
        TimeEstimate(**bad)


def test_later_phases_count_this_phases_set_up_time(caplog):
    """The pipeline's phases each read their data, build a model and validate before their first step; a later
    phase's estimate counts that time as this phase measured it (from ``started`` to the first training step)."""
    began = time.perf_counter()
    time.sleep(0.3)  # this phase's set-up: data, model, the validation before the fit
    estimate = TimeEstimate([("pretrain", 40), ("sft", 20)], skip=1, measure=3, started=began)
    trainer = cpu_trainer(max_steps=6, callbacks=[SlowSteps(0.02), estimate], limit_val_batches=0)
    with caplog.at_level("INFO"):
        trainer.fit(TinyMLPModule(), regression_loader())
    assert 0.3 <= estimate.setup_seconds < 5
    assert re.search(r"'pretrain' set up in \d+ s and takes", estimate.line)
    estimate.setup_seconds = 30.0
    line = estimate.describe(per_step=2.0, first=1, last=4, trainer=trainer)
    assert "the whole run about 2.4 min more" in line  # 2·36 s left here, then sft: 30 s set-up + 2·20 s


def test_without_a_start_time_set_up_is_measured_from_the_trainers_set_up():
    estimate = TimeEstimate([("fit", 10)], skip=1, measure=2)
    cpu_trainer(max_steps=4, callbacks=[estimate], limit_val_batches=0).fit(TinyMLPModule(), regression_loader())
    assert estimate.started is not None and 0 <= estimate.setup_seconds < 5
