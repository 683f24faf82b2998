"""Callback state shaped like parameters, on one process: what a checkpoint holds comes back placed like the
parameters, and what cannot is refused with the fix (the FSDP2 paths run in ``test_fsdp.py``'s 2-rank launch)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from plasticity_callbacks.callbacks.hare_tortoise import HareTortoise
from plasticity_callbacks.callbacks.l2_init import L2Init
from plasticity_callbacks.distributed.sharded_state import pack_for_checkpoint, restore_like, squared_distance


def test_plain_tensors_come_back_on_the_parameters_device_and_dtype():
    params = [torch.randn(4, 3, dtype=torch.float64), torch.randn(5)]
    saved = [torch.randn(4, 3), torch.randn(5)]  # float32 on disk
    restored = restore_like(SimpleNamespace(ckpt_path=None), saved, params, "anchors")
    assert [r.dtype for r in restored] == [torch.float64, torch.float32]
    for r, s in zip(restored, saved):
        torch.testing.assert_close(r.float(), s)


def test_a_checkpoint_of_another_model_or_a_distributed_one_off_fsdp2_is_refused_with_the_fix():
    params = [torch.randn(4, 3)]
    with pytest.raises(ValueError, match="anchors: tensor 0 of the checkpoint has shape \\(3, 4\\).*same model"):
        restore_like(None, [torch.randn(3, 4)], params, "anchors")
    with pytest.raises(ValueError, match="anchors: the checkpoint holds 2 tensors, the model has 1"):
        restore_like(None, [torch.randn(4, 3)] * 2, params, "anchors")
    with pytest.raises(ValueError, match="distributed checkpoint folder.*ModelParallelStrategy.*ckpt_path"):
        restore_like(SimpleNamespace(ckpt_path="run.ckpt"), ["L2Init{}/anchors/0"], params, "anchors")


def test_packing_leaves_plain_state_as_it_is():
    tensors = [torch.randn(2, 2)]
    checkpoint = {"state_dict": {}, "callbacks": {"key": {"anchors": list(tensors)}}}
    trainer = SimpleNamespace(strategy=SimpleNamespace(_save_distributed_checkpoint=True), is_global_zero=True)
    pack_for_checkpoint(trainer, checkpoint, "key", ("anchors",))
    assert checkpoint["state_dict"] == {} and checkpoint["callbacks"]["key"]["anchors"][0] is tensors[0]


def test_squared_distance_is_the_sum_over_pairs():
    xs, ys = [torch.randn(3, 2), torch.randn(4)], [torch.randn(3, 2), torch.randn(4)]
    expected = sum(((x.double() - y.double()) ** 2).sum() for x, y in zip(xs, ys))
    torch.testing.assert_close(squared_distance(xs, ys).double(), expected)


@pytest.mark.parametrize("make", [lambda: L2Init(strength=0.1), lambda: HareTortoise(decay=0.5)],
                         ids=["l2_init", "hare_tortoise"])
def test_copies_from_a_checkpoint_of_another_model_are_refused_naming_both_selections(make):
    from tiny import TinyMLPModule, cpu_trainer, regression_loader, tiny_gpt_module, token_loader

    first = make()
    cpu_trainer(max_steps=1, callbacks=[first]).fit(TinyMLPModule(), regression_loader())
    resumed = make()
    resumed.load_state_dict(first.state_dict())
    with pytest.raises(ValueError, match=r"the checkpoint holds 6 parameters \['net.0.weight'.*this model selects"):
        cpu_trainer(max_steps=1, callbacks=[resumed]).fit(tiny_gpt_module(), token_loader())
