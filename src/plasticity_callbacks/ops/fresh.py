"""Fresh values of a model's parameters, drawn by the model's own init code, or a clear error."""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ..distributed.sharding import local_part
from ..distributed.strategy import warn_on_rank_zero
from ..model_map import fresh_parameters


def fresh_values(model: nn.Module, names: Iterable[str], seed: int,
                 owner: str = "fresh_values") -> dict[str, torch.Tensor]:
    """``{name: fresh value}`` for the named parameters of ``model``, drawn by its own init code from ``seed``.

    The draw is :func:`~model_map.fresh.fresh_parameters` (Hugging Face ``_init_weights``, ``init_weights``,
    ``nn.MultiheadAttention``'s and each layer's ``reset_parameters``), identical on every rank for the same
    seed. A factorized weight (``W_p + BA``) is named as its plain parameter (``layer.weight``).

    Args:
        model: the module whose init code draws.
        names: parameter names, as ``model.named_parameters()`` gives them.
        seed: the generator's seed.
        owner: the caller's name, for messages.

    Raises:
        RuntimeError: a named parameter that no init code reaches (a bare ``nn.Parameter`` with no
            ``reset_parameters``), naming it and the fix.

    A matrix whose fresh draw equals its current value (an init that copies, or the seed the model was built
    with) is a warning: shrink & perturb would then only rescale it.

    Example:
        >>> fresh = fresh_values(model, ["lm_head.weight"], seed=1)
        >>> model.lm_head.weight.data.copy_(fresh["lm_head.weight"])
    """
    names = list(names)
    fresh = fresh_parameters(model, seed)
    missing = [name for name in names if name not in fresh]
    if missing:
        raise RuntimeError(f"{owner}: no init code draws a fresh value for {missing}; give their module "
                           "reset_parameters() (or the model init_weights() or _init_weights(module)), or exclude "
                           f"them: {owner}(selection={ {'exclude': missing} })")
    unchanged = []
    for name in names:
        value = effective_value(model, name)
        if value.dim() >= 2:  # FSDP2: this rank's rows
            here, rows = local_part(value)
            if torch.equal(fresh[name][rows].to(here.device), here):
                unchanged.append(name)
    if unchanged:
        warn_on_rank_zero(f"{owner}: the fresh draw of {unchanged} equals the current weights, so shrink & perturb "
                          "only rescales them; pass another seed=, or fix their init code if it copies instead of "
                          "drawing")
    return {name: fresh[name] for name in names}


def owner_of(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    """The module holding parameter ``name`` and the attribute's name in it."""
    path, attr = name.rsplit(".", 1) if "." in name else ("", name)
    return model.get_submodule(path), attr


def effective_value(model: nn.Module, name: str) -> torch.Tensor:
    """The parameter's value as the model uses it (the effective ``W_p + BA`` of a factorized weight), detached."""
    module, attr = owner_of(model, name)
    return getattr(module, attr).detach()
