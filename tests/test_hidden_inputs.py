"""``HiddenInputReaders``: a ``down`` layer's input reaches its reader through the owning block's free
``hidden_observer`` slot, else through a pre-hook, exactly as a plain pre-hook sees it; ``remove`` undoes both."""
from __future__ import annotations

import lightning as L
import torch
from torch import nn

from plasticity_callbacks.callbacks.continual_backprop import ContinualBackprop
from plasticity_callbacks.model_map.hidden_inputs import HiddenInputReaders
from tiny import cpu_trainer, tiny_gpt_module, token_loader


def test_a_free_slot_else_a_pre_hook_hands_over_down_input_and_remove_undoes_both():
    torch.manual_seed(0)
    model = tiny_gpt_module().model
    mlps = [block.mlp for block in model.blocks]
    plain = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    expected = []  # what a pre-hook of the test's own sees
    own = [mlp.c_proj.register_forward_pre_hook(lambda m, args: expected.append(args[0].clone())) for mlp in mlps]
    own.append(plain[2].register_forward_pre_hook(lambda m, args: expected.append(args[0].clone())))

    first, second, third = HiddenInputReaders(), HiddenInputReaders(), HiddenInputReaders()
    seen = {"first": [], "second": [], "third": []}
    first.reset(model)
    second.reset(model)
    third.reset(plain)
    for mlp in mlps:
        first.read(mlp.c_proj, lambda m, h: seen["first"].append((m, h.clone())))
        second.read(mlp.c_proj, lambda m, h: seen["second"].append((m, h.clone())))  # the slot is taken: a hook
    third.read(plain[2], lambda m, h: seen["third"].append((m, h.clone())))
    assert all(mlp.hidden_observer is not None for mlp in mlps)
    assert [len(mlp.c_proj._forward_pre_hooks) for mlp in mlps] == [2] * len(mlps)

    model.train()
    model(torch.randint(0, 256, (2, 16)))
    plain(torch.randn(4, 5))
    assert [m for m, _ in seen["first"]] == mlps  # the block hands itself over
    assert [m for m, _ in seen["second"]] == [mlp.c_proj for mlp in mlps]
    assert [m for m, _ in seen["third"]] == [plain[2]]
    for got, want in zip([h for name in seen for _, h in seen[name]], expected[:2] + expected[:2] + expected[2:]):
        assert torch.equal(got, want)

    for readers in (first, second, third, first):  # a second remove does nothing
        readers.remove()
    assert all(mlp.hidden_observer is None for mlp in mlps)
    assert [len(mlp.c_proj._forward_pre_hooks) for mlp in mlps] == [1] * len(mlps)
    assert len(plain[2]._forward_pre_hooks) == 1
    for handle in own:
        handle.remove()


def test_continual_backprop_reads_the_same_through_the_slot_as_through_hooks():
    """ContinualBackprop on our GPT takes the MLPs' free slots; with the slots taken it falls back to pre-hooks,
    and both fits end with the same statistics, replacements and weights."""

    def fit(take_slots: bool):
        torch.manual_seed(0)
        module = tiny_gpt_module()
        mlps = [block.mlp for block in module.model.blocks]
        if take_slots:
            for mlp in mlps:
                mlp.hidden_observer = lambda block, h: None
        cbp = ContinualBackprop(replacement_rate=0.2, maturity_threshold=1, bias_correction=False, seed=1)
        observers = []

        class Observers(L.Callback):
            def on_train_batch_start(self, *args):
                observers.append([mlp.hidden_observer for mlp in mlps])

        cpu_trainer(max_steps=4, callbacks=[cbp, Observers()]).fit(module, token_loader())
        return module, cbp, observers, [mlp.hidden_observer for mlp in mlps]

    slotted, through_slots, during, after = fit(False)
    hooked, through_hooks, _, taken = fit(True)
    assert all(type(o).__name__ == "_Collector" for step in during for o in step)
    assert after == [None, None] and all(t is not None for t in taken)  # the slots are left as found
    assert through_slots.replaced == through_hooks.replaced > 0
    for ours, theirs in zip(through_slots.stats, through_hooks.stats):
        for key in ours:
            assert torch.equal(ours[key], theirs[key])
    for ours, theirs in zip(slotted.parameters(), hooked.parameters()):
        assert torch.equal(ours, theirs)
