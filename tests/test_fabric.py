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


# ------------------------------------------------------------------ verified save / load
def fabric_plasticity(tmp_path, **kwargs):
    torch.manual_seed(0)
    fabric = L.Fabric(accelerator="cpu", devices=1, loggers=CSVLogger(tmp_path, name="fabric"))
    model, optimizer = fabric.setup(*(lambda m: (m, torch.optim.AdamW(m.parameters(), lr=1e-3)))(TinyGPT()))
    return FabricPlasticity(fabric, model, optimizer, *make_callbacks(), **kwargs)


def test_save_and_load_resume_the_schedule_through_a_verified_file(tmp_path):
    first, _, _ = fabric_loop(tmp_path / "first", steps=3)
    path = first.save(tmp_path / "plasticity.pt")
    assert path.with_name("plasticity.pt.sha256").is_file()
    resumed = fabric_plasticity(tmp_path / "resumed")
    resumed.load(path)
    resumed.fit_start()
    assert resumed.global_step == 3 and [h["global_step"] for h in resumed.callbacks[0].history] == [2]


def _flip(data: bytes) -> bytes:
    return data[: len(data) // 2] + bytes([data[len(data) // 2] ^ 0xFF]) + data[len(data) // 2 + 1:]


@pytest.mark.parametrize("case, words", [
    ("payload", "needs arbitrary code to load"),
    ("flipped byte", "does not match its recorded SHA-256"),
    ("truncated", "truncated or replaced"),
    ("foreign file", "holds no FabricPlasticity state"),
    ("missing", "no checkpoint at"),
])
def test_a_damaged_hostile_or_foreign_fabric_state_file_is_one_line_naming_it(tmp_path, case, words):
    import io

    from plasticity_callbacks.app.runs.verified_files import write_verified
    from plasticity_callbacks.errors import CheckpointError
    from fault_injection import Payload

    first, _, _ = fabric_loop(tmp_path / "first", steps=2)
    path, marker = first.save(tmp_path / "plasticity.pt"), tmp_path / "payload_ran"
    data = path.read_bytes()
    if case == "payload":
        buffer = io.BytesIO()
        torch.save({"fabric_plasticity": {**first.state_dict(), "payload": Payload(marker)}}, buffer)
        write_verified(buffer.getvalue(), path)  # a matching checksum: anyone who swaps the file can write one
    elif case == "flipped byte":
        path.write_bytes(_flip(data))
    elif case == "truncated":
        path.write_bytes(data[:-40])
    elif case == "foreign file":
        buffer = io.BytesIO()
        torch.save({"state_dict": {}}, buffer)
        write_verified(buffer.getvalue(), path)
    else:
        path.unlink()
    with pytest.raises(CheckpointError, match=words) as err:
        fabric_plasticity(tmp_path / "resumed").load(path)
    assert "\n" not in str(err.value) and str(path) in str(err.value), str(err.value)
    assert not marker.exists()


@pytest.mark.parametrize("state, words", [
    ({"callbacks": {}}, "is not a FabricPlasticity state"),
    ({"global_step": -1, "callbacks": {}}, "is not a FabricPlasticity state"),
    ({"global_step": 2, "callbacks": []}, "is not a FabricPlasticity state"),
    ("abc", "is not a FabricPlasticity state"),
    ({"global_step": 2, "callbacks": {"FIREReinit": 5}}, "not a mapping"),
    ({"global_step": 2, "callbacks": {}}, "holds no entry for"),
])
def test_load_state_dict_checks_the_states_shape_itself(tmp_path, state, words):
    from plasticity_callbacks.errors import CheckpointError

    with pytest.raises(CheckpointError, match=words) as err:
        fabric_plasticity(tmp_path).load_state_dict(state)
    assert "\n" not in str(err.value), str(err.value)


def test_a_schedule_beyond_the_loops_max_steps_is_warned_at_fit_start(tmp_path):
    plasticity = fabric_plasticity(tmp_path, max_steps=3)
    with pytest.warns(UserWarning, match=r"DASHPeriodic: Schedule\(steps=\(4,\)\) can never act in this fit"):
        plasticity.fit_start()
    with pytest.raises(ValueError, match="FabricPlasticity max_steps=0 must be"):
        fabric_plasticity(tmp_path, max_steps=0)
