"""Lightning callbacks that restore a network's plasticity at training phase changes.

The callbacks import Lightning; the math (``spectral``, ``dormancy``, ``shrink``,
``subspace``) and the model (``models.GPT``) do not.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

# name -> module that defines it; imported on first use so `import plasticity_callbacks` stays light. The callbacks
# are not listed: each registers itself (callbacks.base.callback_classes), so a new method is exported without an edit.
_LAZY = {
    "GPT": "plasticity_callbacks.models",
    "GPTConfig": "plasticity_callbacks.models",
    "GPTLightningModule": "plasticity_callbacks.models",
    "OptimizerSettings": "plasticity_callbacks.models",
    "CodeCorpusDataModule": "plasticity_callbacks.data",
    "ByteTokenizer": "plasticity_callbacks.data",
    "select_targets": "plasticity_callbacks.model_map",
    "declare_plasticity": "plasticity_callbacks.model_map",
    "describe": "plasticity_callbacks.model_map",
    "coverage_report": "plasticity_callbacks.model_map",
    "interleaved_heads": "plasticity_callbacks.model_map",
    "grouped_heads": "plasticity_callbacks.model_map",
    "PlasticityCallback": "plasticity_callbacks.callbacks.base",
    "Schedule": "plasticity_callbacks.callbacks.schedule",
    "Threshold": "plasticity_callbacks.callbacks.schedule",
    "Selection": "plasticity_callbacks.model_map",
    "FIREOptions": "plasticity_callbacks.functional.isometry",
}


def _callbacks() -> dict[str, type]:
    from .callbacks.base import callback_classes

    return callback_classes()


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name == "__all__":  # the registry is read (its modules imported) only when asked
        return sorted({*_LAZY, *_callbacks()})
    if name[:1].isupper() and name in _callbacks():
        return _callbacks()[name]
    raise AttributeError(f"module 'plasticity_callbacks' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__getattr__("__all__")})
