"""``plasticity-train trainer=fsdp2`` resumes: a distributed checkpoint (a folder of shards) is written aside,
checksummed and renamed like a file checkpoint, checked before anything starts, and a run stopped by SIGTERM
and resumed with ``ckpt_path=last`` ends at the uninterrupted run's weights and metric rows.

Three 2-rank launches of the package GPT (``experiment=smoke``: 6 steps, validated and checkpointed every 3)
with Shrink & Perturb every 2 steps, shared by the tests: uninterrupted, stopped at step 4, resumed. The
refusals run in this process (they happen before Hydra or any rank starts).
"""
from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import metric_rows
import torch

from plasticity_callbacks.app.runs.checkpoint_folders import verify_folder
from plasticity_callbacks.errors import CheckpointError
from plasticity_callbacks.app.runs.checkpoints import read_checkpoint
from plasticity_callbacks.app.runs.verified_files import checksum_path

from fault_injection import Payload, hostile_shard_item
from test_resume_trust import copy_run, refused, snapshot

pytestmark = [pytest.mark.cli, pytest.mark.multiprocess]  # every test reads the 2-rank launches
TESTS = Path(__file__).parent
RUN = ["experiment=smoke", "trainer=fsdp2", "validate_before_fit=false", "+callbacks=shrink_perturb",
       "callbacks.shrink_perturb.schedule={every_n_steps: 2}"]
STOP = "+callbacks.stop={_target_: fault_injection.SignalAt, step: 4}"
RESUME = ["ckpt_path=last", "resume_allow_changes=[callbacks.stop]"]


def launch(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([os.environ.get("PYTHONPATH", ""),
                                                                            str(TESTS)]))
    env.pop("LOCAL_RANK", None)
    return subprocess.run([sys.executable, "-m", "plasticity_callbacks.app.train", *RUN, *overrides,
                           f"hydra.run.dir={run_dir}"], cwd=run_dir.parent, env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``(uninterrupted, resumed, stopped)``: run directories; ``stopped`` is a copy taken at the stop."""
    root = tmp_path_factory.mktemp("fsdp2_cli")
    full, resumed = root / "full", root / "resumed"
    done = launch(full)
    assert done.returncode == 0, done.stderr[-4000:]
    stopped = launch(resumed, STOP)
    assert stopped.returncode == 143, stopped.stderr[-4000:]
    assert "stopped by SIGTERM at step 4" in stopped.stderr, stopped.stderr[-2000:]
    copy = copy_run(resumed, root / "stopped")
    again = launch(resumed, *RESUME)
    assert again.returncode == 0, again.stderr[-4000:]
    return full, resumed, copy



def test_a_stopped_fsdp2_run_resumed_with_ckpt_path_last_ends_at_the_uninterrupted_run(runs):
    full, resumed, stopped = runs
    last = stopped / "checkpoints" / "last.ckpt"
    assert last.is_dir() and checksum_path(last).is_file()  # a distributed checkpoint, checksummed
    assert read_checkpoint(last, mmap=True)["global_step"] == 4
    expected = read_checkpoint(full / "checkpoints" / "last.ckpt")
    got = read_checkpoint(resumed / "checkpoints" / "last.ckpt")
    assert expected["global_step"] == got["global_step"] == 6
    assert set(expected["state_dict"]) == set(got["state_dict"])
    for name, weight in expected["state_dict"].items():
        torch.testing.assert_close(got["state_dict"][name], weight, rtol=0, atol=0, msg=name)
    started = read_checkpoint(stopped / "checkpoints" / "last.ckpt")["state_dict"]
    assert any(not torch.equal(started[k], expected["state_dict"][k]) for k in started)  # steps 5, 6 were trained
    rows = metric_rows(full)
    assert [row["step"] for row in rows if row.get("shrink_perturb/norm_ratio")] == ["2", "4"]  # 6 ends the fit
    assert metric_rows(resumed) == rows  # every row once: none lost or repeated at the stop


def corrupt_shard(folder: Path) -> None:
    shard = folder / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one byte flipped
    shard.write_bytes(bytes(data))


def truncate_shard(folder: Path) -> None:
    shard = folder / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-100])


def drop_index(folder: Path) -> None:
    (folder / ".metadata").unlink()


def truncate_unverified(folder: Path) -> None:
    checksum_path(folder).unlink()  # a folder without checksums: the index still tells a shard is short
    truncate_shard(folder)


@pytest.mark.parametrize("damage, words", [(corrupt_shard, "SHA-256"), (truncate_shard, "truncated"),
                                           (drop_index, "lacks .metadata"), (truncate_unverified, "shorter than"),
                                           (shutil.rmtree, "does not exist")])
def test_a_damaged_or_missing_checkpoint_folder_is_refused_in_one_line_and_nothing_is_written(
        runs, tmp_path, damage, words, monkeypatch, capsys):
    run = tmp_path / "run"
    shutil.copytree(runs[2], run)
    damage(run / "checkpoints" / "last.ckpt")
    before = snapshot(run)
    line = refused([*RUN, *RESUME, f"hydra.run.dir={run}"], monkeypatch, capsys)
    assert words in line and "last.ckpt" in line, line
    assert snapshot(run) == before


@pytest.mark.parametrize("change, words", [("model.n_embd=32", "model.n_embd"),
                                           ("callbacks.shrink_perturb.shrink=0.5", "callbacks.shrink_perturb.shrink")])
def test_a_changed_configuration_is_refused_against_the_checkpoint_folder(runs, tmp_path, change, words,
                                                                          monkeypatch, capsys):
    run = tmp_path / "run"
    shutil.copytree(runs[2], run)
    before = snapshot(run)
    line = refused([*RUN, *RESUME, change, f"hydra.run.dir={run}"], monkeypatch, capsys)
    assert words in line and "configuration differs" in line, line
    assert snapshot(run) == before


def test_a_model_of_other_shapes_is_named_from_the_folder_index_alone(runs, tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    shutil.copytree(runs[2], run)

    def no_shard_read(*args, **kwargs):
        raise AssertionError("the checks before a resume read shards")

    monkeypatch.setattr("torch.distributed.checkpoint.load", no_shard_read)
    line = refused([*RUN, "ckpt_path=last", "model.n_embd=32", "resume_allow_changes=[callbacks.stop,model.n_embd]",
                    f"hydra.run.dir={run}"], monkeypatch, capsys)
    assert "other shapes" in line and "model.wte.weight (264, 64) in the checkpoint, (264, 32) here" in line, line


def test_an_index_that_needs_code_is_refused_and_its_payload_never_runs(runs, tmp_path):
    folder = tmp_path / "last.ckpt"
    shutil.copytree(runs[2] / "checkpoints" / "last.ckpt", folder)
    marker = tmp_path / "payload_ran"
    (folder / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(CheckpointError, match="needs arbitrary code") as err:
        read_checkpoint(folder, mmap=True)
    assert "\n" not in str(err.value) and not marker.exists()


def test_a_shard_item_that_needs_code_is_refused_before_any_rank_starts(runs, tmp_path, monkeypatch, capsys):
    """The optimizer's param-group settings are pickled bytes inside the shards; one planted there (the folder's
    .sha256 recomputed) is refused in one line, nothing written, its payload never run."""
    run, marker = tmp_path / "run", tmp_path / "payload_ran"
    shutil.copytree(runs[2], run)
    hostile_shard_item(run / "checkpoints" / "last.ckpt", marker)
    before = snapshot(run)
    line = refused([*RUN, *RESUME, f"hydra.run.dir={run}"], monkeypatch, capsys)
    assert "__1_0.distcp (item optimizer_0.param_groups.0.lr) needs arbitrary code to load (io.open)" in line, line
    assert snapshot(run) == before and not marker.exists()


def test_a_copied_run_resumes_its_checkpoint_folder_and_writes_the_next_in_its_place(runs, tmp_path):
    full, _, stopped = runs
    run = tmp_path / "elsewhere"
    shutil.copytree(stopped, run)  # a run directory moved or restored: its checkpoints name the old place
    done = launch(run, *RESUME)
    assert done.returncode == 0, done.stderr[-4000:]
    assert sorted(p.name for p in (run / "checkpoints").glob("last*")) == ["last.ckpt", "last.ckpt.sha256"]
    expected, got = (read_checkpoint(r / "checkpoints" / "last.ckpt") for r in (full, run))
    assert got["global_step"] == expected["global_step"] == 6
    for name, weight in expected["state_dict"].items():
        assert torch.equal(got["state_dict"][name], weight), name


def test_a_folder_write_interrupted_before_its_rename_is_finished_on_read(runs, tmp_path):
    folder = tmp_path / "last.ckpt"
    shutil.copytree(runs[2] / "checkpoints" / "last.ckpt", tmp_path / "last.ckpt.writing")
    shutil.copy(checksum_path(runs[2] / "checkpoints" / "last.ckpt"), checksum_path(folder))
    assert verify_folder(folder) == folder and folder.is_dir() and not (tmp_path / "last.ckpt.writing").exists()
    assert read_checkpoint(folder, mmap=True)["global_step"] == 4


def test_a_pipeline_under_fsdp2_hands_each_phase_its_predecessors_checkpoint_folder(tmp_path):
    """pretrain → SFT on 2 ranks with distributed checkpoints: the SFT phase starts from the pretrain phase's
    ``final.ckpt`` folder. With the SFT learning rate 0 only FIRE (exact polar factor) moves its weights: the untreated embedding
    ends equal to pretrain's, bit for bit, and a treated matrix is a scaled isometry that pretrain's was not."""
    run = tmp_path / "pipeline"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("LOCAL_RANK", None)
    proc = subprocess.run([sys.executable, "-m", "plasticity_callbacks.app.train", "experiment=pipeline_smoke",
                           "+method=fire_exact", "trainer=fsdp2", "phases.sft.optimizer.lr=0.0", f"hydra.run.dir={run}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    folders = [run / "checkpoints" / phase / "final.ckpt" for phase in ("pretrain", "sft")]
    assert all(folder.is_dir() for folder in folders)
    pretrain, sft = (read_checkpoint(folder)["state_dict"] for folder in folders)
    assert torch.equal(sft["model.wte.weight"], pretrain["model.wte.weight"])
    name = "model.blocks.0.mlp.c_fc.weight"  # (128, 32): tall, its Gram matrix s²·I after FIRE
    before, after = pretrain[name].double(), sft[name].double()
    spread = lambda w: (lambda s: float((s.max() - s.min()) / s.max()))(torch.linalg.svdvals(w))  # noqa: E731
    assert spread(before) > 0.1 and spread(after) < 1e-5
