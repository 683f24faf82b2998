"""Fault and bad-input counts for the guarantees in docs/trust.md (CPU; a few minutes on an idle machine).

Every fault goes through ``plasticity-train`` itself (``python -m plasticity_callbacks.app.train``, this
interpreter: never whatever PATH finds), so "nothing written" covers ``.hydra/`` and ``train.log`` too. A fault
counts as survived when the run either

* refuses in one line (exit 1, one line on stderr, no traceback) and leaves the run directory byte for byte as it
  was, a hostile checkpoint's payload never run; or
* resumes and ends with the uninterrupted run's weights, optimizer state (every tensor), every metric row (each
  phase's ``metrics.csv`` less wall-clock columns) and phase summary.

Families: ``pipeline`` (one process: signals, a crash, damaged/foreign/hostile checkpoints, a broken
``pipeline.json``, a moved and a copied run directory), ``fsdp2`` (2 gloo ranks: a stop and resume, a hostile shard
item, a copied run), ``ddp`` (2 gloo ranks: SIGTERM to rank 0, to rank 1, to both), ``hf`` (the Trainer adapter:
resume, hostile/damaged state file, a removed callback), ``fabric`` (``FabricPlasticity.save``/``load``: resume,
hostile/damaged/foreign state file, a callback added since the save), ``benchmark`` (method files from
``--config-dir`` naming ``os.system`` or a module of their own, through ``plasticity-benchmark`` and
``plasticity-train``; an edited, foreign or unreadable ``ranking_runs.json``), ``report`` (``plasticity-report`` on
hostile folders: a planted module named by a ``_target_``, damaged ``pipeline.json``/``stream.json``/``tasks.csv``/
``metrics.csv``), ``monitor`` (PlasticityMonitor and a threshold-triggered ShrinkPerturb stopped and resumed:
the uninterrupted run's weights, optimizer state and every metric row), ``inputs`` (bad arguments: one line of
the expected error type each). ``--break NAME`` breaks one guarantee on purpose (also inside every command it
launches) to show the count drops; ``--only WORD`` runs the faults whose name holds WORD.

    PYTHONPATH=src python benchmarks/faults.py [--families pipeline,hf] [--break logs] [--only SIGTERM]
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from fault_injection import Payload, hostile_checkpoint, hostile_shard_item  # noqa: E402  (the trust tests' faults)

PIPELINE = ["experiment=pipeline_smoke", "+method=fire_lm", "validate_before_fit=true", "phases.sft.steps=6"]
SINGLE = ["experiment=smoke", "validate_before_fit=false", "+callbacks=shrink_perturb",
          "callbacks.shrink_perturb.schedule={every_n_steps: 2}"]
SUMMARY = ("val_loss_before", "summary", "val_loss", "train_loss", "retention_loss")  # summary: fire/dfi_*
VOLATILE = ("seconds", "per_sec")  # wall-clock columns differ run to run
TIMEOUT = 240  # a launch past this is a hang: the fault is lost


# ------------------------------------------------------------------------ guarantees broken on purpose (--break)
def break_guarantee(name: str) -> None:
    """Break one guarantee in this process (and, through ``--as-plasticity-train``, in every run it launches)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from plasticity_callbacks.app import pipeline, train
    from plasticity_callbacks.app.runs import checkpoints, verified_files

    if name == "logs":  # the resumed-log restoration a no-op: the rows before the checkpoint are not kept as they were
        pipeline.restore_logs = train.restore_logs = lambda logger, checkpoint: None
    elif name == "checksum":  # checksums never compared
        checkpoints.recorded_checksum = lambda path: None
    elif name == "weights_only":  # every load unpickles with code
        os.environ[verified_files.TRUST_ENV] = "1"
    elif name == "optimizer":  # a resume drops the optimizer's moments
        load = checkpoints.VerifiedCheckpointIO.load_checkpoint

        def without_moments(self, path, *args, **kwargs):
            checkpoint = load(self, path, *args, **kwargs)
            for state in checkpoint.get("optimizer_states", []):
                state["state"] = {}
            return checkpoint
        checkpoints.VerifiedCheckpointIO.load_checkpoint = without_moments
    elif name == "rebase":  # a moved run's checkpoint callback forgets its checkpoints (Lightning's own rule)
        checkpoints.ModelCheckpointAfterValidation.load_state_dict = ModelCheckpoint.load_state_dict
    elif name == "refuse_first":  # no refusal before Hydra creates the run directory
        train.refuse_before_start = lambda argv, directory: None
    elif name == "fabric_state":  # FabricPlasticity.load_state_dict takes any state as it comes
        from plasticity_callbacks.integrations.fabric import FabricPlasticity

        def unchecked(self, state, source="the state"):
            self.view.global_step, self._restored = int(state["global_step"]), state
        FabricPlasticity.load_state_dict = unchecked
    elif name == "targets":  # a method file's _target_ instantiated whatever it names
        from plasticity_callbacks.app import methods
        from plasticity_callbacks.app.benchmark import main as benchmark_main

        methods.check_method_targets = pipeline.check_method_targets = benchmark_main.check_method_targets = \
            lambda method, dirs=(): None
    elif name == "results_checksum":  # the shipped ranking runs read as they are
        from plasticity_callbacks.app.benchmark import main as benchmark_main, results

        benchmark_main.load_results = lambda path, require_checksum=False: results.Results(
            **{**(data := json.loads(Path(path).read_text())), "runs": [results.RunResult(**r) for r in data["runs"]]})
    elif name == "report_reads":  # plasticity-report reads a run folder's files without checking them
        import contextlib

        from plasticity_callbacks.app.report import runs as report_runs, streams as report_streams

        report_runs.reading = report_streams.reading = lambda path, what: contextlib.nullcontext()
        report_runs._check_pipeline_state = lambda state: None
    elif name == "threshold_state":  # a resumed schedule forgets its threshold's actions
        from plasticity_callbacks.callbacks.schedule import ScheduleState

        load_schedule = ScheduleState.load_state_dict
        ScheduleState.load_state_dict = lambda self, state: load_schedule(
            self, {k: v for k, v in state.items() if not k.startswith("threshold_")})
    elif name == "monitor_state":  # a resumed monitor forgets θ₀ and its history
        from plasticity_callbacks.callbacks.monitor import PlasticityMonitor

        PlasticityMonitor.load_extra_state = lambda self, state: None
    else:
        raise SystemExit(f"--break {name!r}: one of {', '.join(BREAKS)}")


BREAKS = ("logs", "checksum", "weights_only", "optimizer", "rebase", "refuse_first", "fabric_state", "targets",
          "results_checksum", "report_reads", "threshold_state", "monitor_state")


BROKEN: str | None = None


def plasticity_train(run: Path, *overrides: str, timeout: float = TIMEOUT) -> subprocess.CompletedProcess | None:
    """``plasticity-train OVERRIDES hydra.run.dir=RUN`` in a fresh process; None when it ran past ``timeout``."""
    return launch("plasticity_callbacks.app.train", [*overrides, f"hydra.run.dir={run}"], run.parent, timeout)


def launch(module: str, args: list[str], cwd: Path, timeout: float = TIMEOUT,
           env: dict | None = None) -> subprocess.CompletedProcess | None:
    """``python -m MODULE ARGS`` (with ``--break``: through this file, so the break holds inside) in a fresh
    process group; None when it ran past ``timeout``."""
    extra = dict(env or {})
    through_here = BROKEN is not None or "FAULTS_SHIPPED_RESULTS" in extra
    command = ([sys.executable, __file__, "--as", module, BROKEN or "-"] if through_here else
               [sys.executable, "-m", module])
    paths = (extra.pop("PYTHONPATH", None), os.environ.get("PYTHONPATH"), str(ROOT / "tests"))
    env = dict(os.environ, OMP_NUM_THREADS="1", **extra, PYTHONPATH=os.pathsep.join(p for p in paths if p))
    env.pop("LOCAL_RANK", None)
    cwd.mkdir(parents=True, exist_ok=True)
    process = subprocess.Popen([*command, *args], cwd=cwd, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, 9)  # this launch's process group: its ranks too
        process.communicate()
        return None
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


# ---------------------------------------------------------------------------------------------- comparisons
def snapshot(directory: Path) -> dict:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(directory.rglob("*"))} \
        if directory.exists() else {}


def same(a, b) -> bool:
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and set(a) == set(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def metric_rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return [{k: v for k, v in row.items() if not any(word in k for word in VOLATILE)} for row in csv.DictReader(f)]


def differences(run: Path, reference: Path, checkpoints: dict[str, str], logs: list[str]) -> list[str]:
    """What in ``run`` differs from ``reference``: weights and optimizer state of each ``checkpoints`` entry
    (a name → its path under ``checkpoints/``), the rows of each ``logs`` file, the pipeline's phase summaries."""
    from plasticity_callbacks.app.runs.checkpoints import read_checkpoint

    found = []
    for name, relative in checkpoints.items():
        a, b = (read_checkpoint(r / "checkpoints" / relative) for r in (reference, run))
        found += [f"{name} weights"] * (not same(a["state_dict"], b["state_dict"]))
        if "optimizer_states" in a:  # a distributed checkpoint keeps them in its shards (compared by its weights)
            found += [f"{name} optimizer state"] * (not same(a["optimizer_states"], b.get("optimizer_states")))
    for relative in logs:
        found += [f"{relative} rows"] * (metric_rows(run / relative) != metric_rows(reference / relative))
    if (reference / "pipeline.json").is_file():
        phases = [json.loads((r / "pipeline.json").read_text())["phases"] for r in (reference, run)]
        found += [f"{phase} summary" for phase in phases[0]
                  if any(phases[0][phase].get(k) != phases[1].get(phase, {}).get(k) for k in SUMMARY)]
    return found


def refused_in_one_line(run: Path, *overrides: str, marker: Path | None = None) -> str | None:
    """None when ``plasticity-train`` refuses in one line and writes nothing; else what went wrong."""
    before = snapshot(run)
    done = plasticity_train(run, *overrides)
    if done is None:
        return "hung"
    problem = one_line(done)
    if problem:
        return problem
    if snapshot(run) != before:
        return "wrote into the run directory"
    if marker is not None and marker.exists():
        return "the payload ran"
    return None


def one_line(done: subprocess.CompletedProcess | None, *words: str, codes: tuple[int, ...] = (1,)) -> str | None:
    """None when the command exited with one of ``codes`` and one line on stderr holding every one of ``words``."""
    if done is None:
        return "hung"
    lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
    if done.returncode not in codes or len(lines) != 1:
        return f"exit {done.returncode}, {len(lines)} lines on stderr"
    missing = [word for word in words if word not in lines[0]]
    return f"the line does not name {missing}: {lines[0][:120]!r}" if missing else None


def last_versions(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("last-v*"))


# ------------------------------------------------------------------------------------------ the families
def pipeline_faults(root: Path) -> dict:
    from fault_injection import signal_spec

    reference, pretrained, marker = root / "reference", root / "pretrained", root / "payload_ran"
    compared = {"pretrain final": "pretrain/final.ckpt", "sft final": "sft/final.ckpt"}
    logs = ["logs/pretrain/metrics.csv", "logs/sft/metrics.csv"]
    allow = "resume_allow_changes=[phases.sft.callbacks.stop]"

    def prepare():
        for run, extra in ((reference, []), (pretrained, ["pipeline.stop_phase=pretrain"])):
            if not run.exists():
                assert plasticity_train(run, *PIPELINE, *extra).returncode == 0, f"{run.name} run failed"

    def fresh(name: str) -> Path:
        prepare()
        run = root / name
        shutil.copytree(pretrained, run)
        (run / ".run.lock").unlink(missing_ok=True)
        return run

    def stopped_then_resumed(name: str, stop: str, expected_exit: int | None) -> list[str]:
        prepare()
        run = root / name
        done = plasticity_train(run, *PIPELINE, stop)
        if done is None or (expected_exit is not None and done.returncode != expected_exit):
            return [f"the stop exited {None if done is None else done.returncode}"]
        again = plasticity_train(run, *PIPELINE, "pipeline.resume=true", allow)
        if again is None or again.returncode != 0:
            return [f"the resume exited {None if again is None else again.returncode}"]
        return differences(run, reference, compared, logs)

    def damaged(how: str) -> str | None:
        run = fresh(f"damaged_{how}")
        final = run / "checkpoints" / "pretrain" / "final.ckpt"
        data = final.read_bytes()
        middle = len(data) // 2  # inside a tensor's bytes: torch would load the flipped value without a word
        final.write_bytes({"truncated": data[:middle], "empty": b"",
                           "flipped": data[:middle] + bytes([data[middle] ^ 1]) + data[middle + 1:]}[how])
        return refused_in_one_line(run, *PIPELINE, "pipeline.resume=true")

    def foreign_phase() -> str | None:
        run = fresh("foreign_phase")
        (run / "checkpoints" / "sft").mkdir()
        for name in ("last.ckpt", "last.ckpt.sha256"):
            shutil.copy(run / "checkpoints" / "pretrain" / name, run / "checkpoints" / "sft" / name)
        return refused_in_one_line(run, *PIPELINE, "pipeline.resume=true")

    def schema(name: str, edit) -> str | None:
        run = fresh(f"schema_{name}")
        state = json.loads((run / "pipeline.json").read_text())
        edit(state)
        (run / "pipeline.json").write_text(json.dumps(state))
        return refused_in_one_line(run, *PIPELINE, "pipeline.resume=true")

    def hostile_via(how: str) -> str | None:
        run = fresh(f"hostile_{how}")
        target = {"resume": run / "checkpoints" / "sft" / "last.ckpt", "init_from": root / "shared.ckpt",
                  "previous": run / "checkpoints" / "pretrain" / "final.ckpt"}[how]
        hostile_checkpoint(target, marker, global_step=1)
        extra = {"resume": "pipeline.resume=true", "init_from": f"pipeline.init_from={target}",
                 "previous": "pipeline.start_phase=sft"}[how]
        return refused_in_one_line(run, *PIPELINE, extra, marker=marker)

    def half_written_state() -> list[str]:
        run = fresh("half_written")
        (run / "pipeline.json").rename(run / "pipeline.json.writing")
        done = plasticity_train(run, *PIPELINE, "pipeline.resume=true")
        return differences(run, reference, compared, logs) if done and done.returncode == 0 else ["resume failed"]

    def moved_then_copied() -> list[str]:
        """Stopped at sft step 3, moved, resumed and stopped at 5, copied, resumed to the end from the copy."""
        prepare()
        first, moved, copied = root / "moved_first", root / "elsewhere" / "moved", root / "copied"
        if plasticity_train(first, *PIPELINE, signal_spec(3, "SIGTERM")).returncode != 143:
            return ["the first stop"]
        moved.parent.mkdir(exist_ok=True)
        shutil.move(first, moved)
        if plasticity_train(moved, *PIPELINE, "pipeline.resume=true", allow, signal_spec(5, "SIGTERM")).returncode \
                != 143:
            return ["the stop after the move"]
        drift = last_versions(moved / "checkpoints" / "sft")
        shutil.copytree(moved, copied)
        (copied / ".run.lock").unlink(missing_ok=True)
        before = snapshot(moved)
        if plasticity_train(copied, *PIPELINE, "pipeline.resume=true", allow).returncode != 0:
            return ["the resume of the copy"]
        found = differences(copied, reference, compared, logs)
        found += [f"{name} written beside last.ckpt" for name in drift + last_versions(copied / "checkpoints" / "sft")]
        return found + ["the copy's run wrote where it came from"] * (snapshot(moved) != before)

    return {
        "SIGTERM mid-phase (no validation follows)": lambda: stopped_then_resumed("sigterm_3", signal_spec(3, "SIGTERM"), 143),
        "SIGTERM mid-phase (a validation follows)": lambda: stopped_then_resumed("sigterm_4", signal_spec(4, "SIGTERM"), 143),
        "SIGINT mid-phase": lambda: stopped_then_resumed("sigint_5", signal_spec(5, "SIGINT"), 130),
        "crash mid-phase (after logging past the checkpoint)": lambda: stopped_then_resumed(
            "crash_5", "+phases.sft.callbacks.stop={_target_: fault_injection.CrashAt, step: 5}", 1),
        "truncated previous-phase checkpoint": lambda: damaged("truncated"),
        "empty previous-phase checkpoint": lambda: damaged("empty"),
        "one flipped byte in a weight": lambda: damaged("flipped"),
        "another phase's checkpoint as sft/last.ckpt": foreign_phase,
        "pipeline.json phase entry a string": lambda: schema("entry", lambda s: s["phases"].__setitem__("pretrain", "x")),
        "pipeline.json loss a string": lambda: schema("loss", lambda s: s["phases"]["pretrain"].__setitem__("val_loss", "x")),
        "pipeline.json phases a list": lambda: schema("list", lambda s: s.__setitem__("phases", [])),
        "pipeline.json write stopped before its rename": half_written_state,
        "changed configuration": lambda: refused_in_one_line(fresh("changed"), *PIPELINE, "pipeline.resume=true", "seed=3"),
        "missing run directory": lambda: refused_in_one_line(root / "nowhere", *PIPELINE, "pipeline.resume=true"),
        "hostile checkpoint via pipeline.resume": lambda: hostile_via("resume"),
        "hostile checkpoint via pipeline.init_from": lambda: hostile_via("init_from"),
        "hostile checkpoint as previous phase": lambda: hostile_via("previous"),
        "run directory moved, then copied (resume follows the run)": moved_then_copied,
    }


def sharded_faults(root: Path, trainer: str) -> dict:
    """``experiment=smoke`` on 2 gloo ranks (``trainer=fsdp2`` or ``ddp``): stops and resumes against one
    uninterrupted run (weights and every metric row; FSDP2's optimizer state lives in its shards)."""
    reference, marker = root / f"{trainer}_reference", root / f"{trainer}_payload_ran"
    run_args = [*SINGLE, f"trainer={trainer}"]
    resume = ["ckpt_path=last", "resume_allow_changes=[callbacks.stop]"]

    def prepare():
        if not reference.exists():
            assert plasticity_train(reference, *run_args).returncode == 0, f"{trainer} reference run failed"

    def stop(step: int, ranks: str) -> str:
        return f"+callbacks.stop={{_target_: fault_injection.SignalRanksAt, step: {step}, ranks: {ranks}}}"

    def stopped_then_resumed(name: str, ranks: str, move: bool = False) -> list[str]:
        prepare()
        run = root / name
        done = plasticity_train(run, *run_args, stop(4, ranks))
        if done is None or done.returncode != 143:
            return [f"the stop {'hung' if done is None else f'exited {done.returncode}'}"]
        if move:
            moved = root / "elsewhere" / name
            moved.parent.mkdir(exist_ok=True)
            shutil.move(run, moved)
            run = moved
        again = plasticity_train(run, *run_args, *resume)
        if again is None or again.returncode != 0:
            return [f"the resume {'hung' if again is None else f'exited {again.returncode}'}"]
        found = differences(run, reference, {"last": "last.ckpt"}, ["logs/metrics.csv"])
        return found + [f"{n} written beside last.ckpt" for n in last_versions(run / "checkpoints")]

    def hostile_shard() -> str | None:
        prepare()
        run = root / f"{trainer}_hostile"
        shutil.copytree(reference, run)
        (run / ".run.lock").unlink(missing_ok=True)
        hostile_shard_item(run / "checkpoints" / "last.ckpt", marker)
        return refused_in_one_line(run, *run_args, *resume, marker=marker)

    if trainer == "fsdp2":
        return {"FSDP2: SIGTERM to both ranks, resumed": lambda: stopped_then_resumed("fsdp2_both", "[0, 1]"),
                "FSDP2: run directory moved, resumed": lambda: stopped_then_resumed("fsdp2_moved", "[0, 1]", True),
                "FSDP2: hostile item in a .distcp shard": hostile_shard}
    return {f"DDP: SIGTERM to {who}, resumed": (lambda ranks=ranks, who=who: stopped_then_resumed(
        f"ddp_{who.replace(' ', '_')}", ranks)) for who, ranks in
        (("rank 0 alone", "[0]"), ("rank 1 alone", "[1]"), ("both ranks", "[0, 1]"))}


def hf_faults(root: Path) -> dict:
    """The Trainer adapter (in this process; the adapter is a library, not a command)."""
    from test_hf_trainer import make_trainer, tiny_gpt2

    from plasticity_callbacks.app.runs.verified_files import write_verified
    from plasticity_callbacks.callbacks.fire import FIREReinit
    from plasticity_callbacks.callbacks.redo import ReDoMonitor
    from plasticity_callbacks.callbacks.schedule import Schedule
    from plasticity_callbacks.integrations.hf import STATE_FILE

    markers = {}  # one per fault: a payload that ran in one is not counted against another

    def callbacks(with_redo: bool = True):
        fire = FIREReinit(schedule=Schedule(steps=[2, 5]), selection={"scope": "attention"})
        return [fire, ReDoMonitor()] if with_redo else [fire]

    def train(output: Path, resume: bool = False, with_redo: bool = True):
        trainer = make_trainer(output, tiny_gpt2(), *callbacks(with_redo), max_steps=6, save_steps=3)
        trainer.train(resume_from_checkpoint=str(output / "checkpoint-3") if resume else None)
        return trainer

    def rows(trainer) -> list[dict]:
        return [{k: v for k, v in row.items() if not any(word in k for word in (*VOLATILE, "runtime"))}
                for row in trainer.state.log_history if row.get("step", 0) > 3 and "train_runtime" not in row]
        # (the Trainer's end-of-training row averages the loss over this process's steps only: not a metric row)

    reference: dict = {}

    def prepare():
        if not reference:
            reference["trainer"] = train(root / "hf_reference")

    def resumed() -> list[str]:
        prepare()
        run = root / "hf_resumed"
        shutil.copytree(root / "hf_reference", run)
        for later in ("checkpoint-6",):
            shutil.rmtree(run / later, ignore_errors=True)
        trainer, expected = train(run, resume=True), reference["trainer"]
        found = ["weights"] * (not same(dict(expected.model.state_dict()), dict(trainer.model.state_dict())))
        found += ["optimizer state"] * (not same(expected.optimizer.state_dict()["state"],
                                                 trainer.optimizer.state_dict()["state"]))
        return found + ["log rows after the checkpoint"] * (rows(trainer) != rows(expected))

    def refused(name: str, damage, with_redo: bool = True) -> str | None:
        prepare()
        run = root / f"hf_{name}"
        shutil.copytree(root / "hf_reference", run)
        markers[run] = run / "payload_ran"
        damage(run / "checkpoint-3" / STATE_FILE)
        try:
            train(run, resume=True, with_redo=with_redo)
        except Exception as err:
            if "\n" in str(err) or STATE_FILE not in str(err):
                return f"not one line naming the file: {type(err).__name__}"
            return "the payload ran" if markers[run].exists() else None
        return "resumed without a word"

    def hostile(path: Path) -> None:
        buffer = io.BytesIO()
        torch.save({"adapters": [{"payload": Payload(markers[path.parents[1]])}]}, buffer)
        write_verified(buffer.getvalue(), path)

    def flip(path: Path) -> None:
        data = path.read_bytes()
        path.write_bytes(data[:len(data) // 2] + bytes([data[len(data) // 2] ^ 1]) + data[len(data) // 2 + 1:])

    return {"HF adapter: resumed from a Trainer checkpoint": resumed,
            "HF adapter: hostile state file (checksum recomputed)": lambda: refused("hostile", hostile),
            "HF adapter: one flipped byte in the state file": lambda: refused("flipped", flip),
            "HF adapter: truncated state file": lambda: refused(
                "truncated", lambda p: p.write_bytes(p.read_bytes()[:-40])),
            "HF adapter: a callback removed since the save": lambda: refused("removed", lambda p: None, False)}


def fabric_faults(root: Path) -> dict:
    """``FabricPlasticity`` in a Fabric loop (in this process; Fabric is a library): its states through
    ``save``/``load``, against the uninterrupted loop."""
    import zipfile

    import lightning as L
    from test_fabric import batches, loss_of, make_callbacks, TinyGPT

    from plasticity_callbacks.app.runs.verified_files import write_verified
    from plasticity_callbacks.integrations.fabric import FabricPlasticity

    def loop(steps: int, resume_from: Path | None = None, callbacks=make_callbacks):
        torch.manual_seed(0)
        fabric = L.Fabric(accelerator="cpu", devices=1, loggers=[])
        model = TinyGPT()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, optimizer = fabric.setup(model, optimizer)
        plasticity = FabricPlasticity(fabric, model, optimizer, *callbacks())
        if resume_from is not None:
            fabric.load(resume_from / "loop.ckpt", {"model": model, "optimizer": optimizer})
            plasticity.load(resume_from / "plasticity.pt")
        with plasticity:
            for batch_idx, batch in enumerate(batches(steps)[plasticity.global_step:]):
                plasticity.batch_start(batch_idx)
                fabric.backward(loss_of(model, batch))
                plasticity.before_optimizer_step()
                optimizer.step()
                optimizer.zero_grad()
                plasticity.batch_end(batch_idx)
        return fabric, model, optimizer, plasticity

    def saved(name: str, steps: int = 3) -> Path:
        folder = root / f"fabric_{name}"
        fabric, model, optimizer, plasticity = loop(steps)
        fabric.save(folder / "loop.ckpt", {"model": model, "optimizer": optimizer})
        plasticity.save(folder / "plasticity.pt")
        return folder

    def resumed() -> list[str]:
        _, reference, reference_optimizer, expected = loop(6)
        _, model, optimizer, plasticity = loop(6, resume_from=saved("resumed"))
        found = ["weights"] * (not same(dict(reference.state_dict()), dict(model.state_dict())))
        found += ["optimizer state"] * (not same(reference_optimizer.state_dict()["state"],
                                                 optimizer.state_dict()["state"]))
        return found + ["callback states"] * (not same(expected.state_dict(), plasticity.state_dict()))

    def refused(name: str, damage, callbacks=make_callbacks) -> str | None:
        folder = saved(name)
        path, marker = folder / "plasticity.pt", folder / "payload_ran"
        damage(path, marker)
        try:
            loop(6, resume_from=folder, callbacks=callbacks)
        except Exception as err:
            if "\n" in str(err) or str(path) not in str(err):
                return f"not one line naming the file: {type(err).__name__}"
            return "the payload ran" if marker.exists() else None
        return "the payload ran" if marker.exists() else "resumed without a word"

    def hostile(path: Path, marker: Path) -> None:
        state = torch.load(path, weights_only=True)
        state["fabric_plasticity"]["payload"] = Payload(marker)
        buffer = io.BytesIO()
        torch.save(state, buffer)
        write_verified(buffer.getvalue(), path)  # anyone who swaps the file can write its checksum too

    def flip_a_tensor_byte(path: Path, marker: Path) -> None:
        """One bit of the largest stored tensor: torch reads it back without a word; only the checksum sees it."""
        data = bytearray(path.read_bytes())
        with zipfile.ZipFile(path) as archive:
            info = max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
        header = info.header_offset
        start = header + 30 + int.from_bytes(data[header + 26:header + 28], "little") + \
            int.from_bytes(data[header + 28:header + 30], "little")
        data[start + info.file_size // 2] ^= 1
        path.write_bytes(bytes(data))

    def foreign(path: Path, marker: Path) -> None:
        buffer = io.BytesIO()
        torch.save({"model": {"w": torch.zeros(2)}}, buffer)
        write_verified(buffer.getvalue(), path)

    def state_of(value):
        def damage(path: Path, marker: Path) -> None:
            buffer = io.BytesIO()
            torch.save({"fabric_plasticity": value}, buffer)
            write_verified(buffer.getvalue(), path)
        return damage

    def with_monitor():
        from plasticity_callbacks import PlasticityMonitor

        return [*make_callbacks(), PlasticityMonitor(weights_every_n_steps=1)]

    return {"Fabric: resumed through save/load": resumed,
            "Fabric: hostile state file (checksum recomputed)": lambda: refused("hostile", hostile),
            "Fabric: one flipped bit in a stored tensor": lambda: refused("flipped", flip_a_tensor_byte),
            "Fabric: truncated state file": lambda: refused("truncated", lambda p, m: p.write_bytes(p.read_bytes()[:-40])),
            "Fabric: another checkpoint as the state file": lambda: refused("foreign", foreign),
            "Fabric: state without its callbacks' entries": lambda: refused(
                "shape", state_of({"global_step": 3, "callbacks": []})),
            "Fabric: a callback added since the save": lambda: refused("added", lambda p, m: None, with_monitor)}


def benchmark_faults(root: Path) -> dict:
    """Method files from ``--config-dir`` naming code outside the package, through ``plasticity-benchmark`` and
    ``plasticity-train``; the shipped ranking runs edited, foreign, unreadable. Survived: one line naming the file
    (and the key), exit 1, nothing planted ran."""
    from plasticity_callbacks.app.benchmark.results import SHIPPED_RESULTS
    from plasticity_callbacks.app.runs.verified_files import write_verified

    configs, marker = root / "user_configs", root / "benchmark_payload_ran"
    (configs / "method").mkdir(parents=True, exist_ok=True)
    (configs / "method" / "shell.yaml").write_text(
        f"name: shell\ncarry_optimizer: true\ncallbacks:\n  boom:\n    _target_: os.system\n"
        f"    _args_: ['touch {marker}']\n")
    (configs / "method" / "planted.yaml").write_text(
        "name: planted\ncarry_optimizer: true\ncallbacks:\n  mine:\n    _target_: planted_method.Boom\n")
    (configs / "planted_method.py").write_text(f"open({str(marker)!r}, 'w').close()  # runs when imported\n"
                                               "class Boom:\n    pass\n")
    planted_path = {"PYTHONPATH": str(configs)}  # the user's module is importable, as the README's is

    def benchmark(*args: str, env: dict | None = None, timeout: float = 180):
        return launch("plasticity_callbacks.app.benchmark.main", ["--out", str(root / "benchmark_out"), *args],
                      root, timeout, env={**planted_path, **(env or {})})

    def method_file(name: str, key: str, via: str) -> str | None:
        marker.unlink(missing_ok=True)
        file = configs / "method" / f"{name}.yaml"
        if via == "benchmark":
            done = benchmark("--methods", name, "--config-dir", str(configs))
        else:
            run = root / f"train_{name}"
            done = launch("plasticity_callbacks.app.train", ["--config-dir", str(configs), "experiment=continual_digits",
                                                             f"+method={name}", f"hydra.run.dir={run}"], root, 180,
                          env=planted_path)
        problem = one_line(done, str(file), key, codes=(1, 2))  # plasticity-train: 2, a configuration error
        return ("the payload ran" if marker.exists() else None) or problem

    def shipped(name: str, edit, *words: str) -> str | None:
        path = root / "shipped" / name / "ranking_runs.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(SHIPPED_RESULTS, path)
        shutil.copy(SHIPPED_RESULTS.with_name("ranking_runs.json.sha256"), path.with_name("ranking_runs.json.sha256"))
        edit(path)
        # --tasks 1: a file read without its checks stops at the settings check instead, which names no file
        done = benchmark("--methods", "warm", "--tasks", "1", env={"FAULTS_SHIPPED_RESULTS": str(path)})
        return one_line(done, str(path), *words)

    def edited_numbers(path: Path) -> None:  # the better for a method: within [0, 1], the file as valid as before
        data = json.loads(path.read_text())
        data["runs"][0]["accuracy"] = [min(1.0, a + 0.1) for a in data["runs"][0]["accuracy"]]
        path.write_text(json.dumps(data, indent=1) + "\n")

    def foreign_version(path: Path) -> None:  # another release's file, its checksum written with it
        data = json.loads(path.read_text())
        data["version"], data["runs"][0]["accuracy"] = "9.9.9", [2.0] * len(data["runs"][0]["accuracy"])
        write_verified((json.dumps(data) + "\n").encode(), path)

    return {"benchmark --config-dir: method file naming os.system": lambda: method_file(
                "shell", "callbacks.boom._target_", "benchmark"),
            "benchmark --config-dir: method file naming a module of its own": lambda: method_file(
                "planted", "callbacks.mine._target_", "benchmark"),
            "train --config-dir: method file naming os.system": lambda: method_file(
                "shell", "callbacks.boom._target_", "train"),
            "train --config-dir: method file naming a module of its own": lambda: method_file(
                "planted", "callbacks.mine._target_", "train"),
            "ranking_runs.json: numbers edited": lambda: shipped("edited", edited_numbers, "SHA-256"),
            "ranking_runs.json: another version's, out-of-range numbers": lambda: shipped(
                "foreign", foreign_version, "accuracy outside [0, 1]"),
            "ranking_runs.json: not JSON (checksum recomputed)": lambda: shipped(
                "garbage", lambda p: write_verified(b"{ not json", p), "not a benchmark results file")}


def report_faults(root: Path) -> dict:
    """``plasticity-report`` on hostile run folders: a ``_target_`` naming a module planted beside the run (its
    import would run it), damaged or foreign files. Survived: the planted code never ran, and a file the report
    cannot read is one line naming it (exit 1)."""
    marker = root / "report_payload_ran"

    def folder(name: str) -> Path:
        run = root / "report" / name
        shutil.rmtree(run, ignore_errors=True)
        (run / ".hydra").mkdir(parents=True)
        (run / "planted_report.py").write_text(f"open({str(marker)!r}, 'w').close()  # runs when imported\n"
                                               "class Boom:\n    summary_metrics = ()\n")
        return run

    def report(run: Path):
        marker.unlink(missing_ok=True)
        return launch("plasticity_callbacks.app.report", [str(run)], run)  # cwd: the planted module is importable

    def planted_callback() -> str | None:
        run = folder("planted_callback")
        (run / ".hydra" / "config.yaml").write_text("seed: 0\ncallbacks:\n  evil:\n    _target_: planted_report.Boom\n")
        (run / "logs").mkdir()
        (run / "logs" / "metrics.csv").write_text("step,train/loss\n1,0.5\n2,0.4\n")
        done = report(run)
        if marker.exists():
            return "the payload ran"
        return None if done is not None and done.returncode == 0 else f"exit {None if done is None else done.returncode}"

    def planted_stream() -> str | None:
        run = folder("planted_stream")
        (run / ".hydra" / "config.yaml").write_text(
            "seed: 0\ndata:\n  _target_: plasticity_callbacks.data.digits.DigitsTaskStream\n"
            "  transform:\n    _target_: planted_report.Boom\n")
        (run / "stream.json").write_text(json.dumps({"method": "warm", "seed": 0}))
        (run / "tasks.csv").write_text("task,accuracy,online_accuracy\n0,0.5,0.4\n1,0.6,0.5\n")
        done = report(run)
        if marker.exists():
            return "the payload ran"
        return None if done is not None and done.returncode == 0 else f"exit {None if done is None else done.returncode}"

    def damaged(name: str, files: dict[str, str], named: str) -> str | None:
        run = folder(name)
        for relative, text in files.items():
            (run / relative).parent.mkdir(parents=True, exist_ok=True)
            (run / relative).write_text(text)
        return one_line(report(run), str(run / named))

    pipeline = {"method": "warm", "seed": 0, "phase_order": ["fit"],
                "phases": {"fit": {"index": 0, "steps": 2, "step_offset": 0, "val_loss": 1.0}}}
    logs = {"logs/fit/metrics.csv": "step,val/loss\n1,0.5\n"}
    return {"report: a _target_ naming a module planted in the run folder": planted_callback,
            "report: a stream config with a planted nested _target_": planted_stream,
            "report: pipeline.json not JSON": lambda: damaged("not_json", {"pipeline.json": "{"}, "pipeline.json"),
            "report: pipeline.json phases a list of strings": lambda: damaged(
                "phases_list", {"pipeline.json": json.dumps({**pipeline, "phases": {"fit": "x"}}), **logs},
                "pipeline.json"),
            "report: pipeline.json loss a word": lambda: damaged("loss_word", {"pipeline.json": json.dumps(
                {**pipeline, "phases": {"fit": {**pipeline["phases"]["fit"], "val_loss": "low"}}}), **logs},
                "pipeline.json"),
            "report: stream.json a list": lambda: damaged(
                "stream_list", {"stream.json": "[1, 2]", "tasks.csv": "task,accuracy\n0,0.5\n"}, "stream.json"),
            "report: tasks.csv accuracy a word": lambda: damaged(
                "tasks_word", {"stream.json": json.dumps({"seed": 0}), "tasks.csv": "task,accuracy\n0,abc\n"},
                "tasks.csv"),
            "report: metrics.csv step a word": lambda: damaged(
                "metrics_word", {".hydra/config.yaml": "seed: 0\n", "logs/metrics.csv": "step,train/loss\nx,0.5\n"},
                ".")}


MONITOR = ["experiment=smoke", "validate_before_fit=false", "+callbacks=[monitor,shrink_perturb]",
           "callbacks.monitor.activations_every_n_steps=1", "callbacks.monitor.weights_every_n_steps=1",
           "callbacks.monitor.spectra_every_n_steps=2", "callbacks.monitor.plot=false",
           "callbacks.shrink_perturb.schedule={threshold: {metric: monitor/weight_distance, above: 0.0, cooldown: 2, "
           "max_actions: 2}}"]


def monitor_faults(root: Path) -> dict:
    """PlasticityMonitor (θ₀ and its history) and a ShrinkPerturb on a threshold of the monitor's metric (its
    actions, cooldown and the value it acted on), stopped mid-fit and resumed, against the uninterrupted run."""
    reference = root / "monitor_reference"
    resume = ["ckpt_path=last", "resume_allow_changes=[callbacks.stop]"]

    def prepare():
        if not reference.exists():
            assert plasticity_train(reference, *MONITOR).returncode == 0, "monitor reference run failed"

    def stopped_then_resumed(name: str, stop: str, expected_exit: int) -> list[str]:
        prepare()
        run = root / name
        done = plasticity_train(run, *MONITOR, stop)
        if done is None or done.returncode != expected_exit:
            return [f"the stop {'hung' if done is None else f'exited {done.returncode}'}"]
        again = plasticity_train(run, *MONITOR, *resume)
        if again is None or again.returncode != 0:
            return [f"the resume {'hung' if again is None else f'exited {again.returncode}'}"]
        found = differences(run, reference, {"last": "last.ckpt"}, ["logs/metrics.csv"])
        return found + [f"{n} written beside last.ckpt" for n in last_versions(run / "checkpoints")]

    return {"monitor + threshold: SIGTERM after step 2, resumed": lambda: stopped_then_resumed(
                "monitor_sigterm_2", "+callbacks.stop={_target_: fault_injection.SignalAt, step: 2}", 143),
            "monitor + threshold: SIGTERM after step 4, resumed": lambda: stopped_then_resumed(
                "monitor_sigterm_4", "+callbacks.stop={_target_: fault_injection.SignalAt, step: 4}", 143),
            "monitor + threshold: crash after step 5, resumed": lambda: stopped_then_resumed(
                "monitor_crash_5", "+callbacks.stop={_target_: fault_injection.CrashAt, step: 5}", 1)}


def input_faults(root: Path) -> dict:
    """Bad inputs: each counts when it raises one line of the expected type."""

    def clear(call, error) -> str | None:
        try:
            call()
        except error as err:
            return None if "\n" not in str(err) and len(str(err)) > 20 else f"unclear: {str(err)[:80]!r}"
        except Exception as err:
            return f"{type(err).__name__}, not {error.__name__}"
        return "accepted"

    return {name: (lambda call=call, error=error: clear(call, error)) for name, call, error in bad_inputs(root)}


def bad_inputs(root: Path):
    from torch import nn

    from types import SimpleNamespace

    from plasticity_callbacks import ContinualBackprop, DASHPeriodic, ReDoMonitor, Schedule, declare_plasticity
    from plasticity_callbacks.app.pipeline import read_state, write_state
    from plasticity_callbacks.app.runs.checkpoints import read_checkpoint
    from plasticity_callbacks.app.runs.verified_files import write_verified
    from plasticity_callbacks.errors import CheckpointError
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
        ("ContinualBackprop layer_map naming no module", lambda: ContinualBackprop(
            layer_map={"nope": ("fc1", "fc2")}).setup(SimpleNamespace(strategy=None), model, "fit"), ValueError),
        ("DASHPeriodic shrink_rate=2", lambda: DASHPeriodic(shrink_rate=2), ValueError),
        ("DASHPeriodic min_factor=0", lambda: DASHPeriodic(min_factor=0), ValueError),
        ("Schedule(bogus=1)", lambda: Schedule(bogus=1), ValueError),
        ("declare_plasticity fused naming a bias", lambda: declare_plasticity(
            nn.Sequential(nn.Linear(4, 6)), fused={"0.bias": {"a": 3, "b": 3}}), ValueError),
        ("ReDoMonitor exclude pattern matching nothing", lambda: ReDoMonitor(selection={"exclude": ["nett.*"]}).setup(
            SimpleNamespace(strategy=None), model, "fit"), ValueError),
    ]


# ---------------------------------------------------------------------------------------------------- main
def run_faults(faults: dict, only: str | None) -> tuple[int, int]:
    survived = total = 0
    for name, fault in faults.items():
        if only and only.lower() not in name.lower():
            continue
        try:
            problem = fault()
        except Exception as err:  # an unexpected error is a fault not survived
            problem = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:160] if str(err).strip() else ''}"
        ok = not problem
        survived, total = survived + ok, total + 1
        print(f"  {'survived' if ok else 'LOST    '}  {name}{'' if ok else f'  ({problem})'}", flush=True)
    return survived, total


def main() -> None:
    global BROKEN
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default="pipeline,fsdp2,ddp,hf,fabric,benchmark,report,monitor,inputs")
    parser.add_argument("--break", dest="broken", default=None, help=f"one of {', '.join(BREAKS)}: break that "
                        "guarantee on purpose")
    parser.add_argument("--only", default=None, help="run only the faults whose name holds this word")
    parser.add_argument("--reuse", type=Path, default=None, help="keep the uninterrupted reference runs in this "
                        "folder and reuse them (e.g. across --break runs: the reference is never broken)")
    args = parser.parse_args()
    if args.reuse is not None:  # reference runs first, unbroken, once; each invocation's faults in their own folder
        args.reuse.mkdir(parents=True, exist_ok=True)
        for family in args.families.split(","):
            if family in ("pipeline", "fsdp2", "ddp", "monitor"):
                references(args.reuse, family)
    if args.broken:
        BROKEN = args.broken
        break_guarantee(args.broken)
    root = args.reuse or Path(tempfile.mkdtemp(prefix="faults-"))
    if args.reuse is not None:  # the reference runs stay in root; this invocation's faults go one level down
        cases = root / f"cases-{os.getpid()}"
        for name in ("reference", "pretrained", "fsdp2_reference", "ddp_reference", "monitor_reference"):
            if (root / name).exists():
                (cases / name).parent.mkdir(parents=True, exist_ok=True)
                (cases / name).symlink_to(root / name)
        root = cases
    families = {"pipeline": lambda: pipeline_faults(root), "fsdp2": lambda: sharded_faults(root, "fsdp2"),
                "ddp": lambda: sharded_faults(root, "ddp"), "hf": lambda: hf_faults(root),
                "fabric": lambda: fabric_faults(root), "benchmark": lambda: benchmark_faults(root),
                "report": lambda: report_faults(root), "monitor": lambda: monitor_faults(root),
                "inputs": lambda: input_faults(root)}
    counts = {}
    for family in args.families.split(","):
        print(f"{family}{f' (broken on purpose: {BROKEN})' if BROKEN else ''}:", flush=True)
        counts[family] = run_faults(families[family](), args.only)
    for family, (survived, total) in counts.items():
        print(f"{family}: faults survived with nothing lost: {survived}/{total}")
    if args.reuse is None:
        shutil.rmtree(root, ignore_errors=True)


def references(root: Path, family: str) -> None:
    """The uninterrupted runs a family compares against (with no guarantee broken)."""
    runs = {"pipeline": [("reference", PIPELINE), ("pretrained", [*PIPELINE, "pipeline.stop_phase=pretrain"])],
            "fsdp2": [("fsdp2_reference", [*SINGLE, "trainer=fsdp2"])],
            "ddp": [("ddp_reference", [*SINGLE, "trainer=ddp"])],
            "monitor": [("monitor_reference", MONITOR)]}[family]
    for name, overrides in runs:
        if not (root / name).exists():
            assert plasticity_train(root / name, *overrides).returncode == 0, f"{name} run failed"


def as_command(module: str, broken: str, args: list[str]) -> None:
    """Run ``module``'s ``main`` as its console script does (``cli._run``), with ``broken`` broken first ("-":
    none) and, for ``plasticity-benchmark``, ``FAULTS_SHIPPED_RESULTS`` as its shipped runs."""
    import importlib

    if broken != "-":
        break_guarantee(broken)
    sys.path.insert(0, os.getcwd())  # as ``python -m`` does: the working directory first
    command = importlib.import_module(module)
    if os.environ.get("FAULTS_SHIPPED_RESULTS"):
        command.SHIPPED_RESULTS = Path(os.environ["FAULTS_SHIPPED_RESULTS"])
    sys.argv = [module, *args]
    command.main()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--as"]:  # a command launched with a guarantee broken (see --break) or shipped runs swapped
        as_command(sys.argv[2], sys.argv[3], sys.argv[4:])
    else:
        main()
