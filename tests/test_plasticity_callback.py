"""PlasticityCallback, the base of every scheduled method: hooks, logging, state, checks, on a tiny MLP."""
from __future__ import annotations

import pytest
import torch

from plasticity_callbacks import PlasticityCallback, Schedule, Selection
from plasticity_callbacks.errors import CheckpointError
from plasticity_callbacks.model_map import select_targets

from tiny import TinyMLPModule, cpu_trainer, regression_loader


class HalveWeights(PlasticityCallback):
    """The docstring's example method: halve the selected weights when the schedule says so."""

    summary_metrics = ("halve/norm",)
    extra_state_types = {"halvings": int}

    def __init__(self, schedule=None, selection=None):
        super().__init__(schedule, Selection.build(selection, "HalveWeights"))
        self.halvings, self.steps_seen = 0, []

    def act(self, trainer, pl_module, reason):
        targets = select_targets(pl_module, self.selection)
        with torch.no_grad():
            for t in targets:
                t.param.mul_(0.5)
        self.halvings += 1
        self.steps_seen.append((trainer.global_step, reason))
        return {"halve/norm": float(sum(t.param.norm() for t in targets))}

    def extra_state(self):
        return {"halvings": self.halvings}

    def load_extra_state(self, state):
        self.halvings = state["halvings"]


class Recorder(HalveWeights):
    """Copies the weights it sees right before each act, to check the effect exactly."""

    def act(self, trainer, pl_module, reason):
        self.before = {n: p.detach().clone() for n, p in pl_module.named_parameters()}
        return super().act(trainer, pl_module, reason)


def test_acts_at_its_step_and_halves_exactly_the_selected_weights():
    module = TinyMLPModule()
    callback = Recorder(Schedule(steps=[2]), Selection(include=["net.0.*"]))
    seen = {}

    class Snapshot(PlasticityCallback):  # the weights right after the act, in the same hook, before the step
        default_schedule = Schedule(steps=[2])

        def act(self, trainer, pl_module, reason):
            seen.update({n: p.detach().clone() for n, p in pl_module.named_parameters()})
            return {}

    trainer = cpu_trainer(max_steps=4, callbacks=[callback, Snapshot()])
    trainer.fit(module, regression_loader())
    assert callback.steps_seen == [(2, "step 2")] and callback.halvings == 1
    for name, before in callback.before.items():
        expected = before * 0.5 if name.startswith("net.0.weight") else before
        assert torch.equal(seen[name], expected), name
    assert trainer.callback_metrics["halve/norm"] == pytest.approx(float(seen["net.0.weight"].norm()), rel=1e-6)


def test_metrics_from_fit_start_are_logged_at_the_next_batch():
    callback = HalveWeights(Schedule(at_fit_start=True))
    trainer = cpu_trainer(max_steps=1, callbacks=[callback])
    trainer.fit(TinyMLPModule(), regression_loader())
    assert "halve/norm" in trainer.callback_metrics


def test_state_round_trips_and_a_foreign_state_is_refused():
    callback = HalveWeights(Schedule(every_n_steps=2))
    cpu_trainer(max_steps=5, callbacks=[callback]).fit(TinyMLPModule(), regression_loader())
    state = callback.state_dict()
    assert state["halvings"] == 2 and set(state) == {"schedule", "pending_logs", "halvings"}
    other = HalveWeights(Schedule(every_n_steps=2))
    other.load_state_dict(state)
    assert other.halvings == 2 and other.firing.state_dict() == callback.firing.state_dict()
    with pytest.raises(CheckpointError, match="halvings"):
        other.load_state_dict({"schedule": state["schedule"], "halvings": "two"})
    with pytest.raises(CheckpointError, match="missing keys"):
        other.load_state_dict({"schedule": state["schedule"]})


def test_an_empty_selection_fails_at_setup_and_a_method_without_act_says_so():
    with pytest.raises(ValueError, match="HalveWeights: no weights selected"):  # biases only: no weight view
        cpu_trainer(max_steps=1, callbacks=[HalveWeights(selection={"include": ["*.bias"]})]).fit(
            TinyMLPModule(), regression_loader())
    with pytest.raises(ValueError, match="HalveWeights include pattern 'nothing.*' matches no parameter"):
        cpu_trainer(max_steps=1, callbacks=[HalveWeights(selection={"include": ["nothing.*"]})]).fit(
            TinyMLPModule(), regression_loader())

    class Nothing(PlasticityCallback):
        pass

    with pytest.raises(NotImplementedError, match="Nothing must implement act"):
        cpu_trainer(max_steps=1, callbacks=[Nothing()]).fit(TinyMLPModule(), regression_loader())


@pytest.mark.parametrize("hook", ["on_before_optimizer_step", "on_train_batch_end"])
def test_step_hook_chooses_where_step_triggers_act(hook):
    calls = []

    class Where(PlasticityCallback):
        default_schedule = Schedule(steps=[1])
        step_hook = hook

        def act(self, trainer, pl_module, reason):
            calls.append(trainer.global_step)
            return {"where/step": float(trainer.global_step)}

    trainer = cpu_trainer(max_steps=3, callbacks=[Where()])
    trainer.fit(TinyMLPModule(), regression_loader())
    # batch end sees global_step after the step: step 1 is first seen at the end of batch 0
    assert calls == [1] and float(trainer.callback_metrics["where/step"]) == 1.0


def test_a_bad_step_hook_and_a_bad_selection_are_named():
    with pytest.raises(TypeError, match="Wrong.step_hook='on_step'"):  # where the class is written, not at use
        class Wrong(PlasticityCallback):
            step_hook = "on_step"
    with pytest.raises(TypeError, match="Late.every_step_hook='after'"):
        class Late(PlasticityCallback):
            every_step_hook = "after"
    with pytest.raises(ValueError, match="HalveWeights selection"):
        HalveWeights(selection="mlp")


def test_pipeline_summary_reads_each_methods_own_summary_metrics():
    from plasticity_callbacks import FIREReinit, ReDoMonitor
    from plasticity_callbacks.app.pipeline import format_table, summary_values

    metrics = {"halve/norm": 1.5, "fire/dfi_before": 0.25, "fire/dfi_after": 0.0, "redo/dormant": 0.1, "x": 9.0}
    summary = summary_values([HalveWeights(), FIREReinit(), object()], metrics)
    assert summary == {"halve/norm": 1.5, "fire/dfi_before": 0.25, "fire/dfi_after": 0.0}
    assert summary_values([ReDoMonitor()], {}) == {}  # not logged in this phase: no column value
    table = format_table({"method": "m", "seed": 0, "phases": {"a": {"steps": 4, "summary": summary}}})
    header, row = table.splitlines()[-2:]
    assert header.split() == ["phase", "steps", "train", "loss", "val", "loss", "retention", "halve/norm",
                              "fire/dfi_before", "fire/dfi_after", "minutes"]
    assert row.split()[:2] == ["a", "4"] and "1.5" in row and "0.25" in row


def test_an_every_step_schedule_is_a_series_written_at_log_every_n_steps_and_other_actions_are_events():
    """every_n_steps=1 acts at every step (step 0 included) and keeps each value in callback_metrics, but writes a
    logger row only at multiples of log_every_n_steps; an action for another reason (a listed step, off the
    cadence) is an event, written at its step."""
    from lightning.pytorch.loggers import Logger

    class Recording(Logger):
        name, version, rows = "recording", 0, []

        @property
        def experiment(self):
            return None

        def log_hyperparams(self, params, *args, **kwargs):
            pass

        def log_metrics(self, metrics, step=None):
            if "halve/norm" in metrics:
                self.rows.append(step)

    class Every(HalveWeights):
        def act(self, trainer, pl_module, reason):
            self.seen = [*getattr(self, "seen", []), float(trainer.callback_metrics.get("halve/norm", -1.0))]
            metrics = super().act(trainer, pl_module, reason)
            self.returned = [*getattr(self, "returned", []), metrics["halve/norm"]]
            return metrics

    every, recording = Every(Schedule(every_n_steps=1), Selection(include=["net.0.*"])), Recording()
    trainer = cpu_trainer(max_steps=7, callbacks=[every], logger=recording, log_every_n_steps=3)
    trainer.fit(TinyMLPModule(), regression_loader())
    assert [step for step, _ in every.steps_seen] == list(range(7))
    assert recording.rows == [0, 3, 6]
    # the series' latest value is in callback_metrics at every step (a threshold or a checkpoint monitor reads it)
    assert every.seen[1:] == pytest.approx(every.returned[:-1])
    event, recording.rows = Every(Schedule(steps=[4]), Selection(include=["net.0.*"])), []
    cpu_trainer(max_steps=7, callbacks=[event], logger=recording, log_every_n_steps=3).fit(TinyMLPModule(),
                                                                                           regression_loader())
    assert recording.rows == [4]


def test_the_base_builds_a_selection_mapping_and_targets_needs_one():
    class Plain(PlasticityCallback):
        def __init__(self, selection=None):
            super().__init__(selection=selection)

        def act(self, trainer, pl_module, reason):
            return {}

    module = TinyMLPModule()
    assert Plain({"include": ["net.0.*"]}).selection == Selection(include=["net.0.*"])
    assert [t.name for t in Plain({"include": ["net.0.*"]}).targets(module)] == ["net.0.weight"]
    with pytest.raises(TypeError, match="Plain calls self.targets\\(\\) but passed no selection"):
        Plain().targets(module)
