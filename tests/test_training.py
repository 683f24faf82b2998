import math

import lightning as L
import pytest
import torch

from plasticity_callbacks.data import CodeCorpusDataModule
from plasticity_callbacks.models import GPTLightningModule
from plasticity_callbacks.models.optimizers import CombinedOptimizer, OptimizerSettings, build_optimizer, lr_lambda
from tiny import cpu_trainer

TINY = dict(n_layer=2, n_head=2, n_kv_head=2, n_embd=64, sequence_len=64)


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_loss_falls_on_a_small_slice_of_the_corpus(optimizer):
    L.seed_everything(0)
    dm = CodeCorpusDataModule(packages=["json"], sequence_len=64, batch_size=8, val_fraction=0.2)
    module = GPTLightningModule(TINY, {"name": optimizer, "lr": 3e-3, "warmup_steps": 5})
    trainer = cpu_trainer(max_steps=40, limit_val_batches=4, val_check_interval=40, check_val_every_n_epoch=None,
                          inference_mode=False)
    before = trainer.validate(module, datamodule=dm, verbose=False)[0]["val/loss"]
    trainer.fit(module, datamodule=dm)
    after = float(trainer.callback_metrics["val/loss"])
    assert before == pytest.approx(torch.log(torch.tensor(264.0)).item(), abs=0.05)  # zero head: uniform
    assert after < before - 1.5, (before, after)


def test_muon_groups_block_matrices_and_adamw_the_rest():
    module = GPTLightningModule(TINY, {"name": "muon"})
    opt = build_optimizer(module.model, {"name": "muon"})
    muon, adamw = opt.optimizers
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    muon_ids = {id(p) for g in muon.param_groups for p in g["params"]}
    names = {n for n, p in module.model.named_parameters() if id(p) in muon_ids}
    assert "blocks.0.attn.c_q.weight" in names and "lm_head.weight" not in names and "wte.weight" not in names
    assert len(muon_ids) + sum(len(g["params"]) for g in adamw.param_groups) == len(list(module.parameters()))


def test_combined_optimizer_steps_schedules_and_round_trips_its_state():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = build_optimizer(model, {"name": "muon"})
    # no block roles in a plain Sequential: the matrices count as "other" and still go to Muon
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda("linear", 10, 2, 0.0))
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(8, 4)).square().mean().backward()
        opt.step()
        sched.step()
    assert opt.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.02 * lr_lambda("linear", 10, 2, 0.0)(3))
    assert len(opt.state) == 4 and all(p in opt.state for p in model.parameters())
    restored = build_optimizer(model, {"name": "muon"})
    restored.load_state_dict(opt.state_dict())
    for p in model.parameters():
        for key, value in opt.state[p].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(restored.state[p][key]))


def test_lr_schedule_shapes():
    cos = lr_lambda("cosine", 100, 10, 0.1)
    assert cos(0) == pytest.approx(0.1) and cos(9) == pytest.approx(1.0)
    assert cos(10) == pytest.approx(1.0) and cos(100) == pytest.approx(0.1) and cos(55) == pytest.approx(0.55)
    with pytest.raises(ValueError, match="schedule"):
        lr_lambda("exp", 10, 0, 0)


def test_checkpoint_resume_restores_combined_optimizer(tmp_path):
    L.seed_everything(0)
    dm = CodeCorpusDataModule(packages=["json"], sequence_len=32, batch_size=4, val_fraction=0.2)
    module = GPTLightningModule({**TINY, "sequence_len": 32}, {"name": "muon"})
    trainer = cpu_trainer(max_steps=3, default_root_dir=tmp_path, limit_val_batches=0)
    trainer.fit(module, datamodule=dm)
    ckpt = tmp_path / "a.ckpt"
    trainer.save_checkpoint(ckpt)
    resumed = GPTLightningModule({**TINY, "sequence_len": 32}, {"name": "muon"})
    trainer2 = cpu_trainer(max_steps=4, default_root_dir=tmp_path, limit_val_batches=0)
    trainer2.fit(resumed, datamodule=dm, ckpt_path=ckpt)
    assert trainer2.global_step == 4
    assert isinstance(trainer2.optimizers[0], CombinedOptimizer)


def test_tokens_per_sec_is_logged_from_step_end_to_step_end(tmp_path):
    """The rate spans whole steps (a clock inside a step would time a GPU's launches): none for an epoch's first
    step, whose interval has no start; then tokens over the time between two step ends, which a slow callback
    between them lowers."""
    import csv
    import time

    from lightning.pytorch.loggers import CSVLogger

    from tiny import tiny_gpt_module, token_loader

    class SlowStep(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            time.sleep(0.5 if batch_idx == 2 else 0.0)

    trainer = cpu_trainer(max_steps=4, callbacks=[SlowStep()], log_every_n_steps=1,
                          logger=CSVLogger(tmp_path, name="", version=""))
    trainer.fit(tiny_gpt_module(), token_loader(n=16, batch_size=4))
    with open(tmp_path / "metrics.csv") as rows:
        rates = [row["train/tokens_per_sec"] for row in csv.DictReader(rows) if row["train/loss"]]
    assert len(rates) == 4 and rates[0] == "" and all(float(r) > 0 for r in rates[1:])
    rates = [float(r) for r in rates[1:]]  # steps 1, 2 (waited 0.5 s before its forward), 3
    assert rates[1] <= 4 * 16 / 0.5 and rates[1] < min(rates[0], rates[2])  # the wait is inside its interval


def test_the_optimizer_settings_travel_whole_and_a_bad_one_is_named():
    """One settings object from the config to build_optimizer: the module restates none of its fields, every
    field of configs/optimizer/*.yaml is one of them, and a bad value is one line naming optimizer.<field>."""
    import dataclasses
    import inspect
    from pathlib import Path

    from omegaconf import OmegaConf

    from plasticity_callbacks.errors import ConfigError
    from plasticity_callbacks.models.optimizers import OptimizerSettings

    assert list(inspect.signature(GPTLightningModule.__init__).parameters) == ["self", "model", "optimizer"]
    fields = {f.name for f in dataclasses.fields(OptimizerSettings)}
    for path in (Path(__file__).resolve().parents[1] / "configs" / "optimizer").glob("*.yaml"):
        settings = OptimizerSettings.build(OmegaConf.to_container(OmegaConf.load(path)))
        assert set(OmegaConf.load(path)) <= fields and settings.name == path.stem
    module = GPTLightningModule(TINY, {"name": "muon", "lr": 1e-3, "betas": [0.8, 0.95]})
    assert module.hparams["optimizer"] == dataclasses.asdict(module.optimizer_settings)
    assert module.optimizer_settings.betas == (0.8, 0.95)
    [muon, adamw] = module.configure_optimizers()["optimizer"].optimizers
    assert muon.defaults["lr"] == 0.02 and adamw.defaults["lr"] == 1e-3 and adamw.defaults["betas"] == (0.8, 0.95)
    for bad, named in (({"lr": -1.0}, "optimizer.lr=-1.0"), ({"name": "sgd"}, "optimizer.name='sgd'"),
                       ({"betas": [0.9]}, "optimizer.betas"), ({"warmup_steps": 1.5}, "optimizer.warmup_steps"),
                       ({"momentum": 0.9}, r"unknown field\(s\) \['momentum'\]")):
        with pytest.raises(ConfigError, match=named):
            GPTLightningModule(TINY, bad)


def warmup_cosine_per_task(step: int, steps_per_task: int, warmup: int, min_ratio: float) -> float:
    """The schedule written out independently: task-local step, linear warmup from 1/warmup, cosine to min_ratio."""
    local = step - (step // steps_per_task) * steps_per_task
    if local < warmup:
        return (local + 1) / warmup
    return min_ratio + (1 - min_ratio) * (1 + math.cos(math.pi * (local - warmup) / (steps_per_task - warmup))) / 2


def test_lr_schedule_restarts_its_warmup_and_cosine_every_period():
    per_task = lr_lambda("cosine", 10_000, 10, 0.1, restart_every_n_steps=100)  # total_steps unused
    for step in range(350):
        assert per_task(step) == pytest.approx(warmup_cosine_per_task(step, 100, 10, 0.1), abs=1e-12), step
    assert lr_lambda("cosine", 300, 10, 0.1)(150) != pytest.approx(per_task(150))  # one schedule over 300: no restart


class LearningRates(L.Callback):
    """The learning rate and weight decay of every param group at each training step, as the step uses them."""

    def __init__(self):
        self.lrs, self.decays = [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        groups = trainer.optimizers[0].param_groups
        self.lrs.append([g["lr"] for g in groups])
        self.decays.append([g["weight_decay"] for g in groups])


def test_a_task_stream_trains_every_task_with_its_own_warmup_and_cosine():
    from plasticity_callbacks.data.lm_stream import LMTaskStream

    steps, warmup, lr = 7, 2, 1e-2
    stream = LMTaskStream(design={"windows_per_task": 16}, num_tasks=3, steps_per_task=steps, seed=0,
                          corpus_max_bytes=200_000, window=16, batch_size=4)
    module = GPTLightningModule({"n_layer": 1, "n_embd": 32, "n_head": 2, "n_kv_head": 2, "sequence_len": 16},
                                {"lr": lr, "weight_decay": 0.1, "schedule": "cosine", "warmup_steps": warmup,
                                 "min_lr_ratio": 0.1, "restart_every_n_steps": steps})
    seen = LearningRates()
    cpu_trainer(max_epochs=1, callbacks=[seen]).fit(module, datamodule=stream)
    assert len(seen.lrs) == 3 * steps
    for step, group_lrs in enumerate(seen.lrs):
        assert group_lrs == pytest.approx([lr * warmup_cosine_per_task(step, steps, warmup, 0.1)], abs=1e-12)
    assert seen.lrs[steps] == seen.lrs[2 * steps] == seen.lrs[0]  # each task boundary starts the warmup over
    assert seen.decays[0] == [0.1]  # one group: every GPT parameter is a matrix (no biases, parameter-free norms)


def test_a_restart_period_within_the_warmup_is_refused():
    with pytest.raises(ValueError, match=r"optimizer.restart_every_n_steps=10 leaves no step after the warmup"):
        OptimizerSettings(warmup_steps=10, restart_every_n_steps=10)
    with pytest.raises(ValueError, match="optimizer.restart_every_n_steps"):
        OptimizerSettings(restart_every_n_steps=-1)
