"""A mixture-of-experts MLP: a top-k router and gated experts stored as 3-D stacks, as transformers 5.x stores them.

``experts.gate_up_proj (E, 2I, d)`` holds each expert's ``[gate | up]`` rows and ``experts.down_proj (E, d, I)``
its output matrix; ``experts(hidden, top_k_index, top_k_weights)`` has Hugging Face's signature and its own
``_apply_gate``, so the model map reads these experts as it reads a Hugging Face model's: ReDo and
ContinualBackprop watch and recycle each expert's units on the tokens routed to it.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..registry import MLPS
from .mlp import MLPBlock, gated_hidden_width


class Experts(nn.Module):
    """``E`` SwiGLU MLPs in two stacks; ``forward(hidden (N, d), top_k_index (N, k), top_k_weights (N, k))``."""

    def __init__(self, n_experts: int, d: int, hidden: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(n_experts, 2 * hidden, d))  # (E, [gate | up], d)
        self.down_proj = nn.Parameter(torch.empty(n_experts, d, hidden))  # (E, d, I)

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        out = torch.zeros_like(hidden_states)
        # Every expert runs, on its routed tokens or on none: every parameter stays in the graph (DDP's rule).
        for e in range(self.gate_up_proj.shape[0]):
            token, slot = torch.where(top_k_index == e)
            h = self._apply_gate(F.linear(hidden_states[token], self.gate_up_proj[e]))  # (n_e, I)
            y = F.linear(h, self.down_proj[e]) * top_k_weights[token, slot, None]  # (n_e, d)
            out = out.index_add(0, token, y)
        return out


@MLPS.register("moe")
class MoEMLP(MLPBlock):
    """``Σ_k w_k · expert_k(x)`` over the ``top_k`` experts the router picks per token (softmax weights,
    renormalized over the picked ones). Each expert is a SwiGLU MLP of width ``gated_hidden_width / n_experts ·
    top_k``, so a token costs about what the dense SwiGLU MLP costs.

    Args:
        config: the GPT config (``n_embd``).
        layer_idx: unused.
        n_experts: ``E``.
        top_k: experts per token.
        hidden_mult, multiple_of: the dense gated width this splits (see :func:`gated_hidden_width`).

    Example:
        >>> GPT(GPTConfig(mlp="moe", mlp_options={"n_experts": 8, "top_k": 2}))
    """

    def __init__(self, config, layer_idx: int, n_experts: int = 4, top_k: int = 2, hidden_mult: int = 4,
                 multiple_of: int = 8):
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"moe: top_k={top_k} must be in [1, n_experts={n_experts}]")
        d = config.n_embd
        hidden = max(multiple_of, gated_hidden_width(d, hidden_mult, multiple_of) * top_k // n_experts)
        self.top_k = top_k
        self.router = nn.Linear(d, n_experts, bias=False)
        self.experts = Experts(n_experts, d, hidden)
        self.init_weights()

    def neuron_layouts(self) -> list:
        return []  # the model map finds each expert's units in the stacks

    @torch.no_grad()
    def init_weights(self) -> None:
        """The GPT's Linear rule per expert matrix (``N(0, min(1, √(fan_out/fan_in))/√fan_in)``), ``down_proj``
        zero so the block starts as the identity like the GPT's other MLPs."""
        _, rows, fan_in = self.experts.gate_up_proj.shape
        std = min(1.0, math.sqrt(rows / 2 / fan_in)) / math.sqrt(fan_in)
        nn.init.normal_(self.experts.gate_up_proj, 0.0, std)
        nn.init.zeros_(self.experts.down_proj)

    def forward(self, x: torch.Tensor, attn_out: torch.Tensor | None = None) -> torch.Tensor:
        B, T, d = x.shape
        flat = x.reshape(B * T, d)
        weights, index = torch.topk(self.router(flat).softmax(-1), self.top_k, dim=-1)  # (BT, k)
        weights = weights / weights.sum(-1, keepdim=True)
        return self.experts(flat, index, weights).view(B, T, d)
