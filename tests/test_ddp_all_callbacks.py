"""Every callback under DDP (2 CPU ranks, gloo), all acting in one run: on the GPT with Muon and gradient
accumulation, and on the CNN with SGD (the conv path). The callbacks are found (:mod:`callback_table`: the
package's exports and ``configs/callbacks/``), so a new method is here without an edit. Parameters, optimizer
states and logged callback metrics must be bit-identical on both ranks, and every method must have logged its
summary metric (else the test proves nothing).

Owners' DDP tests cover each method's own DDP semantics (ReDo's all-reduced statistics, DASH's data pass,
AdaptiveSVD's projection); this file checks that they keep the ranks identical together.
Two DDP runs, ~20-30 s each on an idle 2-core machine; they run in CI (no GPU needed).
"""
from __future__ import annotations

import pytest

from callback_table import acting_soon, configs, exported_callbacks, methods
from ddp_harness import assert_ranks_identical

NEEDS_GATES = {"GateLogger"}  # reads the reciprocal blocks' gates, which the tiny models do not have


def test_every_method_has_a_config_and_every_config_an_exported_callback():
    """A method is its callback, its config and its test: the config is what puts it in the DDP runs below."""
    assert set(methods()) <= set(configs()) <= set(exported_callbacks())


def callbacks_for(model: str) -> list[dict]:
    return [acting_soon(name) for name in sorted(configs()) if name not in NEEDS_GATES]


def assert_acted(metrics: dict) -> None:
    for name, cls in methods().items():
        assert any(m in metrics for m in cls.summary_metrics), f"{name} logged none of {cls.summary_metrics}"
    assert float(metrics["redo/recycled"]) > 0
    assert float(metrics["adaptive_svd/n_minor"]) > 0


@pytest.mark.multiprocess
@pytest.mark.ddp_run(callbacks_for("gpt"), model="gpt", optimizer="muon", steps=4, accumulate=2)
def test_all_callbacks_on_gpt_with_muon_and_accumulation_keep_ranks_identical(ddp_run):
    results = ddp_run
    assert_ranks_identical(results)
    assert_acted(results[0]["metrics"])


@pytest.mark.multiprocess
@pytest.mark.ddp_run(callbacks_for("cnn"), model="cnn", optimizer="sgd", steps=4)
def test_all_callbacks_on_cnn_with_sgd_keep_ranks_identical(ddp_run):
    results = ddp_run
    assert_ranks_identical(results)
    assert_acted(results[0]["metrics"])


# ------------------------------------------------------------------ the FSDP gather path, on CPU (gloo)

def _fsdp_worker(rank: int, port: int, out: str, flavour: str) -> None:
    import os

    import torch
    import torch.distributed as dist
    from torch import nn

    from plasticity_callbacks.distributed.process_group import end_process_group
    from plasticity_callbacks.distributed.strategy import full_parameters, gather_full, is_dtensor
    from plasticity_callbacks.functional.spectral import PolarOptions, orthogonalize

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)  # the same initial weights on both ranks
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))  # 5 rows: uneven shards
    expected = orthogonalize(model[0].weight.detach(), PolarOptions(method="svd"))
    result = {}
    try:
        if flavour == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            for layer in (model[0], model[2]):
                fully_shard(layer)
            fully_shard(model)
            original = model[0].weight
            result["sharded"] = is_dtensor(original) and original.to_local().shape[0] < 5
        else:
            from torch.distributed.fsdp import FullyShardedDataParallel

            model = FullyShardedDataParallel(model, use_orig_params=True)
            original = None
        inner = model if flavour == "fsdp2" else model.module
        with full_parameters(model):
            weight = inner[0].weight
            result["full_inside"] = tuple(weight.shape) == (5, 6) and not is_dtensor(weight)
            with torch.no_grad():
                weight.copy_(orthogonalize(weight.detach(), PolarOptions(method="svd")))
        if flavour == "fsdp2":
            result["same_parameter_object"] = model[0].weight is original
            gathered = gather_full(model[0].weight)
        else:
            with full_parameters(model, writeback=False):
                gathered = inner[0].weight.detach().clone()
        result["written_back"] = torch.allclose(gathered, expected, atol=1e-6)
        model(torch.randn(4, 6)).sum().backward()  # the sharded model still trains afterwards
        result["trains"] = True
    except Exception as err:  # reported to the test, which decides between failing and skipping
        result["error"] = f"{type(err).__name__}: {err}"
    torch.save(result, f"{out}/{flavour}_rank{rank}.pt")
    end_process_group()


@pytest.mark.multiprocess
@pytest.mark.parametrize("flavour", ["fsdp2", "fsdp1"])
def test_full_parameters_gathers_and_writes_back_fsdp_shards(tmp_path, flavour):
    """FSDP2 (DTensor ``full_tensor``) and FSDP1 (``summon_full_params``) on 2 CPU processes: inside
    the block a weight is whole; an update made there (here: its polar factor) lands in the shards."""
    import socket

    import torch
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_fsdp_worker, args=(port, str(tmp_path), flavour), nprocs=2, start_method="fork")
    results = [torch.load(tmp_path / f"{flavour}_rank{r}.pt") for r in range(2)]
    if flavour == "fsdp1" and any("error" in r for r in results):
        pytest.skip(f"FSDP1 does not run on CPU in this torch build: {results[0].get('error')}")
    for r in results:
        assert "error" not in r, r["error"]
        assert r["full_inside"] and r["written_back"] and r["trains"], r
        if flavour == "fsdp2":
            assert r["sharded"] and r["same_parameter_object"], r
