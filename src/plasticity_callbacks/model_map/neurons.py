"""Neuron layouts (ReDo's hidden units): ``up`` (and ``gate``) -> activation -> ``down``.

Unit ``i`` of a layout is row ``i`` of ``up`` (and ``gate``) in ``(out, in)`` orientation and the
``group`` consecutive inputs of ``down`` starting at ``down_offset + i·group`` (``group > 1`` when
a conv output is flattened into a Linear: one unit is a channel, read over its spatial positions).
A BatchNorm between ``up`` and the activation (``norm``) belongs to the unit too.

Found, first match wins per ``up`` layer:

1. a declaration (:func:`~model_map.declare_plasticity` ``neurons=``);
2. modules with ``neuron_layouts()`` (this package's GPT MLPs);
3. adapters by structure: Llama/Mistral-style ``gate_proj, up_proj, down_proj``; ``w1, w3, w2``;
   litgpt ``fc_1, fc_2, proj`` and ``fc, proj``; GPT-2 ``c_fc, c_proj`` (HF ``Conv1D``); BERT-style
   ``intermediate.dense, output.dense``; ``fc1, fc2``; GPT-J/CodeGen ``fc_in, fc_out``;
   ``dense_h_to_4h, dense_4h_to_h``; ``nn.TransformerEncoderLayer``/``DecoderLayer`` ``linear1, linear2``;
   a fused input layer that writes two values per unit (Phi-3 ``gate_up_proj``, ModernBERT ``Wi``, or any
   child whose output is twice the next child's input), its pairing of rows read from the block's forward
   (:func:`read_unit_pairing`; Phi-3's ``[gate | up]`` halves are the fast path when the block needs more
   than ``x``);
   stacks of experts stored as 3-D parameters (transformers 5.x ``experts.gate_up_proj``/``down_proj``,
   ``(out, in)`` or ``(in, out)``, halves or interleaved): one layer per expert (:func:`expert_layers`);
4. a ``torch.fx`` trace of each traceable submodule: Linear/conv -> [BatchNorm] -> activation ->
   [dropout, pooling, flatten] -> Linear/conv where each value has exactly one user (so zeroing the
   outgoing weights removes the unit from the output: a residual ``add`` breaks the chain);
5. the same pattern among consecutive children of an ``nn.Sequential`` (models fx cannot trace).
"""
from __future__ import annotations

import operator
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .declaration import declarations
from .detached_hooks import hooks_detached
from .weights import CONV, CONV_TRANSPOSE, is_conv1d, is_layer
from .experts import ExpertMatrix, expert_layers, read_unit_pairing

_BATCHNORM = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
# Activations that act on each unit alone; softmax-like and GLU modules mix units.
_MIXING = (nn.Softmax, nn.Softmin, nn.LogSoftmax, nn.Softmax2d, nn.GLU, nn.MultiheadAttention)
ACTIVATIONS = tuple(
    c for c in vars(nn.modules.activation).values()
    if isinstance(c, type) and issubclass(c, nn.Module) and c.__module__ == nn.modules.activation.__name__
    and not issubclass(c, _MIXING)
)
PASS_THROUGH = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout,
                nn.Identity)
_POOL = (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d, nn.AdaptiveAvgPool1d,
         nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d, nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d)
_ACTIVATION_FUNCTIONS = {F.relu, torch.relu, F.gelu, F.silu, F.mish, F.elu, F.leaky_relu, F.selu, F.softplus,
                         torch.tanh, torch.sigmoid, F.relu6, F.hardswish, F.hardtanh, torch.square}
_ACTIVATION_METHODS = {"relu", "tanh", "sigmoid", "square"}
_UNITWISE_FUNCTIONS = {F.dropout, F.max_pool1d, F.max_pool2d, F.avg_pool1d, F.avg_pool2d, F.adaptive_avg_pool1d,
                       F.adaptive_avg_pool2d, F.adaptive_max_pool2d}
_FLATTEN_FUNCTIONS = {torch.flatten}
_FLATTEN_METHODS = {"flatten", "view", "reshape"}


@dataclass
class HiddenUnits:
    """Hidden units between ``up`` (and ``gate``) and ``down``, as the model map resolved them (from a
    declaration, a module's own ``NeuronLayout``, an adapter or a trace); their value is ``down``'s input."""

    name: str
    up: nn.Module
    down: nn.Module
    gate: nn.Module | None = None
    down_offset: int = 0  # this layer's units start at down's input offset (several ups may share a down)
    group: int = 1  # down inputs per unit (a conv channel flattened over its positions)
    norm: nn.Module | None = None  # a BatchNorm between up and the activation
    fused_gate: bool = False  # up writes two values per unit: rows i and width + i (Phi-3 [gate | up])
    interleaved: bool = False  # with fused_gate: rows 2i and 2i + 1 instead (GPT-OSS experts)
    experts: nn.Module | None = None  # the module holding a stack of experts (up and down are ExpertMatrix)

    @property
    def width(self) -> int:
        return out_features(self.up) // (2 if self.fused_gate else 1)

    def incoming_rows(self, units: torch.Tensor) -> torch.Tensor:
        """Indices of ``up``'s output rows (``(out, in)`` orientation) that belong to ``units`` (indices)."""
        if not self.fused_gate:
            return units
        if self.interleaved:
            return torch.stack([2 * units, 2 * units + 1], 1).flatten()
        return torch.cat([units, units + self.width])

    def incoming_mask(self, units: torch.Tensor) -> torch.Tensor:
        """A mask over units as a mask over ``up``'s rows (a fused layer: the unit's two rows)."""
        if not self.fused_gate:
            return units
        return units.repeat_interleave(2) if self.interleaved else units.repeat(2)

    def unit_activity(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        """``down``'s input ``x`` as ``(tensor, unit_dim)`` holding exactly this layer's units."""
        if isinstance(self.down, (*CONV, *CONV_TRANSPOSE)):
            unit = x.dim() - (self.down.weight.dim() - 1)  # the channel axis
        else:
            unit = x.dim() - 1
            if self.group > 1:  # (B, C·positions) -> (B, C, positions)
                x, unit = x.unflatten(-1, (-1, self.group)), x.dim() - 1
        if x.shape[unit] != self.width:
            x = x.narrow(unit, self.down_offset, self.width)
        return x, unit


def stores_in_out(layer) -> bool:
    """The layer's weight is stored ``(in, out, ...)``: HF ``Conv1D``, a transposed conv, an expert stored
    transposed. Its units' rows are then along dim 1 and its inputs along dim 0."""
    return is_conv1d(layer) or getattr(layer, "transposed", False) is True


def out_features(layer) -> int:
    return layer.weight.shape[1] if stores_in_out(layer) else layer.weight.shape[0]


def in_features(layer) -> int:
    return layer.weight.shape[0] if stores_in_out(layer) else layer.weight.shape[1]


def is_unit_layer(module) -> bool:
    """A layer whose units ReDo can recycle: Linear, conv, transposed conv, HF Conv1D, one expert's matrix."""
    return is_layer(module) or isinstance(module, (*CONV_TRANSPOSE, ExpertMatrix))


def check_layer(layer: HiddenUnits) -> HiddenUnits:
    """Raise a clear ValueError when ``up``/``gate``/``down`` do not fit together."""
    for role, module in (("up", layer.up), ("down", layer.down), ("gate", layer.gate)):
        if module is not None and not is_unit_layer(module):
            raise ValueError(f"ReDo layer {layer.name!r}: {role} is a {type(module).__name__}, "
                             "not an nn.Linear, conv, transposed conv or Conv1D")
    reads, writes = in_features(layer.down), layer.width
    fits = layer.down_offset + writes * layer.group <= reads
    if getattr(layer.down, "groups", 1) != 1 or not fits:
        raise ValueError(f"ReDo layer {layer.name!r}: down reads {reads} inputs (groups="
                         f"{getattr(layer.down, 'groups', 1)}, offset={layer.down_offset}), up writes {writes} units "
                         f"of {layer.group} inputs each")
    if layer.gate is not None and out_features(layer.gate) != writes:
        raise ValueError(f"ReDo layer {layer.name!r}: gate writes {out_features(layer.gate)} units, up {writes}")
    return layer


def declared_layers(model: nn.Module) -> list[HiddenUnits]:
    layers = []
    for prefix, declaration in declarations(model):
        for name, (incoming, down) in declaration.neurons.items():
            modules = [model.get_submodule(prefix + n) for n in (*incoming, down)]
            gate, up = (modules[0], modules[1]) if len(incoming) == 2 else (None, modules[0])
            layers.append(check_layer(HiddenUnits(prefix + name, up, modules[-1], gate)))
    return layers


def layout_layers(model: nn.Module) -> list[HiddenUnits]:
    """Layers of modules that describe themselves with ``neuron_layouts()``."""
    layers = []
    for name, module in model.named_modules():
        layouts = getattr(module, "neuron_layouts", None)
        if not callable(layouts):
            continue
        found = list(layouts())
        for i, layout in enumerate(found):  # by attribute: the layout tuple may grow fields
            label = name if len(found) == 1 else f"{name}.{i}" if name else str(i)
            layers.append(check_layer(HiddenUnits(label, layout.up, layout.down, layout.gate,
                                                  getattr(layout, "down_offset", 0))))
    return layers


def _child(module: nn.Module, path: str) -> nn.Module | None:
    try:
        found = module.get_submodule(path)
    except AttributeError:
        return None
    return found if is_layer(found) else None


# (gate, up, down) attribute paths of MLP blocks in common model code; gate may be None.
_ADAPTERS = (
    ("gate_proj", "up_proj", "down_proj"),  # Llama, Mistral, Qwen, Gemma
    ("w1", "w3", "w2"),  # Meta's Llama reference, Mixtral experts
    ("fc_1", "fc_2", "proj"),  # litgpt LLaMAMLP / GemmaMLP: proj(act(fc_1 x) * fc_2 x)
    (None, "c_fc", "c_proj"),  # GPT-2 (HF Conv1D), nanoGPT
    (None, "intermediate.dense", "output.dense"),  # BERT, RoBERTa (on the layer module)
    (None, "fc1", "fc2"),  # OPT, ViT, CLIP, Phi
    (None, "fc_in", "fc_out"),  # GPT-J, CodeGen
    (None, "fc", "proj"),  # litgpt GptNeoxMLP
    (None, "dense_h_to_4h", "dense_4h_to_h"),  # GPT-NeoX, Falcon, Bloom
    (None, "linear1", "linear2"),  # nn.TransformerEncoderLayer / DecoderLayer
)
# Fused input layers whose forward is known to split the output in contiguous halves, one value of each unit
# in each (the fast path when the block cannot be run on ``x`` alone); any other pairing is read from the forward.
_FUSED_HALVES = {("gate_up_proj", "down_proj")}  # Phi-3


def adapter_layers(model: nn.Module) -> list[HiddenUnits]:
    """MLP blocks recognised by the attribute names of common model code (see ``_ADAPTERS``), fused input
    layers (:func:`fused_layers`) and stacks of experts (:func:`~.experts.expert_layers`)."""
    layers = []
    for name, module in model.named_modules():
        fused = fused_layers(name, module)
        if fused:
            layers += fused
            continue
        for gate_path, up_path, down_path in _ADAPTERS:
            up, down = _child(module, up_path), _child(module, down_path)
            gate = _child(module, gate_path) if gate_path else None
            if up is None or down is None or (gate_path and gate is None) or up is down:
                continue
            layer = HiddenUnits(name or type(module).__name__, up, down, gate)
            if in_features(down) == layer.width and (gate is None or out_features(gate) == layer.width):
                layers.append(check_layer(layer))
            break
    return layers + [check_layer(HiddenUnits(**layer)) for layer in expert_layers(model)]


def fused_layers(name: str, module: nn.Module) -> list[HiddenUnits]:
    """``up -> [two values per unit] -> down`` among ``module``'s direct children: ``up`` writes twice as many
    values as ``down`` reads. Which two rows make unit ``i`` is read from ``module``'s forward
    (:func:`~.experts.read_unit_pairing`: contiguous halves or interleaved pairs); a table entry
    (``_FUSED_HALVES``) is trusted when the block will not run on ``x`` alone."""
    children = [(n, c) for n, c in module.named_children() if isinstance(c, nn.Linear)]
    found = []
    for up_name, up in children:
        for down_name, down in children:
            if up is down or out_features(up) != 2 * in_features(down) or in_features(up) != out_features(down):
                continue
            pairing = read_unit_pairing(module, up, down)
            if pairing is None and (up_name, down_name) in _FUSED_HALVES:
                pairing = "halves"
            if pairing is not None:
                found.append(check_layer(HiddenUnits(name or type(module).__name__, up, down, fused_gate=True,
                                                     interleaved=pairing == "interleaved")))
    return found


def traced_layers(model: nn.Module) -> list[HiddenUnits]:
    """Chains found in a ``torch.fx`` trace of each outermost traceable submodule (see the module docstring)."""
    layers = []
    pending = [("", model)]
    while pending:
        prefix, module = pending.pop(0)
        graph = _trace(module)
        if graph is None:
            pending += [(f"{prefix}{n}.", c) for n, c in module.named_children()]
            continue
        modules = dict(module.named_modules())
        for up_name, norm_name, down_name, flattened in _chains(graph, modules):
            up, down = modules[up_name], modules[down_name]
            width = out_features(up)
            group = in_features(down) // width if flattened and isinstance(up, (*CONV, *CONV_TRANSPOSE)) else 1
            layer = HiddenUnits(prefix + up_name, up, down, norm=modules.get(norm_name) if norm_name else None,
                                group=group)
            if getattr(down, "groups", 1) != 1:
                _warn_grouped(prefix + up_name, prefix + down_name, down)
            elif in_features(down) == width * group:
                layers.append(layer)
    return layers


def _trace(module: nn.Module):
    if sum(is_layer(m) for m in module.modules()) < 2 or hasattr(module, "config"):  # HF models use adapters
        return None
    # Tracing runs the forward's Python code on proxies; whatever it assigns to a module (a cache, a
    # counter) is put back afterwards, so a failed or successful trace leaves the model as it was.
    saved = [(m, dict(vars(m)), {k: dict(vars(m)[k]) for k in ("_parameters", "_buffers", "_modules")})
             for m in module.modules()]
    try:
        with warnings.catch_warnings(), hooks_detached(module):  # a hook would see proxies, and its effect be traced
            warnings.simplefilter("ignore")
            return torch.fx.Tracer().trace(module)
    except Exception:  # noqa: BLE001 - any untraceable forward just means "look at the children"
        return None
    finally:
        for m, attributes, registries in saved:
            vars(m).clear()
            vars(m).update(attributes)
            for key, entries in registries.items():
                vars(m)[key].clear()
                vars(m)[key].update(entries)


def _chains(graph, modules):
    def target(node):
        return modules.get(node.target) if node.op == "call_module" else None

    def single_user(node):
        users = list(node.users)
        return users[0] if len(users) == 1 else None

    for node in graph.nodes:
        up = target(node)
        if not (isinstance(up, (nn.Linear, *CONV, *CONV_TRANSPOSE)) or (up is not None and is_conv1d(up))):
            continue
        if isinstance(up, CONV_TRANSPOSE) and up.groups != 1:
            _warn_grouped_up(node.target, up)
            continue
        current, norm_name, activated, flattened = single_user(node), None, False, False
        if current is not None and isinstance(target(current), _BATCHNORM):
            norm_name, current = current.target, single_user(current)
        while current is not None:
            module = target(current)
            if module is not None and (is_layer(module) or isinstance(module, CONV_TRANSPOSE)):
                break
            if isinstance(module, ACTIVATIONS) or _is_call(current, _ACTIVATION_FUNCTIONS, _ACTIVATION_METHODS):
                activated = True
            elif isinstance(module, nn.Flatten) or _is_call(current, _FLATTEN_FUNCTIONS, _FLATTEN_METHODS):
                flattened = True
            elif not (isinstance(module, (*PASS_THROUGH, *_POOL)) or _is_call(current, _UNITWISE_FUNCTIONS, set())
                      or _is_square(current)):
                current = None
                break
            current = single_user(current)
        if current is not None and activated and (flattened or _same_kind(up, target(current))):
            yield node.target, norm_name, current.target, flattened


def _same_kind(up: nn.Module, down: nn.Module) -> bool:
    """``down`` reads ``up``'s units one per input: a Linear after a Linear, a conv or transposed conv of the same
    dimensionality after a conv or transposed conv."""
    spatial = (*CONV, *CONV_TRANSPOSE)
    if isinstance(up, spatial) or isinstance(down, spatial):
        return isinstance(up, spatial) and isinstance(down, spatial) and up.weight.dim() == down.weight.dim()
    return is_layer(down)


def _is_call(node, functions, methods) -> bool:
    if node.op == "call_function":
        return node.target in functions
    return node.op == "call_method" and node.target in methods


def _is_square(node) -> bool:
    """``x ** 2`` or ``x * x`` (relu² MLPs): still one value per unit."""
    if node.op != "call_function":
        return False
    if node.target is operator.pow:
        return not isinstance(node.args[0], (int, float))
    return node.target is operator.mul and len(node.args) == 2 and node.args[0] is node.args[1]


def _warn_grouped(up_name: str, down_name: str, down: nn.Module) -> None:
    kind = "a grouped transposed conv" if isinstance(down, CONV_TRANSPOSE) else "a grouped conv"
    warnings.warn(f"ReDo: the units of {up_name} are not recycled: they feed {down_name}, {kind} (groups="
                  f"{down.groups}), whose per-unit outgoing weights ReDo does not cut; FIRE, DASH, AdaptiveSVD and "
                  "ShrinkPerturb still treat both layers", stacklevel=3)


def _warn_grouped_up(up_name: str, up: nn.Module) -> None:
    warnings.warn(f"ReDo: the units of {up_name} are not recycled: it is a grouped transposed conv (groups="
                  f"{up.groups}), whose output channels are spread over its groups' weight blocks; FIRE, DASH, "
                  "AdaptiveSVD and ShrinkPerturb still treat it", stacklevel=3)


def recurrent_refusals(model: nn.Module) -> list[str]:
    """Recurrent layers, whose hidden units ReDo does not treat (a unit's output feeds back through ``weight_hh``)."""
    return [f"{name} ({type(m).__name__})" for name, m in model.named_modules() if isinstance(m, nn.RNNBase)]


def state_space_refusals(model: nn.Module) -> list[str]:
    """State-space mixers (Mamba, Mamba-2, Jamba's, this package's ``mamba2`` block: a module with its own
    ``A_log``), whose ``in_proj -> out_proj`` channels are not units ReDo can recycle: a channel also feeds the
    scan's input-dependent parameters (Mamba's ``x_proj``: dt, B, C of every channel) or a norm over all
    channels (Mamba-2's gated RMSNorm), so cutting its ``out_proj`` column does not remove it from the output."""
    return [f"{name} ({type(m).__name__})" for name, m in model.named_modules()
            if isinstance(m._parameters.get("A_log"), torch.Tensor)]


def sequential_layers(model: nn.Module) -> list[HiddenUnits]:
    """``Linear/conv -> activation(s)/dropout -> Linear/conv`` runs among an ``nn.Sequential``'s children."""
    layers = []
    for seq_name, seq in model.named_modules():
        if not isinstance(seq, nn.Sequential):
            continue
        children = list(seq.named_children())
        for i, (up_name, up) in enumerate(children):
            if not (is_layer(up) or isinstance(up, CONV_TRANSPOSE)):
                continue
            if isinstance(up, CONV_TRANSPOSE) and up.groups != 1:
                _warn_grouped_up(f"{seq_name}.{up_name}" if seq_name else up_name, up)
                continue
            j, activated, norm = i + 1, False, None
            if j < len(children) and isinstance(children[j][1], _BATCHNORM):
                norm, j = children[j][1], j + 1
            while j < len(children) and isinstance(children[j][1], (*ACTIVATIONS, *PASS_THROUGH)):
                activated |= isinstance(children[j][1], ACTIVATIONS)
                j += 1
            down = children[j][1] if activated and j < len(children) else None
            same_kind = down is not None and _same_kind(up, down)
            if same_kind and getattr(down, "groups", 1) != 1:
                _warn_grouped(f"{seq_name}.{up_name}" if seq_name else up_name, "the next conv", down)
            elif same_kind and in_features(down) == out_features(up):
                layers.append(HiddenUnits(f"{seq_name}.{up_name}" if seq_name else up_name, up, down, norm=norm))
    return layers


def find_layers(model: nn.Module) -> tuple[list[HiddenUnits], set[int]]:
    """Every neuron layer, deduplicated by ``up`` (first source wins), and the ids of the modules
    the adapters recognised as MLP layers (for the role map)."""
    chosen: list[HiddenUnits] = []
    seen: set[int] = set()
    described: set[int] = set()  # every layer of a declared/self-described/adapter layout
    mlp_modules: set[int] = set()
    for source in (declared_layers, layout_layers, adapter_layers, traced_layers, sequential_layers):
        structural = source in (traced_layers, sequential_layers)
        for layer in source(model):
            if id(layer.up) in seen or (structural and id(layer.up) in described):
                continue
            seen.add(id(layer.up))
            chosen.append(layer)
            members = {id(m) for m in (layer.up, layer.down, layer.gate) if m is not None}
            if not structural:
                described |= members
            if source in (adapter_layers, declared_layers):
                mlp_modules |= members
    return chosen, mlp_modules
