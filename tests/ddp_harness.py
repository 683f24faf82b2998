"""Run a callback under DDP with 2 CPU ranks and assert the ranks end bit-identical.

    results = run_ddp(tmp_path, {"_target_": "plasticity_callbacks.FIREReinit", ...}, model="gpt")
    assert_ranks_identical(results)
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

WORKER = Path(__file__).with_name("ddp_worker.py")


def run_ddp(tmp_path: Path, callbacks: list[dict] | dict | None, model: str = "mlp", optimizer: str = "adamw",
            steps: int = 6, accumulate: int = 1, timeout: float = 300) -> list[dict]:
    """Train ``model`` (mlp | cnn | gpt) for ``steps`` on 2 gloo ranks with ``callbacks``
    (Hydra ``_target_`` dicts); return each rank's ``{"params", "optimizer", "metrics"}``."""
    if isinstance(callbacks, dict):
        callbacks = [callbacks]
    spec = {"out": str(tmp_path), "model": model, "optimizer": optimizer, "steps": steps,
            "accumulate": accumulate, "callbacks": callbacks or []}
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, OMP_NUM_THREADS="1", PL_DISABLE_FORK="1")
    env.pop("LOCAL_RANK", None)
    proc = subprocess.run([sys.executable, str(WORKER), str(spec_path)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"DDP run failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]


def _assert_equal(a, b, path: str) -> None:
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.shape == b.shape and torch.equal(a, b), f"ranks differ at {path}"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"ranks differ in keys at {path}"
        for k in a:
            _assert_equal(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"ranks differ in length at {path}"
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_equal(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"ranks differ at {path}: {a!r} != {b!r}"


def assert_ranks_identical(results: list[dict], metrics: bool = True, per_rank=("train/", "val/")) -> None:
    """Parameters and optimizer state bit-identical on both ranks, and so are the logged
    metrics, except the model's own per-rank losses (names starting with ``per_rank``)."""
    rank0, rank1 = results
    _assert_equal(rank0["params"], rank1["params"], "params")
    _assert_equal(rank0["optimizer"], rank1["optimizer"], "optimizer")
    if metrics:
        def shared(m):
            return {k: v for k, v in m.items() if not k.startswith(tuple(per_rank))}

        _assert_equal(shared(rank0["metrics"]), shared(rank1["metrics"]), "metrics")


def assert_trained(results: list[dict], initial: dict[str, torch.Tensor]) -> None:
    """Guard against a vacuous pass: training must have changed the weights."""
    changed = [n for n, p in results[0]["params"].items() if not torch.equal(p, initial[n])]
    assert changed, "no parameter changed during the DDP run"
