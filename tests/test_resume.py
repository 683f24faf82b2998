"""Crash and resume: a run interrupted at a checkpoint and resumed in a fresh process ends exactly
where the uninterrupted run ends, for every callback in the configuration where it acts, and a run
killed by SIGTERM or SIGKILL leaves a usable ``last.ckpt`` and keeps every metric row it logged.

All training runs happen in three worker processes (see resume_harness.py); the sampler tests
run in this process.
"""
from __future__ import annotations

import csv
import importlib
import signal
import shutil
import time
import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import TensorDataset

from plasticity_callbacks.data.sampler import ResumableDataLoader, ResumableSampler
from resume_harness import assert_same_run, load_result, run_resume_scenarios, run_worker
from tiny import TinyMLPModule, cpu_trainer

CB = "plasticity_callbacks."
# 12 steps of 8 batches per epoch: steps 8-11 are epoch 1. Each callback acts every 3 steps (or at
# fit / epoch start), and the run is interrupted at step 5 (or 10): between two of its actions.
SCENARIOS = {
    "no_callback": dict(stop_at=5),
    "no_callback_gpt_muon": dict(model="gpt", optimizer="muon", stop_at=5),
    "redo": dict(stop_at=5, callbacks=[{"_target_": CB + "ReDoMonitor", "tau": 0.5, "collect_every_n_steps": 1,
                                        "log_every_n_steps": 1, "schedule": {"every_n_steps": 3}}]),
    "dash_periodic": dict(stop_at=5, callbacks=[{"_target_": CB + "DASHPeriodic",
                                                 "schedule": {"every_n_steps": 3}, "cosine_threshold": -1.0, "shrink_rate": 0.2}]),
    "dash_paper": dict(stop_at=10, ckpt_every=10, callbacks=[{"_target_": CB + "DASHShrink",
                                                              "schedule": {"at_fit_start": True, "epochs": [1]},
                                                              "n_batches": 2}]),
    "adaptive_svd_project": dict(stop_at=5, callbacks=[{"_target_": CB + "AdaptiveSVDSwitch", "minor_training": "project",
                                                        "schedule": {"every_n_steps": 3, "start_step": 2}, "r_min": 2,
                                                        "save_figure": False, "skip_full_gradient": True}]),
    "adaptive_svd_factorize": dict(stop_at=5, callbacks=[{"_target_": CB + "AdaptiveSVDSwitch", "minor_training": "factorize",
                                                          "schedule": {"every_n_steps": 3, "start_step": 2}, "r_min": 2,
                                                          "save_figure": False}]),
    "shrink_perturb": dict(stop_at=5, callbacks=[{"_target_": CB + "ShrinkPerturb", "shrink": 0.5, "perturb": 0.1,
                                                  "reset_optimizer": True}]),
    "fire": dict(stop_at=5, callbacks=[{"_target_": CB + "FIREReinit",
                                        "schedule": {"at_fit_start": True, "steps": [3, 9]}, "rewarmup_steps": 4}]),
    # The multi-phase pipeline (experiment=pipeline_smoke: pretrain 4 steps, then SFT 4 steps, checkpoints
    # every 2) with Shrink & Perturb at the boundary: interrupted right at the boundary (pretrain done, SFT
    # not started) and in the middle of SFT; resumed with pipeline.resume=true.
    "pipeline_at_boundary": dict(kind="pipeline", stop_phase="sft", final_phase="sft", stop_at=0,
                                 overrides=["experiment=pipeline_smoke", "+method=sp", "validate_before_fit=false"]),
    "pipeline_mid_phase": dict(kind="pipeline", stop_phase="sft", final_phase="sft", stop_at=3,
                               same_reference_as="pipeline_at_boundary",
                               overrides=["experiment=pipeline_smoke", "+method=sp", "validate_before_fit=false"]),
    # FIRE on a plateau of val/loss (patience 1; min_delta so large that no validation improves: it acts at every
    # second validation), SFT of 6 steps validated and checkpointed every 2. Interrupted when the validation of
    # step 4 starts: a checkpoint written before that validation would lose it on resume, and FIRE would act
    # at step 6 only.
    "pipeline_plateau": dict(kind="pipeline", stop_phase="sft", final_phase="sft", stop_at=4, at="validation",
                             overrides=["experiment=pipeline_smoke", "+method=warm", "validate_before_fit=false",
                                        "phases.sft.steps=6", "+phases.sft.callbacks.plateau={_target_: "
                                        "plasticity_callbacks.FIREReinit, schedule: {monitor: val/loss, "
                                        "patience: 1, min_delta: 100.0}}"]),
}
MODULES = {"ReDoMonitor": "redo", "DASHShrink": "dash", "DASHPeriodic": "dash_periodic", "AdaptiveSVDSwitch": "adaptive_svd",
           "ShrinkPerturb": "shrink_perturb", "FIREReinit": "fire"}
SIGNAL_RUN = dict(model="mlp", steps=12, ckpt_every=5, stop_at=7, how="wait")  # checkpoint at 5, killed at 7


def available(spec: dict) -> bool:
    """Callbacks are written in parallel with this file: a scenario runs once its module exists."""
    if spec.get("kind") == "pipeline":
        return importlib.util.find_spec("plasticity_callbacks.app.pipeline") is not None
    names = [c["_target_"].rsplit(".", 1)[-1] for c in spec.get("callbacks", [])]
    return all(importlib.util.find_spec(f"plasticity_callbacks.callbacks.{MODULES[n]}") for n in names)


def complete(spec: dict) -> dict:
    if spec.get("kind") == "pipeline":
        return spec
    return {"model": "mlp", "optimizer": "adamw", "steps": 12, "ckpt_every": 5, **spec}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every scenario, plus one run killed by SIGTERM and one by SIGKILL, each resumed afterwards."""
    tmp = tmp_path_factory.mktemp("resume")
    scenarios = {n: complete(s) for n, s in SCENARIOS.items() if available(s)}
    victims = {}
    for sig in ("SIGTERM", "SIGKILL"):
        out = tmp / sig
        out.mkdir()
        victims[sig] = (out, run_worker(out, [dict(SIGNAL_RUN, out=str(out))], wait=False))
    results = run_resume_scenarios(tmp, scenarios)  # the victims train meanwhile
    killed = {}
    for sig, (out, proc) in victims.items():
        deadline = time.monotonic() + 240
        while not (out / "ready").exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (out / "ready").exists(), f"{sig} victim never reached step 7:\n{(out / 'spec.log').read_text()[-3000:]}"
        proc.send_signal(getattr(signal, sig))
        proc.wait(timeout=120)
        output = (out / "spec.log").read_text()
        metrics = out / "logs" / "metrics.csv"
        killed[sig] = {"returncode": proc.returncode, "output": output,
                       "rows": read_rows(metrics) if metrics.exists() else [],
                       "checkpoint": torch.load(out / "checkpoints" / "last.ckpt", weights_only=False)}
        shutil.copytree(out / "checkpoints", out / "checkpoints_at_kill")
    run_worker(tmp, [dict(SIGNAL_RUN, out=str(out), resume=True, stop_at=None) for out, _ in victims.values()],
               "resume_killed")
    for sig, (out, _) in victims.items():
        killed[sig]["resumed"] = load_result(out)
        killed[sig]["rows_after_resume"] = read_rows(out / "logs" / "metrics.csv")
    reference = results["no_callback"]["reference"]
    return {"scenarios": results, "killed": killed, "reference": reference}


def read_rows(path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def acted(name: str, state: list[dict]) -> bool:
    """The callback changed something in the uninterrupted run (else the comparison proves little)."""
    if not state:
        return True
    s = state[0]
    if name == "redo":
        return int(s["recycled"].sum()) > 0
    if name.startswith("dash"):
        return s["shrinks"] == (3 if name == "dash_periodic" else 2)  # periodic: steps 3, 6, 9; paper: start, epoch 1
    if name.startswith("adaptive_svd"):
        return any(state == "minor" for _, _, state, _ in s["history"])
    if name == "shrink_perturb":
        return s["applications"] == 1
    if name == "pipeline_plateau":
        return any(h.get("global_step") == 4 and h.get("reason", "").startswith("plateau")
                   for c in state for h in c.get("history", []) if isinstance(h, dict))
    if name.startswith("pipeline"):  # the pipeline's boundary method is Shrink & Perturb
        return any(c.get("applications") == 1 for c in state)
    if name == "fire":
        return len(s["history"]) == 3  # fit start, step 3, step 9
    return True


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_resumed_run_ends_where_the_uninterrupted_run_ends(runs, name):
    if name not in runs["scenarios"]:
        pytest.skip(f"the callback of scenario {name!r} does not exist yet")
    result = runs["scenarios"][name]
    if SCENARIOS[name].get("kind") != "pipeline":
        checkpoint = torch.load(result["checkpoint"].with_name(f"stepstep={SCENARIOS[name]['stop_at']}.ckpt"),
                                weights_only=False)
        assert checkpoint["global_step"] == SCENARIOS[name]["stop_at"]
        assert checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"], "the data position was not saved"
    assert acted(name, result["reference"]["callbacks"]), f"{name} did not act: the test would prove nothing"
    assert_same_run(result["reference"], result["resumed"])


@pytest.mark.multiprocess
def test_plateau_run_resumed_between_checkpoint_and_validation_logs_every_validation(runs):
    """The metric rows of the interrupted-and-resumed plateau run are those of the uninterrupted run (timings aside)."""
    if "pipeline_plateau" not in runs["scenarios"]:
        pytest.skip("the pipeline does not exist yet")
    result = runs["scenarios"]["pipeline_plateau"]

    def content(rows):
        return [{k: v for k, v in r.items() if v and not any(t in k for t in ("seconds", "per_sec"))} for r in rows]

    reference, resumed = content(result["reference"]["rows"]), content(result["resumed"]["rows"])
    assert [r["step"] for r in reference if "val/loss" in r] == ["1", "3", "5", "6"]  # steps 2, 4, 6 and the final
    assert resumed == reference


@pytest.mark.multiprocess
def test_resumed_run_is_not_vacuous(runs):
    """Training moved the weights after the interruption point, so equality is not trivial."""
    first = runs["scenarios"]["no_callback"]
    saved = torch.load(first["checkpoint"].with_name("stepstep=5.ckpt"), weights_only=False)["state_dict"]
    final = first["reference"]["params"]
    assert all(not torch.equal(saved[n], final[n]) for n in final)


@pytest.mark.multiprocess
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL"])
def test_killed_run_leaves_a_usable_last_checkpoint_and_resumes(runs, sig):
    killed = runs["killed"][sig]
    if sig == "SIGKILL":
        assert killed["returncode"] == -signal.SIGKILL
        assert killed["checkpoint"]["global_step"] == 5  # the last periodic checkpoint before the kill
    else:
        # Lightning turns SIGTERM into a graceful stop: the current epoch finishes (steps 7, 8 of 8 per
        # epoch), then the run exits, so its last.ckpt is at least the periodic one at step 5.
        assert killed["checkpoint"]["global_step"] >= 5, killed["output"][-2000:]
    assert_same_run(runs["reference"], killed["resumed"], callback_state=False)


@pytest.mark.multiprocess
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL"])
def test_nothing_logged_before_the_kill_is_lost(runs, sig):
    """Every step trained before the signal has its row on disk (the logger writes each row at once)."""
    steps = {int(r["step"]) for r in runs["killed"][sig]["rows"] if r.get("train/loss")}
    assert set(range(7)) <= steps, sorted(steps)


@pytest.mark.multiprocess
@pytest.mark.parametrize("sig", ["SIGKILL"])
def test_rows_logged_before_the_kill_survive_the_resume_once(runs, sig):
    """A hand-built Trainer with ``LogPosition`` and ``restore_logs``: killed at step 7 after the checkpoint of
    step 5, resumed: every step's row once (steps 5 and 6 were logged before the kill and again after it)."""
    steps = [int(r["step"]) for r in runs["killed"][sig]["rows_after_resume"] if r.get("train/loss")]
    assert steps == list(range(12)), steps


# ------------------------------------------------------------------ the resumable sampler, in-process

def dataset(n: int = 20) -> TensorDataset:
    return TensorDataset(torch.arange(n).float()[:, None], torch.zeros(n, 1))


def order(loader) -> list[int]:
    return [int(i) for x, _ in loader for i in x[:, 0]]


def test_sampler_order_is_a_function_of_seed_and_epoch_and_splits_over_ranks():
    ds = dataset()
    a, b = ResumableSampler(ds, seed=3), ResumableSampler(ds, seed=3)
    assert list(a) == list(b) and sorted(a) == list(range(20))
    a.set_epoch(1)
    assert list(a) != list(b) and sorted(a) == list(range(20))
    ranks = [ResumableSampler(ds, num_replicas=2, rank=r, seed=3) for r in (0, 1)]
    assert sorted(list(ranks[0]) + list(ranks[1])) == list(range(20))
    with pytest.raises(ValueError, match="rank=2"):
        ResumableSampler(ds, num_replicas=2, rank=2)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_restarts_mid_epoch_with_exactly_the_remaining_batches(num_workers):
    """With workers the sampler runs ahead of training; the saved position is still the batches handed out."""
    loader = ResumableDataLoader(dataset(), batch_size=3, seed=1, num_workers=num_workers)
    loader.sampler.set_epoch(2)
    full = order(loader)
    it = iter(loader)
    seen = [next(it) for _ in range(2)]
    state = loader.state_dict()
    assert state["epoch"] == 2 and state["samples_seen"] == 6
    fresh = ResumableDataLoader(dataset(), batch_size=3, seed=0)  # the checkpoint's seed wins
    fresh.load_state_dict(state)
    fresh.sampler.set_epoch(2)  # Lightning calls this after loading: same epoch, position kept
    rest = order(fresh)
    assert [int(i) for x, _ in seen for i in x[:, 0]] + rest == full and len(full) == 18  # drop_last: 6 batches
    fresh.sampler.set_epoch(3)  # the next epoch starts from its beginning
    assert len(order(fresh)) == 18


def test_a_side_pass_before_training_does_not_move_the_position():
    """DASHShrink reads batches from the training loader before the first step."""
    loader = ResumableDataLoader(dataset(), batch_size=2, seed=0)
    side = iter(loader)
    next(side)
    main = iter(loader)
    next(main), next(main), next(main)
    next(side)  # the side pass goes on while training runs: it must not be what is saved
    assert loader.state_dict()["samples_seen"] == 6


def test_lightning_saves_and_restores_the_loader_without_the_not_resumable_warning(tmp_path):
    def fit(max_steps, ckpt_path=None):
        L.seed_everything(0)
        loader = ResumableDataLoader(dataset(64), batch_size=8, seed=0)
        module = TinyMLPModule(d_in=1, d_out=1)
        trainer = cpu_trainer(max_steps=max_steps, default_root_dir=tmp_path, callbacks=[
            ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_last=True)], enable_checkpointing=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(module, train_dataloaders=loader, ckpt_path=ckpt_path)
        assert not [w for w in caught if "not resumable" in str(w.message)]
        return module

    fit(3)
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)["loops"]["fit_loop"]["state_dict"]
    assert saved["combined_loader"] == [{"epoch": 0, "seed": 0, "shuffle": True, "samples_seen": 24}]
    resumed = fit(11, ckpt_path="last")
    shutil.rmtree(tmp_path)
    reference = fit(11)
    for (name, p), q in zip(reference.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), name
