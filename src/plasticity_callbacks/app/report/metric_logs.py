"""A run's logged metrics as rows, whichever logger wrote them: CSV (``metrics.csv``) or TensorBoard (event files).

``configs/logger/csv.yaml`` writes ``<run>/logs[/<phase>]/metrics.csv``; ``tensorboard.yaml`` writes
``<run>/tensorboard[/<phase>]/events.out.tfevents.*``; a plain Lightning run writes either straight into its
version folder (``lightning_logs/version_0``); ``mlflow.yaml`` keeps a SQLite store ``<run>/mlflow.db`` (one
MLflow run per phase, named after it), read here with ``sqlite3``. The report reads each through
:func:`read_rows`. W&B keeps its history in its own binary format: not read.

Example:
    >>> rows = read_rows(Path("outputs/2026-01-01/12-00-00"), "sft")   # [{"step": 0, "val/loss": 5.5}, ...]
"""
from __future__ import annotations

import contextlib
import csv
from collections import defaultdict
from pathlib import Path

# Where a run's logger writes, under the run dir: plasticity-train's CSV and TensorBoard folders, then the
# run dir itself (a plain Lightning run: lightning_logs/version_0/metrics.csv or its event files).
LOG_FOLDERS = ("logs", "tensorboard", "")
MLFLOW_STORE = "mlflow.db"  # configs/logger/mlflow.yaml: a SQLite tracking store in the run dir


class RunFolderError(ValueError):
    """A file of a run folder the report cannot read as the package writes it: one line naming it."""


@contextlib.contextmanager
def reading(path: Path, what: str):
    """Inside, a file of a run folder that is not what the package writes (not JSON, a list for a dict, a word
    for a number, a missing column) is one :class:`RunFolderError` naming ``path``, not a traceback from deep in
    the report: a run folder is data, possibly damaged or written by something else.

    Example:
        >>> with reading(run_dir / "pipeline.json", "a pipeline state"):
        ...     state = json.loads((run_dir / "pipeline.json").read_text())
    """
    import yaml

    try:
        yield
    except RunFolderError:
        raise
    except (ValueError, KeyError, TypeError, IndexError, AttributeError, csv.Error, yaml.YAMLError) as err:
        detail = str(err).strip().splitlines()[0][:120] if str(err).strip() else ""
        raise RunFolderError(f"{path} is not {what} as plasticity-train writes it ({type(err).__name__}: {detail}); "
                             "remove it from the folder or restore it") from None


def holds_metrics(path: Path) -> bool:
    """Whether ``path`` itself holds a CSV or TensorBoard log."""
    return (path / "metrics.csv").is_file() or any(path.glob("events.out.tfevents.*"))


def log_dir(run_dir: Path, phase: str | None) -> Path | None:
    """The folder holding ``phase``'s metrics (a single fit: ``phase=None``), CSV first, or None."""
    for folder in LOG_FOLDERS:
        path = run_dir / folder / phase if phase else run_dir / folder
        if holds_metrics(path):
            return path
    return None


def has_metrics(run_dir: Path) -> bool:
    """Whether a single fit's metrics (CSV, TensorBoard or MLflow's store) are in ``run_dir``."""
    return log_dir(run_dir, None) is not None or (run_dir / MLFLOW_STORE).is_file()


def read_rows(run_dir: Path, phase: str | None) -> list[dict[str, float]]:
    """Rows ``{"step": step, metric: value, ...}`` in step order; empty when nothing was logged."""
    path = log_dir(run_dir, phase)
    if path is None:
        return _mlflow_rows(run_dir / MLFLOW_STORE, phase) if (run_dir / MLFLOW_STORE).is_file() else []
    if (path / "metrics.csv").is_file():
        with (path / "metrics.csv").open(newline="") as f:
            return [{"step": int(row["step"]), **{k: float(v) for k, v in row.items() if v and k not in ("step",)}}
                    for row in csv.DictReader(f)]
    return _tensorboard_rows(path)


def _tensorboard_rows(path: Path) -> list[dict[str, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    import logging

    quiet = logging.getLogger("tensorboard")  # its directory watcher reports every file it opens at INFO
    level, quiet.level = quiet.level, logging.WARNING
    try:
        events = EventAccumulator(str(path), size_guidance={"scalars": 0})  # 0: keep every point
        events.Reload()
    finally:
        quiet.setLevel(level)
    by_step: dict[int, dict[str, float]] = defaultdict(dict)
    for tag in events.Tags()["scalars"]:
        for event in events.Scalars(tag):
            by_step[event.step][tag] = event.value
    return [{"step": step, **values} for step, values in sorted(by_step.items())]


def _mlflow_rows(store: Path, phase: str | None) -> list[dict[str, float]]:
    """The rows of MLflow's SQLite store, read with ``sqlite3`` (no ``mlflow`` needed): every active run named
    ``phase`` (the pipeline names each phase's run; a resumed phase adds a run of the same name), or every
    active run for a single fit; a metric logged twice at a step keeps its latest value."""
    import contextlib
    import sqlite3

    with contextlib.closing(sqlite3.connect(f"file:{store}?mode=ro", uri=True)) as db:
        runs = [uuid for uuid, name in db.execute(
            "SELECT run_uuid, name FROM runs WHERE lifecycle_stage = 'active' ORDER BY start_time")
            if phase is None or name == phase]
        marks = ",".join("?" * len(runs))
        points = db.execute(f"SELECT step, key, value, is_nan FROM metrics WHERE run_uuid IN ({marks}) "
                            "ORDER BY timestamp", runs).fetchall() if runs else []
    by_step: dict[int, dict[str, float]] = defaultdict(dict)
    for step, key, value, is_nan in points:
        by_step[int(step)][key] = float("nan") if is_nan else float(value)
    return [{"step": step, **values} for step, values in sorted(by_step.items())]
