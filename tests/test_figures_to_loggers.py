"""Figures leave the package through ``callbacks.figures.save_figure``: a PNG in the run's folder and the logger's
dashboard (TensorBoard here; MLflow and W&B where installed), never into the current directory unasked."""
from __future__ import annotations

import lightning as L
import pytest

from plasticity_callbacks.callbacks.figures import new_figure, save_figure

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


def test_the_report_reads_a_run_logged_with_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    from plasticity_callbacks.app.report.metric_logs import read_rows
    from plasticity_callbacks.app.report.runs import build_report

    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text("seed: 0\ncallbacks:\n  fire: {}\n")
    writer = SummaryWriter(run / "tensorboard")  # where configs/logger/tensorboard.yaml writes a single fit
    for step, (val, dormant) in enumerate([(5.5, 0.1), (4.25, 0.2), (3.125, 0.3)]):
        writer.add_scalar("val/loss", val, step)
        writer.add_scalar("redo/dormant", dormant, step)
    writer.close()
    assert [r["step"] for r in read_rows(run, None)] == [0, 1, 2]
    text, figures = build_report(tmp_path)
    assert "| 1 | 3.1250 | 0.3000 |" in text  # one seed: the last step's values alone, no "± 0.0000"
    assert (tmp_path / "report" / "loss_curves.png") in figures


class _TrainerView:
    """What save_figure reads from a trainer: rank, step, loggers, root dir."""

    def __init__(self, logger, root):
        self.global_rank, self.global_step, self.logger, self.loggers = 0, 3, logger, [logger]
        self.default_root_dir = str(root)


def test_mlflow_receives_the_figure(tmp_path):
    pytest.importorskip("mlflow")
    from plasticity_callbacks.app.loggers import mlflow_logger

    logger = mlflow_logger(version="sft", tracking_uri=f"sqlite:///{tmp_path}/mlflow.db",
                           artifact_location=str(tmp_path / "artifacts"), experiment_name="test")
    save_figure(drawn(), _TrainerView(logger, tmp_path / "run"), "curve")
    run = logger.experiment.get_run(logger.run_id)
    assert run.info.run_name == "sft"
    assert [a.path for a in logger.experiment.list_artifacts(logger.run_id, "figures")] == ["figures/curve.png"]


def test_wandb_offline_receives_the_figure(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    from plasticity_callbacks.app.loggers import wandb_logger

    logger = wandb_logger(version="sft", save_dir=str(tmp_path), offline=True, project="test")
    save_figure(drawn(), _TrainerView(logger, tmp_path / "run"), "curve")
    logger.experiment.finish()
    images = list(tmp_path.glob("wandb/offline-run-*/files/media/images/figures/curve_*.png"))
    assert len(images) == 1
