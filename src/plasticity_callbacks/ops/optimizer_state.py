"""Reset optimizer state for chosen parameters only, for any ``torch.optim.Optimizer``.

State is per parameter tensor (AdamW: ``exp_avg``, ``exp_avg_sq``, ``step``; Muon and SGD:
``momentum_buffer``). Removing a parameter's entry makes the optimizer treat it as new on its
next step: zero moments, ``step = 0`` (so Adam's bias correction starts over), and SGD's
momentum starting from the next gradient — exactly a fresh optimizer for those weights.
"""
from __future__ import annotations

from typing import Iterable, Iterator

import torch
from torch.optim import Optimizer

from ..distributed.sharding import local_part


def leaf_optimizers(optimizers) -> Iterator[Optimizer]:
    """Flatten a Lightning ``LightningOptimizer``, a list of optimizers, or a combined optimizer."""
    if optimizers is None:
        return
    if isinstance(optimizers, (list, tuple)):
        for opt in optimizers:
            yield from leaf_optimizers(opt)
        return
    opt = getattr(optimizers, "_optimizer", optimizers)  # unwrap LightningOptimizer
    inner = getattr(opt, "optimizers", None)  # CombinedOptimizer
    if inner is not None:
        yield from leaf_optimizers(list(inner))
    else:
        yield opt


def owning_optimizer(optimizers, param: torch.Tensor) -> Optimizer | None:
    """The leaf optimizer whose param groups contain ``param``."""
    for opt in leaf_optimizers(optimizers):
        if any(p is param for group in opt.param_groups for p in group["params"]):
            return opt
    return None


def reset_optimizer_state(optimizers, params: Iterable[torch.Tensor]) -> int:
    """Drop the optimizer state of exactly ``params``; return how many states were dropped."""
    params = list(params)
    dropped = 0
    for opt in leaf_optimizers(optimizers):
        for p in params:
            if p in opt.state:
                del opt.state[p]
                dropped += 1
    return dropped


def zero_optimizer_state_slices(optimizers, param: torch.Tensor, mask: torch.Tensor, dim: int,
                                index: int | None = None) -> None:
    """Zero the state entries of ``param`` where ``mask`` (a bool vector along ``dim``) is set; with ``index``,
    only in ``param[index]`` (one expert of a stacked parameter; ``dim`` counts the stack's dims).

    Only tensors shaped like ``param`` (moments, momentum) are touched; ``step`` is kept,
    because it is one counter for the whole tensor: resetting it would restart Adam's bias
    correction for every row, not just the masked ones. Static shapes, no host sync.
    """
    shape = [1] * param.dim()
    shape[dim] = -1
    keep = (~mask).reshape(shape)
    if index is not None:  # every other slice of the stack is kept whole
        others = torch.arange(param.shape[0], device=mask.device) != index
        keep = keep | others.reshape(-1, *[1] * (param.dim() - 1))
    for opt in leaf_optimizers(optimizers):
        state = opt.state.get(param)
        if not state:
            continue
        for key, value in state.items():
            if torch.is_tensor(value) and value.shape == param.shape:
                local, rows = local_part(value)  # FSDP2: the moments are sharded like the parameter
                here = keep[rows] if dim == 0 else keep
                local.copy_(torch.where(here, local, torch.zeros_like(local)))
