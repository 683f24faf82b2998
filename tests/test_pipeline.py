"""The multi-phase pipeline: CLI run with per-phase checkpoints and metrics, restart from a
completed phase, resume mid-phase, optimizer carry-over, and config errors."""
import csv
import json
import os

import pytest
import torch
from helpers import compose_pipeline
from hydra_app import run_train
from omegaconf import OmegaConf

from plasticity_callbacks.app.runs import verified_files
from plasticity_callbacks.errors import ConfigError
from plasticity_callbacks.app.pipeline import Pipeline, with_saved_moments
from plasticity_callbacks.app.train import config_dir


def rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """Pretrain → SFT with Shrink & Perturb at the boundary, from the command line, its standard output redirected
    to a file (``plasticity-train > out.log``) with the progress display on, as a batch job runs it."""
    run = tmp_path_factory.mktemp("pipeline") / "run"
    console = run.parent / "out.log"
    with open(console, "w") as stdout:
        proc = run_train("experiment=pipeline_smoke", "+method=sp", "trainer.enable_progress_bar=true",
                         f"hydra.run.dir={run}", cwd=run.parent, timeout=600, stdout=stdout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return run, console.read_text() + proc.stderr


@pytest.mark.cli
def test_cli_writes_checkpoints_metrics_and_summary(cli_run):
    run, output = cli_run
    for phase in ("pretrain", "sft"):
        assert (run / "checkpoints" / phase / "final.ckpt").is_file()
        assert (run / "checkpoints" / phase / "last.ckpt").is_file()
    state = json.loads((run / "pipeline.json").read_text())
    assert state["method"] == "sp" and list(state["phases"]) == ["pretrain", "sft"]
    pretrain, sft = state["phases"].values()
    assert sft["step_offset"] == pretrain["steps"] == 4
    assert pretrain["retention_loss"] == pretrain["val_loss"]
    assert sft["retention_loss"] is not None and sft["retention_loss"] != sft["val_loss"]
    assert sft["dormant_fraction"] is not None
    sft_rows = rows(run / "logs" / "sft" / "metrics.csv")
    assert any(r["retention/pretrain/loss"] for r in sft_rows) and any(r["val/loss"] for r in sft_rows)
    assert sum(bool(r.get("shrink_perturb/norm_ratio")) for r in sft_rows) == 1  # applied once, at the boundary
    assert "shrink_perturb/norm_ratio" not in rows(run / "logs" / "pretrain" / "metrics.csv")[0]
    assert "pipeline summary (method sp" in output and "retention" in output
    # the final checkpoint of phase 1 is what phase 2 started from: same validation loss before the method
    saved = torch.load(run / "checkpoints" / "pretrain" / "final.ckpt", weights_only=False)
    assert saved["global_step"] == 4 and "optimizer_states" in saved


@pytest.mark.cli
def test_restart_from_a_completed_phase_and_resume_mid_phase(cli_run, tmp_path, monkeypatch):
    run, _ = cli_run
    first = json.loads((run / "pipeline.json").read_text())["phases"]
    # re-run phase 2 with another method, in a new run dir, from phase 1's checkpoint
    other = tmp_path / "other"
    cfg = compose_pipeline(other, "+method=warm", "pipeline.start_phase=sft",
                           f"pipeline.init_from={run}/checkpoints/pretrain/final.ckpt")
    state = Pipeline(cfg).run()
    assert list(state["phases"]) == ["sft"] and state["phases"]["sft"]["step_offset"] == 4
    # the weights came from phase 1: the same validation loss before the boundary as in the first run
    assert state["phases"]["sft"]["val_loss_before"] == pytest.approx(first["sft"]["val_loss_before"], rel=1e-6)
    assert not (other / "checkpoints" / "pretrain").exists()

    # interrupted phase 2: only its mid-phase last.ckpt (step 4) is left; resume and extend it to 6 steps
    (other / "checkpoints" / "sft" / "final.ckpt").unlink()
    cfg = compose_pipeline(other, "+method=warm", "pipeline.start_phase=sft", "pipeline.resume=true",
                           f"pipeline.init_from={run}/checkpoints/pretrain/final.ckpt", "phases.sft.steps=6")
    before_boundary = state["phases"]["sft"]["val_loss_before"]
    last = (other / "checkpoints" / "sft" / "last.ckpt").stat()
    hashed = []
    real = verified_files.sha256_of_file

    def counting(path, *args, **kwargs):
        stat = os.stat(path)
        hashed.append((stat.st_ino, stat.st_size, stat.st_mtime_ns))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(verified_files, "sha256_of_file", counting)
    state = Pipeline(cfg).run()
    # verified at start-up, by the phase's resume guard and by Lightning's load: read from disk once
    assert hashed.count((last.st_ino, last.st_size, last.st_mtime_ns)) == 1
    sft = state["phases"]["sft"]
    assert sft["steps"] == 6 and sft["val_loss_before"] == before_boundary  # kept across the resume
    assert torch.load(other / "checkpoints" / "sft" / "final.ckpt", weights_only=False)["global_step"] == 6
    train_steps = [int(r["step"]) for r in rows(other / "logs" / "sft" / "metrics.csv") if r["train/loss"]]
    assert train_steps == list(range(6))  # the log of steps 0-3 survived the resume


def test_carried_optimizer_state_keeps_new_learning_rates():
    model = torch.nn.Linear(3, 2)
    old = torch.optim.AdamW(model.parameters(), lr=1.0)
    model(torch.randn(4, 3)).sum().backward()
    old.step()
    new = torch.optim.AdamW(model.parameters(), lr=0.25)
    new.load_state_dict(with_saved_moments(new.state_dict(), old.state_dict()))
    assert new.param_groups[0]["lr"] == 0.25
    for p in model.parameters():
        assert torch.equal(new.state[p]["exp_avg"], old.state[p]["exp_avg"])
    with pytest.raises(ConfigError, match="carry_optimizer"):
        with_saved_moments(new.state_dict(), {"optimizers": [old.state_dict()]})


@pytest.mark.parametrize("override,message", [
    ("phases.sft.steps=0", "phases.sft.steps"),
    ("+phases.sft.learning_rate=1", "phases.sft has unknown keys"),
    ("pipeline.start_phase=finetune", "pipeline.start_phase='finetune'"),
    ("+phases.pretrain.retention=[sft]", "retention"),
])
def test_config_errors_name_the_field(tmp_path, override, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        Pipeline(compose_pipeline(tmp_path, override))


def test_missing_checkpoint_for_start_phase_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="run the earlier phase first"):
        Pipeline(compose_pipeline(tmp_path, "pipeline.start_phase=sft", "+method=warm")).run()


@pytest.mark.slow  # every method's callbacks built: tens of seconds
def test_every_method_composes_into_boundary_callbacks(tmp_path):
    from pathlib import Path

    refused = []
    for path in sorted(Path(config_dir(), "method").glob("*.yaml")):
        cfg = compose_pipeline(tmp_path, f"+method={path.stem}")
        try:
            pipeline = Pipeline(cfg)
        except ConfigError as err:  # a setting of another model (l2, ln_wd: the digits classifier's), by name
            assert "which the run's model config does not have" in str(err), path.stem
            refused.append(path.stem)
            continue
        first, second = pipeline.phases
        assert set(pipeline.method.callbacks or {}) <= set(second.callbacks)
        assert set(first.callbacks) == set(OmegaConf.to_container(cfg.callbacks))  # the method is not in phase 1
    assert refused == ["l2", "ln_wd"]


@pytest.mark.cli
def test_a_redirected_run_prints_plain_progress_lines_and_each_banner_once_per_phase(cli_run):
    run, output = cli_run
    assert "\r" not in output and "\x1b[" not in output  # no bar redrawn into the file
    steps = [line for line in output.splitlines() if line.startswith(("pretrain: step", "sft: step"))]
    assert steps[0].startswith("pretrain: step 1/4 (25 %)") and steps[-1].startswith("sft: step 4/4 (100 %)")
    assert len(steps) == 8, steps  # pipeline_smoke: 4 steps a phase, a line per step (a tenth of 4, at least 1)
    # each phase validates, fits and validates again with one ReDoMonitor: it says what it watches once
    assert output.count("ReDoMonitor watches") == 2, output
    assert output.count("ReDoMonitor watches") == (run / "train.log").read_text().count("ReDoMonitor watches")


@pytest.mark.cli
def test_cli_run_logs_to_train_log_draws_figures_and_says_where_outputs_are(cli_run):
    run, output = cli_run
    log = (run / "train.log").read_text()
    assert "phase 1/2 'pretrain'" in log and "phase 2/2 'sft'" in log and "pipeline summary" in log
    for figure in ("loss_curves.png", "dormant_fraction.png"):
        assert (run / "report" / figure).read_bytes()[:4] == b"\x89PNG"
    assert f"outputs in {run}" in output and f"figures      {run / 'report' / 'loss_curves.png'}" in output
    assert output.count("GPU available") == 1 and output.count("Tip:") <= 1  # once, not once per phase
    assert "LeafSpec" not in output
