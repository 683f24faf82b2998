"""Weight views: every weight a plasticity method may treat, seen as ``(out, in)`` matrices.

A :class:`WeightView` hides how a layer stores its weight:

* orientation: ``nn.Linear`` and conv store ``(out, in, *k)``; Hugging Face's GPT-2 ``Conv1D``
  stores ``(in, out)``, so its view is the transpose (a view: writing it writes the parameter);
* fused matrices: ``nn.MultiheadAttention.in_proj_weight`` and GPT-2's ``c_attn`` are Q, K and V
  stacked by rows; ``gate_up_proj`` is gate and up. ``blocks`` lists the row blocks, and FIRE
  treats each as its own matrix;
* factorization: under ``AdaptiveSVDSwitch(minor_training="factorize")`` the stored parameter is the frozen
  ``W_p`` and the layer computes ``W_p + BA``; :meth:`WeightView.read` returns that effective
  weight and :meth:`WeightView.write` sets it (by writing ``W_p``).

Roles come from the model's structure: a module's ``plasticity_role`` class attribute, a
declaration (:func:`~plasticity_callbacks.core.model_map.declare_plasticity`), attention modules
(``nn.MultiheadAttention`` and classes named ``*Attention``), and the MLP layers the neuron
adapters recognise; every weight inherits the role of its nearest declaring ancestor, else
``"other"``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.utils import parametrize

from .declaration import declarations

CONV = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
# Fused projections by attribute name: Q/K/V stacks and gate/up pairs (Hugging Face and common code).
QKV_NAMES = {"c_attn", "qkv", "qkv_proj", "Wqkv", "query_key_value", "in_proj"}
GATE_UP_NAMES = {"gate_up_proj"}


@dataclass(frozen=True)
class Block:
    """Rows ``start:stop`` of a weight's ``(out, in)`` view, e.g. the K block of a fused QKV."""

    label: str
    start: int
    stop: int


@dataclass(frozen=True, eq=False)
class WeightView:
    """One treatable weight. ``param`` is the stored parameter (``W_p`` when factorized)."""

    name: str  # parameter name as the model reports it, e.g. "transformer.h.0.attn.c_attn.weight"
    module: nn.Module  # the layer owning it
    param: nn.Parameter
    role: str  # attention | mlp | position | other
    kind: str  # linear | conv | matrix (a bare 2-D parameter such as in_proj_weight)
    attr: str = ""  # attribute on ``module`` ("weight", "in_proj_weight"); derived from ``name`` if empty
    transposed: bool = False  # stored (in, out), as HF Conv1D
    blocks: tuple[Block, ...] = field(default=())  # row blocks of the (out, in) view; () = one block

    @property
    def attribute(self) -> str:
        return self.attr or self.name.rsplit(".", 1)[-1]

    @property
    def factorized(self) -> bool:
        return parametrize.is_parametrized(self.module, self.attribute)

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape in ``(out, in, *k)`` orientation."""
        return tuple(self.oriented(self.param).shape)

    def oriented(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (shaped like the stored parameter) as ``(out, in, *k)``: a view, writes go through."""
        return tensor.mT if self.transposed else tensor

    def read(self) -> torch.Tensor:
        """The effective weight as ``(out, in, *k)``, detached. Not factorized: a view of the parameter."""
        if self.factorized:
            return self.oriented(getattr(self.module, self.attribute).detach())
        return self.oriented(self.param.detach())

    @torch.no_grad()
    def write(self, value: torch.Tensor) -> None:
        """Set the effective weight to ``value`` (``(out, in, *k)``); factorized: ``W_p = value − BA``."""
        stored = value.mT if self.transposed else value
        if self.factorized:
            parts = getattr(self.module.parametrizations, self.attribute)[0]
            delta = parts.delta(self.param)
            self.param.copy_(stored.to(self.param.dtype) - delta.to(self.param.dtype))
        elif stored.data_ptr() != self.param.data_ptr() or stored.stride() != self.param.stride():
            self.param.copy_(stored)

    def block_list(self) -> tuple[Block, ...]:
        return self.blocks or (Block("all", 0, self.shape[0]),)

    def trainable(self) -> list[nn.Parameter]:
        """The parameters an optimizer updates for this weight: the weight, or ``B, A`` when factorized."""
        if self.factorized:
            parts = getattr(self.module.parametrizations, self.attribute)[0]
            return [p for p in parts.parameters()]
        return [self.param]


# What a callback acts on; selection code calls a weight view a target.
Target = WeightView


def class_name(module: nn.Module) -> str:
    """The module's own class name: FSDP2's ``fully_shard`` swaps a ``Conv1D``'s class for ``FSDPConv1D``."""
    name = type(module).__name__
    return name.removeprefix("FSDP") if name.startswith("FSDP") and hasattr(module, "reshard") else name


def is_conv1d(module: nn.Module) -> bool:
    """Hugging Face's ``transformers.pytorch_utils.Conv1D`` (a Linear stored ``(in, out)``), without importing it."""
    return class_name(module) == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx")


def is_layer(module: nn.Module) -> bool:
    """A layer whose ``weight`` maps inputs to outputs: Linear, conv or HF Conv1D."""
    return isinstance(module, (nn.Linear, *CONV)) or is_conv1d(module)


def stored_param(module: nn.Module, attr: str) -> nn.Parameter | None:
    """The parameter behind ``module.<attr>``: the plain one, or ``W_p`` under a parametrization."""
    if parametrize.is_parametrized(module, attr):
        return getattr(module.parametrizations, attr).original
    value = module._parameters.get(attr)
    return value if isinstance(value, nn.Parameter) else None


def module_roles(model: nn.Module, mlp_modules: dict[int, str] | None = None) -> dict[str, str]:
    """Role of every module name: declared, detected (attention classes, adapter MLPs) or inherited."""
    declared = {}
    for prefix, declaration in declarations(model):
        declared.update({prefix + name: role for name, role in declaration.roles.items()})
    mlp_modules = mlp_modules or {}
    roles = {"": declared.get("", getattr(model, "plasticity_role", "other"))}
    for name, module in model.named_modules():
        if not name:
            continue
        parent = roles[name.rsplit(".", 1)[0] if "." in name else ""]
        role = declared.get(name) or getattr(module, "plasticity_role", None)
        if role is None and (isinstance(module, nn.MultiheadAttention) or class_name(module).endswith("Attention")):
            role = "attention"
        if role is None and id(module) in mlp_modules and parent == "other":
            role = "mlp"
        roles[name] = role or parent
    return roles


def output_heads(model: nn.Module) -> set[str]:
    """Module names of the model's output layers.

    Declared heads (``output_head_name`` attributes, :func:`declare_plasticity` ``head=``), Hugging
    Face's ``get_output_embeddings()`` and layers whose weight *is* an embedding's (tied) come first;
    without any, Linear layers with as many outputs as the token (largest) embedding has rows (an
    untied LM head, wherever it is registered); without those, the last Linear/conv layer
    registered (the classifier of an ordinary network).
    """
    names = {id(m): n for n, m in model.named_modules()}
    heads: set[str] = set()
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        declared = getattr(module, "output_head_name", None)
        if isinstance(declared, str):
            heads.add(prefix + declared)
        getter = getattr(module, "get_output_embeddings", None)
        if callable(getter) and hasattr(module, "config"):
            try:
                out = getter()
            except (NotImplementedError, AttributeError):
                out = None
            if isinstance(out, nn.Module) and id(out) in names:
                heads.add(names[id(out)])
    for prefix, declaration in declarations(model):
        heads.update(prefix + h for h in declaration.heads)
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    embedding_weights = {id(m.weight) for m in embeddings}
    layers = [(name, module) for name, module in model.named_modules() if is_layer(module)]
    heads |= {name for name, module in layers if id(stored_param(module, "weight")) in embedding_weights}  # tied
    if heads:
        return heads
    # An untied LM head: as many outputs as the token embedding (the largest one) has rows.
    vocab = max((m.num_embeddings for m in embeddings), default=None)
    heads = {name for name, module in layers if isinstance(module, nn.Linear) and module.out_features == vocab}
    if not heads and layers:
        heads.add(layers[-1][0])  # an ordinary network's classifier
    return heads


def output_head(model: nn.Module) -> str | None:
    """One output layer's name (see :func:`output_heads`), for callers that expect a single head."""
    heads = sorted(output_heads(model))
    return heads[0] if heads else None


def fused_blocks(model: nn.Module, module_name: str, module: nn.Module, attr: str, rows: int) -> tuple[Block, ...]:
    """Row blocks of a fused matrix: declared, ``nn.MultiheadAttention`` Q/K/V, or a known fused name."""
    full = f"{module_name}.{attr}" if module_name else attr
    for prefix, declaration in declarations(model):
        if full.startswith(prefix) and full[len(prefix):] in declaration.fused:
            sizes = declaration.fused[full[len(prefix):]]
            if sum(s for _, s in sizes) != rows:
                raise ValueError(f"declare_plasticity(fused=...): blocks of {full} add up to "
                                 f"{sum(s for _, s in sizes)} rows, the matrix has {rows}")
            return _stack(sizes)
    if isinstance(module, nn.MultiheadAttention) and attr == "in_proj_weight":
        return _stack((("q", module.embed_dim), ("k", module.embed_dim), ("v", module.embed_dim)))
    leaf = module_name.rsplit(".", 1)[-1]
    if leaf in QKV_NAMES and attr == "weight":
        q, kv = _qkv_sizes(model, module_name, rows)
        return _stack((("q", q), ("k", kv), ("v", kv)))
    if leaf in GATE_UP_NAMES and attr == "weight" and rows % 2 == 0:
        return _stack((("gate", rows // 2), ("up", rows // 2)))
    return ()


def _qkv_sizes(model: nn.Module, module_name: str, rows: int) -> tuple[int, int]:
    """Q and K/V row counts of a fused projection: from the enclosing attention's head counts (GQA), else thirds."""
    parent = model.get_submodule(module_name.rsplit(".", 1)[0]) if "." in module_name else model
    config = getattr(parent, "config", None)
    heads = getattr(parent, "num_heads", None) or getattr(config, "num_attention_heads", None)
    kv_heads = getattr(parent, "num_key_value_heads", None) or getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(parent, "head_dim", None)
    if heads and kv_heads and head_dim and heads * head_dim + 2 * kv_heads * head_dim == rows:
        return heads * head_dim, kv_heads * head_dim
    if rows % 3:
        raise ValueError(f"{module_name}: a fused QKV projection of {rows} rows is not three equal blocks; "
                         "declare its split with declare_plasticity(fused={...})")
    return rows // 3, rows // 3


def _stack(sizes) -> tuple[Block, ...]:
    blocks, start = [], 0
    for label, size in sizes:
        blocks.append(Block(label, start, start + size))
        start += size
    return tuple(blocks)
