"""Run callbacks under FSDP2 on 2 CPU ranks and on one process over the same global batches; compare.

    results = run_fsdp2(tmp_path, [{"name": "fire", "model": "gpt2", "callbacks": [...]}])
    assert_same_as_single(run_single(tmp_path, runs[0]), results["fire"])
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

WORKER = Path(__file__).with_name("fsdp_worker.py")
CRASH_EXIT = 3  # fsdp_worker.CRASH_EXIT
RTOL, ATOL = 1e-4, 1e-5  # float32: FSDP2 reduce-scatters gradients in another order than one process sums them


def run_fsdp2(tmp_path: Path, runs: list[dict], timeout: float = 600, crash: bool = False) -> dict[str, dict]:
    """Every run on one 2-rank launch (one process-group start for all); each run's rank-0 result by name.
    ``crash``: the launch must end by the worker's ``Crash`` (a run with ``crash_at``); nothing is returned."""
    spec_path = tmp_path / "fsdp_spec.json"
    spec_path.write_text(json.dumps({"out": str(tmp_path), "runs": runs}))
    env = dict(os.environ, OMP_NUM_THREADS="1", PL_DISABLE_FORK="1")
    env.pop("LOCAL_RANK", None)
    proc = subprocess.run([sys.executable, str(WORKER), str(spec_path)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=timeout)
    if crash:
        if proc.returncode != CRASH_EXIT:
            raise AssertionError(f"expected the crash exit {CRASH_EXIT}, got {proc.returncode}:\n{proc.stderr[-6000:]}")
        return {}
    if proc.returncode != 0:
        raise AssertionError(f"FSDP2 run failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-6000:]}")
    return {run["name"]: torch.load(tmp_path / f"{run['name']}.pt", weights_only=True) for run in runs}


def run_single(tmp_path: Path, run: dict) -> dict:
    from fsdp_worker import run as run_worker

    return run_worker(run, tmp_path, devices=1)


def assert_close(single, sharded, path: str = "") -> None:
    if torch.is_tensor(single):
        assert torch.is_tensor(sharded) and single.shape == sharded.shape, f"{path}: {single.shape} vs {sharded}"
        torch.testing.assert_close(sharded.double(), single.double(), rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"{path}: {m}")
    elif isinstance(single, dict):
        assert set(single) == set(sharded), f"{path}: keys {sorted(set(single) ^ set(sharded))} differ"
        for key in single:
            assert_close(single[key], sharded[key], f"{path}.{key}")
    elif isinstance(single, (list, tuple)):
        assert isinstance(sharded, (list, tuple)) and len(single) == len(sharded), f"{path}: {single!r} vs {sharded!r}"
        for index, (a, b) in enumerate(zip(single, sharded)):
            assert_close(a, b, f"{path}[{index}]")
    else:
        assert single == sharded, f"{path}: {single!r} != {sharded!r}"


def assert_same_as_single(single: dict, sharded: dict, metrics: tuple[str, ...] = ()) -> None:
    """Weights and optimizer state equal to float32 rounding; so are the named logged metrics."""
    assert_close(single["params"], sharded["params"], "params")
    assert_close(single["optimizer"], sharded["optimizer"], "optimizer")
    for name in metrics:
        assert name in single["metrics"] and name in sharded["metrics"], f"{name} not logged"
        assert_close(single["metrics"][name], sharded["metrics"][name], name)
