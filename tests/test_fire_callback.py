"""FIREReinit: triggers fire exactly when configured, once; resume; re-warmup; MLP/CNN/GPT; DDP; Hydra config."""
import math
from pathlib import Path

import lightning as L
import pytest
import torch
from hydra.utils import instantiate
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import OmegaConf

from ddp_harness import assert_ranks_identical
from plasticity_callbacks import FIREReinit
from plasticity_callbacks.callbacks.schedule import Schedule
from plasticity_callbacks.functional.isometry import FIREOptions
from plasticity_callbacks.functional.spectral import deviation_from_isometry
from tiny import TinyMLPModule, build, cpu_trainer, regression_loader

BATCHES = 8  # regression_loader(): 64 samples / batch 8


class WeightsAtTrainStart(L.Callback):
    """Records the first hidden layer's DfI right after FIRE acted in on_train_start (runs after it)."""

    def on_train_start(self, trainer, pl_module):
        self.dfi = float(deviation_from_isometry(pl_module.net[2].weight.detach()))


def quiet(trainer_fn):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trainer_fn()


@pytest.mark.parametrize("kwargs,name", [
    ({"schedule": {"at_fit_start": False}}, "trigger"), ({"schedule": {"epochs": [-1]}}, "epochs"),
    ({"schedule": {"at_start": True}}, "at_start"), ({"selection": {"scope": "heads"}}, "scope"),
    ({"options": {"method": "qr"}}, "method"), ({"options": {"normalize": "l1"}}, "normalize"),
    ({"options": {"dtype": "float16"}}, "dtype"), ({"options": {"scale": "orthogonal"}}, "scale"),
    ({"options": {"on_degenerate": "zero"}}, "on_degenerate"), ({"options": {"tol": -1.0}}, "tol"),
    ({"options": {"method": "newton_schulz", "steps": -1}}, "steps=-1 must be"), ({"rewarmup_steps": -2}, "rewarmup_steps"),
    ({"options": {"method": "polar_express", "normalize": "spectral"}}, "spectral"),
    ({"options": {"steps": 5, "tolerance": 1}}, "tolerance"),
    ({"options": {"method": "newton_schulz", "steps": 5, "tol": 1e-5}}, "steps=5 is a fixed count"),
    ({"options": {"method": "svd", "max_steps": 5}}, "max_steps=5 applies to the iterative"),
])
def test_bad_arguments_raise_naming_them(kwargs, name):
    with pytest.raises(ValueError, match=name):
        FIREReinit(**kwargs)


def fired(fire):
    return [(h["global_step"], h["reason"]) for h in fire.history]


def test_fit_start_epochs_every_n_and_steps_fire_exactly_once_each():
    module = TinyMLPModule()
    probe = WeightsAtTrainStart()
    schedule = Schedule(at_fit_start=True, epochs=[1], every_n_epochs=2, steps=[3, 2 * BATCHES])
    fire = FIREReinit(schedule=schedule, log_per_layer=True)
    trainer = cpu_trainer(max_epochs=5, callbacks=[fire, probe], accumulate_grad_batches=1)
    quiet(lambda: trainer.fit(module, regression_loader()))
    # epoch 2 start and step 16 coincide: one moment, one application
    assert fired(fire) == [(0, "fit start"), (3, "step 3"), (8, "epoch 1"), (16, "epoch 2"), (32, "epoch 4")]
    assert probe.dfi < 1e-8  # the weights really were an isometry (at scale 1: 16×16) right after fit start
    metrics = trainer.callback_metrics
    assert float(metrics["fire/applications"]) == 5 and float(metrics["fire/layers"]) == 2
    assert float(metrics["fire/dfi_after"]) < 1e-8 and "fire/dfi_before/net.0.weight" in metrics


def test_steps_under_gradient_accumulation_fire_once():
    fire = FIREReinit(schedule=Schedule(steps=[2]))
    trainer = cpu_trainer(max_steps=4, callbacks=[fire], accumulate_grad_batches=2)
    quiet(lambda: trainer.fit(TinyMLPModule(), regression_loader()))
    assert fired(fire) == [(2, "step 2")]


def test_plateau_follows_early_stopping_semantics_with_cooldown():
    module = TinyMLPModule(optimizer="sgd", lr=0.0)  # lr 0: the validation loss only moves when FIRE acts
    fire = FIREReinit(schedule=Schedule(monitor="val/loss", patience=2, cooldown=1, min_delta=1e-6))
    trainer = cpu_trainer(max_epochs=7, callbacks=[fire])
    quiet(lambda: trainer.fit(module, regression_loader(), regression_loader(seed=1)))
    # validations 0..6: v0 best; v1, v2 no gain -> FIRE at v2; v3 in cooldown (new best);
    # v4, v5 no gain -> FIRE at v5; v6 in cooldown again (sets the new best, no counting).
    assert fired(fire) == [(3 * BATCHES, "plateau of val/loss"), (6 * BATCHES, "plateau of val/loss")]
    assert fire.firing.wait == 0 and fire.firing.cooldown_left == 0 and fire.firing.best is not None


def test_plateau_needs_the_monitored_metric():
    fire = FIREReinit(schedule=Schedule(monitor="val/accuracy"))
    trainer = cpu_trainer(max_epochs=1, callbacks=[fire])
    with pytest.raises(RuntimeError, match="val/accuracy"):
        quiet(lambda: trainer.fit(TinyMLPModule(), regression_loader(), regression_loader(seed=1)))


def test_resume_never_repeats_or_skips_an_application(tmp_path):
    def run(max_steps, ckpt_path=None):
        fire = FIREReinit(schedule=Schedule(at_fit_start=True, steps=[3, 5]))
        checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1, filename="{step}")
        trainer = cpu_trainer(max_steps=max_steps, callbacks=[fire, checkpoint], enable_checkpointing=True)
        quiet(lambda: trainer.fit(TinyMLPModule(), regression_loader(), ckpt_path=ckpt_path))
        return fire

    first = run(6)
    assert fired(first) == [(0, "fit start"), (3, "step 3"), (5, "step 5")]
    # Resumed after step 4: fit start and step 3 already happened, step 5 did not yet.
    resumed = run(7, tmp_path / "step=4.ckpt")
    assert fired(resumed) == fired(first)
    assert len(resumed.last_records) > 0  # step 5 was applied in the resumed run ...
    resumed_late = run(7, tmp_path / "step=6.ckpt")
    assert fired(resumed_late) == fired(first) and resumed_late.last_records == []  # ... and nothing here


def test_rewarmup_scales_the_next_k_steps_and_leaves_the_scheduler_alone():
    seen = []

    class RecordLR(L.Callback):  # registered after FIRE's pre-hook, so it sees the scaled LR
        def on_train_start(self, trainer, pl_module):
            opt = trainer.optimizers[0]
            opt.register_step_pre_hook(lambda o, a, k: seen.append(o.param_groups[0]["lr"]))

    class Scheduled(TinyMLPModule):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            return [opt], [{"scheduler": torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5), "interval": "step"}]

    fire = FIREReinit(schedule=Schedule(steps=[2]), rewarmup_steps=4)
    trainer = cpu_trainer(max_steps=8, callbacks=[fire, RecordLR()])
    quiet(lambda: trainer.fit(Scheduled(), regression_loader()))
    schedule = [0.1 * 0.5**s for s in range(8)]  # ExponentialLR multiplies the group's current lr
    warm = [1, 1, 0.25, 0.5, 0.75, 1, 1, 1]
    assert seen == pytest.approx([lr * f for lr, f in zip(schedule, warm)], rel=1e-12)
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**8, rel=1e-12)


@pytest.mark.parametrize("kind", ["mlp", "cnn", "gpt"])
def test_works_on_any_lightning_module(kind, tmp_path):
    module, loader = build(kind, "adamw")
    fire = FIREReinit(schedule=Schedule(at_fit_start=True, steps=[2]), save_spectra=True)
    trainer = cpu_trainer(max_steps=3, callbacks=[fire], default_root_dir=tmp_path)
    quiet(lambda: trainer.fit(module, loader))
    expected_layers = {"mlp": 2, "cnn": 2, "gpt": 12}[kind]  # GPT: 2 layers × (q, k, v, proj, fc, proj)
    assert fire.history[1]["layers"] == expected_layers
    for record in fire.last_records:
        if record.fell_back:  # rank-deficient (a c_proj after one update): partial isometry, DfI = #zero σ
            assert record.dfi_after == pytest.approx(round(record.dfi_after), abs=1e-4)
        else:
            assert record.dfi_after < 1e-6
    assert all(torch.isfinite(p).all() for p in module.parameters())
    assert sorted(p.name for p in (Path(tmp_path) / "figures").glob("*.png")) == [
        "fire_spectra_fit_start.png", "fire_spectra_step_2.png"]


def test_state_key_and_state_dict_round_trip():
    schedule = Schedule(at_fit_start=True, steps=[4], monitor="val/loss")
    fire = FIREReinit(schedule=schedule)
    fire.firing.fit_start_fired, fire.firing.best, fire.firing.wait, fire.warmup_start = True, 1.5, 2, 3
    other = FIREReinit(schedule=schedule)
    other.load_state_dict(fire.state_dict())
    assert (other.firing.fit_start_fired, other.firing.best, other.firing.wait, other.warmup_start) == (True, 1.5, 2, 3)
    assert FIREReinit(selection={"scope": "mlp"}).state_key != FIREReinit(selection={"scope": "attention"}).state_key


def test_hydra_config_instantiates_with_overrides():
    config = OmegaConf.load(Path(__file__).parents[1] / "configs" / "callbacks" / "fire.yaml")
    config.fire.options.method = "svd"
    fire = instantiate(config.fire)
    assert isinstance(fire, FIREReinit) and fire.options == FIREOptions(method="svd")
    assert fire.schedule == Schedule(at_fit_start=True)


@pytest.mark.multiprocess
@pytest.mark.ddp_run({"_target_": "plasticity_callbacks.FIREReinit", "schedule": {"at_fit_start": True, "steps": [3]},
                      "rewarmup_steps": 2, "log_per_layer": True}, model="gpt", optimizer="muon", steps=5)
def test_ddp_two_ranks_end_identical_after_fire(ddp_run):
    results = ddp_run
    assert_ranks_identical(results)
    metrics = results[0]["metrics"]
    assert float(metrics["fire/applications"]) == 2 and float(metrics["fire/dfi_after"]) < 1e-6
    q = results[0]["params"]["model.blocks.0.attn.c_q.weight"]
    assert not math.isclose(float(deviation_from_isometry(q)), 0.0, abs_tol=1e-9)  # trained on after FIRE
