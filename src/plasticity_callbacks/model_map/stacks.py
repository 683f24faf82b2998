"""Weights that live outside ``nn.Linear``/conv modules, and layers left alone by default.

* a bare 2-D parameter the forward uses as a linear map (a mixture-of-experts router's ``weight``
  through ``F.linear``) is a matrix;
* a 3-D parameter used one matrix at a time (``W[e]``) or by a batched matmul is a stack of
  matrices (``experts.gate_up_proj (E, 2I, H)``, GPT-OSS's ``(E, H, 2I)``): its view is ``(E·out, in)``
  and every expert's matrix (and each part of it the forward cuts apart) is its own row block;
* a state-space layer's depthwise ``conv1d`` (its causal filter: a 1×1 matrix per channel and tap,
  whose polar factor is a sign) and its own parameters (``A_log``, ``D``, ``dt_bias``) are left
  alone by default, with the reason in the coverage table.

Orientation, stacking and cuts come from the forward (:mod:`.trace`); a declaration
(``declare_plasticity(fused={name: stacked_matrices(...)})``) overrides them.
"""
from __future__ import annotations

import math

from torch import nn

from .layouts import Bare, RowBlock, declared_blocks
from .trace import ParameterUse, trace_uses
from .weights import WeightView, declared_layout, named_blocks, stacked_blocks

SSM_PARAMETERS = ("A_log", "A", "D", "dt_bias", "D_skip")
_MOE_WORDS = ("moe", "expert", "router", "sparse")


def is_state_space(module: nn.Module | None) -> bool:
    """A state-space mixer (Mamba, Mamba-2 and the hybrids built from them): it owns an ``A_log``."""
    return module is not None and isinstance(getattr(module, "A_log", None), nn.Parameter)


def left_alone(model: nn.Module, module_name: str, module: nn.Module) -> str:
    """Why ``module``'s weight is left alone by default ("" when it is not).

    By role, not by name: a depthwise conv with one input and one output channel per group (``groups ==
    channels``) filters each channel on its own: along the sequence for a ``Conv1d`` (a state-space layer's, a
    short-conv or linear-attention mixer's causal filter, a conformer's), over space for a ``Conv2d`` (ConvNeXt's
    7×7). Its operator per group and tap is a 1×1 matrix, whose polar factor is a sign: FIRE would replace the
    filter by ±1, and there is no matrix to orthogonalize.
    """
    if (not isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)) or module.groups == 1
            or not module.groups == module.in_channels == module.out_channels or math.prod(module.kernel_size) < 2):
        return ""
    parent = model.get_submodule(module_name.rsplit(".", 1)[0]) if "." in module_name else model
    if isinstance(module, nn.Conv1d):
        owner = "a state-space layer" if is_state_space(parent) else f"{type(parent).__name__} (a sequence mixer)"
        what = f"depthwise causal conv1d of {owner}"
    else:
        what = f"depthwise conv (groups == channels) of {type(parent).__name__}"
    return (f"{what}: its filter is a 1×1 matrix per channel and tap, FIRE would replace it by signs; left alone "
            "by default, include=[its name] treats it")


class Layouts:
    """What :func:`read_layouts` read: the traced use of every weight and the views of bare parameters."""

    def __init__(self, model: nn.Module, uses: dict[str, ParameterUse] | None, bare: dict[str, nn.Parameter]):
        self.model, self.uses, self.bare = model, uses, bare

    def traced(self, name: str) -> ParameterUse | None:
        """How the forward used parameter ``name`` (None: not as a linear map, or the forward did not run)."""
        use = (self.uses or {}).get(name)
        return use if use is not None and use.consistent else None

    def layer_split(self, name: str, module_name: str, rows: int, conv: bool = False
                    ) -> tuple[tuple[RowBlock, ...], str | None]:
        """``(blocks, refusal)`` of a layer's weight as its traced forward cuts it: ``(blocks, "")`` when proven
        (``()``: whole), ``((), why)`` with the declaration to give when a cut came after an op the trace does not
        model, ``((), None)`` when the forward did not use it as a linear map, ``((), why)`` when no forward ran."""
        unread = self.uses is None or (name in self.uses and self.uses[name] is None)
        if unread and not conv:  # no forward that uses it ran: nothing proves the rows whole
            return (), not_traced(name, rows)
        use = self.traced(name)
        if use is None:
            return (), None
        if use.unproven:
            return (), unproven_split(name, rows, use)
        return named_blocks(module_name, use.blocks), ""

    def views(self, roles: dict[str, str]) -> list[tuple[str, WeightView]]:
        """``(module_name, view)`` of every bare parameter that is a matrix or a stack of them."""
        out = []
        for name, param in self.bare.items():
            module_name, attr = name.rsplit(".", 1) if "." in name else ("", name)
            view = self._view(name, module_name, attr, param, roles)
            if view is not None:
                out.append((module_name, view))
        return out

    def _view(self, name, module_name, attr, param, roles) -> WeightView | None:
        module = self.model.get_submodule(module_name)
        declared = declared_layout(self.model, name)
        use = self.traced(name)
        if isinstance(declared, Bare):
            transposed, stacked, split = declared.stored == "in_out", declared.stacked, declared.split
        elif declared is not None:
            transposed, stacked, split = (use.transposed if use else False), False, declared
        elif use is not None and use.stacked == (param.dim() == 3 or use.experts > 0) and param.dim() in (2, 3):
            transposed, stacked, split = use.transposed, use.stacked, None
        else:
            return None
        role = roles.get(module_name, "other")
        if role == "other" and _in_moe(self.model, module_name):
            role = "mlp"
        what = f"declare_plasticity(fused={{{name!r}: ...}})"
        unknown = unproven_split(name, param.shape[1] if transposed else param.shape[0], use) \
            if split is None and use is not None and use.unproven and not stacked else ""
        if not stacked:
            rows = param.shape[1] if transposed else param.shape[0]
            blocks = declared_blocks(split, rows, what) if split is not None else named_blocks(name, use.blocks)
            return WeightView(name, module, param, role, "matrix", attr, transposed=transposed,
                              blocks=() if unknown else blocks, split_unknown=unknown)
        # A 3-D stack (E, ·, ·), or a 2-D parameter (E·a, b) that the forward views as (E, a, b) (DBRX's w1/v1/w2).
        experts = param.shape[0] if param.dim() == 3 else (use.experts if use is not None else 0)
        if not experts:
            return None
        matrix = tuple(param.shape[1:]) if param.dim() == 3 else (param.shape[0] // experts, param.shape[1])
        rows = matrix[1] if transposed else matrix[0]
        if split is not None:
            per_matrix = declared_blocks(split, rows, what)
        else:
            per_matrix = named_blocks(name, use.blocks) if use is not None else ()
        if split is None and use is not None and use.unproven:
            declaration = (f"stacked_matrices({'in_out' if transposed else 'out_in'!r}, split="
                           f"{layout_literal(use.suggested, rows)})")
            unknown = unproven_split(name, rows, use, declaration)
        return WeightView(name, module, param, role, "matrix", attr, transposed=transposed,
                          blocks=stacked_blocks(experts, rows, () if unknown else per_matrix), stack=experts,
                          per_matrix=() if unknown else per_matrix, split_unknown=unknown)


def layout_literal(blocks, rows: int) -> str:
    """``blocks`` written as a ``fused=`` layout: counts when contiguous, row lists otherwise, ``[rows]``: whole."""
    if not blocks:
        return f"[{rows}]"
    if all(isinstance(b.rows, range) and b.rows.step == 1 for b in blocks):
        return "[" + ", ".join(str(len(b)) for b in blocks) + "]"
    return "{" + ", ".join(f"{b.label!r}: {list(b.rows)}" for b in blocks) + "}"


def unproven_split(name: str, rows: int, use: ParameterUse, declaration: str | None = None) -> str:
    """Why a weight whose rows the trace cannot prove whole (nor split as read) is refused, with the declaration
    that settles it: the split its cuts read through the unmodelled ops, or whole."""
    suggested = declaration or layout_literal(use.suggested, rows)
    return (f"{name} ({rows} rows): its forward passes the output through {use.unproven} (not modelled by the "
            "trace) before cutting it, so whether its rows form one matrix or several cannot be proven; declare the "
            f"split the forward uses: declare_plasticity(model, fused={{{name!r}: {suggested}}})"
            + ("  # as read through those ops: check it against the forward" if use.suggested else
               "  # one matrix; give row counts or row index lists if the forward cuts it"))


NOT_TRACED = ("the model map could not run the forward that uses them on an input it can make (one token id, the "
              "model's example_input_array, a zero image or audio for its first conv, a zero vector for its first "
              "Linear), so whether "
              "the forward cuts these weights' rows into blocks cannot be read; give it one input: "
              "model.example_input_array = <one input batch> (Lightning's attribute, on any module), or declare each "
              "layout: declare_plasticity(model, fused={'<name>': [<rows>]}) for one matrix")


def not_traced(name: str, rows: int) -> str:
    """Why a weight of a model whose forward did not run is refused by methods that need its blocks."""
    return f"{name} ({rows} rows): {NOT_TRACED}"


def read_layouts(model: nn.Module, layer_params: set[int]) -> Layouts:
    """Trace ``model``'s forward once (cached) for every ≥2-D parameter; the ones not in ``layer_params``
    (ids of the weights of Linear/conv/MHA/RNN modules) are the bare parameters."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))}
    params = {name: p for name, p in model.named_parameters()
              if p.dim() >= 2 and id(p) not in embeddings and ".parametrizations." not in name}
    bare = {name: p for name, p in params.items() if id(p) not in layer_params}
    return Layouts(model, trace_uses(model, params) if params else None, bare)


def bare_reason(model: nn.Module, name: str, param: nn.Parameter) -> str | None:
    """Why a bare parameter that is no weight view is left alone, when the reason is a default (None otherwise)."""
    module_name, attr = name.rsplit(".", 1) if "." in name else ("", name)
    owner = model.get_submodule(module_name)
    if is_state_space(owner) and attr in SSM_PARAMETERS:
        return f"state-space parameter ({attr}): not a linear map, left alone (default)"
    if expert_bias_of(owner, param) is not None:
        return "expert biases (one bias vector per expert), left alone like every bias (default)"
    return None


def expert_bias_of(owner: nn.Module, param: nn.Parameter) -> nn.Parameter | None:
    """The expert stack whose per-expert biases ``param`` (``(E, out)``) holds, by shape, in the same module."""
    if param.dim() != 2:
        return None
    for other in owner.parameters(recurse=False):
        if other.dim() == 3 and other.shape[0] == param.shape[0] and param.shape[1] in other.shape[1:]:
            return other
    return None


def bare_fix(name: str, param: nn.Parameter) -> str:
    """The declaration that makes a bare parameter treatable."""
    if param.dim() == 3:
        return (f"declare_plasticity(model, fused={{{name!r}: stacked_matrices('out_in' or 'in_out')}}) if it holds "
                "one matrix per expert (F.linear(x, W[e]) or x @ W[e]), else exclude it")
    if param.dim() == 2:
        return (f"declare_plasticity(model, fused={{{name!r}: linear_map('out_in' or 'in_out')}}) if the forward "
                "computes F.linear(x, W) or x @ W with it, else exclude it")
    return "exclude it"


def _in_moe(model: nn.Module, module_name: str) -> bool:
    parts = module_name.split(".") if module_name else []
    for depth in range(1, len(parts) + 1):  # the root model's class name says nothing
        module = model.get_submodule(".".join(parts[:depth]))
        if any(word in type(module).__name__.lower() for word in _MOE_WORDS):
            return True
    return False
