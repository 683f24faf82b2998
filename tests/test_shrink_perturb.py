"""ShrinkPerturb: the exact formula on three kinds of model, once only, resume, validation, DDP."""
import copy

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from tiny import TinyCNNModule, TinyMLPModule, build, cpu_trainer

from plasticity_callbacks import Selection, ShrinkPerturb
from plasticity_callbacks.callbacks.schedule import Schedule
from plasticity_callbacks.distributed.strategy import rank_identical_generator


class Snapshot(L.Callback):
    """Parameters as training starts (after every callback's on_fit_start)."""

    def on_train_start(self, trainer, pl_module):
        self.params = {n: p.detach().clone() for n, p in pl_module.named_parameters()}


class RankSkewedRNG(L.Callback):
    """Gives each DDP rank a different global RNG, so only a rank-identical draw keeps ranks equal."""

    def setup(self, trainer, pl_module, stage):
        torch.manual_seed(1000 + trainer.global_rank)


def expected_fresh(kind: str, module, seed: int) -> dict[str, torch.Tensor]:
    """An independent fresh init: the tiny modules' constructors draw their layers in order; the
    GPT's own ``init_weights`` is run on a separate copy."""
    torch.manual_seed(seed)
    if kind == "mlp":
        return dict(TinyMLPModule().named_parameters())
    if kind == "cnn":
        return dict(TinyCNNModule().named_parameters())
    gpt = copy.deepcopy(module.model)
    gpt.init_weights()
    return {f"model.{n}": p for n, p in gpt.named_parameters()}


@pytest.mark.parametrize("kind", ["mlp", "cnn", "gpt"])
def test_exact_formula_on_trained_weights(kind):
    module, loader = build(kind)
    cpu_trainer(max_steps=3).fit(module, loader)  # trained, not freshly initialized, weights
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    snapshot = Snapshot()
    callback = ShrinkPerturb(shrink=0.4, perturb=0.1, seed=7)
    cpu_trainer(max_steps=1, callbacks=[callback, snapshot]).fit(module, loader)
    seed = rank_identical_generator(7, 0).initial_seed()
    fresh = expected_fresh(kind, module, seed)
    assert set(fresh) == set(before)
    for name, theta in before.items():
        torch.testing.assert_close(snapshot.params[name], 0.4 * theta + 0.1 * fresh[name], rtol=1e-6, atol=1e-7)
    changed = [n for n in before if not torch.equal(snapshot.params[n], 0.4 * before[n])]
    assert changed, "the perturbation must add a fresh init, not only shrink"
    if kind == "gpt":  # zero-initialized projections and head are only shrunk; embeddings get N(0, 1)
        torch.testing.assert_close(snapshot.params["model.lm_head.weight"], 0.4 * before["model.lm_head.weight"])
        noise = (snapshot.params["model.wte.weight"] - 0.4 * before["model.wte.weight"]) / 0.1
        assert 0.9 < noise.std() < 1.1
    assert callback.applications == 1


def test_include_exclude_and_once_per_fit():
    module, loader = build("mlp")
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    callback = ShrinkPerturb(shrink=0.5, perturb=0.0, selection=Selection(include=["net.*"], exclude=["net.4.*"]))
    snapshot = Snapshot()
    trainer = cpu_trainer(max_steps=1, callbacks=[callback, snapshot])
    trainer.fit(module, loader)
    for name, theta in before.items():
        factor = 1.0 if name.startswith("net.4.") else 0.5
        torch.testing.assert_close(snapshot.params[name], factor * theta)
    assert callback.applications == 1  # once, though fit start and the first step are both "at start"
    # a second fit with the same callback is a new phase: it applies again (a resumed fit does not, below)
    after_first = {n: p.detach().clone() for n, p in module.named_parameters()}
    cpu_trainer(max_steps=2, callbacks=[callback, snapshot]).fit(module, loader)
    for name, theta in after_first.items():
        factor = 1.0 if name.startswith("net.4.") else 0.5
        torch.testing.assert_close(snapshot.params[name], factor * theta)
    assert callback.applications == 2


def test_every_trigger_of_the_schedule_applies():
    module, loader = build("mlp")  # 8 batches per epoch
    callback = ShrinkPerturb(shrink=0.5, perturb=0.0, schedule=Schedule(steps=[3], every_n_epochs=1))
    norms = []

    class Norms(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # after ShrinkPerturb's
            norms.append(float(pl_module.net[0].weight.norm()))

    cpu_trainer(max_steps=10, callbacks=[callback, Norms()], limit_val_batches=0).fit(module, loader)
    assert callback.firing.fired == [(3, "step 3"), (8, "epoch 1")]
    for step in (3, 8):  # lr is small: the shrink halves the norm, training moves it much less
        assert norms[step] == pytest.approx(0.5 * norms[step - 1], rel=0.05)


def test_resume_from_checkpoint_does_not_reapply(tmp_path):
    module, loader = build("gpt")
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0, every_n_train_steps=2)
    cpu_trainer(max_steps=2, callbacks=[ShrinkPerturb(shrink=0.5, perturb=0.1), ckpt],
                enable_checkpointing=True).fit(module, loader)
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)
    resumed, _ = build("gpt")
    callback, snapshot = ShrinkPerturb(shrink=0.5, perturb=0.1), Snapshot()
    cpu_trainer(max_steps=4, callbacks=[callback, snapshot]).fit(resumed, loader, ckpt_path=tmp_path / "last.ckpt")
    assert callback.applications == 1 and callback.firing.fit_start_fired  # the count restored, not raised
    for name, value in saved["state_dict"].items():
        torch.testing.assert_close(snapshot.params[name], value)


@pytest.mark.parametrize("kwargs,name", [
    (dict(shrink=1.5), "shrink"), (dict(shrink=-0.1), "shrink"), (dict(perturb=-1), "perturb"),
    (dict(shrink="0.4"), "shrink"), (dict(selection={"include": "net.*"}), "include"),
    (dict(selection={"exclude": [3]}), "exclude"), (dict(selection={"scope": "mlp"}), "scope"),
    (dict(reset_optimizer=1), "reset_optimizer"), (dict(seed=1.5), "seed"),
    (dict(schedule={"at_fit_start": False}), "no trigger"), (dict(schedule={"steps": [-3]}), "steps"),
])
def test_bad_arguments_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        ShrinkPerturb(**kwargs)


def test_no_matching_parameters_is_an_error():
    module, loader = build("mlp")
    with pytest.raises(ValueError, match="matches no parameter"):
        cpu_trainer(max_steps=1, callbacks=[ShrinkPerturb(selection={"include": ["nothing.*"]})]).fit(module, loader)


def test_reset_optimizer_drops_state_of_changed_parameters():
    module, loader = build("mlp")
    class StateProbe(L.Callback):
        def on_train_start(self, trainer, pl_module):  # runs after ShrinkPerturb (listed later)
            self.states = len(trainer.optimizers[0].state)

    probe = StateProbe()
    callback = ShrinkPerturb(selection={"include": ["net.0.*"]}, reset_optimizer=True)

    class FakeState(L.Callback):  # give the fresh optimizer some state to drop
        def on_fit_start(self, trainer, pl_module):
            for p in pl_module.parameters():
                trainer.optimizers[0].state[p] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros_like(p),
                                                  "exp_avg_sq": torch.zeros_like(p)}

    cpu_trainer(max_steps=1, callbacks=[FakeState(), callback, probe]).fit(module, loader)
    assert probe.states == len(list(module.parameters())) - 2  # net.0.weight and net.0.bias dropped


@pytest.mark.multiprocess
@pytest.mark.ddp_run([{"_target_": "test_shrink_perturb.RankSkewedRNG"},
                      {"_target_": "plasticity_callbacks.ShrinkPerturb", "shrink": 0.5, "perturb": 0.5}],
                     model="gpt", steps=2)
def test_ddp_ranks_stay_identical(ddp_run):
    from ddp_harness import assert_ranks_identical

    results = ddp_run
    assert_ranks_identical(results)
