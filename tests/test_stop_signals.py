"""A stop signal to any one rank, or to all, stops a 2-rank run cleanly: every rank ends the same step, one
checkpoint is saved and verified, every process exits with 128 + signal (no hang, no traceback), and the run
resumed with ``ckpt_path=last`` ends at the uninterrupted run's weights and metric rows.

``plasticity-train experiment=smoke`` (6 steps, validated and checkpointed every 3) on 2 gloo ranks with
Shrink & Perturb every 2 steps; ``fault_injection.SignalAt`` sends SIGTERM to the process of one rank (or of
both) after a training step: step 4 ends without a validation, step 3 with one.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import metric_rows
import torch

from plasticity_callbacks.app.runs.checkpoints import read_checkpoint, verify_file

from test_resume_trust import copy_run

TESTS = Path(__file__).parent
RUN = ["experiment=smoke", "validate_before_fit=false", "+callbacks=shrink_perturb",
       "callbacks.shrink_perturb.schedule={every_n_steps: 2}"]
RESUME = ["ckpt_path=last", "resume_allow_changes=[callbacks.stop]"]


def stop(step: int, rank: int | None) -> str:
    return f"+callbacks.stop={{_target_: fault_injection.SignalAt, step: {step}, rank: {'null' if rank is None else rank}}}"


def launch(run_dir: Path, trainer: str, *overrides: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([os.environ.get("PYTHONPATH", ""),
                                                                            str(TESTS)]))
    env.pop("LOCAL_RANK", None)
    # A hang is the failure looked for: the timeout ends it (SIGKILL: a held SIGTERM would not).
    return subprocess.run(["timeout", "-s", "KILL", "300", sys.executable, "-m", "plasticity_callbacks.app.train",
                           *RUN, f"trainer={trainer}", *overrides, f"hydra.run.dir={run_dir}"],
                          cwd=run_dir.parent, env=env, capture_output=True, text=True)


def assert_stopped(proc: subprocess.CompletedProcess, step: int) -> None:
    """Exit 143 for the job, every rank too (rank 0 names one that ended otherwise), and no traceback."""
    out = proc.stdout + proc.stderr
    assert proc.returncode == 143, out[-4000:]
    assert f"stopped by SIGTERM at step {step}" in proc.stderr and "exited with status" not in proc.stderr, out[-4000:]
    assert "Traceback" not in out and "Error" not in proc.stderr, out[-4000:]



def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return read_checkpoint(verify_file(run_dir / "checkpoints" / "last.ckpt"))["state_dict"]


def assert_same_weights(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    assert set(expected) == set(got)
    for name, weight in expected.items():
        torch.testing.assert_close(got[name], weight, rtol=0, atol=0, msg=name)


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    """``{"full": run, "rank 0": run, "rank 1": run, "both": run, "resumed": run}``: ``rank 1`` is a copy of
    the rank-1 stop taken at the stop, ``resumed`` that run resumed in place to the end."""
    root = tmp_path_factory.mktemp("ddp_stop")
    runs = {"full": root / "full", "rank 0": root / "rank0", "resumed": root / "resumed", "both": root / "both"}
    done = launch(runs["full"], "ddp")
    assert done.returncode == 0, done.stderr[-4000:]
    for name, step, rank in [("rank 0", 4, 0), ("resumed", 3, 1), ("both", 4, None)]:
        assert_stopped(launch(runs[name], "ddp", stop(step, rank)), step)
    runs["rank 1"] = copy_run(runs["resumed"], root / "rank1")
    again = launch(runs["resumed"], "ddp", stop(3, 1), *RESUME)
    assert again.returncode == 0, again.stderr[-4000:]
    return runs


@pytest.mark.multiprocess  # its fixture trains on 2 ranks
def test_a_signal_to_one_rank_or_both_stops_every_rank_at_the_same_step_with_one_checkpoint(ddp):
    at_step_4 = [read_checkpoint(ddp[name] / "checkpoints" / "last.ckpt") for name in ("rank 0", "both")]
    assert [checkpoint["global_step"] for checkpoint in at_step_4] == [4, 4]
    assert_same_weights(at_step_4[1]["state_dict"], at_step_4[0]["state_dict"])  # the same stop, whichever rank
    assert read_checkpoint(ddp["rank 1"] / "checkpoints" / "last.ckpt")["global_step"] == 3
    for name in ("rank 0", "rank 1", "both"):  # one checkpoint, nothing half-written beside it
        assert sorted(p.name for p in (ddp[name] / "checkpoints").iterdir()) == ["last.ckpt", "last.ckpt.sha256"]


@pytest.mark.multiprocess  # its fixture trains on 2 ranks
def test_a_run_stopped_through_one_rank_resumes_to_the_uninterrupted_run(ddp):
    full = weights(ddp["full"])
    assert read_checkpoint(ddp["full"] / "checkpoints" / "last.ckpt")["global_step"] == 6
    assert_same_weights(full, weights(ddp["resumed"]))
    assert any(not torch.equal(weights(ddp["rank 1"])[k], v) for k, v in full.items())  # steps 4-6 were trained
    rows = metric_rows(ddp["full"])
    assert [row["step"] for row in rows if row.get("shrink_perturb/norm_ratio")] == ["2", "4"]
    assert metric_rows(ddp["resumed"]) == rows  # every row once, the validation of the stop step included


@pytest.mark.multiprocess
def test_a_signal_to_fsdp2_rank_0_alone_stops_every_rank_with_one_verified_checkpoint_folder(tmp_path):
    run = tmp_path / "run"
    assert_stopped(launch(run, "fsdp2", stop(4, 0)), 4)
    last = run / "checkpoints" / "last.ckpt"
    assert last.is_dir() and read_checkpoint(verify_file(last), mmap=True)["global_step"] == 4
