"""DASH's own regime (experiment=dash_regime, docs/dash_regime.md): the shrink on BatchNorm nets against a
re-derivation of the authors' loop (baekrok/DASH-Direction-Aware-SHrinking, utils/train_utils.py ``dash``), the
accumulating stages, the experiment composed and run for a few steps, and the model's argument checks."""
import copy
import importlib.util
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from helpers import metric_rows
from hydra_app import compose_config
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

pytest.importorskip("sklearn")

from plasticity_callbacks.app.methods import task_stream_callbacks  # noqa: E402
from plasticity_callbacks.app.pipeline import instantiate_callbacks, resolve_method  # noqa: E402
from plasticity_callbacks.app.train import build_module, fit, with_stream_method  # noqa: E402
from plasticity_callbacks.functional.shrink import dash_shrink_factors  # noqa: E402
from plasticity_callbacks.models.classifier import DigitsClassifier  # noqa: E402
from tiny import cpu_trainer  # noqa: E402

BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "dash_regime.py"


def authors_dash_(model: nn.Module, loader, alpha: float, lam: float) -> torch.Tensor:
    """The authors' DASH, re-derived: on a copy left in the model's mode (their pass follows an evaluation),
    ``G ← (1 − α)G + α(−grad)`` per Linear/conv weight and bias over the loader; then every Linear weight row,
    every conv (out, in) kernel slice, and every bias vector as a whole, times ``clamp(cos(G, W), λ, 1)``.
    Returns the weights' factors, flattened."""
    copy_ = copy.deepcopy(model)
    layers = [(m, c) for m, c in zip(model.modules(), copy_.modules()) if isinstance(m, (nn.Linear, nn.Conv2d))]
    ema = {id(m): [torch.zeros_like(m.weight), torch.zeros_like(m.bias)] for m, _ in layers}
    for x, y in loader:
        copy_.zero_grad()
        F.cross_entropy(copy_(x), y).backward()
        for m, c in layers:
            for i, p in enumerate((c.weight, c.bias)):
                ema[id(m)][i] = (1 - alpha) * ema[id(m)][i] + alpha * (-p.grad)
    factors = []
    with torch.no_grad():
        for m, _ in layers:
            g_weight, g_bias = ema[id(m)]
            cos = F.cosine_similarity(g_weight.flatten(2) if m.weight.dim() == 4 else g_weight,
                                      m.weight.flatten(2) if m.weight.dim() == 4 else m.weight, dim=-1)
            scale = cos.clamp(lam, 1)
            m.weight.mul_(scale.reshape(scale.shape + (1,) * (m.weight.dim() - scale.dim())))
            m.bias.mul_(F.cosine_similarity(g_bias[None], m.bias[None]).clamp(lam, 1))
            factors.append(scale.flatten())
    return torch.cat(factors)


def fresh_digits(n: int = 96, seed: int = 1) -> TensorDataset:
    """Random 64-pixel inputs and labels, drawn for this test (no digit, no data the model saw elsewhere)."""
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 64, generator=g), torch.randint(0, 10, (n,), generator=g))


def trained_bn_model(architecture: str, data: TensorDataset) -> DigitsClassifier:
    """A small BatchNorm classifier after 20 SGD steps on ``data`` (from a fresh init the rows point nowhere in
    particular and every factor is λ; trained, they share directions with the gradient and the factors spread
    over [λ, 1]), in eval mode, its running statistics moved off the batches' so that the mode shows."""
    torch.manual_seed(0)
    module = DigitsClassifier(architecture, widths=[32, 32], channels=[4, 8], hidden=16, lr=0.05, norm="batch",
                              optimizer="sgd", momentum=0.9)
    optimizer = module.configure_optimizers()
    for _ in range(20):
        optimizer.zero_grad()
        F.cross_entropy(module(data.tensors[0]), data.tensors[1]).backward()
        optimizer.step()
    with torch.no_grad():
        for bn in module.modules():
            if isinstance(bn, nn.modules.batchnorm._BatchNorm):
                bn.running_mean.add_(torch.rand_like(bn.running_mean) - 0.5)
                bn.running_var.mul_(torch.rand_like(bn.running_var) + 0.5)
    return module.eval()


def first_layer(model: nn.Module) -> nn.Module:
    return next(m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d)))


class AfterShrink(L.Callback):
    """After DASHShrink at fit start: the parameters and the BatchNorm statistics it left."""

    def on_train_start(self, trainer, pl_module):
        self.params = {n: p.detach().clone() for n, p in pl_module.named_parameters()}
        self.buffers = {n: b.clone() for n, b in pl_module.named_buffers()}


@pytest.mark.filterwarnings("ignore:.*eval mode")
@pytest.mark.parametrize("architecture", ["mlp", "cnn"])
def test_the_regimes_dash_shrinks_a_batchnorm_net_as_the_authors_loop_does(architecture):
    data = fresh_digits()
    module = trained_bn_model(architecture, data)
    loader = DataLoader(data, batch_size=32)  # 3 batches, all read by the pass
    expected = copy.deepcopy(module)
    factors = authors_dash_(expected, loader, alpha=0.3, lam=0.3)
    assert (factors == 0.3).any() and ((factors > 0.3) & (factors < 1)).any()  # both sides of λ occur
    # the callback as the method file configures it (the whole loader: n_batches null, as the authors' pass)
    cfg = compose_config("experiment=dash_regime", "+method=dash", "method.carry_optimizer=true")
    (dash,) = instantiate_callbacks(cfg.method.callbacks)
    assert dash.n_batches is None and dash.gradient_mode == "eval"
    before = {n: b.clone() for n, b in module.named_buffers()}
    after = AfterShrink()
    cpu_trainer(max_steps=1, callbacks=[dash, after]).fit(module.train(), loader)
    for (name, want), got in zip(expected.named_parameters(), after.params.values()):
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6, msg=name)
    assert all(torch.equal(after.buffers[n], b) for n, b in before.items())  # the pass moves no statistic
    # a pass in train mode (batch statistics) gives other factors: the mode the test pins matters
    in_train_mode = trained_bn_model(architecture, data).train()
    authors_dash_(in_train_mode, loader, alpha=0.3, lam=0.3)
    assert not torch.allclose(first_layer(in_train_mode).weight, first_layer(expected).weight, atol=1e-4)


@pytest.mark.parametrize("shape", [(7, 5), (4, 3, 3, 3), (6,)])
def test_our_factor_rule_is_the_authors_clamped_cosine(shape):
    g = torch.Generator().manual_seed(2)
    weight, direction = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    if len(shape) == 1:
        authors = F.cosine_similarity(direction[None], weight[None]).clamp(0.3, 1)[0]
    else:
        authors = F.cosine_similarity(direction.flatten(2) if len(shape) == 4 else direction,
                                      weight.flatten(2) if len(shape) == 4 else weight, dim=-1).clamp(0.3, 1)
    torch.testing.assert_close(dash_shrink_factors(weight, direction, 0.3), authors)


def test_the_stages_accumulate_on_one_held_out_split():
    stream = instantiate(compose_config("experiment=dash_regime").data, _convert_="all")
    assert stream.fractions == pytest.approx([k / 10 for k in range(1, 11)]) and stream.steps_per_task == 400
    stream.load_data()
    held = {tuple(row.tolist()) for row in stream.task(0).eval_x}
    previous: list[tuple] = []
    for k in range(stream.num_tasks):
        task = stream.task(k)
        rows = [tuple(row.tolist()) for row in task.train_x]
        assert rows[:len(previous)] == previous and len(rows) > len(previous)  # all of stage k-1, plus new
        assert not held & set(rows) and torch.equal(task.eval_x, stream.task(0).eval_x)
        previous = rows
    assert len(previous) == len(stream.labels) - len(held)  # the last stage is the whole training split


def benchmark_runs() -> dict:
    spec = importlib.util.spec_from_file_location("dash_regime_benchmark", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.RUNS


@pytest.mark.parametrize("row", list(benchmark_runs()))
def test_each_benchmark_row_composes_the_regime(row):
    method, overrides = benchmark_runs()[row]
    cfg = with_stream_method(compose_config("experiment=dash_regime", f"+method={method}", *overrides))
    module = build_module(cfg)
    optimizer = module.configure_optimizers()
    assert isinstance(optimizer, torch.optim.SGD) and optimizer.defaults["momentum"] == 0.9
    assert sum(isinstance(m, nn.BatchNorm1d) for m in module.modules()) == 2
    callbacks = task_stream_callbacks(resolve_method(cfg))
    assert ("fresh_optimizer_state" in callbacks) == (method in ("reset", "sp"))  # DASH keeps its momentum
    if method == "dash":
        assert callbacks.dash.n_batches == 11 and callbacks.dash.schedule.at_task_boundaries
        assert callbacks.dash.min_factor == (0.5 if "0.5" in row else 0.3)


def test_a_few_steps_of_the_regime_run_and_dash_acts_at_each_stage(tmp_path):
    cfg = compose_config("experiment=dash_regime", "+method=dash", "method.carry_optimizer=true",
                         "data.steps_per_task=3", "data.fractions=[0.1,0.2,0.3]", "model.widths=[16,16]",
                         "method.task_stream.dash.n_batches=2", output_dir=tmp_path)
    fit(cfg)
    assert len(metric_rows(tmp_path / "logs" / "tasks.csv")) == 3
    shrinks = [float(row["dash/shrinks"]) for row in metric_rows(tmp_path) if row["dash/shrinks"]]
    assert shrinks == [1.0, 2.0]  # at the two stage boundaries


@pytest.mark.parametrize("kwargs, message", [
    ({"norm": "batchnorm"}, r"model.norm='batchnorm' is not one of \('none', 'layer', 'batch'\)"),
    ({"optimizer": "adamw"}, r"model.optimizer='adamw' is not one of \('adam', 'sgd'\)"),
    ({"optimizer": "sgd", "momentum": 1.0}, r"model.momentum=1.0 must be a number in \[0, 1\)"),
    ({"momentum": 0.9}, r"model.momentum=0.9 is SGD's; with model.optimizer='adam'"),
])
def test_bad_norm_optimizer_or_momentum_is_refused_naming_the_allowed_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DigitsClassifier("mlp", widths=[4], **kwargs)
