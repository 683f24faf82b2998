"""ReDo and ContinualBackprop on hidden units beyond ``Linear -> act -> Linear``: experts stored as 3-D stacks
(transformers 5.x, two layouts), GPT-J's ``fc_in``/``fc_out``, ModernBERT's split ``Wi``, an interleaved fused
MLP, litgpt's MLP and transposed convs; state-space mixers are named as not unit layers.

Every check reads the raw parameters and the family's own forward: a unit killed by hand (its incoming rows
zeroed) must come back recycled in its expert only, the rest bit-identical, the model's output unchanged by the
recycling (outgoing weights zeroed) and the unit alive again in the family's forward.
"""
from __future__ import annotations

import re

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from scipy import stats
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from plasticity_callbacks import ContinualBackprop, ReDoMonitor
from plasticity_callbacks.callbacks.schedule import Schedule
from plasticity_callbacks.model_map import find_neuron_layers
from tiny import cpu_trainer

VOCAB, HIDDEN, INTER, EXPERTS = 32, 32, 24, 4


def _quiet(build):
    import transformers

    transformers.logging.set_verbosity_error()
    return build()


def mixtral():
    """Experts stored ``(out, in)``: ``gate_up_proj (E, 2I, H)`` split in halves, ``down_proj (E, H, I)``."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=EXPERTS,
                           num_experts_per_tok=2, max_position_embeddings=16, pad_token_id=0, bos_token_id=0,
                           eos_token_id=0)
    return _quiet(lambda: MixtralForCausalLM(config))


def gpt_oss():
    """Experts stored ``(in, out)`` with biases: ``gate_up_proj (E, H, 2I)`` interleaved, ``down_proj (E, I, H)``."""
    from transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=1,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=EXPERTS,
                          num_experts_per_tok=2, max_position_embeddings=16, pad_token_id=0, bos_token_id=0,
                          eos_token_id=0, layer_types=["full_attention"])
    return _quiet(lambda: GptOssForCausalLM(config))


# How each family's own forward reads unit i of expert e (from its modeling code, not from the model map):
# its incoming entries (rows of gate_up_proj[e] in the stored layout, and bias entries) and its down entries.
def mixtral_unit(experts, e, i):
    return [(experts.gate_up_proj, (e, i)), (experts.gate_up_proj, (e, INTER + i))], \
        [(experts.down_proj, (e, slice(None), i))]


def gpt_oss_unit(experts, e, i):
    return [(experts.gate_up_proj, (e, slice(None), 2 * i)), (experts.gate_up_proj, (e, slice(None), 2 * i + 1)),
            (experts.gate_up_proj_bias, (e, 2 * i)), (experts.gate_up_proj_bias, (e, 2 * i + 1))], \
        [(experts.down_proj, (e, i))]


FAMILIES = {"mixtral": (mixtral, mixtral_unit), "gpt_oss": (gpt_oss, gpt_oss_unit)}


class CausalLM(L.LightningModule):
    """A Hugging Face language model trained on its own loss by Adam at lr 0: every change of a weight is the callback's, and the
    optimizer still keeps moments for the reset to act on."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.0)


def tokens(n=8, length=12, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return DataLoader(TensorDataset(torch.randint(1, VOCAB, (n, length), generator=generator)), batch_size=n)


class Snapshot(L.Callback):
    """Parameters and Adam moments at the end of the last step, before the callbacks after it act; with
    ``fill_moments``, every first moment is set to 1 first, so a reset shows as 0 (a dead unit's own moments are
    0 already: its rows and columns get no gradient)."""

    def __init__(self, fill_moments: bool = False):
        self.fill_moments = fill_moments

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        state = trainer.optimizers[0].state
        if self.fill_moments:
            for p in pl_module.parameters():
                if p in state:
                    state[p]["exp_avg"].fill_(1.0)
        self.params = {n: p.detach().clone() for n, p in pl_module.named_parameters()}
        self.moments = {n: state[p]["exp_avg"].clone() for n, p in pl_module.named_parameters() if p in state}


def logits(model, seed=1):
    ids = torch.randint(1, VOCAB, (4, 12), generator=torch.Generator().manual_seed(seed))
    model.eval()
    with torch.no_grad():
        out = model(input_ids=ids).logits
    model.train()
    return out


def _get(entries):
    return [tensor.detach()[index] for tensor, index in entries]


def _kill(entries):
    with torch.no_grad():
        for tensor, index in entries:
            tensor[index] = 0


def _nudge(entries, by):
    with torch.no_grad():
        for tensor, index in entries:
            tensor[index] += by


@pytest.mark.parametrize("family", FAMILIES)
def test_redo_finds_a_dead_unit_of_one_expert_and_recycles_it_there_only(family):
    build, unit_of = FAMILIES[family]
    torch.manual_seed(0)
    module = CausalLM(build())
    experts = module.model.model.layers[0].mlp.experts
    killed = [(1, 3), (1, 17), (2, 5)]  # (expert, unit)
    for e, i in killed:
        _kill(unit_of(experts, e, i)[0])
    # the family's own forward: a killed unit's down entries no longer reach the output
    reference = logits(module.model)
    for e, i in killed:
        _nudge(unit_of(experts, e, i)[1], 1.0)
    torch.testing.assert_close(logits(module.model), reference, rtol=0, atol=0)
    for e, i in killed:
        _nudge(unit_of(experts, e, i)[1], -1.0)

    snapshot = Snapshot(fill_moments=True)
    redo = ReDoMonitor(tau=0.0, collect_every_n_steps=1, schedule=Schedule(every_n_steps=3), init="model")
    cpu_trainer(max_steps=3, callbacks=[snapshot, redo]).fit(module, tokens())
    assert [layer.name for layer in redo.layers] == [f"model.model.layers.0.mlp.experts.{e}" for e in range(EXPERTS)]

    prefix = "model.model.layers.0.mlp.experts."
    stacks = {n: p for n, p in experts.named_parameters()}
    recycled = {n: torch.zeros_like(p, dtype=torch.bool) for n, p in stacks.items()}
    for e, i in killed:
        for tensor, index in sum(unit_of(experts, e, i), []):
            recycled[next(n for n, p in stacks.items() if p is tensor)][index] = True
    for name, param in stacks.items():
        before = snapshot.params[prefix + name]
        # the weights of exactly the killed units changed (fresh rows, zeroed columns), the rest bit-identical;
        # their biases were 0 and are 0
        changed = recycled[name] if not name.endswith("_bias") else torch.zeros_like(recycled[name])
        assert torch.equal(before != param.detach(), changed), name
        # Adam's first moments (all 1 before the recycling): 0 on exactly the recycled slices
        moment = module.trainer.optimizers[0].state[param]["exp_avg"]
        assert torch.equal(moment == 0, recycled[name]), name
    fresh = []
    for e, i in killed:
        incoming, outgoing = unit_of(experts, e, i)
        rows = [w for (t, _), w in zip(incoming, _get(incoming)) if t is experts.gate_up_proj]
        assert all(bool((w != 0).all()) for w in rows) and not torch.equal(rows[0], rows[1])  # independent draws
        assert all(bool((w == 0).all()) for w in _get(outgoing))
        fresh += [w.flatten() for w in rows]
    # the fresh draws are distributed like the model's own init, N(0, initializer_range)
    std = module.model.config.initializer_range
    assert stats.kstest(torch.cat(fresh).double().numpy(), "norm", args=(0.0, std)).pvalue > 1e-3
    # the family's forward: recycling left the output as it was, and the units are alive again
    torch.testing.assert_close(logits(module.model), reference, rtol=1e-5, atol=1e-6)
    for e, i in killed:
        _nudge(unit_of(experts, e, i)[1], 1.0)
    assert not torch.allclose(logits(module.model), reference)


def test_redo_measures_each_expert_on_the_tokens_routed_to_it_only():
    """The EMA of an expert's units equals mean |h| over the tokens the family's router sent to that expert,
    recomputed here with the eager expert loop (``experts_implementation='eager'``) and a hook on ``F.linear``."""
    torch.manual_seed(0)
    model = mixtral()
    module = CausalLM(model)
    experts = model.model.layers[0].mlp.experts
    recorded = {}

    def record(mod, args, kwargs):  # the family's own eager loop: down_proj reads act(gate) * up per expert
        hidden, index = args[0], args[1]
        for e in range(EXPERTS):
            routed = hidden[(index == e).any(-1)]
            if len(routed):
                gate, up = F.linear(routed, experts.gate_up_proj[e].detach()).chunk(2, dim=-1)
                recorded[e] = (experts.act_fn(gate) * up).abs().mean(0)

    experts.register_forward_pre_hook(record, with_kwargs=True)
    redo = ReDoMonitor(tau=0.1, collect_every_n_steps=1, ema_decay=0.0)  # decay 0: the EMA is the last batch
    cpu_trainer(max_steps=1, callbacks=[redo]).fit(module, tokens())
    scores = redo._ema.split([layer.width for layer in redo.layers])
    for e in range(EXPERTS):
        torch.testing.assert_close(scores[e], recorded[e], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("family", FAMILIES)
def test_continual_backprop_replaces_a_dead_expert_unit_in_its_expert(family):
    build, unit_of = FAMILIES[family]
    torch.manual_seed(0)
    module = CausalLM(build())
    experts = module.model.model.layers[0].mlp.experts
    incoming, outgoing = unit_of(experts, 2, 7)
    _kill(incoming)
    snapshot = Snapshot()
    # one unit per routed expert and step once mature: in expert 2 the dead one (utility 0)
    cbp = ContinualBackprop(replacement_rate=1 / INTER, maturity_threshold=1, bias_correction=hasattr(
        experts, "down_proj_bias"))
    cpu_trainer(max_steps=2, callbacks=[snapshot, cbp]).fit(module, tokens())
    prefix = "model.model.layers.0.mlp.experts."
    expected = torch.zeros_like(experts.gate_up_proj, dtype=torch.bool)
    for tensor, index in incoming:
        if tensor is experts.gate_up_proj:
            expected[index] = True
    changed = snapshot.params[prefix + "gate_up_proj"] != experts.gate_up_proj.detach()
    assert torch.equal(changed[2], expected[2])  # the dead unit's gate and up weights, nothing else of expert 2
    assert bool(changed[2][expected[2]].all())
    bound = (2 ** 0.5) * (3 / HIDDEN) ** 0.5  # kaiming uniform of the re-draw
    fresh = experts.gate_up_proj.detach()[expected]
    assert bool((fresh.abs() <= bound).all()) and fresh.std() > bound / 4
    assert all(bool((w == 0).all()) for w in _get(outgoing))
    if hasattr(experts, "down_proj_bias"):  # a dead unit's mean is 0: nothing moved into the bias
        assert torch.equal(snapshot.params[prefix + "down_proj_bias"][2], experts.down_proj_bias.detach()[2])
    assert cbp.replaced >= 1


# ---------------------------------------------------------------- dense MLPs under other names
def gptj():
    from transformers import GPTJConfig, GPTJForCausalLM

    config = GPTJConfig(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=1, n_head=4, rotary_dim=4, n_positions=16,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return _quiet(lambda: GPTJForCausalLM(config))


def codegen():
    from transformers import CodeGenConfig, CodeGenForCausalLM

    config = CodeGenConfig(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=1, n_head=4, rotary_dim=4, n_positions=16,
                           n_ctx=16, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                           eos_token_id=0)
    return _quiet(lambda: CodeGenForCausalLM(config))


def modernbert():
    from transformers import ModernBertConfig, ModernBertForMaskedLM

    config = ModernBertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=1,
                              num_attention_heads=4, pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1,
                              sep_token_id=2, max_position_embeddings=16)
    return _quiet(lambda: ModernBertForMaskedLM(config))


def _recycle_dense(module, incoming, outgoing, tau=0.0):
    """Kill the unit whose incoming ``(tensor, index)`` entries are given, fit 3 steps with ReDo recycling at
    step 3; return (snapshot, redo)."""
    _kill(incoming)
    snapshot = Snapshot()
    redo = ReDoMonitor(tau=tau, collect_every_n_steps=1, schedule=Schedule(every_n_steps=3))
    cpu_trainer(max_steps=3, callbacks=[snapshot, redo]).fit(module, tokens())
    return snapshot, redo


@pytest.mark.parametrize("family", ["gptj", "codegen"])
def test_redo_recycles_fc_in_fc_out_units(family):
    module = CausalLM({"gptj": gptj, "codegen": codegen}[family]())
    mlp = module.model.transformer.h[0].mlp
    unit = 9
    _kill([(mlp.fc_in.weight, unit)])
    with torch.no_grad():
        mlp.fc_in.bias[unit] = -20.0  # gelu_new(-20) = 0 in float32: dead
    reference = logits(module.model)
    snapshot = Snapshot()
    redo = ReDoMonitor(tau=0.0, collect_every_n_steps=1, schedule=Schedule(every_n_steps=3))
    cpu_trainer(max_steps=3, callbacks=[snapshot, redo]).fit(module, tokens())
    assert [layer.name for layer in redo.layers] == ["model.transformer.h.0.mlp"]
    before = snapshot.params["model.transformer.h.0.mlp.fc_in.weight"]
    rows = torch.nonzero((before != mlp.fc_in.weight.detach()).any(1)).flatten().tolist()
    assert rows == [unit] and bool((mlp.fc_in.weight[unit] != 0).all()) and mlp.fc_in.bias[unit] == 0
    assert bool((mlp.fc_out.weight[:, unit] == 0).all())
    torch.testing.assert_close(logits(module.model), reference, rtol=1e-5, atol=1e-6)


def test_redo_reads_modernbert_split_input_from_its_forward():
    """``input, gate = Wi(x).chunk(2)``: unit i is rows i and I + i of ``Wi``, column i of ``Wo``."""
    model = modernbert()
    mlp = model.model.layers[0].mlp
    [layer] = [layer for layer in find_neuron_layers(model) if layer.up is mlp.Wi]
    assert layer.down is mlp.Wo and layer.width == INTER and layer.fused_gate and not layer.interleaved
    unit = 4
    with torch.no_grad():
        mlp.Wi.weight[[unit, INTER + unit]] = 0
    module = CausalLM(model)  # a masked LM trained on its own loss
    snapshot = Snapshot()
    redo = ReDoMonitor(tau=0.0, collect_every_n_steps=1, schedule=Schedule(every_n_steps=2))
    cpu_trainer(max_steps=2, callbacks=[snapshot, redo]).fit(module, tokens())
    before = snapshot.params["model.model.layers.0.mlp.Wi.weight"]
    rows = torch.nonzero((before != mlp.Wi.weight.detach()).any(1)).flatten().tolist()
    assert rows == [unit, INTER + unit]
    assert bool((mlp.Wo.weight[:, unit] == 0).all())


class InterleavedMLP(nn.Module):
    """A fused input whose forward pairs outputs 2i and 2i + 1 (no name table knows it)."""

    def __init__(self, d=12, hidden=10):
        super().__init__()
        self.w_in = nn.Linear(d, 2 * hidden)
        self.w_out = nn.Linear(hidden, d)

    def forward(self, x):
        both = self.w_in(x)
        return x + self.w_out(F.gelu(both[..., 0::2]) * both[..., 1::2])


def test_fused_pairing_is_read_from_the_forward_not_assumed():
    model = nn.Sequential(InterleavedMLP(), InterleavedMLP())
    layers = find_neuron_layers(model)
    assert [(layer.name, layer.fused_gate, layer.interleaved) for layer in layers] == [
        ("0", True, True), ("1", True, True)]
    # recycled rows are the unit's pair in the forward: zeroing rows 2i, 2i+1 kills exactly unit i
    from plasticity_callbacks.ops.neuron_reset import reinit_incoming, zero_outgoing

    block, x = model[0], torch.randn(5, 12)
    mask = torch.zeros(10, dtype=torch.bool)
    mask[6] = True
    reinit_incoming(block.w_in, layers[0].incoming_mask(mask), init=0.0)
    zero_outgoing(block.w_out, mask)
    both = block.w_in(x)
    assert torch.equal(both[:, 12:14], torch.zeros(5, 2))  # rows 2·6 and 2·6 + 1 are the ones reset
    assert bool((both[:, :12] != 0).all())


# ---------------------------------------------------------------- litgpt-shaped model
class LitLLaMAMLP(nn.Module):
    """litgpt's ``LLaMAMLP``: ``proj(silu(fc_1 x) * fc_2 x)``."""

    def __init__(self, d, hidden):
        super().__init__()
        self.fc_1 = nn.Linear(d, hidden, bias=False)
        self.fc_2 = nn.Linear(d, hidden, bias=False)
        self.proj = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        return self.proj(F.silu(self.fc_1(x)) * self.fc_2(x))


class LitGptNeoxMLP(nn.Module):
    """litgpt's ``GptNeoxMLP``: ``proj(gelu(fc x))``."""

    def __init__(self, d, hidden):
        super().__init__()
        self.fc = nn.Linear(d, hidden)
        self.proj = nn.Linear(hidden, d)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class LitBlock(nn.Module):
    def __init__(self, d, mlp):
        super().__init__()
        self.norm_1, self.norm_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.mlp = mlp

    def forward(self, x):
        h = self.norm_1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm_2(x))


class LitGPT(nn.Module):
    """litgpt's layout: ``transformer.wte``, ``transformer.h[i]`` blocks, ``transformer.ln_f``, ``lm_head``."""

    def __init__(self, d=16):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(VOCAB, d),
            h=nn.ModuleList([LitBlock(d, LitLLaMAMLP(d, 40)), LitBlock(d, LitGptNeoxMLP(d, 24))]),
            ln_f=nn.LayerNorm(d)))
        self.lm_head = nn.Linear(d, VOCAB, bias=False)

    def forward(self, idx):
        x = self.transformer.wte(idx)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


class LitModule(L.LightningModule):
    """Holds litgpt's model without a ``forward`` of its own, as litgpt's recipes do."""

    def __init__(self):
        super().__init__()
        self.model = LitGPT()

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        return F.cross_entropy(self.model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.0)


def test_redo_finds_litgpt_mlps_and_recycles_a_dead_gated_unit():
    module = LitModule()
    mlp0, mlp1 = module.model.transformer.h[0].mlp, module.model.transformer.h[1].mlp
    layers = {layer.name: layer for layer in find_neuron_layers(module)}
    assert layers["model.transformer.h.0.mlp"].gate is mlp0.fc_1 and layers["model.transformer.h.0.mlp"].up is mlp0.fc_2
    assert layers["model.transformer.h.1.mlp"].up is mlp1.fc and layers["model.transformer.h.1.mlp"].down is mlp1.proj
    unit = 11
    _kill([(mlp0.fc_2.weight, unit)])  # silu(g) · 0 = 0
    snapshot = Snapshot()
    redo = ReDoMonitor(tau=0.0, collect_every_n_steps=1, schedule=Schedule(every_n_steps=2))
    cpu_trainer(max_steps=2, callbacks=[snapshot, redo]).fit(module, tokens())
    for name, layer in (("fc_1", mlp0.fc_1), ("fc_2", mlp0.fc_2)):
        before = snapshot.params[f"model.transformer.h.0.mlp.{name}.weight"]
        assert torch.nonzero((before != layer.weight.detach()).any(1)).flatten().tolist() == [unit], name
    assert bool((mlp0.proj.weight[:, unit] == 0).all())
    assert torch.equal(snapshot.params["model.transformer.h.1.mlp.fc.weight"], mlp1.fc.weight.detach())


# ---------------------------------------------------------------- transposed convs
class Decoder(nn.Module):
    """A conv decoder: conv -> relu -> transposed conv (x2) -> relu -> conv, and a grouped transposed conv."""

    def __init__(self):
        super().__init__()
        self.encode = nn.Conv2d(3, 8, 3, padding=1)
        self.upsample = nn.ConvTranspose2d(8, 6, 2, stride=2)
        self.refine = nn.Conv2d(6, 4, 3, padding=1)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        x = self.refine(F.relu(self.upsample(F.relu(self.encode(x)))))
        return self.head(x.mean((2, 3)))


def test_redo_recycles_transposed_conv_channels_in_and_out():
    torch.manual_seed(0)
    model = Decoder()
    layers = {layer.name: layer for layer in find_neuron_layers(model)}
    assert layers["encode"].down is model.upsample  # a transposed conv reads channel i at weight[i]
    assert layers["upsample"].down is model.refine  # and writes it from weight[:, i]
    channel = 2
    with torch.no_grad():
        model.upsample.weight[:, channel] = 0
        model.upsample.bias[channel] = -1.0  # relu(-1) = 0: dead
    x = torch.randn(4, 3, 5, 5)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    reference = model(x)
    redo = ReDoMonitor(tau=0.0, collect_every_n_steps=1, schedule=Schedule(every_n_steps=2))
    module = ImageModule(model)
    cpu_trainer(max_steps=2, callbacks=[redo]).fit(module, DataLoader(TensorDataset(x, torch.randn(4, 2)),
                                                                      batch_size=4))
    changed = (before["upsample.weight"] != model.upsample.weight.detach()).flatten(2).any(2).any(0)
    assert torch.nonzero(changed).flatten().tolist() == [channel]  # output channel = dim 1 of (in, out, k, k)
    assert bool((model.upsample.weight[:, channel] != 0).all()) and model.upsample.bias[channel] == 0
    assert bool((model.refine.weight[:, channel] == 0).all())
    torch.testing.assert_close(model(x), reference)  # its outgoing weights are 0: the output is as before
    assert torch.equal(before["encode.weight"], model.encode.weight.detach())


class ImageModule(L.LightningModule):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.model(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_grouped_transposed_conv_units_are_named_as_skipped():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.ConvTranspose2d(4, 4, 2, groups=2), nn.ReLU(),
                          nn.Conv2d(4, 2, 1))
    with pytest.warns(UserWarning, match=r"units of 2 are not recycled: it is a grouped transposed conv \(groups=2\)"):
        layers = find_neuron_layers(model)
    assert [layer.name for layer in layers] == []  # 0 feeds the grouped one: named as well


# ---------------------------------------------------------------- state-space mixers and a hybrid
def mamba():
    from transformers import MambaConfig, MambaForCausalLM

    config = MambaConfig(vocab_size=VOCAB, hidden_size=16, state_size=4, num_hidden_layers=1, expand=2, conv_kernel=3)
    return _quiet(lambda: MambaForCausalLM(config))


def mamba2():
    from transformers import Mamba2Config, Mamba2ForCausalLM

    config = Mamba2Config(vocab_size=VOCAB, hidden_size=16, state_size=4, num_hidden_layers=1, expand=2,
                          conv_kernel=3, num_heads=4, head_dim=8, n_groups=1)
    return _quiet(lambda: Mamba2ForCausalLM(config))


def jamba():
    """A hybrid: a Mamba layer with a dense MLP, then an attention layer with experts."""
    from transformers import JambaConfig, JambaForCausalLM

    config = JambaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=INTER, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_experts=EXPERTS, num_experts_per_tok=2,
                         expert_layer_period=2, expert_layer_offset=1, attn_layer_period=2, attn_layer_offset=1,
                         mamba_d_state=4, mamba_d_conv=3, mamba_expand=2, use_mamba_kernels=False)
    return _quiet(lambda: JambaForCausalLM(config))


@pytest.mark.parametrize("family,mixer,units", [
    ("mamba", "backbone.layers.0.mixer (MambaMixer)", []),
    ("mamba2", "backbone.layers.0.mixer (Mamba2Mixer)", []),
    ("jamba", "model.layers.0.mamba (JambaMambaMixer)",
     ["model.layers.0.feed_forward", *(f"model.layers.1.feed_forward.experts.{e}" for e in range(EXPERTS))]),
])
def test_state_space_mixers_are_named_as_not_unit_layers_and_a_hybrids_experts_are_found(family, mixer, units):
    model = {"mamba": mamba, "mamba2": mamba2, "jamba": jamba}[family]()
    with pytest.warns(UserWarning, match=rf"does not recycle the in_proj -> out_proj channels of \['{re.escape(mixer)}'\]"):
        layers = find_neuron_layers(model)
    assert [layer.name for layer in layers] == units


class PlainExperts(nn.Module):
    """Experts ``down(act(up x))`` without a gate; square matrices, so the shapes cannot tell the orientation."""

    def __init__(self, experts=3, width=8, is_transposed=None):
        super().__init__()
        self.up_proj = nn.Parameter(torch.randn(experts, width, width))
        self.down_proj = nn.Parameter(torch.randn(experts, width, width))
        self.act_fn = nn.GELU()
        if is_transposed is not None:
            self.is_transposed = is_transposed

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e in range(self.up_proj.shape[0]):
            routed = (top_k_index == e).any(-1)
            h = self.act_fn(F.linear(hidden_states[routed], self.up_proj[e]))
            out[routed] += F.linear(h, self.down_proj[e])
        return out


def test_an_expert_stack_whose_orientation_cannot_be_told_is_named_and_left_alone():
    with pytest.warns(UserWarning, match=r"do not recycle the experts of 0: its stacks \(3, 8, 8\) and \(3, 8, 8\) do "
                                         r"not tell \(out, in\) from \(in, out\)"):
        assert find_neuron_layers(nn.Sequential(PlainExperts())) == []
    # the module's own is_transposed settles it: one plain (ungated) unit layer per expert
    layers = find_neuron_layers(nn.Sequential(PlainExperts(is_transposed=False)))
    assert [(layer.name, layer.width, layer.fused_gate) for layer in layers] == [("0.0", 8, False), ("0.1", 8, False),
                                                                                ("0.2", 8, False)]


def test_redo_recycles_a_dead_unit_of_the_package_gpts_own_moe_in_its_expert():
    from plasticity_callbacks.models.lightning_module import GPTLightningModule

    torch.manual_seed(0)
    module = GPTLightningModule(dict(n_layer=1, n_head=2, n_kv_head=2, n_embd=32, sequence_len=12, vocab_size=VOCAB,
                                     mlp="moe", mlp_options={"n_experts": 4, "top_k": 2}), {"lr": 0.0, "schedule": "constant"})
    experts = module.model.blocks[0].mlp.experts
    width = experts.down_proj.shape[2]
    with torch.no_grad():
        experts.down_proj.normal_(0, 0.1)  # zero at init: give the experts an output
        experts.gate_up_proj[1, [6, width + 6]] = 0  # unit 6 of expert 1: silu(0) · 0
    ids = torch.randint(1, VOCAB, (4, 12), generator=torch.Generator().manual_seed(1))
    reference = module(ids).detach()
    snapshot = Snapshot()
    redo = ReDoMonitor(tau=0.0, collect_every_n_steps=1, schedule=Schedule(every_n_steps=2))
    loader = DataLoader(TensorDataset(*(lambda t: (t[:, :-1], t[:, 1:]))(torch.randint(1, VOCAB, (8, 13)))),
                        batch_size=8)
    cpu_trainer(max_steps=2, callbacks=[snapshot, redo]).fit(module, loader)
    assert [layer.name for layer in redo.layers] == [f"model.blocks.0.mlp.experts.{e}" for e in range(4)]
    before = snapshot.params["model.blocks.0.mlp.experts.gate_up_proj"]
    changed = (before != experts.gate_up_proj.detach()).any(-1)  # (E, 2I): rows that changed
    assert torch.nonzero(changed).tolist() == [[1, 6], [1, width + 6]]
    assert bool((experts.down_proj[1, :, 6] == 0).all())
    torch.testing.assert_close(module(ids).detach(), reference)  # its outgoing column is 0: same output
