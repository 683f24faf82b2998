"""Reciprocal MLP (seed 002): part of the hidden layer reads the attention output as well.

The hidden width ``D_ff`` splits into a standard part (``D_ff_std`` units on ``x``) and a
reciprocal part (``R_ff`` units on ``x + α·attn_out``); both feed one down projection:

    out = c_proj([w_std·g_std·act(c_fc x) | w_rec·g_rec·act(c_fc_rec (x + α·attn_out))])

Same parameters and FLOPs as a plain MLP of width ``D_ff``, plus five scalars.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import ConfigError
from .gates import accept_scalar_entries, scalar_parameter
from ..registry import MLPS
from .mlp import MLPBlock, NeuronLayout

ACTIVATIONS = {"relu2": lambda h: F.relu(h).square(), "gelu": F.gelu}


@MLPS.register("reciprocal")
class ReciprocalMLP(MLPBlock):
    """Standard hidden units on ``x``, reciprocal ones on ``x + α·attn_out``, one ``c_proj``.

    ``w_std = D_ff_std/D_ff``, ``w_rec = R_ff/D_ff`` (geometric init, seed 002); skip gates
    ``g = sigmoid(skip)`` start at 2.0 (standard, open) and −3.0 (reciprocal, nearly shut) and gate
    softly in training. ``α`` is learned; ``attn_out`` is this block's attention output (the
    residual-stream update, before the MLP's norm).

    In training the gated hidden ``[w_std·g_std·h_std | w_rec·g_rec·h_rec]`` goes to the hidden
    observer and through the ``c_proj`` module, so observers and hooks see every unit (scaled uniformly per pathway, which
    ReDo's per-layer normalized score ignores). Hard-gated inference reads slices of
    ``c_proj.weight`` directly and bypasses such hooks.

    Args:
        hidden_mult: ``D_ff = hidden_mult · n_embd``, as the relu² MLP.
        reciprocal_fraction: ``R_ff / D_ff`` (the seed's ablations use 0.375).
        activation: ``relu2`` (nanochat's) or ``gelu`` (the seed's GPT-2).
        alpha_init: initial ``α``.
        hard_gate_threshold: in eval mode, a pathway whose gate is below this is skipped
            entirely (its GEMMs are not computed); ``None`` keeps soft gating.
    """

    def __init__(self, config, layer_idx: int, hidden_mult: int = 4, reciprocal_fraction: float = 0.375,
                 activation: str = "relu2", alpha_init: float = 1.0, hard_gate_threshold: float | None = None):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ConfigError(f"mlp_options.activation={activation!r} is not one of {tuple(ACTIVATIONS)}")
        if not isinstance(hidden_mult, int) or hidden_mult <= 0:
            raise ConfigError(f"mlp_options.hidden_mult must be a positive integer, got {hidden_mult!r}")
        hidden = hidden_mult * config.n_embd
        self.rec_width = round(reciprocal_fraction * hidden)
        self.std_width = hidden - self.rec_width
        if not 0.0 < reciprocal_fraction < 1.0 or self.rec_width == 0 or self.std_width == 0:
            raise ConfigError(f"mlp_options.reciprocal_fraction must leave both parts non-empty (in (0, 1)), "
                             f"got {reciprocal_fraction} of width {hidden}")
        if hard_gate_threshold is not None and not 0.0 < hard_gate_threshold < 1.0:
            raise ConfigError(f"mlp_options.hard_gate_threshold must be in (0, 1) or null, got {hard_gate_threshold}")
        self.activation, self.alpha_init, self.hard_gate_threshold = activation, alpha_init, hard_gate_threshold
        self.c_fc = nn.Linear(config.n_embd, self.std_width, bias=False)  # standard up projection
        self.c_fc_rec = nn.Linear(config.n_embd, self.rec_width, bias=False)  # reciprocal up projection
        self.c_proj = nn.Linear(hidden, config.n_embd, bias=False)  # columns: [standard | reciprocal]
        self.w_std = scalar_parameter()
        self.w_rec = scalar_parameter()
        self.skip_std = scalar_parameter()
        self.skip_rec = scalar_parameter()
        self.alpha = scalar_parameter()
        self.register_load_state_dict_pre_hook(accept_scalar_entries)  # a 0-d entry in a state dict loads too
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        hidden = self.std_width + self.rec_width
        self.w_std.fill_(self.std_width / hidden)
        self.w_rec.fill_(self.rec_width / hidden)
        self.skip_std.fill_(2.0)
        self.skip_rec.fill_(-3.0)
        self.alpha.fill_(self.alpha_init)

    def neuron_layouts(self) -> list[NeuronLayout]:
        return [NeuronLayout(up=self.c_fc, down=self.c_proj),
                NeuronLayout(up=self.c_fc_rec, down=self.c_proj, down_offset=self.std_width)]

    def gate_values(self) -> dict[str, torch.Tensor]:
        """Detached ``(1,)`` values for logging (GateLogger); ``DTensor`` shards under FSDP2."""
        return {"gate_std": torch.sigmoid(self.skip_std).detach(), "gate_rec": torch.sigmoid(self.skip_rec).detach(),
                "w_std": self.w_std.detach(), "w_rec": self.w_rec.detach(), "alpha": self.alpha.detach()}

    def _hard_skipped(self) -> tuple[bool, bool]:
        if self.hard_gate_threshold is None or self.training:
            return False, False
        # .item() is a host sync, paid only in hard-gated inference where skipping saves GEMMs.
        return (torch.sigmoid(self.skip_std).item() < self.hard_gate_threshold,
                torch.sigmoid(self.skip_rec).item() < self.hard_gate_threshold)

    def forward(self, x: torch.Tensor, attn_out: torch.Tensor | None = None) -> torch.Tensor:
        act = ACTIVATIONS[self.activation]
        skip_std, skip_rec = self._hard_skipped()
        coef_std = self.w_std * torch.sigmoid(self.skip_std)
        coef_rec = self.w_rec * torch.sigmoid(self.skip_rec)
        s, W = self.std_width, self.c_proj.weight  # W: (d, D_ff), columns [standard | reciprocal]
        if not skip_std and not skip_rec:
            mixed = x if attn_out is None else x + self.alpha * attn_out
            hidden = torch.cat([coef_std * act(self.c_fc(x)), coef_rec * act(self.c_fc_rec(mixed))], dim=-1)
            # Through the c_proj module (not F.linear on its weight), so module hooks on the down
            # projection see every unit too.
            self.observe_hidden(hidden)
            return self.c_proj(hidden)  # (B, T, d)
        if not skip_std:  # hard-gated inference: only the surviving pathway's GEMMs run
            return F.linear(coef_std * act(self.c_fc(x)), W[:, :s])
        if not skip_rec:
            mixed = x if attn_out is None else x + self.alpha * attn_out
            return F.linear(coef_rec * act(self.c_fc_rec(mixed)), W[:, s:])
        return torch.zeros_like(x)
