"""Selection: which weight views and neuron layers a callback treats, with its arguments checked.

Skipped by default: embeddings, the output head(s) (:func:`~.weights.output_heads`, tied or not),
biases, norms and other 1-D parameters, positional blocks and frozen weights (``requires_grad=False``; an
``include`` pattern naming one treats it). A weight a parametrization computes (weight norm, spectral norm,
orthogonal, a user's own: :mod:`.parametrized`) is selected like any other, its view reading and writing through
the parametrization; :func:`require_targets` refuses it by name for a method that cannot act through that kind.

The map of a model is read once and kept (:func:`weight_views`) until the model's structure changes: a module or a
parameter added, removed or replaced, a shape, a ``requires_grad`` flag, a parametrization, a declaration, a role.
"""
from __future__ import annotations

import fnmatch
import warnings
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from torch import nn

from ..arguments import build_options, close_matches, refuse_unknown_fields
from .declaration import ATTRIBUTE as DECLARATION
from .holding import is_frozen, parametrization
from .parametrized import parametrized_weight
from .neurons import (HiddenUnits, adapter_layers, check_layer, declared_layers, find_layers, recurrent_refusals,
                      state_space_refusals, unpaired_message, unpaired_units)
from .probe import probe_fused_layouts
from .stacks import NOT_TRACED, left_alone, read_layouts
from .weights import (CONV, CONV_TRANSPOSE, WeightView, in_attention, is_conv1d, is_probe_candidate, known_blocks,
                      module_roles, output_heads, stored_param, table_blocks, unknown_split)

SCOPES = ("all", "attention", "mlp", "head")
# model -> (structure, weak references to the objects whose ids it names, output heads, {include_conv: views})
_MAPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def weight_views(model: nn.Module, include_conv: bool = True) -> list[tuple[str, WeightView]]:
    """``(module_name, view)`` for every treatable weight of ``model``, head and positional blocks included.

    Read once per model structure (see the module docstring) and kept: a later call costs one walk over the
    modules. A changed model is read again, never served from the kept map.
    """
    return list(_model_map(model, include_conv)[1])


def _model_map(model: nn.Module, include_conv: bool) -> tuple[set[str], list[tuple[str, WeightView]]]:
    """``(output heads, weight views)`` of ``model``, kept while its structure is unchanged."""
    structure, objects = _structure(model)
    kept = _MAPS.get(model)
    if kept is None or kept[0] != structure or any(ref() is None for ref in kept[1]):
        try:  # weak references: the kept map keeps nothing alive, and an id it names belongs to a live object
            refs = [weakref.ref(o) for o in objects]
        except TypeError:  # an object that takes no weak reference: read every time rather than risk a stale map
            refs = None
            _MAPS.pop(model, None)
        kept = (structure, refs, output_heads(model), {})
        if refs is not None:
            _MAPS[model] = kept
    views = kept[3]
    if include_conv not in views:
        views[include_conv] = _read_weight_views(model, include_conv)
        if any(view.module is model for _, view in views[include_conv]):
            _MAPS.pop(model, None)  # a view holding the model itself would keep it alive through its own entry
    return kept[2], views[include_conv]


def _structure(model: nn.Module) -> tuple[tuple, list]:
    """What the map of ``model`` depends on, as a tuple of names, ids, types, shapes and flags, and the objects
    whose ids it holds (but the model's own, the key of the kept map)."""
    parts, objects = [], []
    for name, module in model.named_modules(remove_duplicate=False):
        params = tuple((attr, id(p), p.shape, p.requires_grad) for attr, p in module._parameters.items()
                       if p is not None)  # a legacy weight_norm / spectral_norm hook renames them (weight_g, ...)
        declared = module.__dict__.get(DECLARATION)
        parts.append((name, id(module), type(module), params, id(declared),
                      _attribute(module, "plasticity_role"), _attribute(module, "output_head_name")))
        # no weak reference to a parameter: torch.utils.swap_tensors (model.to() under FSDP2, swap-on-conversion)
        # refuses a tensor that has one. A parameter's id cannot be reused while the kept views hold it.
        objects += [o for o in (module, declared) if o is not None and o is not model]
    example = getattr(model, "example_input_array", None)  # a forward that could not run may run with it
    return (*parts, id(example)), objects + ([example] if example is not None else [])


def _attribute(module: nn.Module, name: str):
    """``getattr(module, name, None)`` without ``nn.Module.__getattr__``'s search of parameters and submodules."""
    return module.__dict__.get(name, getattr(type(module), name, None))


def _read_weight_views(model: nn.Module, include_conv: bool) -> list[tuple[str, WeightView]]:
    mlp_modules = {id(m) for layer in (*declared_layers(model), *adapter_layers(model))
                   for m in (layer.up, layer.down, layer.gate) if m is not None}
    roles = module_roles(model, dict.fromkeys(mlp_modules, "mlp"))
    seen: set[int] = set()
    found = []
    for module_name, module in model.named_modules():
        if isinstance(module, nn.Embedding):
            continue
        for attr, kind in _weight_attributes(module, include_conv):
            param, through = stored_param(module, attr), None
            if param is None and (through := parametrized_weight(module, attr)) is not None:
                param = through.stored  # weight norm's v, spectral norm's original: shaped like the weight
            if param is None or id(param) in seen or param.dim() < 2:
                continue
            seen.add(id(param))
            transposed = is_conv1d(module) or isinstance(module, CONV_TRANSPOSE)
            groups = getattr(module, "groups", 1) if kind == "conv" else 1
            rows = param.shape[1] * groups if transposed else param.shape[0]  # of the (out, in) view
            found.append((module_name, module, attr, kind, param, transposed, groups,
                          known_blocks(model, module_name, module, attr, rows), rows, through))
    attention = {n: m for n, m, attr, *_, blocks, _, _ in found
                 if blocks is None and in_attention(model, n, m, attr)}
    probed = probe_fused_layouts(model, attention)
    layouts = read_layouts(model, seen)
    views = []
    for module_name, module, attr, kind, param, transposed, groups, blocks, rows, through in found:
        unknown = ""
        name = f"{module_name}.{attr}" if module_name else attr
        if blocks is None and module_name in attention:
            blocks = probed.get(module_name)
            if blocks is None:  # the probe could not tell: the trace of the same forward decides (or refuses)
                blocks, unknown = layouts.layer_split(name, module_name, rows)
                if (unknown is None or unknown.endswith(NOT_TRACED)) and is_probe_candidate(model, module_name,
                                                                                            module, attr):
                    # the config's head layout gives a better declaration to suggest than "one matrix"
                    blocks, unknown = (), unknown_split(model, module_name, module, rows)
            blocks, unknown = blocks or (), unknown or ""
        elif blocks is None:  # the forward's own cut of this output (or a refusal), else the name table's guess
            blocks, unknown = layouts.layer_split(name, module_name, rows, conv=kind == "conv")
            blocks, unknown = (table_blocks(module_name, rows), "") if unknown is None else (blocks, unknown)
        views.append((module_name, WeightView(name, module, param, roles[module_name], kind, attr,
                                              transposed=transposed, blocks=blocks, groups=groups,
                                              split_unknown=unknown, through=through,
                                              left_alone=left_alone(model, module_name, module))))
    views += layouts.views(roles)
    return views


def _weight_attributes(module: nn.Module, include_conv: bool):
    if isinstance(module, nn.Linear) or is_conv1d(module):
        yield "weight", "linear"
    elif isinstance(module, (*CONV, *CONV_TRANSPOSE)) and include_conv:
        yield "weight", "conv"
    elif isinstance(module, nn.MultiheadAttention):
        for attr in ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight"):
            yield attr, "matrix"
    elif isinstance(module, nn.RNNBase):
        for attr, _ in module.named_parameters(recurse=False):
            if attr.startswith(("weight_ih", "weight_hh", "weight_hr")):
                yield attr, "matrix"


@refuse_unknown_fields
@dataclass(frozen=True)
class Selection:
    """Which weights a callback treats; checked here once, then passed whole to :func:`select_targets`.

    Args:
        scope: ``all`` (every role except positional), ``attention``, ``mlp``, or ``head``: only the output
            head(s) (:func:`~.weights.output_heads`, whatever ``include_head`` says).
        include: ``fnmatch`` patterns on parameter names; when given, only matching weights
            are kept (a pattern can also bring back a positional or a frozen weight).
        exclude: patterns of parameter names to drop.
        include_conv: also treat conv kernels (``dim > 2``).
        include_head: also treat the output head(s).

    Example:
        >>> selection = Selection(scope="mlp", exclude=["blocks.0.*"])
        >>> [t.name for t in select_targets(model, selection)]
        >>> Selection.build({"scope": "attention"}, "FIREReinit")   # from a config mapping
    """

    scope: str = "all"
    include: tuple[str, ...] | None = None
    exclude: tuple[str, ...] | None = None
    include_conv: bool = True
    include_head: bool = False

    def __post_init__(self) -> None:
        if self.scope not in SCOPES:
            raise ValueError(f"scope={self.scope!r} is not one of {SCOPES}")
        validate_patterns("Selection", include=self.include, exclude=self.exclude)
        for name in ("include_conv", "include_head"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Selection {name}={getattr(self, name)!r} must be true or false")
        # Lists (a config system's list type too) are kept as tuples: hashable, picklable, comparable.
        for name in ("include", "exclude"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, tuple(getattr(self, name)))

    @classmethod
    def build(cls, value: Selection | Mapping | None, owner: str) -> Selection:
        """``value`` as a Selection: a Selection is kept, a mapping of its fields becomes one, None the default."""
        return cls() if value is None else build_options(cls, value, owner, "selection")

    @property
    def treats_head(self) -> bool:
        """Whether the output head(s) are among the weights selected (``include_head`` or ``scope="head"``)."""
        return self.include_head or self.scope == "head"

    def matches(self, name: str) -> bool:
        """Whether the parameter ``name`` passes ``include`` and ``exclude`` (the name patterns only)."""
        return ((self.include is None or _matches(name, self.include))
                and (self.exclude is None or not _matches(name, self.exclude)))


def with_exclude(selection: Selection, exclude: Sequence[str] | None) -> Selection:
    """``selection`` with the ``exclude`` patterns added to its own (ReDo's and ContinualBackprop's shorthand)."""
    validate_patterns("find_neuron_layers", exclude=exclude)
    return replace(selection, exclude=(*(selection.exclude or ()), *exclude)) if exclude else selection


def select_targets(model: nn.Module, selection: Selection | Mapping | None = None) -> list[WeightView]:
    """The weight views (matrices, conv kernels, fused blocks) of ``model`` a method should treat.

    Args:
        model: any ``nn.Module``.
        selection: which weights (:class:`Selection` or a mapping of its fields); None: every treatable weight
            but the head.

    Example:
        >>> targets = select_targets(model, Selection(scope="mlp", exclude=["blocks.0.*"]))
        >>> [(t.name, t.shape, [b.label for b in t.block_list()]) for t in targets]
    """
    selection = Selection.build(selection, "select_targets")  # a mapping of its fields works too
    include, exclude = selection.include, selection.exclude
    heads, views = _model_map(model, selection.include_conv)
    targets = []
    for module_name, view in views:
        if module_name in heads and not selection.treats_head:
            continue
        if selection.scope == "head" and module_name not in heads:
            continue
        explicitly_included = include is not None and _matches(view.name, include)
        if include is not None and not explicitly_included:
            continue
        if is_frozen(view.module, view.attribute) and not explicitly_included:
            continue  # the user froze it (requires_grad=False): an include pattern naming it treats it
        if (view.role == "position" or view.left_alone) and not explicitly_included:
            continue
        if selection.scope not in ("all", "head") and view.role != selection.scope:
            continue
        if exclude is not None and _matches(view.name, exclude):
            continue
        targets.append(view)
    return targets


def find_neuron_layers(model: nn.Module, layer_map: Mapping | None = None, exclude: Sequence[str] | None = None,
                       selection: Selection | Mapping | None = None, owner: str = "ReDoMonitor") -> list[HiddenUnits]:
    """The layers of neurons ReDo and ContinualBackprop watch in ``model`` (see :mod:`.neurons` for how they are
    found); what the forward shows as hidden units but cannot be paired is named in one warning, with the
    ``layer_map`` that declares it.

    Args:
        model: any ``nn.Module``.
        layer_map: ``{name: (up | [gate, up], down)}`` by module names, used as given (the explicit declaration).
        exclude: ``fnmatch`` patterns on parameter names whose layers are left out (added to ``selection``'s).
        selection: which layers (:class:`Selection` or a mapping of its fields): a layer is watched when
            :func:`select_targets` accepts its ``up`` (and gate) weights; a stack of experts when its parameter
            names pass ``include``/``exclude`` and ``scope`` is ``all`` or ``mlp``. The output layer is never an
            ``up``, whatever ``include_head`` says.
        owner: the callback named in errors (a ``layer_map`` module name the model lacks is one error naming it,
            the entry and the closest names).

    Example:
        >>> [(layer.name, layer.width, layer.gate is not None) for layer in find_neuron_layers(model)]
        >>> find_neuron_layers(model, selection=Selection(scope="mlp", exclude=["blocks.0.*"]))
        >>> find_neuron_layers(model, layer_map={"ffn": (["w_gate", "w_up"], "w_down")})
    """
    selection = with_exclude(Selection.build(selection, "find_neuron_layers"), exclude)
    exclude = selection.exclude
    heads = output_heads(model)
    names = {id(m): n for n, m in model.named_modules()}
    if layer_map:
        layers = []
        for name, (incoming, down_name) in layer_map.items():
            in_names = [incoming] if isinstance(incoming, str) else list(incoming)
            modules = [_submodule(model, n, name, owner) for n in [*in_names, down_name]]
            if any(n in heads for n in in_names):
                raise ValueError(f"{owner} layer_map[{name!r}]: {sorted(heads & set(in_names))} is the output "
                                 "layer, which ReDo never recycles")
            computed = [n for n, m in zip([*in_names, down_name], modules) if parametrization(m, "weight")]
            if computed:
                raise ValueError(f"{owner} layer_map[{name!r}]: the weights of {computed} are computed by a "
                                 "parametrization (weight norm, ...), which recycling would write past; remove it "
                                 "(torch.nn.utils.parametrize.remove_parametrizations) or leave the layer out")
            gate, up = (modules[0], modules[1]) if len(in_names) == 2 else (None, modules[0])
            layers.append(check_layer(HiddenUnits(name, up, modules[-1], gate)))
        return layers
    require_patterns_match(model, owner, exclude=exclude)
    recurrent = recurrent_refusals(model)
    if recurrent:
        warnings.warn(f"ReDo does not recycle the hidden units of {recurrent}: a recurrent unit's output feeds back "
                      "through weight_hh, so it has no single outgoing weight to cut (FIRE, DASH, AdaptiveSVD and "
                      "ShrinkPerturb treat their gates)", stacklevel=2)
    state_space = state_space_refusals(model)
    if state_space:
        warnings.warn(f"ReDo does not recycle the in_proj -> out_proj channels of {state_space}: a channel also "
                      "feeds the scan's input-dependent parameters or a norm over all channels, so cutting its out_proj "
                      "column does not remove it (FIRE, DASH and AdaptiveSVD treat in_proj/out_proj; the MLPs beside "
                      "them are still recycled)", stacklevel=2)
    allowed = {id(t.module) for t in select_targets(model, replace(selection, include_head=False))}
    found, _ = find_layers(model)
    held = [layer.name for layer in found if layer.experts is None
            and not all(_plain_trainable(m) for m in (layer.up, layer.gate, layer.down) if m is not None)]
    if held:
        warnings.warn(f"ReDo and ContinualBackprop leave alone the units of {held}: their weights are frozen "
                      "(requires_grad=False) or computed by a parametrization (weight norm, ...); a layer_map naming "
                      "them treats frozen ones", stacklevel=2)

    unpaired = [u for u in unpaired_units(model, found)
                if all(selection.matches(n) for n in u.names)]
    if unpaired:
        warnings.warn(unpaired_message(unpaired), stacklevel=2)

    def watched(layer: HiddenUnits) -> bool:
        if layer.experts is not None:  # stacked parameters: excluded by their names, frozen as a whole
            return (selection.scope in ("all", "mlp") and all(selection.matches(m.name) for m in (layer.up, layer.down))
                    and all(m.stack.requires_grad for m in (layer.up, layer.down)))
        return (id(layer.up) in allowed and (layer.gate is None or id(layer.gate) in allowed)
                and names.get(id(layer.up)) not in heads
                and all(_plain_trainable(m) for m in (layer.up, layer.gate, layer.down) if m is not None))

    return [layer for layer in found if watched(layer)]


def _plain_trainable(layer: nn.Module) -> bool:
    """Recycling writes into ``layer.weight``'s rows or columns: it must train and be stored as it is used."""
    return not is_frozen(layer, "weight") and not parametrization(layer, "weight")


def _submodule(model: nn.Module, path: str, entry: str, owner: str) -> nn.Module:
    try:
        return model.get_submodule(path)
    except AttributeError:
        names = [n for n, _ in model.named_modules() if n]
        raise ValueError(f"{owner} layer_map[{entry!r}]: the model has no module {path!r}"
                         f"{close_matches(path, names)}; name modules as model.named_modules() lists them, e.g. "
                         f"{names[:4]}") from None


def check_layer_map(layer_map, owner: str) -> dict | None:
    """``layer_map`` (``{name: (up | [gate, up], down)}`` by module names; any Mapping / Sequence types) as a plain
    dict, or None; another shape is one error naming ``owner`` and the entry. Whether the names exist is checked
    at setup, against the model (:func:`find_neuron_layers`).

    Example:
        >>> check_layer_map({"ffn": (["w_gate", "w_up"], "w_down")}, "ReDoMonitor")
        {'ffn': (['w_gate', 'w_up'], 'w_down')}
    """
    if layer_map is None:
        return None
    shape = "{name: (up_name | [gate_name, up_name], down_name)}, e.g. {'mlp0': ('fc1', 'fc2')}, or None to find them"
    if not isinstance(layer_map, Mapping) or not layer_map:
        raise ValueError(f"{owner} layer_map={layer_map!r} must be a mapping {shape}")
    clean = {}
    for name, entry in layer_map.items():
        incoming = down = None
        if not isinstance(entry, str) and isinstance(entry, Sequence) and len(entry) == 2:
            incoming, down = entry
            incoming = ([incoming] if isinstance(incoming, str) else list(incoming)
                        if isinstance(incoming, Sequence) else None)
        if not incoming or len(incoming) > 2 or not all(isinstance(n, str) and n for n in [*incoming, down]):
            raise ValueError(f"{owner} layer_map[{name!r}]={entry!r} must be (up_name | [gate_name, up_name], "
                             f"down_name): layer_map is {shape}")
        clean[str(name)] = (incoming[0] if len(incoming) == 1 else incoming, down)
    return clean


def validate_patterns(owner: str, **patterns) -> None:
    """Each keyword (``include=``, ``exclude=``) must be None or a list of ``fnmatch`` patterns; errors name ``owner``."""
    for name, value in patterns.items():
        if value is None:
            continue
        # A bare string would be iterated character by character: demand a list of patterns.
        if isinstance(value, str) or not isinstance(value, Sequence) or not all(isinstance(p, str) for p in value):
            raise ValueError(f"{owner} {name} must be a list of fnmatch patterns such as ['blocks.*'], got {value!r}")


def _matches(name: str, patterns: Iterable[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def require_patterns_match(model: nn.Module, owner: str, **patterns) -> None:
    """Each ``include``/``exclude`` pattern must match a parameter of ``model``: one that matches none is a typo
    (an ``exclude`` that leaves the layer treated, an ``include`` that drops it), so it is one error at setup
    naming ``owner``, the argument, the pattern and the closest parameter names.

    Example:
        >>> require_patterns_match(model, "L2Init", include=None, exclude=["head.wieght"])
        ValueError: L2Init exclude pattern 'head.wieght' matches no parameter of the model (did you mean 'head.weight'?) ...
    """
    names = [name for name, _ in model.named_parameters()]
    for argument, values in patterns.items():
        for pattern in values or ():
            if not _matches_any(pattern, names):
                raise ValueError(f"{owner} {argument} pattern {pattern!r} matches no parameter of the model"
                                 f"{close_matches(pattern, names)}; patterns are fnmatch patterns on parameter names, "
                                 f"e.g. {names[:3]}")


def _matches_any(pattern: str, names: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for name in names)


def refuse_parametrized(targets: Iterable[WeightView], owner: str, through: Mapping[str, str] | None = None
                        ) -> list[WeightView]:
    """``targets`` without the weights computed by a parametrization ``owner`` does not act through, each named in
    one warning with why and the fix.

    Args:
        targets: the selected views.
        owner: the method, for the message.
        through: ``{kind: why it is left alone}`` (``""``: the method acts through that kind, see
            :mod:`.parametrized`); a kind not listed (a user's own parametrization, a chain) is refused.

    Example:
        >>> refuse_parametrized(select_targets(model), "FIRE", {"weight norm": "", "orthogonal": "already an isometry"})
    """
    kept, refused = _split_parametrized(targets, owner, through or {})
    if refused:
        warnings.warn(f"{owner} leaves alone " + "; ".join(refused), stacklevel=3)
    return kept


def _split_parametrized(targets: Iterable[WeightView], owner: str, through: Mapping[str, str]
                        ) -> tuple[list[WeightView], list[str]]:
    kept, refused = [], []
    for view in targets:
        kind = view.through.kind if view.through is not None else None
        if kind is None or through.get(kind) == "":
            kept.append(view)
            continue
        why = through.get(kind) or f"{owner} does not act through a {kind} parametrization"
        refused.append(f"{view.name} ({kind}: {why}; to treat it, {view.through.removal()} first, or exclude it)")
    return kept, refused


def require_targets(targets: list[WeightView], owner: str, selection: Selection,
                    through: Mapping[str, str] | None = None) -> list[WeightView]:
    """The targets ``owner`` acts on, parametrized weights it cannot act through refused by name
    (:func:`refuse_parametrized`, ``through`` as there); raise a clear error when nothing is left (a callback
    that silently does nothing is a bug).

    Example:
        >>> targets = require_targets(select_targets(model, selection), "DASHShrink", selection)
    """
    kept, refused = _split_parametrized(targets, owner, through or {})
    if targets and not kept:
        raise ValueError(f"{owner}: every selected weight is computed by a parametrization it does not act "
                         "through: " + "; ".join(refused))
    if refused:
        warnings.warn(f"{owner} leaves alone " + "; ".join(refused), stacklevel=2)
    targets = kept
    if not targets:
        raise ValueError(
            f"{owner}: no weights selected (scope={selection.scope!r}, include={selection.include}, "
            f"exclude={selection.exclude}). "
            "Targets are Linear / conv / HF Conv1D / MultiheadAttention weights outside embeddings and the output "
            "head; check the scope (roles 'attention'/'mlp' come from attention modules, recognised MLPs, "
            "plasticity_role attributes or declare_plasticity(roles=...)) and the include/exclude patterns."
        )
    return targets


def refuse_unknown_splits(views: Iterable[WeightView], owner: str) -> None:
    """Raise, with the declarations that fit, when a method that treats each block of a fused matrix (Q, K, V,
    gate/up, ...) on its own meets one whose split is unknown or not proven by the trace."""
    views = [v for v in views if v.split_unknown]
    untraced = [v.name for v in views if v.split_unknown.endswith(NOT_TRACED)]
    unknown = [v.split_unknown for v in views if not v.split_unknown.endswith(NOT_TRACED)]
    if untraced:  # one reason for every weight of the model: said once, after their names
        unknown.append(f"{untraced}: {NOT_TRACED}")
    if unknown:
        raise ValueError(f"{owner} treats each block of a fused weight (Q, K, V, gate/up, ...) on its own and needs "
                         "their rows: " + "; ".join(unknown)
                         + " (or exclude the weight)")


def refuse_factorized(views: Iterable[WeightView], owner: str, why: str) -> None:
    """Raise when a callback that cannot act through ``W_p + BA`` meets a factorized weight."""
    factorized = [v.name for v in views if v.factorized]
    if factorized:
        raise RuntimeError(f"{owner}: {factorized} are factorized by AdaptiveSVDSwitch(minor_training='factorize') and {why}; "
                           "use AdaptiveSVDSwitch(minor_training='project') (same minor-subspace training) or exclude them")
