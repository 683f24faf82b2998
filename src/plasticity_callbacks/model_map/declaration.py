"""The one way for a user to describe a model the built-in adapters do not know.

``declare_plasticity(module, ...)`` stores a :class:`Declaration` on ``module``; every callback
reads it through the model map, with names taken relative to that module, so it works the same
whether the module is the LightningModule itself or a model held inside it.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from torch import nn

from ..arguments import close_matches
from .layouts import Bare, HeadLayout, declared_blocks, parse_fused

ROLES = ("attention", "mlp", "position", "other")
ATTRIBUTE = "plasticity_declaration"


@dataclass(frozen=True)
class Declaration:
    """What a user declares about a module (names relative to it).

    Attributes:
        fused: parameter name -> row blocks of its ``(out, in)`` matrix: ``(label, count)`` pairs
            (contiguous), ``(label, row indices)`` pairs, or a :class:`~.layouts.HeadLayout`.
        neurons: layout name -> ``(up | [gate, up], down)`` module names (ReDo's hidden units).
        heads: module names of output layers, never treated by default.
        roles: module name -> ``attention`` | ``mlp`` | ``position`` | ``other`` (inherited by submodules).
    """

    fused: dict[str, HeadLayout | tuple[tuple[str, object], ...]] = field(default_factory=dict)
    neurons: dict[str, tuple[tuple[str, ...], str]] = field(default_factory=dict)
    heads: tuple[str, ...] = ()
    roles: dict[str, str] = field(default_factory=dict)


def declare_plasticity(module: nn.Module, *, fused: Mapping | None = None, neurons: Mapping | None = None,
                       head: str | Sequence[str] | None = None, roles: Mapping | None = None) -> nn.Module:
    """Describe ``module`` for every plasticity callback; returns ``module``.

    Args:
        module: any ``nn.Module``; names below are relative to it.
        fused: ``{param_name: layout}``, how a fused matrix's rows (``(out, in)`` orientation) split:
            contiguous counts ``{"q": 64, "k": 16, "v": 16}`` or ``[64, 16, 16]``; row index lists
            ``{"q": [0, 1, ...], ...}``; ``interleaved_heads(heads=8)`` (``[heads, 3, head_dim]``) or
            ``grouped_heads(kv_groups=2, q_per_kv=4)`` (``[kv_groups, q_per_kv + 2, head_dim]``);
            ``Interleaved(("gate", "up"))`` (rows dealt out in turn). A parameter outside ``nn.Linear``/conv:
            ``linear_map("out_in" | "in_out", split=...)`` (a router), ``stacked_matrices("out_in" | "in_out",
            split=...)`` (a 3-D expert stack, ``split`` per expert matrix). The blocks must cover every row once;
            a layout that does not fit the parameter raises here, and nothing is stored.
        neurons: ``{name: (up, down)}`` or ``{name: ([gate, up], down)}`` by module names.
        head: the output layer(s); never treated unless a callback is told ``include_head=True``.
        roles: ``{module_name: role}``, so ``scope="attention"``/``"mlp"`` find the right weights.

    Example:
        >>> declare_plasticity(model, fused={"blocks.0.qkv.weight": {"q": 64, "k": 16, "v": 16},
        ...                                  "blocks.1.qkv.weight": interleaved_heads(heads=4)},
        ...                    neurons={"mlp0": ("blocks.0.fc_in", "blocks.0.fc_out")}, head="out")
        >>> FIREReinit(schedule=Schedule(at_fit_start=True))  # reads the declaration like every other callback
    """
    for argument, value, example in [("fused", fused, '{"qkv.weight": {"q": 64, "k": 16, "v": 16}}'),
                                     ("neurons", neurons, '{"mlp": ("fc_in", "fc_out")}'),
                                     ("roles", roles, '{"blocks.0.attn": "attention"}')]:
        if value is not None and not isinstance(value, Mapping):
            raise ValueError(f"declare_plasticity({argument}={value!r}) must be a mapping, e.g. {argument}={example}")
    declaration = Declaration(
        fused={str(k): parse_fused(k, v) for k, v in (fused or {}).items()},
        neurons={str(k): _neurons(k, v) for k, v in (neurons or {}).items()},
        heads=(head,) if isinstance(head, str) else tuple(head or ()),
        roles={str(k): _role(k, v) for k, v in (roles or {}).items()},
    )
    for name in [*declaration.heads, *declaration.roles, *(n for up, down in declaration.neurons.values()
                                                           for n in (*up, down))]:
        if name and not _has_module(module, name):
            known = [n for n, _ in module.named_modules() if n]
            raise ValueError(f"declare_plasticity: the module has no submodule {name!r}{close_matches(name, known)}")
    for name, spec in declaration.fused.items():
        _check_fused(module, name, spec)  # every entry checked before the module is touched
    object.__setattr__(module, ATTRIBUTE, declaration)  # a plain attribute, not a submodule
    return module


def declarations(model: nn.Module) -> list[tuple[str, Declaration]]:
    """``(prefix, declaration)`` for every declared submodule of ``model`` (prefix "" for the root)."""
    found = []
    for name, module in model.named_modules():
        declaration = getattr(module, ATTRIBUTE, None)
        if isinstance(declaration, Declaration):
            found.append((f"{name}." if name else "", declaration))
    return found


def _check_fused(module: nn.Module, name: str, spec) -> None:
    """Raise, naming what is wrong, unless ``spec`` fits parameter ``name`` (its kind and its row count)."""
    what = f"declare_plasticity(fused={{{name!r}: ...}})"
    try:
        param = module.get_parameter(name)
    except AttributeError:
        names = [n for n, _ in module.named_parameters()]
        raise ValueError(f"declare_plasticity(fused=...): the module has no parameter {name!r}"
                         f"{close_matches(name, names)}") from None
    owner = module.get_submodule(name.rsplit(".", 1)[0]) if "." in name else module
    layer = isinstance(owner, (nn.Linear, nn.modules.conv._ConvNd)) or hasattr(owner, "nf")
    if param.dim() < 2:  # a bias or a norm's scale: it has no rows to split, its layer's weight does
        weight = f"{name.rsplit('.', 1)[0]}.weight" if "." in name else "the weight"
        raise ValueError(f"{what}: {name!r} is a {param.dim()}-D parameter {tuple(param.shape)} (a bias?); fused "
                         f"describes a weight matrix's rows: name {weight!r}")
    if isinstance(spec, Bare):
        if layer:
            raise ValueError(f"{what}: {type(owner).__name__}'s weight is a layer's, not a bare parameter: give its "
                             "row blocks ({'q': 64, ...}), not linear_map/stacked_matrices")
        if param.dim() != (3 if spec.stacked else 2):
            raise ValueError(f"{what}: the parameter is {param.dim()}-D {tuple(param.shape)}; "
                             + ("stacked_matrices(...) describes a 3-D stack" if spec.stacked else
                                "linear_map(...) describes a 2-D matrix")
                             + ("; use stacked_matrices(...)" if param.dim() == 3 else
                                "; use linear_map(...)" if param.dim() == 2 else ""))
        rows = param.shape[-1 if spec.stored == "in_out" else -2]
        if spec.split is not None:
            declared_blocks(spec.split, rows, what)
        return
    if param.dim() == 3 and not layer:
        raise ValueError(f"{what}: the parameter is a 3-D stack {tuple(param.shape)}; describe it with "
                         "stacked_matrices('out_in' or 'in_out', split=...)")
    if hasattr(owner, "nf") or isinstance(owner, nn.modules.conv._ConvTransposeNd):
        rows = param.shape[1] * getattr(owner, "groups", 1)
    else:
        rows = param.shape[0]
    declared_blocks(spec, rows, what)


def _has_module(module: nn.Module, name: str) -> bool:
    try:
        module.get_submodule(name)
        return True
    except AttributeError:
        return False


def _neurons(name, spec) -> tuple[tuple[str, ...], str]:
    error = ValueError(f"declare_plasticity(neurons={{{name!r}: {spec!r}}}): give (up, down) or ([gate, up], down) "
                       "module names")
    if isinstance(spec, str) or not isinstance(spec, Sequence) or len(spec) != 2:
        raise error
    incoming, down = spec
    incoming = (incoming,) if isinstance(incoming, str) else tuple(incoming)
    if not 1 <= len(incoming) <= 2 or not all(isinstance(n, str) for n in (*incoming, down)):
        raise error
    return incoming, down


def _role(name, role) -> str:
    if role not in ROLES:
        raise ValueError(f"declare_plasticity(roles={{{name!r}: {role!r}}}): role must be one of {ROLES}")
    return role
