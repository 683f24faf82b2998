"""FIRE batched by shape (the GPU path of ``apply_fire``), checked on CPU against one weight at a time
(``fire_matrix``) and against an independent float64 SVD, on mixed shapes, dtypes, convs and degenerate weights."""
from __future__ import annotations

import math
import warnings

import pytest
import torch

from plasticity_callbacks.functional.isometry import (
    FireItem,
    FIREOptions,
    as_matrices,
    fire_matrices,
    fire_matrix,
    target_scale,
)
from plasticity_callbacks.functional.spectral import DegenerateMatrixError
from plasticity_callbacks.models import GPT, GPTConfig
from plasticity_callbacks.ops import fire as fire_ops


def mixed_items(seed: int) -> list[FireItem]:
    """Equal shapes (one batch), odd ones out, a conv, a grouped conv, float64 and bfloat16 weights."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(48, 48), (48, 48), (48, 48), (80, 24), (80, 24), (24, 80), (8, 4, 3, 3)]
    items = [FireItem(f"w{i}", torch.randn(shape, generator=g) * (0.1 + i)) for i, shape in enumerate(shapes)]
    items.append(FireItem("grouped", torch.randn(8, 2, 3, 3, generator=g), groups=2))
    items.append(FireItem("double", torch.randn(48, 48, generator=g, dtype=torch.float64)))
    items.append(FireItem("half", torch.randn(48, 48, generator=g).bfloat16()))
    return items


def one_at_a_time(items: list[FireItem], options: FIREOptions, record_spectra=False):
    copies = [FireItem(it.name, it.param.clone(), it.groups) for it in items]
    return copies, [fire_matrix(it.name, it.param, options, record_spectra, it.groups) for it in copies]


def batched(items: list[FireItem], options: FIREOptions, **kwargs):
    copies = [FireItem(it.name, it.param.clone(), it.groups) for it in items]
    return copies, fire_matrices(copies, options, **kwargs)


def exact_fire(item: FireItem, scale_rule) -> torch.Tensor:
    """``s·U Vᵀ`` per group and tap from a float64 SVD: the independent reference."""
    M = as_matrices(item.param.double(), item.groups)
    U, _, Vh = torch.linalg.svd(M, full_matrices=False)
    return target_scale(item.param, scale_rule, item.groups) * (U @ Vh)


@pytest.mark.parametrize("options,tol", [
    (FIREOptions(), 1e-5),                                       # auto: svd / eigh on CPU
    (FIREOptions(method="svd", scale="preserve_norm"), 1e-5),    # a scale per weight: groups split by scale
    (FIREOptions(method="polar_express"), 2e-4),                 # the GPU default, to its tol
])
def test_batched_fire_equals_one_weight_at_a_time_and_the_float64_svd(options, tol):
    items = mixed_items(seed=int(torch.randint(0, 10_000, ())))
    singles, single_records = one_at_a_time(items, options)
    many, records = batched(items, options)
    for item, single, one, record, rec in zip(items, singles, many, single_records, records):
        precision = 1e-2 if item.param.dtype == torch.bfloat16 else tol
        reference = exact_fire(item, options.scale)
        assert float((as_matrices(one.param.double(), item.groups) - reference).norm() / reference.norm()) < precision
        torch.testing.assert_close(one.param.double(), single.param.double(), rtol=0, atol=2 * precision * float(
            reference.abs().max()))
        assert rec.name == record.name and rec.shape == record.shape and rec.skipped is None
        assert rec.scale == pytest.approx(record.scale, rel=1e-12)
        for field in ("dfi_before", "sfe", "sfe_normalized"):
            assert getattr(rec, field) == pytest.approx(getattr(record, field), rel=1e-4, abs=1e-9), field
        assert rec.dfi_after < 1e-6 * max(1.0, rec.scale ** 4) * math.prod(item.param.shape)
        assert rec.fell_back == record.fell_back == 0


def test_newton_schulz_fixed_steps_batched_equal_each_alone():
    """The authors' recipe (10 steps, Frobenius normalization): a fixed count, the same arithmetic per slice."""
    options = FIREOptions(method="newton_schulz", normalize="frobenius", steps=10)
    items = mixed_items(seed=3)[:6]
    (singles, single_records), (many, records) = one_at_a_time(items, options), batched(items, options)
    for single, one, record, rec in zip(singles, many, single_records, records):
        torch.testing.assert_close(one.param, single.param, rtol=1e-5, atol=1e-6)
        assert rec.dfi_after == pytest.approx(record.dfi_after, rel=1e-3)
        assert rec.iterations == record.iterations == 10


def test_chunks_under_a_byte_limit_give_the_same_weights_and_spectra():
    items = mixed_items(seed=5)
    options = FIREOptions(method="svd")
    (whole, whole_records), (chunked, chunked_records) = (batched(items, options, record_spectra=True),
                                                          batched(items, options, record_spectra=True,
                                                                  max_batch_bytes=48 * 48 * 4))
    _, single_records = one_at_a_time(items, options, record_spectra=True)
    for a, b, ra, rb, rs in zip(whole, chunked, whole_records, chunked_records, single_records):
        torch.testing.assert_close(a.param, b.param, rtol=1e-6, atol=1e-7)
        assert ra.spectrum_before.shape == rb.spectrum_before.shape == rs.spectrum_before.shape
        assert ra.spectrum_after.shape == rs.spectrum_after.shape
        torch.testing.assert_close(ra.spectrum_before, rs.spectrum_before, rtol=1e-4, atol=1e-6)


def test_degenerate_weights_are_skipped_as_one_at_a_time_or_refused_before_any_change():
    items = mixed_items(seed=7)[:4]
    items.insert(1, FireItem("zero", torch.zeros(48, 48)))
    items.insert(3, FireItem("nan", torch.full((48, 48), float("nan"))))
    items.append(FireItem("bias", torch.randn(48)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        many, records = batched(items, FIREOptions(method="svd"))
    assert [r.skipped for r in records] == [None, "zero", None, "non-finite", None, None, "1-D parameter"]
    assert {str(w.message) for w in caught} >= {"FIRE: zero is all zero (no polar factor); left unchanged"}
    assert torch.equal(many[1].param, items[1].param) and torch.equal(many[-1].param, items[-1].param)
    kept = [FireItem(it.name, it.param.clone()) for it in items]
    with pytest.raises(DegenerateMatrixError, match="zero is all zero"):
        fire_matrices(kept, FIREOptions(method="svd", on_degenerate="raise"))
    for before, after in zip(items, kept):  # every weight was checked before any was written
        assert torch.equal(before.param, after.param) or before.param.isnan().all()


def test_apply_fire_gpu_path_gives_the_cpu_path_on_a_gpt_with_fused_blocks():
    """``_fire_batched`` (what ``apply_fire`` runs on a GPU) on every target of a GPT against the per-target path."""
    torch.manual_seed(int(torch.randint(0, 10_000, ())))
    model = GPT(GPTConfig(vocab_size=64, sequence_len=16, n_layer=2, n_head=2, n_kv_head=1, n_embd=32))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    twin = GPT(model.config)
    twin.load_state_dict(model.state_dict())
    options = FIREOptions(method="svd")
    records = fire_ops.apply_fire(model, None, options)
    targets = fire_ops.require_targets(fire_ops.select_targets(twin, fire_ops.Selection()), "test", None)
    by_target = fire_ops._fire_batched(targets, options, False)
    batched_records = [r for t in targets for r in by_target[id(t)]]
    assert [r.name for r in batched_records] == [r.name for r in records] and len(records) >= 12
    for r, b in zip(records, batched_records):
        assert b.dfi_before == pytest.approx(r.dfi_before, rel=1e-4) and b.sfe == pytest.approx(r.sfe, rel=1e-4)
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=name)
