"""Methods that are settings of the run (``l2``, ``ln_wd``: a ``model:`` block) and the isometric control
(``isometric_reset``): the digits classifier's norm and weight decay against hand computations, a method
file's block reaching the composed config, the built model and its optimizer, and the control's weights
after a boundary against the scaled polar factor of the fresh draw."""
import math

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from hydra_app import compose_config
from omegaconf import OmegaConf
from torch import nn

pytest.importorskip("sklearn")

from plasticity_callbacks.app.methods import sensitivity, task_stream_callbacks, with_method_settings  # noqa: E402
from plasticity_callbacks.app.pipeline import build_phases, instantiate_callbacks, resolve_method  # noqa: E402
from plasticity_callbacks.app.train import build_module, fit, with_stream_method  # noqa: E402
from plasticity_callbacks.data.digits import RandomLabelDigits  # noqa: E402
from plasticity_callbacks.errors import ConfigError  # noqa: E402
from plasticity_callbacks.models.classifier import DigitsClassifier  # noqa: E402


def randomize_norms(module: nn.Module) -> None:
    """Gains and biases away from 1 and 0, so a forward that skipped them would differ."""
    with torch.no_grad():
        for layer in module.modules():
            if isinstance(layer, (nn.LayerNorm, nn.GroupNorm)):
                layer.weight.uniform_(0.5, 1.5)
                layer.bias.normal_()


def hand_layer_norm(h: torch.Tensor, gain: torch.Tensor, bias: torch.Tensor, dims) -> torch.Tensor:
    mean = h.mean(dim=dims, keepdim=True)
    var = ((h - mean) ** 2).mean(dim=dims, keepdim=True)  # biased, as layer norm uses
    return (h - mean) / torch.sqrt(var + 1e-5) * gain + bias


def test_mlp_layer_norm_normalizes_each_layers_hidden_units_before_the_relu():
    torch.manual_seed(0)
    module = DigitsClassifier("mlp", widths=[12, 7], norm="layer")
    randomize_norms(module)
    linears = [m for m in module.network if isinstance(m, nn.Linear)]
    norms = [m for m in module.network if isinstance(m, nn.LayerNorm)]
    assert len(linears) == 3 and len(norms) == 2  # none on the output
    x = torch.randn(5, 64)
    h = x
    for linear, norm in zip(linears[:-1], norms):
        h = torch.relu(hand_layer_norm(h @ linear.weight.T + linear.bias, norm.weight, norm.bias, dims=1))
    expected = h @ linears[-1].weight.T + linears[-1].bias
    torch.testing.assert_close(module(x), expected, rtol=1e-5, atol=1e-5)
    assert not any(isinstance(m, nn.LayerNorm) for m in DigitsClassifier("mlp", widths=[12, 7]).modules())


def test_cnn_layer_norm_normalizes_each_images_feature_map_and_the_hidden_layer():
    torch.manual_seed(0)
    module = DigitsClassifier("cnn", channels=[3, 4], hidden=6, norm="layer")
    randomize_norms(module)
    conv1, conv2 = [m for m in module.network if isinstance(m, nn.Conv2d)]
    gn1, gn2 = [m for m in module.network if isinstance(m, nn.GroupNorm)]
    (ln,) = [m for m in module.network if isinstance(m, nn.LayerNorm)]
    hidden, head = [m for m in module.network if isinstance(m, nn.Linear)]
    x = torch.randn(5, 64)
    per_channel = (slice(None), None, None)  # a channel's gain over its positions
    h = x.view(5, 1, 8, 8)
    h = torch.relu(hand_layer_norm(F.conv2d(h, conv1.weight, conv1.bias, padding=1),
                                   gn1.weight[per_channel], gn1.bias[per_channel], dims=(1, 2, 3)))
    h = torch.relu(hand_layer_norm(F.conv2d(h, conv2.weight, conv2.bias, padding=1),
                                   gn2.weight[per_channel], gn2.bias[per_channel], dims=(1, 2, 3)))
    h = F.max_pool2d(h, 2).flatten(1)
    h = torch.relu(hand_layer_norm(h @ hidden.weight.T + hidden.bias, ln.weight, ln.bias, dims=1))
    torch.testing.assert_close(module(x), h @ head.weight.T + head.bias, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kwargs, message", [
    ({"norm": "group"}, r"model.norm='group' is not one of \('none', 'layer', 'batch'\)"),
    ({"weight_decay": -1e-3}, r"model.weight_decay=-0.001 must be a number >= 0"),
    ({"weight_decay": True}, r"model.weight_decay=True must be a number >= 0"),
])
def test_bad_norm_or_weight_decay_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DigitsClassifier("mlp", widths=[4], **kwargs)


def test_weight_decay_reaches_adam_as_the_coupled_l2_penalty():
    torch.manual_seed(0)
    module = DigitsClassifier("mlp", widths=[6], norm="layer", weight_decay=0.05, lr=0.01)
    optimizer = module.configure_optimizers()
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.05]
    assert {id(p) for g in optimizer.param_groups for p in g["params"]} == {id(p) for p in module.parameters()}
    # One step with a zero loss gradient: the only gradient is the penalty's, 0.05·θ, and Adam's first step
    # moves each entry by lr·g/(|g| + eps) (bias-corrected m and v). AdamW's decay would give θ(1 - lr·0.05).
    before = [p.detach().clone() for p in module.parameters()]
    optimizer.zero_grad()
    (0.0 * sum(p.sum() for p in module.parameters())).backward()
    optimizer.step()
    for p, p0 in zip(module.parameters(), before):
        g = 0.05 * p0
        torch.testing.assert_close(p.detach(), p0 - 0.01 * g / (g.abs() + 1e-8), rtol=1e-5, atol=1e-7)


def stream_cfg(method: str, *overrides: str):
    return compose_config("experiment=continual_digits", f"+method={method}", *overrides)


@pytest.mark.parametrize("method, norm, weight_decay", [("l2", "none", 1e-3), ("ln_wd", "layer", 1e-3),
                                                        ("warm", "none", 0.0)])
def test_a_method_files_model_block_reaches_the_config_the_model_and_its_optimizer(method, norm, weight_decay):
    cfg = with_stream_method(stream_cfg(method, "model.widths=[8,8]"))
    assert (cfg.model.norm, cfg.model.weight_decay, list(cfg.model.widths)) == (norm, weight_decay, [8, 8])
    module = build_module(cfg)
    assert any(isinstance(m, nn.LayerNorm) for m in module.modules()) == (norm == "layer")
    assert [g["weight_decay"] for g in module.configure_optimizers().param_groups] == [weight_decay]


def test_the_sensitivity_sweeps_setting_reaches_the_model():
    cfg = stream_cfg("l2")
    key, values = sensitivity(cfg.method)
    assert key == "model.weight_decay" and 1e-3 in values
    swept = with_stream_method(stream_cfg("l2", f"method.{key}={values[0]}"))
    assert swept.model.weight_decay == values[0]


def test_a_task_stream_fit_trains_the_model_the_method_sets(tmp_path):
    tiny = ["data.num_tasks=2", "data.steps_per_task=2", "data.samples_per_task=64", "data.batch_size=16",
            "model.widths=[8,8]", "callbacks.task_metrics.probe_steps=1", "trainer.log_every_n_steps=2",
            "logger=csv"]
    summary = fit(compose_config("experiment=continual_digits", "+method=ln_wd", *tiny, output_dir=tmp_path))
    plain = sum(p.numel() for p in DigitsClassifier("mlp", widths=[8, 8]).parameters())
    assert summary["parameters"] == plain + 2 * (8 + 8)  # a gain and a bias per hidden unit
    assert summary["steps"] == 4


def test_optimizer_block_merges_onto_every_pipeline_phase_last():
    cfg = compose_config("experiment=pipeline_smoke", "+phases.sft.optimizer.weight_decay=0.3")
    method = OmegaConf.create({"name": "decay", "optimizer": {"weight_decay": 0.05}})
    merged = with_method_settings(cfg, method)
    assert merged.optimizer.weight_decay == 0.05 and cfg.optimizer.weight_decay == 0.0  # a copy
    assert [p.optimizer["weight_decay"] for p in build_phases(merged, method)] == [0.05, 0.05]


@pytest.mark.parametrize("block, message", [
    ({"model": {"weigth_decay": 1e-3}}, r"sets model.weigth_decay, which the run's model config does not have; "
                                        r"its keys: \['_target_', 'architecture', .*'weight_decay'"),
    ({"optimizer": {"weight_decay": 1e-3}}, r"sets optimizer: \{'weight_decay': 0.001\}, but the model "
                                            r"\(.*DigitsClassifier\) builds its own optimizer.*under model:"),
])
def test_a_setting_the_run_cannot_take_is_refused_by_name(block, message):
    with pytest.raises(ConfigError, match=message):
        with_method_settings(stream_cfg("warm"), OmegaConf.create({"name": "bad", **block}))


# ------------------------------------------------------------------------------ isometric_reset


class AtBoundary(L.Callback):
    """Listed last: the parameters at the first step of task 2, after every method's batch-start hook."""

    def __init__(self, step: int):
        self.step, self.params = step, None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step == self.step:
            self.params = {n: p.detach().clone() for n, p in pl_module.named_parameters()}


def weights_after_boundary(method: str, lr: float) -> dict[str, torch.Tensor]:
    steps = 4
    callbacks = instantiate_callbacks(task_stream_callbacks(resolve_method(stream_cfg(method, "seed=3"))))
    capture = AtBoundary(steps)
    stream = RandomLabelDigits(num_tasks=2, steps_per_task=steps, batch_size=32, samples_per_task=128, seed=0)
    L.seed_everything(0)
    L.Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False, callbacks=[*callbacks, capture]).fit(
        DigitsClassifier(widths=[24, 40], lr=lr), datamodule=stream)
    return capture.params


def test_isometric_reset_is_the_scaled_polar_factor_of_a_fresh_draw_whatever_was_trained():
    slow, fast = weights_after_boundary("isometric_reset", 1e-3), weights_after_boundary("isometric_reset", 3e-2)
    fresh = weights_after_boundary("reset", 1e-3)  # the same draw (seed, step), before FIRE
    trained = weights_after_boundary("warm", 3e-2)
    for name in slow:
        torch.testing.assert_close(slow[name], fast[name], rtol=0, atol=0, msg=name)  # nothing kept from training
        assert not torch.equal(slow[name], trained[name]), name
    for name in ("network.0.weight", "network.2.weight"):  # 64→24, 24→40: one isometry per block, up to scale
        d_out, d_in = fresh[name].shape
        u, _, vh = torch.linalg.svd(fresh[name].double(), full_matrices=False)
        expected = math.sqrt(d_out / d_in) * (u @ vh)
        torch.testing.assert_close(slow[name].double(), expected, rtol=1e-5, atol=1e-6, msg=name)
        singular = torch.linalg.svdvals(slow[name].double())
        torch.testing.assert_close(singular, torch.full_like(singular, math.sqrt(d_out / d_in)), rtol=1e-5, atol=1e-6)
    for name in ("network.4.weight", "network.4.bias", "network.0.bias", "network.2.bias"):  # head and biases: fresh
        torch.testing.assert_close(slow[name], fresh[name], rtol=0, atol=0, msg=name)
