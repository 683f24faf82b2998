"""benchmarks/ranking_checks.py: the runs each check plans (at the shipped selected settings, the spread's crossed
design), and its tables recomputed from hand-made per-task curves (no training)."""
import math
import random
import statistics
import sys
from pathlib import Path

import pytest

pytest.importorskip("sklearn")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import ranking_checks as checks  # noqa: E402
from plasticity_callbacks.app.benchmark.results import Results, RunResult  # noqa: E402


def rows_of(table: str) -> dict[str, list[str]]:
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()[2:] if line.startswith("|")]
    found: dict[str, list[str]] = {}
    for row in rows:  # the first table's row of each method (a table below may name it again)
        found.setdefault(row[0], row)
    return found


def test_arguments_default_per_check_and_bad_ones_are_refused(capsys):
    long = checks.parse_args(["long"])
    assert long.seeds == [0, 1, 2] and long.tasks == 100 and long.methods[0] == "reset"
    assert set(long.methods) == set(checks.LONG_METHODS)
    spread = checks.parse_args(["spread", "--methods", "fire_exact"])
    assert spread.seeds == [0, 1, 2, 3, 4] and spread.methods == ["reset", "fire_exact"]  # reset always runs
    for argv, words in ((["long", "--tasks", "40"], "at least 50"), (["fresh", "--jobs", "0"], "at least 1"),
                        (["spread", "--extra-seeds", "4", "5"], "overlap --seeds")):
        with pytest.raises(SystemExit):
            checks.parse_args(argv)
        assert words in capsys.readouterr().err


def test_each_check_runs_the_shipped_selected_settings_and_the_spread_crosses_seeds_and_splits():
    args = checks.parse_args(["spread", "--seeds", "0", "1", "--split-seeds", "0", "7", "--extra-seeds", "5",
                              "--methods", "fire_exact"])
    jobs, streams = checks.jobs_for("spread", args)
    cells = {(j.seed, j.stream.data_overrides) for j in jobs if j.method == "fire_exact"}
    # seed 0 on split 0 is a shipped run (split seed = seed, the default): read from the shipped file, not rerun
    assert cells == {(0, ("data.split_seed=7",)), (1, ("data.split_seed=0",)), (1, ("data.split_seed=7",)),
                     (5, ("data.split_seed=5",))}
    assert len(jobs) == 2 * 4 and {j.setting for j in jobs} == {"model.lr=0.003"}  # the sweep's choice
    assert {s.name for s in streams} == {"generalization_split0", "generalization_split5", "generalization_split7"}
    long_jobs, (stream,) = checks.jobs_for("long", checks.parse_args(["long", "--tasks", "60", "--methods", "sp"]))
    assert stream.num_tasks == 60 and stream.steps_per_task == 100 and stream.data == "digits_labels"
    assert {(j.method, j.setting) for j in long_jobs} == {("reset", "model.lr=0.003"),
                                                          ("sp", "callbacks.shrink_perturb.shrink=0.8")}
    fresh_jobs, streams = checks.jobs_for("fresh", checks.parse_args(["fresh", "--methods", "warm", "--steps", "7"]))
    assert [s.data for s in streams] == ["digits_fresh_labels", "digits_labels"]
    assert all(s.steps_per_task == 7 for s in streams) and len(fresh_jobs) == 2 * 2 * 3
    with pytest.raises(SystemExit, match="no selected setting"):
        checks.selected_settings("memorization", ["no_such_method"])


def test_the_long_table_reads_windows_peaks_and_trends_from_the_curves():
    tasks = 100
    rising = [[0.3 + 0.005 * t + random.uniform(-0.01, 0.01) for t in range(tasks)] for _ in range(3)]
    falling = [[0.9 - 0.004 * t + random.uniform(-0.01, 0.01) for t in range(tasks)] for _ in range(3)]
    peaked = [[min(t, 10) / 10 - 0.003 * max(0, t - 10) for t in range(tasks)] for _ in range(3)]
    saturating = [[1 - 0.7 * math.exp(-t / 10) + random.uniform(-0.01, 0.01) for t in range(tasks)] for _ in range(3)]
    runs = [RunResult("memorization_long", method, "model.lr=0.003", seed, curve, curve, 1.0)
            for method, curves in (("rising", rising), ("falling", falling), ("peaked", peaked),
                                   ("saturating", saturating))
            for seed, curve in enumerate(curves)]
    results = Results({"memorization_long": {"data": "digits_labels", "num_tasks": tasks, "steps_per_task": 100}},
                      [0, 1, 2], [], 0, runs=runs)
    rows = rows_of(checks.long_report(results))
    for name, curves in (("rising", rising), ("falling", falling)):
        for column, task in ((3, 20), (4, 50), (5, 100)):
            values = [statistics.fmean(c[task - 5:task]) for c in curves]
            assert rows[name][column] == f"{statistics.fmean(values):.3f} ± {statistics.stdev(values):.3f}"
    assert rows["rising"][-1] == "rising" and rows["falling"][-1] == "falling"
    assert rows["peaked"][6].startswith("15 (") and rows["peaked"][-1] == "falling"  # tasks 11-15 hold the peak
    # a curve that flattens: its first 20 tasks' slope overstates what it gains by task 100 many times over
    extrapolated, measured = (float(rows["saturating"][column].split()[0]) for column in (7, 8))
    assert extrapolated > 5 * measured > 0


def test_the_multiplicity_family_counts_each_comparison_once():
    text = checks.multiplicity_report()
    # 18 rows per stream: 17 against warm, 16 more against reset (reset vs warm is not counted twice)
    assert text.startswith("66 comparisons")
    assert "| generalization | fire_exact | reset | +0.014 [+0.009, +0.020] |" in text


def test_the_fresh_check_and_its_control_differ_only_in_whether_images_recur():
    from hydra.utils import instantiate

    from plasticity_callbacks.app.benchmark.runs import compose_run

    jobs, _ = checks.jobs_for("fresh", checks.parse_args(["fresh", "--methods", "warm", "--seeds", "0"]))
    fresh, reused = (instantiate(compose_run(Path("unused"), job.overrides(), None).data)
                     for job in jobs if job.method == "warm")
    assert type(fresh).__name__ == "FreshRandomLabelDigits" and type(reused).__name__ == "RandomLabelDigits"
    for name in ("num_tasks", "steps_per_task", "batch_size", "samples_per_task", "seed"):
        assert getattr(fresh, name) == getattr(reused, name), name
    assert (fresh.samples_per_task, fresh.batch_size, fresh.steps_per_task) == (89, 32, 25)


def test_the_spread_table_reads_own_split_seeds_from_the_shipped_runs_and_crosses_the_rest():
    from plasticity_callbacks.app.benchmark.metrics import mean_interval
    from plasticity_callbacks.app.benchmark.results import SHIPPED_RESULTS, load_results

    args = checks.parse_args(["spread", "--seeds", "0", "1", "--split-seeds", "0", "1", "--extra-seeds", "5", "6",
                              "--methods", "fire_exact"])
    jobs, _ = checks.jobs_for("spread", args)
    runs = [RunResult(j.stream.name, j.method, j.setting, j.seed, [random.random() for _ in range(20)], [0.5] * 20,
                      1.0) for j in jobs]
    late = {(r.method, r.seed, int(r.stream.rsplit("split", 1)[1])): statistics.fmean(r.accuracy[-5:]) for r in runs}
    for r in load_results(SHIPPED_RESULTS).ranking_runs():
        if r.stream == "generalization" and r.method in ("reset", "fire_exact"):
            late[r.method, r.seed, r.seed] = statistics.fmean(r.accuracy[-5:])
    results = Results({}, [0, 1, 5, 6], [], 0, runs=runs)
    row = rows_of(checks.spread_report(results, [0, 1], [0, 1], [5, 6]))["fire_exact"]

    def gap(s, p):
        return late["fire_exact", s, p] - late["reset", s, p]

    assert row[1] == "+0.014 [+0.009, +0.020]"  # the shipped seeds on their own split: the ranking's cell
    assert row[2] == str(mean_interval([gap(5, 5), gap(6, 6)]))
    assert row[3] == str(mean_interval([gap(s, s) for s in (0, 1, 2, 3, 4, 5, 6)]))
    assert row[5] == str(mean_interval([(gap(s, 0) + gap(s, 1)) / 2 for s in (0, 1)]))  # across seeds
    assert row[6] == str(mean_interval([(gap(0, p) + gap(1, p)) / 2 for p in (0, 1)]))  # across splits
