"""Crash-and-resume equivalence: an interrupted and resumed run must end where an uninterrupted one does.

    scenarios = {"redo": dict(callbacks=[{...}], steps=12, ckpt_every=5, stop_at=5)}
    results = run_resume_scenarios(tmp_path, scenarios)   # two worker processes for all scenarios
    assert_same_run(results["redo"]["reference"], results["redo"]["resumed"])

Process 1 trains every scenario uninterrupted (``reference``), then again until it is interrupted
just after the checkpoint at ``stop_at``; process 2, fresh, resumes each from ``last.ckpt`` and
finishes (``resumed``). Deterministic CPU kernels, seeded data order and rank-identical callback
generators make the two bit-identical in practice; the comparison allows float32 rounding only.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

WORKER = Path(__file__).with_name("resume_worker.py")
RTOL, ATOL = 1e-6, 1e-7
VOLATILE = ("seconds",)  # wall-clock measurements inside callback state differ run to run


def run_worker(tmp_path: Path, runs: list[dict], name: str = "spec", timeout: float = 300,
               wait: bool = True) -> subprocess.CompletedProcess | subprocess.Popen:
    spec_path = tmp_path / f"{name}.json"
    spec_path.write_text(json.dumps({"runs": runs}))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, str(WORKER), str(spec_path)]
    if not wait:  # output to a file: a full pipe would block the worker
        log = open(tmp_path / f"{name}.log", "w")
        return subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"worker failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-6000:]}")
    return proc


def load_result(out: Path) -> dict:
    return torch.load(out / "result.pt", weights_only=False)


def run_resume_scenarios(tmp_path: Path, scenarios: dict[str, dict]) -> dict[str, dict]:
    """For each ``name: spec`` (resume_worker's fields; ``stop_at`` required; ``same_reference_as``: reuse
    another scenario's uninterrupted run) return
    ``{"reference": result, "resumed": result, "checkpoint": path of the interrupted run's last.ckpt}``."""
    first, second = [], []
    for name, spec in scenarios.items():
        base = {k: v for k, v in spec.items() if k not in ("stop_at", "how", "same_reference_as")}
        if "same_reference_as" not in spec:  # scenarios that differ only in where they stop share one
            first.append(dict(base, out=str(tmp_path / name / "reference")))
        first.append(dict(base, out=str(tmp_path / name / "interrupted"), stop_at=spec["stop_at"], how="raise"))
        second.append(dict(base, out=str(tmp_path / name / "interrupted"), resume=True))
    run_worker(tmp_path, first, "uninterrupted_and_interrupted")
    run_worker(tmp_path, second, "resumed")
    return {name: {"reference": load_result(tmp_path / spec.get("same_reference_as", name) / "reference"),
                   "resumed": load_result(tmp_path / name / "interrupted"),
                   "checkpoint": tmp_path / name / "interrupted" / "checkpoints" / "last.ckpt"}
            for name, spec in scenarios.items()}


def assert_close_tree(a, b, path: str) -> None:
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.shape == b.shape and a.dtype == b.dtype, f"{path}: {a!r} vs {b!r}"
        if a.is_floating_point():
            torch.testing.assert_close(b, a, rtol=RTOL, atol=ATOL, equal_nan=True, msg=lambda m: f"{path}: {m}")
        else:
            assert torch.equal(a, b), f"{path} differs"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(map(str, a)) == set(map(str, b)), \
            f"{path}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        for k in a:
            if not any(v in str(k) for v in VOLATILE):
                assert_close_tree(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{path}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_close_tree(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and isinstance(b, float):
        assert a == b or abs(a - b) <= ATOL + RTOL * abs(a) or (a != a and b != b), f"{path}: {a} vs {b}"
    else:
        assert a == b, f"{path}: {a!r} vs {b!r}"


def assert_same_run(reference: dict, resumed: dict, callback_state: bool = True) -> None:
    """Same step count, parameters, buffers and optimizer state, and (by default) the same callback state."""
    assert resumed["global_step"] == reference["global_step"]
    assert_close_tree(reference["params"], resumed["params"], "params")
    assert_close_tree(reference["buffers"], resumed["buffers"], "buffers")
    assert_close_tree(reference["optimizer"], resumed["optimizer"], "optimizer")
    if callback_state:
        assert_close_tree(reference["callbacks"], resumed["callbacks"], "callbacks")
