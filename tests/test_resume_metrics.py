"""A resume keeps every metric row: what a method logged between the last checkpoint and the
interruption is logged again (at the same step), never lost and never twice.

A method acting at a validation end (a plateau) can only log at the next training batch; the
checkpoint saved after that validation must carry those metrics (``PlasticityCallback``'s
``pending_logs``), or the resumed run never logs them.
"""
from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from plasticity_callbacks.callbacks.base import PlasticityCallback
from plasticity_callbacks.core.checkpoints import ModelCheckpointAfterValidation, VerifiedCheckpointIO
from plasticity_callbacks.core.schedule import Schedule

from tiny import TinyMLPModule, cpu_trainer, regression_loader


class HalveOnPlateau(PlasticityCallback):
    """Halves every weight at a plateau of val/loss (min_delta is huge: the second validation); logs the new norm."""

    default_schedule = Schedule(monitor="val/loss", patience=1, min_delta=100.0)

    def act(self, trainer, pl_module, reason):
        with torch.no_grad():
            for p in pl_module.parameters():
                p.mul_(0.5)
        return {"halve/norm": float(sum(p.norm() for p in pl_module.parameters())),
                "halve/step": float(trainer.global_step)}


class Recorder(L.Callback):
    """Every value of ``halve/*`` as it reaches the loggers: ``[(step, name, value)]``."""

    def __init__(self):
        self.rows = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self.rows += [(trainer.global_step, k, float(v)) for k, v in trainer.logged_metrics.items()
                      if k.startswith("halve/") and not any(r[1] == k and r[2] == float(v) for r in self.rows)]


def fit(tmp_path, max_steps, logger, ckpt_path=None):
    recorder = Recorder()
    checkpoint = ModelCheckpointAfterValidation(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_last=True,
                                                save_top_k=0)
    L.seed_everything(0)
    trainer = cpu_trainer(max_steps=max_steps, val_check_interval=2, limit_val_batches=2, log_every_n_steps=1,
                          callbacks=[HalveOnPlateau(), recorder, checkpoint], logger=logger,
                          enable_checkpointing=True, plugins=[VerifiedCheckpointIO()])
    trainer.fit(TinyMLPModule(), regression_loader(), regression_loader(seed=1), ckpt_path=ckpt_path)
    return recorder.rows


@pytest.mark.parametrize("make_logger", [lambda d: CSVLogger(d, name="run"), lambda d: TensorBoardLogger(d, name="run")],
                         ids=["csv", "tensorboard"])
def test_metrics_of_an_action_at_a_validation_end_survive_a_resume_at_that_checkpoint(tmp_path, make_logger):
    reference = fit(tmp_path / "reference", 6, make_logger(tmp_path / "reference"))
    assert [value for _, name, value in reference if name == "halve/step"] == [4.0], reference  # the plateau at step 4
    # stopped right after the validation of step 4 (its checkpoint holds the action's unlogged metrics), resumed
    first = fit(tmp_path / "interrupted", 4, make_logger(tmp_path / "interrupted"))
    resumed = fit(tmp_path / "interrupted", 6, make_logger(tmp_path / "interrupted"),
                  ckpt_path=str(tmp_path / "interrupted" / "ckpt" / "last.ckpt"))
    assert first + resumed == reference
