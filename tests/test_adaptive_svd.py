"""AdaptiveSVDSwitch: factorized and projected low-rank training, checkpoint resume, DDP."""
from contextlib import nullcontext
from types import SimpleNamespace

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

from ddp_harness import assert_ranks_identical
from plasticity_callbacks import AdaptiveSVDSwitch, DASHShrink
from plasticity_callbacks.callbacks.adaptive_svd import SwitchThresholds
from plasticity_callbacks.callbacks.schedule import Schedule
from plasticity_callbacks.ops import factorization
from plasticity_callbacks.functional.subspace import as_matrix, svd_triplets
from tiny import TinyMLPModule, build, cpu_trainer, regression_loader

ALWAYS_MINOR = dict(thresholds={"clobber_alignment": 0.0}, r_min=2, save_figure=False)  # any principal gradient share > 0


def split(module, attr, r):
    svd = svd_triplets(as_matrix(getattr(module, attr).detach()))
    B, A = factorization.minor_factors(svd, r, torch.float32)
    return factorization.factorize(module, attr, B, A), svd


@pytest.mark.parametrize("layer,x", [
    (nn.Linear(12, 10), torch.randn(5, 12)),
    (nn.Conv2d(3, 6, 3, padding=1), torch.randn(2, 3, 7, 7)),
])
def test_factorize_keeps_the_output_and_fold_back_is_exact(layer, x):
    before = layer(x).detach()
    weight = layer.weight
    parts, svd = split(layer, "weight", r=3)
    assert torch.allclose(layer(x), before, atol=1e-5)
    assert layer.parametrizations.weight.original is weight and not weight.requires_grad
    k = svd.S.numel() - 3  # B A is exactly the minor part U_m S_m V_mᵀ
    minor = (svd.U[:, k:] * svd.S[k:]) @ svd.V[:, k:].mT
    assert torch.allclose(parts.B @ parts.A, minor, atol=1e-5)
    effective = layer.weight.detach().clone()
    assert factorization.fold(layer, "weight") is weight
    assert torch.equal(weight, effective) and weight.requires_grad and not factorization.is_factorized(layer, "weight")


def test_transferred_gradient_is_the_chain_rule():
    """At a switch the step's gradient moves to B, A as G Aᵀ and Bᵀ G: what autograd gives the factors."""
    layer, x = nn.Linear(9, 7), torch.randn(4, 9)
    G = torch.autograd.grad(layer(x).square().sum(), layer.weight)[0]
    parts, _ = split(layer, "weight", r=2)
    layer(x).square().sum().backward()
    assert torch.allclose(parts.B.grad, G @ parts.A.detach().mT, atol=1e-5)
    assert torch.allclose(parts.A.grad, parts.B.detach().mT @ G, atol=1e-5)


class Spy(L.Callback):
    """Records, after each optimizer step, the frozen part and the factors of every factorized matrix."""

    def __init__(self, switch):
        self.switch, self.records = switch, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        row = {"step": trainer.global_step}
        for m in self.switch.matrices:
            if factorization.is_factorized(m.target.module, m.attr):
                parts = factorization.components(m.target.module, m.attr)
                row[m.target.name] = (m.target.param.detach().clone(), (parts.B @ parts.A).detach().clone())
        self.records.append(row)


def test_factorize_freezes_w_p_and_trains_only_the_minor_part():
    module, loader = build("mlp")
    switch = AdaptiveSVDSwitch(minor_training="factorize", schedule=Schedule(every_n_steps=4, start_step=4),
                               **ALWAYS_MINOR)
    spy = Spy(switch)
    cpu_trainer(max_steps=8, callbacks=[switch, spy]).fit(module, loader)
    name = "net.2.weight"
    after_switch = [r[name] for r in spy.records if r["step"] >= 5]  # steps 5..8 run on the split of step 4
    assert len(after_switch) == 4
    for W_p, BA in after_switch[1:]:
        assert torch.equal(W_p, after_switch[0][0])  # the principal part never moves
        assert not torch.equal(BA, after_switch[0][1])  # the minor part trains
    optimizer = module.trainer.optimizers[0]
    m = next(m for m in switch.matrices if m.target.name == name)
    parts = factorization.components(m.target.module, m.attr)
    group = factorization.param_group_of([optimizer], m.target.param)
    assert any(p is parts.B for p in group["params"]) and any(p is parts.A for p in group["params"])
    assert m.target.param not in optimizer.state and parts.B in optimizer.state  # W_p holds no moments
    assert switch.matrices[0].r <= 7 and all(m.state == "minor" for m in switch.matrices)


class FlipToFull(L.Callback):
    """From step ``at`` on, make every decision "full" (no rule can choose low-rank)."""

    def __init__(self, switch, at):
        self.switch, self.at = switch, at

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.at:
            self.switch.thresholds = SwitchThresholds(clobber_alignment=1.0, max_reconstruction_error=0.0)


class Probes(L.Callback):
    """After each backward: per step, whether each factorized matrix carries its gradient probe."""

    def __init__(self, switch):
        self.switch, self.steps = switch, {}

    def on_after_backward(self, trainer, pl_module):
        self.steps[trainer.global_step] = [factorization.components(m.target.module, m.attr).captured is not None
                                           for m in self.switch.matrices
                                           if factorization.is_factorized(m.target.module, m.attr)]


def test_switch_back_to_full_folds_and_trains_the_whole_matrix_again():
    module, loader = build("gpt", optimizer="muon")  # B, A join Muon's group inside CombinedOptimizer
    switch = AdaptiveSVDSwitch(minor_training="factorize", schedule=Schedule(every_n_steps=2, start_step=2),
                               **ALWAYS_MINOR)
    probes = Probes(switch)
    trainer = cpu_trainer(max_steps=7, callbacks=[switch, FlipToFull(switch, at=4), probes])
    trainer.fit(module, loader)
    # the gradient probes ride along on the cycle step only (step 4: factorized since step 2), off around it
    assert probes.steps[4] and all(probes.steps[4])
    assert probes.steps[3] and not any(probes.steps[3]) and not any(probes.steps[5])
    optimizer = trainer.optimizers[0]
    states = [state for step, _, state, _ in switch.history]
    assert "minor" in states and all(state == "full" for step, _, state, _ in switch.history if step >= 4)
    muon_params = optimizer.optimizers[0].param_groups[0]["params"]
    for m in switch.matrices:
        assert not factorization.is_factorized(m.target.module, m.attr) and m.target.param.requires_grad
        assert m.target.param in optimizer.state  # stepped again as a whole matrix
    assert len(muon_params) == len({id(p) for p in muon_params}) == sum(1 for _ in switch.matrices)


def test_factorized_checkpoint_resumes_into_the_same_run(tmp_path):
    def run(max_steps, ckpt_path=None, save=False):
        L.seed_everything(0)
        module = TinyMLPModule()
        switch = AdaptiveSVDSwitch(minor_training="factorize", schedule=Schedule(every_n_steps=4, start_step=4),
                               **ALWAYS_MINOR)
        callbacks = [switch]
        if save:
            callbacks.append(ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=8, save_top_k=-1,
                                             filename="{step}"))
        trainer = cpu_trainer(max_steps=max_steps, callbacks=callbacks, enable_checkpointing=save)
        trainer.fit(module, regression_loader(), ckpt_path=ckpt_path)  # 8 batches: step 8 ends an epoch
        effective = {n: m.target.module.weight.detach().clone() for n, m in
                     ((m.target.name, m) for m in switch.matrices)}
        return module, switch, effective

    module, uninterrupted, weights = run(16, save=True)
    ckpt = torch.load(tmp_path / "step=8.ckpt", weights_only=False)
    assert not any("parametrizations" in k for k in ckpt["state_dict"])  # a plain checkpoint...
    plain = TinyMLPModule()
    plain.load_state_dict(ckpt["state_dict"])  # ...that loads without the callback
    resumed_module, resumed, resumed_weights = run(16, ckpt_path=tmp_path / "step=8.ckpt")
    assert resumed.history == uninterrupted.history
    for name in weights:
        assert torch.equal(resumed_weights[name], weights[name]), name
    for a, b in zip(resumed_module.parameters(), module.parameters()):
        assert torch.equal(a, b)
    assert all(factorization.is_factorized(m.target.module, m.attr) for m in resumed.matrices)


class GradientSpy(L.Callback):
    def __init__(self, sink, switch):
        self.sink, self.switch = sink, switch

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.sink.append({m.target.name: (m.target.param.grad.clone(), m.state, m.U_prev, m.r)
                          for m in self.switch.matrices})


def test_project_removes_the_principal_component_of_the_gradient_exactly():
    module, loader = build("cnn", optimizer="sgd")  # a non-GPT model with conv kernels
    switch = AdaptiveSVDSwitch(minor_training="project", schedule=Schedule(every_n_steps=3, start_step=3),
                               skip_full_gradient=False, **ALWAYS_MINOR)  # the spy before it sees the raw gradient
    raw, projected = [], []
    trainer = cpu_trainer(max_steps=7, callbacks=[GradientSpy(raw, switch), switch, GradientSpy(projected, switch)])
    trainer.fit(module, loader)
    checked = 0
    for before, after in zip(raw[3:], projected[3:]):
        for name, (grad, _, _, _) in before.items():
            projected_grad, mode, U, r = after[name]
            assert mode == "minor"
            U = U.double()
            k = U.shape[1] - r
            G = as_matrix(grad).double()
            assert torch.allclose(as_matrix(projected_grad).double(), U[:, k:] @ (U[:, k:].mT @ G), atol=1e-7)
            assert (U[:, :k].mT @ as_matrix(projected_grad).double()).abs().max() < 1e-6 * G.abs().max()
            checked += 1
    assert checked == 4 * len(switch.matrices)
    assert all(torch.equal(raw[s][n][0], projected[s][n][0]) for s in range(3) for n in raw[s])  # full mode: untouched


class TiedAutoencoder(L.LightningModule):
    """An autoencoder whose decoder is its encoder's transpose: the encoder's weight gets gradient from its
    own forward and from the decoder's direct read."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.mix, self.encoder, self.out = nn.Linear(8, 8), nn.Linear(8, 4), nn.Linear(8, 8)

    def training_step(self, batch, batch_idx):
        x, = batch
        code = torch.relu(self.encoder(torch.relu(self.mix(x))))
        return F.mse_loss(self.out(F.linear(code, self.encoder.weight.mT)), x)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_tied_weight_fails_the_tap_check_and_trains_by_the_plain_projection():
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(48, 8)), batch_size=8)
    weights = {}
    for skip in (True, False):
        module = TiedAutoencoder()
        switch = AdaptiveSVDSwitch(schedule=Schedule(steps=[0]), skip_full_gradient=skip,
                                   selection={"include": ["mix.weight", "encoder.weight"]}, **ALWAYS_MINOR)
        with pytest.warns(UserWarning, match=r"'encoder\.weight' gets gradient from more than its Linear") if skip \
                else nullcontext():
            cpu_trainer(max_steps=5, callbacks=[switch]).fit(module, loader)
        checked = {m.target.name: m.tap_checked for m in switch.matrices}
        assert checked == ({"mix.weight": True, "encoder.weight": False} if skip else
                           {"mix.weight": None, "encoder.weight": None})
        weights[skip] = {n: p.detach().clone() for n, p in module.named_parameters()}
    for name, value in weights[True].items():  # the encoder: the same plain projection; the rest: equal sums
        torch.testing.assert_close(value, weights[False][name], rtol=1e-6, atol=1e-7, msg=name)


class Engaged(L.Callback):
    """Records, per step, the weights training without their own gradient (a tap computes it)."""

    def __init__(self):
        self.steps = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.steps[trainer.global_step] = {n for n, p in pl_module.named_parameters() if not p.requires_grad}


def test_an_exception_mid_fit_gives_every_weight_its_gradient_back():
    module, loader = build("gpt")

    class Boom(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 7:
                raise RuntimeError("boom")

    engaged = Engaged()
    # the GPT's head and output projections start at zero: by step 3 every block matrix has a gradient
    switch = AdaptiveSVDSwitch(schedule=Schedule(steps=[3]), skip_full_gradient=True, **ALWAYS_MINOR)
    with pytest.raises(RuntimeError, match="boom"):
        cpu_trainer(max_steps=9, callbacks=[switch, engaged, Boom()]).fit(module, loader)
    tapped = {m.target.name for m in switch.matrices}
    assert engaged.steps[3] == engaged.steps[4] == set() and engaged.steps[5] == engaged.steps[6] == tapped
    assert all(p.requires_grad for p in module.parameters())
    assert not any(m._forward_hooks for m in module.modules())


def fp16_with_a_loss_scale():
    """float16 autocast with a GradScaler, on CPU (Lightning maps "16-mixed" to bf16 there): the weights'
    gradients are unscaled before on_before_optimizer_step, a tap's C is not."""
    return dict(plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=1024.0))])


@pytest.mark.parametrize("case", ["float32", "bf16-mixed", "fp16-scaled", "accumulate-clip"])
def test_taps_train_as_the_plain_projection(case):
    """The package GPT, every block matrix minor from step 3: the tapped run (every tap's check passed and the taps
    engaged from step 5) against projecting the full gradient after the backward, in float32, under bf16
    autocast, under float16 autocast with a loss scale, and with gradient accumulation and clipping."""
    def options():  # a fresh scaler for each fit
        return {"float32": {}, "bf16-mixed": dict(precision="bf16-mixed"), "fp16-scaled": fp16_with_a_loss_scale(),
                # micro-batches add up; clipping sees U_m C
                "accumulate-clip": dict(accumulate_grad_batches=2, gradient_clip_val=0.05)}[case]

    weights, engaged = {}, Engaged()
    for skip in (True, False):
        torch.manual_seed(0)
        module, loader = build("gpt")
        switch = AdaptiveSVDSwitch(schedule=Schedule(steps=[3]), skip_full_gradient=skip, **ALWAYS_MINOR)
        cpu_trainer(max_steps=8, callbacks=[switch, engaged] if skip else [switch], **options()).fit(module, loader)
        weights[skip] = {n: p.detach().clone() for n, p in module.named_parameters()}
    assert engaged.steps[7] == {m.target.name for m in switch.matrices}
    for name, value in weights[True].items():
        if case in ("float32", "accumulate-clip"):
            torch.testing.assert_close(value, weights[False][name], rtol=1e-5, atol=1e-5, msg=name)
        else:  # bf16/fp16 round the two orders of summation apart: within bf16's unit roundoff 2⁻⁸, in norm
            assert (value - weights[False][name]).norm() <= 2**-8 * weights[False][name].norm(), name


def test_dash_takes_the_whole_gradient_of_a_tapped_weight():
    """DASHShrink's own gradient pass at an epoch start, while the taps are engaged, sees each weight's full
    gradient (the taps lifted), as it does when the switch projects after the backward."""
    weights = {}
    for skip in (True, False):
        torch.manual_seed(0)
        module, loader = build("gpt")  # 8 batches an epoch: DASH acts at step 8, the taps engaged from step 5
        switch = AdaptiveSVDSwitch(schedule=Schedule(steps=[3]), skip_full_gradient=skip, **ALWAYS_MINOR)
        dash = DASHShrink(schedule=Schedule(epochs=[1]), n_batches=2, gradient_mode="train")
        cpu_trainer(max_steps=9, callbacks=[switch, dash]).fit(module, loader)
        assert dash.shrinks == 1 and all(p.requires_grad for p in module.parameters())
        weights[skip] = {n: p.detach().clone() for n, p in module.named_parameters()}
    for name, value in weights[True].items():
        torch.testing.assert_close(value, weights[False][name], rtol=1e-5, atol=1e-5, msg=name)


def test_a_weight_frozen_between_fits_stays_frozen_and_the_others_are_tapped_again():
    """Fit once (every block matrix minor and tapped), freeze one tapped weight, fit again with the same callback:
    the frozen weight is not tapped, does not move and is still frozen after the fit; the others are tapped in
    the second fit too, and no hook remains after either."""
    torch.manual_seed(0)
    module, loader = build("gpt")
    switch = AdaptiveSVDSwitch(schedule=Schedule(steps=[3]), skip_full_gradient=True, **ALWAYS_MINOR)
    for fit in range(2):
        engaged = Engaged()
        if fit == 1:
            frozen = module.model.blocks[0].mlp.c_fc.weight
            frozen.requires_grad_(False)
            before = frozen.detach().clone()
        cpu_trainer(max_steps=8, callbacks=[switch, engaged]).fit(module, loader)  # a new trainer: steps 0–7 again
        names = {m.target.name for m in switch.matrices}
        assert engaged.steps[7] == names, fit  # tapped, or (the frozen one) frozen by the user
        assert not any(m._forward_hooks for m in module.modules())
    assert [n for n, p in module.named_parameters() if not p.requires_grad] == ["model.blocks.0.mlp.c_fc.weight"]
    assert torch.equal(frozen, before)  # a tap would have written its gradient, and the optimizer moved it
    matrix = next(m for m in switch.matrices if m.target.name == "model.blocks.0.mlp.c_fc.weight")
    assert matrix.tap_checked is True  # tapped in the first fit (a frozen weight has no gradient to go minor on)


def test_a_callback_adding_to_the_gradient_first_does_not_fail_the_check():
    """L2Init before the switch adds λ(θ − θ₀) to every gradient in on_before_optimizer_step; the taps' check
    reads the gradients right after the backward, so it still passes."""
    from plasticity_callbacks import L2Init

    torch.manual_seed(0)
    module, loader = build("gpt")
    switch = AdaptiveSVDSwitch(schedule=Schedule(steps=[3]), skip_full_gradient=True, **ALWAYS_MINOR)
    cpu_trainer(max_steps=6, callbacks=[L2Init(strength=1.0), switch]).fit(module, loader)
    assert all(m.tap_checked is True for m in switch.matrices)


class ManualOptimization(L.LightningModule):
    """Manual optimization; ``direct``: ``loss.backward()`` instead of ``manual_backward`` (no on_after_backward)."""

    def __init__(self, direct: bool):
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization, self.direct = False, direct
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        optimizer = self.optimizers()
        optimizer.zero_grad()
        loss = F.mse_loss(self.net(x), y)
        loss.backward() if self.direct else self.manual_backward(loss)
        optimizer.step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("direct", [False, True])
def test_taps_under_manual_optimization(direct):
    """Both backward calls complete the taps' check (without on_after_backward it runs at the optimizer step)
    and train as the projection after the backward."""
    weights = {}
    for skip in (True, False):
        module = ManualOptimization(direct)
        switch = AdaptiveSVDSwitch(schedule=Schedule(steps=[2]), skip_full_gradient=skip, **ALWAYS_MINOR)
        cpu_trainer(max_steps=8, callbacks=[switch]).fit(module, regression_loader())
        assert [m.tap_checked for m in switch.matrices] == [True, True] if skip else [None, None]
        weights[skip] = [p.detach().clone() for p in module.parameters()]
    for a, b in zip(*weights.values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_an_explicit_skip_full_gradient_that_cannot_act_says_so():
    module, loader = build("mlp")
    switch = AdaptiveSVDSwitch(minor_training="factorize", skip_full_gradient=True, schedule=Schedule(steps=[1]),
                               **ALWAYS_MINOR)
    with pytest.warns(UserWarning, match=r"skip_full_gradient=True\) has no effect here: minor_training='factorize'"):
        cpu_trainer(max_steps=2, callbacks=[switch]).fit(module, loader)


def test_logs_and_figure(tmp_path):
    module, loader = build("mlp")
    switch = AdaptiveSVDSwitch(minor_training="project", schedule=Schedule(every_n_steps=2, start_step=2),
                               r_min=2, thresholds={"clobber_alignment": 0.0})
    trainer = cpu_trainer(max_steps=5, callbacks=[switch], default_root_dir=tmp_path)
    trainer.fit(module, loader)
    metrics = trainer.callback_metrics
    assert metrics["adaptive_svd/n_minor"] == 2
    for key in ("angle", "principal_alignment", "minor_alignment", "reconstruction_error", "effective_rank", "r",
                "minor"):
        assert f"adaptive_svd/net.0.weight/{key}" in metrics
    assert (tmp_path / "figures" / "adaptive_svd_modes.png").is_file()


@pytest.mark.parametrize("kwargs,match", [
    (dict(minor_training="lora"), "minor_training"), (dict(schedule={"every_n_steps": 0}), "every_n_steps"),
    (dict(schedule={"epochs": [1]}), "only at steps"), (dict(svd={"method": "lowrank"}), "randomized"),
    (dict(r_min=0), "r_min"), (dict(selection={"scope": "conv"}), "scope"),
    (dict(thresholds={"stable_angle": 2.0}), "stable_angle"), (dict(thresholds={"clobber_alignment": 1.5}), "clobber_alignment"),
    (dict(svd={"method": "qr"}), "method"), (dict(svd={"dtype": "float16"}), "dtype"), (dict(initial_rank=0), "initial_rank"),
    (dict(thresholds={"stable": 0.1}), "unknown field"),
])
def test_arguments_are_validated(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AdaptiveSVDSwitch(**kwargs)


def test_factorize_refuses_ddp_with_a_pointer_to_project():
    fake = SimpleNamespace(strategy=DDPStrategy())
    with pytest.raises(MisconfigurationException, match="minor_training='project'"):
        AdaptiveSVDSwitch(minor_training="factorize").setup(fake, TinyMLPModule(), "fit")


@pytest.mark.multiprocess
@pytest.mark.ddp_run({"_target_": "plasticity_callbacks.AdaptiveSVDSwitch", "minor_training": "project",
                      "schedule": {"every_n_steps": 2, "start_step": 2}, "r_min": 2,
                      "thresholds": {"clobber_alignment": 0.0}, "save_figure": False}, model="gpt", steps=6)
def test_project_mode_keeps_ddp_ranks_identical(ddp_run):
    results = ddp_run
    assert_ranks_identical(results)
    assert results[0]["metrics"]["adaptive_svd/n_minor"] == 12  # every matrix projected: the test is not vacuous


class GradientRecorder(L.Callback):
    """Each step's gradients of the expert stacks as this callback sees them in on_before_optimizer_step."""

    def __init__(self, names):
        self.names, self.seen = names, {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        params = dict(pl_module.named_parameters())
        self.seen[trainer.global_step] = {n: params[n].grad.detach().clone() for n in self.names}


class MomentumWrapped:
    """A zoo model under SGD with momentum and lr 0: the weights stay, the momentum buffers gather gradients."""

    @staticmethod
    def build(family):
        from model_zoo import Wrapped

        class Module(Wrapped):
            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.0, momentum=0.9)
        return Module(family)


def expert_reference(stack: torch.Tensor, transposed: bool, e: int) -> torch.Tensor:
    """Expert ``e``'s ``(out, in)`` matrix of a stored stack, in float64: the independent reading of the layout."""
    matrix = stack[e].double()
    return matrix.mT if transposed else matrix


@pytest.mark.parametrize("family,transposed", [("qwen3_moe", False), ("gpt_oss", True)])
def test_each_expert_is_its_own_matrix_svd_and_projection(family, transposed):
    """A transformers 5.x MoE from a tiny random config: every expert matrix of every stack gets its own SVD (σ equal
    to a float64 SVD of that expert alone), its own state and r, and between cycles its gradient (and, at a cycle,
    its momentum) projected onto its own minor left subspace, the other experts' blocks by theirs."""
    module = MomentumWrapped.build(family)
    stacks = {n: p for n, p in module.named_parameters() if p.dim() == 3}
    assert stacks  # the family stores its experts as 3-D stacks
    before, after = GradientRecorder(list(stacks)), GradientRecorder(list(stacks))
    switch = AdaptiveSVDSwitch(schedule=Schedule(every_n_steps=2, start_step=2), svd={"dtype": "float64"},
                               log_per_matrix=False, **ALWAYS_MINOR)
    cpu_trainer(max_steps=6, callbacks=[before, switch, after]).fit(module)
    experts = [m for m in switch.matrices if m.expert is not None]
    n_experts = next(iter(stacks.values())).shape[0]
    assert len(experts) == n_experts * len(stacks)  # each expert of each stack, none merged
    cycles = {step for step, *_ in switch.history}
    assert cycles == {2, 4}
    minor = 0
    for m in experts:
        W = expert_reference(stacks[m.target.name].detach(), transposed, m.expert)
        U, S, _ = torch.linalg.svd(W, full_matrices=False)
        torch.testing.assert_close(m.S_prev, S, atol=1e-10, rtol=0)  # lr 0: the weights the cycle saw
        assert m.name == f"{m.target.name}[{m.expert}]" and (4, m.name, m.state, m.r) in switch.history
        g = S.numel()
        if m.state == "minor":
            minor += 1
            P = U[:, g - m.r:] @ U[:, g - m.r:].mT  # this expert's own minor projector
            torch.testing.assert_close(m.U_minor @ m.U_minor.mT, P, atol=1e-8, rtol=0)
        else:
            P = torch.eye(W.shape[0], dtype=torch.float64)
        for step in (3, 5):  # steps between cycles: the gradient as the optimizer gets it
            raw = expert_reference(before.seen[step][m.target.name], transposed, m.expert)
            got = expert_reference(after.seen[step][m.target.name], transposed, m.expert)
            torch.testing.assert_close(got, P @ raw, atol=1e-6 * float(raw.norm()) + 1e-12, rtol=0)
        buffer = module.trainer.optimizers[0].state[stacks[m.target.name]]["momentum_buffer"]
        buffer = expert_reference(buffer, transposed, m.expert)  # projected at the cycle, projected gradients since
        torch.testing.assert_close(P @ buffer, buffer, atol=1e-6 * float(buffer.norm()) + 1e-12, rtol=0)
    assert 0 < minor  # the check above covers minor experts, and their neighbours' blocks stay whole


def test_expert_stacks_refused_where_per_expert_training_is_not_done(monkeypatch):
    """Factorize (one parametrization per parameter) and FSDP2 (a sharded cycle splits one matrix by rows) do not
    train a stack per expert: each refuses, naming the stacks and the fix; the router and the rest are treated."""
    from model_zoo import Wrapped
    from plasticity_callbacks.callbacks import adaptive_svd

    module = Wrapped("mixtral")
    with pytest.raises(ValueError, match=r"factorize.*experts\.gate_up_proj.*stacks of expert matrices.*'project'"):
        AdaptiveSVDSwitch(minor_training="factorize").check_targets(None, module)
    switch = AdaptiveSVDSwitch()
    switch.check_targets(None, module)
    names = [m.name for m in switch.matrices]
    assert {"model.model.layers.0.mlp.experts.gate_up_proj[3]", "model.model.layers.0.mlp.experts.down_proj[0]",
            "model.model.layers.0.mlp.gate.weight"} <= set(names)
    stacks = {id(p) for p in module.parameters() if p.dim() == 3}
    monkeypatch.setattr(adaptive_svd, "is_dtensor", lambda t: id(t) in stacks)  # as fully_shard leaves them
    with pytest.raises(MisconfigurationException, match=r"experts\.down_proj.*sharded by FSDP2.*'\*\.experts\.down_proj'"):
        switch.attach(None, module)


def test_the_package_moe_blocks_experts_each_get_their_own_cycle():
    """The package's own MoE MLP (models/blocks/moe.py, (E, 2I, d) and (E, d, I) stacks): at a cycle each expert's
    σ equal a float64 SVD of that expert alone, and the step's gradient of each minor expert is projected by its own
    minor subspace, the blocks of experts left full untouched."""
    from tiny import tiny_gpt_module, token_loader

    torch.manual_seed(0)
    module = tiny_gpt_module(mlp="moe", mlp_options={"n_experts": 4, "top_k": 2}, n_layer=1)
    with torch.no_grad():  # down_proj, c_proj and the head start at zero (no spectrum, no gradient): random
        for p in module.parameters():
            if p.dim() >= 2 and not p.any():
                p.normal_(0, 0.1)
    switch = AdaptiveSVDSwitch(svd={"dtype": "float64"}, **ALWAYS_MINOR)
    switch.check_targets(None, module)
    x, y = next(iter(token_loader(vocab=module.model.config.vocab_size)))
    module.training_step((x, y), 0)["loss"].backward()
    stacks = {n: p for n, p in module.named_parameters() if p.dim() == 3}
    raw = {n: p.grad.detach().double().clone() for n, p in stacks.items()}
    switch._cycle(SimpleNamespace(global_step=3, optimizers=[]), module)
    experts = [m for m in switch.matrices if m.expert is not None]
    assert len(experts) == 4 * len(stacks) == 8
    for m in experts:
        W = stacks[m.target.name].detach()[m.expert].double()
        U, S, _ = torch.linalg.svd(W, full_matrices=False)
        torch.testing.assert_close(m.S_prev, S, atol=1e-10, rtol=0)
        P = U[:, -m.r:] @ U[:, -m.r:].mT if m.state == "minor" else torch.eye(W.shape[0], dtype=torch.float64)
        got = stacks[m.target.name].grad[m.expert].double()
        torch.testing.assert_close(got, P @ raw[m.target.name][m.expert], atol=1e-6, rtol=1e-5)
    assert any(m.state == "minor" for m in experts)
