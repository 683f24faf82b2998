"""MLP blocks. Each exposes its neuron layout (which projections make a hidden unit and
which one reads it) so callbacks such as ReDo and FIRE find them without name matching."""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..registry import MLPS


class NeuronLayout(NamedTuple):
    """Hidden unit i is row i of ``up`` (times row i of ``gate``, if gated) and column
    ``down_offset + i`` of ``down``.

    ``down_offset`` lets several up projections feed slices of one down projection (the
    reciprocal MLP's standard and reciprocal parts share ``c_proj``); it is 0 for plain MLPs.
    Read layouts by attribute: the tuple has grown a field and may grow again.
    """

    up: nn.Linear
    down: nn.Linear
    gate: nn.Linear | None = None
    down_offset: int = 0

    @property
    def down_columns(self) -> slice:
        """The columns of ``down.weight`` that read this layout's hidden units."""
        return slice(self.down_offset, self.down_offset + self.up.out_features)


class MLPBlock(nn.Module):
    """Base class. ``forward(x, attn_out)``: ``attn_out`` is the same block's attention
    output, which most MLPs ignore (the reciprocal MLP uses it).

    ``hidden_observer``: ``None``, or a callable that the forward hands
    ``(block, h)``, with ``h`` the hidden units exactly as they enter ``c_proj``. Monitors
    such as ReDo read neurons through it rather than through module hooks: ``torch.compile``
    does not guard on hook dictionaries, so a hook added after a graph was traced is never
    called, whereas setting this attribute fails a guard and re-traces once (and setting it
    back to ``None`` finds the first graph again).
    """

    plasticity_role = "mlp"

    def __init__(self):
        super().__init__()
        # Always an instance attribute, so a compiled graph guards on its value alone (set or None)
        # and returns to the same graph once a monitor has detached.
        self.hidden_observer = None

    def observe_hidden(self, h: torch.Tensor) -> None:
        if self.hidden_observer is not None:
            self.hidden_observer(self, h)

    def neuron_layouts(self) -> list[NeuronLayout]:
        gate = getattr(self, "c_gate", None)
        return [NeuronLayout(up=self.c_fc, down=self.c_proj, gate=gate)]


@MLPS.register("relu2")
class ReluSquaredMLP(MLPBlock):
    """``c_proj(relu(c_fc x)²)`` with hidden width ``hidden_mult · d`` (nanochat)."""

    def __init__(self, config, layer_idx: int, hidden_mult: int = 4):
        super().__init__()
        hidden = hidden_mult * config.n_embd
        self.c_fc = nn.Linear(config.n_embd, hidden, bias=False)
        self.c_proj = nn.Linear(hidden, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor, attn_out: torch.Tensor | None = None) -> torch.Tensor:
        h = F.relu(self.c_fc(x))
        h = h * h  # not square(): PowBackward is ~25% slower on CPU
        self.observe_hidden(h)
        return self.c_proj(h)


def gated_hidden_width(n_embd: int, hidden_mult: int, multiple_of: int) -> int:
    """Width of a gated MLP with the parameters of a plain one of ``hidden_mult · d``:
    three matrices instead of two, so ``2/3`` of the width, rounded up to ``multiple_of``."""
    width = int(2 * hidden_mult * n_embd / 3)
    return multiple_of * -(-width // multiple_of)


class GatedMLP(MLPBlock):
    """``c_proj(act(c_gate x) * c_fc x)`` with separate gate and value projections."""

    activation = staticmethod(F.silu)

    def __init__(self, config, layer_idx: int, hidden_mult: int = 4, multiple_of: int = 32):
        super().__init__()
        hidden = gated_hidden_width(config.n_embd, hidden_mult, multiple_of)
        self.c_fc = nn.Linear(config.n_embd, hidden, bias=False)
        self.c_gate = nn.Linear(config.n_embd, hidden, bias=False)
        self.c_proj = nn.Linear(hidden, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor, attn_out: torch.Tensor | None = None) -> torch.Tensor:
        h = self.activation(self.c_gate(x)) * self.c_fc(x)
        self.observe_hidden(h)
        return self.c_proj(h)


@MLPS.register("swiglu")
class SwiGLUMLP(GatedMLP):
    activation = staticmethod(F.silu)


@MLPS.register("geglu")
class GeGLUMLP(GatedMLP):
    activation = staticmethod(F.gelu)
