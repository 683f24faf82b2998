"""Model family × callback: each callback's effect on tiny Hugging Face, torch and hand-written models.

Expectations are computed here from the raw parameters and a hand-written list of what each family
holds (orientation, fused blocks, head), not from the model map the callbacks use. SGD with lr=0
keeps training from moving the weights, so every change seen is the callback's.
"""
from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from torch import nn

from model_zoo import FAMILIES, Wrapped, batches, loss_of
from plasticity_callbacks.callbacks.adaptive_svd import AdaptiveSVDSwitch
from plasticity_callbacks.callbacks.dash import DASHShrink
from plasticity_callbacks.callbacks.fire import FIREReinit
from plasticity_callbacks.callbacks.redo import ReDoMonitor
from plasticity_callbacks.callbacks.shrink_perturb import ShrinkPerturb
from plasticity_callbacks.core.distributed import rank_identical_generator
from plasticity_callbacks.core.model_map import fresh_parameters
from plasticity_callbacks.core.schedule import Schedule
from plasticity_callbacks.functional.isometry import FIREOptions

pytest.importorskip("transformers")

HEADS = {"gpt2": "model.lm_head", "llama": "model.lm_head", "mistral": "model.lm_head",
         "bert": "model.cls.predictions.decoder",
         "torch_encoder": "model.head", "resnet": "model.head", "mlp": "model.4"}
# Expected neuron layers: (up, gate, down, down inputs per unit, BatchNorm) by module name.
NEURONS = {
    "gpt2": [(f"model.transformer.h.{i}.mlp.c_fc", None, f"model.transformer.h.{i}.mlp.c_proj", 1, None)
             for i in range(2)],
    "llama": [(f"model.model.layers.{i}.mlp.up_proj", f"model.model.layers.{i}.mlp.gate_proj",
               f"model.model.layers.{i}.mlp.down_proj", 1, None) for i in range(2)],
    "mistral": [("model.model.layers.0.mlp.up_proj", "model.model.layers.0.mlp.gate_proj",
                 "model.model.layers.0.mlp.down_proj", 1, None)],
    "bert": [(f"model.bert.encoder.layer.{i}.intermediate.dense", None, f"model.bert.encoder.layer.{i}.output.dense",
              1, None) for i in range(2)],
    "torch_encoder": [(f"model.encoder.layers.{i}.linear1", None, f"model.encoder.layers.{i}.linear2", 1, None)
                      for i in range(2)],
    "resnet": [("model.block.conv1", None, "model.block.conv2", 1, "model.block.bn1"),
               ("model.reduce", None, "model.fc", 36, None), ("model.fc", None, "model.head", 1, None)],
    "mlp": [("model.0", None, "model.2", 1, None), ("model.2", None, "model.4", 1, None)],
}


def treated(family: str, module: nn.Module):
    """``(name, param, transposed, row blocks)`` of every weight a callback should treat, by hand."""
    out = []
    for name, m in module.named_modules():
        if name == HEADS[family] or isinstance(m, nn.Embedding):
            continue
        if type(m).__name__ == "Conv1D":  # HF GPT-2: stored (in, out)
            rows = m.weight.shape[1]
            blocks = [rows // 3] * 3 if name.endswith("c_attn") else [rows]
            out.append((f"{name}.weight", m.weight, True, blocks))
        elif isinstance(m, (nn.Linear, nn.Conv2d)):
            out.append((f"{name}.weight", m.weight, False, [m.weight.shape[0]]))
        elif isinstance(m, nn.MultiheadAttention):
            out.append((f"{name}.in_proj_weight", m.in_proj_weight, False, [m.embed_dim] * 3))
    return out


def oriented(param: torch.Tensor, transposed: bool) -> torch.Tensor:
    return param.detach().mT if transposed else param.detach()


def fit(module, callbacks, steps=1, **kwargs):
    trainer = L.Trainer(max_steps=steps, callbacks=callbacks, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                        num_sanity_val_steps=0, **kwargs)
    trainer.fit(module)
    return trainer


@pytest.mark.parametrize("family", FAMILIES)
def test_fire_makes_every_block_a_scaled_isometry(family):
    module = Wrapped(family)
    fire = FIREReinit(schedule=Schedule(at_fit_start=True), options=FIREOptions(method="svd"))
    fit(module, [fire])
    expected = treated(family, module)
    assert len([r for r in fire.last_records if r.skipped is None]) == sum(len(b) for *_, b in expected)
    for name, param, transposed, blocks in expected:
        W, start = oriented(param, transposed).double(), 0
        for rows in blocks:
            block = W[start:start + rows]
            start += rows
            taps = block.shape[2:].numel() if block.dim() > 2 else 1
            scale = math.sqrt(block.shape[0] / block.shape[1]) / taps
            per_tap = block.permute(*range(2, block.dim()), 0, 1) if block.dim() > 2 else block
            s = torch.linalg.svdvals(per_tap)
            torch.testing.assert_close(s, torch.full_like(s, scale), rtol=1e-4, atol=1e-6, msg=f"{name}: {s}")


@pytest.mark.parametrize("family", FAMILIES)
def test_shrink_perturb_draws_fresh_values_everywhere(family):
    module = Wrapped(family)
    with torch.no_grad():  # a trained-looking model: no parameter sits at its init value
        for p in module.parameters():
            p.add_(0.05 * torch.randn_like(p))
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    fit(module, [ShrinkPerturb(shrink=0.5, perturb=0.3, seed=3)])
    fresh = fresh_parameters(module, rank_identical_generator(3, 0).initial_seed())
    for name, p in module.named_parameters():
        assert not torch.equal(fresh[name], before[name]), f"{name}: the fresh draw is the current value"
        torch.testing.assert_close(p.detach(), 0.5 * before[name] + 0.3 * fresh[name])
        if p.dim() >= 2:  # not a mere rescale (λ+p)·θ
            assert not torch.allclose(p.detach(), 0.8 * before[name], atol=1e-6), name


class Snapshot(L.Callback):
    def on_train_start(self, trainer, pl_module):
        self.before = {n: p.detach().clone() for n, p in pl_module.named_parameters()}


@pytest.mark.parametrize("family", FAMILIES)
def test_redo_finds_every_mlp_and_recycles_by_layout(family):
    module = Wrapped(family)
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.fill_(0.5)
    redo = ReDoMonitor(tau=1.0, collect_every_n_steps=1, log_every_n_steps=1, schedule=Schedule(steps=[1]))
    snap = Snapshot()
    fit(module, [snap, redo], steps=2)
    modules = dict(module.named_modules())
    names = {id(m): n for n, m in modules.items()}
    assert sorted(names[id(layer.up)] for layer in redo.layers) == sorted(up for up, *_ in NEURONS[family])
    for up_name, gate_name, down_name, group, norm_name in NEURONS[family]:
        up, down = modules[up_name], modules[down_name]
        t_up, t_down = type(up).__name__ == "Conv1D", type(down).__name__ == "Conv1D"
        W_up, W_up0 = oriented(up.weight, t_up), oriented(snap.before[f"{up_name}.weight"], t_up)
        # Re-sampled rows hold new non-zero values (zeroing, by the layout before, only writes zeros).
        changed = ((W_up != W_up0) & (W_up != 0)).flatten(1).any(1)
        assert changed.any(), f"{up_name}: nothing recycled at tau=1"
        if gate_name:  # the gate's rows are the same units
            gate = modules[gate_name]
            assert torch.equal((gate.weight != snap.before[f"{gate_name}.weight"]).flatten(1).any(1), changed)
        assert torch.equal(W_up[~changed], W_up0[~changed]) or any(d == up_name for *_, d, _, _ in NEURONS[family])
        columns = changed.repeat_interleave(group)
        W_down, W_down0 = oriented(down.weight, t_down), oriented(snap.before[f"{down_name}.weight"], t_down)
        # A down layer that is also the next layout's up has some rows re-sampled whole: leave those out.
        resampled = ((W_down != W_down0) & (W_down != 0)).flatten(1).any(1)
        if not any(up == down_name for up, *_ in NEURONS[family]):
            assert not resampled.any()
        kept = W_down[~resampled]
        assert kept[:, columns].abs().sum() == 0, f"{down_name}: outgoing weights of recycled units not zero"
        assert W_down0[~resampled][:, columns].abs().sum() > 0  # they were not zero before
        if norm_name:
            norm = modules[norm_name]
            assert torch.all(norm.weight[changed] == 1) and torch.all(norm.weight[~changed] == 0.5)


@pytest.mark.parametrize("family", FAMILIES)
def test_dash_one_factor_per_output_neuron(family):
    module = Wrapped(family)
    first = next(iter(torch.utils.data.DataLoader(batches(family), batch_size=4)))
    module.train()
    module.zero_grad()
    loss_of(family, module.model, first).backward()
    grads = {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}
    module.zero_grad()
    snap = Snapshot()
    fit(module, [snap, DASHShrink(n_batches=1, gradient_ema_weight=1.0, min_factor=0.3, shrink_bias=False,
                                  gradient_mode="train")])  # the gradients above are taken in train mode
    for name, param, transposed, _ in treated(family, module):
        W0 = oriented(snap.before[name], transposed).double()
        G = -oriented(grads[name], transposed).double()
        flat_w, flat_g = (W0.flatten(2), G.flatten(2)) if W0.dim() > 2 else (W0, G)
        factor = torch.nn.functional.cosine_similarity(flat_g, flat_w, dim=-1).clamp(0.3, 1.0)
        expected = W0 * factor.reshape(factor.shape + (1,) * (W0.dim() - factor.dim()))
        torch.testing.assert_close(oriented(param, transposed).double(), expected, rtol=1e-4, atol=1e-6,
                                   msg=f"{name}")
        assert factor.shape[0] == W0.shape[0]  # one factor per output neuron (conv: per (out, in) slice)


class GradientProbe(L.Callback):
    def __init__(self, switch):
        self.switch, self.checked = switch, 0

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        for m in self.switch.matrices:
            if m.state != "minor":
                continue
            t = m.target
            W = oriented(t.param, t.transposed).double().reshape(t.shape[0], -1)
            G = oriented(t.param.grad, t.transposed).double().reshape(t.shape[0], -1)
            U = torch.linalg.svd(W, full_matrices=False)[0]
            U_minor = U[:, U.shape[1] - m.r:]
            residual = G - U_minor @ (U_minor.mT @ G)
            assert residual.norm() <= 1e-4 * G.norm() + 1e-12, t.name
            self.checked += 1


@pytest.mark.parametrize("family", FAMILIES)
def test_adaptive_svd_projects_onto_the_minor_subspace(family):
    module = Wrapped(family)
    switch = AdaptiveSVDSwitch(minor_training="project", schedule=Schedule(steps=[0], every_n_steps=1),
                               clobber_alignment=0.0, r_min=2,
                               initial_rank=3, svd_dtype="float64", save_figure=False, log_per_matrix=False)
    probe = GradientProbe(switch)
    fit(module, [switch, probe])
    assert probe.checked == len(treated(family, module))
