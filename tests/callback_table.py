"""Every callback the package exports and its config in ``configs/callbacks/``, found rather than listed: the
cross-cutting tests (resume safety, DDP, FSDP2, bad state) take their callbacks from here, so a new method is
in each of them without an edit.

    for name, cls in methods().items(): ...          # every exported PlasticityCallback subclass
    spec = acting_soon("ReDoMonitor")                 # its config, set to act within 4 steps
"""
from __future__ import annotations

import importlib
from pathlib import Path

import lightning as L
from omegaconf import OmegaConf

import plasticity_callbacks as pc
from plasticity_callbacks.callbacks.base import PlasticityCallback

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "callbacks"

# What makes a callback act within the few steps of a test, where its config's default waits longer (every
# 1000 steps, after step 100, a tau no neuron reaches). A method whose defaults act early needs no entry.
ACT_SOON = {
    "ReDoMonitor": {"tau": 1.0, "collect_every_n_steps": 1, "log_every_n_steps": 1,
                    "schedule": {"every_n_steps": 2}},
    "AdaptiveSVDSwitch": {"schedule": {"every_n_steps": 2, "start_step": 2}, "r_min": 2,
                          "thresholds": {"clobber_alignment": 0.0}, "save_figure": False},
    "DASHPeriodic": {"schedule": {"every_n_steps": 2}, "cosine_threshold": -1.0, "shrink_rate": 0.2,
                     "skip_muon_params": False},
    "DASHShrink": {"n_batches": 2, "skip_muon_params": False},
    "FIREReinit": {"schedule": {"at_fit_start": True, "steps": [2]}, "selection": {"include_conv": True}},
    "HareTortoise": {"decay": 0.5, "schedule": {"every_n_steps": 2}},
    "ContinualBackprop": {"replacement_rate": 0.2, "maturity_threshold": 1},
    "WeightClip": {"kappa": 0.1},
    "GateLogger": {"every_n_steps": 1},
    "PlasticityMonitor": {"activations_every_n_steps": 2, "weights_every_n_steps": 2, "spectra_every_n_steps": 2},
}


def exported_callbacks() -> dict[str, type]:
    """``{name: class}`` of every Lightning callback in ``plasticity_callbacks.__all__`` but the base."""
    found = {name: getattr(pc, name) for name in pc.__all__}
    return {name: cls for name, cls in found.items()
            if isinstance(cls, type) and issubclass(cls, L.Callback) and cls is not PlasticityCallback}


def methods() -> dict[str, type]:
    """``{name: class}`` of every plasticity method (a :class:`PlasticityCallback`) the package exports or a
    config in ``configs/callbacks/`` names."""
    found = dict(exported_callbacks())
    for name, spec in configs().items():
        module, _, attribute = spec["_target_"].rpartition(".")
        found[name] = getattr(importlib.import_module(module), attribute)
    return {name: cls for name, cls in found.items() if issubclass(cls, PlasticityCallback)}


def configs() -> dict[str, dict]:
    """``{class name: Hydra spec}`` from ``configs/callbacks/*.yaml`` (``${seed}`` resolved to 0)."""
    specs = {}
    for path in sorted(CONFIGS.glob("*.yaml")):
        merged = OmegaConf.merge({"seed": 0}, OmegaConf.load(path))
        for key, spec in OmegaConf.to_container(merged, resolve=True).items():
            if key != "seed":
                specs[spec["_target_"].rsplit(".", 1)[-1]] = spec
    return specs


def acting_soon(name: str) -> dict:
    """The callback's config with :data:`ACT_SOON`'s settings: it acts within 4 steps of a tiny model."""
    return {**configs()[name], **ACT_SOON.get(name, {})}
