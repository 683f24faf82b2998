"""A nanochat-style GPT whose attention, MLP and positional blocks come from registries.

Data flow: token embedding → RMSNorm → n_layer × [x + attn(norm x); x + mlp(norm x, attn_out)]
→ RMSNorm → lm_head → logit soft-cap. No biases, norms without weights, untied head. ``attn`` is the
layer's sequence mixer: an attention block, or a state-space block (``mamba2``) per ``layer_pattern``.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .blocks import KVCache, rms_norm
from ..arguments import refuse_unknown_fields
from ..errors import ConfigError
from .registry import ATTENTIONS, MLPS, POSITIONS


@refuse_unknown_fields
@dataclass
class GPTConfig:
    vocab_size: int = 264  # 256 bytes + special tokens, padded to a multiple of 8
    sequence_len: int = 256  # longest training context; generation may go beyond it
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int = 4  # < n_head gives grouped-query attention
    n_embd: int = 128
    mlp: str = "relu2"  # key of MLPS: relu2 | swiglu | geglu | ...
    attention: str = "standard"  # key of ATTENTIONS
    position: str = "rope"  # key of POSITIONS: rope | none | ...
    mlp_options: dict[str, Any] = field(default_factory=dict)  # keyword arguments of the MLP block
    attention_options: dict[str, Any] = field(default_factory=dict)
    position_options: dict[str, Any] = field(default_factory=dict)
    layer_pattern: list[str] | None = None  # mixers repeated over the layers, e.g. [attn, mamba2]; attn = `attention`
    ssm_options: dict[str, Any] = field(default_factory=dict)  # keyword arguments of mamba2 blocks from layer_pattern
    logit_softcap: float = 15.0  # logits = c·tanh(logits/c); 0 disables
    compile: bool = False  # GPTLightningModule runs training steps through torch.compile (not the architecture)

    def __post_init__(self):
        for name in ("vocab_size", "sequence_len", "n_layer", "n_head", "n_kv_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"model.{name} must be a positive integer, got {value!r}")
        if not isinstance(self.compile, bool):
            raise ConfigError(f"model.compile must be true or false, got {self.compile!r}")
        if self.n_embd % self.n_head:
            raise ConfigError(f"model.n_embd={self.n_embd} must be divisible by model.n_head={self.n_head}")
        if self.n_head % self.n_kv_head:
            raise ConfigError(f"model.n_head={self.n_head} must be a multiple of model.n_kv_head={self.n_kv_head}")
        MLPS.get(self.mlp), ATTENTIONS.get(self.attention), POSITIONS.get(self.position)  # validate names
        if self.layer_pattern is not None:
            if isinstance(self.layer_pattern, str) or not list(self.layer_pattern):
                raise ConfigError(f"model.layer_pattern={self.layer_pattern!r} must be a list of mixers such as "
                                  "[attn, mamba2]")
            self.layer_pattern = [str(name) for name in self.layer_pattern]
            for name in self.layer_pattern:
                if name != "attn":
                    ATTENTIONS.get(name)
            first = ATTENTIONS.get(self.mixer(0)[0])
            if self.position_options.get("shared") and not getattr(first, "uses_position", True):
                raise ConfigError("model.position_options.shared=true shares layer 0's positional block, and layer 0 "
                                  f"is {self.mixer(0)[0]!r}, which has none: start model.layer_pattern with attn")
        # Hydra hands over DictConfigs; keep plain dicts so the config pickles into checkpoints.
        self.mlp_options, self.attention_options, self.position_options, self.ssm_options = (
            dict(self.mlp_options), dict(self.attention_options), dict(self.position_options), dict(self.ssm_options))

    def mixer(self, layer_idx: int) -> tuple[str, dict[str, Any]]:
        """The sequence mixer of layer ``layer_idx`` and its options: ``attention`` everywhere, or the
        ``layer_pattern`` entry (``attn``: ``attention`` with ``attention_options``; another name: that block with
        ``ssm_options``)."""
        name = "attn" if self.layer_pattern is None else self.layer_pattern[layer_idx % len(self.layer_pattern)]
        if name == "attn" or name == self.attention:
            return self.attention, self.attention_options
        return name, self.ssm_options

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _build(registry, name: str, options: dict, *args):
    try:
        return registry.get(name)(*args, **options)
    except TypeError as err:  # unknown option: name the config field instead of a bare TypeError
        raise ConfigError(f"{registry.kind}={name!r}: bad options {options}: {err}") from err


class Block(nn.Module):
    def __init__(self, config: GPTConfig, layer_idx: int):
        super().__init__()
        name, options = config.mixer(layer_idx)
        # a state-space mixer is causal and position-aware by itself: no positional block (no unused parameters)
        uses_position = getattr(ATTENTIONS.get(name), "uses_position", True)
        position = _build(POSITIONS, config.position if uses_position else "none",
                          config.position_options if uses_position else {}, config, layer_idx)
        self.attn = _build(ATTENTIONS, name, options, config, layer_idx, position)
        self.mlp = _build(MLPS, config.mlp, config.mlp_options, config, layer_idx)

    def forward(self, x: torch.Tensor, kv_cache: KVCache | None = None) -> torch.Tensor:
        attn_out = self.attn(rms_norm(x), kv_cache)
        x = x + attn_out
        return x + self.mlp(rms_norm(x), attn_out=attn_out)


class GPT(nn.Module):
    """Decoder-only transformer. ``forward(idx)`` maps ``(B, T)`` token ids to ``(B, T, V)`` float logits.

    Example:
        >>> model = GPT(GPTConfig(n_layer=2, mlp="swiglu"))
        >>> logits = model(torch.randint(0, 256, (1, 16)))
        >>> out = model.generate(torch.tensor([[256]]), max_new_tokens=8)
    """

    output_head_name = "lm_head"  # target selection never touches the head by default

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layer))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """The seed's init: Linear ``N(0, std)``, ``std = min(1, √(fan_out/fan_in))/√fan_in``;
        embedding ``N(0, 1)``; output projections and head zero, so every block starts as identity."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                fan_out, fan_in = module.weight.shape
                std = min(1.0, math.sqrt(fan_out / fan_in)) / math.sqrt(fan_in)
                nn.init.normal_(module.weight, 0.0, std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        nn.init.normal_(self.wte.weight, 0.0, 1.0)
        nn.init.zeros_(self.lm_head.weight)
        for block in self.blocks:  # a state-space mixer and an MoE zero their output in their own init_weights
            for part in (block.attn, block.mlp):
                if hasattr(part, "c_proj"):
                    nn.init.zeros_(part.c_proj.weight)
        for module in self.modules():  # blocks with their own parameters (gates, bias MLPs) finish here
            if module is not self and hasattr(module, "init_weights"):
                module.init_weights()

    def forward(self, idx: torch.Tensor, kv_cache: KVCache | None = None) -> torch.Tensor:
        x = rms_norm(self.wte(idx))  # (B, T, d)
        for block in self.blocks:
            x = block(x, kv_cache)
        logits = self.lm_head(rms_norm(x)).float()  # (B, T, V)
        c = self.config.logit_softcap
        return c * torch.tanh(logits / c) if c > 0 else logits

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
        stop_token: int | None = None,
    ) -> torch.Tensor:
        """Sample ``max_new_tokens`` after ``idx (B, T)`` with a KV cache; ``temperature=0`` is greedy."""
        cache = KVCache(self.config.n_layer)
        logits = self(idx, cache)[:, -1]  # prefill
        out = idx
        for _ in range(max_new_tokens):
            if temperature == 0:
                nxt = logits.argmax(-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                nxt = torch.multinomial(F.softmax(logits, -1), 1, generator=generator)
            out = torch.cat([out, nxt], dim=1)
            if stop_token is not None and bool((nxt == stop_token).all()):
                break
            logits = self(nxt, cache)[:, -1]
        return out
