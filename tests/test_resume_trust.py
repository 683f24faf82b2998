"""Trust: loading a checkpoint never runs code, a refusal changes nothing on disk, a checkpoint of
another phase or run is refused, SIGTERM/SIGINT stop with a verified checkpoint and a non-zero
status, and a resumed pipeline keeps every summary value of its phases.

The hostile checkpoint is real: its pickle calls ``open(marker, "w")`` when unpickled with full
trust, and the tests check that the marker file never appears (and that it does appear when the
checkpoint is explicitly trusted, so the payload is not a dud).
"""
from __future__ import annotations

import io
import json
import os
import shutil
import signal
import sys
from pathlib import Path

import pytest
import torch

from plasticity_callbacks.app.pipeline import Pipeline, read_state, write_state
from plasticity_callbacks.app.train import fit, main
from plasticity_callbacks.app.runs.checkpoints import RunInterrupted, VerifiedCheckpointIO, read_checkpoint, verify_file
from plasticity_callbacks.app.runs.verified_files import TRUST_ENV
from plasticity_callbacks.errors import CheckpointError
from plasticity_callbacks.app.runs.resume import ResumeError

from fault_injection import hostile_checkpoint, signal_spec
from helpers import compose_pipeline
from hydra_app import compose_config, run_train
from tiny import TinyMLPModule, cpu_trainer, regression_loader

WARM = ("+method=warm", "validate_before_fit=false")  # the pipeline with no boundary method, no validation before
SMOKE = ["experiment=pipeline_smoke", *WARM]


def cli(*args, cwd, env=None):
    return run_train(*args, cwd=cwd, env={"OMP_NUM_THREADS": "1", **(env or {})})


def refused(args, monkeypatch, capsys) -> str:
    """``plasticity-train ARGS`` in this process: it must exit 1 with one line on stderr (returned)."""
    monkeypatch.setattr(sys, "argv", ["plasticity-train", *args])
    with pytest.raises(SystemExit) as exited:
        main()
    err = capsys.readouterr().err
    assert exited.value.code == 1, err[-2000:]
    return one_line(err)


def one_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in text, text[-3000:]
    return lines[0]


def snapshot(directory: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``directory`` with its size and modification time: equal snapshots = nothing written."""
    if not directory.exists():
        return {}
    return {str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(directory.rglob("*"))}




@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """pretrain done, SFT not started (``stop_phase=pretrain``): the run a resume continues."""
    run = tmp_path_factory.mktemp("pretrained") / "run"
    Pipeline(compose_pipeline(run, *WARM, "pipeline.stop_phase=pretrain")).run()
    return run


def copy_run(run: Path, to: Path) -> Path:
    shutil.copytree(run, to)
    (to / ".run.lock").unlink(missing_ok=True)
    return to


# ------------------------------------------------------------------ 1. loading never runs code
def test_a_checkpoint_that_needs_code_is_refused_in_one_line_and_its_payload_never_runs(tmp_path, monkeypatch):
    monkeypatch.delenv(TRUST_ENV, raising=False)
    marker = tmp_path / "payload_ran"
    path = hostile_checkpoint(tmp_path / "hostile.ckpt", marker)
    with pytest.raises(CheckpointError) as err:
        read_checkpoint(path)
    message = str(err.value)
    assert "\n" not in message and str(path) in message and f"{TRUST_ENV}=1" in message, message
    assert not marker.exists()
    with pytest.raises(CheckpointError):  # Lightning's own loading: trainer.fit(ckpt_path=...) through the IO plugin
        cpu_trainer(max_steps=1, plugins=[VerifiedCheckpointIO()]).fit(TinyMLPModule(), regression_loader(),
                                                                        ckpt_path=str(path))
    assert not marker.exists()
    with pytest.raises(TypeError, match="trust=True"):
        read_checkpoint(path, weights_only=False)
    monkeypatch.setenv(TRUST_ENV, "1")  # the explicit opt-in: the payload is real
    read_checkpoint(path)
    assert marker.exists()


def test_every_checkpoint_the_package_writes_loads_without_trust(pretrained):
    files = sorted(pretrained.glob("checkpoints/**/*.ckpt"))
    assert files
    for path in files:
        torch.load(path, weights_only=True)


@pytest.mark.parametrize("how", ["ckpt_path=file", "ckpt_path=last", "pipeline.resume", "pipeline.init_from"])
def test_the_cli_refuses_a_hostile_checkpoint_before_anything_else(pretrained, tmp_path, how, monkeypatch, capsys):
    marker = tmp_path / "payload_ran"
    if how.startswith("ckpt_path"):
        run = tmp_path / "fit"
        path = hostile_checkpoint(run / "checkpoints" / "last.ckpt", marker)
        args = ["experiment=smoke", f"hydra.run.dir={run}", "ckpt_path=last" if how.endswith("last") else f"ckpt_path={path}"]
    elif how == "pipeline.resume":
        run = copy_run(pretrained, tmp_path / "run")
        path = hostile_checkpoint(run / "checkpoints" / "sft" / "last.ckpt", marker)
        args = [*SMOKE, f"hydra.run.dir={run}", "pipeline.resume=true"]
    else:
        run = tmp_path / "new"
        path = hostile_checkpoint(tmp_path / "shared.ckpt", marker)
        args = [*SMOKE, f"hydra.run.dir={run}", f"pipeline.init_from={path}"]
    before = snapshot(run)
    line = refused(args, monkeypatch, capsys)
    assert str(path) in line and TRUST_ENV in line, line
    assert not marker.exists()
    assert snapshot(run) == before  # no .hydra/, no train.log, no directory


# ------------------------------------------------------------------ 3. a refusal changes nothing
@pytest.mark.parametrize("case", ["changed config", "missing run", "damaged checkpoint", "foreign phase"])
def test_a_refused_resume_writes_nothing_into_the_run_directory(pretrained, tmp_path, case, monkeypatch, capsys):
    run = copy_run(pretrained, tmp_path / "run")
    extra = []
    if case == "changed config":
        extra, expected = ["seed=1"], "configuration differs"
    elif case == "missing run":
        run, expected = tmp_path / "no" / "run", "no such directory"
    elif case == "damaged checkpoint":
        last = run / "checkpoints" / "pretrain" / "final.ckpt"  # the completed phase SFT starts from
        last.write_bytes(last.read_bytes()[:1000])
        expected = "bytes"
    else:  # a valid checkpoint of another phase in the place of SFT's
        last = run / "checkpoints" / "sft" / "last.ckpt"
        last.parent.mkdir(parents=True)
        shutil.copy(run / "checkpoints" / "pretrain" / "last.ckpt", last)
        shutil.copy(run / "checkpoints" / "pretrain" / "last.ckpt.sha256", last.with_name("last.ckpt.sha256"))
        expected = "written by phase 'pretrain', not by phase 'sft'"
    before = snapshot(run)
    assert expected in refused([*SMOKE, f"hydra.run.dir={run}", "pipeline.resume=true", *extra], monkeypatch, capsys)
    assert snapshot(run) == before


SINGLE_FIT = ["experiment=smoke", "validate_before_fit=false", "trainer.max_steps=3"]


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """A single fit with ReDo, checkpointed at its last step; and a pipeline stopped in its first phase."""
    runs = tmp_path_factory.mktemp("fitted")
    fit(compose_config(*SINGLE_FIT, "+callbacks=redo", output_dir=runs / "fit"))
    stop = "+phases.pretrain.callbacks.stop={_target_: fault_injection.SignalAt, step: 2}"
    with pytest.raises(RunInterrupted):
        Pipeline(compose_pipeline(runs / "pipeline", *WARM, "pipeline.stop_phase=pretrain", stop)).run()
    return runs


@pytest.mark.parametrize("case", ["fit: removed callback", "fit: changed model", "phase: removed callback",
                                  "phase: changed model"])
def test_a_resume_the_model_or_its_callbacks_refuse_writes_nothing_into_the_run_directory(fitted, tmp_path, case,
                                                                                          monkeypatch, capsys):
    """The configuration change is allowed, the checkpoint does not fit it: refused before Hydra writes anything."""
    kind, change = case.split(": ")
    run = copy_run(fitted / kind.replace("phase", "pipeline"), tmp_path / "run")
    if kind == "fit":
        args = [*SINGLE_FIT, "ckpt_path=last"] + (["+callbacks=redo"] if change == "changed model" else [])
        allowed = []
    else:
        args = [*SMOKE, "pipeline.stop_phase=pretrain", "pipeline.resume=true"]
        allowed = ["phases.pretrain.callbacks.stop"]
    if change == "removed callback":
        args += ["~callbacks.redo"] if kind == "phase" else []
        allowed.append("callbacks.redo")
        expected = "holds state of callbacks this run does not have: ReDoMonitor"
    else:
        args.append("model.n_embd=16")
        allowed.append("model.n_embd")
        expected = "the model has other shapes than the checkpoint's"
    before = snapshot(run)
    line = refused([*args, f"hydra.run.dir={run}", f"resume_allow_changes=[{','.join(allowed)}]"], monkeypatch, capsys)
    assert expected in line, line
    assert snapshot(run) == before


# ------------------------------------------------------------------ 4. phase and run fingerprints, pipeline.json schema
def test_a_checkpoint_of_another_phase_or_run_is_refused_in_one_line(pretrained, tmp_path):
    run = copy_run(pretrained, tmp_path / "run")
    final = run / "checkpoints" / "pretrain" / "final.ckpt"
    sft = run / "checkpoints" / "sft"
    sft.mkdir(parents=True)
    for name in ("last.ckpt", "last.ckpt.sha256"):  # another phase's valid checkpoint copied over SFT's
        shutil.copy(final.with_name(name), sft / name)
    with pytest.raises(ResumeError, match="written by phase 'pretrain', not by phase 'sft'") as err:
        Pipeline(compose_pipeline(run, *WARM, "pipeline.resume=true")).run()
    assert "\n" not in str(err.value)
    assert not (sft / "final.ckpt").exists()
    # the same phase of a run with another configuration (allowed through pipeline.json, caught by the checkpoint)
    other = tmp_path / "other"
    Pipeline(compose_pipeline(other, *WARM, "pipeline.stop_phase=pretrain", "model.n_embd=48")).run()
    for name in ("last.ckpt", "last.ckpt.sha256"):
        shutil.copy(other / "checkpoints" / "pretrain" / name, run / "checkpoints" / "pretrain" / name)
    state = read_state(run / "pipeline.json")
    del state["phases"]["pretrain"]  # pretrain interrupted: it resumes from the foreign last.ckpt
    write_state(run / "pipeline.json", state)
    shutil.rmtree(sft)
    with pytest.raises(ResumeError, match=r"model.n_embd 48 -> 32"):
        Pipeline(compose_pipeline(run, *WARM, "pipeline.resume=true")).run()
    # a final.ckpt of the wrong phase as the starting point of the next one
    for name in ("final.ckpt", "final.ckpt.sha256"):
        shutil.copy(other / "checkpoints" / "pretrain" / "last.ckpt" if name == "final.ckpt" else
                    other / "checkpoints" / "pretrain" / "last.ckpt.sha256", run / "checkpoints" / "pretrain" / name)
    Path(run / "checkpoints" / "pretrain" / "final.ckpt").write_bytes(  # a checkpoint without any phase name
        _without_guard(run / "checkpoints" / "pretrain" / "final.ckpt"))
    with pytest.raises(ResumeError, match="no pipeline phase"):
        Pipeline(compose_pipeline(run, *WARM, "pipeline.start_phase=sft")).run()


def _without_guard(path: Path) -> bytes:
    checkpoint = torch.load(path, weights_only=True)
    checkpoint["callbacks"] = {k: v for k, v in checkpoint["callbacks"].items() if "ResumeGuard" not in k}
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    os.remove(path.with_name(path.name + ".sha256"))
    return buffer.getvalue()


@pytest.mark.parametrize("edit,where", [
    (lambda s: s["phases"].__setitem__("pretrain", "done"), "phases/pretrain"),
    (lambda s: s["phases"]["pretrain"].__setitem__("val_loss", "low"), "phases/pretrain/val_loss"),
    (lambda s: s["phases"]["pretrain"].pop("steps"), "phases/pretrain"),
    (lambda s: s.__setitem__("phases", []), "phases"),
])
def test_a_pipeline_json_that_breaks_the_schema_is_one_line_before_any_training(pretrained, tmp_path, edit, where):
    run = copy_run(pretrained, tmp_path / "run")
    state = json.loads((run / "pipeline.json").read_text())
    edit(state)
    (run / "pipeline.json").write_text(json.dumps(state))
    before = snapshot(run)
    with pytest.raises(CheckpointError, match=f"at {where}") as err:
        Pipeline(compose_pipeline(run, *WARM, "pipeline.resume=true")).run()
    assert "\n" not in str(err.value) and "pipeline.json" in str(err.value)
    assert snapshot(run) == before


def test_the_first_pipeline_json_write_is_atomic_under_sigterm(tmp_path, monkeypatch):
    """SIGTERM in the middle of the write: the file is complete and readable, the signal acts after it."""
    path = tmp_path / "pipeline.json"
    state = {"method": "warm", "seed": 0, "phase_order": ["a"], "phases": {}, "config": {"x": 1}}

    class Stopped(Exception):
        pass

    def stop(signum, frame):
        raise Stopped

    real_dumps = json.dumps

    def dumps_then_signal(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # arrives while the file is being written
        return real_dumps(*args, **kwargs)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        monkeypatch.setattr(json, "dumps", dumps_then_signal)
        with pytest.raises(Stopped):
            write_state(path, state)
    finally:
        signal.signal(signal.SIGTERM, previous)
        monkeypatch.undo()
    assert read_state(path) == state
    # a write stopped between its data and its rename is completed when the run is read
    path.rename(path.with_name("pipeline.json.writing"))
    assert read_state(path) == state and path.is_file()


# ------------------------------------------------------------------ 5. SIGTERM / SIGINT
FIRE_RUN = ["experiment=pipeline_smoke", "+method=fire_lm", "validate_before_fit=true", "phases.sft.steps=6"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run = tmp_path_factory.mktemp("uninterrupted") / "run"
    Pipeline(compose_config(*FIRE_RUN, output_dir=run)).run()
    return run


@pytest.mark.slow  # a pipeline interrupted and resumed per signal: tens of seconds
@pytest.mark.parametrize("name,step", [("SIGTERM", 3), ("SIGINT", 4)])  # 3: no validation follows; 4: one does
def test_a_stop_signal_saves_the_current_step_exits_128_plus_signal_and_resumes_exactly(uninterrupted, tmp_path,
                                                                                         name, step):
    run = tmp_path / "run"
    handlers = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    cfg = compose_config(*FIRE_RUN, signal_spec(step, name), output_dir=run)
    with pytest.raises(RunInterrupted) as stopped:
        Pipeline(cfg).run()
    assert stopped.value.code == 128 + getattr(signal, name)
    last = run / "checkpoints" / "sft" / "last.ckpt"
    assert str(last) in str(stopped.value) and "\n" not in str(stopped.value)
    verify_file(last)
    assert read_checkpoint(last)["global_step"] == step  # the step reached, not the periodic one before it
    assert "sft" not in read_state(run / "pipeline.json")["phases"]
    assert signal.getsignal(signal.SIGTERM) == handlers[0] and signal.getsignal(signal.SIGINT) == handlers[1]
    resumed = compose_config(*FIRE_RUN, "pipeline.resume=true", "resume_allow_changes=[phases.sft.callbacks.stop]",
                             output_dir=run)
    Pipeline(resumed).run()
    reference = read_checkpoint(uninterrupted / "checkpoints" / "sft" / "final.ckpt")["state_dict"]
    final = read_checkpoint(run / "checkpoints" / "sft" / "final.ckpt")["state_dict"]
    assert all(torch.equal(reference[k], final[k]) for k in reference)
    # 2. every summary value survives: FIRE's DfI (logged at the boundary, before the checkpoint) and the
    # validation before the phase (outside the fit)
    expected = read_state(uninterrupted / "pipeline.json")["phases"]["sft"]
    got = read_state(run / "pipeline.json")["phases"]["sft"]
    for key in ("val_loss_before", "val_loss", "train_loss", "retention_loss"):
        assert expected[key] is not None and got[key] == pytest.approx(expected[key]), key
    assert {"fire/dfi_before", "fire/dfi_after"} <= set(expected["summary"])
    assert got["summary"] == pytest.approx(expected["summary"])
    assert set(got["metrics"]) >= {k for k in expected["metrics"] if not k.endswith(("seconds", "per_sec"))}


@pytest.mark.cli
def test_sigterm_through_the_cli_exits_143_with_one_line(tmp_path):
    run = tmp_path / "run"
    env = {"PYTHONPATH": os.pathsep.join([os.environ.get("PYTHONPATH", ""), str(Path(__file__).parent)])}
    proc = cli(*SMOKE, f"hydra.run.dir={run}", signal_spec(2, "SIGTERM"), cwd=tmp_path, env=env)
    assert proc.returncode == 143, proc.stderr[-3000:]
    assert "stopped by SIGTERM at step 2" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    verify_file(run / "checkpoints" / "sft" / "last.ckpt")
