"""FullReset with ``selection={"scope": "head"}`` (``method=head_reset``): the output head alone is drawn afresh by
the model's init and its Adam state dropped; every other parameter and its Adam state stay bit-identical."""
import math

import lightning as L
import pytest
import torch
from tiny import cpu_trainer, tiny_gpt_module, token_loader
from torch.utils.data import DataLoader, TensorDataset

from plasticity_callbacks import FullReset, Selection
from plasticity_callbacks.callbacks.schedule import Schedule
from plasticity_callbacks.distributed.strategy import rank_identical_generator
from plasticity_callbacks.model_map import coverage_report, select_targets
from plasticity_callbacks.models.classifier import DigitsClassifier

STEP, SEED = 3, 5  # the reset acts at the start of step 3, after three Adam steps
HEADS = {"digits": ("network.4.weight", "network.4.bias"), "gpt": ("model.lm_head.weight",)}


def digits_module() -> DigitsClassifier:
    return DigitsClassifier(widths=[32, 256], lr=1e-2)


def build(kind: str):
    if kind == "digits":
        g = torch.Generator().manual_seed(0)
        loader = DataLoader(TensorDataset(torch.randn(64, 64, generator=g), torch.randint(0, 10, (64,), generator=g)),
                            batch_size=16)
        return digits_module(), loader
    return tiny_gpt_module(), token_loader()


class AtStep(L.Callback):
    """Parameters and Adam state at the start of step ``STEP``, as the callbacks listed before it left them."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == STEP:
            optimizer = trainer.optimizers[0]
            self.params = {n: p.detach().clone() for n, p in pl_module.named_parameters()}
            self.state = {n: {k: v.clone() for k, v in optimizer.state.get(p, {}).items()}
                          for n, p in pl_module.named_parameters()}


def reset_head_at_step(kind: str):
    module, loader = build(kind)
    before, after = AtStep(), AtStep()
    reset = FullReset(schedule=Schedule(steps=[STEP]), seed=SEED, selection={"scope": "head"})
    cpu_trainer(max_steps=STEP + 1, callbacks=[before, reset, after]).fit(module, loader)
    return module, before, after


def expected_head(kind: str) -> dict[str, torch.Tensor]:
    """An independent draw: the digits network built again from the reset's seed draws its layers in order, the
    last one being the head; the GPT's init zeroes its head."""
    if kind == "gpt":
        return {"model.lm_head.weight": torch.zeros(264, 32)}
    torch.manual_seed(rank_identical_generator(SEED, STEP).initial_seed())
    fresh = digits_module()
    return {name: p.detach() for name, p in fresh.named_parameters() if name in HEADS["digits"]}


@pytest.mark.parametrize("kind", ["digits", "gpt"])
def test_only_the_head_is_drawn_afresh_and_only_its_adam_state_dropped(kind):
    module, before, after = reset_head_at_step(kind)
    head = HEADS[kind]
    assert set(head) < set(before.params)
    for name, fresh in expected_head(kind).items():
        assert not torch.equal(before.params[name], fresh)  # trained away from its init
        assert (before.params[name] != after.params[name]).all()  # every entry redrawn
        torch.testing.assert_close(after.params[name], fresh, rtol=0, atol=0)
        assert after.state[name] == {} and before.state[name]  # Adam had moments for it; now none
    for name in set(before.params) - set(head):
        assert torch.equal(after.params[name], before.params[name]), name
        assert before.state[name].keys() == after.state[name].keys() == {"step", "exp_avg", "exp_avg_sq"}
        for key, value in before.state[name].items():
            assert torch.equal(after.state[name][key], value), (name, key)


def test_the_digits_head_is_drawn_as_a_linear_layer_draws_it():
    _, _, after = reset_head_at_step("digits")
    weight = after.params["network.4.weight"]  # (10, 256): kaiming_uniform(a=√5) = U(±1/√fan_in)
    bound = 1 / math.sqrt(256)
    assert weight.abs().max() <= bound
    assert weight.std() == pytest.approx(bound / math.sqrt(3), rel=0.1)


@pytest.mark.parametrize("kind", ["digits", "gpt"])
def test_scope_head_selects_exactly_the_output_head(kind):
    module, _ = build(kind)
    weights = {HEADS[kind][0]}
    assert {t.name for t in select_targets(module, Selection(scope="head"))} == weights
    assert weights.isdisjoint(t.name for t in select_targets(module, Selection()))
    treated, untreated = coverage_report(module, Selection(scope="head")).split("untreated (")
    assert HEADS[kind][0] in treated and HEADS[kind][0] not in untreated
    assert "outside the selection (scope='head'" in untreated


@pytest.mark.parametrize("selection", [{"scope": "mlp"}, {"scope": "head", "include_head": True}])
def test_a_reset_selects_by_name_or_the_head_alone(selection):
    with pytest.raises(ValueError, match="scope"):
        FullReset(selection=selection)


def test_a_head_that_patterns_exclude_entirely_is_an_error():
    module, loader = build("gpt")
    reset = FullReset(selection={"scope": "head", "exclude": ["*.lm_head.*"]})
    with pytest.raises(ValueError, match="within the output head"):
        cpu_trainer(max_steps=1, callbacks=[reset]).fit(module, loader)
