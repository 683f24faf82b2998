"""Weights a parametrization computes: read as the forward computes them, written through the parametrization.

A method that rewrites a weight (FIRE, WeightClip) acts on the *effective* weight, the tensor the layer's
forward uses, and writes it back through the parameters the optimizer trains. Where a parametrization can
carry the value written, it is acted on; where it cannot, each method refuses that weight by name (see
:data:`HOW_METHODS_TREAT`). Both of PyTorch's APIs are read: ``torch.nn.utils.parametrizations`` (``module.
parametrizations.weight.original0`` ...) and the legacy hooks of ``torch.nn.utils.weight_norm`` (``weight_g``,
``weight_v``) and ``torch.nn.utils.spectral_norm`` (``weight_orig`` and the buffers ``weight_u``, ``weight_v``).

* **weight norm**: ``W = g · v / ‖v‖``, the norm over every dim but ``dim``. Any ``W`` without a zero slice is
  ``(g, v) = (‖W‖, W)``, so writing ``W`` makes the effective weight exactly ``W``; a zero slice keeps its old
  direction with ``g = 0``.
* **spectral norm**: ``W = original / σ``, ``σ = uᵀ·original·v`` from the power-iteration buffers. Writing
  ``W`` sets ``original = W`` and ``u, v`` to ``W``'s top singular pair, so the forward, in training and in
  eval mode, computes ``W / σ_max(W)``: the value written up to one positive factor, its largest singular
  value 1.
* **orthogonal**: the effective weight is an isometry whatever the originals (``base`` holds the matrix, the
  trained ``original`` is an offset); no other value can be written.
* anything else (a user's own parametrization, a chain of them): read, never written; every method refuses it
  by name.

Example:
    >>> through = parametrized_weight(model.fc, "weight")   # None for a plain weight
    >>> through.kind, [tuple(p.shape) for p in through.originals]
    ('weight norm', [(64, 1), (64, 128)])
    >>> through.write(2 * through.read())   # the forward now computes twice the weight
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.utils import parametrize

# torch.nn.utils.parametrizations' classes, by the names users know them by.
PARAMETRIZATION_NAMES = {"_WeightNorm": "weight norm", "_SpectralNorm": "spectral norm", "_Orthogonal": "orthogonal"}
# Legacy hooks (torch.nn.utils.weight_norm / spectral_norm), by class name: the modules are not imported here.
LEGACY_HOOKS = {"WeightNorm": "weight norm", "SpectralNorm": "spectral norm"}
WRITABLE = ("weight norm", "spectral norm")  # kinds whose originals can carry a new effective weight

# What each method does with a weight computed by each kind: one table, for the coverage table and the docs.
HOW_METHODS_TREAT = {
    "weight norm": "FIRE and WeightClip act through it (the effective weight is written as g·v/‖v‖), DASH "
                   "shrinks its rows through g; AdaptiveSVD, ReDo and ContinualBackprop refuse it",
    "spectral norm": "FIRE acts on its original (the effective weight becomes the polar factor, σ_max = 1); DASH, "
                     "WeightClip, AdaptiveSVD, ReDo and ContinualBackprop refuse it",
    "orthogonal": "FIRE skips it (already an isometry); DASH, WeightClip, AdaptiveSVD, ReDo and ContinualBackprop "
                  "refuse it",
}


@dataclass(frozen=True, eq=False)
class ParametrizedWeight:
    """``module.<attr>``, computed from ``originals`` by a parametrization of ``kind`` (see the module docstring)."""

    module: nn.Module
    attr: str
    kind: str  # "weight norm" | "spectral norm" | "orthogonal" | a user's class name(s), joined by " + "
    originals: tuple[nn.Parameter, ...]  # what the optimizer trains: (g, v), (original,), ...
    legacy: bool = False  # a torch.nn.utils.weight_norm / spectral_norm hook, not torch.nn.utils.parametrize

    @property
    def writable(self) -> bool:
        """Whether :meth:`write` can carry a new effective weight."""
        return self.kind in WRITABLE

    @property
    def stored(self) -> nn.Parameter:
        """The original shaped like the weight: ``v`` of weight norm, else the first (``original``, ``weight_orig``)."""
        return self.originals[-1] if self.kind == "weight norm" else self.originals[0]

    @property
    def norm_dim(self) -> int | None:
        """Weight norm's ``dim``: the one dim its norm leaves out (``-1``: the whole tensor); None for other kinds."""
        if self.kind != "weight norm":
            return None
        return _legacy_hook(self.module, self.attr).dim if self.legacy else \
            getattr(self.module.parametrizations, self.attr)[0].dim

    def removal(self) -> str:
        """The call that removes this parametrization (the fix a refusal names)."""
        if self.legacy:
            remove = "remove_weight_norm" if self.kind == "weight norm" else "remove_spectral_norm"
            return f"torch.nn.utils.{remove}(module, {self.attr!r})"
        return f"torch.nn.utils.parametrize.remove_parametrizations(module, {self.attr!r})"

    @torch.no_grad()
    def read(self) -> torch.Tensor:
        """The effective weight, detached, as the eval-mode forward computes it (no power iteration)."""
        if self.legacy:
            hook = _legacy_hook(self.module, self.attr)
            if self.kind == "spectral norm":
                return hook.compute_weight(self.module, do_power_iteration=False)
            return hook.compute_weight(self.module)
        plist = getattr(self.module.parametrizations, self.attr)
        modes = [p.training for p in plist]
        plist.eval()  # spectral norm's training forward runs a power iteration: a read must not change u, v
        try:
            return getattr(self.module, self.attr).detach()
        finally:
            for p, mode in zip(plist, modes):
                p.train(mode)

    @torch.no_grad()
    def write(self, value: torch.Tensor) -> None:
        """Set the originals so the forward computes ``value`` (weight norm) or ``value / σ_max(value)`` (spectral
        norm); ``value`` is shaped like the weight, stored orientation."""
        if not self.writable:
            raise RuntimeError(f"{self.kind} parametrization of {type(self.module).__name__}.{self.attr} cannot carry "
                               "a new weight")
        if self.kind == "weight norm":
            g, v = self.originals
            norms = torch.norm_except_dim(value, 2, self.norm_dim)  # shaped like g
            v.copy_(torch.where(norms > 0, value.to(v.dtype), v))  # a zero slice keeps a direction: 0·v/‖v‖ = 0
            g.copy_(norms.to(g.dtype))
        else:
            (original,) = self.originals
            original.copy_(value.to(original.dtype))
            self._exact_singular_pair(original)
        if self.legacy:  # the hook sets the attribute at the next forward; keep it current until then
            setattr(self.module, self.attr, self.read())

    def _exact_singular_pair(self, original: torch.Tensor) -> None:
        """Spectral norm's ``u, v`` set to ``original``'s top singular pair: ``σ = uᵀ W v`` is then ``σ_max``
        exactly, and a training forward's power iteration starts at its fixed point."""
        if self.legacy:
            hook = _legacy_hook(self.module, self.attr)
            matrix = hook.reshape_weight_to_matrix(original)
            u, v = getattr(self.module, self.attr + "_u"), getattr(self.module, self.attr + "_v")
        else:
            norm = getattr(self.module.parametrizations, self.attr)[0]
            matrix = norm._reshape_weight_to_matrix(original)
            u, v = norm._u, norm._v
        left, _, right = torch.linalg.svd(matrix.double(), full_matrices=False)  # float64: σ_max to the last bit
        u.copy_(left[:, 0].to(u.dtype))
        v.copy_(right[0].to(v.dtype))


def parametrized_weight(module: nn.Module, attr: str) -> ParametrizedWeight | None:
    """How a parametrization computes ``module.<attr>``, or None when none does (a plain parameter, or AdaptiveSVD's
    own factorization ``W_p + BA``, which :class:`~.weights.WeightView` reads itself)."""
    if parametrize.is_parametrized(module, attr):
        plist = getattr(module.parametrizations, attr)
        if all(getattr(p, "plasticity_factorization", False) for p in plist):
            return None
        kind = " + ".join(PARAMETRIZATION_NAMES.get(type(p).__name__, type(p).__name__) for p in plist)
        return ParametrizedWeight(module, attr, kind, tuple(plist.parameters()))
    hook = _legacy_hook(module, attr)
    if hook is None:
        return None
    kind = LEGACY_HOOKS[type(hook).__name__]
    names = ("_g", "_v") if kind == "weight norm" else ("_orig",)
    return ParametrizedWeight(module, attr, kind, tuple(getattr(module, attr + n) for n in names), legacy=True)


def _legacy_hook(module: nn.Module, attr: str):
    """The ``torch.nn.utils.weight_norm``/``spectral_norm`` pre-forward hook computing ``module.<attr>``, or None."""
    return next((h for h in module._forward_pre_hooks.values()
                 if type(h).__name__ in LEGACY_HOOKS and getattr(h, "name", None) == attr), None)
