"""Learned scalars of a block (pathway weights, skip gates, mixing coefficients) as 1-element parameters.

``fully_shard`` (FSDP2) shards every parameter on dim 0 and rejects 0-d ones, so a block's scalars are
stored with shape ``(1,)``: they broadcast against activations exactly as a 0-d tensor does, so the
forward pass is unchanged. A state dict that holds such a scalar 0-d still loads
(:func:`accept_scalar_entries`).
"""
from __future__ import annotations

import torch
from torch import nn


def scalar_parameter() -> nn.Parameter:
    """An uninitialised learned scalar, shaped ``(1,)`` so that FSDP2 can shard it."""
    return nn.Parameter(torch.empty(1))


def accept_scalar_entries(module: nn.Module, state_dict: dict, prefix: str, *args) -> None:
    """``load_state_dict`` pre-hook: a 0-d entry for one of ``module``'s own ``(1,)`` parameters is
    reshaped to ``(1,)`` before loading, so checkpoints that stored the scalars 0-d stay loadable.

    Example:
        >>> self.register_load_state_dict_pre_hook(accept_scalar_entries)
    """
    for name, param in module.named_parameters(recurse=False):
        key = prefix + name
        value = state_dict.get(key)
        if param.shape == (1,) and torch.is_tensor(value) and value.dim() == 0:
            state_dict[key] = value.reshape(1)
