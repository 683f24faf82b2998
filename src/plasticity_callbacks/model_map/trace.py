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

Cuts along other dims (tokens, batch) keep every row in every piece and refine nothing.

**Fail closed.** A weight is whole only when the trace proves that no cut separates its rows. So the numbers are
followed exactly through every op the trace models: elementwise ops with a broadcast operand (``in_proj(x) *
mup``, a bias, a residual, ``clamp``, norms and activations, probed as the identity), sums and products of traced
layers (``gate_up(x) + adapter(x)``: each keeps its own numbering), ``cat``/``stack`` (experts' outputs one after
another; a layer's own pieces put back along its features join again, as rotary's ``cat(-x2, x1)``), products of
activations and ``einsum`` (``attention @ value`` keeps the value's features; summing over a feature dim, like
``q @ kᵀ``, a norm's mean square or a router's top-k and gather, consumes the numbers). Through any other op, a result
shaped like its numbered operand keeps that operand's numbers marked *unsure*: a later cut that separates rows is
recorded as one the trace cannot vouch for, and the weight is refused by name (``ParameterUse.unproven``) with the
``declare_plasticity`` line to give; a result of another shape loses the numbers, which refuses the weight too (no
later cut could be seen). Results
are cached per model until a parameter's shape changes (so a model read before FSDP2 shards it keeps
its layouts; a sharded model is never run here, its forward would all-gather). A model the map cannot run
(:func:`run_forward` names the inputs it makes) gives no result: nothing is read, nothing is guessed, and the map
refuses its Linear weights to the methods that need their blocks.
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
from .weights import CONV, is_conv1d


@dataclass(frozen=True)
class ParameterUse:
    """How the forward used one parameter.

    Attributes:
        transposed: used as ``(in, out)`` (``x @ W``) rather than ``(out, in)`` (``F.linear``), per matrix.
        stacked: used one ``(…)`` matrix per leading index (experts): a 3-D parameter, or a 2-D one that the
            forward views as ``(experts, ·, ·)``.
        blocks: row blocks of one matrix's ``(out, in)`` view read from the cuts of its output (``()``: none).
        consistent: every use agreed on orientation and blocks (else nothing here may be trusted).
        experts: how many matrices a 2-D parameter viewed ``(experts, ·, ·)`` holds (0: not viewed so).
        unproven: the ops that lost the row numbering before a cut that may separate rows ("": the blocks are
            proven, whole included); the rows are then neither whole nor split as read.
        suggested: the split to declare for an ``unproven`` weight: the one the modelled cuts prove, else the one read
            when the cuts behind ``unproven`` are counted too.
    """

    transposed: bool
    stacked: bool
    blocks: tuple[RowBlock, ...]
    consistent: bool = True
    experts: int = 0
    unproven: str = ""
    suggested: tuple[RowBlock, ...] = ()


@dataclass(frozen=True)
class _Numbering:
    """Row numbers a tensor carries: its values are rows (``r + 1``) of each of ``params``' outputs. ``exact``:
    every op since the linear map was modelled; else ``via`` names the op that may have moved them."""

    params: frozenset
    tensor: torch.Tensor
    exact: bool = True
    via: str = ""


_LINEAR = {F.linear}
_MATMUL = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.Tensor.mm, torch.bmm,
           torch.Tensor.bmm}
_ADDMM = {torch.addmm, torch.Tensor.addmm, torch.baddbmm, torch.Tensor.baddbmm}
_GROUPED = {f for f in (getattr(F, "grouped_mm", None), getattr(torch, "_grouped_mm", None)) if f is not None}
# Ops that move values without changing them (up to a reshape): applied to numbers they give the moved numbers.
_SHAPE = {"view", "reshape", "transpose", "permute", "contiguous", "flatten", "unflatten", "squeeze", "unsqueeze",
          "expand", "expand_as", "clone", "to", "float", "double", "half", "bfloat16", "type", "type_as", "movedim",
          "t", "T", "mT", "detach", "pad", "narrow", "repeat_interleave", "repeat", "tile", "flip", "roll",
          "broadcast_to", "view_as", "reshape_as", "swapaxes", "swapdims", "data", "H", "mH", "real"}
_CUT = {"split", "chunk", "tensor_split", "unbind", "__getitem__", "split_with_sizes", "narrow"}
# Ops that sum over their operand's features (a norm's mean square) or pick from them by routing (a router's top-k
# and the gather of the chosen scores): the values no longer stand for fixed rows, so no later cut can split them.
_CONSUME = {"gather", "take_along_dim", "index_select", "sum", "mean", "amax", "amin", "max", "min", "norm", "var",
            "std", "prod", "logsumexp", "topk", "sort", "argmax", "argmin", "argsort", "var_mean", "std_mean", "nansum",
            "nanmean", "linalg_vector_norm",
            "vector_norm", "cross_entropy", "nll_loss", "mse_loss", "one_hot", "multinomial", "new_empty", "new_zeros",
            "new_ones", "new_full", "new_tensor", "zeros_like", "ones_like", "empty_like", "full_like", "rand_like",
            "randn_like"}
# Spatial pooling and resizing: each channel's values stay in that channel.
_POOLS = {"avg_pool1d", "avg_pool2d", "avg_pool3d", "max_pool1d", "max_pool2d", "max_pool3d", "adaptive_avg_pool1d",
          "adaptive_avg_pool2d", "adaptive_avg_pool3d", "adaptive_max_pool1d", "adaptive_max_pool2d",
          "adaptive_max_pool3d", "max_pool1d_with_indices", "max_pool2d_with_indices", "lp_pool2d", "interpolate",
          "upsample", "upsample_nearest2d", "upsample_bilinear2d"}
_CONV_FUNCS = {F.conv1d, F.conv2d, F.conv3d, torch.conv1d, torch.conv2d, torch.conv3d}
_JOIN = {"cat", "concat", "concatenate", "stack", "hstack", "vstack"}
# Ops that keep every value where it is: a numbered operand's numbers, broadcast to the result, are the result's.
# (Activations and norms are probed as the identity, so a split after "conv -> act" (Mamba-2's xBC) is still read.)
_POSITIONAL = {"add", "__add__", "__radd__", "sub", "__sub__", "__rsub__", "rsub", "mul", "__mul__", "__rmul__",
               "multiply", "div", "__truediv__", "__rtruediv__", "true_divide", "divide", "__pow__", "__rpow__", "pow",
               "neg", "__neg__", "negative", "abs", "exp", "log", "sqrt", "rsqrt", "square", "reciprocal", "sin",
               "cos", "tanh", "sigmoid", "erf", "softplus", "silu", "gelu", "relu", "relu6", "mish", "elu", "selu",
               "celu", "leaky_relu", "hardtanh", "hardswish", "hardsigmoid", "logsigmoid", "softmax", "log_softmax",
               "dropout", "clamp", "clip", "clamp_min", "clamp_max", "maximum", "minimum", "where", "masked_fill",
               "nan_to_num", "lerp", "addcmul", "addcdiv", "layer_norm", "rms_norm", "group_norm", "normalize",
               "sign", "exp2", "expm1", "log1p", "sinh", "cosh", "atan", "asinh"}
_SUMS = {"add", "__add__", "__radd__", "sub", "__sub__", "__rsub__", "rsub"}
_ACTIVATIONS = {F.silu, F.gelu, F.relu, F.softplus, F.sigmoid, torch.sigmoid, torch.tanh, torch.Tensor.sigmoid,
                torch.Tensor.tanh, torch.relu, F.mish, F.elu, torch.nn.functional.leaky_relu}
_SDPA = F.scaled_dot_product_attention
_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (shapes, {param id: ParameterUse})


def _name(func) -> str:
    name = getattr(func, "__name__", "")
    if name == "__get__":  # a property: Tensor.T, .mT, .data
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    return name


def _tensors(values) -> list[torch.Tensor]:
    """The tensors among ``values``, one level into lists and tuples (``torch.cat``'s first argument)."""
    out = []
    for value in values:
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, (list, tuple)):
            out.extend(v for v in value if isinstance(v, torch.Tensor))
    return out


def _varies(tensor: torch.Tensor, dim: int) -> bool:
    """Whether ``tensor``'s values change along ``dim`` (a dim holding features, not tokens)."""
    if tensor.dim() == 0 or tensor.shape[dim] <= 1:
        return False
    # Zeros are no rows (padding, F.pad's): a dim varies when two of its rows differ.
    return not bool(((tensor == 0) | (tensor == tensor.amax(dim, keepdim=True))).all())


class _Tracer(TorchFunctionMode):
    """Follows parameters into linear maps and the numbered outputs of those maps into cuts.

    Every op a numbered tensor meets is either modelled (its result's numbers are exact), or not: then a result
    shaped like a numbered operand carries that operand's numbers marked unsure, so that a cut after it is
    recorded as one that may separate rows (fail closed), never dropped.
    """

    def __init__(self, params: dict[int, nn.Parameter]):
        super().__init__()
        self.params = params
        # id(tensor) -> (param id, the tensor, transposed relative to the stored matrix, one matrix of a stack)
        self.slices: dict[int, tuple[int, torch.Tensor, bool, bool]] = {}
        self.numbered: dict[int, _Numbering] = {}  # id(tensor) -> the row numbers it carries
        self.uses: dict[int, list[tuple[bool, bool]]] = {}  # param id -> [(transposed, stacked)]
        # param id -> cuts in forward order: (each piece's row set, "" or the unmodelled op the numbers went through)
        self.cuts: dict[int, list[tuple[list[set[int]], str]]] = {}
        # param id -> (rows concatenated back along their features (rotary's cat(-x2, x1)), cuts recorded before)
        self.joins: dict[int, list[tuple[set[int], int]]] = {}
        self.width: dict[int, int] = {}
        self.experts: dict[int, int] = {}  # param id -> E, a 2-D parameter viewed (E, ·, ·)
        self.lost: dict[int, str] = {}  # param id -> the unmodelled op its numbers could not follow through

    def _source(self, tensor) -> tuple[int, bool, bool] | None:
        """(param id, flipped, stacked) when ``tensor`` is a parameter or a slice/transpose of one."""
        if not isinstance(tensor, torch.Tensor):
            return None
        if id(tensor) in self.params and tensor is self.params[id(tensor)]:
            return id(tensor), False, tensor.dim() == 3
        entry = self.slices.get(id(tensor))
        if entry is not None and entry[1] is tensor:
            return entry[0], entry[2], entry[3]
        return None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _name(func)
        first = self._numbers(args[0]) if args else None
        if first is not None:
            if func in _ACTIVATIONS:
                return self._keep(first, args[0].clone())
            if name.startswith("__i") or (name.endswith("_") and not name.startswith("_")):
                return args[0]  # an in-place op (a bias added with add_) would overwrite the numbers: skipped
            if name == "__setitem__":
                return None  # a write into part of a numbered tensor would overwrite its numbers: skipped
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
            return self._product(left, right, result)
        if func in _ADDMM and len(args) >= 3 and self._source(args[2]) is not None:
            return self._used(args[2], True, result)
        if func in _ADDMM:  # input + batch1 @ batch2 of activations (ALiBi's scores)
            left = args[1] if len(args) > 1 else kwargs.get("batch1", kwargs.get("mat1"))
            right = args[2] if len(args) > 2 else kwargs.get("batch2", kwargs.get("mat2"))
            return self._product(left, right, result)
        if name == "einsum":
            return self._einsum(args, result)
        if func in _CONV_FUNCS:
            kept = self._depthwise(args, kwargs, result)  # a depthwise conv carries its input's channel numbers
            weight = args[1] if len(args) > 1 else kwargs.get("weight")
            if kept is result and isinstance(result, torch.Tensor) and result.dim() >= 3:
                # any other conv mixes its input channels into new ones, numbered by its own kernel's rows
                return self._used(weight, False, result, feature_dim=-(result.dim() - 1))
            return kept
        if name.startswith("conv_transpose"):  # mixes its input channels (its own output channels are not read)
            return result
        if func is _SDPA:  # the output holds the value's features: attention mixes tokens, not features
            value = args[2] if len(args) > 2 else kwargs.get("value")
            return self._product(None, value, result)
        source = self._source(args[0]) if args else None
        if source is not None and name in ("__getitem__", "select", "transpose", "t", "T", "mT", "permute",
                                           "contiguous", "to", "float", "view", "reshape", "unflatten"):
            self._slice(source, name, result)
        if name in _JOIN:
            return self._joined(name, args, kwargs, result)
        if first is not None and name in _CUT:
            pieces = list(result) if isinstance(result, (tuple, list)) else [result]
            self._cut(first, pieces)
            for piece in pieces:
                self._keep(first, piece)
            return result
        if first is not None and name in _POOLS and isinstance(result, torch.Tensor):
            return self._keep(first, result)  # a channel's positions all hold its number: pooled, they still do
        if first is not None and name in _SHAPE:
            for piece in (result if isinstance(result, (tuple, list)) else [result]):
                self._keep(first, piece)
            return result
        operands = [(t, self._numbers(t)) for t in _tensors(args) + _tensors(kwargs.values())]
        operands = [(t, n) for t, n in operands if n is not None]
        if not operands or not isinstance(result, (torch.Tensor, tuple, list)):
            return result
        if name in _POSITIONAL and isinstance(result, torch.Tensor):
            return self._positional(name, operands, result)
        if name in _CONSUME:
            return result
        return self._unmodelled(name, operands, result)

    def _positional(self, name, operands, result):
        """An elementwise op: each numbered operand's numbers broadcast to the result. One numbered operand (a bias,
        a scale by a buffer or parameter, a residual) or several with the same numbers (a layer summed with an
        adapter, ``act(gate) * up`` of two layers) keep them exactly, each layer its own; different numbers
        (two parts of one output multiplied) are kept unsure."""
        if not result.is_floating_point():
            return result
        spread = []
        for tensor, numbering in operands:
            try:
                spread.append((tensor.expand(result.shape) if tensor.shape != result.shape else tensor, numbering))
            except RuntimeError:
                return result
        numbers = spread[0][0]
        params = frozenset().union(*(n.params for _, n in spread))
        if all(torch.equal(numbers, other) for other, _ in spread[1:]):
            exact = all(n.exact for _, n in spread)
            via = next((n.via for _, n in spread if not n.exact), "")
            return self._mark(result, numbers, params, exact, via)
        if name in _SUMS and len({n.params for _, n in spread}) == 1 and all(n.exact for _, n in spread):
            # A sum of two exactly numbered parts of one output mixes their rows linearly (rotary's x1·cos + x2·sin):
            # the rows at each position join again, unless a later cut parts them. A product (gate · value), or a
            # sum with a tensor whose numbers are unsure, joins nothing.
            for other, _ in spread[1:]:
                pairs = torch.stack([numbers.flatten(), other.flatten()], 1).unique(dim=0)
                for param_id in params:
                    self.joins.setdefault(param_id, []).extend(
                        (self._rows(param_id, pair), len(self.cuts.get(param_id, []))) for pair in pairs)
        return self._mark(result, numbers, params, False, f"{name} of two differently numbered tensors")

    def _unmodelled(self, name, operands, result):
        """An op not modelled here: a result shaped like a numbered operand keeps its numbers, unsure."""
        params = frozenset().union(*(n.params for _, n in operands))
        pieces = list(result) if isinstance(result, (tuple, list)) else [result]
        if not any(isinstance(p, torch.Tensor) and (p.is_floating_point() or p.is_complex()) and p.numel() > 1
                   for p in pieces):
            return result  # sizes, flags, indices: no values that could carry rows
        changed = False
        for i, piece in enumerate(pieces):
            if not isinstance(piece, torch.Tensor) or not piece.is_floating_point():
                continue
            like = next((t for t, _ in operands if t.shape == piece.shape), None)
            if like is not None:
                pieces[i], changed = self._mark(piece, like, params, False, name), True
        if not changed:  # the numbers cannot follow into a new shape: nothing after it is proven uncut
            for param_id in params:
                self.lost.setdefault(param_id, name or "an unnamed op")
        if not changed or isinstance(result, torch.Tensor):
            return pieces[0] if isinstance(result, torch.Tensor) else result
        try:
            return type(result)(pieces)
        except TypeError:
            return result

    def _mark(self, result, numbers, params, exact, via):
        """A copy of ``numbers`` that stands for ``result`` from here on, carrying these rows."""
        out = numbers.to(result.dtype).clone()
        self.numbered[id(out)] = _Numbering(params, out, exact, via)
        return out

    def _product(self, left, right, result):
        """``left @ right`` of two activations: a numbered operand whose contracted dim holds no features (tokens,
        as ``attention @ value``) passes its numbers to the result; a contracted feature dim ends them."""
        if not isinstance(result, torch.Tensor) or result.dim() < 2:
            return result
        for operand, dim in ((right, -2), (left, -1)):
            numbering = self._numbers(operand)
            if numbering is None or operand.dim() < 2 or _varies(operand, dim):
                continue
            try:
                numbers = operand.amax(dim, keepdim=True).expand(result.shape)  # the row, wherever not padding
            except RuntimeError:
                continue
            return self._mark(result, numbers, numbering.params, numbering.exact, numbering.via)
        return result

    def _einsum(self, args, result):
        """``einsum``: a numbered operand whose varying letters (its features) are all summed over is consumed, like
        ``q @ kᵀ``; one whose varying letters all reach the output passes its numbers there (``attention @ value``
        over tokens); a numbered operand partly summed over its features cannot be followed (fail closed)."""
        equation, operands = (args[0], list(args[1:])) if args and isinstance(args[0], str) else (None, [])
        if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
            operands = list(operands[0])
        numbered = [(t, self._numbers(t)) for t in operands if isinstance(t, torch.Tensor)]
        numbered = [(t, n) for t, n in numbered if n is not None]
        if not numbered or not isinstance(result, torch.Tensor):
            return result
        if equation is None or "..." in equation or "->" not in equation:
            return self._unmodelled("einsum", numbered, result)
        inputs, output = equation.replace(" ", "").split("->")
        letters = dict(zip((id(t) for t in operands), inputs.split(",")))
        spread, params = [], frozenset()
        for tensor, numbering in numbered:
            own = letters.get(id(tensor), "")
            varying = {c for i, c in enumerate(own) if _varies(tensor, i)}
            if varying and not varying & set(output):
                continue  # every feature summed over: consumed
            if not varying <= set(output) or len(set(own)) != len(own):
                return self._unmodelled("einsum", numbered, result)
            kept = tensor
            for i in reversed(range(len(own))):  # constant along the summed letters but for padding: its rows
                if own[i] not in output:
                    kept = kept.amax(i)
            order = "".join(c for c in own if c in output)
            kept = torch.einsum(f"{order}->{''.join(c for c in output if c in order)}", kept)
            shape = [result.shape[i] if c in order else 1 for i, c in enumerate(output)]
            spread.append(kept.reshape(shape).expand(result.shape))
            params |= numbering.params
        if not spread:
            return result
        exact = all(n.exact for _, n in numbered) and all(torch.equal(spread[0], o) for o in spread[1:])
        return self._mark(result, spread[0], params, exact, "" if exact else "einsum of differently numbered tensors")

    def _joined(self, name, args, kwargs, result):
        """``cat``/``stack``: pieces along a dim that holds no features (experts' outputs one after another) keep
        their numbers, each layer its own; pieces of one layer put back along its features keep them too (their rows
        are joined again: rotary's ``cat(-x2, x1)``); anything else is kept unsure."""
        tensors = args[0] if args else kwargs.get("tensors", ())
        if not isinstance(tensors, (list, tuple)) or not isinstance(result, torch.Tensor):
            return result
        numberings = [self._numbers(t) for t in tensors]
        if all(n is None for n in numberings) or not result.is_floating_point():
            return result
        dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
        parts = [t if n is not None else torch.zeros_like(t) for t, n in zip(tensors, numberings)]
        try:
            join = getattr(torch, name)
            numbers = join(parts) if name in ("hstack", "vstack") else join(parts, dim)
        except Exception:  # noqa: BLE001 - shapes the op accepted but cannot be replayed: unsure
            return self._unmodelled(name, [(t, n) for t, n in zip(tensors, numberings) if n is not None], result)
        if numbers.shape != result.shape:
            return result
        found = [n for n in numberings if n is not None]
        params = frozenset().union(*(n.params for n in found))
        exact = all(n.exact for n in found) and len(found) == len(numberings)
        via = next((n.via for n in found if not n.exact), "" if exact else f"{name} with an unnumbered tensor")
        is_cat = name in ("cat", "concat", "concatenate")
        along_features = is_cat and any(_varies(t, dim) for t in tensors)
        same_numbers = is_cat or all(torch.equal(parts[0], p) for p in parts[1:])
        if len({n.params for n in found}) > 1 and (along_features or not same_numbers):
            exact, via = False, f"{name} of different layers' features"
        elif along_features:  # one layer's pieces put back together along its features: one block again
            for param_id in params:
                self.joins.setdefault(param_id, []).append((self._rows(param_id, numbers),
                                                            len(self.cuts.get(param_id, []))))
        return self._mark(result, numbers, params, exact, via)

    def _slice(self, source, name, result) -> None:
        param_id, flipped, stacked = source
        if not isinstance(result, torch.Tensor):
            return
        param = self.params[param_id]
        if name in ("transpose", "t", "T", "mT", "permute"):
            flipped = not flipped
        elif name in ("__getitem__", "select") and stacked and result.dim() == 2:
            pass  # W[e]: one expert's matrix
        elif name == "__getitem__":
            pass  # W[expert_ids]: a batch of experts' matrices; b[e]: one expert's bias
        elif name in ("view", "reshape", "unflatten"):
            if param.dim() == 2 and result.dim() == 3 and not stacked and not flipped:
                stacked = True  # (E·out, in) viewed (E, out, in): one matrix per expert (DBRX's w1, v1, w2)
                self.experts[param_id] = result.shape[0]
            elif result.shape != param.shape:
                return
        elif name not in ("contiguous", "to", "float"):
            return
        self.slices[id(result)] = (param_id, result, flipped, stacked)

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
        self.numbered[id(numbered)] = _Numbering(frozenset((param_id,)), numbered)
        return numbered

    def _numbers(self, tensor) -> _Numbering | None:
        """The numbering ``tensor`` carries (its values, or for an unsure result, the numbers standing for them)."""
        entry = self.numbered.get(id(tensor)) if isinstance(tensor, torch.Tensor) else None
        if entry is None:
            return None
        return entry if entry.tensor is tensor else None

    def _keep(self, numbering: _Numbering, child):
        """``child``, computed from a numbered tensor by a modelled op, carries the same numbering."""
        if isinstance(child, torch.Tensor):
            self.numbered[id(child)] = _Numbering(numbering.params, child, numbering.exact, numbering.via)
        return child

    def _rows(self, param_id: int, piece: torch.Tensor) -> set[int]:
        values = torch.unique(piece.detach().float().round()).long()
        return {int(v) - 1 for v in values.tolist() if 1 <= v <= self.width[param_id]}

    def _cut(self, numbering: _Numbering, pieces: list) -> None:
        if not all(isinstance(p, torch.Tensor) and p.is_floating_point() for p in pieces):
            return
        for param_id in numbering.params:
            rows = [self._rows(param_id, piece) for piece in pieces]
            self.cuts.setdefault(param_id, []).append((rows, "" if numbering.exact else numbering.via or "?"))

    def _depthwise(self, args, kwargs, result):
        """A depthwise conv keeps channels apart: its output channel ``c`` carries input channel ``c``'s number;
        any other conv mixes its input channels into new ones, as a Linear mixes features."""
        x = args[0] if args else kwargs.get("input")
        numbering = self._numbers(x)
        weight = args[1] if len(args) > 1 else kwargs.get("weight")
        groups = args[6] if len(args) > 6 else kwargs.get("groups", 1)
        if numbering is None or weight is None or groups != x.shape[1] or weight.shape[0] != groups:
            return result
        first = x[(..., *[slice(0, 1)] * (x.dim() - 2))]  # (B, C, 1, ...): every position holds its channel's number
        numbered = first.expand_as(result).clone()
        self.numbered[id(numbered)] = _Numbering(numbering.params, numbered, numbering.exact, numbering.via)
        return numbered


def trace_uses(model: nn.Module, params: dict[str, nn.Parameter]) -> dict[str, ParameterUse | None] | None:
    """How ``model``'s forward uses each of ``params`` (by name), or None when the model would not run.

    A parameter absent from the answer was never used as a linear map; one mapped to None lies outside the
    part of the model the map could run (:func:`run_forward`), so nothing is known of it.

    Example:
        >>> uses = trace_uses(model, dict(model.named_parameters()))
        >>> uses["model.layers.0.mlp.experts.gate_up_proj"].stacked
        True
    """
    # a new example input may let a forward run that could not before: part of what the reading depends on
    shapes = ({n: tuple(p.shape) for n, p in params.items()}, id(getattr(model, "example_input_array", None)))
    cached = _CACHE.get(model)
    if cached is not None and cached[0] == shapes:
        return cached[1]
    if any(type(p).__name__ == "DTensor" or type(p.data).__name__ == "DTensor" for p in params.values()):
        return None  # FSDP2: a forward all-gathers on every rank; the layouts were read before sharding (cached)
    tracer = _Tracer({id(p): p for p in params.values()})
    with hooks_detached(model), in_float32(model), preserved(model), torch.no_grad(), warnings.catch_warnings(), tracer:
        warnings.simplefilter("ignore")
        ran = torch.compiler.disable(run_forward)(model)  # eager: a compiled forward is neither run nor recompiled
    result = None
    if ran is not None:
        reached = {id(p) for p in ran.parameters()}
        # a weight outside the module that ran (an encoder when only a decoder took the token) is not read: None
        result = {name: None for name, param in params.items() if id(param) not in reached}
        for name, param in params.items():
            uses = tracer.uses.get(id(param))
            if uses:
                key = id(param)
                result[name] = _summary(uses, tracer.cuts.get(key, []), tracer.joins.get(key, []),
                                        tracer.width.get(key), tracer.experts.get(key, 0), tracer.lost.get(key, ""))
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


def _summary(uses: list[tuple[bool, bool]], cuts: list[tuple[list[set[int]], str]],
             joins: list[tuple[set[int], int]], width: int | None, experts: int, lost: str = "") -> ParameterUse:
    consistent = len(set(uses)) == 1
    transposed, stacked = uses[0]
    if not width:
        return ParameterUse(transposed, stacked, (), consistent, experts)
    blocks = _partition(cuts, joins, width, exact_only=True)
    unproven, suggested = "", ()
    unsure = [via for _, via in cuts if via]
    if unsure:
        counted = _partition(cuts, joins, width, exact_only=False)
        if len(counted) > max(len(blocks), 1):  # some cut after an unmodelled op separates rows: not proven
            # What to declare: the split the modelled cuts prove, else the one read through the unmodelled ops.
            unproven, suggested = ", ".join(dict.fromkeys(unsure)), blocks or counted
    if lost and not unproven:  # numbers that could not follow an op: a cut after it would go unseen
        unproven, suggested = lost, blocks
    return ParameterUse(transposed, stacked, blocks, consistent, experts, unproven, suggested)


def _partition(cuts: list[tuple[list[set[int]], str]], joins: list[tuple[set[int], int]], width: int,
               exact_only: bool) -> tuple[RowBlock, ...]:
    """Rows cut apart by any cut are in different blocks (rows grouped by which piece of each cut holds them),
    except rows the forward concatenated back together along their features and never cut apart after that
    (rotary's halves); ``()``: one block."""
    kept = [(i, rows) for i, (rows, via) in enumerate(cuts) if not (exact_only and via)]
    if not kept:
        return ()

    def signature(row: int, after: int = 0) -> tuple:
        return tuple(tuple(i for i, piece in enumerate(rows) if row in piece) for k, rows in kept if k >= after)

    parent = list(range(width))  # union-find over rows: a block is a class

    def find(r: int) -> int:
        while parent[r] != r:
            parent[r] = parent[parent[r]]
            r = parent[r]
        return r

    first: dict[tuple, int] = {}
    for row in range(width):
        parent[find(row)] = find(first.setdefault(signature(row), row))
    for joined, after in joins:
        together: dict[tuple, int] = {}
        for row in sorted(r for r in joined if r < width):
            parent[find(row)] = find(together.setdefault(signature(row, after), row))
    groups: dict[int, list[int]] = {}
    for row in range(width):
        groups.setdefault(find(row), []).append(row)
    if len(groups) == 1:
        return ()
    blocks = []
    for i, rows in enumerate(sorted(groups.values(), key=lambda rows: rows[0])):
        contiguous = rows == list(range(rows[0], rows[-1] + 1))
        blocks.append(RowBlock(f"part{i}", range(rows[0], rows[-1] + 1) if contiguous else tuple(rows)))
    return tuple(blocks)


def run_forward(model: nn.Module) -> nn.Module | None:
    """Run ``model`` once on an input the map can make and return the module whose forward ran (``model``, or the
    part of it the input reaches), or None: the module's ``example_input_array`` (Lightning's attribute; set it
    on any module) first, else a Hugging Face image or audio model on a zero input its config sizes, else one
    token id (see :func:`run_one_token`), else a zero image of the first conv's channels (the first side it
    accepts of 32, 28, 224, 64, 96, then 1…63) or a zero vector of the first Linear's width. A LightningModule without a
    ``forward`` of its own is read through the one network it holds (every weight in one child, as
    ``self.net``): that network's forward is what its steps call. The trace and the hidden-unit reader both read
    the forward through this one run; weights outside the module that ran are not read."""
    if _run_example(model):  # the user's own statement of the input comes first
        return model
    hf = _hf_call(model)
    if hf is not None and _ran(hf[1]):
        return hf[0]
    token = run_one_token(model)
    if token is not None:
        return token
    if _run_on_made_input(model):
        return model
    held = held_network(model)
    return held if held is not None and (_run_example(held) or _run_on_made_input(held)) else None


def _ran(call) -> bool:
    try:
        call()
        return True
    except Exception:  # noqa: BLE001 - a forward that will not run here means "unknown", not a crash
        return False


def _hf_call(model: nn.Module):
    """A call of the outermost Hugging Face module that takes images or audio, on a zero input its config sizes
    (``pixel_values``: ``image_size``; ``input_features``: Whisper's mel frames; ``input_values``: one second of
    16 kHz audio), with one decoder token for an encoder-decoder, as ``(module, call)``; None when there is none."""
    hf = next((m for m in model.modules() if hasattr(m, "config")
               and getattr(m, "main_input_name", "") in ("pixel_values", "input_features", "input_values")), None)
    if hf is None:
        return None
    config, device = hf.config, next(model.parameters()).device
    if hf.main_input_name == "pixel_values":
        side = getattr(config, "image_size", 224)
        x = torch.zeros(1, getattr(config, "num_channels", 3), *(side if isinstance(side, (tuple, list)) else (side, side)))
    elif hf.main_input_name == "input_features":
        x = torch.zeros(1, getattr(config, "num_mel_bins", 80), 2 * getattr(config, "max_source_positions", 1500))
    else:
        x = torch.zeros(1, 16000)
    inputs = {hf.main_input_name: x.to(device)}
    if getattr(config, "is_encoder_decoder", False):
        inputs["decoder_input_ids"] = torch.zeros(1, 1, dtype=torch.long, device=device)
    return hf, lambda: hf(**inputs)


def _on(value, device: torch.device):
    """``value`` (a tensor, or a tuple / list / dict of them) with its tensors on ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(_on(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _on(v, device) for k, v in value.items()}
    return value


# Common dataset sides first, then every small one: a flatten -> Linear fixes the side, and a failing attempt
# costs one trunk pass (all of 1…63 together cost about two 224-side passes).
_IMAGE_SIDES = (32, 28, 224, 64, 96, *(side for side in range(1, 64) if side not in (28, 32)))


def held_network(model: nn.Module) -> nn.Module | None:
    """The child holding every weight of a module whose class defines no ``forward`` (a LightningModule that
    computes in ``training_step``), or None: with several children, how its steps combine them is not read."""
    if "forward" in {name for cls in type(model).__mro__ if cls.__module__.split(".")[0] not in ("torch", "lightning",
                                                                                                "pytorch_lightning")
                     for name in vars(cls)}:
        return None
    holders = [child for child in model.children() if any(p.dim() >= 2 for p in child.parameters())]
    own = any(p.dim() >= 2 for p in model.parameters(recurse=False))
    return holders[0] if len(holders) == 1 and not own else None


def _run_example(model: nn.Module) -> bool:
    """Run ``model`` on its ``example_input_array`` (a tensor, a tuple of arguments or a dict of keywords)."""
    example = getattr(model, "example_input_array", None)
    if example is None:
        return False
    example = _on(example, next(model.parameters()).device)
    return _ran(lambda: model(*example) if isinstance(example, tuple) else model(**example)
                if isinstance(example, dict) else model(example))


def _run_on_made_input(model: nn.Module) -> bool:
    first = next((m for m in model.modules() if isinstance(m, (nn.Linear, *CONV)) or is_conv1d(m)), None)
    if first is None:
        return False
    weight = first.weight
    if isinstance(first, CONV):
        inputs = [torch.zeros(1, first.in_channels, *([size] * (weight.dim() - 2)), device=weight.device)
                  for size in _IMAGE_SIDES]
    else:
        width = first.nx if is_conv1d(first) else first.in_features
        inputs = [torch.zeros(1, 1, width, device=weight.device)]
    for x in inputs:
        try:
            model(x)
            return True
        except Exception:  # noqa: BLE001 - see above
            continue
    return False


def run_one_token(model: nn.Module) -> nn.Module | None:
    """Run the module that takes token ids on one token: a Hugging Face model on ``input_ids`` (without a
    cache), else the outermost module holding an embedding whose ``forward(idx)`` runs (the model itself, or
    the network a LightningModule holds when it has no ``forward`` of its own, litgpt's ``GPT``).
    Returns the module that ran, or None."""
    device = next(model.parameters()).device
    token = torch.zeros(1, 1, dtype=torch.long, device=device)
    hf = next((m for m in model.modules() if hasattr(m, "config") and getattr(m, "main_input_name", "") == "input_ids"),
              None)
    attempts = [(hf, lambda: hf(input_ids=token, use_cache=False)), (hf, lambda: hf(input_ids=token)),
                (hf, lambda: hf(input_ids=token, decoder_input_ids=token, use_cache=False))] if hf is not None else []
    holders = [m for m in model.modules() if any(isinstance(x, nn.Embedding) for x in m.modules())]
    attempts += [(m, lambda m=m: m(token)) for m in holders if not isinstance(m, nn.Embedding)]
    for module, attempt in attempts:
        if _ran(attempt):
            return module
    return None
