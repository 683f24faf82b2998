"""Positional blocks: how attention learns where tokens are.

A positional block may rotate queries and keys (RoPE) and/or return an additive bias for
the attention scores (FIRE, ALiBi, T5). Attention calls both hooks on every forward pass:

- ``rotate(q, k, offset)``: ``q``/``k`` are ``(B, H, T, hd)``; ``offset`` is the absolute
  position of the first query (non-zero while decoding with a KV cache).
- ``score_bias(t_q, t_k, offset)``: ``(H, t_q, t_k)`` added to the scores before softmax, for
  queries at ``offset .. offset+t_q-1`` and keys at ``0 .. t_k-1``, or ``None``.

Both must give the same rows whether a sequence is processed whole or one token at a time.
"""
from __future__ import annotations

import torch
from torch import nn

from ..registry import POSITIONS


class PositionBlock(nn.Module):
    """Base class: no rotation, no bias. Subclasses override one or both hooks."""

    plasticity_role = "position"  # callbacks leave positional parameters alone by default

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.n_head = config.n_head
        self.head_dim = config.n_embd // config.n_head

    def rotate(self, q: torch.Tensor, k: torch.Tensor, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
        return q, k

    def score_bias(self, t_q: int, t_k: int, offset: int) -> torch.Tensor | None:
        return None


@POSITIONS.register("none")
class NoPosition(PositionBlock):
    """No positional information beyond the causal mask (NoPE)."""


@POSITIONS.register("rope")
class Rotary(PositionBlock):
    """Rotary embeddings, split-half layout (as nanochat), base ``rope_base``.

    The cos/sin table is built once for ``config.sequence_len`` positions, as buffers, so a
    compiled forward reads constants and never re-traces; it doubles on demand when generation
    runs past the training length (rare, and done in eager mode by ``GPT.generate``).
    """

    def __init__(self, config, layer_idx: int, base: float = 10000.0):
        super().__init__(config, layer_idx)
        if self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head dim, got n_embd/n_head={self.head_dim}")
        inv_freq = 1.0 / (base ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._build_table(config.sequence_len, inv_freq.device)

    def _build_table(self, length: int, device: torch.device) -> None:
        # A table grown under inference_mode (validation) must still serve training.
        with torch.inference_mode(False), torch.no_grad():
            t = torch.arange(length, dtype=torch.float32, device=device)
            freqs = torch.outer(t, self.inv_freq.to(device=device, dtype=torch.float32))  # (T, hd/2)
            self.register_buffer("cos", freqs.cos(), persistent=False)
            self.register_buffer("sin", freqs.sin(), persistent=False)

    def rotate(self, q, k, offset):
        t = q.shape[-2]
        if offset + t > self.cos.shape[0]:
            self._build_table(max(offset + t, 2 * self.cos.shape[0]), q.device)
        cos, sin = self.cos[offset : offset + t], self.sin[offset : offset + t]  # (T, hd/2)
        return _rotate_half_split(q, cos, sin), _rotate_half_split(k, cos, sin)


def _rotate_half_split(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    x1, x2 = x[..., :d].float(), x[..., d:].float()
    cos, sin = cos.float(), sin.float()  # the table stays float32 math even in a bf16 model
    out = torch.cat([x1 * cos + x2 * sin, -x1 * sin + x2 * cos], dim=-1)
    return out.to(x.dtype)
