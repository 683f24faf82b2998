"""``plasticity_callbacks.ops``: the one-call methods a plain loop uses, each checked against an independent
computation on fresh random inputs, and importable without Lightning."""
from __future__ import annotations

import copy
import math
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from plasticity_callbacks.model_map import Selection, find_neuron_layers
from plasticity_callbacks.ops import ActivationStats, dash_, fire_, fresh_values, redo_, shrink_perturb_

from model_zoo import SEQ, VOCAB, llama


def _mlp(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 12), nn.ReLU(), nn.Linear(12, 3))


def _adam_step(model: nn.Module, seed: int) -> torch.optim.Optimizer:
    """An AdamW with state for every parameter (one step on a random batch)."""
    g = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(16, model[0].in_features, generator=g)
    model(x).square().mean().backward()
    optimizer.step()
    return optimizer


@pytest.mark.cli
def test_ops_and_the_layers_below_import_and_run_without_lightning():
    """Lightning blocked in a fresh interpreter: the ops, the math, the model map and the distributed helpers
    still import, and every one-call method runs on a plain module."""
    script = textwrap.dedent("""
        import sys
        for name in ("lightning", "lightning.pytorch", "lightning.fabric", "pytorch_lightning", "lightning_fabric"):
            sys.modules[name] = None  # any import of them raises ImportError
        import torch
        from torch import nn
        import plasticity_callbacks.functional, plasticity_callbacks.model_map
        import plasticity_callbacks.distributed.strategy, plasticity_callbacks.distributed.sharding
        import plasticity_callbacks.distributed.sharded_fire
        import plasticity_callbacks.distributed.sharded_state, plasticity_callbacks.distributed.sharded_subspace
        from plasticity_callbacks.ops import ActivationStats, dash_, fire_, redo_, shrink_perturb_
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        opt = torch.optim.AdamW(model.parameters())
        with ActivationStats(model) as stats:
            model(torch.randn(32, 8)).square().mean().backward()
        dash_(model, opt)
        opt.step()
        fire_(model, opt)
        redo_(model, opt, stats, tau=0.1)
        shrink_perturb_(model, opt, 0.5, 0.1, seed=1)
        loaded = sorted(m for m in sys.modules if "lightning" in m and sys.modules[m] is not None)
        print("OK", loaded)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "OK []" in done.stdout
    # Lightning installed: importing these layers does not load it either (no fallback hides a module-level import)
    light = ("import sys, plasticity_callbacks.ops, plasticity_callbacks.model_map, plasticity_callbacks.functional, "
             "plasticity_callbacks.distributed.strategy; print(sorted(m for m in sys.modules if 'lightning' in m))")
    done = subprocess.run([sys.executable, "-c", light], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr[-3000:]


def test_fire_gives_each_hidden_weight_the_scaled_float64_polar_factor_and_drops_only_their_moments():
    model = _mlp(seed=1)
    optimizer = _adam_step(model, seed=2)
    before = copy.deepcopy(model)
    records = fire_(model, optimizer)
    assert sorted(r.name for r in records if r.skipped is None) == ["0.weight", "2.weight"]
    for index in (0, 2):
        W = before[index].weight.detach().double()
        U, _, Vh = torch.linalg.svd(W, full_matrices=False)
        expected = math.sqrt(W.shape[0] / W.shape[1]) * (U @ Vh)
        got = model[index].weight.detach().double()
        assert torch.linalg.matrix_norm(got - expected) <= 1e-3 * torch.linalg.matrix_norm(expected)
        assert model[index].weight not in optimizer.state  # moments of the changed weight: gone
        assert model[index].bias in optimizer.state  # the bias was not changed: its moments stay
    assert torch.equal(model[4].weight, before[4].weight) and model[4].weight in optimizer.state  # the head


@pytest.mark.parametrize("shrink, perturb", [(0.4, 0.1), (0.0, 1.0)])
def test_shrink_perturb_is_the_linear_mix_of_the_old_weights_and_the_models_own_fresh_draw(shrink, perturb):
    """On a Hugging Face Llama: θ ← λθ + p·θ_fresh with θ_fresh the model's own init (``_init_weights``) for the
    seed; only the selected parameters move, and with ``reset_optimizer`` only their state is dropped."""
    model = llama()
    old = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for p in model.parameters():
        optimizer.state[p]["momentum_buffer"] = torch.ones_like(p)
    selection = Selection(include=["*.mlp.*"])
    chosen = [n for n in old if ".mlp." in n]
    fresh = fresh_values(model, chosen, seed=7)
    done = shrink_perturb_(model, optimizer, shrink, perturb, selection, seed=7, reset_optimizer=True)
    assert done["parameters"] == len(chosen) == 6
    for name, param in model.named_parameters():
        if name in chosen:
            assert torch.allclose(param, shrink * old[name] + perturb * fresh[name], atol=1e-7)
            assert not torch.allclose(fresh[name], old[name])  # a new draw, not a copy
            assert param not in optimizer.state
        else:
            assert torch.equal(param, old[name]) and param in optimizer.state
    # the fresh draw follows the model's init (HF: N(0, initializer_range)), not a guess
    std = torch.cat([fresh[n].flatten() for n in chosen]).std()
    assert abs(float(std) - model.config.initializer_range) < 0.2 * model.config.initializer_range


def test_fresh_values_of_a_parameter_no_init_reaches_is_an_error_naming_it():
    model = nn.Sequential(nn.Linear(4, 4))
    model.register_parameter("temperature", nn.Parameter(torch.ones(1)))
    with pytest.raises(RuntimeError, match=r"no init code draws a fresh value for \['temperature'\].*exclude"):
        fresh_values(model, ["0.weight", "temperature"], seed=0)


def test_dash_scales_each_row_by_its_clamped_cosine_with_the_negative_gradient():
    """A hand-made layer: rows aligned with, against and orthogonal to the descent direction."""
    g = torch.Generator().manual_seed(3)
    model = nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 2))
    with torch.no_grad():
        model[0].weight.copy_(torch.randn(6, 5, generator=g))
        model[0].bias.copy_(torch.randn(6, generator=g))
    grad = torch.randn(6, 5, generator=g)
    grad[0] = -model[0].weight[0].detach()  # descent direction == row 0: cos 1, untouched
    grad[1] = model[0].weight[1].detach()  # against it: cos -1, clamped to min_factor
    model[0].weight.grad, model[0].bias.grad = grad, torch.randn(6, generator=g)
    W, b = model[0].weight.detach().double().clone(), model[0].bias.detach().double().clone()
    head = model[2].weight.detach().clone()
    factors = dash_(model, min_factor=0.3)
    expected = F.cosine_similarity(-grad.double(), W, dim=1).clamp(0.3, 1.0)
    assert expected[0] == pytest.approx(1.0) and expected[1] == pytest.approx(0.3)
    assert torch.allclose(factors["0"].double(), expected, atol=1e-6)
    assert torch.allclose(model[0].weight.double(), W * expected[:, None], atol=1e-6)
    bias_factor = F.cosine_similarity(-model[0].bias.grad.double(), b, dim=0).clamp(0.3, 1.0)
    assert torch.allclose(model[0].bias.double(), b * bias_factor, atol=1e-6)
    assert torch.equal(model[2].weight, head)  # the head is not selected by default


def test_dash_without_gradients_warns_instead_of_doing_nothing_silently():
    model = _mlp(seed=0)
    before = copy.deepcopy(model)
    with pytest.warns(UserWarning, match="no selected weight had a gradient"):
        assert dash_(model) == {}
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before.parameters()))


def test_redo_recycles_exactly_the_dead_units_of_a_hand_built_network():
    """Units 1 and 4 of the first layer can never fire (bias -100); after a few training-mode forwards
    ``redo_`` gives them fresh incoming rows, zero biases and zero outgoing columns, zeroes exactly those
    slices' moments and leaves every other weight bit-identical."""
    model = _mlp(seed=4)
    with torch.no_grad():
        model[0].bias[[1, 4]] = -100.0
    optimizer = _adam_step(model, seed=5)
    assert [layer.name for layer in ActivationStats(model).layers] == ["0", "2"]
    first = find_neuron_layers(model)[:1]  # the second layer may have dead units of its own: not watched here
    with ActivationStats(model, layers=first) as stats:
        for seed in range(3):
            model(torch.randn(32, 8, generator=torch.Generator().manual_seed(seed)))
        model.eval()
        model(torch.full((4, 8), 1e6))  # an eval-mode forward is not counted
        model.train()
    model(torch.randn(4, 8))  # after the block: the hooks are gone
    before = copy.deepcopy(model)
    moments = {p: optimizer.state[p]["exp_avg"].clone() for p in model.parameters()}
    counts = redo_(model, optimizer, stats, tau=0.0)
    dead = torch.zeros(16, dtype=torch.bool)
    dead[[1, 4]] = True
    assert int(counts["0"]) == 2
    up, down = model[0], model[2]
    assert not torch.equal(up.weight[dead], before[0].weight[dead])  # fresh rows
    assert torch.equal(up.weight[~dead], before[0].weight[~dead])
    assert torch.all(up.bias[dead] == 0) and torch.equal(up.bias[~dead], before[0].bias[~dead])
    assert torch.all(down.weight[:, dead] == 0) and torch.equal(down.weight[:, ~dead], before[2].weight[:, ~dead])
    assert torch.all(optimizer.state[up.weight]["exp_avg"][dead] == 0)
    assert torch.equal(optimizer.state[up.weight]["exp_avg"][~dead], moments[up.weight][~dead])
    assert torch.equal(model[4].weight, before[4].weight)  # the head: never recycled
    recycled = stats.scores()["0"]  # a recycled neuron's statistics start over
    assert torch.isnan(recycled[dead]).all() and torch.isfinite(recycled[~dead]).all()


def test_activation_stats_read_the_gated_mlp_of_a_hugging_face_llama():
    """What enters ``down_proj`` is ``act(gate x) * up x``: the mean |h| per unit matches the model's own
    forward, read independently with a hook on ``down_proj``."""
    model = llama()
    ids = torch.randint(1, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(6))
    seen = []
    handle = model.model.layers[0].mlp.down_proj.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach()))
    with ActivationStats(model) as stats:
        model(input_ids=ids)
    handle.remove()
    layer_names = [layer.name for layer in stats.layers]
    assert len(layer_names) == 2 and all("mlp" in n for n in layer_names)
    [h] = seen  # the batch's forward only: the model map's probes run unseen
    mean_abs = h.abs().mean(dim=(0, 1))
    expected = mean_abs / (mean_abs.mean() + 1e-9)
    assert torch.allclose(stats.scores()[layer_names[0]], expected, atol=1e-5)


class _Uncopyable:
    """Stands for what a training hook may hold: a trainer and its DDP wrapper, which cannot be deep-copied."""

    def __deepcopy__(self, memo):
        raise TypeError("this object cannot be copied")

    def __call__(self, module, args):
        return None


def test_fresh_values_ignore_the_hooks_a_training_callback_left_on_the_model():
    """A callback's forward hook (ContinualBackprop's collector holds the trainer) must not be copied along with
    the model whose init draws the fresh values (it made Shrink & Perturb fail under DDP)."""
    model = _mlp(seed=8)
    model[2].register_forward_pre_hook(_Uncopyable())
    model.register_forward_hook(lambda *args: None)
    fresh = fresh_values(model, ["0.weight", "2.weight"], seed=3)
    torch.manual_seed(3)  # each Linear's own reset_parameters, in order, from the seed
    reference = _mlp(seed=3)
    assert torch.equal(fresh["0.weight"], reference[0].weight) and torch.equal(fresh["2.weight"], reference[2].weight)
    assert len(model[2]._forward_pre_hooks) == 1  # the model keeps its hooks
