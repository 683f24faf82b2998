"""plasticity-benchmark's numbers equal direct computations on hand-made per-seed runs (no training, except
one tiny end-to-end run), and a user's method is placed against shipped runs only when their settings match."""
import csv
import io
import json
import logging
import math
import random
import statistics
from dataclasses import replace
from pathlib import Path
import sys
import warnings

import numpy as np
import pytest
from scipy import stats

pytest.importorskip("sklearn")

from plasticity_callbacks.app.benchmark import main as benchmark  # noqa: E402
from plasticity_callbacks.app.console import LIGHTNING_LOGGERS  # noqa: E402
from plasticity_callbacks.app.benchmark.metrics import (holm_rejections, late_stream_accuracy,  # noqa: E402
                                                        mean_interval, online_average, paired_difference,
                                                        paired_p_value, slope_per_100_tasks, windowed_accuracy)
from plasticity_callbacks.app.benchmark.results import (Results, RunResult, check_comparable,  # noqa: E402
                                                        load_results, save_results)
from plasticity_callbacks.app.benchmark.table import (per_seed_csv, ranking_table, short_table,  # noqa: E402
                                                      tuning_table)

@pytest.fixture(autouse=True)
def logging_restored():
    """``plasticity-benchmark``'s main quiets logging for the whole process, as a command should; the tests
    call it in-process, so every logger it touches is put back for the tests that read log records."""
    names = ["", "lightning", "lightning.pytorch", "lightning.fabric", "plasticity_callbacks", *LIGHTNING_LOGGERS]
    saved = {name: (logging.getLogger(name).level, logging.getLogger(name).propagate,
                    list(logging.getLogger(name).handlers)) for name in names}
    filters = {handler: list(handler.filters) for handler in logging.getLogger().handlers}
    capturing = logging._warnings_showwarning is not None
    with warnings.catch_warnings():
        yield
    for name, (level, propagate, handlers) in saved.items():
        logger = logging.getLogger(name)
        logger.setLevel(level)
        logger.propagate = propagate
        logger.handlers[:] = handlers
    for handler, kept in filters.items():
        handler.filters[:] = kept
    logging.captureWarnings(capturing)


STREAMS = {"memorization": {"data": "digits_labels", "num_tasks": 6, "steps_per_task": 10},
           "generalization": {"data": "digits_permuted", "num_tasks": 6, "steps_per_task": 5}}
SEEDS = [0, 1, 2, 3, 4]


def made_run(stream, method, seed, setting="", tasks=6):
    return RunResult(stream, method, setting, seed, [random.random() for _ in range(tasks)],
                     [random.random() for _ in range(tasks)], random.uniform(1, 9))


def made_results(methods=("warm", "reset", "fire"), seeds=SEEDS) -> Results:
    runs = [made_run(stream, method, seed) for stream in STREAMS for method in methods for seed in seeds]
    return Results(STREAMS, list(seeds), [100, 101], 4, runs=runs)


def rows_of(table: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()[2:]]


def test_late_stream_slope_and_online_metrics_are_the_direct_computations():
    accuracy = [random.random() for _ in range(17)]
    assert late_stream_accuracy(accuracy, 5) == pytest.approx(np.mean(accuracy[-5:]))
    assert late_stream_accuracy(accuracy, 40) == pytest.approx(np.mean(accuracy))  # a shorter stream: all tasks
    assert slope_per_100_tasks(accuracy) == pytest.approx(100 * np.polyfit(range(17), accuracy, 1)[0])
    assert online_average(accuracy) == pytest.approx(np.mean(accuracy))
    with pytest.raises(ValueError, match="k >= 1"):
        late_stream_accuracy(accuracy, 0)


def test_windowed_accuracy_counts_tasks_from_one_and_refuses_a_window_outside_the_stream():
    accuracy = [random.random() for _ in range(30)]
    assert windowed_accuracy(accuracy, 20, 5) == pytest.approx(np.mean(accuracy[15:20]))  # tasks 16-20
    assert windowed_accuracy(accuracy, 30, 5) == late_stream_accuracy(accuracy, 5)
    for task, width in ((31, 5), (4, 5), (5, 0)):
        with pytest.raises(ValueError, match="within the stream's 30 tasks"):
            windowed_accuracy(accuracy, task, width)


def test_p_values_invert_the_intervals_and_holm_steps_down():
    a, b = [random.random() for _ in range(6)], [random.random() for _ in range(6)]
    assert paired_p_value(a, b) == pytest.approx(stats.ttest_rel(a, b).pvalue)
    values = [random.gauss(0.1, 0.1) for _ in range(5)]
    interval = mean_interval(values)
    assert interval.excludes_zero == (stats.ttest_1samp(values, 0).pvalue < 0.05)
    assert (interval.low, interval.high) == pytest.approx(stats.t.interval(0.95, 4, np.mean(values), stats.sem(values)))
    # Holm at 5 % over 4: sorted 0.001 < 0.0125, 0.012 < 0.0167, 0.03 > 0.025 stops: the 0.04 stands too
    assert holm_rejections([0.04, 0.001, 0.03, 0.012]) == [False, True, False, True]
    assert holm_rejections([0.011, 0.02, 0.04]) == [True, True, True]  # 0.011 < 0.0167, 0.02 < 0.025, 0.04 < 0.05
    assert holm_rejections([0.02, 0.02, 0.02]) == [False, False, False]  # Bonferroni's 0.0167 is the first bar
    assert holm_rejections([math.nan, 0.001]) == [False, True]


def test_paired_interval_is_scipys_paired_t_test_and_the_t_table():
    a, b = [random.random() for _ in range(5)], [random.random() for _ in range(5)]
    diff = paired_difference(a, b)
    expected = stats.ttest_rel(a, b).confidence_interval(0.95)  # scipy's own paired t-test
    assert (diff.low, diff.high) == pytest.approx((expected.low, expected.high))
    d = np.subtract(a, b)
    half = 2.776445105 * d.std(ddof=1) / math.sqrt(5)  # t_{0.975, 4} from a printed t table
    assert (diff.mean, diff.low, diff.high, diff.seeds) == pytest.approx((d.mean(), d.mean() - half, d.mean() + half, 5))
    assert paired_difference([0.5, 0.7], [0.1, 0.2], confidence=0.9).high == pytest.approx(
        0.45 + 6.313751515 * statistics.stdev([0.4, 0.5]) / math.sqrt(2))  # t_{0.95, 1}
    single = paired_difference([0.5], [0.2])
    assert single.mean == pytest.approx(0.3) and math.isnan(single.low) and not single.excludes_zero
    assert str(single) == "+0.300"
    for bad in (([0.1], []), ([], [])):
        with pytest.raises(ValueError, match="one value per seed"):
            paired_difference(*bad)


def test_ranking_is_one_row_per_method_ordered_by_late_accuracy_and_every_cell_is_recomputed():
    results = made_results()
    results.runs = [replace(r, setting="callbacks.fire.options.steps=10") if r.method == "fire" else r
                    for r in results.runs]  # fire's row at its selected setting
    results.runs = [replace(r, setting="callbacks.fire.options.steps=5")
                    if r.method == "fire" and r.stream == "generalization" else r for r in results.runs]
    k = 3
    table = ranking_table(results, k)
    rows = rows_of(table)

    def late(method, stream):
        return {r.seed: late_stream_accuracy(r.accuracy, k) for r in results.runs
                if r.method == method and r.stream == stream}

    methods = [row[1] for row in rows]
    assert sorted(methods) == ["fire", "reset", "warm"]  # one row per method, whatever its setting per stream
    [fire] = [row for row in rows if row[1] == "fire"]
    assert (fire[3], fire[9]) == ("steps=10", "steps=5")  # the setting each stream's cells ran at
    means = [statistics.fmean(late(m, "memorization").values()) for m in methods]
    assert means == sorted(means, reverse=True)
    for row in rows:
        method = row[1]
        mine = late(method, "memorization")
        assert row[4] == f"{statistics.fmean(mine.values()):.3f} ± {statistics.stdev(mine.values()):.3f}"
        for column, baseline in ((5, "warm"), (6, "reset")):
            if method == baseline:
                assert row[column] == "·"
                continue
            theirs = late(baseline, "memorization")
            d = [mine[s] - theirs[s] for s in SEEDS]
            ci = stats.ttest_rel([mine[s] for s in SEEDS], [theirs[s] for s in SEEDS]).confidence_interval()
            assert row[column] == f"{np.mean(d):+.3f} [{ci.low:+.3f}, {ci.high:+.3f}]"
        slopes = [slope_per_100_tasks(r.accuracy) for r in results.runs if r.method == method and r.stream == "memorization"]
        assert row[7] == f"{np.mean(slopes):.3f} ± {np.std(slopes, ddof=1):.3f}"
        general = late(method, "generalization")
        assert row[10] == f"{statistics.fmean(general.values()):.3f} ± {statistics.stdev(general.values()):.3f}"
    short = rows_of(short_table(results, k))
    assert [r[0].strip("`") for r in short] == methods
    assert [r[1] for r in short if r[0] == "`fire`"] == ["steps=10 / steps=5"]
    reset = late("reset", "generalization")
    for row in short:
        general = late(row[0].strip("`"), "generalization")
        assert row[4] == f"{statistics.fmean(general.values()):.3f}"
        assert row[5] == ("·" if row[0] == "`reset`" else str(paired_difference(
            [general[s] for s in SEEDS], [reset[s] for s in SEEDS])))


def test_differences_pair_only_the_seeds_both_ran():
    results = made_results(seeds=[0, 1, 2])
    results.runs = [r for r in results.runs if not (r.method == "fire" and r.seed == 0)]
    k = 2
    [fire] = [row for row in rows_of(ranking_table(results, k)) if row[1] == "fire"]
    late = {(r.method, r.seed): late_stream_accuracy(r.accuracy, k) for r in results.runs if r.stream == "memorization"}
    assert fire[2] == "2"
    assert fire[6] == str(paired_difference([late["fire", s] for s in (1, 2)], [late["reset", s] for s in (1, 2)]))


def test_tuning_table_and_per_seed_csv_hold_the_direct_numbers():
    results = made_results(methods=("warm",), seeds=[0])
    tuning = [made_run(stream, "sp", seed, setting=f"callbacks.sp.shrink={v}") for stream in STREAMS
              for v in (0.4, 0.8) for seed in (100, 101)]
    results.runs += tuning
    results.tuned["sp"] = {"memorization": "callbacks.sp.shrink=0.4", "generalization": "callbacks.sp.shrink=0.8"}
    rows = rows_of(tuning_table(results, 2))
    assert [row[:3] for row in rows] == [["sp", stream, "callbacks.sp.shrink"] for stream in STREAMS]
    for row, first, chosen in zip(rows, (0, 4), ("0.4", "0.8")):
        means = [statistics.fmean(late_stream_accuracy(r.accuracy, 2) for r in tuning[i:i + 2]) for i in (first, first + 2)]
        assert row[3:] == [f"0.4: {means[0]:.3f}, 0.8: {means[1]:.3f}", chosen]
    lines = list(csv.DictReader(io.StringIO(per_seed_csv(results, 2))))
    assert len(lines) == len(results.runs)
    for line in lines:
        [run] = [r for r in results.runs if (r.stream, r.method, r.setting, r.seed) ==
                 (line["stream"], line["method"], line["setting"], int(line["seed"]))]
        assert float(line["end_of_task_acc_last_2"]) == pytest.approx(np.mean(run.accuracy[-2:]), abs=1e-4)
        assert float(line["online_acc_all_tasks"]) == pytest.approx(np.mean(run.online_accuracy), abs=1e-4)


def test_swept_values_are_listed_by_size_whatever_order_the_runs_come_in():
    results = made_results(methods=("warm",), seeds=[0])
    values = ["0.0001", "0.01", "1e-05", "0.001", "auto"]  # text order would put 1e-05 after 0.01
    random.shuffle(values)
    results.runs += [made_run("memorization", "l2", 100, setting=f"model.weight_decay={v}") for v in values]
    [row] = rows_of(tuning_table(results, 2))
    assert [cell.split(":")[0] for cell in row[3].split(", ")] == ["1e-05", "0.0001", "0.001", "0.01", "auto"]


def test_each_stream_selects_its_own_best_setting_ties_going_to_the_files_own():
    """A fake results set where memorization's best value is 0.2 and generalization's 0.8: each stream's row runs
    at its own best; a tie keeps the method file's value."""
    results = made_results(methods=("warm",), seeds=[0])
    best = {"memorization": "0.2", "generalization": "0.8"}
    for stream in STREAMS:
        for value in ("0.2", "0.4", "0.8"):
            for seed in (100, 101):
                level = 0.9 if value == best[stream] else 0.3 + 0.05 * (seed - 100)  # seeds differ, the order not
                results.runs.append(RunResult(stream, "sp", f"k={value}", seed, [level] * 4, [level] * 4, 1.0))
    results.runs.append(RunResult("memorization", "sp", "k=0.4", 0, [1.0] * 6, [1.0] * 6, 1.0))  # a ranking seed
    for stream, value in best.items():
        assert benchmark.best_setting("sp", stream, "k", ["0.2", "0.4", "0.8"], "0.4", results, 2) == f"k={value}"
    results.runs = [r for r in results.runs if r.setting != "k=0.2"]  # memorization: 0.4 and 0.8 tie
    assert benchmark.best_setting("sp", "memorization", "k", ["0.4", "0.8"], "0.8", results, 2) == "k=0.8"
    assert benchmark.best_setting("sp", "memorization", "k", ["0.4", "0.8"], "0.4", results, 2) == "k=0.4"


def test_results_round_trip_and_unlike_settings_are_refused(tmp_path):
    results = made_results()
    results.tuned["fire"] = {"memorization": "callbacks.fire.options.steps=10",
                             "generalization": "callbacks.fire.options.steps=5"}
    results.regimes, results.notes = {"fire": "Designed for x; here y."}, ["a merged row"]
    loaded = load_results(save_results(results, tmp_path / "r.json"))
    assert loaded.version == results.version and loaded.tuned == results.tuned
    assert (loaded.regimes, loaded.notes) == (results.regimes, results.notes)
    assert sorted(loaded.runs, key=str) == sorted(results.runs, key=str)
    check_comparable(loaded, made_results())
    shorter = json.loads(json.dumps(STREAMS))
    shorter["memorization"]["num_tasks"] = 10
    for change, what in (({"streams": shorter}, "num_tasks"), ({"seeds": [0, 1]}, "seeds: yours"),
                         ({"tuning_seeds": [7]}, "tuning_seeds"), ({"tuning_tasks": 20}, "tuning_tasks")):
        with pytest.raises(ValueError, match=what):
            check_comparable(loaded, replace(made_results(), **change))


GRID = ("0.0003", "0.001", "0.003")  # the controls' model.lr sweep


@pytest.fixture
def fake_runs(monkeypatch):
    """run_job without training: a run's accuracies are a function of its method, setting and seed; the value
    0.4 (sp's shrink) and lr 0.001 score best on every stream."""
    ran = []

    def run_job(job, out, config_dir):
        ran.append(job)
        rng = random.Random(f"{job.stream.name}{job.method}{job.setting}{job.seed}")
        value = 0.9 if job.setting.endswith(("=0.4", "=0.001")) else rng.random() * 0.5
        return RunResult(job.stream.name, job.method, job.setting, job.seed, [value] * job.stream.num_tasks,
                         [value] * job.stream.num_tasks, 1.0)

    monkeypatch.setattr(benchmark, "run_job", run_job)
    return ran


def shipped_results(methods=("warm", "reset")) -> Results:
    """Shipped runs at the default settings: 20 tasks, the methods at lr 0.001 on the ranking seeds, their
    three-value sweep on the tuning seeds 100-102 over the ranked streams' length."""
    streams = {name: {**s, "num_tasks": 20, "steps_per_task": steps} for (name, s), steps in zip(STREAMS.items(), (100, 25))}
    shipped = Results(streams, list(SEEDS), [100, 101, 102], 20)
    for stream in streams:
        for method in methods:
            shipped.runs += [RunResult(stream, method, "model.lr=0.001", seed, [random.random() for _ in range(20)],
                                       [random.random() for _ in range(20)], random.uniform(1, 9)) for seed in SEEDS]
            shipped.runs += [RunResult(stream, method, f"model.lr={v}", seed, [0.5] * 20, [0.5] * 20, 1.0)
                             for v in GRID for seed in (100, 101, 102)]
    shipped.tuned = {m: {s: "model.lr=0.001" for s in streams} for m in methods}
    shipped.regimes = {m: f"the {m} regime" for m in methods}
    return shipped


@pytest.mark.slow  # composes every method file through Hydra: seconds each
def test_a_new_method_runs_alone_against_the_shipped_baselines(tmp_path, monkeypatch, fake_runs, capsys):
    monkeypatch.setattr(benchmark, "SHIPPED_RESULTS", save_results(shipped_results(), tmp_path / "shipped.json"))
    benchmark.main(["--out", str(tmp_path / "out"), "--methods", "sp"])
    # only sp ran: its sweep on the tuning seeds and both streams at full length, then its best (0.4) per stream
    assert {job.method for job in fake_runs} == {"sp"}
    tuning = [job for job in fake_runs if job.seed >= 100]
    assert {job.seed for job in tuning} == {100, 101, 102} and {job.stream.num_tasks for job in tuning} == {20}
    assert {(job.stream.name, job.setting.rsplit("=", 1)[1]) for job in tuning} == {
        (stream, v) for stream in STREAMS for v in ("0.2", "0.4", "0.8")}
    assert {(job.stream.name, job.setting, job.seed) for job in fake_runs if job.seed < 100} == {
        (stream, "callbacks.shrink_perturb.shrink=0.4", seed) for stream in STREAMS for seed in SEEDS}
    text = (tmp_path / "ranking.md").read_text() if (tmp_path / "ranking.md").exists() else \
        (tmp_path / "out" / "ranking.md").read_text()
    rows = rows_of(text.split("\n\n")[1])
    assert [row[1] for row in rows][0] == "sp" and sorted(row[1] for row in rows) == ["reset", "sp", "warm"]
    assert [row[3] for row in rows if row[1] == "sp"] == ["shrink=0.4"]
    out = capsys.readouterr().out
    assert "[1/" in out and "tuning runs +" in out and "CPU-minutes" in out  # a plan with its cost, a line per run
    assert "- `sp`: Designed for warm-starting on growing data" in text and "- `warm`: the warm regime" in text
    with pytest.raises(SystemExit, match="num_tasks.*--rerun-baselines"):
        benchmark.main(["--out", str(tmp_path / "other"), "--methods", "sp", "--tasks", "5"])


@pytest.mark.slow  # composes every method file through Hydra: seconds each
def test_ship_with_methods_adds_their_runs_and_keeps_every_shipped_entry(tmp_path, monkeypatch, fake_runs):
    shipped = shipped_results(methods=("warm", "reset", "head_reset"))
    path = save_results(shipped, tmp_path / "shipped.json")
    before = json.loads(path.read_text())
    monkeypatch.setattr(benchmark, "SHIPPED_RESULTS", path)
    benchmark.main(["--out", str(tmp_path / "out"), "--methods", "head_reset", "--ship"])
    after = json.loads(path.read_text())
    key = lambda run: (run["stream"], run["method"], run["setting"], run["seed"])  # noqa: E731
    kept = {key(run): run for run in before["runs"] if run["method"] != "head_reset"}
    assert [run for run in after["runs"] if key(run) in kept] == list(kept.values())  # as shipped, in order
    assert {key(run) for run in after["runs"] if key(run) not in kept} == {
        (job.stream.name, job.method, job.setting, job.seed) for job in fake_runs}  # head_reset's new runs only
    assert {job.method for job in fake_runs} == {"head_reset"}
    assert len(fake_runs) == 2 * len(SEEDS) + 2 * len(GRID) * 3  # its ranking rows and its sweep
    assert after["tuned"]["warm"] == before["tuned"]["warm"] and set(after["tuned"]) == {"warm", "reset", "head_reset"}
    assert after["regimes"]["head_reset"].startswith("A control")  # its file's, not the shipped one
    assert {k: v for k, v in after.items() if k not in ("runs", "tuned", "regimes")} == {
        k: v for k, v in before.items() if k not in ("runs", "tuned", "regimes")}
    shipped_now = path.read_text()
    with pytest.raises(SystemExit):  # would replace every shipped run by warm, reset and the method's
        benchmark.main(["--out", str(tmp_path / "out"), "--methods", "head_reset", "--ship", "--rerun-baselines"])
    assert path.read_text() == shipped_now
    save_results(replace(shipped, version="0.0.0-other"), path)  # runs of another release
    shipped_now = path.read_text()
    with pytest.raises(SystemExit, match="made with plasticity_callbacks 0.0.0-other.*--ship adds runs only of"):
        benchmark.main(["--out", str(tmp_path / "out"), "--methods", "head_reset", "--ship"])
    assert path.read_text() == shipped_now


@pytest.mark.slow  # composes every method file through Hydra: seconds each
def test_rerun_baselines_runs_warm_and_reset_with_the_new_method(tmp_path, fake_runs):
    benchmark.main(["--out", str(tmp_path), "--methods", "warm_reset", "--tasks", "4", "--rerun-baselines",
                    "--seeds", "0", "1"])
    assert {job.method for job in fake_runs} == {"warm", "reset", "warm_reset"}
    assert {job.stream.num_tasks for job in fake_runs} == {4}  # the sweep as long as the ranked streams
    results = load_results(tmp_path / "results.json")
    assert results.tuned == {m: {s: "model.lr=0.001" for s in STREAMS} for m in ("warm", "reset", "warm_reset")}


@pytest.mark.slow  # composes every method file through Hydra: seconds each
def test_every_shipped_method_file_sweeps_as_many_values_and_states_its_regime():
    """Discovered from configs/method: every file has a sensitivity: block of the same size, its own value among
    them, and a one-line regime:; the unranked ones say why in it."""
    from plasticity_callbacks.app.benchmark.runs import sweep
    from plasticity_callbacks.app.methods import method_names

    names = method_names()
    sweeps = {name: sweep(name, None) for name in names}
    assert all(sweeps.values()), [n for n, s in sweeps.items() if s is None]
    assert len({len(values) for _, values, _ in sweeps.values()}) == 1, {n: s[1] for n, s in sweeps.items()}
    benchmark.check_grids(sweeps, {})
    ranked, regimes = benchmark.ranked_methods(names, None)
    for name in names:
        assert regimes[name] and "\n" not in regimes[name] and len(regimes[name]) < 400, name
        assert "designed" in regimes[name].lower() or "control" in regimes[name].lower(), name
    assert set(names) - set(ranked) == {"fire_lm"}  # the authors' language-model recipe: not the digits regime


def test_unequal_grids_a_missing_sweep_and_an_unswept_default_are_refused():
    with pytest.raises(SystemExit, match=r"same number of values.*'a': 2.*'b': 3"):
        benchmark.check_grids({"a": ("k", ["1", "2"], "1"), "b": ("k", ["1", "2", "3"], "1")}, {})
    with pytest.raises(SystemExit, match=r"same number of values.*'warm \(shipped\)': 3"):
        benchmark.check_grids({"a": ("k", ["1", "2"], "1")}, {"warm (shipped)": 3})
    with pytest.raises(SystemExit, match=r"\['b'\] have no sensitivity"):
        benchmark.check_grids({"a": ("k", ["1", "2"], "1"), "b": None}, {})
    with pytest.raises(SystemExit, match="its own k=5 is not among its sensitivity values"):
        benchmark.check_grids({"a": ("k", ["1", "2"], "5")}, {})


def test_an_unranked_method_is_left_out_and_refused_by_name(tmp_path, fake_runs, capsys):
    with pytest.raises(SystemExit, match=r"\['fire_lm'\] say ranked: false.*GPT"):
        benchmark.main(["--out", str(tmp_path), "--methods", "fire_lm", "--rerun-baselines"])
    assert not fake_runs


def mine(tmp_path, lr: str | None):
    """A user's method file that is warm start under another name, with its own lr ``lr`` (None: the run's)."""
    (tmp_path / "method").mkdir(exist_ok=True)
    model = f"model:\n  lr: {lr}\n" if lr else ""
    (tmp_path / "method" / "mine.yaml").write_text(
        f"name: mine\nregime: \"Designed for nothing.\"\ncarry_optimizer: true\ncallbacks: {{}}\n{model}"
        "sensitivity:\n  key: model.lr\n  values: [3.0e-4, 1.0e-3, 3.0e-3]\n")
    return tmp_path


@pytest.mark.slow  # composes every method file through Hydra: seconds each
def test_two_method_files_of_one_configuration_are_refused(tmp_path, fake_runs):
    args = ["--out", str(tmp_path / "out"), "--methods", "mine", "--rerun-baselines", "--tasks", "2"]
    with pytest.raises(SystemExit, match="mine and warm compose the same configuration on memorization|"
                                         "warm and mine compose the same configuration on memorization"):
        benchmark.main([*args, "--config-dir", str(mine(tmp_path, None))])
    assert not fake_runs


@pytest.mark.slow  # composes every method file through Hydra: seconds each
def test_rows_tuned_to_one_configuration_are_merged_with_a_line(tmp_path, fake_runs, capsys):
    """mine (lr 3e-4 in its file) and warm both select lr 0.001: one configuration, one row (warm's)."""
    benchmark.main(["--out", str(tmp_path / "out"), "--methods", "mine", "--rerun-baselines", "--tasks", "2",
                    "--config-dir", str(mine(tmp_path, "3.0e-4"))])
    assert not [job for job in fake_runs if job.method == "mine" and job.seed < 100]  # no ranking run of its own
    text = (tmp_path / "out" / "ranking.md").read_text()
    assert "mine (lr=0.001) on memorization is the configuration of warm (lr=0.001): one row, warm's" in text
    assert "note: mine (lr=0.001) on generalization is the configuration of warm" in capsys.readouterr().out
    assert "mine" not in [row[1] for row in rows_of(text.split("\n\n")[1])]


def test_identical_groups_and_the_run_fingerprint():
    from plasticity_callbacks.app.benchmark.runs import STREAMS as RUN_STREAMS, configuration, identical_groups

    assert identical_groups({"a": "x", "b": "y", "c": "x", "d": "x"}) == [["a", "c", "d"]]
    assert identical_groups({"a": "x", "b": "y"}) == []
    memorization = RUN_STREAMS[0]
    # the authors' LM recipe at 10 steps is their continual recipe: the same run under two names
    assert (configuration(memorization, "fire_lm", "callbacks.fire.options.steps=10", None)
            == configuration(memorization, "fire_continual", "", None))
    assert (configuration(memorization, "fire_lm", "", None) != configuration(memorization, "fire_continual", "", None))


def test_a_streams_data_overrides_reach_the_composed_run():
    from plasticity_callbacks.app.benchmark.runs import STREAMS as RUN_STREAMS, Job, compose_run

    split = replace(RUN_STREAMS[1], name="generalization_split3", data_overrides=("data.split_seed=3",))
    cfg = compose_run(Path("unused"), Job(split, "reset", "", 0).overrides(), None)
    assert cfg.data.split_seed == 3 and cfg.data.seed == 0
    assert split.settings()["data_overrides"] == ["data.split_seed=3"]
    plain = compose_run(Path("unused"), Job(RUN_STREAMS[1], "reset", "", 0).overrides(), None)
    assert plain.data.split_seed is None and "data_overrides" not in RUN_STREAMS[1].settings()


def test_bad_arguments_are_refused_in_one_line(tmp_path):
    with pytest.raises(SystemExit, match="no method file for \\['nope'\\]"):
        benchmark.main(["--out", str(tmp_path), "--methods", "nope"])
    with pytest.raises(SystemExit):
        benchmark.main(["--seeds", "0", "100"])  # a ranking seed among the tuning seeds


def test_readme_table_goes_between_its_markers(tmp_path):
    readme = tmp_path / "README.md"
    start, end = benchmark.README_MARKERS
    readme.write_text(f"# x\n{start}\nold\n{end}\ntail\n")
    benchmark.replace_readme_table(readme, "| new |")
    assert readme.read_text() == f"# x\n{start}\n| new |\n{end}\ntail\n"
    readme.write_text("no markers")
    with pytest.raises(SystemExit, match="needs the lines"):
        benchmark.replace_readme_table(readme, "| new |")


@pytest.mark.slow  # a whole benchmark: tens of seconds
def test_a_tiny_benchmark_trains_reports_and_draws(tmp_path):
    benchmark.main(["--out", str(tmp_path), "--methods", "warm", "--rerun-baselines", "--seeds", "0", "1",
                    "--tasks", "2", "--memorization-steps", "3", "--generalization-steps", "3", "--no-tuning",
                    "--last-k", "1"])
    results = load_results(tmp_path / "results.json")
    assert len(results.runs) == 2 * 2 * 2 and all(len(r.accuracy) == 2 for r in results.runs)
    assert {r.method for r in results.runs} == {"warm", "reset"}
    assert (tmp_path / "ranking.png").stat().st_size > 10_000


def test_without_the_digits_extra_the_script_names_the_install(monkeypatch):
    from plasticity_callbacks import cli

    monkeypatch.setitem(sys.modules, "sklearn", None)  # as if scikit-learn were not installed
    monkeypatch.delitem(sys.modules, "plasticity_callbacks.app.benchmark.main")
    with pytest.raises(SystemExit, match=r"plasticity-benchmark: .*needs sklearn.*pip install .*\[digits\]"):
        cli.benchmark()


def test_every_swept_value_has_its_own_run_folder(tmp_path):
    from plasticity_callbacks.app.benchmark.runs import STREAMS as RUN_STREAMS, Job

    values = ["1.0", "2.0", "4.0", "0.001", "0.01", "1e-05"]
    folders = {Job(RUN_STREAMS[0], "m", f"callbacks.weight_clip.kappa={v}", 100).folder(tmp_path) for v in values}
    assert len(folders) == len(values)
    assert Job(RUN_STREAMS[0], "m", "callbacks.weight_clip.kappa=2.0", 0).folder(tmp_path).parent.name == "kappa_2.0"


# ------------------------------------------------------------------ trust: the shipped runs and method files
def test_the_shipped_runs_carry_a_checksum_and_load_checked():
    from plasticity_callbacks.app.benchmark.results import SHIPPED_RESULTS, load_results

    assert SHIPPED_RESULTS.with_name("ranking_runs.json.sha256").is_file()
    assert load_results(SHIPPED_RESULTS, require_checksum=True).runs


@pytest.mark.parametrize("damage, words", [
    ("edited", "does not match its recorded SHA-256"),
    ("no checksum", "has no .sha256 beside it"),
    ("out of range", "an accuracy outside [0, 1]"),
    ("missing tasks", "accuracies for"),
    ("not json", "is not a benchmark results file"),
    ("foreign", "is not a benchmark results file"),
])
def test_an_edited_or_foreign_results_file_is_one_line_naming_it(tmp_path, damage, words):
    import json
    import shutil

    from plasticity_callbacks.app.benchmark.results import SHIPPED_RESULTS, ResultsError, load_results
    from plasticity_callbacks.app.runs.verified_files import write_verified

    path = tmp_path / "ranking_runs.json"
    shutil.copy(SHIPPED_RESULTS, path)
    shutil.copy(SHIPPED_RESULTS.with_name("ranking_runs.json.sha256"), tmp_path / "ranking_runs.json.sha256")
    data = json.loads(path.read_text())
    run = data["runs"][0]
    if damage == "edited":  # a plausible edit: still valid JSON, still in range
        run["accuracy"] = [min(1.0, a + 0.01) for a in run["accuracy"]]
        path.write_text(json.dumps(data))
    elif damage == "no checksum":
        (tmp_path / "ranking_runs.json.sha256").unlink()
    elif damage in ("out of range", "missing tasks"):
        run["accuracy"] = [1.5] * len(run["accuracy"]) if damage == "out of range" else run["accuracy"][:-1]
        run["seed"] = data["seeds"][0]
        write_verified(json.dumps(data).encode(), path)
    elif damage == "not json":
        write_verified(b"{", path)
    else:
        write_verified(json.dumps({"version": "9", "runs": []}).encode(), path)
    with pytest.raises(ResultsError) as err:
        load_results(path, require_checksum=True)
    assert words in str(err.value) and str(path) in str(err.value) and "\n" not in str(err.value), str(err.value)


@pytest.mark.parametrize("target", ["os.system", "my_module.Callback", "builtins.eval"])
def test_a_method_file_naming_code_outside_the_package_is_refused_unless_trusted(tmp_path, monkeypatch, target):
    from omegaconf import OmegaConf

    from plasticity_callbacks.app.methods import check_method_targets
    from plasticity_callbacks.errors import ConfigError

    (tmp_path / "method").mkdir()
    (tmp_path / "method" / "mine.yaml").write_text("name: mine\n")
    method = OmegaConf.create({"name": "mine", "callbacks": {"x": {
        "_target_": "plasticity_callbacks.ShrinkPerturb", "schedule": {"_target_": target}}}})
    with pytest.raises(ConfigError) as err:
        check_method_targets(method, [tmp_path])
    assert (f"{tmp_path / 'method' / 'mine.yaml'}: callbacks.x.schedule._target_={target!r} is not a class of "
            "plasticity_callbacks") in str(err.value) and "\n" not in str(err.value)
    monkeypatch.setenv("PLASTICITY_TRUST_CHECKPOINTS", "1")
    check_method_targets(method, [tmp_path])  # the opt-in
    monkeypatch.delenv("PLASTICITY_TRUST_CHECKPOINTS")
    for name in ("sp", "fire_lm", "cbp"):  # the package's own method files pass
        from plasticity_callbacks.app.methods import config_dir

        check_method_targets(OmegaConf.load(f"{config_dir()}/method/{name}.yaml"))


def test_a_finished_run_with_the_same_config_is_read_back_not_run_again(tmp_path, monkeypatch):
    from plasticity_callbacks.app.benchmark import runs

    fits = []

    def fit(cfg):  # a stand-in for training: writes the per-task log a real run writes
        fits.append(cfg.seed)
        logs = Path(cfg.paths.output_dir) / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        rows = "".join(f"{t},{0.5 + t / 100},{0.4}\n" for t in range(cfg.data.num_tasks))
        (logs / "tasks.csv").write_text("task,accuracy,online_accuracy\n" + rows)

    monkeypatch.setattr(runs, "fit", fit)
    job = runs.Job(runs.STREAMS[0], "reset", "model.lr=0.003", 0)
    first = runs.run_job(job, tmp_path, None)
    assert runs.run_job(job, tmp_path, None) == first and fits == [0]  # reused: same result, no second fit
    config = job.folder(tmp_path) / runs.CONFIG_FILE
    config.write_text(config.read_text().replace("lr: 0.003", "lr: 0.01"))  # saved with another config
    assert runs.run_job(job, tmp_path, None).accuracy == first.accuracy and fits == [0, 0]  # run again
    (job.folder(tmp_path) / "logs" / "tasks.csv").write_text("task,accuracy,online_accuracy\n0,0.5,0.4\n")
    runs.run_job(job, tmp_path, None)  # stopped after one task: run again
    assert fits == [0, 0, 0]
