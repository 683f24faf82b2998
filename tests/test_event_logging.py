"""Every action of a plasticity method is one row in the logs, at the step it acted, whatever ``log_every_n_steps``;
``trainer.callback_metrics`` keeps its latest values (for monitors and summaries)."""
from __future__ import annotations

import lightning as L
import pytest
from lightning.pytorch.loggers import CSVLogger

from plasticity_callbacks.callbacks.adaptive_svd import AdaptiveSVDSwitch
from plasticity_callbacks.callbacks.dash import DASHShrink
from plasticity_callbacks.callbacks.fire import FIREReinit
from plasticity_callbacks.callbacks.redo import ReDoMonitor
from plasticity_callbacks.callbacks.shrink_perturb import ShrinkPerturb
from plasticity_callbacks.callbacks.schedule import Schedule

from helpers import fit, metric_rows
from tiny import TinyMLPModule, regression_loader

ACTION_STEP = 3  # not a multiple of log_every_n_steps=4

METHODS = {
    "fire": lambda: FIREReinit(schedule=Schedule(steps=[ACTION_STEP])),
    "shrink_perturb": lambda: ShrinkPerturb(schedule=Schedule(steps=[ACTION_STEP])),
    "redo/recycled": lambda: ReDoMonitor(tau=0.5, collect_every_n_steps=1, schedule=Schedule(steps=[ACTION_STEP])),
    "dash": lambda: DASHShrink(schedule=Schedule(steps=[ACTION_STEP])),
    "adaptive_svd": lambda: AdaptiveSVDSwitch(schedule=Schedule(steps=[ACTION_STEP]), r_min=2, save_figure=False),
}


def logged_rows(tmp_path, callback) -> tuple[list[dict[str, str]], L.Trainer]:
    """The CSV rows of 8 steps with ``callback`` (every column: a timing is a metric too), and the trainer."""
    L.seed_everything(0)
    trainer = fit(TinyMLPModule(), callback, steps=8, data=regression_loader(), log_every_n_steps=4,
                  logger=CSVLogger(tmp_path, name="run", version=0))
    return metric_rows(tmp_path / "run" / "version_0" / "metrics.csv", volatile=()), trainer


@pytest.mark.parametrize("prefix", list(METHODS))
def test_an_action_is_one_row_at_its_step_and_stays_in_callback_metrics(tmp_path, prefix):
    rows, trainer = logged_rows(tmp_path, METHODS[prefix]())
    names = sorted({k for row in rows for k, v in row.items() if k.startswith(prefix) and v != ""})
    assert names, f"no {prefix}* metric reached the CSV: {rows}"
    for name in names:
        logged = [(int(row["step"]), float(row[name])) for row in rows if row[name] != ""]
        assert [step for step, _ in logged] == [ACTION_STEP], (name, logged)
        assert float(trainer.callback_metrics[name]) == pytest.approx(logged[0][1]), name
    assert any(row["train/loss"] != "" for row in rows)  # the per-step series still goes through Lightning


def test_an_action_at_fit_start_is_one_row_at_step_0(tmp_path):
    rows, trainer = logged_rows(tmp_path, FIREReinit())
    logged = [(int(row["step"]), row["fire/dfi_before"]) for row in rows if row["fire/dfi_before"] != ""]
    assert [step for step, _ in logged] == [0], logged
    assert float(trainer.callback_metrics["fire/dfi_before"]) == pytest.approx(float(logged[0][1]))

