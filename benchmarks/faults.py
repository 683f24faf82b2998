"""Fault and bad-input counts for the README's "Interruptions" guarantees (CPU, about a minute).

Each fault is injected into a tiny two-phase pipeline run (experiment=pipeline_smoke) and counts as
survived when the run either refuses in one line and leaves the run directory unchanged, or resumes
and ends with the uninterrupted run's weights and phase summary; a hostile checkpoint also counts
only if its payload never ran. Each bad input counts when it raises one line of the expected type.

    PYTHONPATH=src python benchmarks/faults.py
"""
from __future__ import annotations

import io
import json
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from torch import nn

from plasticity_callbacks.app.pipeline import Pipeline, read_state, write_state
from plasticity_callbacks.app.train import config_dir, refuse_before_start
from plasticity_callbacks.errors import CheckpointError
from plasticity_callbacks.app.runs.checkpoints import RunInterrupted, read_checkpoint, verify_file
from plasticity_callbacks.app.runs.verified_files import write_verified
from plasticity_callbacks.app.runs.resume import ResumeError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from fault_injection import hostile_checkpoint, signal_spec  # noqa: E402  (the faults the trust tests inject)

RUN = ["experiment=pipeline_smoke", "+method=fire", "validate_before_fit=true", "phases.sft.steps=6"]
SUMMARY = ("val_loss_before", "summary", "val_loss", "train_loss", "retention_loss")  # summary: fire/dfi_*


def cfg(run: Path, *overrides):
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        return compose("config", overrides=[*RUN, f"paths.output_dir={run}", *overrides])


def snapshot(directory: Path) -> dict:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(directory.rglob("*"))} \
        if directory.exists() else {}


def same_as_reference(run: Path, reference: Path) -> bool:
    a = read_checkpoint(reference / "checkpoints" / "sft" / "final.ckpt")["state_dict"]
    b = read_checkpoint(run / "checkpoints" / "sft" / "final.ckpt")["state_dict"]
    sa, sb = (read_state(r / "pipeline.json")["phases"]["sft"] for r in (reference, run))
    return all(torch.equal(a[k], b[k]) for k in a) and all(sa[k] == sb[k] for k in SUMMARY)


def refused_cleanly(run: Path, action, errors=(ResumeError, CheckpointError)) -> bool:
    before = snapshot(run)
    try:
        action()
    except errors as err:
        return "\n" not in str(err) and snapshot(run) == before
    return False


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="faults-"))
    reference, pretrained = root / "reference", root / "pretrained"
    Pipeline(cfg(reference)).run()
    Pipeline(cfg(pretrained, "pipeline.stop_phase=pretrain")).run()
    marker = root / "payload_ran"

    def fresh(name: str) -> Path:
        run = root / name
        shutil.copytree(pretrained, run)
        return run

    def resume(run: Path, *extra):
        return lambda: Pipeline(cfg(run, "pipeline.resume=true", *extra)).run()

    def preflight(run: Path, *extra):
        return lambda: refuse_before_start([*RUN, f"hydra.run.dir={run}", *extra], config_dir())

    def signal_fault(name: str, step: int) -> bool:
        run = root / f"signal_{name}_{step}"
        stop = signal_spec(step, name)
        try:
            Pipeline(cfg(run, stop)).run()
            return False
        except RunInterrupted as stopped:
            if stopped.code != 128 + getattr(signal, name):
                return False
        verify_file(run / "checkpoints" / "sft" / "last.ckpt")
        resume(run, "resume_allow_changes=[phases.sft.callbacks.stop]")()
        return same_as_reference(run, reference)

    def damaged(how: str) -> bool:
        run = fresh(f"damaged_{how}")
        final = run / "checkpoints" / "pretrain" / "final.ckpt"
        data = final.read_bytes()
        final.write_bytes({"truncated": data[: len(data) // 2], "empty": b"",
                           "flipped": data[:100] + bytes([data[100] ^ 1]) + data[101:]}[how])
        return refused_cleanly(run, preflight(run, "pipeline.resume=true")) and refused_cleanly(run, resume(run))

    def foreign_phase() -> bool:
        run = fresh("foreign_phase")
        (run / "checkpoints" / "sft").mkdir()
        for name in ("last.ckpt", "last.ckpt.sha256"):
            shutil.copy(run / "checkpoints" / "pretrain" / name, run / "checkpoints" / "sft" / name)
        return refused_cleanly(run, preflight(run, "pipeline.resume=true")) and refused_cleanly(run, resume(run))

    def schema(edit) -> bool:
        run = fresh(f"schema_{len(os.listdir(root))}")
        state = json.loads((run / "pipeline.json").read_text())
        edit(state)
        (run / "pipeline.json").write_text(json.dumps(state))
        return refused_cleanly(run, resume(run))

    def hostile_via(how: str) -> bool:
        run = fresh(f"hostile_{how}")
        target = {"resume": run / "checkpoints" / "sft" / "last.ckpt", "init_from": root / "shared.ckpt",
                  "previous": run / "checkpoints" / "pretrain" / "final.ckpt"}[how]
        hostile_checkpoint(target, marker, global_step=1)
        extra = {"resume": ["pipeline.resume=true"], "init_from": [f"pipeline.init_from={target}"],
                 "previous": ["pipeline.start_phase=sft"]}[how]
        ok = refused_cleanly(run, preflight(run, *extra)) and refused_cleanly(
            run, lambda: Pipeline(cfg(run, *extra)).run())
        return ok and not marker.exists()

    def half_written_state() -> bool:
        run = fresh("half_written")
        (run / "pipeline.json").rename(run / "pipeline.json.writing")
        resume(run)()
        return same_as_reference(run, reference)

    faults = {
        "SIGTERM mid-phase (no validation follows)": lambda: signal_fault("SIGTERM", 3),
        "SIGTERM mid-phase (a validation follows)": lambda: signal_fault("SIGTERM", 4),
        "SIGINT mid-phase": lambda: signal_fault("SIGINT", 5),
        "truncated previous-phase checkpoint": lambda: damaged("truncated"),
        "empty previous-phase checkpoint": lambda: damaged("empty"),
        "one flipped byte": lambda: damaged("flipped"),
        "another phase's checkpoint as sft/last.ckpt": foreign_phase,
        "pipeline.json phase entry a string": lambda: schema(lambda s: s["phases"].__setitem__("pretrain", "done")),
        "pipeline.json loss a string": lambda: schema(lambda s: s["phases"]["pretrain"].__setitem__("val_loss", "x")),
        "pipeline.json phases a list": lambda: schema(lambda s: s.__setitem__("phases", [])),
        "pipeline.json write stopped before its rename": half_written_state,
        "changed configuration": lambda: refused_cleanly(fresh("changed"), preflight(root / "changed", "pipeline.resume=true", "seed=3")),
        "missing run directory": lambda: refused_cleanly(root / "nowhere", preflight(root / "nowhere", "pipeline.resume=true")),
        "hostile checkpoint via pipeline.resume": lambda: hostile_via("resume"),
        "hostile checkpoint via pipeline.init_from": lambda: hostile_via("init_from"),
        "hostile checkpoint as previous phase": lambda: hostile_via("previous"),
    }
    survived = 0
    for name, fault in faults.items():
        try:
            ok = bool(fault())
        except Exception as err:  # an unexpected error is a fault not survived
            ok, name = False, f"{name} ({type(err).__name__}: {str(err).splitlines()[0][:120]})"
        survived += ok
        print(f"  {'survived' if ok else 'LOST    '}  {name}", flush=True)

    bad = bad_inputs(root)
    clear = 0
    for name, call, error in bad:
        try:
            call()
            ok = False
        except error as err:
            ok = "\n" not in str(err) and len(str(err)) > 20
        except Exception:
            ok = False
        clear += ok
        print(f"  {'clear   ' if ok else 'UNCLEAR '}  {name}", flush=True)
    print(f"faults survived with nothing lost: {survived}/{len(faults)}")
    print(f"bad inputs with a clear one-line error: {clear}/{len(bad)}")
    shutil.rmtree(root, ignore_errors=True)


def bad_inputs(root: Path):
    from plasticity_callbacks import ReDoMonitor
    from plasticity_callbacks.ops.fire import apply_fire
    from plasticity_callbacks.model_map import Selection
    from plasticity_callbacks.functional.spectral import orthogonalize

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    redo = ReDoMonitor()
    state = {"layers": ["1"], "widths": [8], "ema": torch.zeros(8), "observed": torch.zeros(8, dtype=torch.bool),
             "recycled": torch.zeros(1, dtype=torch.long), "init_std": torch.ones(1, 2), "collections": 1,
             "last_logged_step": 0, "schedule": redo.state_dict()["schedule"]}
    not_a_dict = root / "list.ckpt"
    buffer = io.BytesIO()
    torch.save([1, 2], buffer)
    write_verified(buffer.getvalue(), not_a_dict)
    return [
        ("orthogonalize 0x4", lambda: orthogonalize(torch.zeros(0, 4)), ValueError),
        ("orthogonalize 4x0", lambda: orthogonalize(torch.zeros(4, 0)), ValueError),
        ("orthogonalize batch 2x0x3", lambda: orthogonalize(torch.zeros(2, 0, 3)), ValueError),
        ("orthogonalize a vector", lambda: orthogonalize(torch.zeros(4)), ValueError),
        ("orthogonalize integers", lambda: orthogonalize(torch.ones(3, 3, dtype=torch.long)), ValueError),
        ("apply_fire optimizers=object()", lambda: apply_fire(model, optimizers=object()), TypeError),
        ("apply_fire optimizers=['sgd']", lambda: apply_fire(model, optimizers=["sgd"]), TypeError),
        ("apply_fire include=['nomatch*']", lambda: apply_fire(model, selection=Selection(include=["nomatch*"])),
         ValueError),
        ("ReDo state ema shape", lambda: redo.load_state_dict({**state, "ema": torch.zeros(7)}), CheckpointError),
        ("ReDo state init_std shape", lambda: redo.load_state_dict({**state, "init_std": torch.ones(2)}),
         CheckpointError),
        ("ReDo state widths vs layers", lambda: redo.load_state_dict({**state, "widths": [4, 4]}), CheckpointError),
        ("ReDo state missing key", lambda: redo.load_state_dict({k: v for k, v in state.items() if k != "ema"}),
         CheckpointError),
        ("read_checkpoint weights_only=False", lambda: read_checkpoint(not_a_dict, weights_only=False), TypeError),
        ("read_checkpoint of a list", lambda: read_checkpoint(not_a_dict), CheckpointError),
        ("read_checkpoint of a missing file", lambda: read_checkpoint(root / "nope.ckpt"), CheckpointError),
        ("pipeline.json not JSON", lambda: (root / "bad.json").write_text("{") and read_state(root / "bad.json"),
         CheckpointError),
        ("write_state into a missing folder", lambda: write_state(root / "no" / "dir" / "p.json", {}), CheckpointError),
    ]


if __name__ == "__main__":
    sys.exit(main())
