"""Failure semantics of an interrupted run: a resume continues the same run or refuses in one line.

One test (or parametrized family) per failure mode: a missing run or checkpoint, a changed
configuration, an unwritable checkpoint directory, a damaged checkpoint or pipeline.json, a run
directory in use, non-finite statistics, garbage callback state. Each goes through the CLI, the
pipeline or a hand-built ``Trainer`` with the same parts (``VerifiedCheckpointIO``,
``ResumeGuard``, ``RunLock``) a user would add. The plateau run interrupted between its checkpoint
and its validation is in test_resume.py (it shares the worker processes there).
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

import plasticity_callbacks as pc
from plasticity_callbacks.app.pipeline import Pipeline
from plasticity_callbacks.errors import CheckpointError
from plasticity_callbacks.app.runs.checkpoints import VerifiedCheckpointIO, verify_file
from plasticity_callbacks.app.runs.verified_files import write_verified
from plasticity_callbacks.app.runs.resume import ResumeError, ResumeGuard, RunLock

from callback_table import methods
from helpers import compose_pipeline
from hydra_app import compose_config, run_train
from tiny import TinyMLPModule, cpu_trainer, recycle, regression_loader


WARM = ("+method=warm", "validate_before_fit=false")  # the pipeline with no boundary method, no validation before


def cli(*args, cwd):
    return run_train(*args, cwd=cwd, env={"OMP_NUM_THREADS": "1"})


def one_line(text: str) -> str:
    """The error output of a refused run: exactly one line, no traceback."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in text, text[-3000:]
    return lines[0]


def fit_mlp(tmp_path, max_steps, ckpt_path=None, callbacks=(), module=None, every=2):
    """A hand-built Trainer with the resume parts: verified IO, the guard, Lightning's checkpoint callback."""
    module = module or TinyMLPModule()
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=every, save_last=True, save_top_k=0)
    guard = [] if any(isinstance(c, ResumeGuard) for c in callbacks) else [ResumeGuard()]
    trainer = cpu_trainer(max_steps=max_steps, callbacks=[*guard, *callbacks, checkpoint],
                          plugins=[VerifiedCheckpointIO()], enable_checkpointing=True)
    trainer.fit(module, regression_loader(), ckpt_path=ckpt_path)
    return trainer, module


@pytest.fixture(scope="module")
def finished_pipeline(tmp_path_factory):
    """pretrain → SFT, 4 steps each, in-process; the run directory a resume is attempted on."""
    run = tmp_path_factory.mktemp("finished") / "run"
    Pipeline(compose_pipeline(run, *WARM)).run()
    return run


# ------------------------------------------------------------------ 1. checkpoint after its validation
def plateau_fit(tmp_path, interrupt_at=None, resume=False):
    """MLP, validation and checkpoint every 2 steps, FIRE on a plateau at every second validation."""
    from lightning.pytorch import seed_everything
    from plasticity_callbacks.app.runs.checkpoints import ModelCheckpointAfterValidation
    from plasticity_callbacks.data.sampler import ResumableDataLoader
    from resume_worker import Interrupt, Interrupted

    seed_everything(0)
    module = TinyMLPModule()
    fire = pc.FIREReinit(schedule=pc.Schedule(monitor="val/loss", patience=1, min_delta=100.0))
    callbacks = [fire, ModelCheckpointAfterValidation(dirpath=tmp_path / "ckpt", every_n_train_steps=2,
                                                      save_last=True, save_top_k=0)]
    if interrupt_at is not None:
        callbacks.append(Interrupt(interrupt_at, "raise", tmp_path, at="validation"))
    trainer = cpu_trainer(max_steps=8, callbacks=callbacks, val_check_interval=2, check_val_every_n_epoch=None,
                          plugins=[VerifiedCheckpointIO()], enable_checkpointing=True, deterministic=True)
    with contextlib.suppress(Interrupted):
        train = ResumableDataLoader(regression_loader().dataset, batch_size=8, seed=0)  # restarts mid-epoch
        trainer.fit(module, train, regression_loader(n=16, seed=1),
                    ckpt_path="last" if resume == "last" else tmp_path / "ckpt" / "last.ckpt" if resume else None)
    return module, fire


def test_hand_built_plateau_run_interrupted_before_a_validation_resumes_bit_identical(tmp_path):
    reference, fire = plateau_fit(tmp_path / "reference")
    assert [(h["global_step"], h["reason"]) for h in fire.history] == [(4, "plateau of val/loss"),
                                                                       (8, "plateau of val/loss")]
    plateau_fit(tmp_path / "run", interrupt_at=4)  # killed as the validation of step 4 starts
    assert torch.load(tmp_path / "run" / "ckpt" / "last.ckpt", weights_only=False)["global_step"] == 2
    resumed, fire = plateau_fit(tmp_path / "run", resume=True)
    assert [(h["global_step"], h["reason"]) for h in fire.history] == [(4, "plateau of val/loss"),
                                                                       (8, "plateau of val/loss")]
    for (name, p), q in zip(reference.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), name


# ------------------------------------------------------------------ 2. nothing to resume
@pytest.mark.cli
def test_resuming_a_missing_run_is_a_one_line_error_not_a_fresh_start(tmp_path):
    typo = tmp_path / "outptus" / "run"
    proc = cli("experiment=smoke", "ckpt_path=last", f"hydra.run.dir={typo}", cwd=tmp_path)
    assert proc.returncode != 0, "a resume of nothing started a fresh run"
    assert "last.ckpt does not exist" in one_line(proc.stderr)
    with pytest.raises(ResumeError, match="holds no pipeline.json") as err:
        Pipeline(compose_pipeline(typo, *WARM, "pipeline.resume=true")).run()
    assert "\n" not in str(err.value)
    assert not (typo / "checkpoints").exists() and not (typo / "logs").exists()
    with pytest.raises(ResumeError, match='ckpt_path="last" but .*holds no last checkpoint'):  # hand-built Trainer
        plateau_fit(tmp_path / "never_ran", resume="last")


# ------------------------------------------------------------------ 3. changed configuration
@pytest.mark.parametrize("override,key", [
    ("+method=sp", "method.name"),
    ("seed=1", "seed"),
    ("callbacks.redo.tau=0.1", "callbacks.redo.tau"),
    ("model.n_embd=48", "model.n_embd"),
    ("~callbacks.redo", "callbacks.redo <present> -> <absent>"),
])
def test_resume_with_a_changed_configuration_is_refused_naming_the_key(finished_pipeline, override, key):
    overrides = [o for o in ("+method=warm",) if not override.startswith("+method")]
    cfg = compose_config("experiment=pipeline_smoke", *overrides, "validate_before_fit=false", "pipeline.resume=true",
                         override, output_dir=finished_pipeline)
    before = (finished_pipeline / "pipeline.json").read_text()
    with pytest.raises(ResumeError, match=r"configuration differs") as err:
        Pipeline(cfg)
    assert key in str(err.value) and "resume_allow_changes" in str(err.value) and "\n" not in str(err.value)
    assert (finished_pipeline / "pipeline.json").read_text() == before  # nothing was touched


def test_an_allowed_change_resumes(finished_pipeline):
    cfg = compose_pipeline(finished_pipeline, *WARM, "pipeline.resume=true", "seed=1", "resume_allow_changes=[seed]")
    assert Pipeline(cfg).state["seed"] == 1


def test_hand_built_trainer_refuses_a_changed_width_and_a_removed_callback(tmp_path):
    fit_mlp(tmp_path, 2, callbacks=[pc.ReDoMonitor(collect_every_n_steps=1, log_every_n_steps=1)])
    last = tmp_path / "ckpt" / "last.ckpt"
    with pytest.raises(ResumeError, match=r"net\.0\.weight \(16, 8\) in the checkpoint, \(24, 8\) here") as err:
        fit_mlp(tmp_path, 4, ckpt_path=last, module=TinyMLPModule(hidden=24),
                callbacks=[pc.ReDoMonitor(collect_every_n_steps=1, log_every_n_steps=1)])
    assert "\n" not in str(err.value) and "size mismatch" not in str(err.value)
    with pytest.raises(ResumeError, match=r"state of callbacks this run does not have: ReDoMonitor"):
        fit_mlp(tmp_path, 4, ckpt_path=last)  # ReDo's statistics would be dropped
    with pytest.raises(ResumeError, match=r"ReDoMonitor\{.*'tau': 0.025"):  # another tau: another state key
        fit_mlp(tmp_path, 4, ckpt_path=last, callbacks=[pc.ReDoMonitor(tau=0.1, collect_every_n_steps=1)])


# ------------------------------------------------------------------ 4. unwritable checkpoints
@contextlib.contextmanager
def read_only(directory: Path):
    """``directory`` unwritable, also for root (chattr +i where chmod does not stop it); skip where neither works."""
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o555)
    immutable = False
    try:
        if os.access(directory, os.W_OK):
            immutable = subprocess.run(["chattr", "+i", str(directory)], capture_output=True).returncode == 0
        probe = directory / "probe"
        try:
            probe.write_text("x")
            probe.unlink()
            pytest.skip("cannot make a directory read-only here")
        except OSError:
            pass
        yield directory
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(directory)])
        directory.chmod(0o755)


@pytest.mark.cli
def test_a_checkpoint_that_cannot_be_written_stops_the_run_and_no_phase_is_marked_complete(tmp_path):
    run = tmp_path / "run"
    with read_only(run / "checkpoints" / "sft"):
        with pytest.raises(CheckpointError, match=r"could not write checkpoint .*sft") as err:
            Pipeline(compose_pipeline(run, *WARM)).run()
    assert "\n" not in str(err.value)
    state = json.loads((run / "pipeline.json").read_text())
    assert list(state["phases"]) == ["pretrain"]  # sft is not recorded complete
    # a hand-built Trainer with the plugin stops as loudly
    with read_only(tmp_path / "ckpt"), pytest.raises(CheckpointError, match="could not write checkpoint"):
        fit_mlp(tmp_path, 4)


# ------------------------------------------------------------------ 5. damaged files
def damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "empty":
        data = bytearray()
    elif how == "truncated":
        data = data[: len(data) // 2]
    elif how == "garbage":
        data = bytearray(os.urandom(len(data)))
    elif how == "flipped":  # 4 KiB inside the tensor data: still a valid zip, wrong numbers
        start = len(data) // 2
        data[start:start + 4096] = bytes(b ^ 0xFF for b in data[start:start + 4096])
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how,message", [("empty", "is empty"), ("truncated", "bytes, its checksum file records"),
                                         ("garbage", "does not match its recorded SHA-256"),
                                         ("flipped", "does not match its recorded SHA-256")])
def test_a_damaged_checkpoint_is_refused_in_one_line(tmp_path, how, message):
    fit_mlp(tmp_path, 2)
    last = tmp_path / "ckpt" / "last.ckpt"
    damage(last, how)
    with pytest.raises(CheckpointError, match=message) as err:
        fit_mlp(tmp_path, 4, ckpt_path=last)
    assert "last.ckpt" in str(err.value) and "\n" not in str(err.value)
    (tmp_path / "ckpt" / "last.ckpt.sha256").unlink()  # no checksum: still no EOFError or pickle trace
    if how in ("empty", "truncated", "garbage"):
        with pytest.raises(CheckpointError, match="last.ckpt") as err:
            fit_mlp(tmp_path, 4, ckpt_path=last)
        assert "\n" not in str(err.value)


def test_a_write_interrupted_between_its_checksum_and_its_rename_is_completed_on_load(tmp_path):
    """The checksum is recorded before the new file replaces the old one; a kill in between leaves the
    new bytes in ``last.ckpt.writing``, and loading finishes the rename instead of refusing both."""
    path = tmp_path / "last.ckpt"
    write_verified(b"old", path)
    write_verified(b"new", tmp_path / "next.ckpt")
    (tmp_path / "next.ckpt").rename(tmp_path / "last.ckpt.writing")  # the state a kill leaves
    (tmp_path / "next.ckpt.sha256").replace(tmp_path / "last.ckpt.sha256")
    assert verify_file(path) == path and path.read_bytes() == b"new"
    assert not (tmp_path / "last.ckpt.writing").exists()


def test_a_truncated_pipeline_json_is_a_one_line_error(finished_pipeline, tmp_path):
    run = tmp_path / "copy"
    run.mkdir()
    (run / "pipeline.json").write_text((finished_pipeline / "pipeline.json").read_text()[:200])
    with pytest.raises(CheckpointError, match="pipeline.json is not valid JSON") as err:
        Pipeline(compose_pipeline(run, *WARM, "pipeline.resume=true"))
    assert "\n" not in str(err.value)


# ------------------------------------------------------------------ 6. one run per directory
@pytest.mark.cli
def test_a_run_directory_in_use_is_refused(finished_pipeline, tmp_path):
    metrics = (finished_pipeline / "logs" / "sft" / "metrics.csv").read_text()
    # another process holds the directory, as a live run does, until told to let go
    # (plain flock on the lock file, as RunLock takes it: no Lightning import, so the holder starts at once)
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys; "
                               f"f = open({str(finished_pipeline / '.run.lock')!r}, 'a+'); "
                               "fcntl.flock(f, fcntl.LOCK_EX); f.truncate(0); f.write(f'pid {os.getpid()} '); f.flush(); "
                               "print('locked', flush=True); sys.stdin.read()"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(ResumeError, match=rf"in use by a live run \(pid {holder.pid}\)") as err:
            Pipeline(compose_pipeline(finished_pipeline, *WARM, "pipeline.resume=true")).run()
        assert "\n" not in str(err.value)
        with pytest.raises(ResumeError, match="in use by a live run"):
            fit_mlp(tmp_path, 2, callbacks=[ResumeGuard(run_dir=finished_pipeline)])
    finally:
        holder.communicate("", timeout=60)
    assert (finished_pipeline / "logs" / "sft" / "metrics.csv").read_text() == metrics  # untouched
    with RunLock(finished_pipeline):  # free again once the holder ended
        pass


# ------------------------------------------------------------------ 7. non-finite statistics
class SkipsNonFinite(TinyMLPModule):
    """A training step that skips a batch whose loss is not finite (the user's usual guard)."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        return loss if torch.isfinite(loss) else None


def test_a_nan_batch_does_not_blind_redo(tmp_path):
    loader = regression_loader()
    x, y = loader.dataset.tensors
    x[8:16] = float("nan")  # batch 1
    module = SkipsNonFinite()
    with torch.no_grad():  # 4 dead neurons in the first hidden layer: ReDo must keep seeing them
        module.net[0].weight[:4] = 0
        module.net[0].bias[:4] = -1
    redo = pc.ReDoMonitor(tau=0.0, collect_every_n_steps=1, log_every_n_steps=1)
    trainer = cpu_trainer(max_steps=6, callbacks=[redo], log_every_n_steps=1)
    trainer.fit(module, loader)
    assert all(torch.isfinite(p).all() for p in module.parameters())
    state = redo.state_dict()
    assert torch.isfinite(state["ema"]).all() and int(state["nonfinite_batches"].sum()) == 2  # both layers saw it
    scores = redo.scores()
    assert bool(redo.dormant_masks(scores, 0.0)["net.0"][:4].all())
    assert float(trainer.callback_metrics["redo/nonfinite_batches"]) == 2.0
    assert float(trainer.callback_metrics["redo/dead"]) > 0
    poisoned = redo.state_dict()  # as a checkpoint of the old code holds it
    poisoned["ema"][5] = float("nan")
    redo.load_state_dict(poisoned)
    healed = redo.state_dict()
    assert torch.isfinite(healed["ema"]).all() and not bool(healed["observed"][5]) and bool(healed["observed"][6])


def test_weight_std_recycling_next_to_a_nan_row_is_finite():
    up, down = nn.Linear(4, 6), nn.Linear(6, 3)
    with torch.no_grad():
        up.weight[0] = float("nan")
    recycle(up, down, torch.tensor([False, True, False, False, False, False]), init="weight_std")
    assert torch.isfinite(up.weight[1:]).all()
    assert float(up.weight[1].std()) > 0  # re-sampled, not zeroed


def test_adaptive_svd_on_non_finite_weights_skips_naming_itself_and_the_layer():
    module = TinyMLPModule()
    with torch.no_grad():
        module.net[2].weight[3, 1] = float("inf")
    switch = pc.AdaptiveSVDSwitch(schedule=pc.Schedule(steps=[0]), save_figure=False)
    with pytest.warns(RuntimeWarning, match=r"AdaptiveSVDSwitch: .* skipped .*net\.2\.weight.*NaN/Inf"):
        cpu_trainer(max_steps=1, callbacks=[switch]).fit(module, regression_loader())


# ------------------------------------------------------------------ 8. garbage callback state
@pytest.mark.parametrize("name", sorted(methods()))  # every exported method, found: a new one is here too
@pytest.mark.parametrize("state", [{"unrelated": 1}, ["applied"], "garbage"], ids=["wrong_keys", "list", "string"])
def test_garbage_callback_state_is_refused_naming_callback_and_keys(name, state):
    callback = methods()[name]()
    with pytest.raises(CheckpointError, match=rf"{name}\.load_state_dict") as err:
        callback.load_state_dict(state)
    if isinstance(state, dict):
        assert "unrelated" in str(err.value) and "missing keys" in str(err.value)


def test_a_string_is_not_a_flag():
    callback = pc.ShrinkPerturb()
    state = pc.ShrinkPerturb().state_dict()
    state["schedule"]["fit_start_fired"] = "no"
    with pytest.raises(CheckpointError, match=r"fit_start_fired='no' \(must be bool\)"):
        callback.load_state_dict(state)
    assert callback.firing.fit_start_fired is False and callback.applications == 0
    good = pc.FIREReinit()
    good.load_state_dict(pc.FIREReinit().state_dict())  # a real state still loads
