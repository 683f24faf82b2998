"""Hidden units read from the forward: which layer's outputs reach which layer's input, one value per unit.

One eval forward (one token, or the module's ``example_input_array``) runs under a ``TorchFunctionMode`` that
tags the output of every layer use (``F.linear``/``conv``/``x @ W`` with a parameter, or one matrix ``W[e]`` of
a stacked or viewed parameter) with the row of the weight behind each feature. A tag follows the value through
what keeps units apart (elementwise activations, ``relu²``/``x * x``, a gate ``act(g) * u``, scalars, biases,
per-token scales, BatchNorm, dropout, and reshapes/cuts/token selections, whose effect on the rows is read by
running them on row numbers) and is dropped, *escaping*, at anything else (a residual add, a norm, attention, a
concatenation). A tagged, activated value entering another layer use is a candidate ``up -> act -> down`` chain.

A chain is a unit layer when every value of its ``up`` (and gate) reaches that one ``down`` and nothing else, and
``down`` input ``j`` holds exactly unit ``j``'s values (``up`` row ``j``, a gate's row ``j``, or two rows of a
fused ``up``, halves or interleaved; a conv channel flattened over its positions). Whatever fails one of these is
kept with the reason, so that the caller can name it: the map fails closed, it never guesses.
"""
from __future__ import annotations

import operator
import warnings
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from .detached_hooks import hooks_detached
from .trace import in_float32, preserved, run_forward

_ACTIVATIONS = {F.relu, F.relu6, F.gelu, F.silu, F.mish, F.elu, F.celu, F.selu, F.leaky_relu, F.softplus, F.hardswish,
                F.hardsigmoid, F.hardtanh, F.logsigmoid, F.tanhshrink, F.softsign, F.prelu, F.rrelu, torch.relu,
                torch.tanh, torch.sigmoid, torch.square, torch.exp, F.sigmoid, F.tanh, torch.erf, torch.rsqrt,
                torch.sqrt, torch.abs}
_ACTIVATION_METHODS = {"relu", "relu_", "tanh", "tanh_", "sigmoid", "sigmoid_", "square", "square_", "exp", "erf",
                       "abs", "sqrt", "rsqrt", "gelu", "silu"}
# Elementwise with a second operand: scalars, biases, gates. Their own effect on units: none (same unit in, out).
_BINARY = {operator.add, operator.sub, operator.mul, operator.truediv, operator.pow, torch.add, torch.sub, torch.mul,
           torch.div, torch.pow}
_BINARY_METHODS = {"__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__",
                   "__rtruediv__", "__pow__", "add", "sub", "mul", "div", "pow", "__iadd__", "__imul__", "__isub__",
                   "__itruediv__", "add_", "mul_", "sub_", "div_", "pow_"}
_NONLINEAR_BINARY = {"__pow__", "pow", "pow_", "__rpow__"}
_PASS = {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout}
_PASS_METHODS = {"float", "double", "half", "bfloat16", "to", "type", "type_as", "contiguous", "clone", "detach"}
# Rearrangements: their effect on the rows is read by running them on row numbers.
_SHAPE_METHODS = {"view", "reshape", "flatten", "unflatten", "squeeze", "unsqueeze", "transpose", "permute",
                  "movedim", "chunk", "split", "tensor_split", "unbind", "__getitem__", "narrow", "index_select",
                  "t", "expand", "expand_as", "mean", "amax"}
_SHAPE_FUNCTIONS = {torch.flatten, torch.reshape, torch.chunk, torch.split, torch.narrow, torch.index_select,
                    torch.squeeze, torch.unsqueeze, torch.transpose, torch.permute, torch.movedim,
                    torch.tensor_split, torch.unbind, torch.mean, torch.amax}
_POOL = {F.max_pool1d, F.max_pool2d, F.max_pool3d, F.avg_pool1d, F.avg_pool2d, F.avg_pool3d, F.adaptive_avg_pool1d,
         F.adaptive_avg_pool2d, F.adaptive_avg_pool3d, F.adaptive_max_pool1d, F.adaptive_max_pool2d,
         F.adaptive_max_pool3d}
_CONV = {F.conv1d: 1, F.conv2d: 2, F.conv3d: 3, torch.conv1d: 1, torch.conv2d: 2, torch.conv3d: 3}
_MATMUL = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.Tensor.mm}
_METADATA = (bool, int, float, str, torch.Size, torch.dtype, torch.device)
_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (shapes, FlowResult | None)


@dataclass(frozen=True)
class Source:
    """One matrix used as a linear map: a parameter, or matrix ``expert`` of a stacked/viewed parameter."""

    param: int  # id of the parameter
    expert: int | None = None


@dataclass
class _Tag:
    sources: tuple[Source, ...]  # one per column of rows
    rows: torch.Tensor  # (features, len(sources)): the weight row of each source that feature j carries
    dim: int  # the feature dim, counted from the end (-1: last; conv outputs: the channel dim)
    activated: tuple[bool, ...]  # per source: passed through a nonlinearity
    norm: int | None = None  # id of a BatchNorm weight applied to these features


@dataclass
class Chain:
    """A tagged, activated value entering ``down`` (see the module docstring)."""

    down: Source
    sources: tuple[Source, ...]
    rows: torch.Tensor  # (down inputs, len(sources))
    activated: tuple[bool, ...]
    norm: int | None


@dataclass
class FlowResult:
    chains: list[Chain] = field(default_factory=list)
    escaped: dict[Source, str] = field(default_factory=dict)  # source -> the op that its values escaped through
    uses: dict[Source, int] = field(default_factory=dict)  # source -> layer uses in the forward


def _name(func) -> str:
    name = getattr(func, "__name__", "")
    if name == "__get__":  # a property (x.T, x.mT)
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    return name


class _Flow(TorchFunctionMode):
    """Tags every layer use's output with its weight rows and follows the tags (see the module docstring)."""

    def __init__(self, params: dict[int, nn.Parameter]):
        super().__init__()
        self.params = params
        self.slices: dict[int, tuple] = {}  # id -> (tensor, param id, expert, is a stack): W[e], W.view(E, I, H)
        self.tags: dict[int, tuple[torch.Tensor, _Tag]] = {}
        self.result = FlowResult()

    # ------------------------------------------------------------------ weights and their matrices
    def _base(self, tensor) -> tuple[int, int | None, bool] | None:
        """``(parameter id, expert, is a stack)`` when ``tensor`` is a parameter or was cut from one."""
        if not isinstance(tensor, torch.Tensor):
            return None
        if id(tensor) in self.params and self.params[id(tensor)] is tensor:
            return id(tensor), None, tensor.dim() == 3
        entry = self.slices.get(id(tensor))
        return entry[1:] if entry is not None and entry[0] is tensor else None

    def _matrix(self, tensor) -> Source | None:
        """The source of ``tensor`` when it is one matrix of a parameter (the parameter, ``W[e]``, a view, ``.T``)."""
        base = self._base(tensor)
        if base is None or base[2] or tensor.dim() != 2:
            return None
        return Source(base[0], base[1])

    def _track_slice(self, name, args, result) -> None:
        """``W.view(E, I, H)``, ``W[e]``, ``W.T``: remember which parameter (and expert) a matrix comes from."""
        base = self._base(args[0]) if args else None
        if base is None or not isinstance(result, torch.Tensor):
            return
        param, expert, stack = base
        if stack and name == "__getitem__" and result.dim() == 2:
            index = args[1] if len(args) > 1 else None
            if isinstance(index, torch.Tensor) and index.numel() == 1 and not index.is_floating_point():
                index = int(index)
            if isinstance(index, int) and not isinstance(index, bool):
                self.slices[id(result)] = (result, param, index, False)
        elif not stack and expert is None and name in ("view", "reshape", "unflatten") and result.dim() == 3:
            self.slices[id(result)] = (result, param, None, True)  # a 2-D parameter seen as a stack of matrices
        elif not stack and result.dim() == 2 and name in ("t", "T", "mT", "transpose", "contiguous", "to", "float"):
            self.slices[id(result)] = (result, param, expert, False)

    # ------------------------------------------------------------------ tags
    def _tag(self, tensor) -> _Tag | None:
        entry = self.tags.get(id(tensor)) if isinstance(tensor, torch.Tensor) else None
        return entry[1] if entry is not None and entry[0] is tensor else None

    def _set(self, tensor, tag: _Tag) -> None:
        if isinstance(tensor, torch.Tensor):
            self.tags[id(tensor)] = (tensor, tag)

    def _escape(self, tag: _Tag, why: str) -> None:
        for source in tag.sources:
            self.result.escaped.setdefault(source, why)

    def _new(self, source: Source, result, dim: int):
        self.result.uses[source] = self.result.uses.get(source, 0) + 1
        if isinstance(result, torch.Tensor) and result.dim() >= -dim:
            width = result.shape[dim]
            self._set(result, _Tag((source,), torch.arange(width).unsqueeze(1), dim, (False,)))
        return result

    def _enter(self, tag: _Tag, down: Source, dim: int) -> None:
        if tag.dim != dim:
            self._escape(tag, "a layer reads them along another dim")
            return
        if not any(tag.activated):
            self._escape(tag, "they reach the next layer with no activation between")
            return
        self.result.chains.append(Chain(down, tag.sources, tag.rows, tag.activated, tag.norm))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _name(func)
        tagged = [(i, a) for i, a in enumerate(args) if self._tag(a) is not None]
        tagged += [(k, v) for k, v in kwargs.items() if self._tag(v) is not None]
        for value in args:  # torch.cat([...]) and the like hold tensors in a list
            if isinstance(value, (list, tuple)):
                tagged += [(None, v) for v in value if self._tag(v) is not None]
        result = func(*args, **kwargs)
        try:
            self._account(func, name, args, kwargs, result, tagged)
        except Exception:  # noqa: BLE001 - a value this reader cannot follow: its units escape, the forward goes on
            for _, value in tagged:
                self._escape(self._tag(value), name or str(func))
        return result

    def _account(self, func, name, args, kwargs, result, tagged) -> None:
        self._track_slice(name, args, result)
        layer = self._layer(func, args, kwargs, result)
        if layer is not None:
            source, x, dim = layer
            if self._tag(x) is not None:
                self._enter(self._tag(x), source, x_dim(func, x))
                tagged = [(i, a) for i, a in tagged if a is not x]
            for _, value in tagged:
                self._escape(self._tag(value), f"{name} (as a weight)")
            self._new(source, result, dim)
            return
        if not tagged:
            return
        out = self._follow(func, name, args, kwargs, result, tagged)
        if out is None and not isinstance(result, _METADATA):  # x.shape, x.dim(): no value leaves
            for _, value in tagged:
                self._escape(self._tag(value), name or str(func))

    def _layer(self, func, args, kwargs, result):
        """``(source, input, output feature dim)`` when ``func`` applies a parameter's matrix to an input."""
        if func is F.linear:
            weight = args[1] if len(args) > 1 else kwargs.get("weight")
            source = self._matrix(weight)
            return (source, args[0] if args else kwargs.get("input"), -1) if source is not None else None
        if func in _CONV:
            weight = args[1] if len(args) > 1 else kwargs.get("weight")
            groups = args[6] if len(args) > 6 else kwargs.get("groups", 1)
            if isinstance(weight, torch.Tensor) and id(weight) in self.params and groups == 1:
                x = args[0] if args else kwargs.get("input")
                return Source(id(weight)), x, -(_CONV[func] + 1)
            return None
        if func in _MATMUL and len(args) == 2:
            source = self._matrix(args[1])
            return (source, args[0], -1) if source is not None else None
        if func in (torch.addmm, torch.Tensor.addmm) and len(args) >= 3:
            source = self._matrix(args[2])
            return (source, args[1], -1) if source is not None else None
        return None

    def _follow(self, func, name, args, kwargs, result, tagged) -> bool | None:
        """Tag ``result`` from its tagged inputs where the op keeps units apart; None where they escape."""
        first = args[0] if args else None
        tag = self._tag(first)
        if (func in _ACTIVATIONS or name in _ACTIVATION_METHODS) and tag is not None and len(tagged) == 1:
            self._set(result, _Tag(tag.sources, tag.rows, tag.dim, (True,) * len(tag.sources), tag.norm))
            return True
        if func in _PASS or func in _POOL or (name in _PASS_METHODS and tag is not None and len(tagged) == 1):
            if tag is None or (func in _POOL and tag.dim != -(result.dim() - 1)):
                return None
            self._set(result, tag)
            return True
        if func is F.batch_norm and tag is not None and len(tagged) == 1:
            weight = args[3] if len(args) > 3 else kwargs.get("weight")
            norm = id(weight) if weight is not None else None
            self._set(result, _Tag(tag.sources, tag.rows, tag.dim, tag.activated, norm))
            return True
        if func in _BINARY or name in _BINARY_METHODS:
            return self._binary(name, args, result)
        if (name in _SHAPE_METHODS or func in _SHAPE_FUNCTIONS) and tag is not None and len(tagged) == 1:
            return self._reshaped(func, name, args, kwargs, tag, result)
        if func in (torch.cat, torch.concat, torch.concatenate):
            return self._concatenated(args, kwargs, result)
        return None

    def _binary(self, name, args, result) -> bool | None:
        if len(args) != 2 or not isinstance(result, torch.Tensor):
            return None
        a, b = args
        ta, tb = self._tag(a), self._tag(b)
        nonlinear = name in _NONLINEAR_BINARY
        if ta is not None and tb is not None:
            if ta.dim != tb.dim or ta.rows.shape[0] != tb.rows.shape[0] or result.shape[ta.dim] != ta.rows.shape[0]:
                return None
            if ta.sources == tb.sources and torch.equal(ta.rows, tb.rows):  # x * x, x + c·x³ (tanh GELU)
                product = "mul" in name or name.startswith("__pow")
                activated = tuple(x or y or product or nonlinear for x, y in zip(ta.activated, tb.activated))
                self._set(result, _Tag(ta.sources, ta.rows, ta.dim, activated, ta.norm or tb.norm))
                return True
            if "mul" not in name:
                return None  # the sum of two layers' values is no one unit's
            # A gate: act(g) * u. One unit reads row j of both (or two rows of one fused layer).
            self._set(result, _Tag(ta.sources + tb.sources, torch.cat([ta.rows, tb.rows], 1), ta.dim,
                                   ta.activated + tb.activated, None))
            return True
        tag, other = (ta, b) if ta is not None else (tb, a)
        if isinstance(other, torch.Tensor) and other.dim() > 0 and other.dim() >= -tag.dim \
                and other.shape[tag.dim] != 1 and not isinstance(other, nn.Parameter) and self._matrix(other) is None \
                and not self._is_param_part(other):
            return None  # another full-width value (a residual): the unit no longer enters down alone
        if result.dim() < -tag.dim or result.shape[tag.dim] != tag.rows.shape[0]:
            return None
        self._set(result, _Tag(tag.sources, tag.rows, tag.dim,
                               tuple(x or nonlinear for x in tag.activated), tag.norm))
        return True

    def _is_param_part(self, tensor) -> bool:
        return self._base(tensor) is not None

    def _concatenated(self, args, kwargs, result) -> bool | None:
        """``torch.cat`` of one stack's experts' outputs along tokens (``ParallelExperts``): one tag for "every
        expert of the stack" (expert ``-1``), so that the chain is still seen, and named."""
        pieces = args[0] if args else kwargs.get("tensors")
        dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
        tags = [self._tag(p) for p in pieces]
        if any(t is None or len(t.sources) != 1 for t in tags) or len({t.sources[0].param for t in tags}) != 1:
            return None
        first = tags[0]
        if any(t.dim != first.dim or not torch.equal(t.rows, first.rows) for t in tags):
            return None
        if isinstance(dim, int) and (dim - result.dim() if dim >= 0 else dim) == first.dim:
            return None  # along the units: a wider layer made of several
        self._set(result, _Tag((Source(first.sources[0].param, -1),), first.rows, first.dim, first.activated, None))
        return True

    def _reshaped(self, func, name, args, kwargs, tag: _Tag, result) -> bool | None:
        """Run the same rearrangement on row numbers and read where each feature went."""
        x = args[0]
        numbers = torch.arange(tag.rows.shape[0], dtype=torch.float64, device=x.device)
        shape = [1] * x.dim()
        shape[tag.dim] = -1
        numbered = numbers.view(shape).expand(x.shape).contiguous()
        try:
            with torch._C.DisableTorchFunction():
                moved = func(numbered, *args[1:], **kwargs)
        except Exception:  # noqa: BLE001 - an op that will not run on numbers: the units are lost, not an error
            return None
        pieces = list(moved) if isinstance(moved, (tuple, list)) else [moved]
        outputs = list(result) if isinstance(result, (tuple, list)) else [result]
        if len(pieces) != len(outputs):
            return None
        for piece, out in zip(pieces, outputs):
            if not isinstance(piece, torch.Tensor) or piece.dim() == 0:
                return None
            if piece.numel() == 0:  # no token routed here: the units are where they were
                if piece.dim() != x.dim() or piece.shape[tag.dim] != len(numbers):
                    return None
                self._set(out, tag)
                continue
            dim = _feature_dim(piece)
            if dim is None:
                return None
            index = piece.movedim(dim, -1).reshape(-1, piece.shape[dim])[0]
            if not torch.equal(index, index.round()) or (name in ("mean", "amax") and len(index) != len(numbers)):
                return None  # features averaged together: no longer one unit each
            index = index.long()
            self._set(out, _Tag(tag.sources, tag.rows[index], dim - piece.dim(), tag.activated, tag.norm))
        return True


def x_dim(func, x) -> int:
    """The feature dim a layer reads its input along: the last for a linear map, the channel dim for a conv."""
    return -(_CONV[func] + 1) if func in _CONV else -1


def _feature_dim(numbered: torch.Tensor) -> int | None:
    """The one dim along which the row numbers vary (None: several, the units were mixed with another axis)."""
    varying = [d for d in range(numbered.dim()) if numbered.shape[d] > 1
               and bool((numbered.narrow(d, 1, numbered.shape[d] - 1) != numbered.narrow(d, 0, 1)).any())]
    if len(varying) == 1:
        return varying[0]
    if not varying:  # one feature (or one unit's positions): the last dim keeps it
        return numbered.dim() - 1
    return None


def read_unit_flow(model: nn.Module) -> FlowResult | None:
    """The chains and escapes of ``model``'s forward (see the module docstring), or None when no forward ran
    (the model needs inputs the map cannot make: give the LightningModule an ``example_input_array``).
    Cached per model until a parameter's shape changes.

    Example:
        >>> flow = read_unit_flow(model)
        >>> [(chain.down, chain.sources) for chain in flow.chains]
    """
    params = {id(p): p for p in model.parameters()}
    shapes = tuple(tuple(p.shape) for p in params.values())
    cached = _CACHE.get(model)
    if cached is not None and cached[0] == shapes:
        return cached[1]
    if any(type(p).__name__ == "DTensor" or type(p.data).__name__ == "DTensor" for p in params.values()):
        return None  # a sharded forward would all-gather: the units were read before sharding
    result = None
    if params:
        with hooks_detached(model), in_float32(model), preserved(model), torch.no_grad(), \
                warnings.catch_warnings():
            warnings.simplefilter("ignore")
            params = {id(p): p for p in model.parameters()}  # in_float32 swaps .data only: same objects
            flow = _Flow(params)
            with flow:
                ran = torch.compiler.disable(run_forward)(model)
            result = flow.result if ran is not None else None
    _CACHE[model] = (shapes, result)
    return result
