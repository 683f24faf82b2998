"""One rule for non-finite values, checked on every method the package registers (discovered, not listed):
acting on a NaN/Inf weight (or, for a method that reads them, a NaN/Inf gradient) is skipped with a warning
naming the parameter. Right after the method's hook, no other parameter has turned non-finite (nothing was
folded into a bias or a fresh draw), the method's own state (EMAs, statistics, the tortoise) is finite, and
no metric it logged is NaN.
"""
from __future__ import annotations

import math
import warnings

import lightning as L
import pytest
import torch

from plasticity_callbacks.callbacks.base import PlasticityCallback, plasticity_methods

from tiny import TinyMLPModule, cpu_trainer, regression_loader

POISONED = "net.2.weight"  # a hidden layer every method treats (not the head)
STEPS = 3  # the poison lands in the last step's hook, just before the method's own

METHODS = sorted(plasticity_methods())


def acting_in_the_last_step(cls: type[PlasticityCallback]) -> tuple[dict, str]:
    """The arguments under which ``cls`` acts in the last step, and the hook it acts in, read off the class's
    declarations: its ``quick_settings``; its ``every_step_hook`` (the EMA, the pull, the clip of every step)
    or, for a scheduled method, a schedule at the last step's global step as its ``step_hook`` sees it (after
    the optimizer step at a batch end)."""
    kwargs = dict(cls.quick_settings)
    if cls.every_step_hook is not None:
        return kwargs, cls.every_step_hook
    last = STEPS if cls.step_hook == "on_train_batch_end" else STEPS - 1
    return {**kwargs, "schedule": {"steps": [last]}}, cls.step_hook


class Poison(L.Callback):
    """Writes NaN into one entry of ``POISONED`` (or of its gradient) at the last call of ``hook``."""

    def __init__(self, hook: str, gradient: bool):
        self.hook, self.gradient, self.calls = hook, gradient, 0
        setattr(self, hook, self._poison)

    def _poison(self, trainer, pl_module, *args) -> None:
        self.calls += 1
        if self.calls == STEPS:
            param = pl_module.get_parameter(POISONED)
            target = param.grad if self.gradient else param.data
            assert target is not None, f"no gradient of {POISONED} in {self.hook}"
            target[0, 0] = float("nan")


class Snapshot(L.Callback):
    """Which parameters are finite right after the method's hook in the last step."""

    def __init__(self, hook: str):
        self.calls, self.finite = 0, None
        setattr(self, hook, self._look)

    def _look(self, trainer, pl_module, *args) -> None:
        self.calls += 1
        if self.calls == STEPS:
            self.finite = {n: bool(torch.isfinite(p).all()) for n, p in pl_module.named_parameters()}


def tensors(tree):
    if torch.is_tensor(tree):
        yield tree
    elif isinstance(tree, dict):
        for value in tree.values():
            yield from tensors(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from tensors(value)


def test_the_methods_are_found_in_the_registry():
    assert len(METHODS) >= 12 and {"FIREReinit", "WeightClip", "PlasticityMonitor"} <= set(METHODS)


@pytest.mark.parametrize("name, gradient", [(name, False) for name in METHODS] + [
    (name, True) for name in METHODS if plasticity_methods()[name].reads_gradients])
def test_a_method_skips_a_nan_weight_or_gradient_with_a_warning_naming_it(name, gradient):
    kwargs, hook = acting_in_the_last_step(plasticity_methods()[name])
    method = plasticity_methods()[name](**kwargs)
    snapshot = Snapshot(hook)
    trainer = cpu_trainer(max_steps=STEPS, callbacks=[Poison(hook, gradient), method, snapshot])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(TinyMLPModule(), regression_loader())
    named = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning) and POISONED in str(w.message)
             and "NaN/Inf" in str(w.message) and name in str(w.message)]
    assert named, [str(w.message) for w in caught]
    others = {n for n, ok in snapshot.finite.items() if not ok} - {POISONED}
    assert not others, f"{name} moved the NaN into {sorted(others)}"
    assert snapshot.finite[POISONED] == gradient  # the weight poisoned is left as it was, not silently replaced
    state = [t for t in tensors(method.state_dict()) if t.is_floating_point()]
    assert all(bool(torch.isfinite(t).all()) for t in state), f"{name} keeps a NaN in its state"
    prefixes = {metric.split("/")[0] + "/" for metric in method.summary_metrics}
    logged = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(tuple(prefixes))}
    assert all(math.isfinite(v) for v in logged.values()), logged
