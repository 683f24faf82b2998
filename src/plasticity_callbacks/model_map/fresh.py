"""A fresh initialization of a model by its own init code, drawn without touching the model.

Which init runs, outermost first:

* Hugging Face models (``PreTrainedModel``): ``initialize_weights()``, i.e. their ``_init_weights``,
  after clearing the ``_is_hf_initialized`` flags that otherwise make it skip every module;
* modules with ``init_weights()`` (this package's GPT);
* ``nn.MultiheadAttention``: ``_reset_parameters()`` (its ``in_proj_weight`` has no public init),
  after its children;
* every other module with ``reset_parameters()`` (PyTorch layers).

Every parameter of the copy is first filled with NaN, so a parameter that no init reaches is
detected (it would otherwise come back as a silent copy of the current value).

Under FSDP2 (``DTensor`` parameters) a module cannot be deep-copied (its sharding state holds process
groups), so the init runs on the module itself, with every parameter swapped for a NaN-filled plain
tensor of the full shape and its buffers saved, then put back: each rank draws the whole value that one
process draws for the same seed and keeps its own rows.
"""
from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.nn.utils import parametrize

from ..distributed.strategy import is_dtensor


def _is_hf_model(module: nn.Module) -> bool:
    return callable(getattr(module, "initialize_weights", None)) and callable(getattr(module, "_init_weights", None))


def _initializers(module: nn.Module) -> Iterator:
    """Init callables for ``module`` and its children, children first where a parent's init must win."""
    if _is_hf_model(module):
        yield lambda: _hf_initialize(module)
        return
    if callable(getattr(module, "init_weights", None)):
        yield module.init_weights
        return
    if callable(getattr(module, "reset_parameters", None)):
        yield module.reset_parameters
    for child in module.children():
        yield from _initializers(child)
    if isinstance(module, nn.MultiheadAttention):
        yield module._reset_parameters


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


def _hook_dicts(module: nn.Module) -> Iterator[dict]:
    """``module``'s own hook tables (forward, backward, state-dict hooks, and those to come)."""
    return (value for attr, value in vars(module).items() if attr.endswith("_hooks") and isinstance(value, dict))


def _copy_without_hooks(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` that runs no hook: the hooks are shared with the copy instead of copied (a
    hook may reach anything: a callback, its trainer, a process group), then dropped from it."""
    hooks = {id(hook): hook for sub in module.modules() for table in _hook_dicts(sub) for hook in table.values()}
    clone = copy.deepcopy(module, memo=hooks)
    for sub in clone.modules():
        for table in _hook_dicts(sub):
            table.clear()
    return clone


def _plain_copy(module: nn.Module) -> nn.Module:
    """A deep copy without parametrizations or hooks: inits write the real weight (``W_p`` stands in for it)."""
    clone = _copy_without_hooks(module)
    for sub in clone.modules():
        if parametrize.is_parametrized(sub):
            # deepcopy shares the injected class, and removing a parametrization deletes its property from
            # that class: give the copy its own class first, or the original would lose its weight.
            cls = type(sub)
            sub.__class__ = type(cls.__name__, cls.__bases__, dict(cls.__dict__))
            for attr in list(sub.parametrizations):
                parametrize.remove_parametrizations(sub, attr, leave_parametrized=False)
    return clone


@contextmanager
def _drawn_in_place(module: nn.Module) -> Iterator[nn.Module]:
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
        yield module
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
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        torch.manual_seed(seed)
        # A model with its own init is drawn whole (its init may treat parts jointly: tied heads, scaled
        # projections); otherwise child by child, which also skips a LightningModule's trainer references.
        whole = _is_hf_model(model) or callable(getattr(model, "init_weights", None))
        units = [("", model)] if whole else list(model.named_children())
        for name, child in units:
            if not any(True for _ in child.parameters()):
                continue  # metrics and other parameter-free children
            sharded = any(is_dtensor(p) for p in child.parameters())
            with (_drawn_in_place(child) if sharded else _nan_copy(child)) as clone:
                for initialize in _initializers(clone):
                    initialize()
                for key, value in clone.named_parameters():
                    if not bool(torch.isnan(value).any()):
                        fresh[f"{name}.{key}" if name else key] = value.detach()
    return fresh


@contextmanager
def _nan_copy(module: nn.Module) -> Iterator[nn.Module]:
    clone = _plain_copy(module)
    for p in clone.parameters():
        p.fill_(float("nan"))
    yield clone


def fresh_layer_weight(model: nn.Module, layer: nn.Module, seed: int) -> torch.Tensor:
    """A fresh ``layer.weight`` (stored orientation) drawn by the init code that initializes it in ``model``.

    Inside a Hugging Face model: that model's ``_init_weights`` applied to a copy of the layer (flags
    cleared). Elsewhere: the layer's own ``reset_parameters()``. Raises when neither draws the weight.

    Example:
        >>> new_rows = fresh_layer_weight(model, model.mlp.up_proj, seed=0)[mask]
    """
    owners = [m for m in model.modules() if _is_hf_model(m) and any(sub is layer for sub in m.modules())]
    devices = [layer.weight.device.index] if layer.weight.is_cuda else []
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        torch.manual_seed(seed)
        clone = _plain_copy(layer)
        clone.weight.fill_(float("nan"))
        if owners:  # the innermost Hugging Face model owning the layer
            for tensor in (clone, *clone.parameters()):
                if getattr(tensor, "_is_hf_initialized", False):
                    tensor._is_hf_initialized = False
            owners[-1]._init_weights(clone)
        elif callable(getattr(clone, "reset_parameters", None)):
            clone.reset_parameters()
    if bool(torch.isnan(clone.weight).any()):
        raise RuntimeError(f"no init code draws a fresh weight for a {type(layer).__name__}; give it "
                           "reset_parameters() or use another init")
    return clone.weight.detach()
