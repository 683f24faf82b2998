import pytest
import torch
from torch import nn

from plasticity_callbacks.models import GPT, GPTConfig
from plasticity_callbacks.models.optimizers import CombinedOptimizer
from plasticity_callbacks.ops.optimizer_state import reset_optimizer_state, zero_optimizer_state_slices
from plasticity_callbacks.model_map import Selection, require_targets, select_targets
from tiny import TinyCNNModule, TinyMLPModule, make_optimizer


def names(targets):
    return [t.name for t in targets]


def test_gpt_scopes_follow_declared_roles():
    model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, n_kv_head=2, mlp="swiglu"))
    attention = select_targets(model, Selection(scope="attention"))
    mlp = select_targets(model, Selection(scope="mlp"))
    assert {t.role for t in attention} == {"attention"} and len(attention) == 8
    assert {t.role for t in mlp} == {"mlp"} and len(mlp) == 6
    assert sorted(names(select_targets(model))) == sorted(names(attention) + names(mlp))
    assert "lm_head.weight" in names(select_targets(model, Selection(include_head=True)))


def test_include_and_exclude_patterns():
    model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, n_kv_head=2))
    only_first = select_targets(model, Selection(include=["blocks.0.*"]))
    assert only_first and all(n.startswith("blocks.0.") for n in names(only_first))
    no_proj = select_targets(model, Selection(exclude=["*.c_proj.weight"]))
    assert not any("c_proj" in n for n in names(no_proj))


def test_generic_models_skip_head_biases_and_norms():
    mlp = TinyMLPModule()
    assert names(select_targets(mlp)) == ["net.0.weight", "net.2.weight"]  # net.4 is the head
    cnn = TinyCNNModule()
    targets = select_targets(cnn)
    assert names(targets) == ["features.0.weight", "features.2.weight"] and {t.kind for t in targets} == {"conv"}
    assert names(select_targets(cnn, Selection(include_conv=False))) == []
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.MultiheadAttention(4, 2), nn.Linear(4, 2))
    got = {t.name: t.role for t in select_targets(model)}
    assert got == {"0.weight": "other", "2.in_proj_weight": "attention", "2.out_proj.weight": "attention"}


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="scope='mpl'"):
        select_targets(TinyMLPModule(), Selection(scope="mpl"))
    attention = Selection(scope="attention")
    with pytest.raises(ValueError, match="no weights selected"):
        require_targets(select_targets(TinyMLPModule(), attention), "FIREReinit", attention)


def _stepped(optimizer_name):
    module = TinyMLPModule(optimizer=optimizer_name)
    opt = make_optimizer(module, optimizer_name, 1e-2)
    for _ in range(2):
        opt.zero_grad()
        module(torch.randn(8, 8)).square().mean().backward()
        opt.step()
    return module, opt


def _state_of(opt, p):
    return {k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[p].items()}


@pytest.mark.parametrize("optimizer_name", ["adamw", "sgd", "muon"])
def test_reset_touches_exactly_the_chosen_parameters(optimizer_name):
    module, opt = _stepped(optimizer_name)
    chosen = [module.net[0].weight]
    others = [p for p in module.parameters() if p is not chosen[0]]
    before = {id(p): _state_of(opt, p) for p in others}
    assert reset_optimizer_state(opt, chosen) == 1
    assert chosen[0] not in opt.state or len(opt.state[chosen[0]]) == 0
    for p in others:
        for key, value in before[id(p)].items():
            assert torch.equal(torch.as_tensor(opt.state[p][key]), torch.as_tensor(value))
    opt.zero_grad()  # the optimizer restarts the reset parameter cleanly
    module(torch.randn(8, 8)).square().mean().backward()
    opt.step()
    if optimizer_name == "adamw":
        assert opt.state[chosen[0]]["step"] == 1


@pytest.mark.parametrize("optimizer_name", ["adamw", "sgd", "muon"])
def test_zero_slices_zeroes_rows_and_keeps_the_rest(optimizer_name):
    module, opt = _stepped(optimizer_name)
    w = module.net[0].weight
    before = _state_of(opt, w)
    rows = torch.zeros(w.shape[0], dtype=torch.bool)
    rows[[1, 5]] = True
    zero_optimizer_state_slices(opt, w, rows, dim=0)
    moments = [k for k, v in before.items() if torch.is_tensor(v) and v.shape == w.shape]
    assert moments
    for key in moments:
        assert opt.state[w][key][rows].abs().sum() == 0
        assert torch.equal(opt.state[w][key][~rows], before[key][~rows])
    if "step" in before:
        assert torch.equal(torch.as_tensor(opt.state[w]["step"]), torch.as_tensor(before["step"]))
    assert isinstance(opt, CombinedOptimizer) == (optimizer_name == "muon")


def test_select_targets_takes_a_selection_or_a_mapping_and_names_anything_else():
    model = TinyMLPModule()
    assert [t.name for t in select_targets(model, {"include": ["net.0.*"]})] == ["net.0.weight"]
    with pytest.raises(ValueError, match="select_targets selection='mlp' must be a Selection"):
        select_targets(model, "mlp")
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['scopes'\]"):
        select_targets(model, {"scopes": "mlp"})
