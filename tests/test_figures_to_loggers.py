"""Figures leave the package through ``core.figures.save_figure``: a PNG in the run's folder and the logger's
dashboard (TensorBoard here; MLflow and W&B where installed), never into the current directory unasked."""
from __future__ import annotations

import lightning as L
import pytest
import torch

from plasticity_callbacks.core.figures import new_figure, save_figure

from tiny import TinyMLPModule, regression_loader


def drawn():
    fig = new_figure(figsize=(3, 2))
    fig.subplots().plot([3.0, 1.0, 2.0])
    return fig


def test_a_trainer_without_logger_writes_nothing_into_the_current_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    trainer = L.Trainer(logger=False, enable_checkpointing=False)  # default_root_dir: the current directory
    with pytest.warns(UserWarning, match="default_root_dir"):
        assert save_figure(drawn(), trainer, "curve") is None
    assert list(tmp_path.iterdir()) == []
    elsewhere = tmp_path / "run"
    trainer = L.Trainer(logger=False, enable_checkpointing=False, default_root_dir=elsewhere)
    assert save_figure(drawn(), trainer, "curve") == elsewhere / "figures" / "curve.png"


def test_tensorboard_receives_the_figure(tmp_path):
    pytest.importorskip("tensorboard")
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = TensorBoardLogger(tmp_path, name="tb")
    trainer = L.Trainer(logger=logger, max_steps=1, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(TinyMLPModule(), regression_loader())
    path = save_figure(drawn(), trainer, "curve")
    assert path.is_file() and path.parent == tmp_path / "tb" / "version_0" / "figures"
    logger.experiment.flush()
    events = EventAccumulator(str(tmp_path / "tb" / "version_0"), size_guidance={"images": 0})
    events.Reload()
    assert "figures/curve" in events.Tags()["images"]
    image = events.Images("figures/curve")[0]
    assert image.step == 1 and image.width > 100
