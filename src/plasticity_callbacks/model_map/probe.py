"""Read a fused projection's Q/K/V split from the model's own forward, by a probe.

The fused layer's output is replaced by a known pattern (feature ``r`` holds ``r + 1``) and the
attention call that follows (``scaled_dot_product_attention``, or the eager ``matmul``/``bmm``
pair) is intercepted with a ``TorchFunctionMode``: the values that reach its query, key and value
arguments name the rows each one came from, whatever ``view``/``split``/``chunk``/``transpose`` the
forward did in between. A run with every feature at ``1`` gives the scale each argument was
multiplied by on the way (``q · head_dim^-½`` in some code), so the ratio of the two runs is exact.
A half-precision model is probed in float32 (:func:`~.trace.in_float32`; bf16 holds integers exactly only
up to 256), and its row numbers still travel as base-16 digits, one run per digit. One token
(position 0) keeps rotary embeddings the identity.

The result is accepted only when every row of the layer reaches at most one of Q, K, V; rows that
reach none of them (a compressed latent another layer expands) form one more block. Every Linear of
the attention module is numbered in the same run, so no unnumbered value reaches an operand.
Anything else (a norm on q/k, a model that cannot run without real inputs) gives ``None``: the
layout is then unknown, never guessed.
"""
from __future__ import annotations

import math
import warnings
import weakref

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from .detached_hooks import hooks_detached
from .layouts import RowBlock
from .trace import in_float32, preserved, run_one_token

_SDPA = F.scaled_dot_product_attention
_MATMULS = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.Tensor.bmm}
_BADDBMM = {torch.baddbmm, torch.Tensor.baddbmm}
_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # layer -> (weight shape, blocks or None)


class _Recorder(TorchFunctionMode):
    """Keeps the operands of attention-like calls made while a probed attention module runs."""

    def __init__(self):
        super().__init__()
        self.active: list[str] = []
        self.calls: dict[str, list[tuple[str, list[torch.Tensor]]]] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.active:
            calls = self.calls.setdefault(self.active[-1], [])
            if func is _SDPA:
                names = ("query", "key", "value")
                operands = [*args[:3], *(kwargs[n] for n in names[len(args[:3]):] if n in kwargs)]
                calls.append(("sdpa", [t.detach().clone() for t in operands]))
            elif func in _MATMULS and len(args) >= 2 and all(isinstance(a, torch.Tensor) for a in args[:2]):
                calls.append(("matmul", [args[0].detach().clone(), args[1].detach().clone()]))
            elif func in _BADDBMM:  # baddbmm(input, batch1, batch2), batch1/batch2 possibly by keyword
                operands = [kwargs.get(n, args[i] if len(args) > i else None)
                            for i, n in ((1, "batch1"), (2, "batch2"))]
                if all(isinstance(t, torch.Tensor) for t in operands):
                    calls.append(("matmul", [t.detach().clone() for t in operands]))
        return func(*args, **kwargs)


def probe_fused_layouts(model: nn.Module, layers: dict[str, nn.Module]) -> dict[str, tuple[RowBlock, ...] | None]:
    """Q/K/V row blocks of each fused ``layers[name]`` (an ``nn.Linear`` or HF ``Conv1D`` inside an attention
    module), read from ``model``'s forward. ``()`` means the layer feeds one part whole (not fused), ``None``
    that the probe could not tell.

    Example:
        >>> probe_fused_layouts(model, {"gpt_neox.layers.0.attention.query_key_value": layer})
    """
    found, pending = {}, {}
    for name, layer in layers.items():
        cached = _CACHE.get(layer)
        if cached is not None and cached[0] == tuple(layer.weight.shape):
            found[name] = cached[1]
        else:
            pending[name] = layer
    if not pending:
        return found
    pending = dict(layers)  # every layer of the attention numbered in one run: no stray value reaches Q, K, V
    # Layers under one attention module get disjoint numbers, so each value names one layer's row.
    offsets, used = {}, {}
    for name, layer in pending.items():
        offsets[name] = used.get(_parent(name), 0)
        used[_parent(name)] = offsets[name] + _width(layer)
    # Half precision holds integers exactly only up to 256 (bf16): send row numbers as base-16 digits, one run
    # per digit, and accept a ratio within 0.25 of an integer (a rescale by head_dim^-½ rounds in bf16).
    low = any(p.dtype in (torch.float16, torch.bfloat16) for p in model.parameters())
    base = 16 if low else 2 ** 20
    digits = 1 + int(math.log(max(used.values()), base)) if max(used.values()) > 1 else 1
    with hooks_detached(model):  # before the probe's own hooks are added
        scale = _run(model, pending, offsets, None)
        numbered = [_run(model, pending, offsets, base ** d, base) for d in range(digits)]
    for name, layer in pending.items():
        blocks = _decode(name, layer, offsets[name], used[_parent(name)], scale, numbered, base,
                         0.25 if low else 1e-3)
        _CACHE[layer] = (tuple(layer.weight.shape), blocks)
        found[name] = blocks
    return found


def _width(layer: nn.Module) -> int:
    return layer.nf if hasattr(layer, "nf") else layer.weight.shape[0]


def _parent(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def _run(model: nn.Module, layers: dict[str, nn.Module], offsets: dict[str, int], place: int | None, base: int = 0):
    """One probing forward: feature ``r`` of each layer carries digit ``(offset + r) // place % base`` plus one
    (``place=None``: all ones). Returns ``{parent name: recorded calls}``, or None when the model would not run."""
    recorder = _Recorder()
    handles = []
    for name, layer in layers.items():
        def replace(module, inputs, output, width=_width(layer), offset=offsets[name]):
            numbers = torch.arange(offset, offset + width, device=output.device)
            values = (numbers // place % base + 1 if place else torch.ones_like(numbers)).to(output.dtype)
            return values.expand_as(output).clone()

        parent = model.get_submodule(_parent(name))

        def enter(module, args, parent_name=_parent(name)):
            recorder.active.append(parent_name)

        def leave(module, args, output):
            recorder.active.pop()

        handles += [layer.register_forward_hook(replace), parent.register_forward_pre_hook(enter),
                    parent.register_forward_hook(leave)]
    try:
        with in_float32(model), preserved(model), torch.no_grad(), warnings.catch_warnings(), recorder:
            warnings.simplefilter("ignore")
            ran = torch.compiler.disable(_forward)(model, layers)  # eager: no recompilation of a compiled forward
    finally:
        for handle in handles:
            handle.remove()
    return recorder.calls if ran else None


def _forward(model: nn.Module, layers: dict[str, nn.Module]) -> bool:
    """Run a Hugging Face model on ``input_ids``, else each attention module on ``x``, else the module that
    takes token ids (the model, or the network a LightningModule without ``forward`` holds) on one token."""
    device = next(model.parameters()).device
    hf = any(hasattr(m, "config") and getattr(m, "main_input_name", "") == "input_ids" for m in model.modules())
    if not hf:
        try:
            for name, layer in layers.items():
                inputs = layer.nx if hasattr(layer, "nx") else layer.weight.shape[1]
                model.get_submodule(_parent(name))(torch.zeros(1, 1, inputs, device=device))
            return True
        except Exception:  # noqa: BLE001 - an attention that needs more than x (rotary tables, a mask): try the model
            pass
    return run_one_token(model) is not None


def _operands(calls) -> list[torch.Tensor] | None:
    """(query, key, value) of the first attention in ``calls``: an SDPA call, or an eager matmul pair."""
    if not calls:
        return None
    for kind, operands in calls:
        if kind == "sdpa" and len(operands) == 3:
            return operands
    matmuls = [operands for kind, operands in calls if kind == "matmul"]
    if len(matmuls) < 2:
        return None
    (query, key), (_, value) = matmuls[:2]
    return [query, key, value]


def _decode(name: str, layer: nn.Module, offset: int, total: int, scale, numbered: list, base: int, tolerance: float
            ) -> tuple[RowBlock, ...] | None:
    """This layer's rows in each of Q, K, V; ``offset``: its first number, ``total``: all numbers under its parent;
    ``numbered``: one run per base-``base`` digit, lowest first."""
    if scale is None or any(run is None for run in numbered):
        return None
    parent = _parent(name)
    ones, runs = _operands(scale.get(parent)), [_operands(run.get(parent)) for run in numbered]
    if ones is None or any(r is None or [t.shape for t in r] != [t.shape for t in ones] for r in runs):
        return None
    width, parts = _width(layer), []
    for part, one in enumerate(ones):
        if not bool((one != 0).all()):
            return None
        ids = torch.zeros(one.numel(), dtype=torch.long)
        for place, run in enumerate(runs):
            ratio = (run[part].double() / one.double()).flatten().cpu()
            digit = torch.round(ratio)
            if not bool(torch.allclose(ratio, digit, rtol=0, atol=tolerance)) or digit.min() < 1 or digit.max() > base:
                return None
            ids += (digit.long() - 1) * base ** place
        if ids.max() >= total:
            return None
        mine = ids[(ids >= offset) & (ids < offset + width)]
        parts.append(sorted(set((mine - offset).tolist())))
    reached = [r for p in parts for r in p]
    if len(reached) != len(set(reached)):
        return None  # a row in two of Q, K, V: not a partition, unknown, never guessed
    # Rows that reach no attention operand (a latent that another layer expands, DeepSeek's kv_a_proj_with_mqa)
    # are one more block of their own.
    parts.append(sorted(set(range(width)) - set(reached)))
    if sum(bool(p) for p in parts) == 1:
        return ()
    blocks = []
    for label, rows in zip(("q", "k", "v", "rest"), parts):
        contiguous = rows == list(range(rows[0], rows[-1] + 1)) if rows else False
        blocks.append(RowBlock(label, range(rows[0], rows[-1] + 1) if contiguous else tuple(rows)))
    return tuple(b for b in blocks if len(b))
