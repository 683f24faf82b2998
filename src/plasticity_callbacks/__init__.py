"""Lightning callbacks that restore a network's plasticity at training phase changes.

The callbacks import Lightning; the math (``spectral``, ``dormancy``, ``shrink``,
``subspace``) and the model (``models.GPT``) do not.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

# name -> module that defines it; imported on first use so `import plasticity_callbacks` stays light.
_LAZY = {
    "GPT": "plasticity_callbacks.models",
    "GPTConfig": "plasticity_callbacks.models",
    "GPTLightningModule": "plasticity_callbacks.models",
    "CodeCorpusDataModule": "plasticity_callbacks.data",
    "ByteTokenizer": "plasticity_callbacks.data",
    "select_targets": "plasticity_callbacks.model_map",
    "declare_plasticity": "plasticity_callbacks.model_map",
    "describe": "plasticity_callbacks.model_map",
    "coverage_report": "plasticity_callbacks.model_map",
    "interleaved_heads": "plasticity_callbacks.model_map",
    "grouped_heads": "plasticity_callbacks.model_map",
    "FIREReinit": "plasticity_callbacks.callbacks.fire",
    "ReDoMonitor": "plasticity_callbacks.callbacks.redo",
    "DASHShrink": "plasticity_callbacks.callbacks.dash",
    "DASHPeriodic": "plasticity_callbacks.callbacks.dash_periodic",
    "AdaptiveSVDSwitch": "plasticity_callbacks.callbacks.adaptive_svd",
    "ShrinkPerturb": "plasticity_callbacks.callbacks.shrink_perturb",
    "FullReset": "plasticity_callbacks.callbacks.full_reset",
    "GateLogger": "plasticity_callbacks.callbacks.gate_logger",
    "ContinualBackprop": "plasticity_callbacks.callbacks.continual_backprop",
    "L2Init": "plasticity_callbacks.callbacks.l2_init",
    "WeightClip": "plasticity_callbacks.callbacks.weight_clip",
    "HareTortoise": "plasticity_callbacks.callbacks.hare_tortoise",
    "PlasticityCallback": "plasticity_callbacks.callbacks.base",
    "PlasticityMonitor": "plasticity_callbacks.callbacks.monitor",
    "Schedule": "plasticity_callbacks.callbacks.schedule",
    "Threshold": "plasticity_callbacks.callbacks.schedule",
    "Selection": "plasticity_callbacks.model_map",
    "FIREOptions": "plasticity_callbacks.functional.isometry",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'plasticity_callbacks' has no attribute {name!r}")
