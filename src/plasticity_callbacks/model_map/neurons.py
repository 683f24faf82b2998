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
5. the same pattern among consecutive children of an ``nn.Sequential`` (models fx cannot trace);
6. the model's own forward (:mod:`.unit_flow`): ``up -> [gate] -> activation (module, ``F.*``, ``torch.square``,
   ``x * x``) -> down`` for any layer names, Hugging Face models included (Nemotron's relu² ``up_proj``/``down_proj``,
   RWKV's ``key -> relu² -> value``), conv chains whatever the forward's control flow. What it sees but cannot pair
   (a unit that also reaches a residual, experts stored in another form) is returned by :func:`unpaired_units`.
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
    for source in (declared_layers, layout_layers, adapter_layers, traced_layers, sequential_layers, _flow_found):
        structural = source in (traced_layers, sequential_layers, _flow_found)
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


def _flow_found(model: nn.Module) -> list[HiddenUnits]:
    return flow_layers(model)[0]


def unpaired_units(model: nn.Module, found: list[HiddenUnits]) -> list[Unpaired]:
    """What the forward shows as ``up -> act -> down`` but no source of :func:`find_layers` could pair, each with
    the reason (and the ``layer_map`` entry that declares it, where one can); where the forward could not be run,
    the sibling layers that fit as ``up -> down`` instead. Layers that ``found`` covers are left out."""
    from .unit_flow import read_unit_flow

    covered = {id(p) for layer in found for m in (layer.up, layer.gate) if m is not None
               for p in ([m.stack] if isinstance(m, ExpertMatrix) else [m.weight])}
    covered_modules = {id(m) for layer in found for m in (layer.up, layer.gate) if m is not None}
    flow = read_unit_flow(model)
    if flow is None:
        return structural_candidates(model, found)
    modules = {id(m.weight): m for m in model.modules() if isinstance(getattr(m, "weight", None), torch.Tensor)}
    seen = {source.param for source in flow.uses}
    unrun = [u for u in structural_candidates(model, found, "the forward the map could run does not reach it")
             if not any(p in seen for p in u.params)]  # e.g. Whisper's encoder: only the token decoder ran
    return [u for u in flow_layers(model)[1]
            if not any(p in covered or id(modules.get(p)) in covered_modules for p in u.params)] + unrun


def unpaired_message(unpaired: list[Unpaired], owner: str = "ReDo and ContinualBackprop") -> str:
    """One message naming every unpaired layer, with the ``layer_map`` that declares those a declaration fits."""
    fixes = {}
    for u in unpaired:
        if u.layer_map is not None:
            name = u.layer_map[0] if u.layer_map[0] not in fixes else u.ups[0].removesuffix(".weight")
            fixes[name] = u.layer_map[1]
    text = f"{owner} do not recycle the hidden units of " + "; ".join(u.describe() for u in unpaired)
    if fixes:
        text += (f". If these are units whose outgoing weights alone carry them, declare them: layer_map={fixes!r} "
                 "(or declare_plasticity(model, neurons=...)); else exclude them")
    undeclarable = [n for u in unpaired if u.layer_map is None for n in u.names]
    if undeclarable:
        text += f". To say that leaving them is intended: exclude={undeclarable!r}"
    return text


@dataclass(frozen=True)
class Unpaired:
    """Hidden units the model map saw but will not recycle: ``ups -> down`` and why. ``layer_map`` is the
    ``{name: (up | [gate, up], down)}`` entry that declares them (None where no declaration can: expert stacks)."""

    ups: tuple[str, ...]
    down: str
    reason: str
    layer_map: tuple[str, tuple] | None = None
    params: tuple[int, ...] = ()  # ids of the weights the ups read (to drop what another source found)
    names: tuple[str, ...] = ()  # the parameter names of the ups and down (what ``exclude`` patterns match)

    def describe(self) -> str:
        return f"{' and '.join(self.ups)} -> {self.down} ({self.reason})"


def _common_name(names: list[str]) -> str:
    parts = [n.split(".") for n in names]
    common = []
    for pieces in zip(*parts):
        if len(set(pieces)) != 1:
            break
        common.append(pieces[0])
    return ".".join(common)


def flow_layers(model: nn.Module) -> tuple[list[HiddenUnits], list[Unpaired]]:
    """Hidden units read from the forward (:mod:`.unit_flow`): the unit layers, and what it saw but cannot pair."""
    from .unit_flow import read_unit_flow

    flow = read_unit_flow(model)
    if flow is None:
        return [], []
    owners = {id(m._parameters["weight"]): (n, m) for n, m in model.named_modules()
              if isinstance(m._parameters.get("weight"), torch.Tensor) and is_unit_layer(m)}
    param_names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    norms = {id(m.weight): m for m in model.modules() if isinstance(m, _BATCHNORM) and m.weight is not None}
    groups: dict[tuple, list] = {}
    for chain in flow.chains:
        groups.setdefault(chain.sources, []).append(chain)
    counts: dict = {}
    for sources in groups:
        for source in set(sources):
            counts[source] = counts.get(source, 0) + 1
    layers, unpaired = [], []
    for sources, chains in groups.items():
        def label(source):
            name = param_names.get(source.param, "?")
            return name if source.expert is None else f"{name} (experts)"

        ups = tuple(dict.fromkeys(label(s) for s in sources))
        down = chains[0].down
        params = tuple(dict.fromkeys(s.param for s in sources))
        modules = [owners.get(s.param) for s in dict.fromkeys(sources)]
        layer_map = None
        if all(m is not None and s.expert is None for m, s in zip(modules, dict.fromkeys(sources))) \
                and owners.get(down.param) is not None and down.expert is None and len(modules) <= 2:
            names = [m[0] for m in modules]
            entry = names[0] if len(names) == 1 else names
            layer_map = (_common_name([*names, owners[down.param][0]]) or names[-1], (entry, owners[down.param][0]))
        reason = _unpairable(flow, sources, chains, counts, owners)
        if reason is None:
            layer, reason = _paired(sources, chains[0], owners, norms, layer_map)
            if layer is not None:
                layers.append(layer)
                continue
        if not any(u.ups == ups and u.down == label(down) for u in unpaired):  # one line per stack of experts
            names = tuple(dict.fromkeys(param_names.get(p, "?") for p in (*params, down.param)))
            unpaired.append(Unpaired(ups, label(down), reason, layer_map, params, names))
    return layers, unpaired


def _unpairable(flow, sources, chains, counts, owners) -> str | None:
    if any(s.expert is not None or s.param not in owners for s in (*sources, chains[0].down)):
        kind = "a stack of experts" if any(s.expert is not None for s in sources) else "a bare parameter"
        return (f"{kind}: ReDo recycles rows of nn.Linear/conv layers and the 3-D expert stacks of transformers "
                "(gate_up_proj/down_proj); exclude it or store the experts that way")
    if len({(c.down.param, c.down.expert) for c in chains}) > 1:
        return "its units reach several layers"
    if any(not torch.equal(c.rows, chains[0].rows) for c in chains):
        return "the forward pairs its units differently from one call to the next"
    escaped = [flow.escaped[s] for s in sources if s in flow.escaped]
    if escaped:
        return f"its values also leave through {escaped[0]}, so zeroing the outgoing weights does not remove a unit"
    if any(counts[s] > 1 for s in set(sources)):
        return "a layer of it also pairs with another"
    return None


def _paired(sources, chain, owners, norms, layer_map) -> tuple[HiddenUnits | None, str]:
    """The HiddenUnits that ``chain`` shows, or None and why not."""
    rows = chain.rows
    first = rows[:, 0]
    unique = torch.unique_consecutive(first)
    group = rows.shape[0] // max(len(unique), 1)
    if group < 1 or not torch.equal(rows, rows[::group].repeat_interleave(group, 0)):
        return None, "down's inputs do not hold one unit each"
    rows = rows[::group]
    width = rows.shape[0]
    units = torch.arange(width)
    up_name, up = owners[sources[-1].param]
    name = layer_map[0] if layer_map else up_name
    norm = norms.get(chain.norm) if chain.norm is not None else None
    layer = None
    if len(sources) == 1 and torch.equal(rows[:, 0], units):
        layer = HiddenUnits(name, up, owners[chain.down.param][1], group=group, norm=norm)
    elif len(sources) == 2 and sources[0] == sources[1]:
        low, high = rows.min(1).values, rows.max(1).values
        halves = torch.equal(low, units) and torch.equal(high, units + width)
        interleaved = torch.equal(low, 2 * units) and torch.equal(high, 2 * units + 1)
        if halves or interleaved:
            layer = HiddenUnits(name, up, owners[chain.down.param][1], fused_gate=True, interleaved=interleaved,
                                group=group)
    elif len(sources) == 2 and torch.equal(rows[:, 0], units) and torch.equal(rows[:, 1], units):
        gate_first = chain.activated[0] or not chain.activated[1]
        gate, up = (owners[sources[0].param][1], owners[sources[1].param][1]) if gate_first else \
            (owners[sources[1].param][1], owners[sources[0].param][1])
        layer = HiddenUnits(name, up, owners[chain.down.param][1], gate, group=group)
    if layer is None:
        return None, f"down's input j is not unit j of {len(sources)} value(s) per unit"
    if layer.width * group != in_features(layer.down):
        return None, "down reads more than these units"
    try:
        return check_layer(layer), ""
    except ValueError as err:
        return None, str(err)


def structural_candidates(model: nn.Module, found: list[HiddenUnits],
                          reason: str = "its forward could not be run to check the pairing") -> list[Unpaired]:
    """Sibling layers that could be ``up -> down`` (``up`` writes as many values as ``down`` reads), outside
    attention and the output head, that no found layer covers: named when the forward could not be run."""
    from .weights import is_attention, output_heads

    covered = {id(m) for layer in found for m in (layer.up, layer.down, layer.gate) if m is not None}
    heads = output_heads(model)
    candidates = []
    for parent_name, parent in model.named_modules():
        if is_attention(parent):
            continue
        children = [(n, c) for n, c in parent.named_children() if is_unit_layer(c) and id(c) not in covered
                    and (f"{parent_name}.{n}" if parent_name else n) not in heads]
        for i, (up_name, up) in enumerate(children):
            for down_name, down in children[i + 1:]:  # model code registers up before down
                if out_features(up) != in_features(down) or getattr(down, "groups", 1) != 1:
                    continue
                full = [f"{parent_name}.{n}" if parent_name else n for n in (up_name, down_name)]
                params = (id(up.weight), id(down.weight))
                candidates.append(Unpaired((full[0],), full[1], reason,
                                           (parent_name or up_name, (full[0], full[1])), params,
                                           (f"{full[0]}.weight", f"{full[1]}.weight")))
    return candidates


def candidates_hint(model: nn.Module) -> str:
    """What a "found no neuron layers" error names: the layers found but left out by the selection, else what the
    forward shows but cannot pair (with the ``layer_map`` that declares it), else the layers that could pair."""
    found, _ = find_layers(model)
    if found:
        return (f"the layers found ({', '.join(layer.name for layer in found[:8])}{', ...' if len(found) > 8 else ''})"
                " are all left out by the selection (scope/include/exclude), frozen, or the output head")
    unpaired = unpaired_units(model, []) or structural_candidates(model, [])
    if not unpaired:
        return ("the model has no two layers where one writes as many values as the other reads, outside attention "
                "and the output head")
    return unpaired_message(unpaired, "candidates seen but not paired:").replace(
        "candidates seen but not paired: do not recycle the hidden units of ", "candidates seen but not paired: ")
