"""The compiled GPT and the callbacks under torch.compile: graphs, graph breaks, and that compiled
training sees what the callbacks write. One compiling test (tiny model, several fits in one
process, as a pretrain → SFT pipeline does); the rest check the compile-friendly mechanisms eagerly."""
from dataclasses import replace

import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters
from torch.utils.data import DataLoader, TensorDataset

from plasticity_callbacks import AdaptiveSVDSwitch, DASHPeriodic, FIREReinit, GPTLightningModule, ReDoMonitor, ShrinkPerturb
from plasticity_callbacks.ops import factorization
from tiny import cpu_trainer

TINY = dict(n_layer=2, n_embd=32, n_head=2, n_kv_head=2, sequence_len=16, compile=True)


def repeated_batch(steps: int, batch_size: int = 4, seed: int = 0) -> DataLoader:
    """The same batch at every step, so the last collected activations can be recomputed."""
    tokens = torch.randint(0, 256, (batch_size, 17), generator=torch.Generator().manual_seed(seed)).repeat(steps, 1)
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=batch_size)


def graphs() -> int:
    return counters["stats"]["unique_graphs"]


@pytest.mark.slow  # Inductor compiles the GPT: about a minute of CPU
def test_compiled_gpt_across_fits_with_every_callback():
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    module = GPTLightningModule(TINY, {"lr": 1e-3})

    def fit(callbacks, steps=6):
        before = graphs()
        cpu_trainer(max_steps=steps, callbacks=callbacks).fit(module, repeated_batch(steps))
        return graphs() - before

    assert fit([], steps=3) == 1  # model.compile=true: one Inductor graph, no re-trace at later steps
    x = repeated_batch(1).dataset.tensors[0]
    module.train()
    torch.testing.assert_close(module._compiled_forward(x), module.model(x), rtol=1e-4, atol=1e-4)
    # The rest counts graphs with AOTAutograd but without Inductor's code generation (minutes on a
    # small CPU): graph breaks, guards and in-place updates are decided before code generation.
    module._compiled_forward = torch.compile(module.model.forward, backend="aot_eager", dynamic=False)
    assert fit([]) == 1
    # FIRE, DASH and Shrink & Perturb write weights in place: no re-trace, and the compiled
    # forward reads the new values (it equals the eager forward on the same weights).
    assert fit([FIREReinit(), DASHPeriodic(schedule={"every_n_steps": 2}), ShrinkPerturb()]) == 0
    torch.testing.assert_close(module._compiled_forward(x), module.model(x), rtol=1e-4, atol=1e-4)

    # ReDo attaches after the graph was traced: it still sees every MLP's hidden units. lr=0 and
    # ema_decay=0 make the statistics those of one forward pass, recomputed eagerly below.
    module.optimizer_settings = replace(module.optimizer_settings, lr=0.0)
    redo = ReDoMonitor(collect_every_n_steps=2, log_every_n_steps=2, ema_decay=0.0)
    assert fit([redo]) == 2  # one graph for collecting steps, one for idle steps
    assert redo.collections == 3 and bool(redo._observed.all())
    seen = []
    hooks = [block.mlp.c_proj.register_forward_pre_hook(lambda m, args: seen.append(args[0].abs().mean((0, 1))))
             for block in module.model.blocks]
    with torch.no_grad():
        module.model(x)
    for h in hooks:
        h.remove()
    torch.testing.assert_close(redo._ema, torch.cat(seen), rtol=1e-4, atol=1e-6)
    assert fit([redo]) == 0  # attaching again finds both graphs

    # AdaptiveSVD's factorize mode: one graph for the new structure, one for its gradient-capture
    # steps; the second cycle at the same rank re-splits in place and re-traces nothing.
    module.optimizer_settings = replace(module.optimizer_settings, lr=1e-3)
    switch = AdaptiveSVDSwitch(minor_training="factorize", schedule={"every_n_steps": 3, "start_step": 3},
                               thresholds={"clobber_alignment": 0.0},
                               initial_rank=4, r_min=4, save_figure=False)
    assert fit([switch], steps=10) <= 2
    assert {step for step, *_ in switch.history} == {3, 6, 9}
    assert all(state == "minor" for _, _, state, _ in switch.history)
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_captured_gradient_is_the_effective_weights_gradient_summed_over_micro_batches():
    torch.manual_seed(0)
    layer, reference = nn.Linear(6, 5), nn.Linear(6, 5)
    reference.load_state_dict(layer.state_dict())
    W = layer.weight.detach()
    U, S, Vh = torch.linalg.svd(W)
    B, A = U[:, -2:] * S[-2:].sqrt(), S[-2:].sqrt()[:, None] * Vh[-2:]
    parts = factorization.factorize(layer, "weight", B.contiguous(), A.contiguous())
    parts.capture = True
    for seed in (1, 2):  # two micro-batches
        x = torch.randn(3, 6, generator=torch.Generator().manual_seed(seed))
        (layer(x) ** 2).sum().backward()
        (reference(x) ** 2).sum().backward()
    torch.testing.assert_close(parts.captured, reference.weight.grad)
    parts.capture = False
    assert parts.captured is None and torch.allclose(layer.weight, reference.weight, atol=1e-6)


def test_resplit_keeps_the_effective_weight_and_the_parametrization():
    torch.manual_seed(0)
    layer = nn.Linear(8, 6)
    before = layer.weight.detach().clone()
    parts = factorization.factorize(layer, "weight", torch.randn(6, 2), torch.randn(2, 8))
    cls = type(layer)
    B, A = torch.randn(6, 2), torch.randn(2, 8)
    assert factorization.resplit(layer, "weight", B, A) is parts
    assert type(layer) is cls and torch.equal(parts.B.detach(), B) and torch.equal(parts.A.detach(), A)
    torch.testing.assert_close(layer.weight.detach(), before, rtol=1e-5, atol=1e-5)


def test_hook_based_redo_on_a_model_compiled_before_it_attached_fails_loudly():
    from tiny import TinyMLPModule, regression_loader

    torch._dynamo.reset()
    module = TinyMLPModule()
    module.forward = torch.compile(module.forward, backend="eager")  # Dynamo alone: seconds, not minutes
    cpu_trainer(max_steps=2).fit(module, regression_loader())  # traced without hooks
    # a declared layer_map: no forward at setup, which would have Dynamo trace the graph again
    with pytest.raises(RuntimeError, match="saw no activations.*compiled"):
        cpu_trainer(max_steps=2, callbacks=[ReDoMonitor(collect_every_n_steps=1, layer_map={"mlp": ("net.0", "net.2")})]
                    ).fit(module, regression_loader())
    torch._dynamo.reset()  # traced with the hooks in place, they run
    redo = ReDoMonitor(collect_every_n_steps=1)
    cpu_trainer(max_steps=2, callbacks=[redo]).fit(module, regression_loader())
    assert redo.collections == 2 and bool(redo._observed.all())
