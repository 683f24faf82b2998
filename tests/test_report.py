"""plasticity-report on a small fake sweep: the table's numbers and the figure files."""
import csv
import json
import shutil
import statistics

import pytest
from hydra_app import run_report

from plasticity_callbacks.app.report import build_report, main

METHODS = {"warm": 2.0, "fire": 1.8}  # new-phase final val loss of seed 0; seed s adds 0.1·s


def fake_run(job_dir, method, seed, with_spectra=False):
    """What one pipeline job leaves behind: pipeline.json, per-phase metrics.csv, Hydra overrides."""
    (job_dir / ".hydra").mkdir(parents=True)
    (job_dir / ".hydra" / "overrides.yaml").write_text(
        f"- experiment=continual_pretrain\n- +method={method}\n- seed={seed}\n")
    final = METHODS[method] + 0.1 * seed
    phases = {}
    for index, name in enumerate(["pretrain", "sft"]):
        log_dir = job_dir / "logs" / name
        log_dir.mkdir(parents=True)
        fields = ["epoch", "step", "train/loss", "val/loss", "redo/dormant"] + (["retention/pretrain/loss"] if index else [])
        with (log_dir / "metrics.csv").open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=fields)
            writer.writeheader()
            for step in range(0, 11, 5):
                row = {"epoch": 0, "step": step, "train/loss": 3 - step / 10, "val/loss": final + (10 - step) / 10,
                       "redo/dormant": 0.01 * step}
                if index:
                    row["retention/pretrain/loss"] = 2.5 + step / 100
                writer.writerow(row)
        phases[name] = {"index": index, "steps": 10, "step_offset": 10 * index, "val_loss": final if index else 2.4,
                        "retention_loss": (2.6 + seed / 100) if index else 2.4, "dormant_fraction": 0.1 * (seed + 1),
                        "minutes": 1.0 + seed}
        if with_spectra and index:
            (log_dir / "figures").mkdir()
            (log_dir / "figures" / "fire_spectra_fit_start.png").write_bytes(b"\x89PNG fake")
    state = {"method": method, "seed": seed, "phase_order": ["pretrain", "sft"], "phases": phases}
    (job_dir / "pipeline.json").write_text(json.dumps(state))


@pytest.fixture
def sweep(tmp_path):
    job = 0
    for method in METHODS:
        for seed in range(3):
            fake_run(tmp_path / "multirun" / str(job), method, seed, with_spectra=(method == "fire"))
            job += 1
    return tmp_path / "multirun"


def test_table_has_mean_and_std_over_seeds(sweep):
    text, figures = build_report(sweep)
    rows = [line for line in text.splitlines() if line.startswith("| ") and "seeds" not in line]
    assert [r.split("|")[1].strip() for r in rows] == ["fire", "warm"]  # best new-phase loss first
    fire = [c.strip() for c in rows[0].split("|")[1:-1]]
    finals = [1.8, 1.9, 2.0]
    assert fire[1] == "3"
    assert fire[2] == f"{statistics.fmean(finals):.4f} ± {statistics.stdev(finals):.4f}"
    assert fire[3] == f"{statistics.fmean([2.6, 2.61, 2.62]):.4f} ± {statistics.stdev([2.6, 2.61, 2.62]):.4f}"
    assert fire[4] == f"{0.2:.4f} ± {0.1:.4f}"
    assert fire[5] == f"{statistics.fmean([2, 4, 6]):.2f} ± {statistics.stdev([2, 4, 6]):.2f}"  # both phases' minutes
    names = sorted(p.name for p in figures)
    assert names == ["dormant_fraction.png", "loss_curves.png", "spectra_fire.png"]
    for path in figures[:2]:
        assert path.read_bytes()[:4] == b"\x89PNG" and path.stat().st_size > 10_000
    assert (sweep / "report" / "report.md").read_text() == text


@pytest.mark.cli
def test_command_line(sweep, tmp_path, capsys):
    out = tmp_path / "elsewhere"
    main([str(sweep), "--out", str(out)])
    printed = capsys.readouterr().out
    assert "| fire | 3 |" in printed and (out / "loss_curves.png").is_file()
    proc = run_report(tmp_path / "empty")
    assert proc.returncode == 2 and "no runs under" in proc.stderr


def fake_single_fit(job_dir, seed, lr):
    """What one ``~experiment`` job leaves: Hydra's config and overrides, logs/metrics.csv."""
    (job_dir / ".hydra").mkdir(parents=True)
    (job_dir / ".hydra" / "overrides.yaml").write_text(
        f"- ~experiment\n- +callbacks=fire\n- trainer.max_steps=10\n- optimizer.lr={lr}\n- seed={seed}\n")
    (job_dir / ".hydra" / "config.yaml").write_text(f"seed: {seed}\ncallbacks:\n  fire: {{at_fit_start: true}}\n")
    (job_dir / "logs").mkdir()
    with (job_dir / "logs" / "metrics.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["epoch", "step", "train/loss", "val/loss"])
        writer.writeheader()
        for step in (0, 5, 10):
            val = 2.0 + lr - step / 100 + seed / 50
            writer.writerow({"epoch": 0, "step": step, "train/loss": 3.0, "val/loss": val})


def test_sweep_of_single_fits_is_reported_and_labelled_by_what_varies(tmp_path):
    job = 0
    for lr in (0.1, 0.2):
        for seed in (0, 1):
            fake_single_fit(tmp_path / str(job), seed, lr)
            job += 1
    text, figures = build_report(tmp_path)
    rows = [line for line in text.splitlines() if line.startswith("| ") and "seeds" not in line]
    # only the varying override names a group; the shared ones (method, max_steps) are listed once
    assert [r.split("|")[1].strip() for r in rows] == ["optimizer.lr=0.1", "optimizer.lr=0.2"]
    finals = [2.0 + 0.1 - 0.1 + s / 50 for s in (0, 1)]
    assert f"{statistics.fmean(finals):.4f} ± {statistics.stdev(finals):.4f}" in rows[0]
    assert "Shared by every run: callbacks=fire, ~experiment, trainer.max_steps=10." in text
    assert [p.name for p in figures] == ["loss_curves.png"]


def test_identical_groups_are_drawn_once_under_both_names(tmp_path):
    from plasticity_callbacks.app.report.runs import Run, merge_identical

    def run(label, final):
        return Run(tmp_path, label, 0, {}, label=label, curves={"val": {0: 2.0, 5: final}, "train": {0: 3.0}})

    merged = merge_identical({"fire": [run("fire", 1.6)], "redo": [run("redo", 1.5)], "warm": [run("warm", 1.5)]})
    assert sorted(merged) == ["fire", "redo = warm"]
    differs_elsewhere = run("warm", 1.5)
    differs_elsewhere.curves["train"] = {0: 3.1}  # same validation curve, another training curve: both drawn
    assert sorted(merge_identical({"redo": [run("redo", 1.5)], "warm": [differs_elsewhere]})) == ["redo", "warm"]


def test_a_methods_summary_metrics_become_columns(sweep):
    """A method names its summary values (PlasticityCallback.summary_metrics); the report adds them, no edit needed."""
    for path in sorted(sweep.glob("*/pipeline.json")):
        state = json.loads(path.read_text())
        if state["method"] == "fire":
            state["phases"]["sft"]["summary"] = {"fire/dfi_after": 0.5 + state["seed"]}
            path.write_text(json.dumps(state))
    text, _ = build_report(sweep)
    header = next(line for line in text.splitlines() if "seeds" in line and line.startswith("| "))
    assert [c.strip() for c in header.split("|")[1:-1]][-2:] == ["fire/dfi_after", "minutes"]
    fire = next(line for line in text.splitlines() if line.startswith("| fire"))
    assert [c.strip() for c in fire.split("|")[1:-1]][-2] == f"{1.5:.4f} ± {1.0:.4f}"
    warm = next(line for line in text.splitlines() if line.startswith("| warm"))
    assert [c.strip() for c in warm.split("|")[1:-1]][-2] == "-"


@pytest.mark.parametrize("logger_name", ["csv", "tensorboard"])
def test_a_plain_lightning_run_is_reported_with_its_methods_summary(tmp_path, logger_name):
    """``lightning_logs/version_0`` of a Trainer nobody configured for the report: its last values, FIRE's
    summary columns, one seed shown as the value alone."""
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
    from tiny import TinyMLPModule, cpu_trainer, regression_loader

    from plasticity_callbacks import FIREReinit, Schedule
    from plasticity_callbacks.app.report.metric_logs import read_rows

    if logger_name == "tensorboard":
        pytest.importorskip("tensorboard")
    logger = (CSVLogger if logger_name == "csv" else TensorBoardLogger)(save_dir=tmp_path, name="lightning_logs")
    trainer = cpu_trainer(max_steps=6, val_check_interval=3, logger=logger, log_every_n_steps=1,
                          callbacks=[FIREReinit(schedule=Schedule(steps=[2]))])
    trainer.fit(TinyMLPModule(), regression_loader(), regression_loader(seed=1))
    version = tmp_path / "lightning_logs" / "version_0"
    rows = read_rows(version, None)  # the logger's own rows, CSV or TensorBoard
    last_val = [r["val/loss"] for r in rows if "val/loss" in r][-1]
    dfi_after = [r["fire/dfi_after"] for r in rows if "fire/dfi_after" in r][-1]
    assert dfi_after < 1e-3  # FIRE acted, so the column below reports a real value

    text, figures = build_report(tmp_path / "lightning_logs")
    header, _, row = [line for line in text.splitlines() if line.startswith("|")]
    cells = dict(zip([c.strip() for c in header.split("|")[1:-1]], [c.strip() for c in row.split("|")[1:-1]]))
    assert cells["runs (what varies)"] == "version_0" and cells["seeds"] == "1"
    assert cells["final val loss"] == f"{last_val:.4f}" and cells["fire/dfi_after"] == f"{dfi_after:.4f}"
    assert float(cells["fire/dfi_before"]) > 0.1 and "±" not in row
    assert [p.name for p in figures] == ["loss_curves.png"]
    assert build_report(version)[0].count("| version_0 |") == 1  # the version folder itself is a run too


def test_one_seed_is_the_value_alone_and_several_seeds_mean_and_std(sweep):
    for path in sorted(sweep.glob("*/pipeline.json")):
        if json.loads(path.read_text())["seed"] > 0:
            shutil.rmtree(path.parent)
    text, _ = build_report(sweep)
    fire = next(line for line in text.splitlines() if line.startswith("| fire"))
    assert [c.strip() for c in fire.split("|")[1:-1]][1:3] == ["1", f"{1.8:.4f}"]
    assert "±" not in fire


# The tables and columns of MLflow's SQLAlchemy tracking store (mlflow/store/tracking/dbmodels/models.py) that
# the report reads; mlflow itself is not needed to read them (nor installed in CI).
MLFLOW_SCHEMA = """
CREATE TABLE runs (run_uuid VARCHAR(32) PRIMARY KEY, name VARCHAR(250), status VARCHAR(9), start_time BIGINT,
                   end_time BIGINT, lifecycle_stage VARCHAR(20), artifact_uri VARCHAR(200), experiment_id INTEGER);
CREATE TABLE metrics (key VARCHAR(250) NOT NULL, value FLOAT NOT NULL, timestamp BIGINT NOT NULL,
                      run_uuid VARCHAR(32) NOT NULL, step BIGINT NOT NULL, is_nan BOOLEAN NOT NULL,
                      PRIMARY KEY (key, timestamp, step, run_uuid, value, is_nan));
"""


def test_a_pipeline_logged_to_mlflow_is_read_from_its_store(sweep):
    """``logger=mlflow``: one MLflow run per phase in ``<run>/mlflow.db``; a resumed phase adds a run of the same
    name; a deleted run is left out. Its curves are drawn as a CSV run's are."""
    import sqlite3

    from plasticity_callbacks.app.report.metric_logs import read_rows

    run = next(p.parent for p in sorted(sweep.glob("*/pipeline.json")))
    expected = {phase: read_rows(run, phase) for phase in ("pretrain", "sft")}
    shutil.rmtree(run / "logs")
    db = sqlite3.connect(run / "mlflow.db")
    db.executescript(MLFLOW_SCHEMA)
    runs = [("a", "pretrain", 1, "active"), ("b", "sft", 2, "active"), ("c", "sft", 3, "active"),
            ("d", "sft", 4, "deleted")]
    db.executemany("INSERT INTO runs (run_uuid, name, start_time, lifecycle_stage) VALUES (?, ?, ?, ?)", runs)
    clock = iter(range(1000, 2000))
    for phase, rows in expected.items():
        for row in rows:
            uuid = "a" if phase == "pretrain" else ("b" if row["step"] <= 5 else "c")  # sft resumed after step 5
            db.executemany("INSERT INTO metrics VALUES (?, ?, ?, ?, ?, 0)",
                           [(k, v, next(clock), uuid, row["step"]) for k, v in row.items() if k != "step"])
    db.execute("INSERT INTO metrics VALUES ('val/loss', 99.0, 1, 'b', 10, 0)")  # an older value, replaced below
    db.execute("INSERT INTO metrics VALUES ('val/loss', 77.0, 5000, 'd', 10, 0)")  # a deleted run's
    db.commit()
    db.close()
    for phase, rows in expected.items():
        got = read_rows(run, phase)
        assert [r["step"] for r in got] == [r["step"] for r in rows]
        assert all(g[k] == pytest.approx(v) for g, r in zip(got, rows) for k, v in r.items() if k != "epoch")
    text, figures = build_report(sweep)
    assert {"loss_curves.png", "dormant_fraction.png"} <= {p.name for p in figures}


def test_a_run_folders_callback_target_is_not_imported(tmp_path, monkeypatch, caplog):
    """A run folder is data: a ``_target_`` module planted beside it (found first on ``sys.path``) never runs,
    the summary of a built-in callback is still read, and the skipped one is named with the opt-in."""
    import sys

    fake_single_fit(tmp_path / "run", seed=0, lr=0.1)
    (tmp_path / "run" / ".hydra" / "config.yaml").write_text(
        "seed: 0\ncallbacks:\n  mine: {_target_: planted_callback.Mine}\n"
        "  fire: {_target_: plasticity_callbacks.FIREReinit}\n")
    (tmp_path / "planted_callback.py").write_text(
        "import pathlib\npathlib.Path(__file__).with_name('ran').write_text('code ran')\n"
        "class Mine:\n    summary_metrics = ('mine/x',)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("PLASTICITY_TRUST_CHECKPOINTS", raising=False)
    from plasticity_callbacks.app.report.runs import summary_names

    assert summary_names(["planted_callback.Mine", "plasticity_callbacks.FIREReinit"]) == ["fire/dfi_before",
                                                                                           "fire/dfi_after"]
    build_report(tmp_path / "run")
    assert not (tmp_path / "ran").exists() and "planted_callback" not in sys.modules
    assert "planted_callback.Mine's summary metrics are not read" in caplog.text
    assert "PLASTICITY_TRUST_CHECKPOINTS=1" in caplog.text
    monkeypatch.setenv("PLASTICITY_TRUST_CHECKPOINTS", "1")  # the user's opt-in: then it is read
    assert summary_names(["planted_callback.Mine"]) == ["mine/x"] and (tmp_path / "ran").exists()
    monkeypatch.delitem(sys.modules, "planted_callback")


def test_a_pipelines_loss_figure_shows_the_training_loss_at_every_logged_step(sweep, monkeypatch):
    """Validation runs every few hundred steps in the main job; the training loss, logged every few steps, is what
    shows the jump at the phase boundary as more than one segment."""
    from plasticity_callbacks.app.report import runs as report_runs

    drawn = {}

    def record(path, panels, title=None):
        drawn[path.name] = panels
        return path

    monkeypatch.setattr(report_runs, "metric_figure", record)
    build_report(sweep)
    panels = {panel.title: panel for panel in drawn["loss_curves.png"]}
    assert list(panels) == ["training loss, current phase's data", "validation loss, current phase's data",
                            "retention: validation loss on 'pretrain' data"]
    train = panels["training loss, current phase's data"]
    assert train.boundaries == [10] and sorted(train.series) == ["fire", "warm"]
    assert sorted(train.series["fire"][0]) == [0, 5, 10, 15, 20]  # both phases' logged steps, on the run's steps


def test_the_zoom_row_only_where_several_curves_are_compared():
    from plasticity_callbacks.app.report.runs import Panel, zoom_row

    wide = {"a": [{0: 10.0, 10: 1.0}], "b": [{0: 9.0, 10: 1.1}]}  # a factor 10 squeezes the ends together
    values = {"loss": [v for series in wide.values() for curve in series for v in curve.values()]}
    assert zoom_row([Panel("loss", "nats", wide)], values)
    alone = {"a": wide["a"]}
    assert not zoom_row([Panel("loss", "nats", alone)], {"loss": [10.0, 1.0]})  # one run: nothing to zoom on
    narrow = {"a": [{0: 2.0, 10: 1.5}], "b": [{0: 2.1, 10: 1.6}]}
    assert not zoom_row([Panel("loss", "nats", narrow)], {"loss": [2.0, 1.5, 2.1, 1.6]})


@pytest.mark.parametrize("files, named", [
    ({"pipeline.json": "{"}, "pipeline.json"),
    ({"pipeline.json": '{"method": "x", "seed": 0, "phases": {"fit": "x"}}'}, "pipeline.json"),
    ({"pipeline.json": '{"method": "x", "seed": 0, "phases": {"fit": {"step_offset": 0, "val_loss": "low"}}}'},
     "pipeline.json"),
    ({"stream.json": "[1]", "tasks.csv": "task,accuracy\n0,0.5\n"}, "stream.json"),
    ({"stream.json": '{"seed": 0}', "tasks.csv": "task,accuracy\n0,abc\n"}, "tasks.csv"),
    ({"stream.json": '{"seed": 0}', "tasks.csv": "task,acc\n0,0.5\n"}, "tasks.csv"),
])
def test_a_damaged_or_foreign_run_folder_file_is_one_line_naming_it(tmp_path, capsys, files, named):
    from plasticity_callbacks.app.report import main

    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(SystemExit) as exit_:
        main([str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 1 and len(err.splitlines()) == 1 and str(tmp_path / named) in err, err
