"""The callbacks in a Lightning Fabric loop (litgpt's shape: a hand-written GPT, ``fabric.setup``, a manual
loop), driven by :class:`~plasticity_callbacks.integrations.fabric.FabricPlasticity`, on CPU."""
from __future__ import annotations

import csv
import math

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.fabric.loggers import CSVLogger
from torch import nn

import plasticity_callbacks as pc
from plasticity_callbacks.integrations.fabric import FabricPlasticity

VOCAB, SEQ, WIDTH = 32, 8, 16


class CausalSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)  # litgpt's fused Q/K/V
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)  # 3 × (B, T, C)
        q, k, v = (t.view(B, T, 2, C // 2).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm_1, self.norm_2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn = CausalSelfAttention()
        self.fc, self.out = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x):
        x = x + self.attn(self.norm_1(x))
        return x + self.out(F.gelu(self.fc(self.norm_2(x))))


class TinyGPT(nn.Module):
    """litgpt's layout in miniature: embedding, blocks, final norm, head."""

    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.h = nn.ModuleList([Block(), Block()])
        self.ln_f = nn.LayerNorm(WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, idx):
        x = self.wte(idx)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def loss_of(model, batch):
    return F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())


def batches(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (4, SEQ + 1), generator=g) for _ in range(n)]


def make_callbacks():
    return [pc.FIREReinit(schedule=pc.Schedule(steps=[2])),
            pc.ReDoMonitor(tau=1.0, collect_every_n_steps=1, log_every_n_steps=1, schedule=pc.Schedule(steps=[3])),
            pc.DASHPeriodic(schedule=pc.Schedule(steps=[4]), cosine_threshold=-1.0, shrink_rate=0.2),
            pc.ShrinkPerturb(shrink=0.5, perturb=0.1, schedule=pc.Schedule(steps=[5]))]


def fabric_loop(tmp_path, steps, state=None, on_step=None):
    torch.manual_seed(0)
    fabric = L.Fabric(accelerator="cpu", devices=1, loggers=CSVLogger(tmp_path, name="fabric"))
    model = TinyGPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = fabric.setup(model, optimizer)
    plasticity = FabricPlasticity(fabric, model, optimizer, *make_callbacks())
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        plasticity.load_state_dict(state["plasticity"])
    plasticity.fit_start()
    for batch_idx, batch in enumerate(batches(steps)[plasticity.global_step:]):
        plasticity.batch_start(batch_idx)
        if on_step is not None:
            on_step(plasticity.global_step, model)
        fabric.backward(loss_of(model, batch))
        plasticity.before_optimizer_step()
        optimizer.step()
        optimizer.zero_grad()
        plasticity.batch_end(batch_idx)
    plasticity.fit_end()
    fabric.logger.finalize("success")
    saved = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "plasticity": plasticity.state_dict()}
    return plasticity, model, saved


def test_fire_redo_dash_and_shrink_perturb_act_in_a_fabric_loop_and_log_to_fabrics_logger(tmp_path):
    checked = []

    def after_hooks(step, model):
        if step == 2:  # FIRE acted in batch_start: each true block is an isometry at √(d_out/d_in)
            for block in model.h:
                attn = block.attn
                matrices = [attn.proj.weight, *attn.qkv.weight.split(WIDTH), block.fc.weight, block.out.weight]
                for weight in matrices:  # Q, K, V of the fused matrix: one isometry each
                    s = torch.linalg.svdvals(weight.detach().double())
                    scale = math.sqrt(weight.shape[0] / weight.shape[1])
                    assert torch.allclose(s, torch.full_like(s, scale), rtol=1e-3), (weight.shape, s)
            checked.append(step)

    plasticity, _, _ = fabric_loop(tmp_path, steps=6, on_step=after_hooks)
    assert checked == [2]
    fire, redo, dash, sp = plasticity.callbacks
    assert [h["global_step"] for h in fire.history] == [2]
    assert float(plasticity.view.callback_metrics["redo/recycled"]) > 0
    assert dash.shrinks == 1 and sp.applications == 1
    rows = list(csv.DictReader(open(next(tmp_path.rglob("metrics.csv")))))
    logged = {(int(r["step"]), k) for r in rows for k, v in r.items() if v not in ("", None) and k != "step"}
    assert {(2, "fire/dfi_after"), (3, "redo/recycled"), (4, "dash_periodic/shrunk"),
            (5, "shrink_perturb/norm_ratio")} <= logged


def test_a_resumed_fabric_loop_continues_the_schedule_without_acting_twice(tmp_path):
    reference, ref_model, _ = fabric_loop(tmp_path / "reference", steps=6)
    _, _, saved = fabric_loop(tmp_path / "first", steps=3)  # stops after step 3: FIRE and ReDo done
    resumed, model, _ = fabric_loop(tmp_path / "resumed", steps=6, state=saved)
    fire, _, dash, sp = resumed.callbacks
    assert [h["global_step"] for h in fire.history] == [2]  # restored, not repeated
    assert resumed.global_step == 6 and dash.shrinks == 1 and sp.applications == 1
    for (name, p), q in zip(ref_model.named_parameters(), model.parameters()):
        assert torch.equal(p, q), name


def test_a_sharded_fabric_strategy_is_refused_with_the_fix():
    class FSDPStrategy:  # stands for lightning.fabric's FSDP strategy (only its name is read)
        pass

    fabric = L.Fabric(accelerator="cpu", devices=1)
    model = TinyGPT()
    plasticity = FabricPlasticity(fabric, model, torch.optim.SGD(model.parameters(), lr=0.1), pc.FIREReinit())
    plasticity.view.strategy.__class__.__name__ = FSDPStrategy.__name__
    with pytest.raises(Exception, match="FIREReinit cannot act under strategy FSDPStrategy.*ModelParallelStrategy"):
        plasticity.fit_start()
