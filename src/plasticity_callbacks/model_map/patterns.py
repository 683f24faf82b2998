"""Parameters chosen by name patterns, for methods that act on whole parameter tensors (not weight views)."""
from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from . import Selection
from .select import require_patterns_match


def name_selection(selection: Selection | Mapping | None, owner: str) -> Selection:
    """``selection`` as a Selection of name patterns only: the method treats parameters by name, so
    ``scope``, ``include_conv`` and ``include_head`` do not apply and setting them is an error."""
    selection = Selection.build(selection, owner)
    if (selection.scope, selection.include_conv, selection.include_head) != ("all", True, False):
        raise ValueError(f"{owner} selection={selection}: this method selects parameters by name only; set "
                         "include/exclude patterns (scope, include_conv and include_head do not apply)")
    return selection


def matching_parameters(module: nn.Module, selection: Selection, owner: str) -> list[tuple[str, nn.Parameter]]:
    """Trainable ``(name, parameter)`` pairs whose name ``selection`` matches; a clear ValueError naming
    ``owner`` when none is left.

    Example:
        >>> matching_parameters(model, Selection(exclude=["*.bias"]), "L2Init")   # every weight but biases
    """
    require_patterns_match(module, owner, include=selection.include, exclude=selection.exclude)
    chosen = [(name, p) for name, p in module.named_parameters() if p.requires_grad and selection.matches(name)]
    if not chosen:
        raise ValueError(f"{owner}: no trainable parameter matches include={selection.include}, "
                         f"exclude={selection.exclude}")
    return chosen
