"""A resumed fit keeps every metric row logged before its checkpoint, once: CSV rows and TensorBoard events.

A run killed after its checkpoint at step ``N`` has logged more than the checkpoint holds: the steps
trained since (the resumed fit trains and logs them again) and, at step ``N`` itself, rows written
before the checkpoint (an action at the end of step ``N``'s batch) and after it (a validation end's
deferred row, which the resumed fit writes from the checkpoint's state). The step number alone
cannot tell these apart, so :class:`LogPosition` records in every checkpoint how far each log file
had been written, and :func:`restore_logs` keeps, before the resumed fit starts, what one rule says:

    a row (or event) is kept when it was written before the checkpoint, or its step is below ``N``

(the second part keeps the training row of step ``N - 1``, which Lightning writes right after a
checkpoint saved at the end of that batch). Everything else is logged again by the resumed fit.

Lightning's ``CSVLogger`` deletes ``metrics.csv`` when a fit reopens its folder, so the kept rows are
logged again through the logger before the fit starts (a second interruption loses nothing either);
TensorBoard's event files are rewritten without the dropped events, and the resumed fit adds its own.

Example:
    >>> trainer = L.Trainer(callbacks=[LogPosition(), ...], logger=logger)    # every run
    >>> restore_logs(logger, read_checkpoint(path, mmap=True))               # a resume, before fit
    >>> trainer.fit(module, datamodule, ckpt_path=path)
"""
from __future__ import annotations

import csv
import os
import warnings
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn

POSITION_KEY = "log_position"  # in the checkpoint: {file name in the logger's folder: rows or bytes written}
METRICS_FILE = "metrics.csv"
EVENT_FILES = "events.out.tfevents.*"


def kept(written_before_checkpoint: bool, step: int, resumed_at: int) -> bool:
    """The one rule: keep what the checkpoint had seen written, and every step before its own."""
    return written_before_checkpoint or step < resumed_at


class LogPosition(L.Callback):
    """Records in every checkpoint how many rows ``metrics.csv`` held and how many bytes each TensorBoard
    event file held (after flushing both), under ``checkpoint["log_position"]``; :func:`restore_logs`
    reads it on resume. Rank zero writes the logs and measures them; every rank puts the same record in
    its checkpoint (a sharded checkpoint is written by all of them).

    Example:
        >>> trainer = L.Trainer(callbacks=[LogPosition(), ModelCheckpoint(...)], logger=CSVLogger("runs"))
    """

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        position = log_position(trainer.loggers) if trainer.is_global_zero else None
        checkpoint[POSITION_KEY] = trainer.strategy.broadcast(position, src=0)


def log_position(loggers) -> dict[str, int]:
    """``{"metrics.csv": rows, "events.out.tfevents...": bytes}`` of the CSV and TensorBoard loggers."""
    position = {}
    for logger in loggers:
        folder = log_folder(logger)
        if folder is None:
            continue
        if isinstance(logger, TensorBoardLogger):
            logger.experiment.flush()
            position.update({path.name: path.stat().st_size for path in sorted(folder.glob(EVENT_FILES))})
        else:
            logger.save()
            if (folder / METRICS_FILE).is_file():
                with (folder / METRICS_FILE).open(newline="") as f:
                    position[METRICS_FILE] = max(sum(1 for _ in csv.reader(f)) - 1, 0)  # less the header
    return position


def log_folder(logger) -> Path | None:
    """The folder a CSV or TensorBoard logger writes to; None for any other logger (W&B, MLflow keep their own)."""
    if not isinstance(logger, (CSVLogger, TensorBoardLogger)):
        return None
    return Path(logger.log_dir)


def restore_logs(logger, checkpoint: dict[str, Any] | None) -> None:
    """Before a fit resumed from ``checkpoint``: keep in ``logger``'s folder what the rule keeps (see the module).
    Before a fit that starts afresh (``checkpoint=None``: a phase run again, or killed before its first
    checkpoint): keep nothing of the earlier attempt's logs there.

    Call it before ``trainer.fit`` and before the logger writes anything; it creates the CSV logger's file
    (Lightning empties it then) and logs the kept rows into it again, and rewrites TensorBoard's event
    files. Other loggers (W&B, MLflow) are left alone.

    Args:
        logger: the resumed fit's logger (the same folder as the interrupted fit's).
        checkpoint: the checkpoint it resumes from (``read_checkpoint(path, mmap=True)`` is enough), or None.
    """
    folder = log_folder(logger)
    if folder is None or rank_zero_only.rank != 0:
        return
    checkpoint = {"global_step": 0, POSITION_KEY: {}} if checkpoint is None else checkpoint
    resumed_at = int(checkpoint["global_step"])
    position = checkpoint.get(POSITION_KEY)
    if position is None:
        rank_zero_warn(f"the checkpoint records no log position (it was written without LogPosition): rows at "
                       f"step {resumed_at} logged just before it may be missing from {folder} after the resume")
        position = {}
    if isinstance(logger, TensorBoardLogger):
        for path in sorted(folder.glob(EVENT_FILES)):
            rewrite_events(path, position.get(path.name, 0), resumed_at)
        return
    rows = [row for index, row in enumerate(read_csv_rows(folder / METRICS_FILE))
            if row.get("step") and kept(index < position.get(METRICS_FILE, 0), int(row["step"]), resumed_at)]
    with warnings.catch_warnings():  # its warning that the old rows "will be deleted": they are logged again below
        warnings.filterwarnings("ignore", message="Experiment logs directory")
        logger.experiment  # noqa: B018 (creating the writer now: Lightning's CSVLogger deletes the old file here)
    for row in rows:  # through the writer: the names are written already (with the logger's prefix, if any)
        logger.experiment.log_metrics({name: number(value) for name, value in row.items() if value and name != "step"},
                                      step=int(row["step"]))
    logger.save()


def read_csv_rows(path: Path) -> list[dict[str, str]]:
    if not path.is_file():
        return []
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def number(text: str) -> int | float:
    """The value a CSV cell was written from: ``str(int)`` or ``str(float)``, which read back exactly."""
    try:
        return int(text)
    except ValueError:
        return float(text)


def rewrite_events(path: Path, written_before: int, resumed_at: int) -> None:
    """Rewrite one event file with the events the rule keeps (``written_before``: its size at the checkpoint)."""
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.summary.writer.record_writer import RecordWriter

    records, offset, dropped = [], 0, False
    for record in RawEventFileLoader(str(path)).Load():
        if kept(offset < written_before, Event.FromString(record).step, resumed_at):
            records.append(record)
        else:
            dropped = True
        offset += len(record) + 16  # a TFRecord frame: length (8 bytes) and two CRCs (4 each) around the data
    if not dropped and offset == path.stat().st_size:
        return  # nothing to drop and no torn record at the end: the file stays as it is
    pending = path.with_name(path.name + ".writing")
    with open(pending, "wb") as f:
        writer = RecordWriter(f)
        for record in records:
            writer.write(record)
        f.flush()
        os.fsync(f.fileno())
    pending.replace(path)
