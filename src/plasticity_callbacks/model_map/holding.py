"""How the user holds a parameter: frozen, an adapter's factor, computed by a parametrization.

Every callback reads this one place before it changes a weight:

* **frozen**: ``requires_grad=False`` as the user left it. A weight that a plasticity method trains
  another way is not frozen: AdaptiveSVD's factorized ``W_p`` trains through ``B, A``, a tapped weight
  gets its gradient from the tap. Frozen weights are left alone unless a selection names them.
* **adapter**: PEFT LoRA's ``lora_A``/``lora_B`` (ordinary trainable Linear layers, drawn fresh by PEFT's
  own init: ``A`` kaiming, ``B`` zeros) and the ``base_layer`` they sit on (frozen by PEFT).
* **parametrized**: ``torch.nn.utils.parametrize`` (or a legacy ``weight_norm``/``spectral_norm`` hook) computes
  the weight from its ``original``\\ (s) (``weight_norm``, ``spectral_norm``, ``orthogonal``, a user's own).
  :mod:`.parametrized` reads and writes it; each method acts through it or refuses it by name
  (:data:`~.parametrized.HOW_METHODS_TREAT`); Shrink & Perturb treats its ``original`` parameters, which any
  value maps to a valid weight. AdaptiveSVD's factorization is a parametrization too, but one the package owns
  (``plasticity_factorization = True``): it is not this.

Example:
    >>> describe_holding(model.layer, "weight")   # "frozen", "adapter (LoRA A)", "parametrized (weight norm)"
    >>> is_frozen(model.layer, "weight")
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import parametrize

from .parametrized import parametrized_weight

TAPPED = "_plasticity_gradient_tap"  # set on a weight while a GradientTap owns its requires_grad


def is_factorization(module: nn.Module, attr: str) -> bool:
    """``module.<attr>`` is factorized by a plasticity method (AdaptiveSVD's ``W_p + BA``)."""
    return parametrize.is_parametrized(module, attr) and all(
        getattr(p, "plasticity_factorization", False) for p in getattr(module.parametrizations, attr))


def parametrization(module: nn.Module, attr: str) -> str:
    """The user's parametrization computing ``module.<attr>`` (``"weight norm"``, ...; a legacy hook's too), or
    ``""``."""
    through = parametrized_weight(module, attr)
    return through.kind if through is not None else ""


def weight_in_buffer(module: nn.Module, attr: str) -> bool:
    """The parametrization keeps the weight in a buffer and trains an offset from it (``orthogonal`` with its
    default ``use_trivialization=True``: ``base`` holds the matrix, the ``original`` is a zero skew matrix), so
    a new value of the ``original`` parameters cannot carry a new weight."""
    return parametrize.is_parametrized(module, attr) and any(
        isinstance(getattr(p, "base", None), torch.Tensor) for p in getattr(module.parametrizations, attr))


def is_frozen(module: nn.Module, attr: str) -> bool:
    """The user froze ``module.<attr>``: nothing that computes it trains (see the module docstring)."""
    if parametrize.is_parametrized(module, attr):
        return not any(p.requires_grad for p in getattr(module.parametrizations, attr).parameters())
    through = parametrized_weight(module, attr)  # a legacy hook: weight_g/weight_v, weight_orig
    if through is not None:
        return not any(p.requires_grad for p in through.originals)
    param = module._parameters.get(attr)
    return param is not None and is_frozen_parameter(param)


def is_frozen_parameter(param: nn.Parameter) -> bool:
    """A plain parameter the user froze (a tapped weight's ``requires_grad`` belongs to its tap)."""
    return not param.requires_grad and not getattr(param, TAPPED, False)


def lora_parts(model: nn.Module) -> dict[int, str]:
    """``{id(module): "LoRA A" | "LoRA B" | "LoRA base"}`` for every PEFT LoRA layer's parts in ``model``."""
    parts = {}
    for module in model.modules():
        lora_A, lora_B = getattr(module, "lora_A", None), getattr(module, "lora_B", None)
        if not (isinstance(lora_A, nn.ModuleDict) and isinstance(lora_B, nn.ModuleDict)):
            continue
        parts.update({id(m): "LoRA A" for m in lora_A.values()})
        parts.update({id(m): "LoRA B" for m in lora_B.values()})
        base = getattr(module, "base_layer", None)
        if isinstance(base, nn.Module):
            parts[id(base)] = "LoRA base"
    return parts


def describe_holding(module: nn.Module, attr: str, lora: dict[int, str] | None = None) -> str:
    """How ``module.<attr>`` is held, for the coverage table: ``"frozen"``, ``"adapter (LoRA A)"``,
    ``"parametrized (weight norm)"``, joined by ``", "``; ``""`` for an ordinary trainable weight."""
    part = (lora or {}).get(id(module), "")
    held = []
    if is_frozen(module, attr):
        held.append("frozen" + (" (LoRA base)" if part == "LoRA base" else ""))
    if part in ("LoRA A", "LoRA B"):
        held.append(f"adapter ({part})")
    if kind := parametrization(module, attr):
        held.append(f"parametrized ({kind})")
    return ", ".join(held)
