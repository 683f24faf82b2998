"""Additive positional biases: FIRE, ALiBi and T5 relative buckets.

Each block returns ``score_bias(t_q, t_k, offset) -> (H, t_q, t_k)`` for queries at absolute
positions ``offset .. offset+t_q-1`` and keys at ``0 .. t_k-1``. Every entry depends only on the
absolute pair ``(i, j)``, so the row of one new query while decoding with a KV cache is exactly
the row of the full matrix, and nothing is sized by the training length: any length works.

The math is in plain functions (``relative_distance``, ``fire_interpolation``,
``clamped_interpolation``, ``alibi_slopes``, ``t5_causal_buckets``); the blocks hold parameters.
"""
from __future__ import annotations

import math
import weakref

import torch
from torch import nn

from ...errors import ConfigError
from ..registry import POSITIONS
from .position import PositionBlock


def relative_distance(t_q: int, t_k: int, offset: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(i - j)`` as ``(t_q, t_k)`` float, clamped at 0, and the query positions ``i`` as ``(t_q, 1)``.

    Future keys (``j > i``) are masked by the attention anyway; clamping keeps the log-based
    maps below finite there instead of producing NaNs that would leak through ``0·NaN``.
    """
    i = torch.arange(offset, offset + t_q, device=device, dtype=torch.float32)[:, None]
    j = torch.arange(t_k, device=device, dtype=torch.float32)[None, :]
    return (i - j).clamp(min=0.0), i


def fire_interpolation(distance: torch.Tensor, query_pos: torch.Tensor, c: torch.Tensor,
                       threshold: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """FIRE's progressive interpolation ``ψ(i−j) / ψ(max(L, i))`` with ``ψ(x) = log(c·x + 1)``.

    Below the threshold ``L`` the denominator is the constant ``ψ(L)`` (distances keep an absolute
    scale, good for short contexts); beyond it the query position normalizes, so every query maps
    its keys into ``[0, 1]`` however long the sequence grows (Li et al., ICLR 2024, eq. 4).
    ``c`` and ``L`` are learned; absolute values keep ``ψ`` defined whatever sign they drift to.
    """
    c = c.abs()
    numerator = torch.log1p(c * distance)
    denominator = torch.log1p(c * torch.maximum(threshold.abs(), query_pos)).clamp(min=eps)
    return numerator / denominator


def clamped_interpolation(distance: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """Seed 001's simpler map ``clamp(log(1+d) / log(1+L_h), 0, 1)``: ``(H, t_q, t_k)`` for per-head ``L_h``."""
    return (torch.log1p(distance) / torch.log1p(threshold.view(-1, 1, 1))).clamp(0.0, 1.0)


def alibi_slopes(n_head: int) -> torch.Tensor:
    """ALiBi's per-head slopes ``2^(−8h/n)``, h = 1..n, for ``n`` a power of two. Otherwise (Press et
    al.'s recipe) the slopes of the largest power of two ``p < n``, then every other slope of ``2p``."""
    def geometric(n: int) -> list[float]:
        return [2.0 ** (-8.0 * h / n) for h in range(1, n + 1)]

    if n_head <= 0:
        raise ValueError(f"n_head must be positive, got {n_head}")
    p = 2 ** int(math.floor(math.log2(n_head)))
    slopes = geometric(p) + geometric(2 * p)[0::2][: n_head - p]
    return torch.tensor(slopes, dtype=torch.float32)


def t5_causal_buckets(distance: torch.Tensor, num_buckets: int = 32, max_distance: int = 128) -> torch.Tensor:
    """T5's unidirectional relative buckets for ``distance = i − j ≥ 0``: the first half of the
    buckets are exact offsets, the second half log-spaced up to ``max_distance``; farther shares
    the last bucket."""
    n = distance.long().clamp(min=0)
    max_exact = num_buckets // 2
    # The exact region never uses the log branch; clamping keeps log(0) = -inf out of the long cast.
    scaled = torch.log(n.float().clamp(min=1) / max_exact) / math.log(max_distance / max_exact)
    large = (max_exact + (scaled * (num_buckets - max_exact)).long()).clamp(max=num_buckets - 1)
    return torch.where(n < max_exact, n, large)


def lookup(per_distance: torch.Tensor, distance: torch.Tensor) -> torch.Tensor:
    """``(H, n)`` values per distance -> ``(H, t_q, t_k)`` by the ``(t_q, t_k)`` distance matrix.

    ``index_select`` rather than advanced indexing: its backward is an ``index_add`` and ran
    about 1.6x faster on CPU for T = 256.
    """
    t_q, t_k = distance.shape
    return per_distance.index_select(1, distance.long().flatten()).view(-1, t_q, t_k)


# Layer-shared parameter modules, keyed by the GPTConfig they were built for (see _shared_or_new).
_SHARED: dict[tuple[int, str], tuple[weakref.ref, weakref.ref]] = {}


def _shared_or_new(config, layer_idx: int, key: str, shared: bool, build) -> nn.Module:
    """One module per layer, or (``shared``) the module layer 0 of the same model built.

    Blocks are built in layer order from one config object, so layer 0 starts a new shared
    module and later layers of that model find it; a second model from the same config starts
    afresh at its layer 0. Weak references keep this table from holding models alive.
    """
    if not shared:
        return build()
    slot = (id(config), key)
    entry = _SHARED.get(slot)
    if layer_idx > 0 and entry is not None and entry[0]() is config and entry[1]() is not None:
        return entry[1]()
    module = build()
    _SHARED[slot] = (weakref.ref(config), weakref.ref(module))
    return module


class FIREFunction(nn.Module):
    """The learned part of FIRE: ``f_θ`` (an MLP 1→width→H), ``c`` and the threshold ``L``."""

    def __init__(self, n_head: int, width: int, threshold: float, c_init: float):
        super().__init__()
        self.c_init, self.threshold = c_init, threshold
        self.mlp = nn.Sequential(
            nn.Linear(1, width), nn.ReLU(),
            nn.Linear(width, n_head, bias=False),  # a constant per-head bias is a no-op under softmax
        )
        self.c = nn.Parameter(torch.tensor(c_init))
        self.threshold_scale = nn.Parameter(torch.tensor(1.0))  # L = threshold · scale, learned
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        # Hidden units O(1) so the MLP can bend early; output small so training starts bias-free.
        nn.init.xavier_uniform_(self.mlp[0].weight)
        nn.init.zeros_(self.mlp[0].bias)
        nn.init.xavier_uniform_(self.mlp[2].weight, gain=0.1)
        self.c.fill_(self.c_init)
        self.threshold_scale.fill_(1.0)

    def forward(self, distance: torch.Tensor, query_pos: torch.Tensor, max_distance: int) -> torch.Tensor:
        x = fire_interpolation(distance, query_pos, self.c, self.threshold * self.threshold_scale)
        return self.mlp(x.unsqueeze(-1)).permute(2, 0, 1)  # (t_q, t_k, H) -> (H, t_q, t_k)


class ClampedFIREFunction(nn.Module):
    """Seed 001's variant: per-head learned ``L_h`` (log-parametrized), MLP 1→width→1 with GELU shared
    by the heads, Xavier init with gain 0.1."""

    def __init__(self, n_head: int, width: int, threshold: float):
        super().__init__()
        self.threshold = threshold
        self.log_threshold = nn.Parameter(torch.full((n_head,), math.log(threshold)))
        self.mlp = nn.Sequential(nn.Linear(1, width), nn.GELU(), nn.Linear(width, 1, bias=False))
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        for layer in (self.mlp[0], self.mlp[2]):
            nn.init.xavier_uniform_(layer.weight, gain=0.1)
        nn.init.zeros_(self.mlp[0].bias)
        self.log_threshold.fill_(math.log(self.threshold))

    def forward(self, distance: torch.Tensor, query_pos: torch.Tensor, max_distance: int) -> torch.Tensor:
        # The bias depends on the distance alone: run the per-head MLP once per distinct distance
        # (H·T inputs instead of H·T²) and look the matrix up.
        distances = torch.arange(max_distance + 1, device=distance.device, dtype=distance.dtype)
        x = clamped_interpolation(distances.view(1, -1), self.log_threshold.exp())  # (H, 1, n)
        per_distance = self.mlp(x.unsqueeze(-1)).view(x.shape[0], -1)  # (H, n)
        return lookup(per_distance, distance)  # (H, t_q, t_k)


@POSITIONS.register("fire")
class FIREBias(PositionBlock):
    """FIRE: ``b(i, j) = f_θ(ψ(i−j) / ψ(max(L, i)))`` added to the scores (Li et al., ICLR 2024).

    Args:
        variant: ``paper`` (the form above; ``c`` init ``c_init``, ``L = threshold`` × a learned
            scale) or ``clamped`` (seed 001: ``clamp(log(1+d)/log(1+L_h), 0, 1)``, per-head ``L_h``).
        width: hidden width of ``f_θ``.
        threshold: initial ``L``; training positions below it see an absolute distance scale.
        shared: one FIRE module for all layers instead of one per layer.
    """

    VARIANTS = ("paper", "clamped")

    def __init__(self, config, layer_idx: int, variant: str = "paper", width: int = 32,
                 threshold: float = 512.0, c_init: float = 0.1, shared: bool = False):
        super().__init__(config, layer_idx)
        if variant not in self.VARIANTS:
            raise ConfigError(f"position_options.variant={variant!r} is not one of {self.VARIANTS}")
        if not isinstance(width, int) or width <= 0:
            raise ConfigError(f"position_options.width must be a positive integer, got {width!r}")
        if threshold <= 0 or c_init <= 0:
            raise ConfigError(f"position_options.threshold and c_init must be > 0, got {threshold}, {c_init}")
        if variant == "paper":
            def build():
                return FIREFunction(self.n_head, width, float(threshold), float(c_init))
        else:
            def build():
                return ClampedFIREFunction(self.n_head, width, float(threshold))
        self.fire = _shared_or_new(config, layer_idx, f"fire-{variant}", shared, build)

    def score_bias(self, t_q: int, t_k: int, offset: int) -> torch.Tensor:
        distance, query_pos = relative_distance(t_q, t_k, offset, self.fire.mlp[0].weight.device)
        return self.fire(distance, query_pos, offset + t_q - 1)  # (H, t_q, t_k)


@POSITIONS.register("alibi")
class ALiBiBias(PositionBlock):
    """ALiBi: ``−m_h·(i−j)`` with fixed slopes ``m_h`` (Press et al., ICLR 2022); no parameters."""

    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        self.register_buffer("slopes", alibi_slopes(self.n_head), persistent=False)

    def score_bias(self, t_q: int, t_k: int, offset: int) -> torch.Tensor:
        distance, _ = relative_distance(t_q, t_k, offset, self.slopes.device)
        return -self.slopes.view(-1, 1, 1) * distance  # (H, t_q, t_k)


class T5BucketTable(nn.Module):
    def __init__(self, num_buckets: int, n_head: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_buckets, n_head))  # starts bias-free


@POSITIONS.register("t5")
class T5RelativeBias(PositionBlock):
    """T5's learned relative bias: one scalar per (causal bucket, head) (Raffel et al., 2020).

    ``shared=True`` uses one table for all layers, as T5 itself does; the default is one per layer.
    """

    def __init__(self, config, layer_idx: int, num_buckets: int = 32, max_distance: int = 128,
                 shared: bool = False):
        super().__init__(config, layer_idx)
        if not isinstance(num_buckets, int) or num_buckets < 2:
            raise ConfigError(f"position_options.num_buckets must be an integer >= 2, got {num_buckets!r}")
        if not isinstance(max_distance, int) or max_distance <= num_buckets // 2:
            raise ConfigError(f"position_options.max_distance must be an integer > num_buckets/2, got {max_distance!r}")
        self.num_buckets, self.max_distance = num_buckets, max_distance
        self.table = _shared_or_new(config, layer_idx, "t5", shared, lambda: T5BucketTable(num_buckets, self.n_head))

    def score_bias(self, t_q: int, t_k: int, offset: int) -> torch.Tensor:
        distance, _ = relative_distance(t_q, t_k, offset, self.table.weight.device)
        bucket_of = t5_causal_buckets(torch.arange(offset + t_q, device=distance.device),
                                      self.num_buckets, self.max_distance)  # one log per distinct distance
        return lookup(self.table.weight.t()[:, bucket_of], distance)  # (H, n) -> (H, t_q, t_k)
