"""The GPU path: the polar factor's CUDA default, FIRE on a model on the GPU, every method in one GPU run.

Skipped where no CUDA device is at hand (CI has none); ``benchmarks/gpu_checks.sh`` runs this file on a GPU
machine together with the GPU benchmarks. What these tests catch that the CPU suite cannot: a tensor or a
random generator made on the CPU and met by a CUDA one, Polar Express (the CUDA default, see
``choose_method``) on real CUDA kernels, and an optimizer's CUDA state reset in place.
"""
from __future__ import annotations

import math
import warnings

import lightning as L
import pytest
import torch
from hydra.utils import instantiate

from callback_table import acting_soon, configs, methods
from plasticity_callbacks.functional.spectral import orthogonalize
from plasticity_callbacks.models import GPT, GPTConfig
from plasticity_callbacks.ops.fire import apply_fire
from tiny import build

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = torch.device("cuda")
NEEDS_GATES = {"GateLogger"}  # reads the reciprocal blocks' gates, which the tiny models do not have


def exact_polar(W: torch.Tensor) -> torch.Tensor:
    """U·Vᵀ of a float64 SVD on the CPU: the reference."""
    U, _, Vh = torch.linalg.svd(W.detach().cpu().double(), full_matrices=False)
    return U @ Vh


@pytest.mark.parametrize("shape", [(96, 96), (384, 96), (96, 384), (4, 64, 48)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 1e-2)])
def test_cuda_default_polar_factor_matches_float64_svd(shape, dtype, tol):
    W = torch.randn(shape, device=CUDA).to(dtype)
    Q, info = orthogonalize(W, return_info=True)
    assert info.method == "polar_express" and Q.device.type == "cuda" and Q.dtype == dtype
    exact = exact_polar(W)
    assert float((Q.cpu().double() - exact).norm() / exact.norm()) < tol


def gpt_pair() -> tuple[GPT, GPT]:
    """The same GPT (output projections drawn, not zero, so FIRE treats them) on the CPU and on the GPU."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, sequence_len=32, n_layer=2, n_head=4, n_kv_head=4, n_embd=64))
    with torch.no_grad():
        for block in model.blocks:
            for proj in (block.attn.c_proj, block.mlp.c_proj):
                proj.weight.normal_(0.0, 1.0 / math.sqrt(proj.weight.shape[1]))
    gpu = GPT(model.config).to(CUDA)
    gpu.load_state_dict(model.state_dict())
    return model, gpu


def adam_after_one_step(model: GPT, device: torch.device) -> torch.optim.AdamW:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1)).to(device)
    torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
    optimizer.step()
    return optimizer


def test_fire_on_the_gpu_gives_the_cpu_weights_and_resets_exactly_their_cuda_state():
    cpu, gpu = gpt_pair()
    cpu_optimizer, gpu_optimizer = adam_after_one_step(cpu, torch.device("cpu")), adam_after_one_step(gpu, CUDA)
    before = {name: gpu_optimizer.state[p]["exp_avg"].clone() for name, p in gpu.named_parameters()}
    cpu_records, gpu_records = apply_fire(cpu, cpu_optimizer), apply_fire(gpu, gpu_optimizer)
    treated = {r.name for r in gpu_records if r.skipped is None}
    assert treated == {r.name for r in cpu_records if r.skipped is None} and len(treated) == 12
    cpu_params = dict(cpu.named_parameters())
    for name, p in gpu.named_parameters():
        assert p.device.type == "cuda"
        # one Adam step in float32 on two devices, then two solvers (SVD / Polar Express): equal to ~1e-4
        torch.testing.assert_close(p.detach().cpu(), cpu_params[name].detach(), rtol=1e-3, atol=2e-4)
        state = gpu_optimizer.state[p]
        if name in treated:
            spectrum = torch.linalg.svdvals(p.detach().cpu().double())  # a scaled isometry: one singular value
            assert float(spectrum.max() / spectrum.min()) - 1 < 1e-3, name
            assert not state or (state["exp_avg"].abs().max() == 0 and state["exp_avg_sq"].abs().max() == 0), name
        else:
            assert torch.equal(state["exp_avg"], before[name]), name  # untreated weights keep their moments


class WeightsAtTrainEnd(L.Callback):
    """Where each weight is, and whether it is finite, after every method acted (Lightning moves the module
    back to the CPU when fit ends)."""

    def on_train_end(self, trainer, pl_module):
        self.seen = {name: (p.device.type, bool(torch.isfinite(p).all())) for name, p in pl_module.named_parameters()}


def test_apply_fire_on_the_gpu_solves_one_batch_per_shape(monkeypatch):
    from plasticity_callbacks.functional import isometry

    calls = []
    solve = isometry.orthogonalize
    monkeypatch.setattr(isometry, "orthogonalize", lambda X, *a, **k: calls.append(tuple(X.shape)) or solve(X, *a, **k))
    _, gpu = gpt_pair()
    records = apply_fire(gpu, None)
    assert len([r for r in records if r.skipped is None]) == 12
    assert sorted(calls) == [(2, 64, 256), (2, 256, 64), (8, 64, 64)]  # c_proj of the MLPs; c_fc; q, k, v, proj


def run_every_method_on_the_gpu(model: str, optimizer: str) -> dict:
    L.seed_everything(0)
    module, loader = build(model, optimizer)
    probe = WeightsAtTrainEnd()
    callbacks = [instantiate(acting_soon(name)) for name in sorted(configs()) if name not in NEEDS_GATES]
    trainer = L.Trainer(accelerator="gpu", devices=1, max_steps=4, callbacks=[*callbacks, probe], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, log_every_n_steps=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, train_dataloaders=loader)
    assert probe.seen and all(seen == ("cuda", True) for seen in probe.seen.values()), probe.seen
    return trainer.callback_metrics


@pytest.mark.parametrize("model,optimizer", [("gpt", "muon"), ("cnn", "sgd"), ("mlp", "adamw")])
def test_every_method_acts_in_one_gpu_run(model, optimizer):
    """All methods in one run on the GPU, as the DDP test runs them on CPU ranks: each logs its summary."""
    metrics = run_every_method_on_the_gpu(model, optimizer)
    for name, cls in methods().items():
        assert any(m in metrics for m in cls.summary_metrics), f"{name} logged none of {cls.summary_metrics}"
    assert float(metrics["redo/recycled"]) > 0
