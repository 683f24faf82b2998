"""Every method of ``configs/method/`` runs in a task stream as its real callbacks, built by
``task_stream_callbacks``, and acts at every task boundary of the stream (and nowhere else)."""
import lightning as L
import pytest
import torch
from hydra_app import compose_config

pytest.importorskip("sklearn")

from plasticity_callbacks.app.methods import method_names, task_stream_callbacks  # noqa: E402
from plasticity_callbacks.app.pipeline import instantiate_callbacks, resolve_method  # noqa: E402
from plasticity_callbacks.callbacks.schedule import Schedule  # noqa: E402
from plasticity_callbacks.data.digits import RandomLabelDigits  # noqa: E402
from plasticity_callbacks.models.classifier import DigitsClassifier  # noqa: E402

STEPS_PER_TASK = 5
# ReDo changes weights only where neurons are dormant: a threshold near the layer mean makes some
# neuron dormant at every decision, and deciding every 5 steps puts a decision at every boundary.
OVERRIDES = {"redo": ["method.callbacks.redo.tau=0.9", "method.callbacks.redo.schedule.every_n_steps=5"]}


def method_callbacks(method: str, *overrides: str) -> tuple[list[L.Callback], bool]:
    """The method's callbacks in a task stream, and whether it carries the optimizer's state."""
    cfg = compose_config("experiment=continual_digits", f"+method={method}", *overrides)
    method_cfg = resolve_method(cfg)
    return instantiate_callbacks(task_stream_callbacks(method_cfg)), bool(method_cfg.carry_optimizer)


class Snapshot(L.Callback):
    """Listed first: the weights right after each optimizer step, before any method's batch-end hook."""

    def __init__(self):
        self.weights: list[torch.Tensor] = []

    def take(self, pl_module):
        self.weights = [p.detach().clone() for p in pl_module.parameters()]

    def on_train_start(self, trainer, pl_module):
        self.take(pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.take(pl_module)


class ChangedSince(L.Callback):
    """Listed last: global steps at which the weights, just before the optimizer steps (after every
    method's batch-start hook), differ from the snapshot: something other than the optimizer acted.
    Also the steps at which Adam's moments start again (the step count of every parameter is 0)."""

    def __init__(self, snapshot: Snapshot):
        self.snapshot, self.steps, self.fresh_optimizer = snapshot, [], []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if any(not torch.equal(a, b) for a, b in zip(self.snapshot.weights, pl_module.parameters())):
            self.steps.append(trainer.global_step)
        if all(not optimizer.state.get(p) for p in pl_module.parameters()):
            self.fresh_optimizer.append(trainer.global_step)


def run_stream(callbacks, num_tasks=4):
    snapshot = Snapshot()
    changed = ChangedSince(snapshot)
    stream = RandomLabelDigits(num_tasks=num_tasks, steps_per_task=STEPS_PER_TASK, batch_size=32,
                               samples_per_task=128, seed=0)
    L.seed_everything(0)
    trainer = L.Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, log_every_n_steps=STEPS_PER_TASK,
                        callbacks=[snapshot, *callbacks, changed])
    trainer.fit(DigitsClassifier(widths=[32, 32, 32]), datamodule=stream)
    return changed, stream.task_boundary_steps


def test_every_declared_method_is_found():
    assert {"warm", "warm_reset", "reset", "sp", "fire_lm", "fire_continual", "fire_exact", "fire_exact_head", "dash", "redo"} <= set(method_names())


def at_boundaries(callback) -> bool:
    """Whether the callback acts at task boundaries (or, here, every 5 steps: the same steps) and nowhere else."""
    return getattr(callback, "schedule", None) in (Schedule(at_task_boundaries=True), Schedule(every_n_steps=5))


@pytest.mark.parametrize("method", method_names())
def test_each_method_acts_at_every_task_boundary(method):
    callbacks, carries_optimizer = method_callbacks(method, *OVERRIDES.get(method, []))
    assert all(type(c).__module__.startswith("plasticity_callbacks.callbacks.") for c in callbacks)
    changed, boundaries = run_stream(callbacks)
    assert boundaries == [5, 10, 15]
    if all(at_boundaries(c) for c in callbacks):  # a method that acts every step is timed by its own tests
        touches_weights = bool(resolve_method_cfg(method).get("callbacks"))
        assert changed.steps == (boundaries if touches_weights else [])
    # Adam's state starts again at step 0 and, without carry_optimizer, at every boundary
    assert changed.fresh_optimizer == [0] + ([] if carries_optimizer else boundaries)


def resolve_method_cfg(method: str):
    return resolve_method(compose_config(f"+method={method}"))
