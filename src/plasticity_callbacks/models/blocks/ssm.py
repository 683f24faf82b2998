"""A Mamba-2-style state-space mixer (Dao & Gu, 2024), in plain PyTorch: slow but exact on CPU.

Data flow, per token ``t`` and head ``h`` (``P`` channels of ``x`` per head, state size ``N``):

    [z | x | B | C | dt] = in_proj(u)                        one matrix, five blocks
    [x | B | C] = silu(causal depthwise conv1d([x | B | C]))
    dt = softplus(dt + dt_bias),  A = -exp(A_log)            one decay per head
    S_t = exp(dt_t A_h) S_{t-1} + dt_t · x_t ⊗ B_t            (P, N) state
    y_t = S_t C_t + D_h x_t
    out = out_proj(rmsnorm(y · silu(z)) · norm_weight)

The scan is computed in its dual, quadratic form (``y = (L ∘ C Bᵀ) (dt · x)`` with ``L[t, s] = exp(Σ_{s<r≤t}
dt_r A)``), exact like attention and as slow (``O(T²)``); a cached state continues it token by token.

For the plasticity callbacks the block declares itself (:func:`~plasticity_callbacks.model_map.declare_plasticity`):
``in_proj`` is five blocks (``z``, ``x``, ``B``, ``C``, ``dt``), each treated as its own matrix by FIRE;
``out_proj`` is one matrix; the depthwise ``conv1d`` is a causal filter over positions, declared with the
``position`` role, so the callbacks leave it alone by default, as they leave ``A_log``, ``D``, ``dt_bias`` and
the norm (1-D) alone. ReDo names the block as not a unit layer (a channel feeds the norm over all channels).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ...model_map.declaration import declare_plasticity
from ..registry import ATTENTIONS
from .attention import KVCache
from .position import PositionBlock


def segment_sums(a: torch.Tensor) -> torch.Tensor:
    """``(..., T)`` -> ``(..., T, T)`` with ``[t, s] = Σ_{s<r≤t} a_r`` for ``s ≤ t`` and ``-inf`` above the diagonal
    (``exp`` of it is the decay from step ``s`` to step ``t``). Differences of one cumulative sum: exact enough for
    the ``T`` of a training context."""
    cumulative = a.cumsum(-1)
    sums = cumulative[..., :, None] - cumulative[..., None, :]
    causal = torch.ones(a.shape[-1], a.shape[-1], dtype=torch.bool, device=a.device).tril()
    return sums.masked_fill(~causal, float("-inf"))


def selective_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The Mamba-2 scan without ``D``: ``S_t = exp(dt_t A) S_{t-1} + dt_t x_t ⊗ B_t``, ``y_t = S_t C_t``.

    Args:
        x: ``(batch, T, heads, P)``.
        dt: ``(batch, T, heads)``, positive step sizes.
        A: ``(heads,)``, negative decay rates.
        B, C: ``(batch, T, N)``, shared by the heads (one group).
        state: ``(batch, heads, P, N)`` before the first step, or None for zeros.

    Returns:
        ``y (batch, T, heads, P)`` and the state after the last step.

    Example:
        >>> y, last = selective_scan(x, dt, -torch.rand(4), B, C)
    """
    decay = (dt * A).transpose(1, 2)  # (b, h, T): log of each step's decay
    L = torch.exp(segment_sums(decay))  # (b, h, T, T)
    scores = torch.einsum("btn,bsn->bts", C, B)  # (b, T, T): C_t · B_s
    weights = L * scores[:, None]  # (b, h, T, T)
    y = torch.einsum("bhts,bsh,bshp->bthp", weights, dt, x)
    after = torch.exp(decay.cumsum(-1))  # (b, h, T): decay from the initial state to step t
    if state is not None:
        y = y + torch.einsum("bht,btn,bhpn->bthp", after, C, state)
    to_end = torch.exp(decay.sum(-1, keepdim=True) - decay.cumsum(-1))  # (b, h, T): decay from step s to the end
    last = torch.einsum("bhs,bsh,bshp,bsn->bhpn", to_end, dt, x, B)
    if state is not None:
        last = last + after[..., -1, None, None] * state
    return y, last


@ATTENTIONS.register("mamba2")
class Mamba2Mixer(nn.Module):
    """A Mamba-2 sequence mixer in an attention slot: ``forward(x (B, T, d), kv_cache) -> (B, T, d)``.

    Args:
        config: the GPT config (``n_embd``).
        layer_idx: where it sits (its recurrent state's slot in a cache).
        position: ignored (the conv and the scan are causal and position-aware by themselves).
        d_state: ``N``, the state size per channel.
        d_conv: taps of the causal depthwise conv.
        expand: ``d_inner = expand · n_embd`` channels.
        head_dim: ``P``, channels per head (one decay ``A`` and step ``dt`` per head).

    Example:
        >>> GPT(GPTConfig(attention="mamba2", attention_options={"d_state": 16}))
        >>> GPT(GPTConfig(layer_pattern=["attn", "mamba2"]))   # a hybrid: attention, then SSM, repeated
    """

    plasticity_role = "attention"  # the token mixer of its layer
    uses_position = False  # the GPT gives it no positional block

    def __init__(self, config, layer_idx: int, position: PositionBlock | None = None, d_state: int = 16,
                 d_conv: int = 4, expand: int = 2, head_dim: int = 32):
        super().__init__()
        d = config.n_embd
        self.layer_idx, self.d_state, self.d_inner = layer_idx, d_state, expand * d
        if self.d_inner % head_dim:
            raise ValueError(f"mamba2: d_inner = expand·n_embd = {self.d_inner} must be divisible by head_dim={head_dim}")
        self.head_dim, self.n_heads = head_dim, self.d_inner // head_dim
        conv_dim = self.d_inner + 2 * d_state
        self.in_proj = nn.Linear(d, 2 * self.d_inner + 2 * d_state + self.n_heads, bias=False)  # [z | x | B | C | dt]
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, d_conv, groups=conv_dim, padding=d_conv - 1)
        self.A_log = nn.Parameter(torch.empty(self.n_heads))
        self.D = nn.Parameter(torch.empty(self.n_heads))
        self.dt_bias = nn.Parameter(torch.empty(self.n_heads))
        self.norm_weight = nn.Parameter(torch.empty(self.d_inner))
        self.out_proj = nn.Linear(self.d_inner, d, bias=False)
        self.init_weights()
        declare_plasticity(self, fused={"in_proj.weight": {"z": self.d_inner, "x": self.d_inner, "B": d_state,
                                                           "C": d_state, "dt": self.n_heads}},
                           roles={"conv1d": "position"})

    @torch.no_grad()
    def init_weights(self) -> None:
        """Mamba-2's init: ``A ~ U[1, 16]``, ``dt ~ logU[1e-3, 1e-1]`` through ``dt_bias`` (inverse softplus),
        ``D = 1``, norm 1, the conv PyTorch's default, ``out_proj`` zero (the block starts as the identity, like the
        GPT's other blocks). ``in_proj`` keeps the GPT's Linear init."""
        self.A_log.copy_(torch.empty(self.n_heads).uniform_(1, 16).log())
        dt = torch.exp(torch.empty(self.n_heads).uniform_(math.log(1e-3), math.log(1e-1))).clamp_min(1e-4)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        self.D.fill_(1.0)
        self.norm_weight.fill_(1.0)
        self.conv1d.reset_parameters()
        nn.init.zeros_(self.out_proj.weight)

    def forward(self, u: torch.Tensor, kv_cache: KVCache | None = None) -> torch.Tensor:
        batch, T, _ = u.shape
        z, xBC, dt = self.in_proj(u).split([self.d_inner, self.d_inner + 2 * self.d_state, self.n_heads], -1)
        xBC = xBC.transpose(1, 2)  # (b, conv_dim, T)
        taps = self.conv1d.kernel_size[0]
        cached = kv_cache.states[self.layer_idx] if kv_cache is not None else None
        if cached is not None:  # the conv reads the last taps - 1 inputs of the previous call
            xBC = torch.cat([cached["conv"], xBC], -1)
        conv_input = xBC
        # padding taps - 1 on both sides: output t of the first L sees inputs t - taps + 1 .. t (causal)
        xBC = self.conv1d(xBC)[..., :conv_input.shape[-1]]
        xBC = F.silu(xBC[..., -T:]).transpose(1, 2)  # (b, T, conv_dim)
        x, B, C = xBC.split([self.d_inner, self.d_state, self.d_state], -1)
        x = x.view(batch, T, self.n_heads, self.head_dim)  # (b, T, h, P)
        dt = F.softplus(dt + self.dt_bias)  # (b, T, h)
        A = -torch.exp(self.A_log.float())
        y, state = selective_scan(x, dt, A, B, C, None if cached is None else cached["ssm"])
        y = y + self.D[:, None] * x
        if kv_cache is not None:
            padded = F.pad(conv_input, (max(0, taps - 1 - conv_input.shape[-1]), 0))
            kv_cache.states[self.layer_idx] = {"conv": padded[..., -(taps - 1):], "ssm": state}
        y = y.reshape(batch, T, self.d_inner) * F.silu(z)
        return self.out_proj(F.rms_norm(y, (self.d_inner,)) * self.norm_weight)
