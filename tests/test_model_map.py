"""The model map beyond the family matrix: heads, declarations, factorized weights, settings."""
from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn

from helpers import fit
from model_zoo import Wrapped
from plasticity_callbacks.callbacks.dash import DASHShrink
from plasticity_callbacks.callbacks.dash_periodic import DASHPeriodic
from plasticity_callbacks.callbacks.redo import ReDoMonitor
from plasticity_callbacks.callbacks.shrink_perturb import ShrinkPerturb
from plasticity_callbacks.model_map import (Selection, declare_plasticity, find_neuron_layers, output_heads,
                                                 refuse_factorized, select_targets)
from plasticity_callbacks.ops import factorization
from plasticity_callbacks.callbacks.schedule import Schedule
from plasticity_callbacks.ops.fire import apply_fire
from plasticity_callbacks.functional.isometry import FIREOptions

pytest.importorskip("transformers")


class LitGPTStyle(nn.Module):
    """An untied LM head registered before the blocks (the last Linear is not the head)."""

    def __init__(self):
        super().__init__()
        self.lm_head = nn.Linear(8, 20, bias=False)
        self.wte = nn.Embedding(20, 8)
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))

    def forward(self, idx):
        return self.lm_head(self.mlp(self.wte(idx)))


def test_heads_are_found_tied_untied_and_registered_first():
    model = LitGPTStyle()
    assert output_heads(model) == {"lm_head"}
    assert "lm_head.weight" not in [t.name for t in select_targets(model)]
    collision = nn.ModuleDict(dict(tok=nn.Embedding(50, 8), pos=nn.Embedding(16, 8), up=nn.Linear(8, 16),
                                   down=nn.Linear(16, 8), head=nn.Linear(8, 50)))
    assert output_heads(collision) == {"head"}  # a layer as wide as the position table is no head
    gpt2 = Wrapped("gpt2")
    assert gpt2.model.lm_head.weight is gpt2.model.transformer.wte.weight
    assert output_heads(gpt2) == {"model.lm_head"}
    assert not any("wte" in t.name or "lm_head" in t.name for t in select_targets(gpt2))


class Custom(nn.Module):
    """A fused projection under a name no adapter knows, a gated MLP and a head, all declared."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 16, bias=False)  # rows: q (8), k (4), v (4)
        self.a, self.b, self.c = nn.Linear(8, 12), nn.Linear(8, 12), nn.Linear(12, 8)
        self.out = nn.Linear(8, 2)
        self.spare = nn.Linear(2, 2)  # registered last: without the declaration it would be taken for the head


def test_declaration_is_read_by_every_selection():
    model = declare_plasticity(Custom(), fused={"proj.weight": {"q": 8, "k": 4, "v": 4}},
                               neurons={"ffn": (["a", "b"], "c")}, head="out", roles={"a": "mlp", "b": "mlp"})
    views = {t.name: t for t in select_targets(model)}
    assert "out.weight" not in views and "spare.weight" in views
    assert [(b.label, b.rows) for b in views["proj.weight"].blocks] == [("q", range(0, 8)), ("k", range(8, 12)),
                                                                         ("v", range(12, 16))]
    assert {t.name for t in select_targets(model, Selection(scope="mlp"))} == {"a.weight", "b.weight", "c.weight"}
    [layer] = [layer for layer in find_neuron_layers(model) if layer.name == "ffn"]
    assert layer.gate is model.a and layer.up is model.b and layer.down is model.c
    apply_fire(model, options=FIREOptions(method="svd"), selection=Selection(include=["proj.weight"]))
    for start, stop in ((0, 8), (8, 12), (12, 16)):
        s = torch.linalg.svdvals(model.proj.weight[start:stop].double())
        torch.testing.assert_close(s, torch.full_like(s, ((stop - start) / 8) ** 0.5), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="add up to 15 rows"):
        select_targets(declare_plasticity(Custom(), fused={"proj.weight": [8, 4, 3]}))
    with pytest.raises(ValueError, match="no submodule 'nope'"):
        declare_plasticity(Custom(), head="nope")


def test_factorized_weights_are_seen_through_or_refused():
    layer = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 2))
    W = layer[0].weight.detach()
    U, S, Vh = torch.linalg.svd(W)
    B, A = U[:, 4:] * S[4:].sqrt(), S[4:].sqrt()[:, None] * Vh[4:]
    factorization.factorize(layer[0], "weight", B.contiguous(), A.contiguous())
    views = select_targets(layer)
    assert [v.name for v in views] == ["0.weight", "2.weight"] and views[0].factorized
    apply_fire(layer, options=FIREOptions(method="svd"))
    s = torch.linalg.svdvals(layer[0].weight.detach().double())  # the effective weight W_p + BA
    torch.testing.assert_close(s, torch.ones_like(s), rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="DASHShrink.*minor_training='project'"):
        refuse_factorized(views, "DASHShrink", "DASH needs the gradient of the effective weight")


class BareParameter(Wrapped):
    def __init__(self):
        super().__init__("mlp")
        self.temperature = nn.Parameter(torch.ones(()))


def test_shrink_perturb_refuses_a_parameter_no_init_reaches():
    with pytest.raises(RuntimeError, match="ShrinkPerturb: no init code draws a fresh value for \\['temperature'\\]"):
        fit(BareParameter(), [ShrinkPerturb()])
    fit(BareParameter(), [ShrinkPerturb(selection={"exclude": ["temperature"]})])  # the fix the message names


@pytest.mark.parametrize("family", ["gpt2", "resnet"])
def test_bf16_true_redo_and_dash_act(family):
    redo = ReDoMonitor(tau=1.0, collect_every_n_steps=1, log_every_n_steps=1, schedule=Schedule(steps=[1]))
    module = Wrapped(family)
    fit(module, [redo], steps=2, precision="bf16-true")
    assert redo.collections > 0 and bool(redo._observed.all()) and int(redo._recycled.sum()) > 0
    module = Wrapped(family)
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    fit(module, [DASHShrink(n_batches=1)], precision="bf16-true")
    assert any(not torch.equal(before[n], p) for n, p in module.named_parameters())


class Manual(Wrapped):
    """Manual optimization: training_step steps its optimizer and scheduler itself."""

    def __init__(self):
        super().__init__("mlp", lr=0.1)
        self.automatic_optimization = False

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=0.1)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)]

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        self.lr_schedulers().step()


class AfterDash(L.Callback):
    def on_train_start(self, trainer, pl_module):
        opt = trainer.optimizers[0]
        self.state, self.lr, self.step = len(opt.state), opt.param_groups[0]["lr"], trainer.global_step
        self.params = {n: p.detach().clone() for n, p in pl_module.named_parameters()}


def test_dash_gradient_pass_never_steps_a_manual_optimizer():
    module = Manual()
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    after = AfterDash()
    fit(module, [DASHShrink(n_batches=2), after], steps=1)
    assert after.state == 0 and after.lr == 0.1 and after.step == 0  # no optimizer or scheduler step
    # The head is no DASH target; the hidden layers moved by one factor in [lam, 1] per row
    assert torch.equal(after.params["model.4.weight"], before["model.4.weight"])
    for name in ("model.0.weight", "model.2.weight"):
        ratio = after.params[name] / before[name]
        assert torch.all((ratio >= 0.3 - 1e-6) & (ratio <= 1 + 1e-6))
        torch.testing.assert_close(ratio, ratio[:, :1].expand_as(ratio))  # one factor per row


class Bypass(Wrapped):
    """A second MLP the training forward never runs: ReDo cannot observe it."""

    def __init__(self):
        super().__init__("mlp")
        self.unused = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 3))


def test_redo_warns_about_layers_it_never_observes():
    redo = ReDoMonitor(collect_every_n_steps=1, log_every_n_steps=1)
    with pytest.warns(UserWarning, match=r"ReDoMonitor observed no activation of \['unused.0'\]"):
        fit(Bypass(), [redo], steps=2)


class GQAAttention(nn.Module):
    """A fused QKV projection with grouped K/V heads (4 query heads, 1 key/value head), split ``[q | k | v]``."""

    def __init__(self):
        super().__init__()
        self.num_heads, self.num_key_value_heads, self.head_dim = 4, 1, 4
        self.qkv = nn.Linear(16, 16 + 4 + 4, bias=False)
        self.proj = nn.Linear(16, 16)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).split([16, 4, 4], dim=-1)
        q = q.view(B, T, 4, 4).transpose(1, 2)  # (B, nh, T, hd)
        k, v = (t.view(B, T, 1, 4).transpose(1, 2).expand(B, 4, T, 4) for t in (k, v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, 16))


def test_fused_qkv_with_grouped_heads_is_split_as_its_forward_splits():
    model = nn.Sequential(GQAAttention(), nn.Linear(16, 3))
    [qkv] = [t for t in select_targets(model) if t.name == "0.qkv.weight"]
    assert qkv.role == "attention"
    assert [(b.label, len(b)) for b in qkv.blocks] == [("q", 16), ("k", 4), ("v", 4)]
    apply_fire(model, options=FIREOptions(method="svd"), selection=Selection(include=["0.qkv.weight"]))
    for start, stop in ((0, 16), (16, 20), (20, 24)):
        s = torch.linalg.svdvals(model[0].qkv.weight[start:stop].double())
        torch.testing.assert_close(s, torch.full_like(s, ((stop - start) / 16) ** 0.5), rtol=1e-5, atol=1e-6)


def test_gradient_accumulation_dash_periodic_uses_the_accumulated_gradient():
    from model_zoo import batches, loss_of

    module = Wrapped("gpt2")
    loader = torch.utils.data.DataLoader(batches("gpt2"), batch_size=4)
    micro = [b for _, b in zip(range(2), loader)]
    for batch in micro:  # the accumulated gradient: sum of the micro-batch gradients (scale does not matter)
        loss_of("gpt2", module.model, batch).backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters()}
    module.zero_grad()
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    dash = DASHPeriodic(schedule=Schedule(steps=[0], every_n_steps=1), cosine_threshold=-1.0, shrink_rate=1.0,
                        min_factor=0.5, shrink_bias=False)
    fit(module, [dash], steps=1, accumulate_grad_batches=2)
    assert dash.shrinks == 1  # once per optimizer step, not per micro-batch
    for name in ("model.transformer.h.0.attn.c_attn.weight", "model.transformer.h.1.mlp.c_fc.weight"):
        W, G = before[name].mT.double(), grads[name].mT.double()  # Conv1D: rows of the transpose
        factor = (-torch.nn.functional.cosine_similarity(W, G, dim=1)).clamp(0.5, 1.0)
        torch.testing.assert_close(dict(module.named_parameters())[name].detach().mT.double(), W * factor[:, None],
                                   rtol=1e-4, atol=1e-6)


def _factorize_first_layer(module):
    layer = module.model[0]
    U, S, Vh = torch.linalg.svd(layer.weight.detach(), full_matrices=False)  # (16, 8), (8,), (8, 8)
    B, A = (U[:, 6:] * S[6:].sqrt()).contiguous(), (S[6:].sqrt()[:, None] * Vh[6:]).contiguous()
    factorization.factorize(layer, "weight", B, A)
    return layer


def test_shrink_perturb_treats_a_factorized_weight_as_its_effective_weight():
    from plasticity_callbacks.distributed.strategy import rank_identical_generator
    from plasticity_callbacks.model_map import fresh_parameters

    module = Wrapped("mlp")
    layer = _factorize_first_layer(module)
    effective = layer.weight.detach().clone()
    B = factorization.components(layer, "weight").B.detach().clone()
    fit(module, [ShrinkPerturb(shrink=0.5, perturb=0.3, seed=5)])
    fresh = fresh_parameters(module, rank_identical_generator(5, 0).initial_seed())["model.0.weight"]
    torch.testing.assert_close(layer.weight.detach(), 0.5 * effective + 0.3 * fresh)
    assert torch.equal(factorization.components(layer, "weight").B.detach(), B)  # B, A kept, W_p absorbed it


def test_redo_refuses_a_factorized_layer_before_recycling():
    module = Wrapped("mlp")
    _factorize_first_layer(module)
    redo = ReDoMonitor(tau=1.0, collect_every_n_steps=1, log_every_n_steps=1, schedule=Schedule(every_n_steps=1))
    with pytest.raises(RuntimeError, match=r"ReDoMonitor: layers \['model.0'\] are factorized"):
        fit(module, [redo], steps=2)


def test_adaptive_svd_factorizes_conv1d_in_out_in_orientation():
    from plasticity_callbacks.callbacks.adaptive_svd import AdaptiveSVDSwitch

    module = Wrapped("gpt2")
    before = {n: m.weight.detach().clone() for n, m in module.named_modules() if type(m).__name__ == "Conv1D"}
    switch = AdaptiveSVDSwitch(minor_training="factorize", schedule=Schedule(steps=[0], every_n_steps=1),
                               thresholds={"clobber_alignment": 0.0}, r_min=2,
                               initial_rank=3, save_figure=False, log_per_matrix=False)
    fit(module, [switch], steps=1)
    for name, W in before.items():
        layer = module.get_submodule(name)
        assert factorization.is_factorized(layer, "weight")
        parts = factorization.components(layer, "weight")
        assert parts.B.shape == (W.shape[1], 3) and parts.A.shape == (3, W.shape[0])  # (out, r), (r, in)
        torch.testing.assert_close(layer.weight.detach(), W, rtol=1e-4, atol=1e-5)  # lr=0: W_p + BA is W


def test_fresh_parameters_of_a_bare_hugging_face_model_draws_it_whole():
    from model_zoo import gpt2
    from plasticity_callbacks.model_map import fresh_parameters

    model = gpt2()
    flags = {n for n, m in model.named_modules() if getattr(m, "_is_hf_initialized", False)}
    fresh = fresh_parameters(model, seed=1)
    assert set(fresh) == {n for n, _ in model.named_parameters()}  # the tied head is drawn once, with wte
    assert all(not torch.equal(fresh[n], p) for n, p in model.named_parameters() if p.dim() >= 2)
    assert flags == {n for n, m in model.named_modules() if getattr(m, "_is_hf_initialized", False)}  # untouched


class Uncopyable:
    """What a callback's forward hook may reach under DDP (its trainer, a process group): no deep copy."""

    def __deepcopy__(self, memo):
        raise AttributeError("a process group cannot be deep-copied")


def test_a_fresh_draw_neither_copies_nor_runs_the_models_hooks():
    from plasticity_callbacks.model_map import fresh_layer_weight, fresh_parameters

    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    calls = []

    class Collector:  # ContinualBackprop's kind of hook: an object holding its callback and trainer
        def __init__(self):
            self.trainer = Uncopyable()

        def __call__(self, module, args):
            calls.append(module)

    model[2].register_forward_pre_hook(Collector())
    model[0].register_forward_hook(lambda module, args, out: calls.append(module))
    torch.manual_seed(3)
    expected = {f"{i}.{k}": v for i in (0, 2) for k, v in nn.Linear(*model[i].weight.shape[::-1]).named_parameters()}
    fresh = fresh_parameters(model, seed=3)
    assert set(fresh) == set(expected) and not calls
    for name, value in expected.items():  # what one draw of the layers' own init gives, in model order
        torch.testing.assert_close(fresh[name], value, rtol=0, atol=0, msg=name)
    torch.manual_seed(4)
    torch.testing.assert_close(fresh_layer_weight(model, model[2], seed=4), nn.Linear(7, 3).weight, rtol=0, atol=0)
    model(torch.randn(2, 5))
    assert calls == [model[0], model[2]]  # the model keeps its hooks


class CachingForward(nn.Module):
    """A forward that stores something on the module: a trace must not leave a proxy behind."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.last = nn.Linear(4, 8), nn.Linear(8, 4), None

    def forward(self, x):
        self.last = x
        return self.fc2(torch.relu(self.fc1(x)))


def test_finding_layers_by_tracing_leaves_the_model_as_it_was():
    model = nn.Sequential(CachingForward(), nn.Linear(4, 2))
    [layer] = find_neuron_layers(model)
    assert layer.up is model[0].fc1 and layer.down is model[0].fc2
    assert model[0].last is None


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_redo_model_init_redraws_rows_by_the_hugging_face_init(family):
    module = Wrapped(family)
    with torch.no_grad():  # grown weights: a draw at the recorded std would be 3x the model's init scale
        for p in module.parameters():
            p.mul_(3.0)
    redo = ReDoMonitor(tau=1.0, init="model", collect_every_n_steps=1, log_every_n_steps=1,
                       schedule=Schedule(steps=[1]))
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    fit(module, [redo], steps=2)
    std = module.model.config.initializer_range
    for layer in redo.layers:
        for m in (layer.up, layer.gate):
            if m is None:
                continue
            name = next(n for n, x in module.named_modules() if x is m)
            W, W0 = m.weight.detach(), before[f"{name}.weight"]
            rows = (W != W0).any(0) if type(m).__name__ == "Conv1D" else (W != W0).any(1)
            new = W[:, rows].mT if type(m).__name__ == "Conv1D" else W[rows]
            assert rows.any() and abs(float(new.std()) / std - 1) < 0.35  # N(0, initializer_range) rows


class RawMatrix(nn.Module):
    """A weight used through einsum: no linear map the model map can read."""

    def __init__(self):
        super().__init__()
        self.mix = nn.Parameter(torch.randn(6, 6))
        self.embed = nn.Embedding(5, 6)
        self.fc = nn.Linear(6, 6)
        self.out = nn.Linear(6, 2)

    def forward(self, ids):
        return self.out(torch.relu(self.fc(torch.einsum("...i,ij->...j", self.embed(ids), self.mix))))


def test_coverage_lists_every_matrix_with_its_reason_and_warns_about_unknown_ones(caplog):
    import logging

    import warnings

    from plasticity_callbacks.model_map import coverage_report, describe
    from plasticity_callbacks.model_map.coverage import log_coverage

    model = RawMatrix()
    with caplog.at_level(logging.INFO, logger="plasticity_callbacks"), warnings.catch_warnings():
        warnings.simplefilter("error")
        assert names(select_targets(model)) == ["fc.weight"]  # a query: no table, no warning
    assert caplog.text == ""
    with caplog.at_level(logging.INFO, logger="plasticity_callbacks"), \
            pytest.warns(UserWarning, match=r"no plasticity callback treats \['mix'\]"):
        log_coverage(model, None, "mine")
    assert "mine coverage:" in caplog.text and "fc.weight" in caplog.text and "mix" in caplog.text
    report = coverage_report(model, {"scope": "attention"})
    lines = {line.split()[0]: line for line in report.splitlines() if line.startswith("  ")}
    assert "outside the selection (scope='attention'" in lines["fc.weight"]
    assert "output head" in lines["out.weight"] and "embedding" in lines["embed.weight"]
    assert "no callback knows this layer (RawMatrix.mix: " in lines["mix"] and "linear_map(" in lines["mix"]
    assert report in describe(model) or coverage_report(model) in describe(model)
    lstm = nn.Sequential(nn.LSTM(4, 3), nn.Linear(3, 2))
    assert "blocks[i=rows 0:3, f=rows 3:6, g=rows 6:9, o=rows 9:12]" in coverage_report(lstm)


def names(targets):
    return [t.name for t in targets]


def test_redo_says_which_units_it_cannot_recycle():
    from model_zoo import ConvZoo, Recurrent

    with pytest.warns(UserWarning) as record:
        # depthwise feeds a transposed conv, which reads its channel i at weight[i]: recycled
        assert [layer.name for layer in find_neuron_layers(ConvZoo())] == ["depthwise"]
    messages = [str(w.message) for w in record]
    assert any("units of grouped are not recycled: they feed depthwise, a grouped conv (groups=8)" in m
               for m in messages)
    assert any("units of up are not recycled: they feed up_grouped, a grouped transposed conv (groups=2)" in m
               for m in messages)
    with pytest.warns(UserWarning, match=r"ReDo does not recycle the hidden units of \['lstm \(LSTM\)', 'gru \(GRU\)'"):
        find_neuron_layers(Recurrent())


class GroupedQueryAttention(nn.Module):
    """litgpt-style: ``qkv`` rows laid out ``[n_query_groups, q_per_kv + 2, head_size]``; needs a mask argument."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.qkv = nn.Linear(16, (4 + 2 * 2) * 4, bias=False)
        self.proj = nn.Linear(16, 16, bias=False)

    def forward(self, x, mask):
        B, T, _ = x.shape
        qkv = self.qkv(x).view(B, T, 2, 4, 4)  # (B, T, groups, q_per_kv + 2, hs)
        q, k, v = qkv.split((2, 1, 1), dim=3)
        q = q.reshape(B, T, 4, 4).transpose(1, 2)  # (B, nh, T, hs)
        k, v = (t.expand(B, T, 2, 2, 4).reshape(B, T, 4, 4).transpose(1, 2) for t in (k, v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(y.transpose(1, 2).reshape(B, T, 16))


class TokenModel(nn.Module):
    def __init__(self):
        super().__init__()
        config = type("Config", (), {"n_head": 4, "n_query_groups": 2})()
        self.wte, self.attn, self.lm_head = nn.Embedding(10, 16), GroupedQueryAttention(config), nn.Linear(16, 10)

    def forward(self, idx):
        T = idx.shape[1]
        return self.lm_head(self.attn(self.wte(idx), torch.ones(T, T, dtype=torch.bool).tril()))


def test_a_litgpt_style_grouped_qkv_is_read_from_the_whole_models_forward():
    model = TokenModel()
    [qkv] = [t for t in select_targets(model) if t.name == "attn.qkv.weight"]
    index = torch.arange(32).view(2, 4, 4)  # the forward's (groups, q_per_kv + 2, hs)
    assert [(b.label, sorted(b.rows)) for b in qkv.blocks] == [
        ("q", index[:, :2].flatten().tolist()), ("k", index[:, 2].flatten().tolist()),
        ("v", index[:, 3].flatten().tolist())]
    apply_fire(model, options=FIREOptions(method="svd"))
    W = model.attn.qkv.weight.detach().view(2, 4, 4, 16)
    for M in (W[:, :2], W[:, 2], W[:, 3]):
        s = torch.linalg.svdvals(M.reshape(-1, 16).double())
        scale = (M.reshape(-1, 16).shape[0] / 16) ** 0.5
        torch.testing.assert_close(s, torch.full_like(s, scale), rtol=1e-5, atol=1e-6)
    # a model the probe cannot run: FIRE names the grouped declaration, from the config's n_query_groups
    with pytest.raises(ValueError, match=r"grouped_heads\(kv_groups=2, q_per_kv=2\)"):
        apply_fire(TokenModelWithoutForward(), options=FIREOptions(method="svd"))


class TokenModelWithoutForward(TokenModel):
    def forward(self, idx, extra):
        raise NotImplementedError


def test_the_probe_reads_the_same_split_in_half_precision():
    from model_zoo import LAYOUT_MODELS

    name = "gpt_neox.layers.0.attention.query_key_value.weight"
    index = torch.arange(48).view(4, 3, 4)  # the forward's (heads, 3, head_dim)
    expected = [(label, index[:, i].flatten().tolist()) for i, label in enumerate("qkv")]
    for dtype in (torch.bfloat16, torch.float16):
        model = LAYOUT_MODELS["gpt_neox"]().to(dtype)
        [view] = [t for t in select_targets(model) if t.name == name]
        assert [(b.label, sorted(b.rows)) for b in view.blocks] == expected, dtype


def test_every_callback_shows_its_coverage_table_at_setup(caplog):
    import logging

    from plasticity_callbacks.callbacks.fire import FIREReinit

    with caplog.at_level(logging.INFO):
        fit(Wrapped("gpt2"), [FIREReinit(schedule=Schedule(at_fit_start=True), selection={"scope": "mlp"})])
    text = caplog.text
    assert "FIREReinit coverage:" in text
    assert "model.transformer.h.*.mlp.c_fc.weight ×2 (64, 16) role=mlp" in text
    assert "model.transformer.h.*.attn.c_attn.weight ×2 (48, 16) outside the selection (scope='mlp'" in text
