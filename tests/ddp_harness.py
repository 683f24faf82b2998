"""Run callbacks under DDP with 2 CPU ranks and assert the ranks end bit-identical.

A test declares its run with the ``ddp_run`` marker and reads the results from the ``ddp_run`` fixture
(``conftest.py``); the runs of every selected test train in one launch, the first time a test asks (two
interpreters and a process group started once, not once per test):

    @pytest.mark.multiprocess
    @pytest.mark.ddp_run({"_target_": "plasticity_callbacks.FIREReinit"}, model="gpt", steps=4)
    def test_fire_keeps_ranks_identical(ddp_run):
        assert_ranks_identical(ddp_run)

``run_ddp(tmp_path, callbacks, ...)`` is one run on a launch of its own.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

WORKER = Path(__file__).with_name("ddp_worker.py")


def ddp_spec(callbacks: list[dict] | dict | None = None, model: str = "mlp", optimizer: str = "adamw", steps: int = 6,
             accumulate: int = 1) -> dict:
    """One run: ``model`` (mlp | cnn | gpt) trained for ``steps`` optimizer steps with ``callbacks`` (Hydra
    ``_target_`` dicts), ``accumulate`` batches a step."""
    if isinstance(callbacks, dict):
        callbacks = [callbacks]
    return {"model": model, "optimizer": optimizer, "steps": steps, "accumulate": accumulate,
            "callbacks": callbacks or []}


def run_ddp_many(out: Path, runs: dict[str, dict], timeout: float = 300) -> dict[str, list[dict]]:
    """Every run of ``runs`` (name -> :func:`ddp_spec`) in one 2-rank launch; each run's per-rank
    ``{"params", "optimizer", "metrics"}`` by name."""
    spec_path = out / "ddp_spec.json"
    spec_path.write_text(json.dumps({"out": str(out), "runs": [{"name": name, **spec} for name, spec in runs.items()]}))
    env = dict(os.environ, OMP_NUM_THREADS="1", PL_DISABLE_FORK="1")
    env.pop("LOCAL_RANK", None)
    proc = subprocess.run([sys.executable, str(WORKER), str(spec_path)], cwd=out, env=env,
                          capture_output=True, text=True, timeout=timeout * max(1, len(runs)))
    if proc.returncode != 0:
        raise AssertionError(f"DDP launch failed (exit {proc.returncode}; the last 'ddp_worker: run' line names the "
                             f"run):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return {name: [torch.load(out / name / f"rank{r}.pt", weights_only=True) for r in range(2)] for name in runs}


def run_ddp(tmp_path: Path, callbacks: list[dict] | dict | None, model: str = "mlp", optimizer: str = "adamw",
            steps: int = 6, accumulate: int = 1, timeout: float = 300) -> list[dict]:
    """One run (see :func:`ddp_spec`) on a launch of its own; each rank's ``{"params", "optimizer", "metrics"}``."""
    spec = ddp_spec(callbacks, model, optimizer, steps, accumulate)
    return run_ddp_many(tmp_path, {"run": spec}, timeout)["run"]


class SharedLaunch:
    """The ``ddp_run`` runs of the selected tests (``runs``: test id -> :func:`ddp_spec`), trained together in
    one launch when the first of them asks for its results."""

    def __init__(self, out: Path, runs: dict[str, dict]):
        self.out, self.runs = out, runs
        self.results: dict[str, list[dict]] | None = None
        self.error: str | None = None

    def __getitem__(self, test_id: str) -> list[dict]:
        if self.error is not None:  # the launch failed once: every test that shares it fails with its message
            raise AssertionError(self.error)
        if self.results is None:
            names = {test_id: f"run{index}" for index, test_id in enumerate(self.runs)}
            try:
                by_name = run_ddp_many(self.out, {names[t]: spec for t, spec in self.runs.items()})
            except AssertionError as err:
                self.error = f"the shared DDP launch of {sorted(self.runs)} failed: {err}"
                raise AssertionError(self.error) from None
            self.results = {t: by_name[name] for t, name in names.items()}
        return self.results[test_id]


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
