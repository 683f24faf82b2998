"""What the callbacks need from the distributed strategy, in one place.

Under DDP every rank holds the full, identical parameters and gradients are already
all-reduced when ``on_before_optimizer_step`` runs, so a deterministic computation gives
identical weights everywhere. Randomness (re-sampled neurons, fresh inits) must come from a
generator seeded the same way on every rank. Sharded strategies hold only shards. FSDP2
(Lightning's ``ModelParallelStrategy`` with ``fully_shard``) keeps each weight a ``DTensor``
sharded on dim 0: a callback that acts on such shards (:mod:`plasticity_callbacks.distributed.sharding`)
declares so with ``supports_fsdp2 = True``; the others, and every callback under FSDP1 or DeepSpeed,
refuse at setup with the fix rather than act on shards. For code of a
user's own that needs whole weights, ``full_parameters(module)`` makes every weight whole inside a
``with`` block and writes changes back to the shards (FSDP1: ``summon_full_params``; FSDP2:
``full_tensor()`` and a local re-slice); no callback uses it: each gathers one matrix at a time.
"""
from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator

import torch
from torch import nn

_SHARDED = ("FSDP", "DeepSpeed", "ModelParallel")


def is_sharded(trainer) -> bool:
    return any(name in type(trainer.strategy).__name__ for name in _SHARDED)


def require_full_parameters(trainer, owner: str, fsdp2: bool = False,
                            fsdp2_capable: Callable[[], Iterable[str]] | None = None) -> None:
    """Raise Lightning's ``MisconfigurationException`` under a strategy whose sharded parameters the caller
    cannot act on.

    ``fsdp2=True``: the caller acts on each rank's shard of ``DTensor`` parameters
    (:mod:`plasticity_callbacks.distributed.sharding`), so ``ModelParallelStrategy`` (FSDP2) is accepted.
    FSDP1 (``FSDPStrategy``, flat parameters) and DeepSpeed (ZeRO partitions) are always refused with the fix.

    Args:
        trainer: a Lightning ``Trainer`` (its ``strategy`` is read).
        owner: the caller's name, for the message.
        fsdp2: the caller acts on FSDP2's shards.
        fsdp2_capable: lists the callbacks that do act under FSDP2, for the refusal's message (called only
            when refusing: :func:`plasticity_callbacks.callbacks.base.fsdp2_callbacks` reads the callback registry).

    Example:
        >>> require_full_parameters(trainer, "FIREReinit", fsdp2=True)   # in setup, on every rank
    """
    name = type(trainer.strategy).__name__
    if not is_sharded(trainer) or (fsdp2 and "ModelParallel" in name):
        return
    # Only a Lightning trainer reaches here: importing Lightning at module level would make the ops pay for it.
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    if "ModelParallel" in name:
        capable = sorted(fsdp2_capable()) if fsdp2_capable is not None else []
        which = f"{', '.join(capable)} do" if capable else "callbacks with supports_fsdp2 = True do"
        raise MisconfigurationException(
            f"{owner} does not act on FSDP2's sharded weights (strategy {name}); {which}. "
            "Use strategy='ddp' (trainer=ddp) for this callback.")
    raise MisconfigurationException(
        f"{owner} cannot act under strategy {name}: the strategy flattens parameters into shards (FSDP1's flat "
        "parameters, DeepSpeed's ZeRO partitions) that hold no weight matrix whole. "
        "Use FSDP2: strategy=lightning.pytorch.strategies.ModelParallelStrategy(data_parallel_size=<number of ranks>, "
        "tensor_parallel_size=1) with fully_shard(..., mesh=self.device_mesh['data_parallel']) in configure_model "
        "(trainer=fsdp2), or strategy='ddp'."
    )


def is_dtensor(tensor: torch.Tensor) -> bool:
    return type(tensor).__name__ == "DTensor" and hasattr(tensor, "full_tensor")


def gather_full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank: ``full_tensor()`` of a DTensor (a collective: call it on
    every rank), else the tensor itself, detached."""
    return tensor.full_tensor().detach() if is_dtensor(tensor) else tensor.detach()


@torch.no_grad()
def write_full_(tensor: torch.Tensor, full: torch.Tensor) -> None:
    """Write the whole tensor ``full`` into ``tensor``: for a DTensor, each rank copies its own slice
    (``full`` must be identical on every rank, as a deterministic update of gathered weights is)."""
    if not is_dtensor(tensor):
        tensor.copy_(full)
        return
    from torch.distributed.tensor import distribute_tensor

    # src_data_rank=None: slice the local copy, no communication (and no trust in rank 0's copy).
    local = distribute_tensor(full.to(tensor.dtype), tensor.device_mesh, tensor.placements, src_data_rank=None)
    tensor.to_local().copy_(local.to_local())


@contextmanager
def full_parameters(module: nn.Module, writeback: bool = True) -> Iterator[nn.Module]:
    """Inside the block every parameter of ``module`` is whole on every rank; on exit, changes
    go back to the shards (``writeback``). Enter it on every rank: gathering is a collective.

    FSDP1 (``FullyShardedDataParallel`` anywhere in ``module``): ``summon_full_params``.
    FSDP2 / DTensor parameters: each is swapped for a full-tensor Parameter and re-sliced on exit,
    then the original (sharded) Parameter object is put back, so optimizers still own it.
    Optimizer state stays sharded: a callback that edits moments must handle DTensor state itself.
    Anything else (single device, DDP): a no-op.

    Example:
        >>> with full_parameters(pl_module):
        ...     layer.weight.copy_(orthogonalize(layer.weight))   # the whole matrix on every rank
    """
    from torch.distributed.fsdp import FullyShardedDataParallel

    if any(isinstance(m, FullyShardedDataParallel) for m in module.modules()):
        with FullyShardedDataParallel.summon_full_params(module, writeback=writeback, recurse=True):
            yield module
        return
    swapped = []
    for owner in module.modules():
        for name, param in list(owner.named_parameters(recurse=False)):
            if is_dtensor(param):
                full = nn.Parameter(gather_full(param).clone(), requires_grad=param.requires_grad)
                owner._parameters[name] = full  # bypasses FSDP2's registration hooks: no forward runs inside
                swapped.append((owner, name, param, full))
    try:
        yield module
    finally:  # the sharded Parameter objects go back even after an error; its half-done changes do not
        for owner, name, param, _ in swapped:
            owner._parameters[name] = param
    if writeback:
        for _, _, param, full in swapped:
            write_full_(param, full.detach())


def rank_identical_generator(seed: int, *parts: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator seeded only from values every rank shares (e.g. the global step), so random
    draws are identical on all ranks without a broadcast."""
    mixed = seed
    for p in parts:
        mixed = (mixed * 1_000_003 + int(p)) % (2**63 - 1)
    return torch.Generator(device=device).manual_seed(mixed)


def all_reduce_mean(trainer, tensor: torch.Tensor) -> torch.Tensor:
    """Mean over ranks via the strategy's collective (identity on one process)."""
    if trainer is None or trainer.world_size == 1:
        return tensor
    return trainer.strategy.reduce(tensor, reduce_op="mean")


def saves_folders(trainer) -> bool:
    """Whether ``trainer``'s strategy writes its checkpoints as folders of shards (``ModelParallelStrategy`` with
    ``save_distributed_checkpoint=True``; FSDP1, whose sharded folders are laid out otherwise, is refused by the
    callbacks)."""
    # ModelParallelStrategy(save_distributed_checkpoint=...) keeps the choice only as this private attribute
    return bool(getattr(trainer.strategy, "_save_distributed_checkpoint", False))


def warn_on_rank_zero(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` on global rank 0 only (every process when no process group is up): the ops' warnings,
    without Lightning's ``rank_zero_warn``."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        warnings.warn(message, category, stacklevel=3)
