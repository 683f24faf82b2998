"""A fresh initialization of a model by its own init code, drawn without touching the model.

Which init runs, outermost first (:func:`init_sources` names it per parameter, for the coverage table):

* Hugging Face models (``PreTrainedModel``): ``initialize_weights()``, i.e. their ``_init_weights``,
  after clearing the ``_is_hf_initialized`` flags that otherwise make it skip every module;
* modules with ``init_weights()`` (this package's GPT);
* modules that initialize themselves by ``self.apply(self._init_weights)`` (nanoGPT and most GPT-2/ViT
  re-implementations): rebuilt from their ``config`` when they hold one (their constructor may rescale
  layers after the apply, as nanoGPT's ``c_proj`` is), else ``self.apply(self._init_weights)``;
* ``_reset_parameters()`` after the children's init (``nn.MultiheadAttention``'s ``in_proj_weight``,
  ``nn.Transformer``'s xavier pass over every matrix);
* every other module with ``reset_parameters()`` (PyTorch layers);
* PEFT LoRA layers, last: PEFT's own ``reset_lora_parameters`` (``lora_A`` kaiming or gaussian,
  ``lora_B`` zeros) with the model's ``init_lora_weights``; an init derived from the data or the
  base weights (PiSSA, LoftQ, ...) has no fresh draw.

Every parameter of the copy is first filled with NaN, so a parameter that no init reaches is
detected (it would otherwise come back as a silent copy of the current value). A weight computed by a
parametrization (weight norm, spectral norm, orthogonal) is drawn plain, then the parametrization is
registered again, so its ``original`` parameters come back as the parametrization makes them from a
fresh weight (as when the model was built).

Under FSDP2 (``DTensor`` parameters) a module cannot be deep-copied (its sharding state holds process
groups), so the init runs on the module itself, with every parameter swapped for a NaN-filled plain
tensor of the full shape and its buffers saved, then put back: each rank draws the whole value that one
process draws for the same seed and keeps its own rows.
"""
from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.utils import parametrize

from ..distributed.strategy import is_dtensor
from .holding import is_factorization

LORA_INITS = (True, "gaussian")  # PEFT's init_lora_weights values drawn independently of the data and base


@dataclass(frozen=True)
class _Init:
    source: str  # what the coverage table names, e.g. "GPT._init_weights"
    covers: nn.Module  # the module whose parameters it draws
    recurse: bool  # its children's parameters too
    run: Callable[[], None]


def _has(module: nn.Module, method: str) -> bool:
    # On the class: PEFT's wrappers forward unknown attributes to the model they wrap, whose init then runs
    # on the wrapper; walked down to, the wrapped model draws itself.
    return callable(getattr(type(module), method, None))


def _is_hf_model(module: nn.Module) -> bool:
    return _has(module, "initialize_weights") and _has(module, "_init_weights")


def _initializers(module: nn.Module) -> Iterator[_Init]:
    """Init steps for ``module`` and its children, children first where a parent's init must win."""
    name = type(module).__name__.removeprefix("Parametrized")  # parametrize's class for a parametrized layer
    if _is_hf_model(module):
        yield _Init(f"{name}._init_weights (Hugging Face)", module, True, lambda: _hf_initialize(module))
        return
    if _has(module, "init_weights"):
        yield _Init(f"{name}.init_weights", module, True, module.init_weights)
        return
    if _has(module, "_init_weights"):
        if getattr(module, "config", None) is not None:
            yield _Init(f"{name}(config), rebuilt", module, True, lambda: _rebuild(module))
        else:
            yield _Init(f"{name}._init_weights", module, True, lambda: _apply_own_init(module))
        return
    if _has(module, "reset_parameters"):
        yield _Init(f"{name}.reset_parameters", module, False, module.reset_parameters)
    for child in module.children():
        yield from _initializers(child)
    if _has(module, "_reset_parameters"):  # MHA's leaves out_proj.weight to its Linear
        yield _Init(f"{name}._reset_parameters", module, not isinstance(module, nn.MultiheadAttention),
                    module._reset_parameters)


def _rebuild(module: nn.Module) -> None:
    """Draw ``module`` as its constructor does: a new instance from its config, copied in by name (the
    constructor's own steps after ``self.apply(self._init_weights)`` included); falls back to the apply."""
    try:
        built = type(module)(module.config)
    except TypeError:  # a constructor that wants more than the config
        _apply_own_init(module)
        return
    drawn = dict(built.named_parameters())
    for key, param in module.named_parameters():
        if key in drawn and drawn[key].shape == param.shape:
            param.copy_(drawn[key])


def _apply_own_init(module: nn.Module) -> None:
    """``self.apply(self._init_weights)`` for ``_init_weights(module)``; a bare ``_init_weights()`` is called."""
    if len(inspect.signature(module._init_weights).parameters) == 1:
        module.apply(module._init_weights)
    else:
        module._init_weights()


def _lora_initializers(module: nn.Module, lora_inits: dict) -> Iterator[_Init]:
    """PEFT's own init for every LoRA layer in ``module``, after every other init (HF's included)."""
    for layer in module.modules():
        if not (_has(layer, "reset_lora_parameters") and isinstance(getattr(layer, "lora_A", None), nn.ModuleDict)):
            continue
        for adapter in layer.lora_A:
            init = lora_inits.get(adapter, True)
            for part in (layer.lora_A[adapter], layer.lora_B[adapter]):
                if init in LORA_INITS:
                    yield _Init(f"PEFT LoRA init (init_lora_weights={init!r})", part, True,
                                lambda layer=layer, adapter=adapter, init=init: layer.reset_lora_parameters(adapter,
                                                                                                           init))
                else:  # derived from the data or the base weights: nothing to draw afresh
                    yield _Init(f"none: PEFT init_lora_weights={init!r} is not a random draw", part, True,
                                lambda part=part: [p.fill_(float("nan")) for p in part.parameters()])


def lora_inits(model: nn.Module) -> dict:
    """``{adapter name: init_lora_weights}`` from the PEFT configs held in ``model``."""
    inits = {}
    for module in model.modules():
        configs = getattr(module, "peft_config", None)
        if isinstance(configs, dict):
            inits.update({name: getattr(c, "init_lora_weights", True) for name, c in configs.items()})
    return inits


def init_sources(model: nn.Module) -> dict[int, str]:
    """``{id(parameter): the init code a fresh draw of it runs}`` (:func:`fresh_parameters`'s order; the last
    step that draws a parameter wins). A parameter missing from it has no init code."""
    sources: dict[int, str] = {}
    units = [model] if _drawn_whole(model) else list(model.children())
    adapters = lora_inits(model)
    for unit in units:
        for step in (*_initializers(unit), *_lora_initializers(unit, adapters)):
            covered = step.covers.parameters(recurse=step.recurse)
            computed = getattr(step.covers, "parametrizations", None)  # the originals of a parametrized weight
            extra = computed.parameters() if isinstance(computed, nn.Module) and not step.recurse else ()
            for param in (*covered, *extra):
                sources[id(param)] = step.source
    return sources


def _drawn_whole(model: nn.Module) -> bool:
    """A model with its own init is drawn whole (its init may treat parts jointly: tied heads, scaled
    projections); otherwise child by child, which also skips a LightningModule's trainer references."""
    return _is_hf_model(model) or _has(model, "init_weights") or _has(model, "_init_weights")


def _hf_initialize(model: nn.Module) -> None:
    for tensor in (*model.modules(), *model.parameters(), *model.buffers()):
        if getattr(tensor, "_is_hf_initialized", False):
            tensor._is_hf_initialized = False
    model_class = _unsharded_class(type(model))
    # FSDP2's FSDP<Model> class lives outside transformers, which Hugging Face takes for custom code and then
    # skips the modules without own parameters (GPT-2's scaled c_proj init): answer for the model's own class.
    model.is_custom_code = model_class.is_custom_code
    try:
        model.initialize_weights()
    finally:
        del model.is_custom_code


def _unsharded_class(cls: type) -> type:
    """The model's own class under the ``FSDP<Model>`` class that ``fully_shard`` gives it."""
    from torch.distributed.fsdp import FSDPModule

    if not issubclass(cls, FSDPModule):
        return cls
    return next(base for base in cls.__mro__[1:] if not issubclass(base, FSDPModule))


def _plain_copy(module: nn.Module) -> tuple[nn.Module, Callable[[], None]]:
    """A deep copy without parametrizations, so inits write the real weight, and the call that registers the
    user's parametrizations again once it is drawn (a factorized weight stays plain: ``W_p`` stands in for it)."""
    # Hooks and observer slots hold training machinery (a callback that holds the trainer and its DDP wrapper,
    # which cannot be copied): the copy only runs init code, so it gets none of them.
    memo: dict[int, object] = {}
    for sub in module.modules():
        for key, value in vars(sub).items():
            if key.endswith("hooks") and isinstance(value, dict):  # _forward_pre_hooks, _backward_hooks, ...
                memo[id(value)] = type(value)()
        if getattr(sub, "hidden_observer", None) is not None:
            memo[id(sub.hidden_observer)] = None
    clone = copy.deepcopy(module, memo)
    again = []
    for sub in clone.modules():
        if parametrize.is_parametrized(sub):
            # deepcopy shares the injected class, and removing a parametrization deletes its property from
            # that class: give the copy its own class first, or the original would lose its weight.
            cls = type(sub)
            sub.__class__ = type(cls.__name__, cls.__bases__, dict(cls.__dict__))
            for attr in list(sub.parametrizations):
                mine = not is_factorization(sub, attr)
                if mine:
                    again.append((sub, attr, list(getattr(sub.parametrizations, attr))))
                parametrize.remove_parametrizations(sub, attr, leave_parametrized=mine)
                if attr not in sub._parameters:  # several originals, removed without grad: left a plain tensor
                    value = getattr(sub, attr).detach().clone()
                    delattr(sub, attr)
                    sub.register_parameter(attr, nn.Parameter(value))

    def register_again() -> None:
        for sub, attr, steps in again:
            for step in steps:
                parametrize.register_parametrization(sub, attr, step, unsafe=True)

    return clone, register_again


@contextmanager
def _drawn_in_place(module: nn.Module) -> Iterator[tuple[nn.Module, Callable[[], None]]]:
    """``module`` itself with every parameter a NaN-filled plain tensor of its full shape (tied ones stay
    tied) and its buffers saved; on exit its own parameters and buffer values come back. For modules that
    cannot be copied: FSDP2's, whose inits then see whole tensors, as on one process."""
    swapped, plain = [], {}
    for owner in module.modules():
        for name, param in list(owner.named_parameters(recurse=False)):
            if parametrize.is_parametrized(owner):
                raise NotImplementedError(f"a fresh draw of the factorized {type(owner).__name__} under FSDP2: "
                                          "factorize without sharding, or train with strategy='ddp'")
            if id(param) not in plain:
                plain[id(param)] = nn.Parameter(torch.full(param.shape, float("nan"), dtype=param.dtype,
                                                           device=param.device), requires_grad=False)
            owner._parameters[name] = plain[id(param)]  # past FSDP2's registration: no forward runs inside
            swapped.append((owner, name, param))
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    try:
        yield module, lambda: None
    finally:
        for owner, name, param in swapped:
            owner._parameters[name] = param
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)


def fresh_parameters(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """``{name: fresh value}`` for every parameter of ``model`` that its init code draws, from ``seed``.

    Names are those of ``model.named_parameters()``, except that a factorized weight appears under
    its plain name (``layer.weight``). Parameters no init reaches are absent: callers decide
    whether that is an error. Neither ``model`` nor the global RNG is touched. FSDP2: every value is
    the whole tensor one process draws (every rank draws it: peak extra memory one full copy of the
    unit drawn, the whole model when its own ``init_weights`` draws it whole); keep a rank's rows with
    :func:`~distributed.sharding.local_part`.

    Example:
        >>> fresh = fresh_parameters(model, seed=0)
        >>> missing = [n for n, _ in model.named_parameters() if n not in fresh]
    """
    devices = sorted({p.device.index for p in model.parameters() if p.is_cuda})
    fresh: dict[str, torch.Tensor] = {}
    adapters = lora_inits(model)
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        torch.manual_seed(seed)
        units = [("", model)] if _drawn_whole(model) else list(model.named_children())
        for name, child in units:
            if not any(True for _ in child.parameters()):
                continue  # metrics and other parameter-free children
            sharded = any(is_dtensor(p) for p in child.parameters())
            with (_drawn_in_place(child) if sharded else _nan_copy(child)) as (clone, register_again):
                for step in (*_initializers(clone), *_lora_initializers(clone, adapters)):
                    step.run()
                register_again()
                for key, value in clone.named_parameters():
                    if not bool(torch.isnan(value).any()):
                        fresh[f"{name}.{key}" if name else key] = value.detach()
    return fresh


@contextmanager
def _nan_copy(module: nn.Module) -> Iterator[tuple[nn.Module, Callable[[], None]]]:
    clone, register_again = _plain_copy(module)
    for p in clone.parameters():
        p.fill_(float("nan"))
    yield clone, register_again


def fresh_layer_weight(model: nn.Module, layer: nn.Module, seed: int, attr: str = "weight") -> torch.Tensor:
    """A fresh ``layer.<attr>`` (stored orientation; ``attr``: another parameter of the layer, e.g. a stack of
    experts) drawn by the init code that initializes it in ``model``.

    Inside a model with an ``_init_weights(module)`` (Hugging Face, nanoGPT-style): the innermost such model's
    ``_init_weights`` applied to a copy of the layer (Hugging Face's flags cleared). Elsewhere: the layer's own
    ``reset_parameters()``. Raises when neither draws the weight.

    Example:
        >>> new_rows = fresh_layer_weight(model, model.mlp.up_proj, seed=0)[mask]
    """
    owners = [m for m in model.modules() if _has(m, "_init_weights") and any(sub is layer for sub in m.modules())]
    param = getattr(layer, attr)
    devices = [param.device.index] if param.is_cuda else []
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        torch.manual_seed(seed)
        clone, _ = _plain_copy(layer)
        getattr(clone, attr).fill_(float("nan"))
        if owners:  # the innermost model owning the layer
            for tensor in (clone, *clone.parameters()):
                if getattr(tensor, "_is_hf_initialized", False):
                    tensor._is_hf_initialized = False
            owners[-1]._init_weights(clone)
        elif callable(getattr(clone, "reset_parameters", None)):
            clone.reset_parameters()
    if bool(torch.isnan(getattr(clone, attr)).any()):
        raise RuntimeError(f"no init code draws a fresh {attr} for a {type(layer).__name__}; give it "
                           "reset_parameters() or use another init")
    return getattr(clone, attr).detach()
