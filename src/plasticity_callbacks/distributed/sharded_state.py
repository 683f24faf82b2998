"""Callback state shaped like the model's parameters (L2Init's θ₀, HareTortoise's tortoise) under FSDP2, and
state split by rows the same way (AdaptiveSVDSwitch's singular vectors, saved and loaded by the same path).

Under FSDP2 such state is kept sharded like its parameter: a ``DTensor`` with the parameter's placements,
each rank holding the rows of its own shard, no rank ever a whole copy. Lightning's
``ModelParallelStrategy`` writes the callbacks' ``state_dict`` from rank 0 alone (``torch.save`` of the
checkpoint's metadata), and a ``DTensor`` pickled there keeps rank 0's shard: every rank would load rank
0's rows. So these tensors leave the callback state as the checkpoint is written
(:func:`pack_for_checkpoint`, from the callback's ``on_save_checkpoint``):

- distributed checkpoint (``save_distributed_checkpoint=True``, the strategy's default): each tensor goes
  into the checkpoint's ``state_dict`` under ``<state_key>/<key>/<index>``, which the strategy writes with
  ``torch.distributed.checkpoint`` (every rank its own shard, no gathering), and the callback state keeps
  that name;
- full checkpoint (one file): each tensor is gathered whole (``full_tensor()``, one at a time) and rank 0,
  which writes the file, keeps it on CPU: one full copy of the state in rank 0's CPU memory, as the
  strategy's full model state dict costs.

:func:`restore_like` turns what a checkpoint holds (whole tensors, or names in a distributed checkpoint)
back into tensors placed like the parameters: a whole tensor is sliced to each rank's rows, so a
checkpoint of a single-process or DDP run resumes under FSDP2 too.

Example:
    >>> def on_save_checkpoint(self, trainer, pl_module, checkpoint):
    ...     pack_for_checkpoint(trainer, checkpoint, self.state_key, ("anchors",))
    >>> self.anchors = restore_like(trainer, saved_anchors, params, "L2Init anchors")
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from .strategy import saves_folders
from .strategy import is_dtensor, write_full_


def state_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy for a callback's ``state_dict``: on CPU, or, a ``DTensor``, where its shard is (the checkpoint
    writes it, :func:`pack_for_checkpoint`)."""
    return tensor.detach().clone() if is_dtensor(tensor) else tensor.detach().cpu().clone()


def pack_for_checkpoint(trainer, checkpoint: dict, state_key: str, keys: Sequence[str]) -> None:
    """Move the ``DTensor`` entries of the lists ``keys`` of this callback's state in ``checkpoint`` to where
    every rank's shard is written (see the module docstring); plain tensors stay as they are.

    Args:
        checkpoint: the dict Lightning is about to write (``on_save_checkpoint``); changed in place.
        state_key: the callback's key in ``checkpoint["callbacks"]``.
        keys: keys of its state holding lists of tensors shaped like parameters.
    """
    state = checkpoint.get("callbacks", {}).get(state_key)
    if state is None:
        return
    distributed = saves_folders(trainer)
    for key in keys:
        if key not in state:  # e.g. no singular vectors before AdaptiveSVD's first cycle
            continue
        packed = []
        for index, tensor in enumerate(state[key]):
            if not is_dtensor(tensor):
                packed.append(tensor)
            elif distributed:
                name = f"{state_key}/{key}/{index}"
                checkpoint["state_dict"][name] = tensor
                packed.append(name)
            else:
                whole = tensor.full_tensor()  # a collective: every rank gathers, rank 0 keeps it
                packed.append(whole.cpu() if trainer.is_global_zero else None)
        state[key] = packed


def copies_of(trainer, chosen: Sequence[tuple[str, torch.Tensor]], names: list[str], copies: list, what: str
              ) -> tuple[list[str], list[torch.Tensor], list[torch.Tensor]]:
    """A method's per-parameter copies (L2Init's θ₀, HareTortoise's tortoise) paired with the ``chosen``
    ``(name, parameter)`` pairs and placed like them: taken now when there are none (each rank clones its own
    shard), else restored from a checkpoint's, whose parameter names must be the chosen ones.

    Returns:
        ``(names, copies, parameters)``.

    Example:
        >>> self.names, self.anchors, self._params = copies_of(trainer, chosen, self.names, self.anchors, "L2Init")
    """
    if not copies:
        names, copies = [name for name, _ in chosen], [p.detach().clone() for _, p in chosen]
    if [name for name, _ in chosen] != names:
        raise ValueError(f"{what}: the checkpoint holds {len(names)} parameters {names[:3]}..., this model selects "
                         f"{len(chosen)} {[name for name, _ in chosen][:3]}...; use the same model and selection")
    params = [p for _, p in chosen]
    return names, restore_like(trainer, copies, params, what), params


def restore_like(trainer, saved: Sequence, params: Sequence[torch.Tensor], what: str) -> list[torch.Tensor]:
    """Tensors placed like ``params`` from what a checkpoint holds: whole tensors (sliced to each rank's rows
    under FSDP2) or names of tensors in the distributed checkpoint being resumed (loaded shard by shard).

    Args:
        saved: one entry per parameter, a tensor or a name written by :func:`pack_for_checkpoint`.
        params: the parameters the state follows (``DTensor`` under FSDP2).
        what: the state's name in error messages.
    """
    if len(saved) != len(params):
        raise ValueError(f"{what}: the checkpoint holds {len(saved)} tensors, the model has {len(params)} parameters")
    restored: list[torch.Tensor | None] = []
    names = {}
    for index, (entry, param) in enumerate(zip(saved, params)):
        if isinstance(entry, str):
            names[entry] = torch.empty_like(param.detach())  # a DTensor with the parameter's placements
            restored.append(None)
            continue
        if tuple(entry.shape) != tuple(param.shape):
            raise ValueError(f"{what}: tensor {index} of the checkpoint has shape {tuple(entry.shape)}, its parameter "
                             f"{tuple(param.shape)}; resume with the same model")
        if is_dtensor(entry) == is_dtensor(param) and (not is_dtensor(entry) or entry.placements == param.placements):
            restored.append(entry.to(device=param.device, dtype=param.dtype))  # already placed like its parameter
            continue
        tensor = torch.empty_like(param.detach())
        write_full_(tensor, (entry.full_tensor() if is_dtensor(entry) else entry).to(device=param.device))
        restored.append(tensor)
    if names:
        _load_from_distributed_checkpoint(trainer, names, what)
        restored = [names[e] if isinstance(e, str) else t for e, t in zip(saved, restored)]
    return restored


def load_named(trainer, templates: dict[str, torch.Tensor], what: str) -> dict[str, torch.Tensor]:
    """Fill ``templates`` (``DTensor``s placed as the caller keeps them) with the tensors that
    :func:`pack_for_checkpoint` wrote under these names into the distributed checkpoint being resumed; each
    rank reads the rows of its own shards. A collective: call it on every rank.

    Example:
        >>> U = load_named(trainer, {name: DTensor.empty(...)}, "AdaptiveSVDSwitch singular vectors")[name]
    """
    _load_from_distributed_checkpoint(trainer, templates, what)
    return templates


def _load_from_distributed_checkpoint(trainer, templates: dict[str, torch.Tensor], what: str) -> None:
    path = getattr(trainer, "ckpt_path", None)
    if path is None or not Path(path).is_dir() or not all(is_dtensor(t) for t in templates.values()):
        raise ValueError(f"{what}: the checkpoint keeps them in its distributed checkpoint folder (FSDP2 shards); "
                         f"resume it with ModelParallelStrategy and ckpt_path=<that folder> (got {path!r}); for a "
                         "one-file checkpoint, resume there and save with save_distributed_checkpoint=False")
    from torch.distributed.checkpoint import load

    load({"state_dict": templates}, checkpoint_id=path)  # each rank reads the rows of its own shards


@torch.no_grad()
def squared_distance(xs: Sequence[torch.Tensor], ys: Sequence[torch.Tensor]) -> torch.Tensor:
    """``Σ ‖x - y‖²`` over the pairs, float32, 0-D, the same on every rank: the pairs of ``DTensor`` shards
    are summed on each rank, then over the ranks (one all-reduce; a collective: call it on every rank).

    Example:
        >>> distance = squared_distance(params, anchors).sqrt()   # ‖θ - θ₀‖
    """
    total = torch.zeros((), dtype=torch.float32, device=xs[0].device if xs else "cpu")
    sharded = [(x, y) for x, y in zip(xs, ys, strict=True) if is_dtensor(x)]
    for x, y in zip(xs, ys):
        if not is_dtensor(x):
            total = total + (x.float() - y.float()).pow(2).sum()
    if sharded:
        import torch.distributed as dist

        part = sum((x.to_local().float() - y.to_local().float()).pow(2).sum() for x, y in sharded)
        dist.all_reduce(part, group=sharded[0][0].device_mesh.get_group())
        total = total + part
    return total


def reshard(module: torch.nn.Module) -> None:
    """Put every FSDP2 unit of ``module`` back on its shards (a no-op for other modules and for units already
    sharded). FSDP2 keeps a root unit's parameters gathered after a forward that no backward follows (an
    evaluation), and the next forward computes with that gathered copy: a write to the shards in between is
    not seen unless the unit is resharded first.

    Example:
        >>> reshard(pl_module)   # before writing weights at a validation end
        >>> layer.weight.to_local().copy_(new_rows)
    """
    from torch.distributed.fsdp import FSDPModule

    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            unit.reshard()
