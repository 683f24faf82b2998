"""Hidden units read from the model's own forward (``model_map/unit_flow.py``): layer names no table knows,
functional activations, relu², gates, fused inputs and conv chains in forwards fx cannot trace, Hugging Face
families without an adapter (Nemotron's relu² MLP, RWKV's key -> relu² -> value); and what cannot be paired
(a unit that also reaches the residual, experts stored 2-D or as ``ParallelExperts``) named in one warning with
the ``layer_map`` that declares it.

Every check is against the family's own forward: units killed by hand (their incoming rows zeroed) must be
exactly the ones scored dead, the scores must equal mean ``|h|`` read by a pre-hook of our own on the ``down``
module named in the test (not the one the map chose), and recycling must re-draw exactly those rows of ``up``
(and gate) and zero exactly those columns of ``down``, leaving the model's output unchanged.
"""
from __future__ import annotations

import ast
import re
import warnings

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from plasticity_callbacks import ContinualBackprop, ReDoMonitor
from plasticity_callbacks.callbacks.schedule import Schedule
from plasticity_callbacks.model_map import Selection, find_neuron_layers
from plasticity_callbacks.ops.redo import ActivationStats, recycle_
from tiny import cpu_trainer

H, I = 8, 12


def _shaped(x: torch.Tensor) -> bool:
    return x.shape[-1] > 0  # a branch on a shape: torch.fx cannot trace this forward, the map must run it


class Relu2MLP(nn.Module):
    """Primer-style ``w_out(relu(w_in x)²)``, names no adapter knows."""

    def __init__(self):
        super().__init__()
        self.w_in, self.w_out = nn.Linear(H, I), nn.Linear(I, H)

    def forward(self, x):
        return x + self.w_out(F.relu(self.w_in(x)).square()) if _shaped(x) else x


class GatedMLP(nn.Module):
    """``c(silu(a x) * b x)``: a gate under names no adapter knows."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(H, I, bias=False), nn.Linear(H, I, bias=False), nn.Linear(I, H)

    def forward(self, x):
        return x + self.c(F.silu(self.a(x)) * self.b(x)) if _shaped(x) else x


class InterleavedMLP(nn.Module):
    """One fused input layer, unit ``i`` reading rows ``2i`` (gate) and ``2i + 1``, and a tanh-GELU written out;
    the layers sit in a ``ModuleDict``, so no block runs them on ``x`` alone: only the whole forward pairs them."""

    def __init__(self):
        super().__init__()
        self.io = nn.ModuleDict({"wi": nn.Linear(H, 2 * I), "wo": nn.Linear(I, H)})

    def forward(self, x):
        z = self.io["wi"](x)
        g, u = z[..., ::2], z[..., 1::2]
        g = 0.5 * g * (1.0 + torch.tanh(0.7978845608 * (g + 0.044715 * torch.pow(g, 3.0))))
        return x + self.io["wo"](g * u) if _shaped(x) else x


class SquaredMLP(nn.Module):
    """``relu(x)`` then ``h * h``."""

    def __init__(self):
        super().__init__()
        self.i, self.o = nn.Linear(H, I), nn.Linear(I, H)

    def forward(self, x):
        h = F.relu(self.i(x))
        return x + self.o(h * h) if _shaped(x) else x


class LeakyMLP(nn.Module):
    """A unit that also reaches the residual: zeroing its outgoing column does not remove it."""

    def __init__(self):
        super().__init__()
        self.i, self.o = nn.Linear(H, H), nn.Linear(H, H)

    def forward(self, x):
        h = F.relu(self.i(x))
        return x + self.o(h) + h


class TokenNet(nn.Module):
    def __init__(self, *blocks: nn.Module):
        super().__init__()
        self.emb, self.blocks, self.head = nn.Embedding(16, H), nn.ModuleList(blocks), nn.Linear(H, 16)

    def forward(self, idx):
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class FunctionalCNN(nn.Module):
    """Conv -> F.relu -> conv -> F.gelu -> flatten -> Linear -> F.relu -> head, a branch fx cannot trace."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 6, 3, padding=1), nn.Conv2d(6, 4, 3, padding=1)
        self.fc, self.out = nn.Linear(4 * 4 * 4, 10), nn.Linear(10, 3)
        self.example_input_array = torch.zeros(1, 3, 8, 8)

    def forward(self, x):
        x = F.relu(self.c1(x))
        if _shaped(x):
            x = F.max_pool2d(x, 2)
        x = torch.flatten(F.gelu(self.c2(x)), 1)
        return self.out(F.relu(self.fc(x)))


def _quiet(build):
    import transformers

    transformers.logging.set_verbosity_error()
    return build()


def nemotron():
    from transformers import NemotronConfig, NemotronForCausalLM

    return _quiet(lambda: NemotronForCausalLM(NemotronConfig(
        vocab_size=16, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=8)))


def rwkv():
    from transformers import RwkvConfig, RwkvForCausalLM

    return _quiet(lambda: RwkvForCausalLM(RwkvConfig(vocab_size=16, hidden_size=16, attention_hidden_size=16,
                                                     intermediate_size=24, num_hidden_layers=2, context_length=8)))


def tokens(model):
    return torch.randint(0, 16, (3, 5))


# name: (build, input, [(gate, up, down)] module paths as the family's forward uses them, fused pairing)
FAMILIES = {
    "relu2": (lambda: TokenNet(Relu2MLP(), Relu2MLP()), tokens,
              [(None, "blocks.0.w_in", "blocks.0.w_out"), (None, "blocks.1.w_in", "blocks.1.w_out")], None),
    "gated": (lambda: TokenNet(GatedMLP()), tokens, [("blocks.0.a", "blocks.0.b", "blocks.0.c")], None),
    "interleaved": (lambda: TokenNet(InterleavedMLP()), tokens, [(None, "blocks.0.io.wi", "blocks.0.io.wo")],
                    "interleaved"),
    "x*x": (lambda: TokenNet(SquaredMLP()), tokens, [(None, "blocks.0.i", "blocks.0.o")], None),
    "cnn": (FunctionalCNN, lambda m: torch.randn(4, 3, 8, 8),
            [(None, "c1", "c2"), (None, "c2", "fc"), (None, "fc", "out")], None),
    "nemotron": (nemotron, tokens, [(None, "model.layers.0.mlp.up_proj", "model.layers.0.mlp.down_proj")], None),
    "rwkv": (rwkv, tokens, [(None, f"rwkv.blocks.{i}.feed_forward.key", f"rwkv.blocks.{i}.feed_forward.value")
                            for i in range(2)], None),
}


def _logits(output):
    return output if torch.is_tensor(output) else output.logits


def _unit_rows(layer, units):
    """Rows of ``up`` that hold ``units`` in the family's own layout (interleaved: 2i and 2i + 1)."""
    return torch.stack([2 * units, 2 * units + 1], 1).flatten() if layer.interleaved else units


@pytest.mark.parametrize("family", FAMILIES)
def test_units_read_from_the_forward_are_the_true_units_and_recycle_exactly_the_dead(family):
    build, make_input, expected, pairing = FAMILIES[family]
    torch.manual_seed(0)
    model = build()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing here is unpaired: no warning
        layers = find_neuron_layers(model)
    names = {id(m): n for n, m in model.named_modules()}
    found = [(names.get(id(layer.gate)), names[id(layer.up)], names[id(layer.down)]) for layer in layers]
    assert sorted(found, key=str) == sorted(expected, key=str)
    assert all((layer.interleaved if pairing == "interleaved" else not layer.fused_gate) for layer in layers)

    dead = {}  # kill units by their incoming rows, as the family's forward reads them
    with torch.no_grad():
        for layer in layers:
            units = torch.tensor([0, layer.width - 1])
            mask = torch.zeros(layer.width, dtype=torch.bool)
            mask[units] = True
            dead[layer.name] = mask
            rows = _unit_rows(layer, units)
            layer.up.weight[rows] = 0.0
            if layer.up.bias is not None:
                layer.up.bias[rows] = 0.0
    own = {}  # down's input as the family's forward hands it over, by a hook of our own on the named module
    handles = [model.get_submodule(down).register_forward_pre_hook(
        lambda m, args, key=down: own.setdefault(key, args[0].detach())) for _, _, down in expected]
    model.train()
    x = make_input(model)
    with ActivationStats(model, layers) as stats, torch.no_grad():
        model(x)
    for handle in handles:
        handle.remove()
    for layer in layers:
        h = own[names[id(layer.down)]]
        unit_dim = 1 if isinstance(layer.down, nn.Conv2d) else -1
        h = h.movedim(unit_dim, -1)
        if layer.group > 1:
            h = h.unflatten(-1, (layer.width, layer.group)).transpose(-1, -2)
        activity = h.abs().reshape(-1, layer.width).mean(0)
        torch.testing.assert_close(stats.scores()[layer.name], activity / activity.mean())
        assert bool((stats.scores()[layer.name][dead[layer.name]] <= 0).all())  # a ReLU may die by chance too

    model.eval()
    before_out = _logits(model(x)).detach()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    recycle_(model, layers, dead, init="weight_std")
    rows, columns = {}, {}  # per module: rows re-drawn as an up, columns zeroed as a down (a conv can be both)
    for layer in layers:
        units = dead[layer.name].nonzero().flatten()
        for module, module_rows in ((layer.up, _unit_rows(layer, units)), (layer.gate, units)):
            if module is not None:
                rows.setdefault(module, torch.zeros(module.weight.shape[0], dtype=torch.bool))[module_rows] = True
        columns.setdefault(layer.down, torch.zeros(layer.down.weight.shape[1], dtype=torch.bool))
        columns[layer.down] |= dead[layer.name].repeat_interleave(layer.group)
    for module in {*rows, *columns}:
        new, old = module.weight.detach(), before[names[id(module)] + ".weight"]
        r = rows.get(module, torch.zeros(new.shape[0], dtype=torch.bool))
        c = columns.get(module, torch.zeros(new.shape[1], dtype=torch.bool))
        assert torch.equal(new[~r][:, ~c], old[~r][:, ~c])  # everything else bit-identical
        assert not bool(new[:, c].any())  # exactly the dead units' outgoing weights are zero
        assert bool((new[r][:, ~c] != old[r][:, ~c]).flatten(1).any(1).all())  # every dead unit's rows re-drawn
    torch.testing.assert_close(_logits(model(x)), before_out)  # the new units have no outgoing weight yet


def test_a_unit_that_reaches_the_residual_is_named_once_with_the_layer_map_that_declares_it():
    model = TokenNet(LeakyMLP(), Relu2MLP())
    with pytest.warns(UserWarning) as caught:
        layers = find_neuron_layers(model)
    messages = [str(w.message) for w in caught if "do not recycle" in str(w.message)]
    assert len(messages) == 1 and "blocks.0.i.weight -> blocks.0.o.weight" in messages[0] and "add" in messages[0]
    assert [layer.name for layer in layers] == ["blocks.1"]  # the clean block is still recycled
    layer_map = ast.literal_eval(re.search(r"layer_map=(\{.*?\})", messages[0]).group(1))
    assert layer_map == {"blocks.0": ("blocks.0.i", "blocks.0.o")}
    declared = find_neuron_layers(model, layer_map)  # the suggested declaration works as given
    assert [(layer.up, layer.down) for layer in declared] == [(model.blocks[0].i, model.blocks[0].o)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [layer.name for layer in find_neuron_layers(model, exclude=["blocks.0.*"])] == ["blocks.1"]


class Experts2D(nn.Module):
    """Experts stored 2-D, ``(E·I, H)``, viewed ``(E, I, H)`` in the forward."""

    def __init__(self, experts: int = 3):
        super().__init__()
        self.experts = experts
        self.router = nn.Linear(H, experts)
        self.w_up = nn.Parameter(torch.randn(experts * I, H) * 0.1)
        self.w_down = nn.Parameter(torch.randn(experts * H, I) * 0.1)

    def forward(self, x):
        up, down = self.w_up.view(self.experts, I, H), self.w_down.view(self.experts, H, I)  # (E, I, H), (E, H, I)
        choice = self.router(x).argmax(-1)
        out = torch.zeros_like(x)
        for e in range(self.experts):
            routed = choice == e
            out[routed] = F.linear(F.relu(F.linear(x[routed], up[e])), down[e])
        return x + out


class ParallelExperts(nn.Module):
    """Granite's former ``ParallelExperts``: a 3-D ``weight``, tokens sorted by expert and split by count."""

    def __init__(self, experts: int, d_in: int, d_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(experts, d_out, d_in) * 0.1)

    def forward(self, inputs, sizes):
        return torch.cat([F.linear(part, self.weight[e]) for e, part in enumerate(inputs.split(sizes, 0))], 0)


class GraniteStyleMoE(nn.Module):
    def __init__(self, experts: int = 3):
        super().__init__()
        self.experts = experts
        self.router = nn.Linear(H, experts)
        self.input_linear, self.output_linear = ParallelExperts(experts, H, 2 * I), ParallelExperts(experts, I, H)

    def forward(self, x):
        flat = x.reshape(-1, H)  # (tokens, H)
        choice = self.router(flat).argmax(-1)
        order = choice.argsort()
        sizes = torch.bincount(choice, minlength=self.experts).tolist()
        gate, up = self.input_linear(flat[order], sizes).chunk(2, -1)
        y = self.output_linear(F.silu(gate) * up, sizes)
        out = torch.empty_like(y)
        out[order] = y
        return x + out.view_as(x)


@pytest.mark.parametrize("moe, stack", [(Experts2D, "blocks.0.w_up (experts) -> blocks.0.w_down (experts)"),
                                        (GraniteStyleMoE, "blocks.0.input_linear.weight (experts) -> "
                                                          "blocks.0.output_linear.weight (experts)")])
def test_experts_in_other_storage_are_named_and_the_error_names_them(moe, stack):
    model = TokenNet(moe())
    with pytest.warns(UserWarning, match=re.escape(stack) + r".*stack of experts"):
        assert find_neuron_layers(model) == []
    with pytest.raises(ValueError, match=re.escape(stack)):
        ReDoMonitor().check_targets(None, model)
    with pytest.raises(ValueError, match=re.escape(stack)):
        ContinualBackprop().check_targets(None, model)
    with pytest.warns(UserWarning, match=re.escape(stack)) as caught:
        find_neuron_layers(model)
    exclude = ast.literal_eval(re.search(r"exclude=(\[.*?\])", str(caught[0].message)).group(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the exclusion it suggests says that leaving them is intended
        assert find_neuron_layers(model, exclude=exclude) == []


def test_no_layers_error_names_the_siblings_when_the_forward_cannot_run():
    class NeedsTwo(nn.Module):
        def __init__(self):
            super().__init__()
            self.key, self.value = nn.Linear(H, I), nn.Linear(I, H)

        def forward(self, x, y):  # two inputs and a branch: neither fx nor the one-input forward reads it
            return self.value(torch.relu(self.key(x + y)) ** 2) if _shaped(x) else x

    model = nn.Sequential()
    model.mix, model.head = NeedsTwo(), nn.Linear(H, 2)
    with pytest.raises(ValueError, match=re.escape("mix.key -> mix.value") + r".*could not be run") as raised:
        ReDoMonitor().check_targets(None, model)
    layer_map = ast.literal_eval(re.search(r"layer_map=(\{.*?\})", str(raised.value)).group(1))
    assert layer_map == {"mix": ("mix.key", "mix.value")}
    redo = ReDoMonitor(layer_map=layer_map)
    redo.check_targets(None, model)
    assert [(layer.up, layer.down) for layer in redo.layers] == [(model.mix.key, model.mix.value)]


class TokenModule(L.LightningModule):
    """A token model trained by Adam at lr 0: every change of a weight is the callback's."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def training_step(self, batch, batch_idx):
        (idx,) = batch
        logits = _logits(self.net(idx))
        return F.cross_entropy(logits.flatten(0, 1), idx.flatten())

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.0)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randint(0, 16, (8, 5))), batch_size=4)


@pytest.mark.parametrize("family", ["rwkv", "relu2"])
def test_redo_and_cbp_recycle_the_dead_unit_of_a_family_no_table_knows(family):
    build, _, expected, _ = FAMILIES[family]
    torch.manual_seed(0)
    net = build()
    up, down = net.get_submodule(expected[0][1]), net.get_submodule(expected[0][2])
    with torch.no_grad():
        up.weight[3] = 0.0  # unit 3 of the first block is dead in the family's own forward
        if up.bias is not None:
            up.bias[3] = 0.0
    redo = ReDoMonitor(tau=0.0, collect_every_n_steps=1, log_every_n_steps=100,
                       schedule=Schedule(steps=[2]), selection=Selection(include=[f"net.{expected[0][1]}.*"]))
    cpu_trainer(max_steps=2, callbacks=[redo], logger=False).fit(TokenModule(net))
    assert [layer.up for layer in redo.layers] == [up]
    assert float(up.weight[3].abs().sum()) > 0 and float(down.weight[:, 3].abs().sum()) == 0
    assert int(redo._recycled.sum()) == 1

    torch.manual_seed(0)
    net = build()
    up, down = net.get_submodule(expected[0][1]), net.get_submodule(expected[0][2])
    with torch.no_grad():
        up.weight[5] = 0.0
        if up.bias is not None:
            up.bias[5] = 0.0
    before = down.weight.detach().clone()
    width = up.weight.shape[0]
    cbp = ContinualBackprop(replacement_rate=1.0 / width, maturity_threshold=0, bias_correction=False,
                            selection={"include": [f"net.{expected[0][1]}.*"]})
    cpu_trainer(max_steps=1, callbacks=[cbp], logger=False).fit(TokenModule(net))
    assert cbp.replaced == 1  # the one unit with zero utility (its true activation is 0) is the one replaced
    changed = (down.weight != before).any(0).nonzero().flatten().tolist()
    assert changed == [5] and float(down.weight[:, 5].abs().sum()) == 0
    assert float(up.weight[5].abs().sum()) > 0


def test_selection_picks_the_layers_like_every_other_method():
    model = TokenNet(Relu2MLP(), Relu2MLP())
    assert [layer.name for layer in find_neuron_layers(model, selection=Selection(include=["blocks.1.*"]))] \
        == ["blocks.1"]
    assert [layer.name for layer in find_neuron_layers(model, selection={"exclude": ["blocks.1.*"]})] == ["blocks.0"]
    redo = ReDoMonitor(selection={"exclude": ["blocks.0.*"]})
    assert redo.selection.exclude == ("blocks.0.*",)
    with pytest.raises(ValueError, match=r"found no neuron layers: the layers found \(blocks.0, blocks.1\) are all "
                                         r"left out by the selection"):
        ReDoMonitor(selection=Selection(scope="attention")).check_targets(None, model)
    with pytest.raises(ValueError, match="scope='bogus' is not one of"):
        ContinualBackprop(selection={"scope": "bogus"})


def test_continual_backprop_config_takes_a_selection():
    from pathlib import Path

    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(Path(__file__).parents[1] / "configs" / "callbacks" / "continual_backprop.yaml")
    cfg.continual_backprop.seed = 3  # ${seed} comes from the experiment
    cbp = instantiate(cfg.continual_backprop, selection={"scope": "mlp"})
    assert isinstance(cbp, ContinualBackprop) and cbp.selection == Selection(scope="mlp") and cbp.layer_map is None


def test_t5_units_are_read_from_its_forward():
    from transformers import T5Config, T5ForConditionalGeneration

    model = _quiet(lambda: T5ForConditionalGeneration(T5Config(vocab_size=16, d_model=16, d_ff=24, num_layers=1,
                                                               num_heads=2, d_kv=8, decoder_start_token_id=0)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layers = find_neuron_layers(model)
    dense = [model.encoder.block[0].layer[1].DenseReluDense, model.decoder.block[0].layer[2].DenseReluDense]
    assert [(layer.up, layer.down, layer.gate) for layer in layers] == [(d.wi, d.wo, None) for d in dense]


def test_whispers_conv_front_end_is_read_from_a_forward_on_zero_mel_frames():
    """The map runs Whisper on zero mel frames its config sizes (with one decoder token), so the encoder's
    conv1 -> gelu -> conv2 front end is paired from the forward like the MLPs, with no warning."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    model = _quiet(lambda: WhisperForConditionalGeneration(WhisperConfig(
        vocab_size=16, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=24, decoder_ffn_dim=24, num_mel_bins=4, max_source_positions=8,
        max_target_positions=8, pad_token_id=0, bos_token_id=0, eos_token_id=0, decoder_start_token_id=0)))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        layers = find_neuron_layers(model)
    encoder, decoder = model.model.encoder, model.model.decoder
    assert {(layer.up, layer.down) for layer in layers} == {
        (encoder.layers[0].fc1, encoder.layers[0].fc2), (decoder.layers[0].fc1, decoder.layers[0].fc2),
        (encoder.conv1, encoder.conv2)}
