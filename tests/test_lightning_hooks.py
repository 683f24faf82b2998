"""``run_hook``: what the Fabric and Hugging Face adapters drive the callbacks with. For the hook's duration the
model answers ``log``/``log_dict``/``training_step``/``device`` like a LightningModule; afterwards it is as it was."""
from __future__ import annotations

import contextlib

import lightning as L
import pytest
import torch
from torch import nn

from plasticity_callbacks.integrations.lightning_hooks import TaskBoundaries, run_hook


class View:
    device = torch.device("cpu")

    def __init__(self):
        self.logged = {}

    def log(self, name, value, **ignored):
        self.logged[name] = value

    def log_dict(self, metrics, **options):
        self.logged.update(metrics)

    def training_step(self, batch, batch_idx):
        return torch.zeros(())


class Recorder(L.Callback):
    def __init__(self, fail: bool = False):
        self.calls, self.fail = [], fail

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.calls.append((trainer, pl_module, batch, batch_idx))
        pl_module.log("seen", float(batch_idx))
        assert pl_module.training_step(None, 0) is not None and pl_module.device == View.device
        if self.fail:
            raise RuntimeError("hook failed")


@pytest.mark.parametrize("fail", [False, True])
def test_every_callback_in_order_and_the_model_restored(fail):
    model, view = nn.Linear(2, 2), View()

    def own_log(*args, **kwargs):  # an attribute of the model's own, which the hook shadows
        pass

    model.log = own_log
    before = set(model.__dict__)
    first, second = Recorder(), Recorder(fail=fail)
    with pytest.raises(RuntimeError, match="hook failed") if fail else contextlib.nullcontext():
        run_hook([first, second], "on_train_batch_start", view, model, "batch", 3)
    assert first.calls == second.calls == [(view, model, "batch", 3)]
    assert view.logged == {"seen": 3.0}
    assert set(model.__dict__) == before and model.log is own_log
    assert not hasattr(model, "training_step") and not hasattr(model, "device")


def test_task_boundaries_only_where_known():
    assert TaskBoundaries((5, 10)).task_boundary_steps == [5, 10]
    assert not hasattr(TaskBoundaries(None), "task_boundary_steps")
