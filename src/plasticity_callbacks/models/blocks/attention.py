"""Attention blocks. The causal self-attention here is nanochat's: separate q/k/v
projections (so each has a clear role for the callbacks), RoPE or an additive positional
bias, QK-norm, grouped-query attention, no biases."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..registry import ATTENTIONS
from .position import PositionBlock


def rms_norm(x: torch.Tensor) -> torch.Tensor:
    """RMSNorm without learnable weights (nanochat)."""
    return F.rms_norm(x, (x.shape[-1],))


class KVCache:
    """Keys and values (or a recurrent mixer's state) of every layer for incremental decoding.

    Concatenation keeps exactly the valid prefix, so a cache can never hand out stale or
    padding positions (seed 003 recorded a prefill bug from copying a whole buffer).
    """

    def __init__(self, n_layer: int):
        self.keys: list[torch.Tensor | None] = [None] * n_layer
        self.values: list[torch.Tensor | None] = [None] * n_layer
        self.states: list[dict | None] = [None] * n_layer  # recurrent mixers (mamba2): their state after the prefix

    def length(self, layer_idx: int) -> int:
        k = self.keys[layer_idx]
        return 0 if k is None else k.shape[-2]

    def append(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys[layer_idx] is not None:
            k = torch.cat([self.keys[layer_idx], k], dim=-2)
            v = torch.cat([self.values[layer_idx], v], dim=-2)
        self.keys[layer_idx], self.values[layer_idx] = k, v
        return k, v


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int, bias: torch.Tensor | None
) -> torch.Tensor:
    """SDPA over ``q (B, H, Tq, hd)`` and ``k, v (B, Hkv, Tk, hd)``; query i sits at ``offset + i``.

    Without a bias the causal fast path is used; a bias must go in as a float mask.
    """
    t_q, t_k = q.shape[-2], k.shape[-2]
    gqa = q.shape[1] != k.shape[1]
    if bias is None and t_q == t_k:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    q_pos = torch.arange(offset, offset + t_q, device=q.device)[:, None]
    k_pos = torch.arange(t_k, device=q.device)[None, :]
    allowed = k_pos <= q_pos  # (Tq, Tk)
    if bias is None:
        mask = allowed
    else:
        mask = bias.to(q.dtype).masked_fill(~allowed, float("-inf")).unsqueeze(0)  # (1, H, Tq, Tk)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


@ATTENTIONS.register("standard")
class CausalSelfAttention(nn.Module):
    """Multi-head causal attention with GQA (``n_kv_head`` key/value heads)."""

    plasticity_role = "attention"

    def __init__(self, config, layer_idx: int, position: PositionBlock):
        super().__init__()
        if config.n_embd % config.n_head:
            raise ValueError(f"n_embd={config.n_embd} must be divisible by n_head={config.n_head}")
        if config.n_head % config.n_kv_head:
            raise ValueError(f"n_head={config.n_head} must be a multiple of n_kv_head={config.n_kv_head}")
        self.layer_idx = layer_idx
        self.n_head, self.n_kv_head = config.n_head, config.n_kv_head
        self.head_dim = config.n_embd // config.n_head
        d = config.n_embd
        self.c_q = nn.Linear(d, self.n_head * self.head_dim, bias=False)
        self.c_k = nn.Linear(d, self.n_kv_head * self.head_dim, bias=False)
        self.c_v = nn.Linear(d, self.n_kv_head * self.head_dim, bias=False)
        self.c_proj = nn.Linear(d, d, bias=False)
        self.position = position

    def forward(self, x: torch.Tensor, kv_cache: KVCache | None = None) -> torch.Tensor:
        B, T, C = x.shape
        q = self.c_q(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, H, T, hd)
        k = self.c_k(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, Hkv, T, hd)
        v = self.c_v(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, Hkv, T, hd)
        offset = kv_cache.length(self.layer_idx) if kv_cache is not None else 0
        q, k = self.position.rotate(q, k, offset)
        q, k = rms_norm(q), rms_norm(k)  # QK-norm after RoPE (nanochat)
        if kv_cache is not None:
            k, v = kv_cache.append(self.layer_idx, k, v)  # (B, Hkv, Tk, hd)
        bias = self.position.score_bias(T, k.shape[-2], offset)
        y = causal_attention(q, k, v, offset, bias)  # (B, H, T, hd)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)
