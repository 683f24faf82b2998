"""Shrink & Perturb on a model: ``θ ← shrink·θ + perturb·θ_fresh`` for the selected parameters, as one call."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..distributed.sharding import local_part
from ..distributed.strategy import is_dtensor
from ..functional.shrink import shrink_perturb_ as shrink_perturb_tensors_
from ..model_map import Selection, output_heads
from ..model_map.holding import (is_factorization, is_frozen, is_frozen_parameter, parametrization,
                                weight_in_buffer)
from . import factorization
from .fresh import effective_value, fresh_values, owner_of
from .optimizer_state import reset_optimizer_state


def shrink_perturb_(model: nn.Module, optimizers=None, shrink: float = 0.4, perturb: float = 0.1,
                    selection: Selection | None = None, seed: int = 0, reset_optimizer: bool = False,
                    owner: str = "shrink_perturb_") -> dict[str, float]:
    """Shrink & Perturb (Ash & Adams, 2020) in place: ``θ ← shrink·θ + perturb·θ_fresh`` for every selected
    parameter, ``θ_fresh`` drawn by the model's own init code from ``seed`` (:func:`~ops.fresh.fresh_values`).

    A weight factorized by ``AdaptiveSVDSwitch(minor_training="factorize")`` is treated as its effective weight
    ``W_p + BA`` (its frozen ``W_p`` absorbs the change). Under FSDP2 each rank treats its rows with its rows of
    the whole fresh draw (the same on every rank).

    Args:
        model: any ``nn.Module`` whose init code can draw its parameters.
        optimizers: an optimizer, a list of them, or None; used with ``reset_optimizer``.
        shrink: λ in [0, 1] (paper: 0.4); ``shrink=0, perturb=1`` is a full reset.
        perturb: p >= 0, the fresh draw's scale (paper: 0.1).
        selection: a :class:`~model_map.Selection` whose ``include``/``exclude`` patterns match parameter
            names; None: every parameter (biases, norms, the head too).
        seed: the fresh draw's seed; pass the same on every rank.
        reset_optimizer: also drop the optimizer state of the changed parameters.
        owner: the caller's name, for messages.

    Returns:
        ``{"norm_before": ‖θ‖, "norm_after": ‖θ‖, "parameters": how many}`` over the selected parameters.

    Raises:
        ValueError: no parameter matches ``selection``.
        RuntimeError: a selected parameter that no init code draws (name it in ``selection.exclude``).

    Example:
        >>> shrink_perturb_(model, optimizer, shrink=0.4, perturb=0.1, seed=step)
    """
    chosen = selected_parameters(model, selection or Selection(), owner)
    fresh = fresh_values(model, [n for n, _ in chosen], seed, owner)
    factorized = {n: p for n, p in chosen if factorization.is_factorized(*owner_of(model, n))}
    plain = [(n, p) for n, p in chosen if n not in factorized]
    norm_before = parameter_norm(model, chosen)
    shards = [local_part(p) for _, p in plain]  # FSDP2: each rank its rows
    shrink_perturb_tensors_([local for local, _ in shards],
                            [fresh[n][rows] for (n, _), (_, rows) in zip(plain, shards)], shrink, perturb)
    for name, frozen in factorized.items():  # on the effective weight: W_p ← λ(W_p + BA) + p·fresh − BA
        module, attr = owner_of(model, name)
        with torch.no_grad():
            parts = factorization.components(module, attr)
            effective = getattr(module, attr).detach()
            frozen.copy_(shrink * effective + perturb * fresh[name].to(effective) - parts.delta(frozen))
    norm_after = parameter_norm(model, chosen)
    if reset_optimizer and optimizers is not None:
        trainable = [p for _, p in plain] + [q for n in factorized
                                             for q in factorization.components(*owner_of(model, n)).parameters()]
        reset_optimizer_state(optimizers, trainable)
    return {"norm_before": float(norm_before), "norm_after": float(norm_after), "parameters": len(chosen)}


def selected_parameters(model: nn.Module, selection: Selection, owner: str = "shrink_perturb_"
                        ) -> list[tuple[str, nn.Parameter]]:
    """``(name, parameter)`` pairs to treat: those whose names ``selection`` matches (with ``scope="head"``: only
    the output head's, :func:`~model_map.output_heads`), minus those the user froze unless an ``include``
    pattern names them. A factorized weight (``W_p + BA``) appears once, under its plain
    name (``layer.weight``) with ``W_p`` as its parameter; its ``B, A`` are part of it. A weight computed by the
    user's parametrization (weight norm, ...) is treated through its ``original`` parameters.

    Raises:
        ValueError: nothing matches, or a parametrization keeps the selected weight in a buffer (``orthogonal``).
    """
    # a head's parameters by their module's prefix ("" when the model itself is the head)
    heads = tuple(f"{head}." if head else "" for head in output_heads(model)) if selection.scope == "head" else None
    chosen = []
    for name, param in model.named_parameters():
        if heads is not None and not name.startswith(heads):
            continue
        frozen = is_frozen_parameter(param)
        if ".parametrizations." in name:
            path, rest = name.split(".parametrizations.", 1)
            module, attr = model.get_submodule(path), rest.split(".", 1)[0]
            if is_factorization(module, attr):
                if not name.endswith(".original"):
                    continue  # B, A: inside the effective weight
                name, frozen = f"{path}.{attr}", is_frozen(module, attr)
            elif weight_in_buffer(module, attr) and selection.matches(name) and not frozen:
                raise ValueError(f"{owner} cannot treat {path}.{attr}: its parametrization "
                                 f"({parametrization(module, attr)}) keeps the weight in a buffer, not in {name}; "
                                 f"exclude it: {owner}(selection={ {'exclude': [name]} })")
        if frozen and selection.include is None:
            continue  # the user froze it; an include pattern naming it treats it
        if selection.matches(name):
            chosen.append((name, param))
    if not chosen:
        within = f" within the output head {sorted(output_heads(model))}" if heads is not None else ""
        raise ValueError(f"{owner}: no parameters match include={selection.include}, exclude={selection.exclude}"
                         f"{within} (frozen ones count only where include names them)")
    return chosen


def parameter_norm(model: nn.Module, chosen: list[tuple[str, nn.Parameter]]) -> torch.Tensor:
    """‖θ‖ over the chosen parameters' effective values; FSDP2: each DTensor's rows summed over the ranks
    (one all-reduce)."""
    with torch.no_grad():
        values = [effective_value(model, n) for n, _ in chosen]
        sharded = [v for v in values if is_dtensor(v)]
        whole = sum((v.float().pow(2).sum() for v in values if not is_dtensor(v)), torch.zeros(()))
        if not sharded:
            return torch.sqrt(whole)
        rows = sum(v.to_local().float().pow(2).sum() for v in sharded)
        dist.all_reduce(rows, group=sharded[0].device_mesh.get_group())
        return torch.sqrt(whole.to(rows.device) + rows)
