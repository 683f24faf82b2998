"""Coverage: what a selection treats in a model, and why every other weight is left alone.

Every parameter with two or more dimensions gets one line: treated (with the row blocks, groups or
taps a callback sees) or untreated with the reason. Layers repeated per block are folded into one
line (``h.*.attn.c_attn.weight ×12``), so a whole model fits on a screen. A weight left untreated
for a reason other than the user's selection or the documented defaults (embeddings, output
head, positional blocks) is one no callback knows how to treat: :func:`log_coverage` warns about it.
"""
from __future__ import annotations

import logging
import math
import re
import warnings
import weakref

from torch import nn

from .fresh import init_sources
from .holding import describe_holding, is_frozen, lora_parts, weight_in_buffer
from .parametrized import HOW_METHODS_TREAT, parametrized_weight
from .select import Selection, find_neuron_layers, select_targets, weight_views
from .stacks import bare_fix, bare_reason
from .weights import output_heads

log = logging.getLogger("plasticity_callbacks")
_LOGGED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (owner, selection)s logged
UNKNOWN = "no callback knows this layer"
PARAMETRIZED = "parametrized"


def _selection(selection):
    """``selection`` as a :class:`~.select.Selection` (a mapping of its fields, or None: the defaults)."""
    return Selection.build(selection, "coverage_report")


def coverage(model: nn.Module, selection=None) -> list[tuple[str, tuple[int, ...], str, str]]:
    """``(name, shape, "treated" | "untreated", detail)`` for every >=2-D parameter of ``model``; the detail says
    how the user holds it (frozen, adapter, parametrized: :mod:`.holding`) and which init code draws it afresh.

    Args:
        model: any ``nn.Module``.
        selection: the callback's :class:`~.select.Selection` (or a mapping of its fields); None: the defaults.
    """
    selection = _selection(selection)
    views = {id(v.param): (module_name, v) for module_name, v in weight_views(model, include_conv=True)}
    treated = {id(v.param) for v in select_targets(model, selection)}
    heads = output_heads(model)
    modules = dict(model.named_modules())
    lora, sources = lora_parts(model), init_sources(model)
    rows = []
    for name, param in model.named_parameters():
        if param.dim() < 2:
            continue
        fresh = f"; fresh draw: {sources.get(id(param), 'none (no init code reaches it)')}"
        if id(param) in views:
            module_name, view = views[id(param)]
            shape = tuple(view.shape)
            held = describe_holding(view.module, view.attribute, lora)
            if id(param) in treated:
                detail = f"role={view.role} " + _structure(view) + (f", {held}" if held else "")
                if view.through is not None:  # selected by the weight's name, acted on (or refused) per method
                    detail += f": computes {view.name}; " + HOW_METHODS_TREAT.get(
                        view.through.kind, "every method that rewrites a weight refuses it by name")
                rows.append((name, shape, "treated", detail + fresh))
            else:
                rows.append((name, shape, "untreated", _why_not(view, module_name, heads, selection, held) + fresh))
            continue
        owner = modules.get(name.rsplit(".", 1)[0] if "." in name else "")
        reason = _unknown_reason(model, name, param, owner, modules)
        rows.append((name, tuple(param.shape), "untreated", reason + fresh))
    return rows


def _structure(view) -> str:
    taps = math.prod(view.shape[2:])
    parts = []
    if view.split_unknown:
        parts.append("fused, split unknown: FIRE refuses it, the others treat it whole")
    elif view.stack:
        matrix = (view.shape[0] // view.stack, view.shape[1])
        parts.append(f"stack of {view.stack} {matrix} matrices, one block each" + (
            " split [" + ", ".join(b.describe() for b in view.per_matrix) + "]" if view.per_matrix else ""))
    elif view.blocks:
        parts.append("blocks[" + ", ".join(b.describe() for b in view.blocks) + "]")
    if view.groups > 1:
        parts.append(f"{view.groups} groups of ({view.shape[0] // view.groups}, {view.shape[1]})")
    if taps > 1:
        parts.append(f"{taps} taps")
    if view.transposed:
        parts.append("stored transposed")
    if view.factorized:
        parts.append("factorized")
    return " ".join(parts) or "whole"


def _why_not(view, module_name: str, heads: set[str], selection, held: str) -> str:
    if is_frozen(view.module, view.attribute):
        return f"{held} (requires_grad=False: left alone; an include pattern naming it treats it)"
    if view.left_alone and selection.include is None:
        return view.left_alone
    if module_name in heads and not selection.treats_head:
        return "output head (default; include_head=True treats it)"
    if view.kind == "conv" and not selection.include_conv:
        return "conv kernel (include_conv=False)"
    if view.role == "position" and selection.include is None:
        return "positional block (default; include=[...] brings it back)"
    return f"outside the selection (scope={selection.scope!r}, include/exclude patterns)"


def _unknown_reason(model: nn.Module, name: str, param, owner: nn.Module | None,
                    modules: dict[str, nn.Module]) -> str:
    if isinstance(owner, nn.Embedding) or isinstance(owner, nn.EmbeddingBag):
        return "embedding (default)"
    computed = _computed_by(name, owner, modules)
    if computed is not None:
        path, through = computed
        shrink = ("ShrinkPerturb refuses it: the weight is kept in a buffer"
                  if weight_in_buffer(through.module, through.attr) else "ShrinkPerturb treats this original")
        how = HOW_METHODS_TREAT.get(through.kind, "every method that rewrites a weight refuses it by name")
        return f"{PARAMETRIZED} ({through.kind}): computes {path}.{through.attr}; {how}; {shrink}"
    if ".parametrizations." in name:
        return "low-rank factor of a factorized weight (AdaptiveSVDSwitch)"
    if owner is not None and "norm" in type(owner).__name__.lower():
        return "normalization (default)"
    default = bare_reason(model, name, param)
    if default is not None:
        return default
    kind = type(owner).__name__ if owner is not None else "parameter"
    return (f"{UNKNOWN} ({kind}.{name.rsplit('.', 1)[-1]}: the forward never used it as a linear map that could be "
            f"read); {bare_fix(name, param)}")


def _computed_by(name: str, owner: nn.Module | None, modules: dict[str, nn.Module]):
    """``(module path, ParametrizedWeight)`` when parameter ``name`` is an original of a user's parametrization
    (``<path>.parametrizations.<attr>.original0``, a legacy hook's ``<path>.<attr>_g``), else None."""
    if ".parametrizations." in name:
        path, rest = name.split(".parametrizations.", 1)
        module, attr = modules.get(path), rest.split(".")[0]
    else:
        path = name.rsplit(".", 1)[0] if "." in name else ""
        module, leaf = owner, name.rsplit(".", 1)[-1]
        attr = next((leaf.removesuffix(s) for s in ("_g", "_v", "_orig") if leaf.endswith(s)), None)
    through = parametrized_weight(module, attr) if module is not None and attr else None
    return (path, through) if through is not None else None


def coverage_report(model: nn.Module, selection=None) -> str:
    """The coverage table of ``model`` under ``selection`` as text, repeated layers folded into one line.

    Example:
        >>> print(coverage_report(model, Selection(scope="attention")))
    """
    return _table(coverage(model, selection))


def _table(rows) -> str:
    folded: dict[tuple, list[str]] = {}
    for name, shape, status, detail in rows:
        key = (re.sub(r"\.\d+(?=\.)", ".*", name), shape, status, detail)
        folded.setdefault(key, []).append(name)
    treated = [k for k in folded if k[2] == "treated"]
    lines = [f"treated ({sum(len(folded[k]) for k in treated)} weights):"]
    lines += [_line(k, folded[k]) for k in treated]
    untreated = [k for k in folded if k[2] != "treated"]
    lines.append(f"untreated ({sum(len(folded[k]) for k in untreated)} weights):")
    lines += [_line(k, folded[k]) for k in untreated]
    return "\n".join(lines)


def _line(key, names: list[str]) -> str:
    pattern, shape, _, detail = key
    label = names[0] if len(names) == 1 else f"{pattern} ×{len(names)}"
    return f"  {label} {shape} {detail}"


def log_coverage(model: nn.Module, selection=None, owner: str = "plasticity") -> None:
    """Log the coverage table once per model, owner and selection; warn about weights no callback can treat.

    Queries (:func:`~.select.select_targets`) never log; a callback logs its table at setup, a one-call
    operation when it acts.

    Example:
        >>> log_coverage(pl_module, Selection(scope="attention"), "FIREReinit")
    """
    key = (owner, _selection(selection))
    done = _LOGGED.setdefault(model, set())
    if key in done:
        return
    done.add(key)
    rows = coverage(model, selection)
    log.info("%s coverage:\n%s", owner, _table(rows))
    unknown = [name for name, _, status, detail in rows if detail.startswith(UNKNOWN)]
    if unknown:
        warnings.warn(f"{owner}: no plasticity callback treats {unknown} (the forward never used them as a linear "
                      "map it could read); declare them (see the coverage table) or exclude them explicitly",
                      stacklevel=3)


def describe(model: nn.Module) -> str:
    """What the callbacks see in ``model``: output heads, the coverage table and ReDo's neuron layers.

    Example:
        >>> print(describe(model))   # check the map before a long run
    """
    names = {id(m): n for n, m in model.named_modules()}
    lines = [f"output heads (never treated by default): {sorted(output_heads(model))}",
             "weights, (out, in, *k) orientation:", coverage_report(model), "neuron layers (ReDo):"]
    for layer in find_neuron_layers(model):
        gate = f"gate={names[id(layer.gate)]} " if layer.gate is not None else ""
        extra = (f" group={layer.group}" if layer.group > 1 else "") + (
            f" (fused rows, {'interleaved' if layer.interleaved else '[gate | up]'})" if layer.fused_gate else "") + (
            f" norm={names[id(layer.norm)]}" if layer.norm is not None else "")
        lines.append(f"  {layer.name}: {gate}up={names.get(id(layer.up), layer.up)} -> "
                     f"down={names.get(id(layer.down), layer.down)} "
                     f"width={layer.width}{extra}")
    return "\n".join(lines)
