"""DASHShrink in real Lightning runs: when it acts, what it changes, what it leaves alone."""
import copy
import math

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ddp_harness import assert_ranks_identical
from plasticity_callbacks import DASHPeriodic, DASHShrink
from plasticity_callbacks.callbacks.schedule import Schedule
from tiny import TinyMLPModule, build, cpu_trainer, image_loader, regression_loader, tiny_gpt_module, token_loader

VISIBLE = dict(cosine_threshold=-1.0, shrink_rate=0.5)  # every non-zero row shrinks by a visible amount (factor in [0.5, 1))


class WeightWatch(L.Callback):
    """Placed before and after DASHShrink: records at which global steps the hook changed which parameters."""

    def __init__(self):
        self.snapshot, self.changed, self.calls = {}, {}, 0

    def before(self):
        outer = self

        class Before(L.Callback):
            def on_before_optimizer_step(self, trainer, pl_module, optimizer):
                outer.calls += 1
                outer.snapshot = {n: p.detach().clone() for n, p in pl_module.named_parameters()}

        return Before()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        names = {n for n, p in pl_module.named_parameters() if not torch.equal(p, self.snapshot[n])}
        if names:
            self.changed[trainer.global_step] = names


class PoisonGradient(L.Callback):
    """NaN into one gradient at ``step`` (before DASHShrink sees it); ``heal`` zeroes it again afterwards."""

    def __init__(self, step):
        self.step = step

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step == self.step:
            next(pl_module.parameters()).grad[0, 0] = float("nan")

    def heal(self):
        class Heal(L.Callback):
            def on_before_optimizer_step(self, trainer, pl_module, optimizer):
                for p in pl_module.parameters():
                    if p.grad is not None:
                        p.grad.nan_to_num_(0.0)

        return Heal()


def fit_watched(module, loader, dash, max_steps, poison=None, **trainer_kw):
    watch = WeightWatch()
    callbacks = [watch.before(), dash, watch]
    if poison is not None:
        callbacks = [poison] + callbacks + [poison.heal()]
    trainer = cpu_trainer(max_steps=max_steps, callbacks=callbacks, **trainer_kw)
    trainer.fit(module, train_dataloaders=loader)
    return watch, trainer


def test_periodic_rule_logs_per_layer_keys_only_when_asked():
    """Under a logger that prints every key (the HF Trainer's) per-layer factors would be ~3 keys per layer
    and action; by default an action logs its totals only."""
    keys = {}
    for per_layer in (False, True):
        module, loader = build("mlp")
        dash = DASHPeriodic(schedule=Schedule(every_n_steps=3), log_per_layer=per_layer, **VISIBLE)
        _, trainer = fit_watched(module, loader, dash, max_steps=4)  # acts once, at step 3
        keys[per_layer] = {k for k in trainer.callback_metrics if k.startswith("dash_periodic/")}
    assert keys[False] and not any(k.startswith("dash_periodic/net.") for k in keys[False])
    assert keys[True] - keys[False] == {f"dash_periodic/net.{i}/{m}" for i in (0, 2)
                                        for m in ("factor_mean", "factor_min", "shrunk")}


@pytest.mark.parametrize("accumulate", [1, 4])
def test_periodic_rule_fires_on_exactly_the_configured_optimizer_steps(accumulate):
    module, loader = build("mlp")
    dash = DASHPeriodic(schedule=Schedule(every_n_steps=3), log_per_layer=True, **VISIBLE)
    watch, trainer = fit_watched(module, loader, dash, max_steps=8, accumulate_grad_batches=accumulate)
    assert watch.calls == 8  # one hook call per real optimizer step, whatever the accumulation
    assert sorted(watch.changed) == [3, 6]  # once 3 and 6 optimizer steps are done, before the next
    assert watch.changed[3] == {"net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"}  # head untouched
    assert dash.shrinks == 2 and dash.last_shrink_step == 6
    metrics = trainer.callback_metrics
    assert metrics["dash_periodic/shrinks"] == 2 and metrics["dash_periodic/shrunk"] == 32
    assert 0.5 <= metrics["dash_periodic/net.0/factor_min"] < metrics["dash_periodic/net.0/factor_mean"] < 1


def test_periodic_rule_skips_a_step_with_non_finite_gradients():
    module, loader = build("mlp")
    dash = DASHPeriodic(schedule=Schedule(every_n_steps=3), **VISIBLE)
    watch, _ = fit_watched(module, loader, dash, max_steps=8, poison=PoisonGradient(step=3))
    assert sorted(watch.changed) == [6]
    assert dash.skipped_nonfinite == 1 and dash.shrinks == 1


def test_periodic_rule_matches_the_formula_on_a_cnn():
    module, loader = build("cnn")
    seen = {}

    class Capture(L.Callback):
        def __init__(self, key):
            self.key = key

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if trainer.global_step == 1:
                w = pl_module.features[2].weight
                seen[self.key] = w.detach().clone().double()
                seen["grad"] = w.grad.detach().clone().double()
                seen[self.key + "_head"] = pl_module.head.weight.detach().clone()

    dash = DASHPeriodic(schedule=Schedule(steps=[1]), cosine_threshold=0.0, shrink_rate=0.8, min_factor=0.6)
    cpu_trainer(max_steps=2, callbacks=[Capture("before"), dash, Capture("after")]).fit(module, loader)
    w, g = seen["before"], seen["grad"]
    cos = F.cosine_similarity(w.flatten(2), g.flatten(2), dim=2)  # per (out, in) kernel slice
    factors = (1 - 0.8 * cos.clamp_min(0)).clamp(0.6, 1)
    assert (factors < 1).any() and (factors == 1).any()  # both sides of the threshold occur
    assert torch.allclose(seen["after"], w * factors[:, :, None, None], atol=1e-7)
    assert torch.equal(seen["before_head"], seen["after_head"])  # the output head is not a target


class AtTrainStart(L.Callback):
    """After DASHShrink in on_train_start: what the paper rule left behind."""

    def on_train_start(self, trainer, pl_module):
        self.grads = [p.grad for p in pl_module.parameters()]
        self.optimizer_state = len(trainer.optimizers[0].state)
        self.global_step = trainer.global_step
        self.modes = {n: m.training for n, m in pl_module.named_modules()}
        self.buffers = {n: b.clone() for n, b in pl_module.named_buffers()}
        self.params = {n: p.detach().clone() for n, p in pl_module.named_parameters()}


def expected_paper_shrink(module, loader, n_batches, ema_weight, min_factor, layers):
    """Independent computation on a copy: EMA of -grad over the first batches, then clamp(cos, min_factor, 1)."""
    model = copy.deepcopy(module).train()
    ema = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in model.named_parameters()}
    for i, batch in zip(range(n_batches), loader):
        model.zero_grad()
        model.training_step(batch, i).backward()
        for n, p in model.named_parameters():
            ema[n] = (1 - ema_weight) * ema[n] - ema_weight * p.grad.double()
    out = {}
    for n, p in model.named_parameters():
        w = p.detach().double()
        if n.rsplit(".", 1)[0] not in layers:
            out[n] = w
        elif w.dim() == 1:
            out[n] = w * F.cosine_similarity(ema[n][None], w[None], eps=1e-30).clamp(min_factor, 1)
        else:
            cos = F.cosine_similarity(ema[n].flatten(2) if w.dim() > 2 else ema[n],
                                      w.flatten(2) if w.dim() > 2 else w, dim=-1, eps=1e-30)
            out[n] = w * cos.clamp(min_factor, 1).reshape(cos.shape + (1,) * (w.dim() - cos.dim()))
    return out


@pytest.mark.filterwarnings("ignore:.*eval mode")
@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_paper_rule_shrinks_as_computed_independently_and_leaves_no_trace(kind):
    torch.manual_seed(0)
    if kind == "mlp":  # with a BatchNorm, whose running statistics the data pass must not move
        module = TinyMLPModule()
        module.net.insert(1, nn.BatchNorm1d(16))
        loader, layers = regression_loader(), {"net.0", "net.3"}
    else:
        module, loader, layers = build("cnn")[0], image_loader(), {"features.0", "features.2"}
    L.seed_everything(0)
    pre = {n: p.detach().clone() for n, p in module.named_parameters()}
    if kind == "mlp":
        module.net[2].eval()  # an odd mode the callback must hand back unchanged (ReLU: no effect on the math)
        modes_before = {n: m.training for n, m in module.named_modules()}
        buffers_before = {n: b.clone() for n, b in module.named_buffers()}
    expected = expected_paper_shrink(module, loader, n_batches=3, ema_weight=0.3, min_factor=0.3, layers=layers)
    probe = AtTrainStart()
    dash = DASHShrink(n_batches=3, gradient_mode="train")  # the expectation runs in train mode
    trainer = cpu_trainer(max_steps=2, callbacks=[dash, probe])
    trainer.fit(module, loader)
    assert all(g is None for g in probe.grads) and probe.optimizer_state == 0 and probe.global_step == 0
    for n, w in expected.items():
        assert torch.allclose(probe.params[n].double(), w, atol=1e-6), n
    changed = {n for n in pre if not torch.equal(pre[n], probe.params[n])}
    assert changed == {f"{layer}.{p}" for layer in layers for p in ("weight", "bias")}
    if kind == "mlp":
        assert probe.modes == modes_before
        assert all(torch.equal(probe.buffers[n], b) for n, b in buffers_before.items())
    assert dash.firing.fit_start_fired and dash.shrinks == 1
    assert 0 < trainer.callback_metrics["dash/shrunk"] and trainer.callback_metrics["dash/factor_min"] >= 0.3


def test_paper_rule_at_epochs_and_not_twice_at_the_same_point():
    module, loader = build("mlp")  # 8 batches per epoch
    dash = DASHShrink(schedule=Schedule(at_fit_start=True, epochs=[0, 2]), n_batches=2)
    trainer = cpu_trainer(max_epochs=3, callbacks=[dash])
    trainer.fit(module, loader)
    assert dash.shrinks == 2 and dash.last_shrink_step == 16  # fit start and epoch 0 are one moment
    assert dash.firing.fired == [(0, "fit start"), (16, "epoch 2")]


def test_paper_rule_shrinks_again_in_a_new_fit_of_the_same_process():
    module, loader = build("mlp")
    dash = DASHShrink(n_batches=2)
    cpu_trainer(max_steps=2, callbacks=[dash]).fit(module, loader)
    cpu_trainer(max_steps=2, callbacks=[dash]).fit(module, regression_loader(seed=1))  # phase 2: new data
    assert dash.shrinks == 2


@pytest.mark.filterwarnings("ignore:.*eval mode")
def test_paper_rule_on_the_gpt_touches_only_block_matrices():
    module = tiny_gpt_module()
    pre = {n: p.detach().clone() for n, p in module.named_parameters()}
    probe = AtTrainStart()
    cpu_trainer(max_steps=1, callbacks=[DASHShrink(n_batches=2), probe]).fit(module, token_loader())
    changed = {n for n in pre if not torch.equal(pre[n], probe.params[n])}
    assert changed and all(".attn.c_" in n or ".mlp.c_" in n for n in changed)
    assert all(g is None for g in probe.grads) and probe.optimizer_state == 0


def test_skip_muon_params_is_honored():
    def changed_by_dash(skip):
        module = tiny_gpt_module(optimizer="muon")
        dash = DASHPeriodic(schedule=Schedule(steps=[1]), selection={"include_head": True}, skip_muon_params=skip, **VISIBLE)
        watch, _ = fit_watched(module, token_loader(), dash, max_steps=2)
        return watch.changed[1]

    assert changed_by_dash(True) == {"model.lm_head.weight"}  # the head is AdamW's; block matrices are Muon's
    everything = changed_by_dash(False)
    assert "model.lm_head.weight" in everything and any(".c_fc." in n for n in everything)
    module, loader = build("mlp", "muon")  # every Linear weight is Muon's
    with pytest.raises(ValueError, match="torch.optim.Muon"):
        cpu_trainer(max_steps=1, callbacks=[DASHPeriodic()]).fit(module, loader)


def test_resume_neither_repeats_nor_skips(tmp_path):
    module, loader = build("mlp")
    every_3 = Schedule(every_n_steps=3)
    periodic, paper = DASHPeriodic(schedule=every_3, **VISIBLE), DASHShrink(n_batches=2)
    trainer = cpu_trainer(max_steps=4, callbacks=[periodic, paper])
    trainer.fit(module, loader)
    assert (periodic.shrinks, paper.shrinks) == (1, 1)
    trainer.save_checkpoint(tmp_path / "mid.ckpt")

    resumed_periodic, resumed_paper = DASHPeriodic(schedule=every_3, **VISIBLE), DASHShrink(n_batches=2)
    watch = WeightWatch()
    probe = AtTrainStart()
    module2, _ = build("mlp")
    trainer2 = cpu_trainer(max_steps=8, callbacks=[resumed_paper, probe, watch.before(), resumed_periodic, watch])
    trainer2.fit(module2, loader, ckpt_path=tmp_path / "mid.ckpt")
    assert all(torch.equal(p, probe.params[n]) for n, p in module.named_parameters())  # no second start shrink
    assert sorted(watch.changed) == [6]  # step 3 happened before the checkpoint, step 6 after it
    assert (resumed_periodic.shrinks, resumed_paper.shrinks) == (2, 1) and resumed_paper.firing.fit_start_fired

    fresh = DASHShrink()
    fresh.load_state_dict(resumed_paper.state_dict())
    assert fresh.state_dict() == resumed_paper.state_dict()
    assert periodic.state_key != paper.state_key


def test_arguments_are_validated():
    for kwargs, name in [(dict(schedule={"every_n_steps": 0}), "every_n_steps"),
                         (dict(cosine_threshold=1.5), "cosine_threshold"), (dict(shrink_rate=-0.1), "shrink_rate"),
                         (dict(min_factor=2.0), "min_factor"), (dict(selection={"scope": "mpl"}), "scope"),
                         (dict(schedule={"epochs": [3]}), "only at steps")]:
        with pytest.raises(ValueError, match=name):
            DASHPeriodic(**kwargs)
    for kwargs, name in [(dict(min_factor=-0.1), "min_factor"), (dict(gradient_ema_weight=0.0), "gradient_ema_weight"),
                         (dict(n_batches=0), "n_batches"), (dict(selection={"scope": "mpl"}), "scope"),
                         (dict(schedule={"at_fit_start": False}), "no trigger"),
                         (dict(schedule={"epochs": [-1]}), "epochs")]:
        with pytest.raises(ValueError, match=name):
            DASHShrink(**kwargs)


@pytest.mark.multiprocess
@pytest.mark.ddp_run([{"_target_": "plasticity_callbacks.DASHPeriodic", "schedule": {"every_n_steps": 2}, **VISIBLE},
                      {"_target_": "plasticity_callbacks.DASHShrink", "n_batches": 2}], model="mlp", steps=6)
def test_ddp_two_ranks_end_identical(ddp_run):
    results = ddp_run
    assert_ranks_identical(results)
    metrics = results[0]["metrics"]
    assert metrics["dash_periodic/shrinks"] == 2 and metrics["dash_periodic/shrunk"] > 0  # steps 2 and 4
    assert metrics["dash/shrinks"] == 1 and metrics["dash/shrunk"] > 0
    assert not math.isnan(float(metrics["dash/factor_min"]))



def test_under_fp16_amp_the_hook_sees_unscaled_gradients():
    """Lightning's AMP plugin unscales before on_before_optimizer_step (checked with a real GradScaler on CPU)."""
    from lightning.pytorch.plugins import MixedPrecision

    module, loader = build("mlp")
    seen = {}

    class Capture(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if trainer.global_step == 0:
                seen["model"] = copy.deepcopy(pl_module)  # the weights the hook sees (deepcopy drops .grad)
                seen["grad"] = pl_module.net[0].weight.grad.clone()
                seen["scale"] = trainer.precision_plugin.scaler.get_scale()

    paper = DASHShrink(n_batches=2)  # its data pass scales the loss with the same scaler
    periodic = DASHPeriodic(schedule=Schedule(steps=[0], every_n_steps=1), **VISIBLE)
    cpu_trainer(max_steps=2, plugins=[MixedPrecision("16-mixed", "cpu")],
                callbacks=[paper, Capture(), periodic]).fit(module, loader)
    assert seen["scale"] > 1 and paper.shrinks == 1 and periodic.shrinks == 2
    assert all(torch.isfinite(p).all() for p in module.parameters())
    model = seen["model"]
    hook_grad = seen["grad"]
    with torch.autocast("cpu", dtype=torch.float16):
        model.training_step(next(iter(loader)), 0).backward()  # the same batch, never scaled
    assert torch.allclose(hook_grad, model.net[0].weight.grad, rtol=1e-3, atol=1e-7)
