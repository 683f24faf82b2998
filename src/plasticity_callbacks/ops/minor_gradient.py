"""A "minor" weight's projected gradient ``U_m U_mᵀ ∇W``, computed in the backward without ``∇W``.

``AdaptiveSVDSwitch(minor_training="project")`` trains a minor weight with its gradient replaced by
``U_m U_mᵀ ∇W``. For a layer whose forward is ``y = x Wᵀ (+ b)`` over the last dimension (``nn.Linear``;
HF ``Conv1D``, which stores ``Wᵀ``), ``U_mᵀ ∇W = Σ_t (U_mᵀ g_t) x_tᵀ`` over the tokens ``t``, ``g`` being the
output's gradient: an ``r × d_in`` product that needs neither ``∇W`` (a ``d_out × d_in × tokens`` product, a
third of the layer's training FLOPs) nor a pass over it to project it. So a :class:`GradientTap`:

* turns ``W.requires_grad`` off, so autograd skips the weight-gradient product;
* passes the layer's output, unchanged and uncopied, through one autograd node whose backward gives a leaf
  ``C`` (``r × d_in``) the gradient ``(g U_m)ᵀ x``, so autograd sums ``C.grad = U_mᵀ ∇W`` over the layer's
  calls and micro-batches;
* adds ``U_m C.grad`` into ``W.grad`` from ``C``'s post-accumulate hook, inside the backward, so gradient
  clipping, an AMP scaler's unscale and inf check and the optimizer see the projected gradient, as they do
  when the full gradient is projected after the backward.

The tap relies on the module's forward being the weight's only use. A weight tied to another layer, or read
by other code (``nn.MultiheadAttention`` reads ``out_proj.weight`` without calling ``out_proj``; a compiled
forward ignores hooks added after its first trace), would silently lose the other uses' gradient. So a tap
starts in a checking mode: for one step with a gradient the weight keeps its full gradient and ``C.grad`` is
compared with ``U_mᵀ ∇W`` right after the backward (both still as the backward left them: scaled by an AMP
loss scale, before any callback adds to ``.grad``). Only a match turns the weight's own gradient off; a mismatch
keeps the plain projection for that weight.

While a weight is tapped its ``requires_grad`` belongs to the tap: a weight the user froze is never tapped, the
flag comes back as found when the tap is removed, and a weight whose flag is turned back on meanwhile gets its
full gradient (the tap stands aside; the projection after the backward then applies).

Example:
    >>> tap = GradientTap(layer.weight, layer, transposed=False)
    >>> tap.install(U_minor, checked=None)      # checking mode: W keeps its gradient, C.grad is summed
    >>> loss.backward(); tap.verdict()          # True: C.grad == U_mᵀ ∇W
    >>> tap.install(U_minor, checked=True)      # from now on: W.requires_grad off, W.grad = U_m C.grad
"""
from __future__ import annotations

import math
import weakref
from contextlib import contextmanager

import torch
from torch import nn

from ..model_map.holding import TAPPED
from ..model_map.weights import is_conv1d

# The check's relative tolerance: float32 sums in two orders agree to ~1e-6; float16/bfloat16 autocast to ~2.5e-3
# (measured at widths 128–512, 256–4096 tokens). A weight's other use would show as its share of the gradient.
TOLERANCE, LOW_PRECISION_TOLERANCE = 1e-3, 1e-2
# Below this many entries a tap costs more than it saves: its fixed cost per layer and step (a Python hook, an
# autograd node, three small products: about 0.1 ms on a CPU core) against the weight-gradient product and
# projection pass it removes (benchmarks/adaptive_svd_overhead.py, 1×256: a minor step +15 % at width 64, −16 % at
# width 512).
MIN_ENTRIES = 2**15
_TAPS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # id(weight) -> its installed tap


class _Tap(torch.autograd.Function):
    """The layer's output, unchanged and in place, with one more backward: ``C`` receives ``(g U)ᵀ x``, the
    ``r × d_in`` product ``U_mᵀ ∇W`` of this call (``g`` the output's gradient)."""

    @staticmethod
    def forward(ctx, output, x, coefficients, U):
        ctx.save_for_backward(x, U)
        ctx.mark_dirty(output)  # the same tensor, its history extended by this node: no copy
        return output

    @staticmethod
    def backward(ctx, grad):
        x, U = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1]).to(U.dtype)
        return grad, None, (g @ U).mT @ x.reshape(-1, x.shape[-1]).to(U.dtype), None


class GradientTap:
    """Computes one weight's projected gradient ``U_m U_mᵀ ∇W`` in the backward (see the module docstring).

    Args:
        param: the stored weight (``nn.Linear.weight``, or HF ``Conv1D.weight`` stored ``(in, out)``).
        module: the layer whose forward is ``y = x Wᵀ (+ b)``.
        transposed: the weight is stored ``(in, out)`` (HF ``Conv1D``).
    """

    def __init__(self, param: nn.Parameter, module: nn.Module, transposed: bool):
        self.param, self.module, self.transposed = param, module, transposed
        self.checked: bool | None = None  # None: not compared yet; True: C.grad matched U_mᵀ∇W; False: it did not
        self._U: torch.Tensor | None = None  # (d_out, r) in the weight's dtype
        self._C: torch.Tensor | None = None  # (r, d_in) zero leaf
        self._handles: list = []
        self._low_precision = False  # the layer's output was float16/bfloat16 (autocast) when compared
        self._requires_grad = param.requires_grad  # as found, restored by remove()

    @property
    def installed(self) -> bool:
        return bool(self._handles)

    @property
    def skips_full_gradient(self) -> bool:
        """The weight's gradient comes from this tap, already projected (not from autograd)."""
        return self.installed and self.checked is True and not self.param.requires_grad

    def install(self, U_minor: torch.Tensor, checked: bool | None, coefficients: torch.Tensor | None = None) -> None:
        """Tap with ``U_minor`` (``(d_out, r)``, orthonormal columns): skipping the weight's gradient when
        ``checked`` is True, in checking mode when None. Replaces a previous installation; ``coefficients``:
        the leaf ``C`` of one, kept with what its check has summed so far."""
        self.remove()
        self.checked = checked
        self._requires_grad = self.param.requires_grad
        if checked is False:
            return
        d_in = self.param.shape[0] if self.transposed else self.param.shape[1]
        self._U = U_minor.to(self.param.dtype).contiguous()
        self._C = coefficients if coefficients is not None else torch.zeros(
            U_minor.shape[1], d_in, dtype=self.param.dtype, device=self.param.device, requires_grad=True)
        self._handles = [self.module.register_forward_hook(self._forward),
                         self._C.register_post_accumulate_grad_hook(self._accumulated)]
        _TAPS[id(self.param)] = self
        if checked:
            self.param.requires_grad_(False)
            setattr(self.param, TAPPED, True)  # not frozen by the user: other callbacks still treat it

    def remove(self) -> None:
        """Back to the plain layer: hooks removed, ``requires_grad`` as it was found."""
        if not self._handles:
            return
        for handle in self._handles:
            handle.remove()
        self._handles, self._U, self._C = [], None, None
        _TAPS.pop(id(self.param), None)
        self.param.requires_grad_(self._requires_grad)
        if hasattr(self.param, TAPPED):
            delattr(self.param, TAPPED)

    def _forward(self, module: nn.Module, args: tuple, output):
        if not torch.is_grad_enabled() or not args or not torch.is_tensor(args[0]) or not torch.is_tensor(output):
            return None  # no gradient wanted, or a call this tap cannot read (the check then fails, never silently)
        x = args[0]
        if x.shape[-1] != self._C.shape[1] or output.shape[-1] != self._U.shape[0]:
            return None
        if self.checked and self.param.requires_grad:
            return None  # turned back on by someone else: autograd forms the full gradient, projected after
        self._low_precision = output.dtype in (torch.float16, torch.bfloat16)
        return _Tap.apply(output, x.detach(), self._C, self._U)

    def _accumulated(self, C: torch.Tensor) -> None:
        if not self.checked:
            return  # checking: C.grad stays for verdict()
        with torch.autocast(self.param.device.type, enabled=False):  # a backward run under autocast: not here
            if self.transposed:  # stored (in, out): (U C.grad)ᵀ
                update = C.grad.mT @ self._U.mT
            else:
                update = self._U @ C.grad
        if self.param.grad is None:
            self.param.grad = update
        else:
            self.param.grad.add_(update)
        C.grad = None

    def restart_check(self) -> None:
        """A new step: the check sums its backwards from zero."""
        if self._C is not None:
            self._C.grad = None

    def verdict(self, scale: float = 1.0) -> bool | None:
        """In checking mode, after a backward: does ``C.grad / scale`` equal ``U_mᵀ ∇W`` (the weight's full
        gradient)? ``scale``: a loss scale already taken out of the weight's gradient but not out of ``C``'s.
        Both are sums over the same backwards, so any point of an accumulation window works. None when neither
        has a gradient yet (the weight was not used), either is not finite (an AMP overflow step), or the weight
        was frozen meanwhile.

        The bound is relative to the gradient's minor part plus the share of the whole gradient's rounding that
        falls into the ``r`` minor directions, ``√(r/d_out)·‖∇W‖``: in low precision the latter dominates when
        the gradient lies almost wholly in the principal directions. Another use of the weight adding more than
        about ``tolerance`` of ``‖∇W‖`` shows."""
        grad, tapped = self.param.grad, self._C.grad
        if (grad is None and tapped is None) or not self.param.requires_grad:
            return None
        if grad is None or tapped is None:
            return False
        if not bool(torch.isfinite(grad).all() and torch.isfinite(tapped).all()):
            return None
        full = grad.mT if self.transposed else grad
        expected = self._U.mT.to(full.dtype) @ full
        tolerance = LOW_PRECISION_TOLERANCE if self._low_precision else TOLERANCE
        error = torch.linalg.vector_norm(tapped.to(expected.dtype) / scale - expected)
        rounding = math.sqrt(self._U.shape[1] / self._U.shape[0]) * torch.linalg.vector_norm(full)
        return bool(error <= tolerance * (torch.linalg.vector_norm(expected) + rounding) + 1e-12)


@contextmanager
def full_gradients(module: nn.Module):
    """Inside, every tapped weight of ``module`` has its own full gradient and no tap: for side computations
    that train the weights plainly (``TaskMetrics``' plasticity probe). The taps come back on exit."""
    paused = [(tap, tap._U, tap.checked, tap._C) for p in module.parameters()
              if (tap := _TAPS.get(id(p))) is not None and tap.installed]
    for tap, *_ in paused:
        tap.remove()
    try:
        yield
    finally:
        for tap, U, checked, coefficients in paused:  # the same C: a check under way keeps its sums
            tap.install(U, checked, coefficients)


def compiled(module: nn.Module) -> bool:
    """``module`` or a submodule runs through ``torch.compile`` (``Module.compile()``, Lightning's unwrapped
    ``torch.compile(module)``, or the package GPT's ``model.compile``), which would not see hooks added later."""
    if getattr(module, "_compiler_ctx", None) or getattr(module, "_compiled_forward", None) is not None:
        return True
    return any(getattr(m, "_compiled_call_impl", None) is not None for m in module.modules())


def tappable(module: nn.Module, param: nn.Parameter, min_entries: int = 0) -> bool:
    """``module``'s forward is ``y = x Wᵀ (+ b)`` with ``param`` as ``W`` (``nn.Linear``, HF ``Conv1D``), and
    ``param`` has at least ``min_entries`` entries."""
    linear = isinstance(module, nn.Linear) or is_conv1d(module)
    return linear and getattr(module, "weight", None) is param and param.numel() >= min_entries
