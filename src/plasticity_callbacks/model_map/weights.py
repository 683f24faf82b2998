"""Weight views: every weight a plasticity method may treat, seen as ``(out, in)`` matrices.

A :class:`WeightView` hides how a layer stores its weight:

* orientation: ``nn.Linear`` and conv store ``(out, in, *k)``; Hugging Face's GPT-2 ``Conv1D``
  stores ``(in, out)`` and ``ConvTranspose*`` ``(in, out/groups, *k)``, so their view swaps the first
  two dims (a view: writing it writes the parameter; a grouped transposed conv's is a copy);
* grouped convolutions (``groups > 1``, depthwise): the operator is block-diagonal over groups, so
  ``groups`` row blocks of ``(out/groups, in/groups)`` matrices, one per tap;
* fused matrices: Q/K/V of ``in_proj_weight``, ``c_attn``, ``query_key_value``, ``qkv_proj``; gate and
  up of ``gate_up_proj``; the gates of ``nn.LSTM``/``GRU``. ``blocks`` lists the row blocks (index
  sets, see :mod:`.layouts`), and FIRE treats each as its own matrix. A fused matrix whose split
  could not be read has ``split_unknown`` set (callbacks that need the split refuse it);
* factorization: under ``AdaptiveSVDSwitch(minor_training="factorize")`` the stored parameter is the frozen
  ``W_p`` and the layer computes ``W_p + BA``; :meth:`WeightView.read` returns that effective
  weight and :meth:`WeightView.write` sets it (by writing ``W_p``);
* the user's parametrization (weight norm, spectral norm, orthogonal, legacy hooks): ``through`` reads and
  writes the effective weight through it (:mod:`.parametrized`), ``param`` is its original shaped like the weight.

Roles come from the model's structure: a module's ``plasticity_role`` class attribute, a
declaration (:func:`~model_map.declare_plasticity`), attention modules
(``nn.MultiheadAttention`` and classes named ``*Attention``), MLP blocks (classes named ``*MLP``,
``*FeedForward``, ``*FFN``) and the MLP layers the neuron
adapters recognise; every weight inherits the role of its nearest declaring ancestor, else
``"other"``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.utils import parametrize

from .declaration import declarations
from .holding import is_factorization
from .parametrized import ParametrizedWeight
from .layouts import RowBlock, contiguous, declared_blocks, head_counts, suggested_declarations

CONV = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
CONV_TRANSPOSE = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
RECURRENT_GATES = {nn.LSTM: ("i", "f", "g", "o"), nn.GRU: ("r", "z", "n"), nn.RNN: ("h",)}
# Fused projections by attribute name: Q/K/V stacks and gate/up pairs (Hugging Face and common code).
QKV_NAMES = {"c_attn", "qkv", "qkv_proj", "Wqkv", "query_key_value", "in_proj", "fused_qkv"}
GATE_UP_NAMES = {"gate_up_proj"}
# Attention classes whose fused projection is known to be split contiguously [q | k | v] (the fast path;
# every other fused projection is probed, see :mod:`.probe`).
CONTIGUOUS_QKV = {"GPT2Attention", "DecisionTransformerGPT2Attention", "ImageGPTAttention"}


@dataclass(frozen=True, eq=False)
class WeightView:
    """One treatable weight. ``param`` is the stored parameter (``W_p`` when factorized)."""

    name: str  # parameter name as the model reports it, e.g. "transformer.h.0.attn.c_attn.weight"
    module: nn.Module  # the layer owning it
    param: nn.Parameter
    role: str  # attention | mlp | position | other
    kind: str  # linear | conv | matrix (a bare 2-D parameter such as in_proj_weight)
    attr: str = ""  # attribute on ``module`` ("weight", "in_proj_weight"); derived from ``name`` if empty
    transposed: bool = False  # stored (in, out, *k), as HF Conv1D and ConvTranspose
    blocks: tuple[RowBlock, ...] = field(default=())  # row blocks of the (out, in) view; () = one block
    groups: int = 1  # a grouped conv: block-diagonal over this many groups of rows
    split_unknown: str = ""  # a fused matrix whose row split is unknown: why, and what to declare
    left_alone: str = ""  # why callbacks leave it alone unless a name pattern includes it (an SSM's conv1d)
    per_matrix: tuple[RowBlock, ...] = ()  # a stack's blocks within one of its matrices (for the coverage table)
    stack: int = 0  # a stack of this many matrices (experts) along dim 0, viewed as their rows one after another
    through: ParametrizedWeight | None = None  # the user's parametrization computing the weight (None: stored)

    @property
    def attribute(self) -> str:
        return self.attr or self.name.rsplit(".", 1)[-1]

    @property
    def factorized(self) -> bool:
        return is_factorization(self.module, self.attribute)

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape in ``(out, in, *k)`` orientation."""
        return tuple(self.oriented(self.param).shape)

    def oriented(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (shaped like the stored parameter) as ``(out, in, *k)``: a view, writes go through
        (a grouped transposed conv, an ``(in, out)`` stack: a copy). A stack of ``E`` matrices is
        ``(E·out, in)``: expert ``e``'s rows follow expert ``e − 1``'s. :meth:`stored` undoes it."""
        if self.stack:
            if tensor.dim() == 2:  # stored (E·a, b), viewed (E, a, b) by the forward
                tensor = tensor.unflatten(0, (self.stack, -1))
            return (tensor.transpose(1, 2) if self.transposed else tensor).flatten(0, 1)  # (E·out, in)
        if not self.transposed:
            return tensor
        if self.groups == 1:
            return tensor.transpose(0, 1)
        # (groups·a, b, *k) <-> (groups·b, a, *k): swap within each group
        return tensor.unflatten(0, (self.groups, -1)).transpose(1, 2).flatten(0, 1)

    def stored(self, oriented: torch.Tensor) -> torch.Tensor:
        """An ``(out, in, *k)`` tensor back in the stored parameter's layout (the inverse of :meth:`oriented`)."""
        if self.stack:
            matrices = oriented.unflatten(0, (self.stack, -1))  # (E, out, in)
            matrices = matrices.transpose(1, 2) if self.transposed else matrices
            return matrices.reshape(self.param.shape) if self.param.dim() == 2 else matrices
        return self.oriented(oriented)

    def read(self) -> torch.Tensor:
        """The effective weight as ``(out, in, *k)``, detached. Stored plainly: a view of the parameter."""
        if self.through is not None:
            return self.oriented(self.through.read())
        if self.factorized:
            return self.oriented(getattr(self.module, self.attribute).detach())
        return self.oriented(self.param.detach())

    @torch.no_grad()
    def write(self, value: torch.Tensor) -> None:
        """Set the effective weight to ``value`` (``(out, in, *k)``); factorized: ``W_p = value − BA``."""
        stored = self.stored(value)
        if self.through is not None:  # weight norm, spectral norm: see ParametrizedWeight.write
            self.through.write(stored)
        elif self.factorized:
            parts = getattr(self.module.parametrizations, self.attribute)[0]
            delta = parts.delta(self.param)
            self.param.copy_(stored.to(self.param.dtype) - delta.to(self.param.dtype))
        elif stored.data_ptr() != self.param.data_ptr() or stored.stride() != self.param.stride():
            self.param.copy_(stored)

    def block_list(self) -> tuple[RowBlock, ...]:
        """The row blocks FIRE treats as separate matrices (the whole weight when not fused)."""
        return self.blocks or (RowBlock("all", range(self.shape[0])),)

    def trainable(self) -> list[nn.Parameter]:
        """The parameters an optimizer updates for this weight: the weight, the originals of a parametrization,
        or ``B, A`` when factorized."""
        if self.through is not None:
            return list(self.through.originals)
        if self.factorized:
            parts = getattr(self.module.parametrizations, self.attribute)[0]
            return [p for p in parts.parameters()]
        return [self.param]


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


def is_attention(module: nn.Module) -> bool:
    return isinstance(module, nn.MultiheadAttention) or class_name(module).endswith("Attention")


def is_mlp(module: nn.Module) -> bool:
    """An MLP block by its class name (``Phi3MLP``, ``GPTNeoXMLP``, ``BloomMLP``, ``FeedForward``, ...)."""
    return class_name(module).lower().endswith(("mlp", "feedforward", "ffn"))


def stored_param(module: nn.Module, attr: str) -> nn.Parameter | None:
    """The parameter behind ``module.<attr>``: the plain one, or ``W_p`` of a factorized weight; None for a weight
    that the user's parametrization computes (weight norm, ...: see :mod:`.holding`)."""
    if parametrize.is_parametrized(module, attr):
        return getattr(module.parametrizations, attr).original if is_factorization(module, attr) else None
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
        if role is None and is_attention(module):
            role = "attention"
        if role is None and is_mlp(module) and parent == "other":
            role = "mlp"
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


def known_blocks(model: nn.Module, module_name: str, module: nn.Module, attr: str, rows: int
                 ) -> tuple[RowBlock, ...] | None:
    """Row blocks a weight is known to have without running the model, or None when only the forward can tell.

    Declared layouts first, then structure that fixes the split: ``nn.MultiheadAttention`` Q/K/V,
    recurrent gates, GPT-2-style contiguous ``c_attn``. ``()``: not fused.
    """
    full = f"{module_name}.{attr}" if module_name else attr
    declared = declared_layout(model, full)
    if declared is not None:
        return declared_blocks(declared, rows, f"declare_plasticity(fused={{{full!r}: ...}})")
    if isinstance(module, nn.MultiheadAttention) and attr == "in_proj_weight":
        return contiguous((("q", module.embed_dim), ("k", module.embed_dim), ("v", module.embed_dim)))
    gates = next((g for cls, g in RECURRENT_GATES.items() if isinstance(module, cls)), None)
    if gates is not None and attr.startswith(("weight_ih", "weight_hh")):
        return contiguous(tuple((gate, rows // len(gates)) for gate in gates)) if len(gates) > 1 else ()
    if gates is not None or isinstance(module, nn.MultiheadAttention):
        return ()
    leaf = module_name.rsplit(".", 1)[-1]
    parent = _parent_of(model, module_name)
    if leaf == "c_attn" and class_name(parent) in CONTIGUOUS_QKV and rows % 3 == 0 \
            and not getattr(parent, "is_cross_attention", False):
        return contiguous((("q", rows // 3), ("k", rows // 3), ("v", rows // 3)))
    return None  # read from the forward: inside attention, where rows reach Q, K, V (.probe); elsewhere, its cuts


def declared_layout(model: nn.Module, full: str):
    """The ``declare_plasticity(fused=...)`` entry for parameter ``full``, or None."""
    for prefix, declaration in declarations(model):
        if full.startswith(prefix) and full[len(prefix):] in declaration.fused:
            return declaration.fused[full[len(prefix):]]
    return None


def table_blocks(module_name: str, rows: int) -> tuple[RowBlock, ...]:
    """The name table's guess for a weight whose forward could not be read: ``gate_up_proj`` halves."""
    if module_name.rsplit(".", 1)[-1] in GATE_UP_NAMES and rows % 2 == 0:
        return contiguous((("gate", rows // 2), ("up", rows // 2)))
    return ()


def named_blocks(module_name: str, blocks: tuple[RowBlock, ...]) -> tuple[RowBlock, ...]:
    """Read blocks labelled by the name table where it names them (``gate``/``up`` of a ``gate_up_proj``
    whose forward cuts it in two halves, interleaved or not), else kept as read (``part0``, ``part1``, ...)."""
    leaf = module_name.rsplit(".", 1)[-1]
    if len(blocks) == 2 and leaf in GATE_UP_NAMES:
        return tuple(RowBlock(label, b.rows) for label, b in zip(("gate", "up"), blocks))
    return blocks


def stacked_blocks(stack: int, rows: int, blocks: tuple[RowBlock, ...]) -> tuple[RowBlock, ...]:
    """Blocks of an ``(E·rows, in)`` stack view: each of ``blocks`` (of one ``rows``-row matrix) in every expert."""
    per_matrix = blocks or (RowBlock("all", range(rows)),)
    out = []
    for expert in range(stack):
        for block in per_matrix:
            label = f"expert{expert}" if not blocks else f"expert{expert}.{block.label}"
            shifted = block.rows
            if isinstance(shifted, range):
                shifted = range(shifted.start + expert * rows, shifted.stop + expert * rows, shifted.step)
            else:
                shifted = tuple(r + expert * rows for r in shifted)
            out.append(RowBlock(label, shifted))
    return tuple(out)


def in_attention(model: nn.Module, module_name: str, module: nn.Module, attr: str) -> bool:
    """A Linear/Conv1D weight directly inside an attention module (not ``nn.MultiheadAttention``): the probe
    reads which of its rows reach Q, K and V."""
    if attr != "weight" or not (isinstance(module, nn.Linear) or is_conv1d(module)) or not module_name:
        return False
    parent = _parent_of(model, module_name)
    return parent is not None and is_attention(parent) and not isinstance(parent, nn.MultiheadAttention)


def is_probe_candidate(model: nn.Module, module_name: str, module: nn.Module, attr: str) -> bool:
    """A Linear/Conv1D inside an attention module that may compute several of Q, K, V at once."""
    if attr != "weight" or not (isinstance(module, nn.Linear) or is_conv1d(module)) or not module_name:
        return False
    parent = _parent_of(model, module_name)
    if parent is None or not is_attention(parent) or isinstance(parent, nn.MultiheadAttention):
        return False
    out_features, in_features = (module.nf, module.nx) if is_conv1d(module) else module.weight.shape
    return module_name.rsplit(".", 1)[-1] in QKV_NAMES or out_features > in_features


def unknown_split(model: nn.Module, module_name: str, module: nn.Module, rows: int) -> str:
    """Why a probed fused projection has no known split, with the declarations that fit its head counts."""
    parent = _parent_of(model, module_name)
    heads, kv_heads = head_counts(parent, getattr(parent, "config", None))
    name = f"{module_name}.weight"
    options = suggested_declarations(name, rows, heads, kv_heads)
    return (f"{name} ({rows} rows) looks like a fused Q/K/V projection, but its split could not be read from the "
            f"forward; declare the one its forward uses: " + " or ".join(options))


def _parent_of(model: nn.Module, module_name: str) -> nn.Module | None:
    if not module_name:
        return None
    try:
        return model.get_submodule(module_name.rsplit(".", 1)[0]) if "." in module_name else model
    except AttributeError:
        return None
