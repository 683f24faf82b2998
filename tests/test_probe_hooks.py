"""The model map reads a model by running its forward on one token (the trace, the Q/K/V probe, the gate pairing
probe). Those forwards are its own: the model's hooks, and global module hooks, never see them, and are all back,
in order, afterwards, also when the block in between raises."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as torch_module

from plasticity_callbacks import FIREReinit, ReDoMonitor
from plasticity_callbacks.model_map import find_neuron_layers, select_targets
from tiny import cpu_trainer, tiny_gpt_module, token_loader

HOOK_TABLES = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks",
               "_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_forward_hooks_always_called")
GLOBAL_TABLES = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_forward_hooks_always_called")


class Attention(nn.Module):
    """Fused ``[q | k | v]`` rows with one key/value head: only the probe of the forward can split them."""

    def __init__(self):
        super().__init__()
        self.qkv, self.proj = nn.Linear(16, 24, bias=False), nn.Linear(16, 16)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).split([16, 4, 4], dim=-1)
        q = q.view(B, T, 4, 4).transpose(1, 2)  # (B, nh, T, hd)
        k, v = (t.view(B, T, 1, 4).transpose(1, 2).expand(B, 4, T, 4) for t in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, 16))


class GatedMLP(nn.Module):
    """``[gate | up]`` in one layer: the pairing probe reads which two rows make a unit."""

    def __init__(self):
        super().__init__()
        self.fc, self.out = nn.Linear(16, 64), nn.Linear(32, 16)

    def forward(self, x):
        gate, up = self.fc(x).chunk(2, dim=-1)
        return self.out(F.silu(gate) * up)


class TokenModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.attn, self.mlp, self.head = nn.Embedding(10, 16), Attention(), GatedMLP(), nn.Linear(16, 10)

    def forward(self, idx):
        x = self.wte(idx)
        x = x + self.attn(x)
        return self.head(x + self.mlp(x))


def hook_tables(model: nn.Module) -> list:
    """Every hook table's entries, in order: the model's modules' and the global ones."""
    tables = [list(getattr(m, name).items()) for m in model.modules() for name in HOOK_TABLES]
    return tables + [list(getattr(torch_module, name).items()) for name in GLOBAL_TABLES]


@pytest.fixture
def counted():
    """A model with hooks of every kind on it and a global forward pre-hook, each counting its calls."""
    torch.manual_seed(0)
    model, calls = TokenModel(), {}

    def count(key):
        def hook(*args):
            calls[key] = calls.get(key, 0) + 1
        return hook

    handles = [model.attn.qkv.register_forward_pre_hook(count("qkv pre")),
               model.attn.register_forward_hook(count("attn kwargs"), with_kwargs=True, always_call=True),
               model.mlp.fc.register_forward_hook(count("fc")),
               model.mlp.out.register_forward_pre_hook(count("out pre"), prepend=True),
               model.mlp.out.register_full_backward_hook(count("out backward")),
               model.head.register_forward_hook(count("head"))]
    ours, global_hook = {id(m) for m in model.modules()}, count("global")
    handles.append(torch_module.register_module_forward_pre_hook(
        lambda module, args: global_hook() if id(module) in ours else None))
    yield model, calls
    for handle in handles:
        handle.remove()


def test_the_probes_run_unseen_and_the_hooks_are_back_in_order(counted):
    model, calls = counted
    before = hook_tables(model)
    [qkv] = [t for t in select_targets(model) if t.name == "attn.qkv.weight"]
    [gated] = find_neuron_layers(model)
    assert [(b.label, len(b)) for b in qkv.blocks] == [("q", 16), ("k", 4), ("v", 4)]  # the probes did run
    assert gated.fused_gate and not gated.interleaved
    assert calls == {}
    assert hook_tables(model) == before

    F.cross_entropy(model(torch.randint(0, 10, (2, 5))).flatten(0, 1), torch.randint(0, 10, (10,))).backward()
    assert calls == {"qkv pre": 1, "attn kwargs": 1, "fc": 1, "out pre": 1, "out backward": 1, "head": 1,
                     "global": len(list(model.modules()))}  # each module ran once


def test_a_hook_counts_exactly_the_training_batches():
    """FIRE and ReDo read the GPT's map at setup (its probes run then); a user's hooks see the 3 training steps."""
    torch.manual_seed(0)
    module, calls = tiny_gpt_module(), []
    block = module.model.blocks[0]
    handles = [block.mlp.c_fc.register_forward_hook(lambda m, args, out: calls.append("c_fc")),
               block.register_forward_pre_hook(lambda m, args: calls.append("block"))]
    cpu_trainer(max_steps=3, callbacks=[FIREReinit(), ReDoMonitor(collect_every_n_steps=1)]).fit(module,
                                                                                                 token_loader())
    for handle in handles:
        handle.remove()
    assert calls == ["block", "c_fc"] * 3


def test_an_exception_in_the_block_puts_every_hook_back_and_torchs_own_stay():
    from plasticity_callbacks.model_map.detached_hooks import hooks_detached

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    first = model[0].register_forward_pre_hook(lambda m, args: None)
    torch.nn.utils.prune.l1_unstructured(model[0], "weight", amount=0.5)  # torch's pre-hook: weight = orig * mask
    model[0].register_forward_pre_hook(lambda m, args: None)
    global_handle = torch_module.register_module_forward_hook(lambda m, args, out: None)
    try:
        before = hook_tables(model)
        with pytest.raises(RuntimeError, match="probe failed"), hooks_detached(model):
            [kept] = model[0]._forward_pre_hooks.values()
            assert isinstance(kept, torch.nn.utils.prune.BasePruningMethod)
            assert not torch_module._global_forward_hooks
            stays = model[2].register_forward_hook(lambda m, args, out: None)  # registered inside: left as is
            model[2].register_forward_hook(lambda m, args, out: None).remove()
            raise RuntimeError("probe failed")
        assert list(model[2]._forward_hooks) == [stays.id]
        stays.remove()
        assert hook_tables(model) == before  # the user's pre-hooks back around the pruning one, the global one too
        first.remove()
    finally:
        global_handle.remove()
