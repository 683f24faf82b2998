"""Weights a parametrization computes: each method acts through it or refuses that weight by name.

One model mixes plain layers with every kind PyTorch has (``parametrizations.weight_norm`` / ``spectral_norm`` /
``orthogonal`` and the legacy ``weight_norm`` / ``spectral_norm`` hooks). Effects are checked on the weight as the
layer's own forward computes it, against float64 references; the optimizer state against the tensors it trains.
Also: the model map is kept between calls and read again when the model changes.
"""
from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrizations, parametrize

from plasticity_callbacks.callbacks.adaptive_svd import AdaptiveSVDSwitch
from plasticity_callbacks.callbacks.weight_clip import WeightClip
from plasticity_callbacks.functional.isometry import FIREOptions
from plasticity_callbacks.model_map import Selection, declare_plasticity, find_neuron_layers, select_targets
from plasticity_callbacks.model_map.holding import parametrization
from plasticity_callbacks.ops.dash import dash_
from plasticity_callbacks.ops.fire import apply_fire

LEGACY = {"legacy_wn": torch.nn.utils.weight_norm, "legacy_sn": torch.nn.utils.spectral_norm}


class Mixed(nn.Module):
    """Plain, weight norm, spectral norm, orthogonal, legacy weight norm, legacy spectral norm, plain head."""

    def __init__(self):
        super().__init__()
        self.plain = nn.Linear(8, 12)
        self.wn = parametrizations.weight_norm(nn.Linear(12, 16))
        self.sn = parametrizations.spectral_norm(nn.Linear(16, 10))
        self.orth = parametrizations.orthogonal(nn.Linear(10, 10))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # the legacy API is deprecated, not gone: users have it
            self.legacy_wn = torch.nn.utils.weight_norm(nn.Linear(10, 14))
            self.legacy_sn = torch.nn.utils.spectral_norm(nn.Linear(14, 9))
        self.head = nn.Linear(9, 3)

    def forward(self, x):
        for layer in (self.plain, self.wn, self.sn, self.orth, self.legacy_wn, self.legacy_sn):
            x = torch.tanh(layer(x))
        return self.head(x)


def mixed(seed: int = 0) -> Mixed:
    torch.manual_seed(seed)
    model = Mixed()
    with torch.no_grad():  # rows of different norms: g is not one number, so the direction alone would not do
        model.wn.parametrizations.weight.original0.mul_(torch.linspace(0.5, 3.0, 16).unsqueeze(1))
        model.legacy_wn.weight_g.mul_(torch.linspace(0.5, 3.0, 14).unsqueeze(1))
    model(torch.randn(4, 8))  # legacy hooks set .weight, spectral norm runs its power iteration once
    return model


def effective(layer: nn.Linear, train: bool) -> torch.Tensor:
    """The weight as the layer's own forward computes it (train or eval mode), read off its output."""
    layer.train(train)
    eye = torch.eye(layer.in_features)
    with torch.no_grad():
        return (layer(eye) - layer(torch.zeros(1, layer.in_features))).T  # (out, in)


def polar(weight: torch.Tensor) -> torch.Tensor:
    u, _, vh = torch.linalg.svd(weight.double(), full_matrices=False)
    return u @ vh


def adam_state(model: nn.Module) -> torch.optim.Adam:
    optimizer = torch.optim.Adam(model.parameters(), lr=0.0)
    model(torch.randn(4, 8)).square().mean().backward()
    optimizer.step()
    return optimizer


def test_select_targets_sees_every_parametrized_weight_by_its_effective_name():
    model = mixed()
    kinds = {t.name: (t.through.kind if t.through else "", t.through.legacy if t.through else None)
             for t in select_targets(model)}
    assert kinds == {"plain.weight": ("", None), "wn.weight": ("weight norm", False),
                     "sn.weight": ("spectral norm", False), "orth.weight": ("orthogonal", False),
                     "legacy_wn.weight": ("weight norm", True), "legacy_sn.weight": ("spectral norm", True)}
    for t in select_targets(model):  # read is the effective weight, as the eval forward computes it
        torch.testing.assert_close(t.read(), effective(t.module, train=False))
    # a legacy hook is the user's parametrization too: ReDo and every "plain weight" check see it
    assert parametrization(model.legacy_wn, "weight") == "weight norm"


def test_fire_acts_through_weight_norm_and_spectral_norm_skips_orthogonal_by_name():
    model = mixed()
    before = {n: effective(getattr(model, n), train=False).double() for n in LEGACY | {"wn": 0, "sn": 0, "orth": 0,
                                                                                        "plain": 0}}
    optimizer = adam_state(model)
    with pytest.warns(UserWarning, match=r"apply_fire leaves alone orth\.weight \(orthogonal: already an isometry"):
        records = apply_fire(model, optimizer, FIREOptions(method="svd"))
    assert {r.name for r in records} == {"plain.weight", "wn.weight", "sn.weight", "legacy_wn.weight",
                                         "legacy_sn.weight"}
    for name in ("plain", "wn", "legacy_wn"):  # the effective weight is FIRE's: √(d_out/d_in)·polar(W), exactly
        layer = getattr(model, name)
        expected = math.sqrt(layer.out_features / layer.in_features) * polar(before[name])
        for train in (False, True):
            torch.testing.assert_close(effective(layer, train).double(), expected, atol=2e-5, rtol=0)
    for name in ("sn", "legacy_sn"):  # original/σ: the polar factor itself, largest singular value 1
        for train in (False, True):  # eval reads the stored u, v; train runs a power iteration first
            torch.testing.assert_close(effective(getattr(model, name), train).double(), polar(before[name]),
                                       atol=2e-5, rtol=0)
    torch.testing.assert_close(effective(model.orth, False).double(), before["orth"])
    # the optimizer state dropped is the originals', the tensors Adam steps; orthogonal's and the head's kept
    dropped = [model.plain.weight, *model.wn.parametrizations.weight.parameters(),
               model.sn.parametrizations.weight.original, model.legacy_wn.weight_g, model.legacy_wn.weight_v,
               model.legacy_sn.weight_orig]
    kept = [model.orth.parametrizations.weight.original, model.head.weight, model.plain.bias]
    assert all(p not in optimizer.state for p in dropped)
    assert all(p in optimizer.state for p in kept)


@pytest.mark.parametrize("legacy", [False, True])
def test_fire_on_weight_norm_writes_g_and_v_as_the_parametrization_reads_them(legacy):
    torch.manual_seed(1)
    layer = nn.Conv2d(3, 6, 3)  # a conv: FIRE's polar factor per tap, weight norm's norm over (in, kh, kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        (torch.nn.utils.weight_norm if legacy else parametrizations.weight_norm)(layer)
    model = nn.Sequential(layer, nn.Flatten(), nn.Linear(54, 2))
    model(torch.randn(1, 3, 5, 5))
    taps = layer.weight.detach().double().permute(2, 3, 0, 1)  # (kh, kw, out, in)
    plain = nn.Conv2d(3, 6, 3)  # the same weight stored plainly: FIRE's scale for a conv kernel is its own rule
    with torch.no_grad():
        plain.weight.copy_(layer.weight)
    (record,) = apply_fire(model, None, FIREOptions(method="svd"))
    (plain_record,) = apply_fire(nn.Sequential(plain, nn.Flatten(), nn.Linear(54, 2)), None, FIREOptions(method="svd"))
    assert record.scale == plain_record.scale
    expected = (record.scale * polar(taps)).permute(2, 3, 0, 1)  # one polar factor per tap, float64
    x = torch.randn(2, 3, 5, 5, dtype=torch.float64)
    torch.testing.assert_close(layer(x.float()).double(), F.conv2d(x, expected, layer.bias.double()), atol=1e-4,
                               rtol=0)


def test_a_model_whose_only_weight_is_orthogonal_is_refused_by_name_not_as_an_empty_selection():
    model = nn.Sequential(parametrizations.orthogonal(nn.Linear(6, 6)), nn.ReLU(), nn.Linear(6, 2))
    with pytest.raises(ValueError, match=r"every selected weight is computed by a parametrization .*0\.weight "
                                         r"\(orthogonal: already an isometry"):
        apply_fire(model, None, FIREOptions(method="svd"))
    only_wn = nn.Sequential(parametrizations.weight_norm(nn.Linear(6, 6)), nn.ReLU(), nn.Linear(6, 2))
    assert [r.name for r in apply_fire(only_wn, None, FIREOptions(method="svd"))] == ["0.weight"]


def test_dash_shrinks_weight_norm_rows_through_g_and_refuses_the_others_by_name():
    model = mixed()
    twin = mixed()  # the same model with the weight-norm weights stored plainly: they get their own gradients
    parametrize.remove_parametrizations(twin.wn, "weight", leave_parametrized=True)
    torch.nn.utils.remove_weight_norm(twin.legacy_wn)
    x = torch.randn(6, 8)
    for net in (model, twin):
        net(x).square().mean().backward()
    kept = {n: p.detach().clone() for n, p in model.named_parameters() if n.startswith(("sn.", "orth.", "legacy_sn."))}
    with pytest.warns(UserWarning) as caught:
        factors = dash_(model, min_factor=0.1)
    message = " ".join(str(w.message) for w in caught)
    for name in ("sn.weight (spectral norm:", "orth.weight (orthogonal:", "legacy_sn.weight (spectral norm:",
                 "remove_spectral_norm"):
        assert name in message, name
    assert "wn.weight" not in message.replace("legacy_sn.weight", "").replace("sn.weight", "")
    assert set(factors) == {"plain", "wn", "legacy_wn"}
    for name in ("plain", "wn", "legacy_wn"):  # float64: each row of the forward's weight times clamp(cos(−G, W))
        weight, grad = getattr(twin, name).weight.detach().double(), getattr(twin, name).weight.grad.double()
        cos = F.cosine_similarity(-grad, weight, dim=1).clamp(0.1, 1)
        torch.testing.assert_close(factors[name].double(), cos, atol=1e-5, rtol=0)
        for train in (False, True):
            torch.testing.assert_close(effective(getattr(model, name), train).double(), weight * cos[:, None],
                                       atol=1e-5, rtol=0)
    for name, value in kept.items():
        assert torch.equal(dict(model.named_parameters())[name], value), name
    only = nn.Sequential(parametrizations.spectral_norm(nn.Linear(6, 6)), nn.ReLU(), nn.Linear(6, 2))
    with pytest.raises(ValueError, match=r"0\.weight \(spectral norm: the forward divides"):
        dash_(only)


def test_adaptive_svd_refuses_parametrized_weights_by_name():
    model = mixed()
    with pytest.warns(UserWarning, match=r"AdaptiveSVDSwitch leaves alone wn\.weight \(weight norm: "
                                         r"AdaptiveSVDSwitch does not act through"):
        AdaptiveSVDSwitch().check_targets(None, model)
    only = nn.Sequential(parametrizations.weight_norm(nn.Linear(6, 6)), nn.ReLU(), nn.Linear(6, 2))
    with pytest.raises(ValueError, match=r"AdaptiveSVDSwitch: every selected weight .*0\.weight \(weight norm"):
        AdaptiveSVDSwitch().check_targets(None, only)


class Trainer:  # what WeightClip reads of a trainer between steps
    global_step = 1
    world_size = 1
    is_global_zero = True


def test_weight_clip_clips_the_weight_norm_weight_as_the_forward_computes_it_and_refuses_the_rest():
    model = mixed()
    with torch.no_grad():  # the case: the effective weight far outside its box
        model.wn.parametrizations.weight.original0.fill_(17.6)
        model.legacy_wn.weight_g.fill_(17.6)
    clip = WeightClip(kappa=1.0)
    kept = {n: p.detach().clone() for n, p in model.named_parameters() if n.startswith(("sn.", "orth.", "legacy_sn."))}
    with pytest.warns(UserWarning) as caught:
        clip.check_targets(Trainer(), model)
    message = " ".join(str(w.message) for w in caught)
    for name in ("sn.weight (spectral norm:", "orth.weight (orthogonal:", "legacy_sn.weight (spectral norm:"):
        assert name in message, name
    assert "wn.weight" not in message
    before = {n: effective(getattr(model, n), False).double() for n in ("wn", "legacy_wn")}
    clip.attach(Trainer(), model)
    clip._last_step = 0
    model.log = lambda *args, **kwargs: None
    clip.skip_nonfinite = lambda *args: False
    clip.on_train_batch_end(Trainer(), model, None, None, 0)
    for name, weight in before.items():  # the forward's weight: the float64 clamp of the one before
        bound = 1 / math.sqrt(getattr(model, name).in_features)
        assert weight.abs().max() > 10 * bound  # (it was far outside)
        for train in (False, True):
            torch.testing.assert_close(effective(getattr(model, name), train).double(), weight.clamp(-bound, bound),
                                       atol=1e-6, rtol=0)
    for name, value in kept.items():
        assert torch.equal(dict(model.named_parameters())[name], value), name


def test_redo_refuses_a_legacy_weight_norm_layer_by_name():
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model = nn.Sequential(torch.nn.utils.weight_norm(nn.Linear(4, 8)), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(),
                              nn.Linear(8, 2))
    with pytest.warns(UserWarning, match=r"leave alone the units of .*computed by a parametrization"):
        layers = find_neuron_layers(model)
    assert all(layer.up is not model[0] and layer.down is not model[0] for layer in layers)


# ------------------------------------------------------------------------------------------- the kept model map
def test_the_model_map_is_kept_and_read_again_when_the_model_changes():
    model = mixed()
    first = select_targets(model)
    again = select_targets(model)
    assert [id(t) for t in again] == [id(t) for t in first]  # the kept views, in a new list
    again.clear()
    assert len(select_targets(model)) == len(first)

    model.plain = nn.Linear(8, 12)  # a module replaced
    assert select_targets(model)[0].param is model.plain.weight
    model.plain.weight = nn.Parameter(torch.randn(12, 8))  # a parameter replaced
    assert select_targets(model)[0].param is model.plain.weight
    model.plain.weight.data = torch.randn(12, 8)  # same parameter, same shape: nothing to read again
    assert select_targets(model)[0] is select_targets(model)[0]
    parametrizations.weight_norm(model.plain)  # a parametrization registered
    assert select_targets(model)[0].through.kind == "weight norm"
    parametrize.remove_parametrizations(model.plain, "weight")
    assert select_targets(model)[0].through is None
    model.plain.weight.requires_grad_(False)  # frozen
    assert "plain.weight" not in [t.name for t in select_targets(model)]
    model.plain.weight.requires_grad_(True)
    assert select_targets(model, Selection(scope="mlp")) == []
    declare_plasticity(model, roles={"plain": "mlp"})  # a declaration
    assert [t.name for t in select_targets(model, Selection(scope="mlp"))] == ["plain.weight"]
    model.extra = nn.Linear(3, 3)  # a module added
    assert "extra.weight" in [t.name for t in select_targets(model, Selection(include_head=True))]


def test_fire_callback_at_setup_names_only_the_weight_it_skips():
    from plasticity_callbacks.callbacks.fire import FIREReinit
    with pytest.warns(UserWarning) as caught:
        FIREReinit().check_targets(Trainer(), mixed())
    message = " ".join(str(w.message) for w in caught)
    assert "orth.weight (orthogonal: already an isometry" in message
    assert "wn.weight" not in message and "sn.weight" not in message


def test_the_kept_model_map_keeps_no_model_alive():
    import gc
    import weakref
    model = mixed()
    select_targets(model)
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None



def test_a_kept_model_map_leaves_the_parameters_swappable():
    """``model.to()`` under swap-on-conversion (FSDP2's ``model_to_device``) swaps each parameter's tensor in
    place, which torch refuses for a tensor with a weak reference: the kept map must hold none."""
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    select_targets(model)
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.to(torch.float64)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    assert all(p.dtype == torch.float64 for p in model.parameters())
    assert {v.param.dtype for v in select_targets(model)} == {torch.float64}  # the map read again, not kept

class Symmetric(nn.Module):
    """A user's own parametrization: no method knows what value of its original gives a wanted weight."""

    def forward(self, weight):
        return weight.triu() + weight.triu(1).T


def test_a_users_own_parametrization_or_a_chain_is_refused_by_name_and_left_as_it_is():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2))
    parametrize.register_parametrization(model[2], "weight", Symmetric())
    parametrizations.weight_norm(model[0])
    parametrize.register_parametrization(model[0], "weight", Symmetric())  # a chain: weight norm, then Symmetric
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"0\.weight \(weight norm \+ Symmetric: apply_fire does not act through a "
                                         r"weight norm \+ Symmetric parametrization.*2\.weight \(Symmetric"):
        apply_fire(model, None, FIREOptions(method="svd"))
    for name, value in model.named_parameters():
        assert torch.equal(value, before[name]), name
