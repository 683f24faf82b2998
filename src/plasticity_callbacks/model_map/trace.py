"""How the forward uses each weight, read by running it: orientation, stacked matrices and output splits.

One forward on one token under a ``TorchFunctionMode`` answers, for every ≥2-D parameter:

* **is it a linear map, and which way round?** ``F.linear(x, W)`` uses ``W`` as ``(out, in)``;
  ``x @ W`` / ``bmm`` / ``addmm`` / ``grouped_mm`` as ``(in, out)``. A 3-D parameter indexed one
  matrix at a time (``W[e]``, transformers' expert loop) or passed whole to a batched matmul is a
  **stack** of such matrices (mixture-of-experts ``gate_up_proj``/``down_proj``); a 2-D parameter that
  is not an ``nn.Linear``'s (a router's ``weight``) is a plain matrix. A parameter never used so
  (``A_log``, a state-space layer's own) is no linear map.
* **how is its output cut?** The output of every such use is replaced by its feature numbers
  (feature ``r`` holds ``r + 1``), which travel unchanged through ``view``/``transpose``/``pad``, a
  depthwise conv (channel ``c`` stays channel ``c``) and elementwise activations. Every
  ``split``/``chunk``/``unbind``/indexing of a numbered tensor is recorded by the rows each piece
  holds; rows that every cut keeps together form one block (``[x | z]`` of Mamba's ``in_proj``,
  ``[z | x | B | C | dt]`` of Mamba-2's, ``gate[::2] | up[1::2]`` of GPT-OSS's experts, ``[latent |
  rope key]`` of DeepSeek's ``kv_a_proj_with_mqa``, ModernBERT's ``Wi.chunk(2)``).

Cuts along other dims (tokens, batch) keep every row in every piece and refine nothing. Results
are cached per model until a parameter's shape changes (so a model read before FSDP2 shards it keeps
its layouts; a sharded model is never run here, its forward would all-gather). A model that cannot run on one token id
(or on ``x`` for a model without embeddings) gives no result: nothing is read, nothing is guessed.
A half-precision model is traced in float32 (the numbers must stay exact), which needs the memory of a
float32 copy of its weights for the duration of the trace.
"""
from __future__ import annotations

import contextlib
import warnings
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from .detached_hooks import hooks_detached
from .layouts import RowBlock


@dataclass(frozen=True)
class ParameterUse:
    """How the forward used one parameter.

    Attributes:
        transposed: used as ``(in, out)`` (``x @ W``) rather than ``(out, in)`` (``F.linear``), per matrix.
        stacked: a 3-D parameter used one ``(…)`` matrix per leading index (experts).
        blocks: row blocks of one matrix's ``(out, in)`` view read from the cuts of its output (``()``: none).
        consistent: every use agreed on orientation and blocks (else nothing here may be trusted).
    """

    transposed: bool
    stacked: bool
    blocks: tuple[RowBlock, ...]
    consistent: bool = True


_LINEAR = {F.linear}
_MATMUL = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.Tensor.mm, torch.bmm,
           torch.Tensor.bmm}
_ADDMM = {torch.addmm, torch.Tensor.addmm, torch.baddbmm, torch.Tensor.baddbmm}
_GROUPED = {f for f in (getattr(F, "grouped_mm", None), getattr(torch, "_grouped_mm", None)) if f is not None}
# Ops that keep each value where its feature is (up to a reshape): a numbered tensor stays numbered.
_SHAPE = {"view", "reshape", "transpose", "permute", "contiguous", "flatten", "unflatten", "squeeze", "unsqueeze",
          "expand", "expand_as", "clone", "to", "float", "double", "half", "bfloat16", "type", "movedim", "t", "T",
          "mT", "detach", "pad", "narrow", "repeat_interleave"}
_BIAS_ADD = {"add", "__add__", "__radd__"}
_CUT = {"split", "chunk", "tensor_split", "unbind", "__getitem__", "split_with_sizes", "narrow"}
# Elementwise activations: probed as the identity, so a split after "conv -> act" (Mamba-2's xBC) is still read.
_ACTIVATIONS = {F.silu, F.gelu, F.relu, F.softplus, F.sigmoid, torch.sigmoid, torch.tanh, torch.Tensor.sigmoid,
                torch.Tensor.tanh, torch.relu, F.mish, F.elu, torch.nn.functional.leaky_relu}
_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (shapes, {param id: ParameterUse})


def _name(func) -> str:
    return getattr(func, "__name__", "")


class _Tracer(TorchFunctionMode):
    """Follows parameters into linear maps and the numbered outputs of those maps into cuts."""

    def __init__(self, params: dict[int, nn.Parameter]):
        super().__init__()
        self.params = params
        self.slices: dict[int, tuple[int, torch.Tensor]] = {}  # id(tensor) -> (param id, the tensor): W[e], W.T
        self.flipped: dict[int, bool] = {}  # id(slice) -> transposed relative to the stored matrix
        self.numbered: dict[int, tuple[int, torch.Tensor]] = {}  # id(tensor) -> (param id, tensor) carrying numbers
        self.uses: dict[int, list[tuple[bool, bool]]] = {}  # param id -> [(transposed, stacked)]
        self.cuts: dict[int, list[list[set[int]]]] = {}  # param id -> cuts, each a list of pieces' row sets
        self.width: dict[int, int] = {}

    def _source(self, tensor) -> tuple[int, bool, bool] | None:
        """(param id, flipped, stacked) when ``tensor`` is a parameter or a slice/transpose of one."""
        if not isinstance(tensor, torch.Tensor):
            return None
        if id(tensor) in self.params and tensor is self.params[id(tensor)]:
            return id(tensor), False, tensor.dim() == 3
        entry = self.slices.get(id(tensor))
        if entry is not None and entry[1] is tensor:
            param = self.params[entry[0]]
            return entry[0], self.flipped[id(tensor)], param.dim() == 3
        return None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _name(func)
        if args and self._numbers(args[0]) is not None:
            if func in _ACTIVATIONS:
                return self._keep(args[0], args[0].clone())
            if name.startswith("__i") or (name.endswith("_") and not name.startswith("_")):
                return args[0]  # an in-place op (a bias added with add_) would overwrite the numbers: skipped
        if name in _BIAS_ADD and len(args) == 2:
            kept = self._bias_added(*args)
            if kept is not None:
                return kept
        result = func(*args, **kwargs)
        if func in _LINEAR:
            weight = args[1] if len(args) > 1 else kwargs.get("weight")
            return self._used(weight, False, result)
        if func in _MATMUL or func in _GROUPED:
            left, right = (args + (None, None))[:2]
            if self._source(right) is not None:
                return self._used(right, True, result)
            if self._source(left) is not None:  # W @ x: (out, in), the output's features in dim -2
                return self._used(left, False, result, feature_dim=-2)
            return result
        if func in _ADDMM and len(args) >= 3 and self._source(args[2]) is not None:
            return self._used(args[2], True, result)
        if func in (F.conv1d, torch.conv1d):
            return self._depthwise(args, kwargs, result)
        source = self._source(args[0]) if args else None
        if source is not None and name in ("__getitem__", "select", "transpose", "t", "T", "mT", "permute",
                                           "contiguous", "to", "float", "view", "reshape"):
            self._slice(source, name, args, result)
        numbers = self._numbers(args[0]) if args else None
        if numbers is not None:
            if name in _CUT:
                pieces = list(result) if isinstance(result, (tuple, list)) else [result]
                self._cut(numbers, pieces)
                for piece in pieces:
                    self._keep(args[0], piece)
            elif name in _SHAPE:
                for piece in (result if isinstance(result, (tuple, list)) else [result]):
                    self._keep(args[0], piece)
        return result

    def _bias_added(self, a, b):
        """``numbered + bias`` (a parameter, or a parameter's rows ``b[e]``) keeps the numbers."""
        for numbered, other in ((a, b), (b, a)):
            if self._numbers(numbered) is not None and (isinstance(other, nn.Parameter) or self._source(other)):
                return self._keep(numbered, numbered.clone())
        return None

    def _slice(self, source, name, args, result) -> None:
        param_id, flipped, stacked = source
        if not isinstance(result, torch.Tensor):
            return
        if name in ("transpose", "t", "T", "mT", "permute"):
            flipped = not flipped
        elif name in ("__getitem__", "select") and stacked and result.dim() == 2:
            pass  # W[e]: one expert's matrix
        elif name == "__getitem__":
            pass  # W[expert_ids]: a batch of experts' matrices; b[e]: one expert's bias
        elif name not in ("contiguous", "to", "float"):
            return
        self.slices[id(result)] = (param_id, result)
        self.flipped[id(result)] = flipped

    def _used(self, weight, transposed_use: bool, result, feature_dim: int = -1):
        """Record a use of ``weight`` in a linear map and return its output with feature ``r`` (along
        ``feature_dim``) holding ``r + 1``."""
        source = self._source(weight)
        if source is None:
            return result
        param_id, flipped, stacked = source
        self.uses.setdefault(param_id, []).append((transposed_use != flipped, stacked))
        if not isinstance(result, torch.Tensor) or result.dim() < -feature_dim:
            return result
        width = result.shape[feature_dim]
        self.width[param_id] = width
        numbers = torch.arange(1, width + 1, device=result.device).to(result.dtype)
        numbered = numbers.view(-1, *([1] * (-feature_dim - 1))).expand_as(result).clone()
        self.numbered[id(numbered)] = (param_id, numbered)
        return numbered

    def _numbers(self, tensor) -> int | None:
        entry = self.numbered.get(id(tensor)) if isinstance(tensor, torch.Tensor) else None
        return entry[0] if entry is not None and entry[1] is tensor else None

    def _keep(self, parent, child):
        if isinstance(child, torch.Tensor):
            self.numbered[id(child)] = (self.numbered[id(parent)][0], child)
        return child

    def _cut(self, param_id: int, pieces: list) -> None:
        width = self.width[param_id]
        rows = []
        for piece in pieces:
            if not isinstance(piece, torch.Tensor) or not piece.is_floating_point():
                return
            values = torch.unique(piece.detach().float().round()).long()
            rows.append({int(v) - 1 for v in values.tolist() if 1 <= v <= width})
        self.cuts.setdefault(param_id, []).append(rows)

    def _depthwise(self, args, kwargs, result):
        """A depthwise conv keeps channels apart: its output channel ``c`` carries input channel ``c``'s number."""
        x = args[0] if args else kwargs.get("input")
        param_id = self._numbers(x)
        weight = args[1] if len(args) > 1 else kwargs.get("weight")
        groups = args[6] if len(args) > 6 else kwargs.get("groups", 1)
        if param_id is None or weight is None or groups != x.shape[1] or weight.shape[0] != groups:
            return result
        numbered = x[..., :1].expand_as(result).clone()  # (B, C, L): every position holds its channel's number
        self.numbered[id(numbered)] = (param_id, numbered)
        return numbered


def trace_uses(model: nn.Module, params: dict[str, nn.Parameter]) -> dict[str, ParameterUse] | None:
    """How ``model``'s forward uses each of ``params`` (by name), or None when the model would not run.

    A parameter absent from the answer was never used as a linear map.

    Example:
        >>> uses = trace_uses(model, dict(model.named_parameters()))
        >>> uses["model.layers.0.mlp.experts.gate_up_proj"].stacked
        True
    """
    shapes = {n: tuple(p.shape) for n, p in params.items()}
    cached = _CACHE.get(model)
    if cached is not None and cached[0] == shapes:
        return cached[1]
    if any(type(p).__name__ == "DTensor" or type(p.data).__name__ == "DTensor" for p in params.values()):
        return None  # FSDP2: a forward all-gathers on every rank; the layouts were read before sharding (cached)
    tracer = _Tracer({id(p): p for p in params.values()})
    with hooks_detached(model), in_float32(model), preserved(model), torch.no_grad(), warnings.catch_warnings(), tracer:
        warnings.simplefilter("ignore")
        ran = torch.compiler.disable(_forward)(model)  # eager: a compiled forward is neither run nor recompiled
    result = None
    if ran:
        result = {}
        for name, param in params.items():
            uses = tracer.uses.get(id(param))
            if uses:
                result[name] = _summary(uses, tracer.cuts.get(id(param), []), tracer.width.get(id(param)))
    _CACHE[model] = (shapes, result)
    return result


@contextlib.contextmanager
def in_float32(model: nn.Module):
    """Half-precision parameters and buffers seen as float32 copies while the block runs (bf16 holds integers
    exactly only up to 256, so feature numbers would collide); the original tensors are put back after."""
    low = (torch.float16, torch.bfloat16)
    params = [(p, p.data) for p in model.parameters() if p.dtype in low]
    buffers = [(m, n, b) for m in model.modules() for n, b in m._buffers.items() if b is not None and b.dtype in low]
    try:
        for p, data in params:
            p.data = data.float()
        for module, name, buffer in buffers:
            module._buffers[name] = buffer.float()
        yield
    finally:
        for p, data in params:
            p.data = data
        for module, name, buffer in buffers:
            module._buffers[name] = buffer


@contextlib.contextmanager
def preserved(model: nn.Module):
    """Run a probing forward in eval mode and leave ``model`` as it was: every module's attributes (a forward
    may store its input, a cache) and buffers are put back, and each module's training flag."""
    saved = [(m, dict(m.__dict__), {n: b.clone() for n, b in m._buffers.items() if b is not None})
             for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, attributes, buffers in saved:
            module.__dict__.clear()
            module.__dict__.update(attributes)
            with torch.no_grad():
                for name, value in buffers.items():
                    if module._buffers.get(name) is not None and module._buffers[name].shape == value.shape:
                        module._buffers[name].copy_(value)


def _summary(uses: list[tuple[bool, bool]], cuts: list[list[set[int]]], width: int | None) -> ParameterUse:
    consistent = len(set(uses)) == 1
    transposed, stacked = uses[0]
    if not width or not cuts:
        return ParameterUse(transposed, stacked, (), consistent)
    # Rows cut apart by any recorded cut are in different blocks: group rows by which piece of each cut holds them.
    signature = {r: tuple(tuple(i for i, piece in enumerate(cut) if r in piece) for cut in cuts)
                 for r in range(width)}
    groups: dict[tuple, list[int]] = {}
    for row, key in signature.items():
        groups.setdefault(key, []).append(row)
    if len(groups) == 1:
        return ParameterUse(transposed, stacked, (), consistent)
    blocks = []
    for i, rows in enumerate(sorted(groups.values(), key=lambda rows: rows[0])):
        contiguous = rows == list(range(rows[0], rows[-1] + 1))
        blocks.append(RowBlock(f"part{i}", range(rows[0], rows[-1] + 1) if contiguous else tuple(rows)))
    return ParameterUse(transposed, stacked, tuple(blocks), consistent)


def _forward(model: nn.Module) -> bool:
    """Run the model on one token (see :func:`run_one_token`), else on one zero input vector of its first
    Linear's width."""
    if run_one_token(model):
        return True
    first = next((m for m in model.modules() if isinstance(m, nn.Linear)), None)
    if first is None:
        return False
    try:
        model(torch.zeros(1, 1, first.in_features, device=first.weight.device))
        return True
    except Exception:  # noqa: BLE001 - a forward that needs more than one input means "unknown", not a crash
        return False


def run_one_token(model: nn.Module) -> bool:
    """Run the module that takes token ids on one token: a Hugging Face model on ``input_ids`` (without a
    cache), else the outermost module holding an embedding whose ``forward(idx)`` runs (the model itself, or
    the network a LightningModule holds when it has no ``forward`` of its own, litgpt's ``GPT``).
    Returns whether one ran."""
    device = next(model.parameters()).device
    token = torch.zeros(1, 1, dtype=torch.long, device=device)
    hf = next((m for m in model.modules() if hasattr(m, "config") and getattr(m, "main_input_name", "") == "input_ids"),
              None)
    attempts = [lambda: hf(input_ids=token, use_cache=False), lambda: hf(input_ids=token)] if hf is not None else []
    holders = [m for m in model.modules() if any(isinstance(x, nn.Embedding) for x in m.modules())]
    attempts += [lambda m=m: m(token) for m in holders if not isinstance(m, nn.Embedding)]
    for attempt in attempts:
        try:
            attempt()
            return True
        except Exception:  # noqa: BLE001 - a forward that needs more than one input means "unknown", not a crash
            continue
    return False
