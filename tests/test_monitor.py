"""PlasticityMonitor: every metric against a direct float64 computation on the same activations and weights, on
an MLP, a CNN, the package GPT and a Hugging Face Llama; the pure functions against SVD; resume; bad input."""
from __future__ import annotations

import math

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import model_zoo
from plasticity_callbacks import PlasticityMonitor
from plasticity_callbacks.functional import diagnostics as D
from plasticity_callbacks.functional.spectral import deviation_from_isometry
from tiny import (TinyCNNModule, TinyMLPModule, cpu_trainer, image_loader, regression_loader, tiny_gpt_module,
                  token_loader)

TAU = 0.1


class Reference(L.Callback):
    """Records, independently of the monitor, what the measured step saw: the inputs of the hand-named ``down``
    modules (a forward pre-hook of its own), the gradients, and the weights before and after the update."""

    def __init__(self, downs, measured_step: int):
        self.downs, self.measured_step = downs, measured_step
        self.inputs = [[] for _ in downs]
        self.handles = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.measured_step and not self.handles:  # micro-batches: hook once
            for i, down in enumerate(self.downs):
                self.handles.append(down.register_forward_pre_hook(
                    lambda m, args, i=i: self.inputs[i].append(args[0].detach().double().clone())))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step == self.measured_step:
            self.grads = {n: p.grad.detach().double().clone() for n, p in pl_module.named_parameters()}
            self.before = {n: p.detach().double().clone() for n, p in pl_module.named_parameters()}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.measured_step + 1:
            for handle in self.handles:
                handle.remove()
            self.after = {n: p.detach().double().clone() for n, p in pl_module.named_parameters()}


def mlp_case():
    module = TinyMLPModule(lr=0.05)
    return module, regression_loader(), [module.net[2], module.net[4]], [-1, -1]


def cnn_case():
    module = TinyCNNModule(lr=0.05)
    return module, image_loader(), [module.features[2], module.head], [1, -1]  # conv channels, then pooled


def gpt_case():
    module = tiny_gpt_module()
    return module, token_loader(), [block.mlp.c_proj for block in module.model.blocks], [-1, -1]


def llama_case():
    module = model_zoo.Wrapped("llama", lr=0.1)
    loader = DataLoader(model_zoo.batches("llama"), batch_size=4)
    return module, loader, [layer.mlp.down_proj for layer in module.model.model.layers], [-1, -1]


CASES = {"mlp": mlp_case, "cnn": cnn_case, "gpt": gpt_case, "llama": llama_case}


def scores_of(h: torch.Tensor, unit_dim: int) -> torch.Tensor:
    mean = h.abs().movedim(unit_dim, -1).reshape(-1, h.shape[unit_dim]).mean(0)
    return mean / (mean.mean() + 1e-9)


def ranks_of(features: torch.Tensor) -> tuple[float, float]:
    sigma = torch.linalg.svdvals(features)
    p = sigma / sigma.sum()
    return float(torch.exp(-(p * p.clamp_min(1e-300).log()).sum())), float(sigma.square().sum() / sigma[0] ** 2)


@pytest.mark.parametrize("case", CASES)
def test_every_metric_equals_a_direct_computation(case, tmp_path):
    torch.manual_seed(0)
    module, loader, downs, unit_dims = CASES[case]()
    initial = {n: p.detach().double().clone() for n, p in module.named_parameters()}
    monitor = PlasticityMonitor(activations_every_n_steps=2, weights_every_n_steps=2, spectra_every_n_steps=2,
                                tau=TAU, feature_layers=["last", "*0*"], plot=False)
    reference = Reference(downs, measured_step=1)
    trainer = cpu_trainer(max_steps=2, callbacks=[reference, monitor],
                          accumulate_grad_batches=2 if case == "mlp" else 1)
    trainer.fit(module, loader)
    logged = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("monitor/")}
    assert [layer.down for layer in monitor.layers] == downs  # the layers the reference hooks

    def check(name, expected, rtol=1e-5):
        if math.isinf(expected):  # a relative change of a weight at 0 (the GPT's zero-initialized projections)
            assert name not in logged, name  # left out: a gap in the curve, never a NaN
        else:
            assert logged[name] == pytest.approx(expected, rel=rtol, abs=1e-9), name

    # activations: every micro-batch of the measured step (MLP: two, by gradient accumulation)
    hs = [torch.cat([x.movedim(d, -1).reshape(-1, x.shape[d]) for x in xs]) for xs, d in zip(reference.inputs,
                                                                                               unit_dims)]
    assert all(len(xs) == (2 if case == "mlp" else 1) for xs in reference.inputs)
    scores = [scores_of(h, -1) for h in hs]
    for layer, s in zip(monitor.layers, scores):
        check(f"monitor/dormant/{layer.name}", float((s <= TAU).double().mean()))
        check(f"monitor/dead/{layer.name}", float((s == 0).double().mean()))
    check("monitor/dormant", float((torch.cat(scores) <= TAU).double().mean()))
    feature_ranks = {layer.name: ranks_of(h) for layer, h in zip(monitor.layers, hs)}  # "*0*" and last: both
    for name, (erank, srank) in feature_ranks.items():
        check(f"monitor/feature_erank/{name}", erank, 1e-4)
        check(f"monitor/feature_srank/{name}", srank, 1e-4)
    check("monitor/feature_erank", sum(e for e, _ in feature_ranks.values()) / len(feature_ranks), 1e-4)

    # weights, gradients, the update: every trainable parameter together, and per matrix
    names = [n for n, p in module.named_parameters() if p.requires_grad]
    total = {key: sum(float(t[n].square().sum()) for n in names) for key, t in
             (("w", reference.after), ("g", reference.grads), ("b", reference.before), ("0", initial))}
    diff = sum(float((reference.after[n] - initial[n]).square().sum()) for n in names)
    update = sum(float((reference.after[n] - reference.before[n]).square().sum()) for n in names)
    check("monitor/weight_norm", math.sqrt(total["w"]))
    check("monitor/grad_norm", math.sqrt(total["g"]))
    check("monitor/weight_distance", math.sqrt(diff / total["0"]), 1e-4)
    check("monitor/update_ratio", math.sqrt(update / total["b"]), 1e-4)
    assert logged["monitor/weight_distance"] > 0 and logged["monitor/update_ratio"] > 0  # it trained
    sranks = []
    for n in (n for n in names if reference.after[n].dim() >= 2):
        W = reference.after[n]
        check(f"monitor/weight_norm/{n}", float(W.norm()))
        check(f"monitor/grad_norm/{n}", float(reference.grads[n].norm()))
        before = float(reference.before[n].norm())
        check(f"monitor/update_ratio/{n}", float((W - reference.before[n]).norm()) / before if before else math.inf,
              1e-4)
        sigma = torch.linalg.svdvals(W.reshape(W.shape[0], -1))
        sranks.append(float(sigma.square().sum() / sigma[0] ** 2))
        check(f"monitor/weight_srank/{n}", sranks[-1], 1e-6)
        scale = math.sqrt(W.shape[0] / W.shape[1]) / math.prod(W.shape[2:])
        check(f"monitor/weight_dfi/{n}", float((sigma.square() - scale**2).square().sum()), 1e-6)
    check("monitor/weight_srank", sum(sranks) / len(sranks), 1e-6)
    assert monitor.history[-1]["step"] == 2 and len(monitor.history) == 1


@pytest.mark.slow  # explicit Hessians: tens of seconds
@pytest.mark.parametrize("case", ["mlp", "cnn"])
def test_curvature_is_the_top_eigenvalue_of_the_explicit_hessian(case):
    torch.manual_seed(0)
    module, loader, _, _ = CASES[case]()
    monitor = PlasticityMonitor(activations_every_n_steps=None, weights_every_n_steps=None, spectra_every_n_steps=None,
                                curvature={"every_n_steps": 3, "iterations": 300}, plot=False)
    trainer = cpu_trainer(max_steps=3, callbacks=[monitor])
    trainer.fit(module, loader)
    x, y = next(iter(loader))  # the held batch: the fit's first
    names = [n for n, _ in module.named_parameters()]
    shapes = [p.shape for p in module.parameters()]
    flat = torch.cat([p.detach().double().reshape(-1) for p in module.parameters()])
    loss = F.mse_loss if case == "mlp" else F.cross_entropy

    def loss_of(vector):
        params = dict(zip(names, (t.view(s) for t, s in zip(vector.split([math.prod(s) for s in shapes]), shapes))))
        return loss(torch.func.functional_call(module.double(), params, (x.double(),)), y)

    eigenvalues = torch.linalg.eigvalsh(torch.autograd.functional.hessian(loss_of, flat))
    top = eigenvalues[eigenvalues.abs().argmax()]
    assert float(trainer.callback_metrics["monitor/curvature"]) == pytest.approx(float(top), rel=1e-3)


def test_pure_functions_equal_svd_on_fresh_inputs():
    g = torch.Generator().manual_seed(1)
    for shape in [(40, 12), (12, 40), (8, 3, 3, 3), (30, 30)]:
        W = torch.randn(*shape, generator=g, dtype=torch.float64)
        matrix = W.reshape(shape[0], -1)
        sigma = torch.linalg.svdvals(matrix)
        # row blocks (FSDP2 shards) add up to the whole matrix's gram
        gram = D.column_gram(W[: shape[0] // 3]) + D.column_gram(W[shape[0] // 3:])
        ranks = D.gram_ranks(gram)
        p = sigma / sigma.sum()
        assert float(ranks["effective_rank"]) == pytest.approx(float(torch.exp(-(p * p.log()).sum())), rel=1e-9)
        assert float(ranks["stable_rank"]) == pytest.approx(float(sigma.square().sum() / sigma[0] ** 2), rel=1e-9)
        dfi = float(D.gram_isometry_deviation(gram, shape[0], 0.7))
        assert dfi == pytest.approx(float((sigma.square() - 0.49).square().sum()), rel=1e-9)
        assert dfi == pytest.approx(float(deviation_from_isometry(matrix, 0.7, torch.float64)), rel=1e-5)  # FIRE's
    zero = D.gram_ranks(torch.zeros(5, 5, dtype=torch.float64))
    assert float(zero["effective_rank"]) == 0 and float(zero["stable_rank"]) == 0
    h = torch.randn(4, 6, 5, generator=g)
    h[..., 2] = 0  # a dead unit
    sums = D.abs_activation_sum(h[:2]) + D.abs_activation_sum(h[2:])  # batches add up
    torch.testing.assert_close(sums, h.double().abs().sum((0, 1)))
    fractions = D.unit_fractions(sums / 24 / (sums / 24).mean(), tau=0.0)
    assert float(fractions["dead"]) == pytest.approx(0.2)


def test_resume_keeps_the_initial_weights_and_the_history(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    def run(max_steps, ckpt_path=None, checkpoints=()):
        torch.manual_seed(0)
        monitor = PlasticityMonitor(activations_every_n_steps=2, weights_every_n_steps=2, spectra_every_n_steps=None,
                                    plot=False)
        trainer = cpu_trainer(max_steps=max_steps, callbacks=[monitor, *checkpoints],
                              enable_checkpointing=bool(checkpoints))
        trainer.fit(TinyMLPModule(lr=0.05), regression_loader(n=32), ckpt_path=ckpt_path)  # 4 steps per epoch
        return monitor

    whole = run(6)
    run(4, checkpoints=[ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=4, save_top_k=-1)])
    resumed = run(6, ckpt_path=str(tmp_path / "step=4.ckpt"))
    assert [r["step"] for r in resumed.history] == [2, 4, 6]
    for a, b in zip(whole.history, resumed.history):
        assert a == pytest.approx(b, rel=1e-6)  # the distance is from the first fit's θ₀


@pytest.mark.parametrize("kwargs, match", [
    (dict(activations_every_n_steps=0), "activations_every_n_steps=0"),
    (dict(activations_every_n_steps=None, weights_every_n_steps=None, spectra_every_n_steps=None), "measures nothing"),
    (dict(tau=2.0), "tau=2.0"),
    (dict(feature_layers="last"), "feature_layers='last'"),
    (dict(per_layer="yes"), "per_layer='yes'"),
    (dict(curvature={"iterations": 0}), "curvature iterations=0"),
    (dict(curvature={"every_n_steps": 10, "loss": "mse"}), "curvature loss='mse'"),
    (dict(curvature={"steps": 10}), r"curvature: unknown field\(s\) \['steps'\]"),
])
def test_bad_input_names_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PlasticityMonitor(**kwargs)


def test_feature_layers_that_match_nothing_and_models_without_neuron_layers_fail_at_setup():
    module, loader, _, _ = mlp_case()
    with pytest.raises(ValueError, match=r"feature_layers=\['nothing'\] match none"):
        cpu_trainer(max_steps=1, callbacks=[PlasticityMonitor(feature_layers=["nothing"])]).fit(module, loader)

    class Linear(TinyMLPModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(8, 4)

    with pytest.raises(ValueError, match="found no neuron layers"):
        cpu_trainer(max_steps=1, callbacks=[PlasticityMonitor()]).fit(Linear(), loader)
    monitor = PlasticityMonitor(activations_every_n_steps=None, weights_every_n_steps=1, plot=False)
    cpu_trainer(max_steps=1, callbacks=[monitor]).fit(Linear(), loader)  # weights only: fine
    assert monitor.history[0]["monitor/weight_norm"] > 0


# ------------------------------------------------------------------ DDP and FSDP2: one process's values
MONITOR = {"_target_": "plasticity_callbacks.PlasticityMonitor", "activations_every_n_steps": 2,
           "weights_every_n_steps": 2, "spectra_every_n_steps": 2, "feature_layers": ["*"], "plot": False}
# FIRE acts once, when the monitor's DfI logged at step 2 is read: the trigger decides alike on every rank
TRIGGERED_FIRE = {"_target_": "plasticity_callbacks.FIREReinit",
                  "schedule": {"threshold": {"metric": "monitor/weight_dfi", "above": 0.0, "max_actions": 1}}}
DISTRIBUTED = [{"name": "monitor_ddp", "model": "gpt", "ddp": True, "steps": 4,
                "callbacks": [MONITOR | {"curvature": {"every_n_steps": 4, "iterations": 5}}, TRIGGERED_FIRE]},
               {"name": "monitor_fsdp2", "model": "gpt", "steps": 4, "callbacks": [MONITOR, TRIGGERED_FIRE]}]


@pytest.mark.multiprocess
def test_ddp_and_fsdp2_log_the_values_of_one_process(tmp_path):
    """Two gloo ranks, each with half of every global batch, log what one process logs on the whole batch: the
    activation statistics summed over ranks, FSDP2's shard sums over shards; the same rows at the same steps; and
    a threshold trigger on a logged metric acts at the same step as on one process."""
    from fsdp_harness import run_fsdp2, run_single

    sharded = run_fsdp2(tmp_path, DISTRIBUTED)
    for run in DISTRIBUTED:
        single, distributed = run_single(tmp_path, run), sharded[run["name"]]
        rows, rows_distributed = single["callbacks"][0]["history"], distributed["callbacks"][0]["history"]
        assert [r["step"] for r in rows] == [r["step"] for r in rows_distributed] == [2, 4]
        assert len(rows[-1]) > 40 and ("monitor/curvature" in rows[-1]) == (run["name"] == "monitor_ddp")
        for row, other in zip(rows, rows_distributed):
            assert set(row) == set(other)
            for key, value in row.items():
                assert other[key] == pytest.approx(value, rel=1e-4, abs=1e-6, nan_ok=True), (run["name"], key)
        assert distributed["metrics"]["monitor/weight_distance"] > 0
        fired = [state["schedule"]["fired"] for state in (single["callbacks"][1], distributed["callbacks"][1])]
        assert fired[0] == fired[1] and [step for step, _ in fired[0]] == [2]


@pytest.mark.slow  # Inductor compiles the GPT: tens of seconds
def test_a_compiled_gpt_logs_what_the_eager_one_does():
    """The MLPs hand their hidden values to the monitor through ``hidden_observer``, which the compiled graph calls."""
    import torch._dynamo

    def run(compile):
        torch._dynamo.reset()
        torch.manual_seed(0)
        module = tiny_gpt_module(n_layer=1, compile=compile)
        # one step, measuring: one compiled graph (the collecting one)
        monitor = PlasticityMonitor(activations_every_n_steps=1, weights_every_n_steps=1, spectra_every_n_steps=None,
                                    plot=False)
        cpu_trainer(max_steps=1, callbacks=[monitor]).fit(module, token_loader())
        return monitor.history

    eager, compiled = run(False), run(True)
    assert len(compiled) == 1 and compiled[0]["monitor/feature_erank"] > 1
    assert compiled[0] == pytest.approx(eager[0], rel=1e-4, abs=1e-6, nan_ok=True)


def test_in_a_hugging_face_trainer_the_dead_units_made_by_hand_are_logged(tmp_path):
    """Through the HF ``Trainer`` adapter: GPT-2 with three hidden units of block 0 dead by construction."""
    from test_hf_trainer import D as WIDTH, make_trainer, tiny_gpt2

    model = tiny_gpt2()
    dead = [3, 17, 40]
    with torch.no_grad():
        model.transformer.h[0].mlp.c_fc.weight[:, dead] = 0.0
        model.transformer.h[0].mlp.c_fc.bias[dead] = -30.0
    monitor = PlasticityMonitor(activations_every_n_steps=2, weights_every_n_steps=2, spectra_every_n_steps=4,
                                plot=False)
    trainer = make_trainer(tmp_path, model, monitor, max_steps=4)
    trainer.train()
    logged = [h for h in trainer.state.log_history if "monitor/dead" in h]
    assert [h["step"] for h in logged] == [2, 4]
    for h in logged:
        assert h["monitor/dead/transformer.h.0.mlp"] == pytest.approx(len(dead) / (4 * WIDTH))
        assert h["monitor/dead/transformer.h.1.mlp"] == 0.0
        assert h["monitor/weight_distance"] > 0 and h["monitor/grad_norm"] > 0
    assert "monitor/weight_srank" in logged[-1]
