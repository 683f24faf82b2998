"""What ``plasticity-train`` prints, and where it is kept.

Lightning logs through its own ``lightning.pytorch`` / ``lightning.fabric`` loggers, which stop at
a private stderr handler when Lightning is imported before logging is configured, as it is here
(Hydra configures logging when the job starts). :func:`configure_run_output` hands those
messages (``rank_zero_info`` from our pipeline, callbacks and data modules included) to the
handlers Hydra set up: the console and the run directory's ``train.log``. It also shows each of
Lightning's own notices once per process (tips, accelerator lines, ``weights_only``), where a
multi-phase run would repeat them in every phase, and hides a deprecation warning that Lightning
raises on current PyTorch and that no user setting can avoid.

Example:
    >>> configure_run_output()   # first thing in the Hydra job
    >>> rank_zero_info("phase 1/2 'pretrain'")   # console and train.log
"""
from __future__ import annotations

import logging
import warnings
from pathlib import Path

from hydra.experimental.callback import Callback

LIGHTNING_LOGGERS = ("lightning", "lightning.pytorch", "lightning.fabric")
# Lightning's own code raises it on torch >= 2.10; nothing in a config changes it.
FOREIGN_DEPRECATIONS = (r".*isinstance\(treespec, LeafSpec\)` is deprecated.*",)


class LightningNoticesOnce(logging.Filter):
    """Drops a message that Lightning's own code logged before (in an earlier phase or sweep job).

    One instance per handler, sharing one record of first sightings: the same record reaches
    the console and ``train.log``, a repeat is a later record with the same text.
    """

    first_seen: dict[str, float] = {}  # message -> creation time of the record that first carried it

    def __init__(self) -> None:
        super().__init__()
        import lightning

        self.package = str(Path(lightning.__file__).resolve().parent)

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.pathname.startswith(self.package):
            return True  # ours (rank_zero_info points at its caller): always shown
        first = self.first_seen.setdefault(record.getMessage(), record.created)
        return first == record.created


def configure_run_output() -> None:
    """Route Lightning's logging to the root handlers (console + ``train.log``), once per notice;
    Python warnings go to the same handlers."""
    root = logging.getLogger()
    if not root.handlers:  # not under Hydra (a notebook, a test): leave Lightning's own handler
        return
    for name in LIGHTNING_LOGGERS:
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            if type(handler) is logging.StreamHandler:  # the one Lightning added at import
                logger.removeHandler(handler)
        logger.propagate = True
    for handler in root.handlers:  # one filter per handler: each shows every notice once
        if not any(isinstance(f, LightningNoticesOnce) for f in handler.filters):
            handler.addFilter(LightningNoticesOnce())
    for pattern in FOREIGN_DEPRECATIONS:
        warnings.filterwarnings("ignore", message=pattern)
    logging.captureWarnings(True)


class SweepOutputs(Callback):
    """Hydra callback: when a ``-m`` sweep ends, print where its runs are and the command that
    summarizes them (``plasticity-report``). Hydra builds it from ``hydra.callbacks.outputs``."""

    def on_multirun_end(self, config, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir).absolute()
        logging.getLogger(__name__).info(
            f"sweep outputs: {sweep_dir} (one folder per run: train.log, logs/, checkpoints/, report/)\n"
            f"compare the runs: plasticity-report {sweep_dir}")
