"""The stream report's numbers equal direct computations on hand-made runs (no training)."""
import math
import random
from pathlib import Path

import numpy as np
import pytest

from plasticity_callbacks.app.report.streams import (StreamRun, accuracy_slope, cell, ranking_table, run_summary,
                                                    sensitivity_table)


def made_run(method: str, seed: int, accuracies: list[float], online: list[float], label: str | None = None):
    tasks = [{"task": t, "accuracy": a, "online_accuracy": o, "online_loss": 1 - o, "retained_accuracy": a / 2,
              "probe_accuracy": math.nan if t % 2 else a / 3} for t, (a, o) in enumerate(zip(accuracies, online))]
    return StreamRun(Path("."), label or method, seed, {"method": method, "seconds": 1.0}, tasks)


def test_slope_is_the_least_squares_fit():
    values = [random.random() for _ in range(37)]
    assert accuracy_slope(values) == pytest.approx(np.polyfit(range(37), values, 1)[0])
    assert math.isnan(accuracy_slope([0.5]))


def test_run_summary_is_the_mean_over_all_and_over_the_last_tasks():
    acc, online = [random.random() for _ in range(8)], [random.random() for _ in range(8)]
    summary = run_summary(made_run("m", 0, acc, online), k=3)
    assert summary["online_accuracy"] == pytest.approx(np.mean(online))
    assert summary["accuracy"] == pytest.approx(np.mean(acc[-3:]))
    assert summary["retained_accuracy"] == pytest.approx(np.mean(acc[-3:]) / 2)
    assert summary["probe_accuracy"] == pytest.approx(np.mean([acc[6] / 3]))  # only the probed task 6 of 5, 6, 7
    assert summary["slope"] == pytest.approx(100 * np.polyfit(range(8), acc, 1)[0])


def test_ranking_orders_by_late_end_of_task_accuracy_and_one_seed_shows_no_spread():
    # "early" leads on online accuracy over all tasks, "late" on end-of-task accuracy over the last tasks
    runs = [made_run("early", 0, [0.9, 0.9, 0.2, 0.2], [0.9] * 4), made_run("late", 0, [0.2, 0.2, 0.8, 0.9], [0.2] * 4),
            made_run("late", 1, [0.2, 0.2, 0.6, 0.7], [0.3] * 4)]
    rows = [line.split(" | ") for line in ranking_table(runs, k=2).splitlines()[2:]]
    assert [(r[0], r[1], r[2]) for r in rows] == [("| 1", "late", "2"), ("| 2", "early", "1")]
    assert rows[0][3] == "0.750 ± 0.141" and rows[1][3] == "0.200"
    assert rows[0][5] == "0.250 ± 0.071" and rows[1][5] == "0.900"  # online accuracy beside it
    assert cell([0.25], 3) == "0.250" and cell([math.nan], 3) == "—"


def test_sensitivity_gives_each_methods_best_setting_and_spread():
    runs = [made_run("sp", 0, [0.1, 0.1, a, a], [1 - a] * 4, label=f"sp shrink={a}") for a in (0.3, 0.6, 0.4)]
    [row] = sensitivity_table(runs, k=2).splitlines()[2:]
    assert row == "| sp | 3 | sp shrink=0.6 | 0.600 | sp shrink=0.3 | 0.300 |"
