"""Every file in ``examples/`` runs, at smoke size, as a user would start it (a subprocess in a scratch folder)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

# example file -> (command after the interpreter or shell, files it must have written, extra it needs)
SMOKE = {
    "pretrain_then_sft.py": (["--steps", "2", "2", "--val-batches", "1"], [], None),
    "plain_loop.py": (["--steps", "6"], [], None),
    "fabric_loop.py": (["--steps", "8"], ["fabric_logs/lightning_logs/version_0/metrics.csv"], None),
    "hf_trainer.py": (["--steps", "4", "--output-dir", "hf_out"], ["hf_out/checkpoint-4/plasticity_callbacks.pt"],
                      "transformers"),
    "method_sweep.sh": (["sweep", "phases.code_a_h.steps=2", "phases.code_i_r.steps=2", "~phases.code_s_z",
                         "validate_before_fit=false", "trainer.val_check_interval=2", "trainer.limit_val_batches=1", "data.batch_size=2",
                         "model.sequence_len=32", "data.sequence_len=32", "checkpoint.every_n_train_steps=2",
                         "callbacks.redo.log_every_n_steps=1"],
                        ["sweep/report/report.md", "sweep/report/loss_curves.png"], "hydra"),
}


def test_every_example_has_a_smoke_run():
    assert sorted(p.name for p in EXAMPLES.iterdir() if p.suffix in (".py", ".sh")) == sorted(SMOKE)


@pytest.mark.cli
@pytest.mark.parametrize("name", sorted(SMOKE))
def test_example_runs(name, tmp_path):
    arguments, outputs, needs = SMOKE[name]
    if needs:
        pytest.importorskip(needs)
    script = EXAMPLES / name
    command = ["bash", str(script)] if script.suffix == ".sh" else [sys.executable, str(script)]
    env = {**os.environ, "METHODS": "fire_exact", "SEEDS": "0"}  # the sweep's rows: one run
    bin_dir = Path(sys.executable).parent  # plasticity-train / plasticity-report beside this interpreter
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    result = subprocess.run(command + arguments, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{name} failed:\n{result.stderr[-3000:]}"
    for output in outputs:
        assert (tmp_path / output).is_file(), f"{name} did not write {output}"
    written = sorted(p.name for p in tmp_path.iterdir())
    expected = sorted({Path(o).parts[0] for o in outputs})
    assert written == expected, f"{name} wrote {written} into its working directory"
