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
import sys
import warnings

import numpy as np
import pytest
from scipy import stats

pytest.importorskip("sklearn")

from plasticity_callbacks.app.benchmark import main as benchmark  # noqa: E402
from plasticity_callbacks.app.console import LIGHTNING_LOGGERS  # noqa: E402
from plasticity_callbacks.app.benchmark.metrics import (late_stream_accuracy, online_average,  # noqa: E402
                                                        paired_difference, slope_per_100_tasks)
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


def test_ranking_is_ordered_by_late_accuracy_and_every_cell_is_recomputed():
    results = made_results()
    results.runs += [made_run(s, "fire", seed, setting="callbacks.fire.options.steps=10") for s in STREAMS
                     for seed in SEEDS]
    k = 3
    table = ranking_table(results, k)
    rows = rows_of(table)

    def late(label, stream):
        return {r.seed: late_stream_accuracy(r.accuracy, k) for r in results.runs
                if r.label == label and r.stream == stream}

    labels = [row[1] for row in rows]
    assert "fire (steps=10, tuned)" in labels and len(labels) == 4
    means = [statistics.fmean(late(label, "memorization").values()) for label in labels]
    assert means == sorted(means, reverse=True)
    for row in rows:
        label = row[1]
        mine = late(label, "memorization")
        assert row[3] == f"{statistics.fmean(mine.values()):.3f} ± {statistics.stdev(mine.values()):.3f}"
        for column, baseline in ((4, "warm"), (5, "reset")):
            if label == baseline:
                assert row[column] == "·"
                continue
            theirs = late(baseline, "memorization")
            d = [mine[s] - theirs[s] for s in SEEDS]
            ci = stats.ttest_rel([mine[s] for s in SEEDS], [theirs[s] for s in SEEDS]).confidence_interval()
            assert row[column] == f"{np.mean(d):+.3f} [{ci.low:+.3f}, {ci.high:+.3f}]"
        slopes = [slope_per_100_tasks(r.accuracy) for r in results.runs if r.label == label and r.stream == "memorization"]
        assert row[6] == f"{np.mean(slopes):.3f} ± {np.std(slopes, ddof=1):.3f}"
        general = late(label, "generalization")
        assert row[8] == f"{statistics.fmean(general.values()):.3f} ± {statistics.stdev(general.values()):.3f}"
    short = rows_of(short_table(results, k))
    assert [r[0].strip("`") for r in short] == [label for label in labels if "tuned" not in label]
    reset = late("reset", "generalization")
    for row in short:
        general = late(row[0].strip("`"), "generalization")
        assert row[3] == f"{statistics.fmean(general.values()):.3f}"
        assert row[4] == ("·" if row[0] == "`reset`" else str(paired_difference(
            [general[s] for s in SEEDS], [reset[s] for s in SEEDS])))


def test_differences_pair_only_the_seeds_both_ran():
    results = made_results(seeds=[0, 1, 2])
    results.runs = [r for r in results.runs if not (r.method == "fire" and r.seed == 0)]
    k = 2
    [fire] = [row for row in rows_of(ranking_table(results, k)) if row[1] == "fire"]
    late = {(r.method, r.seed): late_stream_accuracy(r.accuracy, k) for r in results.runs if r.stream == "memorization"}
    assert fire[2] == "2"
    assert fire[5] == str(paired_difference([late["fire", s] for s in (1, 2)], [late["reset", s] for s in (1, 2)]))


def test_tuning_table_and_per_seed_csv_hold_the_direct_numbers():
    results = made_results(methods=("warm",), seeds=[0])
    tuning = [made_run("memorization", "sp", seed, setting=f"callbacks.sp.shrink={v}") for v in (0.4, 0.8)
              for seed in (100, 101)]
    results.runs += tuning
    results.tuned["sp"] = "callbacks.sp.shrink=0.4"
    [row] = rows_of(tuning_table(results, 2))
    means = [statistics.fmean(late_stream_accuracy(r.accuracy, 2) for r in tuning[i:i + 2]) for i in (0, 2)]
    assert row == ["sp", "callbacks.sp.shrink", f"0.4: {means[0]:.3f}, 0.8: {means[1]:.3f}", "0.4 (tuned row)"]
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
    assert [cell.split(":")[0] for cell in row[2].split(", ")] == ["1e-05", "0.0001", "0.001", "0.01", "auto"]


def test_results_round_trip_and_unlike_settings_are_refused(tmp_path):
    results = made_results()
    results.tuned["fire"] = "callbacks.fire.options.steps=10"
    loaded = load_results(save_results(results, tmp_path / "r.json"))
    assert loaded.version == results.version and loaded.tuned == results.tuned
    assert sorted(loaded.runs, key=str) == sorted(results.runs, key=str)
    check_comparable(loaded, made_results())
    shorter = json.loads(json.dumps(STREAMS))
    shorter["memorization"]["num_tasks"] = 10
    for change, what in (({"streams": shorter}, "num_tasks"), ({"seeds": [0, 1]}, "seeds: yours"),
                         ({"tuning_seeds": [7]}, "tuning_seeds"), ({"tuning_tasks": 20}, "tuning_tasks")):
        with pytest.raises(ValueError, match=what):
            check_comparable(loaded, replace(made_results(), **change))


@pytest.fixture
def fake_runs(monkeypatch):
    """run_job without training: a run's accuracies are a function of its method, setting and seed."""
    ran = []

    def run_job(job, out, config_dir):
        ran.append(job)
        rng = random.Random(f"{job.stream.name}{job.method}{job.setting}{job.seed}")
        value = 0.9 if job.setting.endswith("=0.4") else rng.random() * 0.5
        return RunResult(job.stream.name, job.method, job.setting, job.seed, [value] * job.stream.num_tasks,
                         [value] * job.stream.num_tasks, 1.0)

    monkeypatch.setattr(benchmark, "run_job", run_job)
    return ran


def test_a_new_method_runs_alone_against_the_shipped_baselines(tmp_path, monkeypatch, fake_runs, capsys):
    shipped = made_results(methods=("warm", "reset"))
    shipped.tuning_tasks, shipped.tuning_seeds = 10, [100]
    shipped.streams = {name: {**s, "num_tasks": 20, "steps_per_task": steps}
                       for (name, s), steps in zip(STREAMS.items(), (100, 25))}
    shipped.runs = [RunResult(r.stream, r.method, r.setting, r.seed, [0.5] * 20, [0.5] * 20, 1.0) for r in shipped.runs]
    monkeypatch.setattr(benchmark, "SHIPPED_RESULTS", save_results(shipped, tmp_path / "shipped.json"))
    benchmark.main(["--out", str(tmp_path / "out"), "--methods", "sp"])
    # only sp ran: its file on the ranking seeds, then its sweep on the tuning seeds, then the best (0.4) again
    assert {job.method for job in fake_runs} == {"sp"}
    assert {job.seed for job in fake_runs if not job.setting} == set(SEEDS)
    sweep_values = {job.setting for job in fake_runs if job.seed in (100, 101)}
    assert {s.rsplit("=", 1)[1] for s in sweep_values} == {"0.2", "0.4", "0.6", "0.8"}
    assert {job.stream.num_tasks for job in fake_runs if job.seed in (100, 101)} == {10}  # the shorter sweep
    table = (tmp_path / "out" / "ranking.md").read_text()
    labels = [row[1] for row in rows_of(table.split("\n\n")[1])]
    assert labels[0] == "sp (shrink=0.4, tuned)" and set(labels) == {"sp (shrink=0.4, tuned)", "sp", "warm", "reset"}
    assert "[1/" in capsys.readouterr().out  # a progress line per run
    with pytest.raises(SystemExit, match="num_tasks.*--rerun-baselines"):
        benchmark.main(["--out", str(tmp_path / "other"), "--methods", "sp", "--tasks", "5"])


def test_ship_with_methods_adds_their_runs_and_keeps_every_shipped_entry(tmp_path, monkeypatch, fake_runs):
    shipped = made_results(methods=("warm", "reset", "fire", "head_reset"))
    shipped.tuning_tasks, shipped.tuning_seeds = 10, [100]
    shipped.streams = {name: {**s, "num_tasks": 20, "steps_per_task": steps}
                       for (name, s), steps in zip(STREAMS.items(), (100, 25))}
    shipped.runs = [RunResult(r.stream, r.method, r.setting, r.seed, [random.random() for _ in range(20)],
                              [random.random() for _ in range(20)], random.uniform(1, 9)) for r in shipped.runs]
    shipped.runs += [made_run("memorization", "fire", 100, "callbacks.fire.options.steps=10", tasks=10)]
    shipped.tuned = {"fire": "callbacks.fire.options.steps=10", "head_reset": "callbacks.x.y=1"}
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
    assert {job.method for job in fake_runs} == {"head_reset"} and len(fake_runs) == 2 * len(SEEDS)
    assert after["tuned"] == {"fire": "callbacks.fire.options.steps=10"}  # head_reset's own is its new sweep's
    assert {k: v for k, v in after.items() if k not in ("runs", "tuned")} == {
        k: v for k, v in before.items() if k not in ("runs", "tuned")}
    shipped_now = path.read_text()
    with pytest.raises(SystemExit):  # would replace every shipped run by warm, reset and the method's
        benchmark.main(["--out", str(tmp_path / "out"), "--methods", "head_reset", "--ship", "--rerun-baselines"])
    assert path.read_text() == shipped_now
    save_results(replace(shipped, version="0.0.0-other"), path)  # runs of another release
    shipped_now = path.read_text()
    with pytest.raises(SystemExit, match="made with plasticity_callbacks 0.0.0-other.*--ship adds runs only of"):
        benchmark.main(["--out", str(tmp_path / "out"), "--methods", "head_reset", "--ship"])
    assert path.read_text() == shipped_now


def test_rerun_baselines_runs_warm_and_reset_with_the_new_method(tmp_path, fake_runs):
    benchmark.main(["--out", str(tmp_path), "--methods", "warm_reset", "--tasks", "4", "--rerun-baselines",
                    "--seeds", "0", "1"])
    assert {job.method for job in fake_runs} == {"warm", "reset", "warm_reset"}
    assert {job.stream.num_tasks for job in fake_runs} == {4}


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
