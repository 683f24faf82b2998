"""``plasticity_callbacks.core`` was split by layer; importing any of its old modules names the new one."""
from __future__ import annotations

import importlib.abc
import sys

MOVED = {
    "arguments": "plasticity_callbacks.arguments", "extras": "plasticity_callbacks.extras",
    "model_map": "plasticity_callbacks.model_map", "parameter_patterns": "plasticity_callbacks.model_map.patterns",
    "apply_fire": "plasticity_callbacks.ops.fire", "neuron_reset": "plasticity_callbacks.ops.neuron_reset",
    "factorization": "plasticity_callbacks.ops.factorization",
    "minor_gradient": "plasticity_callbacks.ops.minor_gradient",
    "optimizer_state": "plasticity_callbacks.ops.optimizer_state",
    "distributed": "plasticity_callbacks.distributed.strategy", "sharding": "plasticity_callbacks.distributed.sharding",
    "sharded_state": "plasticity_callbacks.distributed.sharded_state",
    "sharded_subspace": "plasticity_callbacks.distributed.sharded_subspace",
    "schedule": "plasticity_callbacks.callbacks.schedule", "callback_state": "plasticity_callbacks.callbacks.state",
    "step_logging": "plasticity_callbacks.callbacks.step_logging", "figures": "plasticity_callbacks.callbacks.figures",
    "checkpoints": "plasticity_callbacks.app.runs.checkpoints",
    "checkpoint_folders": "plasticity_callbacks.app.runs.checkpoint_folders",
    "resume": "plasticity_callbacks.app.runs.resume",
}


class _MovedFinder(importlib.abc.MetaPathFinder):
    """Turns ``import plasticity_callbacks.core.<old>`` into one line naming the module to import instead."""

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith(__name__ + "."):
            return None
        old = fullname[len(__name__) + 1:]
        top = old.split(".")[0]
        new = MOVED.get(top)
        where = f"import {new}{old[len(top):]} instead" if new else "see the package's layout in docs/"
        raise ModuleNotFoundError(f"{fullname} was moved: {where}", name=fullname)


def __getattr__(name: str):
    if name in MOVED:
        raise AttributeError(f"plasticity_callbacks.core.{name} was moved: import {MOVED[name]} instead")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if not any(isinstance(finder, _MovedFinder) for finder in sys.meta_path):
    sys.meta_path.insert(0, _MovedFinder())
