"""The DDP harness itself: without callbacks, ranks stay identical (and a broken rank would be caught)."""
import pytest
import torch

from ddp_harness import _assert_equal, assert_ranks_identical


@pytest.mark.multiprocess
@pytest.mark.ddp_run(None, model="gpt", steps=3)
def test_plain_ddp_training_keeps_ranks_identical(ddp_run):
    results = ddp_run
    assert_ranks_identical(results)
    assert results[0]["optimizer"]["state"], "optimizer never stepped"


def test_harness_detects_a_difference():
    a = {"w": torch.ones(3)}
    b = {"w": torch.tensor([1.0, 1.0, 1.0 + 1e-7])}
    try:
        _assert_equal(a, b, "params")
    except AssertionError as err:
        assert "params.w" in str(err)
    else:
        raise AssertionError("difference not detected")
