"""Parameters chosen by name patterns, for methods that act on whole parameter tensors (not weight views)."""
from __future__ import annotations

import fnmatch
from collections.abc import Sequence

from torch import nn


def matching_parameters(module: nn.Module, include: Sequence[str] | None, exclude: Sequence[str] | None,
                        owner: str) -> list[tuple[str, nn.Parameter]]:
    """Trainable ``(name, parameter)`` pairs whose name matches an ``include`` pattern (None: all) and no
    ``exclude`` pattern; a clear ValueError naming ``owner`` when none is left.

    Example:
        >>> matching_parameters(model, None, ["*.bias"], "L2Init")   # every trainable weight but biases
    """
    chosen = [(name, p) for name, p in module.named_parameters() if p.requires_grad
              and (include is None or any(fnmatch.fnmatchcase(name, pat) for pat in include))
              and not any(fnmatch.fnmatchcase(name, pat) for pat in exclude or ())]
    if not chosen:
        raise ValueError(f"{owner}: no trainable parameter matches include={include}, exclude={exclude}")
    return chosen
