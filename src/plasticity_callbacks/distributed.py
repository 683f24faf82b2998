"""What the callbacks need from the distributed strategy, in one place.

Under DDP every rank holds the full, identical parameters and gradients are already
all-reduced when ``on_before_optimizer_step`` runs, so a deterministic computation gives
identical weights everywhere. Randomness (re-sampled neurons, fresh inits) must come from a
generator seeded the same way on every rank. Sharded strategies (FSDP, DeepSpeed, model
parallel) hold only shards, and an SVD or polar factor needs the whole matrix: until a
gather path exists for a strategy, callbacks refuse it at setup rather than act on shards.
"""
from __future__ import annotations

import torch

try:
    from lightning.pytorch.utilities.exceptions import MisconfigurationException
except ImportError:  # pragma: no cover - Lightning is a dependency, but keep the math importable
    MisconfigurationException = RuntimeError  # type: ignore[misc,assignment]

_SHARDED = ("FSDP", "DeepSpeed", "ModelParallel")


def is_sharded(trainer) -> bool:
    return any(name in type(trainer.strategy).__name__ for name in _SHARDED)


def require_full_parameters(trainer, owner: str) -> None:
    """Raise a clear error under a strategy whose parameters are sharded."""
    if is_sharded(trainer):
        raise MisconfigurationException(
            f"{owner} needs each weight matrix whole, but strategy {type(trainer.strategy).__name__} shards "
            "parameters and no gather path is implemented for it yet. Use strategy='ddp' (or a single device)."
        )


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
