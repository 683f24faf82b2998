"""The stream report's numbers equal direct computations on hand-made runs (no training)."""
import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import yaml

from plasticity_callbacks.app.report.streams import (StreamRun, accuracy_slope, cell, find_stream_runs, ranking_table,
                                                    run_summary, sensitivity_table, shared_chance, stream_figure)
from plasticity_callbacks.data.digits import PermutedDigits, RandomLabelDigits
from plasticity_callbacks.data.lm_stream import LMTaskStream


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
    header, _, *lines = ranking_table(runs, k=2).splitlines()
    assert "| acc slope ×100 (per task, fit over the stream) |" in header  # the ranking's name, not "change per 100"
    rows = [line.split(" | ") for line in lines]
    assert [(r[0], r[1], r[2]) for r in rows] == [("| 1", "late", "2"), ("| 2", "early", "1")]
    assert rows[0][3] == "0.750 ± 0.141" and rows[1][3] == "0.200"
    assert rows[0][5] == "0.250 ± 0.071" and rows[1][5] == "0.900"  # online accuracy beside it
    assert cell([0.25], 3) == "0.250" and cell([math.nan], 3) == "—"


def test_sensitivity_gives_each_methods_best_setting_and_spread():
    runs = [made_run("sp", 0, [0.1, 0.1, a, a], [1 - a] * 4, label=f"sp shrink={a}") for a in (0.3, 0.6, 0.4)]
    [row] = sensitivity_table(runs, k=2).splitlines()[2:]
    assert row == "| sp | 3 | sp shrink=0.6 | 0.600 | sp shrink=0.3 | 0.300 |"


COLUMNS = "task,step,accuracy,loss,online_accuracy,online_loss,retained_accuracy,probe_accuracy,dormant,dead," \
          "feature_rank,stable_rank,weight_norm,grad_norm"


def written_run(folder: Path, data: dict | None, info: dict) -> Path:
    """A run folder as ``plasticity-train`` leaves it: ``logs/stream.json``, ``logs/tasks.csv`` and, where
    ``data`` is given, the stored config ``.hydra/config.yaml`` with that ``data:`` block."""
    (folder / "logs").mkdir(parents=True)
    (folder / "logs" / "stream.json").write_text(json.dumps({"method": "warm", "seed": 0, "stream": "s",
                                                             "num_tasks": 2, "steps_per_task": 1, **info}))
    rows = [f"{t},{t + 1},0.5,1.0,0.5,1.0,,,0,0,1,1,1,1" for t in range(2)]
    (folder / "logs" / "tasks.csv").write_text("\n".join([COLUMNS, *rows]) + "\n")
    if data is not None:
        (folder / ".hydra").mkdir()
        (folder / ".hydra" / "config.yaml").write_text(yaml.safe_dump({"seed": 3, "data": data}))
    return folder


LM = "plasticity_callbacks.data.lm_stream.LMTaskStream"
DIGITS = "plasticity_callbacks.data.digits.RandomLabelDigits"


@pytest.mark.parametrize("data, info, chance", [
    ({"_target_": DIGITS, "seed": "${seed}"}, {}, 1 / 10),  # a run from before stream.json held it: the config
    ({"_target_": LM, "design": "random_last_byte", "seed": "${seed}"}, {}, 1 / 256),
    ({"_target_": LM, "design": "permuted_vocab", "seed": "${seed}"}, {}, None),  # next-byte prediction: none
    (None, {"chance": 1 / 256}, 1 / 256),  # stream.json's own level first
    (None, {"chance": None}, None),
    (None, {}, None),  # nothing tells: no line
])
def test_each_stream_draws_its_own_chance_level(tmp_path, data, info, chance):
    written_run(tmp_path / "run", data, info)
    [run] = find_stream_runs(tmp_path)
    assert run.chance == chance and shared_chance([run]) == chance
    fig = stream_figure([run])
    dotted = {float(line.get_ydata()[0]) for ax in fig.axes for line in ax.get_lines() if line.get_linestyle() == ":"}
    assert dotted == (set() if chance is None else {chance, 1 - chance})
    assert ("dotted: chance" in fig._suptitle.get_text()) == (chance is not None)


def test_runs_of_streams_with_different_chance_levels_draw_none(tmp_path):
    written_run(tmp_path / "digits", {"_target_": DIGITS}, {})
    written_run(tmp_path / "lm", None, {"chance": 1 / 256})
    assert shared_chance(find_stream_runs(tmp_path)) is None


def test_the_streams_record_their_chance_level():
    assert RandomLabelDigits().chance == PermutedDigits().chance == 1 / 10
    assert LMTaskStream().chance == 1 / 256
    assert LMTaskStream(design="permuted_vocab").chance is None


@pytest.mark.parametrize("data", [
    {"_target_": "planted_stream.Stream"},                                          # not this package's
    {"_target_": DIGITS, "seed": {"_target_": "planted_stream.Stream"}},           # ours, naming another below
    {"_target_": DIGITS, "seed": [{"_target_": "planted_stream.Stream"}]},
])
def test_a_run_folders_stream_config_never_runs_code_it_names(tmp_path, monkeypatch, data):
    """The chance level's fallback builds a stream from the run's stored config: only this package's, with no
    ``_target_`` below it; a module planted beside the report (first on ``sys.path``) never runs."""
    import sys

    (tmp_path / "planted_stream.py").write_text(
        "import pathlib\npathlib.Path(__file__).with_name('ran').write_text('code ran')\n"
        "class Stream:\n    chance = 0.5\n    def __init__(self, **kwargs): pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    written_run(tmp_path / "run", data, {})
    [run] = find_stream_runs(tmp_path)
    assert run.chance is None and not (tmp_path / "ran").exists() and "planted_stream" not in sys.modules
