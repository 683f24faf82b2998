"""Every callback the package registers (``callbacks.base.callback_classes``) and its config in
``configs/callbacks/``, found rather than listed: the cross-cutting tests (resume safety, DDP, FSDP2, NaN, bad
state) take their callbacks from here, so a new method is in each of them without an edit.

    for name, cls in methods().items(): ...          # every registered PlasticityCallback subclass
    spec = acting_soon("ReDoMonitor")                 # its config with its quick_settings: acts within 4 steps
"""
from __future__ import annotations

import copy
import functools
import importlib
from pathlib import Path

from omegaconf import OmegaConf

from plasticity_callbacks.callbacks.base import PlasticityCallback, callback_classes

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "callbacks"


def exported_callbacks() -> dict[str, type]:
    """``{name: class}`` of every callback the package registers (and so exports)."""
    return callback_classes()


def methods() -> dict[str, type]:
    """``{name: class}`` of every plasticity method (a :class:`PlasticityCallback`) the package exports or a
    config in ``configs/callbacks/`` names."""
    found = dict(exported_callbacks())
    for name, spec in configs().items():
        module, _, attribute = spec["_target_"].rpartition(".")
        found[name] = getattr(importlib.import_module(module), attribute)
    return {name: cls for name, cls in found.items() if issubclass(cls, PlasticityCallback)}


def configs() -> dict[str, dict]:
    """``{class name: Hydra spec}`` from ``configs/callbacks/*.yaml`` (``${seed}`` resolved to 0); a copy, the
    caller may change it."""
    return copy.deepcopy(_read_configs())


@functools.cache
def _read_configs() -> dict[str, dict]:
    """Read once a session: ``acting_soon`` asks for the table per callback, at collection too."""
    specs = {}
    for path in sorted(CONFIGS.glob("*.yaml")):
        merged = OmegaConf.merge({"seed": 0}, OmegaConf.load(path))
        for key, spec in OmegaConf.to_container(merged, resolve=True).items():
            if key != "seed":
                specs[spec["_target_"].rsplit(".", 1)[-1]] = spec
    return specs


def acting_soon(name: str) -> dict:
    """The callback's config with the class's ``quick_settings``: it acts within 4 steps of a tiny model."""
    return {**configs()[name], **getattr(methods().get(name), "quick_settings", {})}
