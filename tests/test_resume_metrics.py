"""A resume keeps every metric row: what a method logged between the last checkpoint and the
interruption is logged again (at the same step), never lost and never twice.

A method acting at a validation end (a plateau) writes its row at the next training hook, at the
same step; the checkpoint saved after that validation carries those metrics (``PlasticityCallback``'s
``pending_logs``), and the resumed run logs them once.
"""
from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger

from plasticity_callbacks.callbacks.base import PlasticityCallback
from plasticity_callbacks.app.runs.checkpoints import ModelCheckpointAfterValidation, VerifiedCheckpointIO
from plasticity_callbacks.callbacks.schedule import Schedule

from helpers import fit
from tiny import TinyMLPModule, regression_loader


class HalveOnPlateau(PlasticityCallback):
    """Halves every weight at a plateau of val/loss (min_delta is huge: the second validation); logs the new norm."""

    default_schedule = Schedule(monitor="val/loss", patience=1, min_delta=100.0)

    def act(self, trainer, pl_module, reason):
        with torch.no_grad():
            for p in pl_module.parameters():
                p.mul_(0.5)
        return {"halve/norm": float(sum(p.norm() for p in pl_module.parameters())),
                "halve/step": float(trainer.global_step)}


class Recorder(Logger):
    """A logger beside the real one: every ``halve/*`` value written to the loggers, ``[(step, name, value)]``."""

    def __init__(self):
        super().__init__()
        self.rows = []

    name, version = "recorder", 0

    def log_metrics(self, metrics, step=None) -> None:
        self.rows += [(step, k, float(v)) for k, v in metrics.items() if k.startswith("halve/")]

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass


def halving_rows(tmp_path, max_steps, logger, ckpt_path=None):
    """The ``halve/*`` rows a fit with ``HalveOnPlateau`` (checkpointed every 2 steps) logs to ``logger``."""
    recorder = Recorder()
    checkpoint = ModelCheckpointAfterValidation(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_last=True,
                                                save_top_k=0)
    L.seed_everything(0)
    fit(TinyMLPModule(), [HalveOnPlateau(), checkpoint], steps=max_steps, data=regression_loader(),
        val_data=regression_loader(seed=1), ckpt_path=ckpt_path, val_check_interval=2, limit_val_batches=2,
        log_every_n_steps=1, logger=[logger, recorder], enable_checkpointing=True, plugins=[VerifiedCheckpointIO()])
    return recorder.rows


@pytest.mark.parametrize("make_logger", [lambda d: CSVLogger(d, name="run"), lambda d: TensorBoardLogger(d, name="run")],
                         ids=["csv", "tensorboard"])
def test_metrics_of_an_action_at_a_validation_end_survive_a_resume_at_that_checkpoint(tmp_path, make_logger):
    reference = halving_rows(tmp_path / "reference", 6, make_logger(tmp_path / "reference"))
    assert [value for _, name, value in reference if name == "halve/step"] == [4.0], reference  # the plateau at step 4
    # stopped right after the validation of step 4 (its checkpoint holds the action's unlogged metrics), resumed
    first = halving_rows(tmp_path / "interrupted", 4, make_logger(tmp_path / "interrupted"))
    resumed = halving_rows(tmp_path / "interrupted", 6, make_logger(tmp_path / "interrupted"),
                  ckpt_path=str(tmp_path / "interrupted" / "ckpt" / "last.ckpt"))
    assert first + resumed == reference


def test_metrics_a_checkpoint_holds_unlogged_are_logged_once_at_the_resumed_start(tmp_path):
    halving_rows(tmp_path, 2, CSVLogger(tmp_path, name="run"))
    path, io = tmp_path / "ckpt" / "last.ckpt", VerifiedCheckpointIO()
    checkpoint = io.load_checkpoint(path)
    checkpoint["callbacks"][HalveOnPlateau().state_key]["pending_logs"] = {"halve/norm": 7.0}
    io.save_checkpoint(checkpoint, path)
    resumed = halving_rows(tmp_path, 3, CSVLogger(tmp_path, name="run"), ckpt_path=str(path))
    assert resumed == [(2, "halve/norm", 7.0)]
