"""What many test files do the same way: fit a module for a few steps, read a run's metric rows, compose the
pipeline's config. One definition each, so that a change (a trainer setting, a column that differs run to run)
reaches every test at once.

    trainer = fit(TinyMLPModule(), [FIREReinit()], steps=2)            # a quiet CPU fit
    rows = metric_rows(run_dir)                                        # run_dir/logs/metrics.csv, timings left out
    cfg = compose_pipeline(tmp_path / "run", "+method=warm")           # experiment=pipeline_smoke
"""
from __future__ import annotations

import csv
from collections.abc import Iterable
from pathlib import Path

import lightning as L
from tiny import cpu_trainer

# wall-clock measurements (a callback's seconds, tokens per second) differ run to run; every other column must not
VOLATILE = ("seconds", "per_sec")


def fit(module: L.LightningModule, callbacks: L.Callback | Iterable[L.Callback] = (), steps: int = 1, data=None,
        val_data=None, ckpt_path=None, **trainer_kwargs) -> L.Trainer:
    """Fit ``module`` for ``steps`` optimizer steps with ``callbacks`` (one or several) on a quiet single-process
    CPU trainer (:func:`tiny.cpu_trainer`: no logger, checkpoints, progress bar or sanity validation unless
    ``trainer_kwargs`` say otherwise) and return the trainer.

    Args:
        data: a train dataloader or a datamodule; None: the module's own.
        val_data: a validation dataloader (with a train dataloader).
        ckpt_path: a checkpoint to resume from.
    """
    callbacks = [callbacks] if isinstance(callbacks, L.Callback) else list(callbacks)
    trainer = cpu_trainer(max_steps=steps, callbacks=callbacks, **trainer_kwargs)
    if isinstance(data, L.LightningDataModule):
        trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    else:
        trainer.fit(module, data, val_data, ckpt_path=ckpt_path)
    return trainer


def metric_rows(path: Path, volatile: tuple[str, ...] = VOLATILE) -> list[dict[str, str]]:
    """The rows of a CSV metrics file (``path``, or a run directory's ``logs/metrics.csv``), without the columns
    whose names contain a word of ``volatile``."""
    path = Path(path)
    if path.is_dir():
        path = path / "logs" / "metrics.csv"
    with open(path, newline="") as f:
        return [{k: v for k, v in row.items() if not any(word in k for word in volatile)} for row in csv.DictReader(f)]


def compose_pipeline(run_dir, *overrides: str):
    """The two-phase smoke pipeline's config (``experiment=pipeline_smoke``) with ``overrides``, writing to
    ``run_dir``."""
    from hydra_app import compose_config

    return compose_config("experiment=pipeline_smoke", *overrides, output_dir=run_dir)
