"""Hidden units that are not one ``nn.Linear`` row: fused layers writing two values per unit, and experts.

A fused input layer (Phi-3 ``gate_up_proj``, ModernBERT ``Wi``) writes two values of each unit; which two rows
they are (contiguous halves, or interleaved pairs) is read from the block's own forward by
:func:`read_unit_pairing`. A stack of experts (transformers 5.x ``experts.gate_up_proj (E, 2I, H)`` and
``experts.down_proj (E, H, I)``, or stored ``(in, out)`` as in GPT-OSS) holds one MLP per expert: unit ``i`` of
expert ``e`` is that expert's gate and up rows of unit ``i`` and its ``down`` column ``i``. Each expert is
one neuron layer whose ``up``/``down`` are :class:`ExpertMatrix` views, and whose activations are measured
on the tokens routed to it by :func:`expert_hidden`, through the module's own gating code.
"""
from __future__ import annotations

import copy
import inspect
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed.strategy import is_dtensor
from .detached_hooks import hooks_detached

# (incoming, outgoing) 3-D parameter names of expert stacks: gated (HF ``has_gate``) or a plain activation.
_EXPERT_STACKS = (("gate_up_proj", "down_proj"), ("up_proj", "down_proj"))
# What was read once per module: (weight shapes, result). The model map is asked on every select_targets call.
_PAIRINGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # up layer -> (shape, pairing)
_LAYOUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # experts module -> (shapes, layout)


@dataclass(frozen=True, eq=False)
class ExpertMatrix:
    """Expert ``expert``'s matrix in the stacked parameter ``owner.<attr>`` (``(experts, ·, ·)``), shaped like a
    layer for the hidden-unit code: ``weight`` is its 2-D view (writes reach the stack), stored ``(out, in)``,
    or ``(in, out)`` when ``transposed``; ``bias`` the expert's row of ``owner.<attr>_bias``, if any.

    Args:
        owner: the experts module.
        attr: the stacked parameter's name on ``owner``.
        expert: which matrix of the stack.
        transposed: the stack holds ``(in, out)`` matrices (the forward computes ``x @ W[e]``).
        name: the parameter's full name, for messages.

    Example:
        >>> up = ExpertMatrix(experts, "gate_up_proj", 3, transposed=False, name="mlp.experts.gate_up_proj")
        >>> up.weight.shape   # (2I, H): expert 3's rows
    """

    owner: nn.Module
    attr: str
    expert: int
    transposed: bool
    name: str

    @property
    def stack(self) -> nn.Parameter:
        stack = getattr(self.owner, self.attr)
        if is_dtensor(stack):
            raise NotImplementedError(f"{self.name}: recycling units of experts sharded by FSDP2 is not supported; "
                                      "train with strategy='ddp', or exclude the experts")
        return stack

    @property
    def bias_stack(self) -> nn.Parameter | None:
        return getattr(self.owner, f"{self.attr}_bias", None)

    @property
    def weight(self) -> torch.Tensor:
        return self.stack[self.expert]

    @property
    def bias(self) -> torch.Tensor | None:
        stack = self.bias_stack
        return None if stack is None else stack[self.expert]

    def __str__(self) -> str:
        return f"{self.name}[{self.expert}]"


def _pairing(z: torch.Tensor, h: torch.Tensor, width: int) -> str | None:
    """How the ``2·width`` values ``z`` of one token reach the ``width`` units ``h`` computed from them:
    ``halves`` (unit ``i`` reads ``z[i]`` and ``z[width + i]``), ``interleaved`` (``z[2i]``, ``z[2i + 1]``) or
    None. Read from two gradients: of ``Σ h_i`` and of ``Σ (i + 1)·h_i``; their ratio at each value of ``z`` is
    the number of the one unit that reads it (exact, as in the attention probe)."""
    if h.shape[-1] != width or z.shape[-1] != 2 * width or not h.requires_grad:
        return None
    h = h.reshape(-1, width)[0]
    ones = torch.autograd.grad(h.sum(), z, retain_graph=True)[0].reshape(-1, 2 * width)[0].double()
    numbers = torch.arange(1, width + 1, dtype=h.dtype, device=h.device)
    numbered = torch.autograd.grad((h * numbers).sum(), z)[0].reshape(-1, 2 * width)[0].double()
    if not bool((ones != 0).all()):
        return None
    ratio = (numbered / ones - 1).cpu()
    unit = ratio.round()
    if not torch.allclose(ratio, unit, rtol=0, atol=1e-3):
        return None
    units = torch.arange(width, dtype=unit.dtype)
    if torch.equal(unit, units.repeat(2)):
        return "halves"
    if torch.equal(unit, units.repeat_interleave(2)):
        return "interleaved"
    return None


def _test_values(shape, dtype, device) -> torch.Tensor:
    # Positive values away from 0: act(g)·u has a zero derivative in g at u = 0, and relu's in g at g <= 0.
    generator = torch.Generator().manual_seed(0)
    return (0.5 + torch.rand(shape, generator=generator)).to(device=device, dtype=dtype).requires_grad_()


def read_unit_pairing(block: nn.Module, up: nn.Module, down: nn.Module) -> str | None:
    """Which two of ``up``'s outputs make unit ``i`` of ``down``'s input, read by running ``block`` on one token
    (``block(x)``, eval mode, no parameter gradient kept): ``halves``, ``interleaved``, or None when ``block``
    will not run on ``x`` alone or the values do not pair cleanly.

    Example:
        >>> read_unit_pairing(modernbert_layer.mlp, modernbert_layer.mlp.Wi, modernbert_layer.mlp.Wo)  # 'halves'
    """
    cached = _PAIRINGS.get(up)
    if cached is not None and cached[0] == (up.weight.shape, down.weight.shape):
        return cached[1]
    with hooks_detached(block):  # its own hooks only, also on a half-precision block's float32 copy
        pairing = _read_unit_pairing(block, up, down)
    _PAIRINGS[up] = ((up.weight.shape, down.weight.shape), pairing)
    return pairing


def _read_unit_pairing(block: nn.Module, up: nn.Module, down: nn.Module) -> str | None:
    if up.weight.dtype in (torch.float16, torch.bfloat16):  # unit numbers past 256 do not survive half precision
        names = {id(m): n for n, m in block.named_modules()}
        try:
            block = copy.deepcopy(block).float()
        except Exception:  # noqa: BLE001 - a block that cannot be copied (sharded): the pairing is unknown
            return None
        up, down = block.get_submodule(names[id(up)]), block.get_submodule(names[id(down)])
    captured = {}

    def replace(module, args, output):
        captured["z"] = _test_values(output.shape, output.dtype, output.device)
        return captured["z"]

    def read(module, args):
        captured.setdefault("h", args[0])

    handles = [up.register_forward_hook(replace), down.register_forward_pre_hook(read)]
    modes = [(m, m.training) for m in block.modules()]
    block.eval()
    try:
        with torch.enable_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            block(torch.zeros(1, 1, up.weight.shape[1], dtype=up.weight.dtype, device=up.weight.device))
            if "z" not in captured or "h" not in captured:
                return None
            return _pairing(captured["z"], captured["h"], down.weight.shape[1])
    except Exception:  # noqa: BLE001 - a block that needs more than x: the pairing is unknown, not an error
        return None
    finally:
        for handle in handles:
            handle.remove()
        for module, mode in modes:
            module.training = mode


@dataclass(frozen=True)
class ExpertLayout:
    """How one experts module stores and uses its stacks (read once, at discovery)."""

    transposed: bool  # (in, out) matrices: the forward computes x @ W[e]
    pairing: str | None  # halves | interleaved for a gated stack, None for a plain activation


def expert_layers(model: nn.Module) -> list[dict]:
    """One neuron layer (as :class:`~.neurons.HiddenUnits` fields) per expert of every stack of experts.

    The orientation comes from the module's own ``is_transposed`` (transformers 5.x sets it for its grouped
    kernels), else from the shapes when only one orientation fits; the gate/up pairing from the module's own
    ``_apply_gate`` (:func:`_pairing` on one token). A stack whose layout cannot be told is named in a warning
    with the reason, and left alone.

    Example:
        >>> [layer["name"] for layer in expert_layers(mixtral)][:2]   # ['model.layers.0.mlp.experts.0', ...]
    """
    layers = []
    for name, module in model.named_modules():
        for up_attr, down_attr in _EXPERT_STACKS:
            up, down = module._parameters.get(up_attr), module._parameters.get(down_attr)
            if up is None or down is None or up.dim() != 3 or down.dim() != 3:
                continue
            shapes = (up.shape, down.shape)
            cached = _LAYOUTS.get(module)
            layout = cached[1] if cached is not None and cached[0] == shapes else _expert_layout(
                name, module, up_attr, down_attr)
            _LAYOUTS[module] = (shapes, layout)
            if layout is None:
                break
            prefix = f"{name}." if name else ""
            for expert in range(up.shape[0]):
                def matrix(attr, e=expert):
                    return ExpertMatrix(module, attr, e, layout.transposed, prefix + attr)

                layers.append(dict(name=f"{prefix}{expert}", up=matrix(up_attr), down=matrix(down_attr),
                                   fused_gate=layout.pairing is not None, interleaved=layout.pairing == "interleaved",
                                   experts=module))
            break
    return layers


def _expert_layout(name: str, module: nn.Module, up_attr: str, down_attr: str) -> ExpertLayout | None:
    up, down = getattr(module, up_attr), getattr(module, down_attr)
    gated = up_attr == "gate_up_proj"
    factor = 2 if gated else 1
    (_, a, b), (_, c, d) = up.shape, down.shape
    fits = {False: a == factor * d and b == c, True: b == factor * c and a == d}  # (out, in) / (in, out)
    transposed = getattr(module, "is_transposed", None)
    if not isinstance(transposed, bool):
        transposed = fits[True] if fits[True] != fits[False] else None
    skip = None
    if transposed is None or not fits[transposed]:
        skip = f"its stacks {tuple(up.shape)} and {tuple(down.shape)} do not tell (out, in) from (in, out)"
    elif not callable(getattr(module, "_apply_gate" if gated else "act_fn", None)):
        skip = f"it has no {'_apply_gate' if gated else 'act_fn'} method to compute its units with"
    elif len(_forward_parameters(module)) < 2:
        skip = "its forward does not take (hidden_states, expert indices)"
    pairing = None
    if skip is None and gated:
        width = d if not transposed else c
        z = _test_values((1, 2 * width), torch.float32, up.device)  # exact unit numbers, whatever the stack's dtype
        with torch.enable_grad():
            pairing = _pairing(z, module._apply_gate(z), width)
        if pairing is None:
            skip = "its _apply_gate does not read each unit from two values (halves or interleaved)"
    if skip is not None:
        warnings.warn(f"ReDo/ContinualBackprop do not recycle the experts of {name or type(module).__name__}: {skip}, "
                      "so their units keep their weights (the other MLPs are recycled); layer_map= and "
                      "declare_plasticity(neurons=...) describe nn.Linear layers, not stacks", stacklevel=4)
        return None
    return ExpertLayout(transposed, pairing)


def _forward_parameters(module: nn.Module) -> list[str]:
    try:
        return list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return []


def expert_hidden(module: nn.Module, args: tuple, kwargs: dict, up_attr: str, transposed: bool
                  ) -> Iterator[tuple[int, torch.Tensor]]:
    """``(expert, h)`` for every expert that tokens are routed to in this call of ``module.forward(*args,
    **kwargs)``: ``h (tokens, I)`` the values that enter that expert's ``down``, computed from its own stack and
    the module's own ``_apply_gate``/``act_fn`` (so whichever kernel the forward uses, eager, grouped or batched,
    the units are the same). Reads which experts were hit on the host (one sync per call)."""
    bound = inspect.signature(module.forward).bind(*args, **kwargs).arguments
    names = _forward_parameters(module)
    hidden, index = bound.get(names[0]), bound.get(names[1])
    if not (torch.is_tensor(hidden) and torch.is_tensor(index)) or index.is_floating_point():
        raise RuntimeError(f"{type(module).__name__}.forward was not called with (hidden_states, expert indices): "
                           "its experts' units cannot be measured; exclude them")
    x = hidden.reshape(-1, hidden.shape[-1])  # (tokens, H)
    index = index.reshape(x.shape[0], -1)  # (tokens, top_k)
    stack, bias = getattr(module, up_attr), getattr(module, f"{up_attr}_bias", None)
    gate: Callable = module._apply_gate if up_attr == "gate_up_proj" else module.act_fn
    for expert in torch.unique(index).tolist():
        if not 0 <= expert < stack.shape[0]:  # expert-parallel sentinels
            continue
        routed = x[(index == expert).any(-1)]
        out = routed @ stack[expert] if transposed else F.linear(routed, stack[expert])
        if bias is not None:
            out = out + bias[expert]
        yield expert, gate(out)
