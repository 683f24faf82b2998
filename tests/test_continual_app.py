"""``plasticity-train experiment=continual_digits`` runs a sweep end to end and ``plasticity-report``
turns it into the task-stream table and figure."""

import pytest
from hydra_app import run_train

pytest.importorskip("sklearn")

from plasticity_callbacks.app.report.streams import build_stream_report, find_stream_runs  # noqa: E402

TINY = ["data.num_tasks=3", "data.steps_per_task=6", "data.samples_per_task=128", "data.batch_size=32",
        "model.widths=[16,16]", "trainer.log_every_n_steps=3"]


def train(args, cwd):
    return run_train(*args, cwd=cwd)


@pytest.mark.cli
def test_sweep_and_report(tmp_path):
    pytest.importorskip("plasticity_callbacks.callbacks.schedule")  # the boundary methods take schedule=
    sweep = tmp_path / "sweep"
    proc = train(["-m", "experiment=continual_digits", "+method=warm,fire_exact", "seed=0,1", *TINY,
                  f"hydra.sweep.dir={sweep}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = find_stream_runs(sweep)
    assert sorted((r.label, r.seed) for r in runs) == [("fire_exact", 0), ("fire_exact", 1), ("warm", 0), ("warm", 1)]
    assert all([t["task"] for t in r.tasks] == [0, 1, 2] for r in runs)
    assert all(r.info["chance"] == r.chance == 1 / 10 for r in runs)  # TaskMetrics records the stream's level

    text, figures = build_stream_report(sweep)
    ranked = [line for line in text.splitlines() if line.startswith(("| 1 |", "| 2 |"))]
    assert sorted(line.split(" | ")[1:3] for line in ranked) == [["fire_exact", "2"], ["warm", "2"]]  # two seeds each
    assert "online acc (all tasks)" in text and "end-of-task acc (last 1)" in text and "retained acc" in text
    assert figures[0].is_file() and figures[0].stat().st_size > 10_000
    assert (sweep / "report" / "report.md").is_file()


def test_every_method_runs_in_the_stream_without_a_stream_table():
    """Every method file runs in the stream, warm_reset (the warm + fresh optimizer control) included."""
    from hydra_app import compose_config

    from plasticity_callbacks.app.methods import task_stream_callbacks
    from plasticity_callbacks.app.pipeline import resolve_method

    cfg = compose_config("experiment=continual_digits", "+method=warm_reset")
    assert "stream_methods" not in cfg
    assert list(task_stream_callbacks(resolve_method(cfg))) == ["fresh_optimizer_state"]
