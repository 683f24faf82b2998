"""ReDoMonitor on hand-built networks with known dead neurons, the GPT's MLPs, a CNN, resume and DDP."""
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from lightning.pytorch.loggers import CSVLogger
from omegaconf import OmegaConf
from torch import nn

from ddp_harness import assert_ranks_identical
from plasticity_callbacks import ReDoMonitor
from plasticity_callbacks.callbacks.schedule import Schedule
from plasticity_callbacks.model_map import Selection
from plasticity_callbacks.functional.dormancy import dormant_mask
from tiny import OPTIMIZERS, TinyCNNModule, TinyMLPModule, cpu_trainer, image_loader, regression_loader, \
    tiny_gpt_module, token_loader

DEAD = [1, 5, 11]


def dead_mlp(optimizer="adamw"):
    """TinyMLPModule whose first hidden layer has DEAD units: bias -100 keeps ReLU at exactly 0."""
    module = TinyMLPModule(optimizer=optimizer)
    with torch.no_grad():
        module.net[0].bias[DEAD] = -100.0
    return module


class CaptureMeanAbs(L.Callback):
    """Independent record of mean |h| per training batch at the output of the given activation modules."""

    def __init__(self, modules: dict[str, nn.Module], reduce_dims):
        self.records = {name: [] for name in modules}
        self.modules, self.reduce_dims = modules, reduce_dims

    def on_fit_start(self, trainer, pl_module):
        for name, module in self.modules.items():
            module.register_forward_hook(
                lambda m, i, out, name=name: self.records[name].append(
                    out.detach().double().abs().mean(self.reduce_dims)) if m.training else None)


def ema_scores(values, decay):
    ema = values[0]
    for v in values[1:]:
        ema = decay * ema + (1 - decay) * v
    return ema / ema.mean()


def test_reports_exactly_the_dead_neurons_and_matches_an_independent_ema(tmp_path):
    module = dead_mlp()
    capture = CaptureMeanAbs({"net.0": module.net[1], "net.2": module.net[3]}, reduce_dims=0)
    redo = ReDoMonitor(collect_every_n_steps=1, log_every_n_steps=3, ema_decay=0.7, tau=0.1, plot_scores=True)
    trainer = cpu_trainer(max_steps=6, callbacks=[capture, redo], limit_train_batches=4, limit_val_batches=2,
                          logger=CSVLogger(tmp_path, name="logs"))
    trainer.fit(module, regression_loader(), regression_loader(seed=1))  # validation after step 4: not collected

    assert redo.collections == 6 and all(len(r) == 6 for r in capture.records.values())
    scores = redo.scores()
    for name in ("net.0", "net.2"):
        torch.testing.assert_close(scores[name].double(), ema_scores(capture.records[name], 0.7), rtol=1e-5, atol=1e-7)
    assert dormant_mask(scores["net.0"], 0.0).nonzero().flatten().tolist() == DEAD
    metrics = trainer.callback_metrics
    assert float(metrics["redo/dead/net.0"]) == pytest.approx(3 / 16)
    expected_dormant = sum(int(dormant_mask(s, 0.1).sum()) for s in scores.values()) / 32
    assert float(metrics["redo/dormant"]) == pytest.approx(expected_dormant)
    assert "redo/recycled" not in metrics, "recycling is off by default"
    assert all(not layer.down._forward_pre_hooks for layer in redo.layers), "hooks must be removed after fit"
    assert list(Path(tmp_path).rglob("redo_scores_step6.png"))


def test_collects_only_every_n_steps():
    redo = ReDoMonitor(collect_every_n_steps=2)
    cpu_trainer(max_steps=5, callbacks=[redo]).fit(TinyMLPModule(), regression_loader())
    assert redo.collections == 3  # steps 0, 2, 4


class RecycleProbe(L.Callback):
    """Around ReDo's action at ``step``: output on a fixed input, parameters and randomized optimizer state."""

    def __init__(self, step, x, before: bool, shared: dict):
        self.step, self.x, self.before, self.shared = step, x, before, shared

    @torch.no_grad()
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step != self.step:
            return
        key = "before" if self.before else "after"
        pl_module.eval()  # no statistics from this probe, neither ReDo's nor the test's
        self.shared[f"out_{key}"] = pl_module(self.x).clone()
        pl_module.train()
        self.shared[f"params_{key}"] = {n: p.clone() for n, p in pl_module.named_parameters()}
        states = {}
        for p, state in trainer.optimizers[0].state.items():
            for k, v in state.items():
                if torch.is_tensor(v) and v.shape == p.shape:
                    if self.before:  # random moments, so that zeroing cannot pass by accident
                        v.copy_(torch.rand_like(v) + 0.5)
                    states[(id(p), k)] = v.clone()
        self.shared[f"opt_{key}"] = states


def run_with_probes(module, loader, x, redo, step, max_steps):
    shared = {}
    callbacks = [RecycleProbe(step, x, True, shared), redo, RecycleProbe(step, x, False, shared)]
    trainer = cpu_trainer(max_steps=max_steps, callbacks=callbacks)
    trainer.fit(module, loader)
    return shared, trainer


def assert_only_slices_changed(shared, module, sliced: dict):
    """``sliced``: {param name: (dim, mask)} whose masked slices may change; everything else is untouched."""
    named = dict(module.named_parameters())
    ids = {id(p): n for n, p in named.items()}
    for (pid, key), before in shared["opt_before"].items():
        after = shared["opt_after"][(pid, key)]
        name = ids[pid]
        if name in sliced:
            dim, mask = sliced[name]
            idx = (mask,) if dim == 0 else (slice(None), mask)
            keep = (~mask,) if dim == 0 else (slice(None), ~mask)
            assert float(after[idx].abs().sum()) == 0.0, f"{name}.{key}: recycled slice not zeroed"
            assert torch.equal(after[keep], before[keep]), f"{name}.{key}: other slices changed"
        else:
            assert torch.equal(after, before), f"{name}.{key} changed"
    for name in named:
        before, after = shared["params_before"][name], shared["params_after"][name]
        if name not in sliced:
            assert torch.equal(before, after), f"{name} changed"


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_recycling_dead_mlp_neurons(optimizer):
    module = dead_mlp(optimizer)
    redo = ReDoMonitor(collect_every_n_steps=1, log_every_n_steps=1, tau=0.0, schedule=Schedule(steps=[3]))
    x = torch.randn(16, 8)
    shared, trainer = run_with_probes(module, regression_loader(), x, redo, step=3, max_steps=7)

    torch.testing.assert_close(shared["out_after"], shared["out_before"], rtol=0, atol=1e-6)
    mask = torch.zeros(16, dtype=torch.bool)
    mask[DEAD] = True
    before, after = shared["params_before"], shared["params_after"]
    assert not torch.equal(after["net.0.weight"][mask], before["net.0.weight"][mask]), "rows not re-sampled"
    assert float(after["net.0.bias"][mask].abs().sum()) == 0.0
    assert float(after["net.2.weight"][:, mask].abs().sum()) == 0.0
    dead2 = before["net.2.weight"].new_zeros(16, dtype=torch.bool)  # net.2 has no dead units here
    assert_only_slices_changed(shared, module, {"net.0.weight": (0, mask), "net.0.bias": (0, mask),
                                                "net.2.weight": (1, mask), "net.2.bias": (0, dead2),
                                                "net.4.weight": (1, dead2)})
    # After recycling: the units fire again and learn outgoing weights; nothing is recycled twice.
    scores = redo.scores()["net.0"]
    assert bool((scores[mask] > 0.05).all()), scores[mask]
    assert float(module.net[2].weight[:, mask].abs().sum()) > 0
    assert int(redo._recycled[0]) == 3 and int(redo._recycled[1]) == 0
    assert redo.firing.fired == [(3, "step 3")]


@pytest.mark.parametrize("mlp", ["relu2", "swiglu", "geglu"])
def test_gpt_mlps_scores_and_recycling(mlp):
    module = tiny_gpt_module(mlp=mlp)
    blocks = module.model.blocks
    with torch.no_grad():
        blocks[0].mlp.c_fc.weight[7] = 0.0  # unit 7 of block 0 outputs exactly 0 for every MLP kind

    independent = {}

    def neuron_values(mlp_block, args):  # the hidden unit, computed from the block's own input
        if not mlp_block.training:
            return
        x = args[0].detach().double()
        up = F.linear(x, mlp_block.c_fc.weight.double())
        if hasattr(mlp_block, "c_gate"):
            h = mlp_block.activation(F.linear(x, mlp_block.c_gate.weight.double())) * up
        else:
            h = F.relu(up).square()
        independent[mlp_block] = h.abs().mean(dim=(0, 1))

    for block in blocks:
        block.mlp.register_forward_pre_hook(neuron_values)
    redo = ReDoMonitor(collect_every_n_steps=1, log_every_n_steps=1, ema_decay=0.0, tau=0.0,
                       schedule=Schedule(every_n_steps=3))
    shared, trainer = run_with_probes(module, token_loader(), torch.randint(0, 256, (2, 16)), redo, step=3, max_steps=3)

    names = [layer.name for layer in redo.layers]
    assert names == ["model.blocks.0.mlp", "model.blocks.1.mlp"]
    scores = redo.scores()
    for name, block in zip(names, blocks):
        values = independent[block.mlp]
        torch.testing.assert_close(scores[name].double(), values / values.mean(), rtol=1e-4, atol=1e-6)
    assert trainer.callback_metrics["redo/recycled/model.blocks.0.mlp"] == 1
    assert trainer.callback_metrics["redo/recycled/model.blocks.1.mlp"] == 0
    torch.testing.assert_close(shared["out_after"], shared["out_before"], rtol=0, atol=1e-6)
    before, after = shared["params_before"], shared["params_after"]
    prefix = "model.blocks.0.mlp"
    assert float(after[f"{prefix}.c_fc.weight"][7].abs().sum()) > 0
    assert float(after[f"{prefix}.c_proj.weight"][:, 7].abs().sum()) == 0
    if mlp != "relu2":
        assert not torch.equal(after[f"{prefix}.c_gate.weight"][7], before[f"{prefix}.c_gate.weight"][7])
        assert torch.equal(after[f"{prefix}.c_gate.weight"][:7], before[f"{prefix}.c_gate.weight"][:7])
    assert torch.equal(after[f"{prefix}.c_fc.weight"][8:], before[f"{prefix}.c_fc.weight"][8:])


def test_cnn_channel_recycling():
    module = TinyCNNModule()
    with torch.no_grad():
        module.features[0].bias[2] = -100.0
    capture = CaptureMeanAbs({"features.0": module.features[1]}, reduce_dims=(0, 2, 3))
    redo = ReDoMonitor(collect_every_n_steps=1, log_every_n_steps=1, ema_decay=0.0, tau=0.0,
                       schedule=Schedule(steps=[4]))
    shared = {}
    x = torch.randn(4, 3, 8, 8)
    callbacks = [capture, RecycleProbe(4, x, True, shared), redo, RecycleProbe(4, x, False, shared)]
    trainer = cpu_trainer(max_steps=4, callbacks=callbacks)
    trainer.fit(module, image_loader())

    # features.2 feeds the head through pooling and flatten: a layer of channels too
    assert [layer.name for layer in redo.layers] == ["features.0", "features.2"]
    values = capture.records["features.0"][-1]
    torch.testing.assert_close(redo.scores()["features.0"].double(), values / values.mean(), rtol=1e-5, atol=1e-7)
    assert float(trainer.callback_metrics["redo/dead/features.0"]) == pytest.approx(1 / 8)
    assert float(trainer.callback_metrics["redo/recycled"]) == 1
    torch.testing.assert_close(shared["out_after"], shared["out_before"], rtol=0, atol=1e-6)
    assert float(module.features[2].weight[:, 2].abs().sum()) == 0
    assert not torch.equal(shared["params_after"]["features.0.weight"][2], shared["params_before"]["features.0.weight"][2])


class TwoPartMLP(TinyMLPModule):
    """Two up projections feeding slices of one down projection (like the reciprocal MLP)."""

    def __init__(self):
        super().__init__()
        del self.net
        self.c_fc, self.c_fc2, self.c_proj = nn.Linear(8, 5), nn.Linear(8, 3), nn.Linear(8, 4)
        self.unused = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2))  # found, never run

    def neuron_layouts(self):  # read by attribute, as NeuronLayout(up, down, gate, down_offset)
        return [SimpleNamespace(up=self.c_fc, down=self.c_proj, gate=None, down_offset=0),
                SimpleNamespace(up=self.c_fc2, down=self.c_proj, gate=None, down_offset=5)]

    def hidden(self, x):
        return torch.cat([F.relu(self.c_fc(x)), F.relu(self.c_fc2(x))], dim=-1)

    def forward(self, x):
        return self.c_proj(self.hidden(x))


def test_layouts_sharing_one_down_projection():
    module = TwoPartMLP()
    with torch.no_grad():
        module.c_fc2.bias[1] = -100.0  # unit 1 of the second part = input column 6 of c_proj
    x = torch.randn(16, 8)
    redo = ReDoMonitor(collect_every_n_steps=1, ema_decay=0.0, tau=0.0, schedule=Schedule(steps=[2]))
    shared, _ = run_with_probes(module, regression_loader(), x, redo, step=2, max_steps=2)
    assert [(l.name, l.width, l.down_offset) for l in redo.layers] == [("0", 5, 0), ("1", 3, 5), ("unused.0", 4, 0)]
    assert dormant_mask(redo.scores()["1"], 0.0).tolist() == [False, True, False]
    torch.testing.assert_close(shared["out_after"], shared["out_before"], rtol=0, atol=1e-6)
    proj_before, proj_after = shared["params_before"]["c_proj.weight"], shared["params_after"]["c_proj.weight"]
    assert float(proj_after[:, 6].abs().sum()) == 0
    assert torch.equal(proj_after[:, [0, 1, 2, 3, 4, 5, 7]], proj_before[:, [0, 1, 2, 3, 4, 5, 7]])
    # No statistics is not the same as dead: the layer that never ran is left alone.
    assert torch.equal(shared["params_after"]["unused.0.weight"], shared["params_before"]["unused.0.weight"])
    assert int(redo._recycled.sum()) == 1


def test_resume_keeps_statistics_and_counters(tmp_path):
    kwargs = dict(collect_every_n_steps=1, log_every_n_steps=2, schedule=Schedule(every_n_steps=2), tau=0.5)
    first = ReDoMonitor(**kwargs)
    trainer = cpu_trainer(max_steps=4, callbacks=[first])
    trainer.fit(TinyMLPModule(), regression_loader())
    ckpt = tmp_path / "redo.ckpt"
    trainer.save_checkpoint(ckpt)
    saved = first.state_dict()
    assert saved["collections"] == 4 and saved["schedule"]["last_fired_step"] == 4 and int(saved["recycled"].sum()) > 0
    assert first.state_key in torch.load(ckpt, weights_only=False)["callbacks"]

    resumed = ReDoMonitor(**kwargs)
    cpu_trainer(max_steps=4, callbacks=[resumed]).fit(TinyMLPModule(), regression_loader(), ckpt_path=ckpt)
    restored = resumed.state_dict()
    for key, value in saved.items():
        assert torch.equal(restored[key], value) if torch.is_tensor(value) else restored[key] == value, key

    cont = ReDoMonitor(**kwargs)
    cpu_trainer(max_steps=6, callbacks=[cont]).fit(TinyMLPModule(), regression_loader(), ckpt_path=ckpt)
    assert cont.collections == 6 and cont.firing.last_fired_step == 6
    assert int(cont._recycled.sum()) >= int(saved["recycled"].sum())


def test_a_state_written_before_any_fit_loads_into_a_fresh_monitor():
    """A checkpoint can hold a ReDoMonitor that never saw a batch (saved before fit, or by a trainer that
    validated only): its state has no statistics, and a fresh monitor takes it, still empty."""
    state = ReDoMonitor().state_dict()
    fresh = ReDoMonitor()
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state and fresh._pending_state is None


def test_layer_map_and_errors():
    module = TinyMLPModule()
    redo = ReDoMonitor(layer_map={"hidden": ("net.0", "net.2")}, collect_every_n_steps=1)
    cpu_trainer(max_steps=2, callbacks=[redo]).fit(module, regression_loader())
    assert [(l.name, l.up, l.down) for l in redo.layers] == [("hidden", module.net[0], module.net[2])]
    assert redo.collections == 2

    for layer_map, match in [({"x": ("net.9", "net.2")}, "net.9"), ({"x": ("net.4", "net.2")}, "output layer"),
                             ({"x": ("net.2", "net.0")}, "down reads")]:
        with pytest.raises(ValueError, match=match):
            ReDoMonitor(layer_map=layer_map).setup(cpu_trainer(), TinyMLPModule(), "fit")

    class OneLayer(TinyMLPModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 4))

    with pytest.raises(ValueError, match="no neuron layers"):
        ReDoMonitor().setup(cpu_trainer(), OneLayer(), "fit")


@pytest.mark.parametrize("kwargs", [
    dict(tau=-0.1), dict(tau=2.0), dict(collect_every_n_steps=0), dict(log_every_n_steps=1.5), dict(ema_decay=1.0),
    dict(schedule={"every_n_steps": 0}), dict(schedule={"start_step": -1, "steps": [1]}),
    dict(schedule={"at_fit_start": True}), dict(init="kaiming"),
    dict(layer_map={"x": "net.0"}), dict(layer_map={"x": (["a", "b", "c"], "d")}), dict(selection={"exclude": "net.*"}),
])
def test_constructor_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError, match=f"(?i){next(iter(kwargs))}"):
        ReDoMonitor(**kwargs)


def test_hydra_config_instantiates():
    cfg = OmegaConf.load(Path(__file__).parents[1] / "configs" / "callbacks" / "redo.yaml")
    redo = instantiate(cfg.redo)
    assert isinstance(redo, ReDoMonitor) and redo.schedule is None and redo.tau == 0.025
    assert redo.selection == Selection() and redo.layer_map is None
    redo = instantiate(cfg.redo, selection={"scope": "mlp", "exclude": ["blocks.0.*"]})
    assert redo.selection == Selection(scope="mlp", exclude=("blocks.0.*",))


@pytest.mark.multiprocess
@pytest.mark.ddp_run({"_target_": "plasticity_callbacks.ReDoMonitor", "collect_every_n_steps": 1, "log_every_n_steps": 1,
                      "schedule": {"every_n_steps": 2}, "tau": 1.0}, model="gpt", steps=4)
def test_ddp_recycling_keeps_ranks_identical(ddp_run):
    results = ddp_run
    assert_ranks_identical(results)
    metrics = results[0]["metrics"]
    assert float(metrics["redo/recycled"]) > 0, "nothing was recycled: the test would prove nothing"
