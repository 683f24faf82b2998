"""One schedule for every callback: each trigger, the resume rule, plateaus, task boundaries, bad input."""
from __future__ import annotations

from types import SimpleNamespace

import lightning as L
import pytest
import torch
from hydra.utils import instantiate
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import OmegaConf

from plasticity_callbacks.callbacks.schedule import Schedule, ScheduleState
from helpers import fit
from tiny import TinyMLPModule, cpu_trainer, regression_loader

BATCHES_PER_EPOCH = 8  # regression_loader(): 64 samples, batch 8


class Recorder(L.Callback):
    """Acts (records an event) whenever its schedule says so; checks steps in ``step_hook``."""

    def __init__(self, schedule: Schedule, step_hook: str = "batch_start"):
        self.firing = ScheduleState(schedule, "Recorder")
        self.step_hook = step_hook
        self.events: list[tuple[int, str]] = []

    def _note(self, trainer, reason):
        if reason is not None:
            self.events.append((trainer.global_step, reason))

    def setup(self, trainer, pl_module, stage):
        self.firing.begin_fit(stage)

    def on_train_start(self, trainer, pl_module):
        self._note(trainer, self.firing.due_at_train_start(trainer))

    def on_train_epoch_start(self, trainer, pl_module):
        self._note(trainer, self.firing.due_at_epoch_start(trainer))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.step_hook == "batch_start":
            self._note(trainer, self.firing.due_at_step(trainer))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if self.step_hook == "before_optimizer_step":
            self._note(trainer, self.firing.due_at_step(trainer))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.step_hook == "batch_end":
            self._note(trainer, self.firing.due_at_step(trainer))

    def on_validation_end(self, trainer, pl_module):
        self._note(trainer, self.firing.due_at_validation_end(trainer, pl_module))

    def state_dict(self):
        return {"firing": self.firing.state_dict(), "events": list(self.events)}

    def load_state_dict(self, state):
        self.firing.load_state_dict(state["firing"])
        self.events = [tuple(e) for e in state["events"]]


def fired(schedule, max_steps, step_hook="batch_start", **trainer_kwargs):
    """The ``(step, reason)`` events ``schedule`` fires in a fit of ``max_steps``."""
    recorder = Recorder(schedule, step_hook)
    fit(TinyMLPModule(), recorder, steps=max_steps, data=regression_loader(), limit_val_batches=0, **trainer_kwargs)
    return recorder.events


# ------------------------------------------------------------------ each trigger in a real fit
def test_fit_start_fires_once_per_fit():
    assert fired(Schedule(at_fit_start=True), max_steps=5) == [(0, "fit start")]


def test_epochs_and_every_n_epochs_fire_at_the_epochs_first_step():
    events = fired(Schedule(epochs=[1], every_n_epochs=3), max_steps=4 * BATCHES_PER_EPOCH)
    assert events == [(8, "epoch 1"), (24, "epoch 3")]  # every_n_epochs skips epoch 0


def test_steps_and_every_n_steps():
    events = fired(Schedule(steps=[0, 5], every_n_steps=4), max_steps=13)
    assert [step for step, _ in events] == [0, 4, 5, 8, 12]


@pytest.mark.parametrize("step_hook, first_seen", [("batch_start", 0), ("before_optimizer_step", 0), ("batch_end", 1)])
def test_step_triggers_are_read_off_global_step_in_any_hook(step_hook, first_seen):
    events = fired(Schedule(steps=[0, 3], every_n_steps=5), max_steps=11, step_hook=step_hook)
    # batch_end first sees global_step 1: step 0 fires there, late but not lost
    assert [step for step, _ in events] == [first_seen, 3, 5, 10]


@pytest.mark.parametrize("step_hook, seen", [("batch_start", [0, 1, 2, 3]), ("before_optimizer_step", [0, 1, 2, 3]),
                                             ("batch_end", [1, 2, 3, 4])])
def test_every_step_acts_at_every_optimizer_step_of_the_fit_step_0_included(step_hook, seen):
    """every_n_steps=1 is every step: before (or, at a batch end, after) each of the fit's optimizer steps; n > 1
    counts its multiples from the fit's start, which is not one of them."""
    assert [step for step, _ in fired(Schedule(every_n_steps=1), max_steps=4, step_hook=step_hook)] == seen
    assert [step for step, _ in fired(Schedule(every_n_steps=2), max_steps=5)] == [2, 4]


def test_gradient_accumulation_counts_optimizer_steps_and_fires_once():
    events = fired(Schedule(steps=[2], every_n_steps=3), max_steps=7, accumulate_grad_batches=4, max_epochs=-1)
    assert events == [(2, "step 2"), (3, "step 3"), (6, "step 6")]


class TwoOptimizers(TinyMLPModule):
    """Manual optimization with two optimizers, each stepping every batch: global_step advances by 2."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        x, y = batch
        for optimizer in self.optimizers():
            optimizer.zero_grad()
            self.manual_backward(torch.nn.functional.mse_loss(self(x), y))
            optimizer.step()

    def configure_optimizers(self):
        first, rest = list(self.net[0].parameters()), list(self.net[2:].parameters())
        return [torch.optim.SGD(first, lr=0.01), torch.optim.SGD(rest, lr=0.01)]


def test_several_optimizers_count_every_step_and_a_jumped_over_trigger_fires_late():
    recorder = Recorder(Schedule(steps=[3, 4], every_n_steps=5))
    cpu_trainer(max_steps=12, callbacks=[recorder]).fit(TwoOptimizers(), regression_loader())
    # batch starts see global_step 0, 2, 4, ...: step 3 is jumped over and fires at 4 with step 4;
    # every_n_steps=5 fires at 6 (5 jumped over) and 10
    assert recorder.events == [(4, "step 4"), (6, "step 6"), (10, "step 10")]


def test_triggers_on_the_same_step_act_once():
    events = fired(Schedule(at_fit_start=True, epochs=[0], steps=[0], every_n_steps=2), max_steps=5)
    assert events == [(0, "fit start"), (2, "step 2"), (4, "step 4")]


def test_window_start_step_end_step():
    events = fired(Schedule(every_n_steps=2, start_step=3, end_step=8), max_steps=12)
    assert [step for step, _ in events] == [4, 6, 8]


def test_a_new_fit_with_the_same_callback_starts_afresh():
    recorder = Recorder(Schedule(at_fit_start=True, steps=[2]))
    for _ in range(2):  # two phases, each with its own Trainer
        cpu_trainer(max_steps=4, callbacks=[recorder]).fit(TinyMLPModule(), regression_loader())
    assert recorder.events == [(0, "fit start"), (2, "step 2")] * 2


# ------------------------------------------------------------------ task boundaries
class TaskStream(L.LightningDataModule):
    def __init__(self, boundaries):
        super().__init__()
        self.task_boundary_steps = boundaries

    def train_dataloader(self):
        return regression_loader()


def test_task_boundaries_fire_when_a_new_task_starts():
    recorder = Recorder(Schedule(at_task_boundaries=True))
    cpu_trainer(max_steps=12, callbacks=[recorder]).fit(TinyMLPModule(), datamodule=TaskStream([3, 7, 50]))
    assert recorder.events == [(3, "task 1 starts (step 3)"), (7, "task 2 starts (step 7)")]


def test_task_boundaries_need_a_datamodule_that_announces_them():
    recorder = Recorder(Schedule(at_task_boundaries=True))
    with pytest.raises(ValueError, match="task_boundary_steps"):
        cpu_trainer(max_steps=2, callbacks=[recorder]).fit(TinyMLPModule(), regression_loader())
    with pytest.raises(ValueError, match="positive integers"):
        cpu_trainer(max_steps=2, callbacks=[Recorder(Schedule(at_task_boundaries=True))]).fit(
            TinyMLPModule(), datamodule=TaskStream([0, 4]))


# ------------------------------------------------------------------ resume: no repeat, no skip
@pytest.mark.parametrize("step_hook", ["batch_start", "batch_end"])
def test_resume_mid_epoch_neither_repeats_nor_skips(tmp_path, step_hook):
    schedule = Schedule(at_fit_start=True, epochs=[1], every_n_epochs=2, steps=[12, 14], every_n_steps=5)
    whole = fired(schedule, max_steps=28, step_hook=step_hook)

    # Interrupted: a checkpoint at step 12, in the middle of epoch 1 (8 batches per epoch) and on a step
    # trigger (Lightning 2.6 does not call on_train_epoch_start again for the resumed epoch).
    checkpoints = ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=12, save_top_k=-1)
    first = Recorder(schedule, step_hook)
    cpu_trainer(max_steps=15, callbacks=[first, checkpoints], enable_checkpointing=True).fit(
        TinyMLPModule(), regression_loader())
    resumed = Recorder(schedule, step_hook)
    cpu_trainer(max_steps=28, callbacks=[resumed]).fit(TinyMLPModule(), regression_loader(),
                                                       ckpt_path=str(tmp_path / "step=12.ckpt"))
    assert resumed.events == whole
    assert (8, "epoch 1") in whole and any(step == 12 for step, _ in whole)  # the resume crosses both


# ------------------------------------------------------------------ plateau (fake trainer: exact control)
def fake_trainer(value, step, world_size=1):
    return SimpleNamespace(callback_metrics={"val/loss": torch.tensor(value)}, sanity_checking=False,
                           global_step=step, world_size=world_size, current_epoch=0)


def test_plateau_patience_min_delta_cooldown_and_limit():
    firing = ScheduleState(Schedule(monitor="val/loss", patience=2, min_delta=0.1, cooldown=1, max_plateau_fires=2),
                           "Recorder")
    module = SimpleNamespace(device=torch.device("cpu"))
    values = [1.0, 0.95, 0.93,  # 0.95 and 0.93 are not 0.1 better than 1.0: plateau at the second
              0.9,  # cooldown: ignored (but becomes the new best)
              0.85, 0.84,  # plateau again
              0.8, 0.79, 0.78, 0.77]  # limit of 2 reached: never again
    fired = [step for step, v in enumerate(values)
             if firing.due_at_validation_end(fake_trainer(v, step), module) is not None]
    assert fired == [2, 5]


def test_plateau_mode_max_and_missing_metric():
    firing = ScheduleState(Schedule(monitor="val/loss", mode="max", patience=1), "Recorder")
    module = SimpleNamespace(device=torch.device("cpu"))
    assert [firing.due_at_validation_end(fake_trainer(v, i), module) for i, v in enumerate([1.0, 2.0, 1.5])] == [
        None, None, "plateau of val/loss"]
    missing = SimpleNamespace(callback_metrics={"other": 1.0}, sanity_checking=False, global_step=0, world_size=1)
    with pytest.raises(RuntimeError, match="val/loss.*logged metrics: \\['other'\\]"):
        firing.due_at_validation_end(missing, module)


def test_plateau_state_survives_a_resume():
    schedule = Schedule(monitor="val/loss", patience=3)
    module = SimpleNamespace(device=torch.device("cpu"))
    first = ScheduleState(schedule, "Recorder")
    for step, v in enumerate([1.0, 1.0, 1.0]):
        assert first.due_at_validation_end(fake_trainer(v, step), module) is None
    resumed = ScheduleState(schedule, "Recorder")
    resumed.begin_fit("fit")
    resumed.load_state_dict(first.state_dict())
    assert resumed.due_at_validation_end(fake_trainer(1.0, 3), module) == "plateau of val/loss"


def test_plateau_in_a_real_fit():
    class Scripted(TinyMLPModule):
        losses = iter([3.0, 2.0, 2.0, 2.0, 1.0])

        def on_validation_epoch_end(self):
            self.log("val/score", next(self.losses))

    recorder = Recorder(Schedule(monitor="val/score", patience=2))
    cpu_trainer(max_epochs=5, callbacks=[recorder]).fit(Scripted(), regression_loader(), regression_loader(n=8))
    assert recorder.events == [(4 * BATCHES_PER_EPOCH, "plateau of val/score")]  # 2nd validation without gain


# ------------------------------------------------------------------ construction and bad input
def test_hydra_nested_target_and_plain_dict_build_the_same_schedule():
    config = OmegaConf.create({"_target_": "plasticity_callbacks.callbacks.schedule.Schedule", "steps": [300, 100],
                               "at_fit_start": True})
    built = instantiate(config)
    assert built == Schedule(at_fit_start=True, steps=(100, 300)) and built.steps == (100, 300)
    assert Schedule.build(OmegaConf.create({"steps": [300, 100], "at_fit_start": True}), "X") == built
    assert Schedule.build({"_target_": "ignored", "at_fit_start": True}, "X") == Schedule(at_fit_start=True)


@pytest.mark.parametrize("kwargs, match", [
    ({}, "no trigger"),
    ({"at_fit_start": "yes"}, "at_fit_start='yes' must be true or false"),
    ({"steps": [5, -1]}, "steps=.*non-negative integers"),
    ({"epochs": "3"}, "epochs='3'.*non-negative integers"),
    ({"every_n_steps": 0}, "every_n_steps=0 must be an integer >= 1"),
    ({"every_n_epochs": 1.5}, "every_n_epochs=1.5"),
    ({"monitor": "val/loss", "mode": "low"}, "mode='low' is not one of"),
    ({"monitor": "val/loss", "patience": 0}, "patience=0"),
    ({"monitor": "val/loss", "min_delta": -1}, "min_delta=-1"),
    ({"every_n_steps": 5, "start_step": 10, "end_step": 5}, "end_step=5"),
])
def test_bad_input_names_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Schedule(**kwargs)


def test_build_refuses_unknown_fields_and_other_types():
    with pytest.raises(ValueError, match=r"FIREReinit schedule: unknown field\(s\) \['at_start'\]"):
        Schedule.build({"at_start": True}, "FIREReinit")
    with pytest.raises(ValueError, match="schedule=True must be a Schedule or a mapping"):
        Schedule.build(True, "FIREReinit")


def test_state_from_another_version_is_refused():
    with pytest.raises(ValueError, match=r"X schedule.load_state_dict.*missing keys.*unknown keys \['applied'\]"):
        ScheduleState(Schedule(at_fit_start=True), "X").load_state_dict({"applied": ["fit_start"]})
