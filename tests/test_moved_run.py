"""Resume follows the run, not its old path: a run directory moved, copied or restored elsewhere resumes from its
newest checkpoint and writes the next one in its place (``last.ckpt``, no ``last-v1.ckpt`` beside it).

Lightning's ``ModelCheckpoint`` keeps the absolute path of the last checkpoint in its state and forgets it when
the directory differs, so after a move it wrote ``last-v1.ckpt``, while ``ckpt_path=last`` and
``pipeline.resume`` read ``last.ckpt``: every later interruption re-trained from the step of the move.
"""
from __future__ import annotations

import io
import shutil
from pathlib import Path

import pytest
from helpers import metric_rows
import torch
from hydra import compose, initialize_config_dir

from plasticity_callbacks.app.runs.checkpoints import (ModelCheckpointAfterValidation, RunInterrupted,
                                                       newest_last_checkpoint, read_checkpoint)
from plasticity_callbacks.app.train import config_dir, fit
from plasticity_callbacks.app.runs.verified_files import write_verified
from plasticity_callbacks.errors import CheckpointError

RUN = ["experiment=smoke", "validate_before_fit=false", "+callbacks=shrink_perturb",
       "callbacks.shrink_perturb.schedule={every_n_steps: 2}"]
RESUME = ["ckpt_path=last", "resume_allow_changes=[callbacks.stop]"]


def stop_at(step: int) -> str:
    return f"+callbacks.stop={{_target_: fault_injection.SignalAt, step: {step}}}"


def fit_in(run_dir: Path, *overrides: str) -> int:
    """``plasticity-train RUN OVERRIDES`` with ``run_dir`` as its run directory, in this process: its exit status."""
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        cfg = compose("config", overrides=[*RUN, *overrides, f"paths.output_dir={run_dir}"])
    try:
        fit(cfg)
    except RunInterrupted as stopped:
        return stopped.code
    return 0



def files(run_dir: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(run_dir)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(run_dir.rglob("*"))}


def test_a_moved_then_copied_run_resumes_from_its_newest_checkpoint_and_ends_at_the_uninterrupted_run(tmp_path):
    full, first = tmp_path / "full", tmp_path / "first"
    assert fit_in(full) == 0
    assert fit_in(first, stop_at(4)) == 143

    moved = tmp_path / "elsewhere" / "moved"
    moved.parent.mkdir()
    shutil.move(first, moved)
    assert fit_in(moved, *RESUME, stop_at(5)) == 143
    checkpoints = moved / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("last*.ckpt")) == ["last.ckpt"]  # no last-v1.ckpt beside it
    assert read_checkpoint(checkpoints / "last.ckpt", mmap=True)["global_step"] == 5

    copied = tmp_path / "copied"
    shutil.copytree(moved, copied)  # the original stays: a restored backup beside the run it came from
    before = files(moved)
    assert fit_in(copied, *RESUME) == 0
    assert files(moved) == before  # the copy's run writes nothing where it came from
    expected, got = (read_checkpoint(run / "checkpoints" / "last.ckpt") for run in (full, copied))
    assert got["global_step"] == expected["global_step"] == 6
    assert sorted(p.name for p in (copied / "checkpoints").glob("last*.ckpt")) == ["last.ckpt"]
    for name, weight in expected["state_dict"].items():
        assert torch.equal(got["state_dict"][name], weight), name
    assert metric_rows(copied) == metric_rows(full)  # every row once, through two interruptions and two moves


def checkpoint_at(path: Path, step: int) -> Path:
    buffer = io.BytesIO()
    torch.save({"global_step": step, "state_dict": {}}, buffer)
    write_verified(buffer.getvalue(), path)
    return path


def test_of_last_and_its_versions_the_newest_step_is_resumed(tmp_path):
    assert newest_last_checkpoint(tmp_path / "none") is None and newest_last_checkpoint(tmp_path) is None
    checkpoint_at(tmp_path / "last.ckpt", 4)
    assert newest_last_checkpoint(tmp_path) == tmp_path / "last.ckpt"
    checkpoint_at(tmp_path / "last-v2.ckpt", 5)  # a directory that drifted: the newest step wins, not the name
    checkpoint_at(tmp_path / "last-v1.ckpt", 7)
    checkpoint_at(tmp_path / "epoch=0-step=9.ckpt", 9)  # not a last checkpoint
    assert newest_last_checkpoint(tmp_path) == tmp_path / "last-v1.ckpt"
    (tmp_path / "last-v2.ckpt").write_bytes(b"damaged")
    with pytest.raises(CheckpointError, match="last-v2.ckpt"):
        newest_last_checkpoint(tmp_path)


def test_a_checkpoint_callback_restored_elsewhere_keeps_its_checkpoints_at_their_new_place(tmp_path):
    old, new = tmp_path / "old", tmp_path / "new"
    saved = {"dirpath": str(old), "last_model_path": str(old / "last.ckpt"), "best_model_path": str(old / "a.ckpt"),
             "kth_best_model_path": str(old / "b.ckpt"), "best_k_models": {str(old / "a.ckpt"): torch.tensor(1.0)},
             "best_model_score": torch.tensor(1.0), "kth_value": torch.tensor(2.0), "monitor": "val/loss"}
    callback = ModelCheckpointAfterValidation(dirpath=new, save_last=True, monitor="val/loss", save_top_k=2)
    callback.load_state_dict(saved)
    assert callback.last_model_path == str(new / "last.ckpt") and callback.best_model_path == str(new / "a.ckpt")
    assert callback.kth_best_model_path == str(new / "b.ckpt") and list(callback.best_k_models) == [str(new / "a.ckpt")]
    assert callback.best_model_score == 1.0
