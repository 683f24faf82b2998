"""Reciprocal attention (seed 002), fused: one SDPA call scores ``Q Kᵀ`` and ``K Qᵀ`` together.

Per head of dim D, R of the dims are "low": the query projection's low dims are ``Q_low`` and
the key projection's are ``K_low``. Swapping the low dims between query and key gives the
folded pair ``Qf = [Q_std | K_low]``, ``Kf = [K_std | Q_low]``, and since a dot product sums over
dims, ``Qf_i · Kf_j = Q_std,i · K_std,j + K_low,i · Q_low,j``: standard attention plus the
reciprocal term "how much token j would attend to token i", at the cost of one attention.

The low dims are the last R/2 of each half of the head, not the last R: split-half RoPE pairs
dim p with p + D/2, so this way rotations never mix a standard dim with a low one and both terms
stay functions of the relative position.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import ConfigError
from .gates import accept_scalar_entries, scalar_parameter
from ..registry import ATTENTIONS
from .attention import KVCache, causal_attention, rms_norm
from .position import PositionBlock


def reciprocal_dim_mask(head_dim: int, rank: int) -> torch.Tensor:
    """``(head_dim,)`` bool, True on the R low dims: the last ``rank/2`` of each half of the head."""
    if head_dim % 2 or rank % 2 or not 0 < rank < head_dim:
        raise ConfigError(f"attention_options.rank must be even and in (0, head_dim={head_dim}), got {rank!r}")
    half = head_dim // 2
    in_half = torch.arange(head_dim) % half
    return in_half >= half - rank // 2


class _SwapDims(torch.autograd.Function):
    """``(a, b) -> (where(mask, b, a), where(mask, a, b))``. The swap is its own transpose, so the
    backward is the same swap of the incoming gradients: two ``where`` instead of autograd's four
    zero-padded gradients and two accumulations (measured ~8% of the block's time on CPU)."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor):
        ctx.save_for_backward(mask)
        return torch.where(mask, b, a), torch.where(mask, a, b)

    @staticmethod
    def backward(ctx, grad_a: torch.Tensor, grad_b: torch.Tensor):
        (mask,) = ctx.saved_tensors
        return torch.where(mask, grad_b, grad_a), torch.where(mask, grad_a, grad_b), None


def fold_reciprocal(q: torch.Tensor, k: torch.Tensor, low_dims: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``q (B, H, T, D)``, ``k (B, Hkv, T, D)`` -> ``Qf = [Q_std | K_low]``, ``Kf = [K_std | Q_low]``, both
    ``(B, H, T, D)``. Under GQA each query head pairs with its group's key head (``h // (H/Hkv)``, as
    SDPA's ``enable_gqa``); the folded key carries that query head's ``Q_low``, so it has H heads."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)  # (B, H, T, D)
    return _SwapDims.apply(q, k, low_dims)


@ATTENTIONS.register("reciprocal")
class ReciprocalAttention(nn.Module):
    """Causal attention with scores ``w_std·g_std·Q_std K_stdᵀ + w_rec·g_rec·K_low Q_lowᵀ`` (÷√D).

    ``w_std = (D−R)/D`` and ``w_rec = R/D`` start at each pathway's share of the head (the
    seed's geometric init); ``g = sigmoid(skip)`` are learned skip gates starting open for the
    standard pathway (2.0) and nearly shut for the reciprocal one (−3.0), so the block starts
    as standard attention and the reciprocal term has to earn its weight. Gating is soft in
    training; ``gate > 0.5`` decisions exist only in logs (``gate_values``).

    The seed applies ``√(w·g)`` to both Qf and Kf; we apply the whole ``w·g`` on the query
    projection's dims, as the weight of its QK-norm: ``Q_std`` (in Qf) gets the standard factor,
    ``Q_low`` (in Kf) the reciprocal one. The scores are identical, the learned ``w`` may cross
    zero (``√`` would give NaN), and the scaling rides in the fused RMSNorm kernel instead of a
    separate pass over Qf (measured 1.19x -> 1.04x of standard attention's time on CPU).

    Under GQA the folded key carries each query head's ``Q_low``, so Kf (and the key cache)
    has ``n_head`` heads; values keep ``n_kv_head``.

    Args:
        rank: R, the reciprocal dims per head (even, ``0 < R < head_dim``).
        hard_gate_threshold: in eval mode, a pathway whose gate is below this is dropped (its
            score term is exactly zero); ``None`` keeps soft gating at inference too.
    """

    plasticity_role = "attention"

    def __init__(self, config, layer_idx: int, position: PositionBlock, rank: int = 4,
                 hard_gate_threshold: float | None = None):
        super().__init__()
        if hard_gate_threshold is not None and not 0.0 < hard_gate_threshold < 1.0:
            raise ConfigError("attention_options.hard_gate_threshold must be in (0, 1) or null, "
                              f"got {hard_gate_threshold}")
        self.layer_idx = layer_idx
        self.n_head, self.n_kv_head = config.n_head, config.n_kv_head
        self.head_dim = config.n_embd // config.n_head
        self.rank, self.hard_gate_threshold = rank, hard_gate_threshold
        self.register_buffer("low_dims", reciprocal_dim_mask(self.head_dim, rank), persistent=False)
        d = config.n_embd
        self.c_q = nn.Linear(d, self.n_head * self.head_dim, bias=False)  # per head: Q_std | Q_low dims
        self.c_k = nn.Linear(d, self.n_kv_head * self.head_dim, bias=False)  # per head: K_std | K_low dims
        self.c_v = nn.Linear(d, self.n_kv_head * self.head_dim, bias=False)
        self.c_proj = nn.Linear(d, d, bias=False)
        self.position = position
        self.w_std = scalar_parameter()
        self.w_rec = scalar_parameter()
        self.skip_std = scalar_parameter()
        self.skip_rec = scalar_parameter()
        self.register_load_state_dict_pre_hook(accept_scalar_entries)  # a 0-d entry in a state dict loads too
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        self.w_std.fill_((self.head_dim - self.rank) / self.head_dim)
        self.w_rec.fill_(self.rank / self.head_dim)
        self.skip_std.fill_(2.0)
        self.skip_rec.fill_(-3.0)

    def gates(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(g_std, g_rec)``: soft sigmoid gates; with hard gating in eval, those below threshold are 0."""
        g_std, g_rec = torch.sigmoid(self.skip_std), torch.sigmoid(self.skip_rec)
        if self.hard_gate_threshold is not None and not self.training:
            g_std = torch.where(g_std < self.hard_gate_threshold, torch.zeros_like(g_std), g_std)
            g_rec = torch.where(g_rec < self.hard_gate_threshold, torch.zeros_like(g_rec), g_rec)
        return g_std, g_rec

    def gate_values(self) -> dict[str, torch.Tensor]:
        """Detached ``(1,)`` values for logging (GateLogger); ``DTensor`` shards under FSDP2."""
        return {"gate_std": torch.sigmoid(self.skip_std).detach(), "gate_rec": torch.sigmoid(self.skip_rec).detach(),
                "w_std": self.w_std.detach(), "w_rec": self.w_rec.detach()}

    def score_scale(self) -> torch.Tensor:
        """``(D,)``: ``w_std·g_std`` on the standard dims, ``w_rec·g_rec`` on the low dims; each
        score term carries its factor exactly once, on the query projection's side."""
        g_std, g_rec = self.gates()
        return torch.where(self.low_dims, self.w_rec * g_rec, self.w_std * g_std)

    def folded_qkv(self, x: torch.Tensor, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``Qf (B, H, T, D)``, ``Kf (B, H, T, D)`` (pathway scales applied) and ``V (B, Hkv, T, D)``
        for queries at ``offset..``."""
        B, T, _ = x.shape
        q = self.c_q(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, H, T, hd)
        k = self.c_k(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, Hkv, T, hd)
        v = self.c_v(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, Hkv, T, hd)
        q, k = self.position.rotate(q, k, offset)
        # QK-norm before folding, so both terms see normalized q and k; the norm's weight scales q.
        q = F.rms_norm(q, (self.head_dim,), self.score_scale().to(q.dtype))
        k = rms_norm(k)
        qf, kf = fold_reciprocal(q, k, self.low_dims)  # (B, H, T, hd) each
        return qf, kf, v

    def forward(self, x: torch.Tensor, kv_cache: KVCache | None = None) -> torch.Tensor:
        B, T, C = x.shape
        offset = kv_cache.length(self.layer_idx) if kv_cache is not None else 0
        qf, kf, v = self.folded_qkv(x, offset)
        if kv_cache is not None:
            # The folded key holds each past token's Q_low: exactly what later queries need.
            kf, v = kv_cache.append(self.layer_idx, kf, v)  # (B, H, Tk, hd), (B, Hkv, Tk, hd)
        if self.n_head != self.n_kv_head:
            v = v.repeat_interleave(self.n_head // self.n_kv_head, dim=1)  # (B, H, Tk, hd)
        bias = self.position.score_bias(T, kf.shape[-2], offset)
        y = causal_attention(qf, kf, v, offset, bias)  # (B, H, T, hd)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)
