"""Logger factories for ``configs/logger/{wandb,mlflow}.yaml``: every run and phase keeps its own local store.

The pipeline creates one logger per phase with ``version=<phase name>``; Lightning's CSV and
TensorBoard loggers take that as a folder name, W&B would take it as the run id (the same id in
every run of a sweep, merged on ``wandb sync``) and MLflow does not accept it. These factories
make it the run's display name instead and pass everything else through.

Example:
    >>> logger = mlflow_logger(tracking_uri="file:outputs/run/mlruns", experiment_name="plasticity", version="sft")
"""
from __future__ import annotations

from ..extras import require_module


def wandb_logger(version: str | None = None, **kwargs):
    """A Lightning ``WandbLogger`` whose run is named ``version`` (its id stays unique); needs the ``[wandb]`` extra.

    Args:
        version: the phase's name (the pipeline's), shown as the run's name; None: W&B's default.
        **kwargs: ``WandbLogger``'s arguments (``save_dir``, ``project``, ``offline``, ...).
    """
    require_module("wandb", "wandb", "logger=wandb")
    from lightning.pytorch.loggers import WandbLogger

    if version is not None:
        kwargs.setdefault("name", version)
    return WandbLogger(**kwargs)


def mlflow_logger(version: str | None = None, **kwargs):
    """A Lightning ``MLFlowLogger`` whose run is named ``version``; needs the ``[mlflow]`` extra.

    Args:
        version: the phase's name (the pipeline's), the MLflow run's name; None: MLflow's default.
        **kwargs: ``MLFlowLogger``'s arguments (``tracking_uri``, ``experiment_name``, ``save_dir``, ...).
    """
    require_module("mlflow", "mlflow", "logger=mlflow")
    from lightning.pytorch.loggers import MLFlowLogger

    if version is not None:
        kwargs.setdefault("run_name", version)
    return MLFlowLogger(**kwargs)
