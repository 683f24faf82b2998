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

from torch import nn

from .layouts import Bare, declared_blocks
from .trace import ParameterUse, trace_uses
from .weights import WeightView, declared_layout, named_blocks, stacked_blocks

SSM_PARAMETERS = ("A_log", "A", "D", "dt_bias", "D_skip")
_MOE_WORDS = ("moe", "expert", "router", "sparse")


def is_state_space(module: nn.Module | None) -> bool:
    """A state-space mixer (Mamba, Mamba-2 and the hybrids built from them): it owns an ``A_log``."""
    return module is not None and isinstance(getattr(module, "A_log", None), nn.Parameter)


def left_alone(model: nn.Module, module_name: str, module: nn.Module) -> str:
    """Why ``module``'s weight is left alone by default ("" when it is not)."""
    if not isinstance(module, nn.Conv1d) or module.groups == 1 or module.groups != module.in_channels:
        return ""
    parent = model.get_submodule(module_name.rsplit(".", 1)[0]) if "." in module_name else model
    if not is_state_space(parent):
        return ""
    return ("depthwise causal conv1d of a state-space layer (its filter: a 1×1 matrix per channel and tap, FIRE "
            "would replace it by signs); left alone by default, include=[its name] treats it")


class Layouts:
    """What :func:`read_layouts` read: the traced use of every weight and the views of bare parameters."""

    def __init__(self, model: nn.Module, uses: dict[str, ParameterUse] | None, bare: dict[str, nn.Parameter]):
        self.model, self.uses, self.bare = model, uses, bare

    def traced(self, name: str) -> ParameterUse | None:
        """How the forward used parameter ``name`` (None: not as a linear map, or the forward did not run)."""
        use = (self.uses or {}).get(name)
        return use if use is not None and use.consistent else None

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
        elif use is not None and use.stacked == (param.dim() == 3) and param.dim() in (2, 3):
            transposed, stacked, split = use.transposed, use.stacked, None
        else:
            return None
        role = roles.get(module_name, "other")
        if role == "other" and _in_moe(self.model, module_name):
            role = "mlp"
        what = f"declare_plasticity(fused={{{name!r}: ...}})"
        if not stacked:
            rows = param.shape[1] if transposed else param.shape[0]
            blocks = declared_blocks(split, rows, what) if split is not None else named_blocks(name, use.blocks)
            return WeightView(name, module, param, role, "matrix", attr, transposed=transposed, blocks=blocks)
        experts, rows = param.shape[0], param.shape[2] if transposed else param.shape[1]
        if split is not None:
            per_matrix = declared_blocks(split, rows, what)
        else:
            per_matrix = named_blocks(name, use.blocks) if use is not None else ()
        return WeightView(name, module, param, role, "matrix", attr, transposed=transposed,
                          blocks=stacked_blocks(experts, rows, per_matrix), stack=experts, per_matrix=per_matrix)


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
