"""No load path runs code a checkpoint carries: FSDP2 distributed checkpoints and the HF Trainer adapter's state file.

Every payload is real: unpickling it calls ``open(marker, "w")`` (``fault_injection.Payload``), so a test fails if
the marker appears. Each hostile file carries a matching ``.sha256``, as anyone who can write the file can make it.

* FSDP2: a payload in a non-tensor item of a ``.distcp`` shard (the optimizer's param-group settings, which
  torch's default load planner unpickles with ``weights_only=False``) is refused by the checks before a resume, by
  :func:`load_sharded` (the planner), and by ``VerifiedModelParallelStrategy`` on 2 gloo ranks.
* HF: ``plasticity_callbacks.pt`` is checksummed and read as data on resume and in ``on_save``.
"""
from __future__ import annotations

import io
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from fault_injection import Payload, hostile_shard_item
from fsdp_harness import run_fsdp2
from plasticity_callbacks.app.runs.checkpoint_folders import load_sharded
from plasticity_callbacks.app.runs.checkpoints import read_checkpoint
from plasticity_callbacks.app.runs.verified_files import checksum_path, write_verified
from plasticity_callbacks.errors import CheckpointError, ResumeError

ITEM = "optimizer_0.param_groups.0.lr"


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A distributed checkpoint of 2 FSDP2 ranks (an MLP, AdamW, 2 steps), written by the package's strategy."""
    out = tmp_path_factory.mktemp("fsdp2_source")
    run_fsdp2(out, [{"name": "source", "model": "mlp", "steps": 2, "ckpt_every": 2, "distributed_checkpoint": True}])
    return out / "source_2" / "ckpt" / "last.ckpt"


def planted(folder: Path, tmp_path: Path) -> tuple[Path, Path]:
    copy, marker = tmp_path / "last.ckpt", tmp_path / "payload_ran"
    shutil.copytree(folder, copy)
    return hostile_shard_item(copy, marker, ITEM), marker


@pytest.mark.multiprocess  # its fixture trains on 2 ranks
def test_the_planted_shard_item_runs_under_torchs_default_planner(folder, tmp_path):
    """The payload is live: the loader Lightning's ModelParallelStrategy calls runs it (why the rest is needed)."""
    import torch.distributed.checkpoint as dcp

    copy, marker = planted(folder, tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load({ITEM: None}, checkpoint_id=copy, no_dist=True)
    assert marker.exists()


@pytest.mark.multiprocess  # its fixture trains on 2 ranks
def test_a_shard_item_that_needs_code_is_refused_before_a_resume_in_one_line(folder, tmp_path):
    copy, marker = planted(folder, tmp_path)
    assert read_checkpoint(folder, mmap=True)["global_step"] == 2  # the untouched folder reads
    for tensors in (False, True):  # the checks before a resume, and a phase that starts from the weights
        with pytest.raises(CheckpointError, match=r"__\d_0\.distcp \(item optimizer_0\.param_groups\.0\.lr\) needs "
                                                  r"arbitrary code to load \(io\.open\)") as err:
            read_checkpoint(copy, mmap=not tensors)
        assert "\n" not in str(err.value) and str(copy) in str(err.value)
    assert not marker.exists()


@pytest.mark.multiprocess  # its fixture trains on 2 ranks
def test_the_load_planner_reads_shard_items_as_data(folder, tmp_path):
    copy, marker = planted(folder, tmp_path)
    state = {ITEM: None, "optimizer_0.param_groups.0.betas": None}
    load_sharded(state, folder, no_dist=True)
    assert isinstance(state[ITEM], float) and state["optimizer_0.param_groups.0.betas"] == (0.9, 0.999)
    with pytest.raises(CheckpointError, match="needs arbitrary code to load"):
        load_sharded({ITEM: None}, copy, no_dist=True)
    assert not marker.exists()


@pytest.mark.multiprocess
def test_the_fsdp2_strategy_refuses_a_planted_item_on_every_rank(folder, tmp_path):
    """Lightning's own resume path under the package's strategy (no check before the fit): both ranks refuse."""
    copy, marker = planted(folder, tmp_path / "planted")
    with pytest.raises(AssertionError) as err:
        run_fsdp2(tmp_path, [{"name": "resumed", "model": "mlp", "steps": 4, "distributed_checkpoint": True,
                              "resume": str(copy.relative_to(tmp_path))}])
    assert "needs arbitrary code to load (io.open)" in str(err.value), str(err.value)[-3000:]
    assert not marker.exists()


def test_a_fit_under_lightnings_plain_fsdp2_strategy_is_refused_with_the_fix():
    from types import SimpleNamespace

    from lightning.pytorch.strategies import ModelParallelStrategy

    from plasticity_callbacks.app.runs.model_parallel import VerifiedModelParallelStrategy
    from plasticity_callbacks.app.runs.resume import ResumeGuard

    def fit_with(strategy):
        ResumeGuard().setup(SimpleNamespace(strategy=strategy), None, "fit")

    with pytest.raises(CheckpointError, match="unpickles .*use plasticity_callbacks.app.runs.model_parallel."
                                              "VerifiedModelParallelStrategy"):
        fit_with(ModelParallelStrategy(save_distributed_checkpoint=True))
    fit_with(VerifiedModelParallelStrategy(save_distributed_checkpoint=True))
    fit_with(ModelParallelStrategy(save_distributed_checkpoint=False))  # one file: read through the IO plugin


# ------------------------------------------------------------------------------------------- HF Trainer adapter
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from plasticity_callbacks.callbacks.fire import FIREReinit  # noqa: E402
from plasticity_callbacks.callbacks.redo import ReDoMonitor  # noqa: E402
from plasticity_callbacks.callbacks.schedule import Schedule  # noqa: E402
from plasticity_callbacks.integrations.hf import STATE_FILE  # noqa: E402
from test_hf_trainer import make_trainer, tiny_gpt2  # noqa: E402


def fire() -> FIREReinit:
    return FIREReinit(schedule=Schedule(steps=[1]), selection={"scope": "attention"})


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory) -> Path:
    """A 2-step run with FIRE and ReDo, checkpointed at step 2."""
    out = tmp_path_factory.mktemp("hf")
    make_trainer(out, tiny_gpt2(), fire(), ReDoMonitor(), max_steps=2, save_steps=2).train()
    return out


def hostile_dict(marker: Path) -> bytes:
    buffer = io.BytesIO()
    torch.save({"adapters": [{"payload": Payload(marker)}]}, buffer)
    return buffer.getvalue()


def raw_pickle(marker: Path) -> bytes:
    import pickle

    return pickle.dumps(Payload(marker))


def flipped(data: bytes) -> bytes:
    return data[: len(data) // 2] + bytes([data[len(data) // 2] ^ 0xFF]) + data[len(data) // 2 + 1:]


# (what the file becomes, whether its .sha256 is recomputed to match, words the refusal holds)
DAMAGE = {
    "payload in a state dict": (hostile_dict, True, "needs arbitrary code to load"),
    "raw pickle payload": (raw_pickle, True, "needs arbitrary code to load"),
    "one byte flipped": (lambda marker, data: flipped(data), False, "does not match its recorded SHA-256"),
    "truncated": (lambda marker, data: data[:-50], False, "truncated or replaced"),
    "empty": (lambda marker, data: b"", False, "is empty"),
    "truncated, checksum recomputed": (lambda marker, data: data[:-50], True, "not a readable torch checkpoint"),
}


def resume(output: Path, *callbacks):
    trainer = make_trainer(output, tiny_gpt2(), *callbacks, max_steps=3, save_steps=2)
    trainer.train(resume_from_checkpoint=str(output / "checkpoint-2"))


@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_damaged_or_hostile_adapter_state_file_is_refused_in_one_line(hf_run, tmp_path, case):
    make, recompute, words = DAMAGE[case]
    run, marker = tmp_path / "run", tmp_path / "payload_ran"
    shutil.copytree(hf_run, run)
    path = run / "checkpoint-2" / STATE_FILE
    data = make(marker) if make in (hostile_dict, raw_pickle) else make(marker, path.read_bytes())
    if recompute:
        write_verified(data, path)
    else:
        path.write_bytes(data)
    with pytest.raises(CheckpointError, match=words) as err:
        resume(run, fire(), ReDoMonitor())
    assert "\n" not in str(err.value) and str(path) in str(err.value), str(err.value)
    assert not marker.exists()


def test_a_state_file_planted_before_a_fresh_run_is_not_unpickled_at_its_first_save(tmp_path):
    marker = tmp_path / "payload_ran"
    write_verified(hostile_dict(marker), tmp_path / "checkpoint-2" / STATE_FILE)
    with pytest.raises(CheckpointError, match="needs arbitrary code to load"):
        make_trainer(tmp_path, tiny_gpt2(), fire(), max_steps=2, save_steps=2).train()
    assert not marker.exists()


def test_a_callback_removed_or_added_since_the_save_is_refused(hf_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(hf_run, run)
    with pytest.raises(ResumeError, match=r"state of callbacks this run does not have: ReDoMonitor"):
        resume(run, fire())
    with pytest.raises(ResumeError, match=r"no state for .*FIREReinit.*"):
        resume(run, FIREReinit(schedule=Schedule(steps=[2]), selection={"scope": "attention"}), ReDoMonitor())


def test_the_state_file_is_checksummed_and_holds_every_adapters_group(tmp_path):
    from plasticity_callbacks.integrations.hf import HFTrainerCallback, read_state_file

    trainer = make_trainer(tmp_path, tiny_gpt2(), fire(), max_steps=2, save_steps=2)
    trainer.add_callback(HFTrainerCallback(ReDoMonitor(), trainer=trainer))  # a second adapter, the same file
    trainer.train()
    path = tmp_path / "checkpoint-2" / STATE_FILE
    assert checksum_path(path).is_file()
    groups = read_state_file(path)
    assert [sorted(k.split("{")[0] for k in group) for group in groups] == [["FIREReinit"], ["ReDoMonitor"]]
    assert groups[0][next(iter(groups[0]))]["history"][0]["global_step"] == 1  # FIRE's state at the save
