"""The Hydra configs compose, and ``plasticity-train`` runs end to end from any directory."""
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from hydra_app import compose_config, run_train
from omegaconf import OmegaConf

from plasticity_callbacks.app.train import build_module, config_dir

CONFIGS = Path(config_dir())
REPO = Path(__file__).resolve().parents[1]


def group_options():
    """Every (group, option) pair under configs/, e.g. ("model/mlp", "swiglu")."""
    for path in sorted(CONFIGS.rglob("*.yaml")):
        rel = path.relative_to(CONFIGS)
        if rel.parent != Path(".") and rel.parts[0] != "hydra":
            yield str(rel.parent), rel.stem


@pytest.mark.parametrize("group,option", list(group_options()))
def test_every_config_composes(group, option):
    prefix = "+" if group in ("callbacks", "method") or group.startswith("hparams") else ""
    overrides = [f"{prefix}{group}={option}"]
    if group == "data" and option == "files":
        overrides.append("data.paths=/tmp/*.txt")
    if group == "model" and option.startswith("digits_"):  # the task-stream classifiers, not a GPT
        overrides.append("experiment=continual_digits")
    cfg = compose_config(*overrides)
    OmegaConf.resolve(cfg)
    if group.startswith("model") or group == "optimizer":
        build_module(cfg)  # the model config is valid, not just parseable


@pytest.mark.cli
def test_cli_trains_and_writes_metrics_and_checkpoint(tmp_path):
    proc = run_train("experiment=smoke", f"hydra.run.dir={tmp_path}/run", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "run"
    metrics = (run / "logs" / "metrics.csv").read_text().splitlines()
    assert metrics[0].startswith("epoch,step") and len(metrics) > 5
    assert (run / "checkpoints" / "last.ckpt").is_file()
    assert "run summary" in proc.stdout + proc.stderr


@pytest.mark.cli
def test_bad_config_value_gives_one_line_error(tmp_path):
    proc = run_train("experiment=smoke", "model.mlp=swiglo", f"hydra.run.dir={tmp_path}/run", cwd=tmp_path)
    assert proc.returncode == 2
    err = proc.stderr.strip().splitlines()
    assert any("model.mlp='swiglo'" in line and "swiglu" in line for line in err), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    missing = run_train("model/mlp=swiglo", cwd=tmp_path)
    assert missing.returncode != 0 and "swiglu" in missing.stderr and "Traceback" not in missing.stderr


@pytest.mark.cli
def test_non_editable_install_finds_configs_from_any_directory(tmp_path):
    wheel_dir = tmp_path / "wheel"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(wheel_dir), str(REPO)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-2000:]
    wheel = next(wheel_dir.glob("*.whl"))
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    assert (site / "plasticity_callbacks" / "configs" / "config.yaml").is_file()
    assert (site / "plasticity_callbacks" / "app" / "benchmark_results" / "ranking_runs.json").is_file()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    code = ("from plasticity_callbacks.app.train import config_dir; import plasticity_callbacks, sys; "
            "print(config_dir()); print(plasticity_callbacks.__file__)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=elsewhere, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(site)), timeout=120)
    assert proc.returncode == 0, proc.stderr
    found, package = proc.stdout.split()
    assert Path(found) == site / "plasticity_callbacks" / "configs" and package.startswith(str(site))
    proc = run_train("experiment=smoke", "trainer.max_steps=2", f"hydra.run.dir={tmp_path}/run2", cwd=elsewhere,
                     env={"PYTHONPATH": str(site)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "run2" / "checkpoints" / "last.ckpt").is_file()


@pytest.mark.cli
def test_resume_in_the_same_run_directory_keeps_earlier_metric_rows(tmp_path):
    run = tmp_path / "run"
    first = run_train("experiment=smoke", f"hydra.run.dir={run}", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = run_train("experiment=smoke", "trainer.max_steps=9", "ckpt_path=last", f"hydra.run.dir={run}",
                        cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    lines = (run / "logs" / "metrics.csv").read_text().splitlines()
    header = lines[0].split(",")
    steps = [int(line.split(",")[header.index("step")]) for line in lines[1:]]
    assert set(range(9)) <= set(steps)  # rows of steps 0-5 from the first run survive the resume
    train_steps = [s for s, line in zip(steps, lines[1:]) if line.split(",")[header.index("train/loss")]]
    assert len(train_steps) == len(set(train_steps)), "a step was logged twice"
