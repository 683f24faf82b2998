"""Schedule(threshold=...): a trigger on a logged metric fires where the metric crossed, with its cooldown and
cap, once across a resume; a metric that is never logged is a warning; bad input names the field."""
from __future__ import annotations

import lightning as L
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from plasticity_callbacks import PlasticityMonitor, ReDoMonitor
from plasticity_callbacks.callbacks.schedule import Schedule, Threshold
from plasticity_callbacks.callbacks.step_logging import log_at_step
from test_schedule import Recorder
from helpers import fit
from tiny import TinyMLPModule, cpu_trainer, regression_loader

# A metric measured every 2 steps (logged at the end of those steps); below 0.5 at 6, 8 (the same value),
# 10, 14 and 16 (the same value).
SERIES = {2: 1.0, 4: 0.9, 6: 0.3, 8: 0.3, 10: 0.2, 12: 0.8, 14: 0.1, 16: 0.1, 18: 0.95, 20: 0.95}


class Scripted(L.Callback):
    """Logs ``SERIES[step]`` as ``m`` at the end of those steps, as a monitor measuring every 2 steps does."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step in SERIES:
            log_at_step(trainer, {"m": SERIES[trainer.global_step]})


def fired_steps(threshold: Threshold, max_steps: int = 22, ckpt_path=None, extra=()) -> list[int]:
    """The steps at which ``threshold`` fires over ``SERIES`` in a fit of ``max_steps``."""
    recorder = Recorder(Schedule(threshold=threshold))
    fit(TinyMLPModule(), [Scripted(), recorder, *extra], steps=max_steps, data=regression_loader(n=8 * 24),
        ckpt_path=ckpt_path, enable_checkpointing=bool(extra))
    return [step for step, _ in recorder.events]


@pytest.mark.parametrize("threshold, expected", [
    (Threshold("m", below=0.5), [6, 10, 14]),  # waits for a new value after each action
    (Threshold("m", below=0.5, max_actions=2), [6, 10]),
    (Threshold("m", below=0.5, cooldown=5), [6, 11, 16]),  # 5 steps, then whatever is logged
    (Threshold("m", above=0.85), [2, 4, 18]),  # 20 repeats 18's value
])
def test_fires_where_the_logged_metric_crossed(threshold, expected):
    assert fired_steps(threshold) == expected


@pytest.mark.parametrize("threshold", [Threshold("m", below=0.5), Threshold("m", below=0.5, cooldown=5)])
def test_a_resume_neither_repeats_nor_skips(tmp_path, threshold):
    whole = fired_steps(threshold)
    # Checkpoints at 6 and 10 hold a crossing logged as the checkpoint was written, not yet read; 7: just after
    # an action on a value still logged.
    checkpoints = ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=1, save_top_k=-1)
    fired_steps(threshold, max_steps=11, extra=[checkpoints])
    for step in (6, 7, 10):  # the recorder's state brings the events before the checkpoint
        assert fired_steps(threshold, ckpt_path=str(tmp_path / f"step={step}.ckpt")) == whole, step


def test_a_metric_never_logged_is_a_warning_not_silence():
    with pytest.warns(UserWarning, match=r"threshold='mis/spelt'.*not logged"):
        assert fired_steps(Threshold("mis/spelt", below=0.5, warn_after_steps=4), max_steps=6) == []


def test_recycling_when_the_monitors_dormant_fraction_exceeds_a_threshold():
    """ReDo acts on PlasticityMonitor's metric at the step the monitor logged it above the threshold."""
    monitor = PlasticityMonitor(activations_every_n_steps=2, weights_every_n_steps=None, spectra_every_n_steps=None,
                                plot=False)
    redo = ReDoMonitor(collect_every_n_steps=1, schedule=Schedule(threshold=Threshold("monitor/dormant", above=0.0)))
    module = TinyMLPModule(lr=0.5)  # a large step kills units
    cpu_trainer(max_steps=12, callbacks=[monitor, redo]).fit(module, regression_loader(n=8 * 12))
    crossed = [row["step"] for row in monitor.history if row["monitor/dormant"] > 0]
    acted = [step for step, _ in redo.firing.fired]
    assert crossed, "no unit went dormant: the test would pass vacuously"
    assert acted and set(acted) <= set(crossed) and acted[0] == crossed[0]


def test_hydra_mapping_builds_the_threshold():
    schedule = Schedule.build({"threshold": {"metric": "monitor/dormant", "above": 0.1, "cooldown": 100}}, "X")
    assert schedule.threshold == Threshold("monitor/dormant", above=0.1, cooldown=100)
    assert schedule.has_trigger and "threshold" in schedule.describe()


@pytest.mark.parametrize("kwargs, match", [
    (dict(metric="m"), "exactly one of below= and above="),
    (dict(metric="m", below=1.0, above=2.0), "exactly one of below= and above="),
    (dict(metric="", below=1.0), "metric=''"),
    (dict(metric="m", below="low"), "below='low'"),
    (dict(metric="m", below=1.0, cooldown=0), "cooldown=0"),
    (dict(metric="m", below=1.0, max_actions=0), "max_actions=0"),
])
def test_bad_input_names_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Threshold(**kwargs)
    with pytest.raises(ValueError, match="unknown field"):
        Schedule(threshold={"metric": "m", "below": 1.0, "patience": 2})
