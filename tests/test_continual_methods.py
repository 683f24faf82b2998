"""Every boundary method of ``experiment=continual_digits`` is the real callback, built from the
experiment's config, and acts at every task boundary of the stream (and nowhere else)."""
import lightning as L
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

pytest.importorskip("sklearn")

from plasticity_callbacks.app.pipeline import callback_specs  # noqa: E402
from plasticity_callbacks.app.train import config_dir  # noqa: E402
from plasticity_callbacks.data.digits import RandomLabelDigits  # noqa: E402
from plasticity_callbacks.models.classifier import DigitsClassifier  # noqa: E402

METHODS = ["reset", "sp", "fire_exact", "fire", "dash", "redo"]
STEPS_PER_TASK = 5


def boundary_callback(method: str, *overrides: str) -> L.Callback | None:
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        cfg = compose("config", overrides=["experiment=continual_digits", f"+method={method}",
                                           "paths.output_dir=/tmp/plasticity-compose", *overrides])
    specs = callback_specs({"boundary": cfg.callbacks.boundary})
    assert len(specs) <= 1, f"{method}: a row names {len(specs)} callbacks"
    return instantiate(specs[0], _convert_="all") if specs else None


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
    method's batch-start hook), differ from the snapshot: something other than the optimizer acted."""

    def __init__(self, snapshot: Snapshot):
        self.snapshot, self.steps = snapshot, []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if any(not torch.equal(a, b) for a, b in zip(self.snapshot.weights, pl_module.parameters())):
            self.steps.append(trainer.global_step)


def run_stream(method_callback, num_tasks=4):
    """Global steps at which the method changed the weights, and the stream's task boundaries."""
    snapshot = Snapshot()
    changed = ChangedSince(snapshot)
    stream = RandomLabelDigits(num_tasks=num_tasks, steps_per_task=STEPS_PER_TASK, batch_size=32,
                               samples_per_task=128, seed=0)
    callbacks = [snapshot, *([method_callback] if method_callback is not None else []), changed]
    L.seed_everything(0)
    trainer = L.Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, log_every_n_steps=STEPS_PER_TASK, callbacks=callbacks)
    trainer.fit(DigitsClassifier(widths=[32, 32, 32]), datamodule=stream)
    return changed.steps, stream.task_boundary_steps


def test_warm_start_has_no_callback_and_nothing_changes_the_weights():
    assert boundary_callback("warm") is None
    changed, _ = run_stream(None)
    assert changed == []


@pytest.mark.parametrize("method", METHODS)
def test_each_method_acts_at_every_task_boundary(method):
    pytest.importorskip("plasticity_callbacks.core.schedule")  # until the callbacks take schedule=
    # ReDo changes weights only where neurons are dormant: a threshold near the layer mean makes
    # some neuron dormant at every boundary of a short stream, so each decision is visible; and
    # 5-step tasks need activations collected at every step to have statistics for each decision.
    overrides = []
    if method == "redo":
        overrides = ["stream_methods.redo.redo.tau=0.9", "stream_methods.redo.redo.collect_every_n_steps=1"]
    callback = boundary_callback(method, *overrides)
    assert type(callback).__module__.startswith("plasticity_callbacks.callbacks.")
    changed, boundaries = run_stream(callback)
    assert boundaries == [5, 10, 15]
    assert changed == boundaries
