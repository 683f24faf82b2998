"""Which weights a plasticity method treats: one selector shared by every callback.

Roles come from the model's structure, not from parameter names: a module may declare a
class attribute ``plasticity_role`` (our GPT's attention blocks say ``"attention"``, MLP
blocks ``"mlp"``, positional blocks ``"position"``), and every weight inherits the role of
its nearest declaring ancestor. ``nn.MultiheadAttention`` counts as attention. Weights with
no declared role are ``"other"`` (the layers of an ordinary MLP or CNN).

Skipped by default: embeddings, the output head (the module named by the model's
``output_head_name``, else the last Linear/conv layer), biases, norms and other 1-D
parameters, and positional blocks.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from collections.abc import Iterable, Sequence

from torch import nn

SCOPES = ("all", "attention", "mlp")
_CONV = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


@dataclass(frozen=True)
class Target:
    name: str  # parameter name, e.g. "blocks.0.attn.c_q.weight"
    module: nn.Module  # the layer owning the parameter
    param: nn.Parameter
    role: str  # attention | mlp | other
    kind: str  # linear | conv | matrix (a bare 2-D parameter such as MultiheadAttention.in_proj_weight)


def _roles(model: nn.Module) -> dict[str, str]:
    roles = {"": getattr(model, "plasticity_role", "other")}
    for name, module in model.named_modules():
        if not name:
            continue
        parent = roles[name.rsplit(".", 1)[0] if "." in name else ""]
        declared = getattr(module, "plasticity_role", None)
        if declared is None and isinstance(module, nn.MultiheadAttention):
            declared = "attention"
        roles[name] = declared or parent
    return roles


def output_head(model: nn.Module) -> str | None:
    """Name of the model's output layer: declared by ``output_head_name``, else the last Linear/conv."""
    declared = getattr(model, "output_head_name", None)
    if declared is not None:
        return declared
    last = None
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, *_CONV)):
            last = name
    return last


def select_targets(
    model: nn.Module,
    scope: str = "all",
    include: Sequence[str] | None = None,
    exclude: Sequence[str] | None = None,
    include_conv: bool = True,
    include_head: bool = False,
) -> list[Target]:
    """The weight matrices (and optionally conv kernels) of ``model`` a method should treat.

    Args:
        scope: ``all`` (every role except positional), ``attention`` or ``mlp``.
        include: ``fnmatch`` patterns on parameter names; when given, only matching weights
            are kept (a pattern can also bring back a positional weight).
        exclude: patterns of parameter names to drop.
        include_conv: also treat conv kernels (``dim > 2``).
        include_head: also treat the output head.

    Example:
        >>> targets = select_targets(model, scope="mlp", exclude=["blocks.0.*"])
        >>> [t.name for t in targets]
    """
    if scope not in SCOPES:
        raise ValueError(f"scope={scope!r} is not one of {SCOPES}")
    roles = _roles(model)
    head = None if include_head else output_head(model)
    targets: list[Target] = []
    for module_name, module in model.named_modules():
        if isinstance(module, nn.Embedding) or (head is not None and module_name == head):
            continue
        for pname, param in module.named_parameters(recurse=False):
            full = f"{module_name}.{pname}" if module_name else pname
            if isinstance(module, nn.Linear) and pname == "weight":
                kind = "linear"
            elif include_conv and isinstance(module, _CONV) and pname == "weight":
                kind = "conv"
            elif isinstance(module, nn.MultiheadAttention) and pname == "in_proj_weight":
                kind = "matrix"
            else:
                continue  # biases, norms, scalars, embeddings
            role = roles[module_name]
            explicitly_included = include is not None and _matches(full, include)
            if include is not None and not explicitly_included:
                continue
            if role == "position" and not explicitly_included:
                continue
            if scope != "all" and role != scope:
                continue
            if exclude is not None and _matches(full, exclude):
                continue
            targets.append(Target(full, module, param, role, kind))
    return targets


def validate_patterns(**patterns) -> None:
    """Each keyword (``include=``, ``exclude=``) must be None or a list of ``fnmatch`` patterns."""
    for name, value in patterns.items():
        if value is None:
            continue
        # A bare string would be iterated character by character: demand a list of patterns.
        if isinstance(value, str) or not isinstance(value, Sequence) or not all(isinstance(p, str) for p in value):
            raise ValueError(f"{name} must be a list of fnmatch patterns such as ['blocks.*'], got {value!r}")


def validate_selection(scope: str, include=None, exclude=None) -> None:
    """Check selection arguments at construction time, so a typo fails before training starts."""
    if scope not in SCOPES:
        raise ValueError(f"scope={scope!r} is not one of {SCOPES}")
    validate_patterns(include=include, exclude=exclude)


def _matches(name: str, patterns: Iterable[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def require_targets(targets: list[Target], owner: str, scope: str, include, exclude) -> list[Target]:
    """Raise a clear error when a selection came back empty (a callback that silently does nothing is a bug)."""
    if not targets:
        raise ValueError(
            f"{owner}: no weights selected (scope={scope!r}, include={include}, exclude={exclude}). "
            "Targets are nn.Linear / conv weights outside embeddings and the output head; "
            "check the scope (roles 'attention'/'mlp' exist only where modules declare plasticity_role) "
            "and the include/exclude patterns."
        )
    return targets
