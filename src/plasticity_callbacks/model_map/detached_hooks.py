"""The model map's own forwards (the one-token probes of :mod:`.trace`, :mod:`.probe`, :mod:`.experts`) run with
the forward and backward hooks of everyone else set aside, so that a hook sees only the forwards its owner ran."""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch.nn.modules.module as torch_module
from torch import nn

# The hooks nn.Module.__call__ runs. The dicts beside them (with_kwargs, always_called, is_full_backward_hook) are
# keyed by hook id and read only for the ids found here, so they stay as they are.
_MODULE_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_GLOBAL_HOOKS = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks",
                 "_global_backward_hooks")


@contextlib.contextmanager
def hooks_detached(model: nn.Module) -> Iterator[None]:
    """Set aside, while the block runs, every hook on ``model``'s modules and every global module hook
    (``register_module_forward_hook``), except torch's own: those compute what the forward uses (``prune``,
    the hook-based ``weight_norm`` and ``spectral_norm``, ``fully_shard``), so the forward without them would not
    be the model's. Hooks registered inside the block stay where they were registered until removed; afterwards
    each set-aside hook is back in its place, in the order it had, the same on an exception.

    Global hooks are process-wide: a forward that another thread runs inside the block does not call them either.

    Args:
        model: the module whose forward the block runs.

    Example:
        >>> with hooks_detached(model), torch.no_grad():
        ...     model(torch.zeros(1, 1, dtype=torch.long))   # no hook of the user's sees this call
    """
    tables = [getattr(module, name) for module in model.modules() for name in _MODULE_HOOKS]
    tables += [getattr(torch_module, name) for name in _GLOBAL_HOOKS]
    saved = [(table, list(table.items())) for table in tables if table]
    for table, entries in saved:
        for key, hook in entries:
            if not _torch_machinery(hook):
                del table[key]
    try:
        yield
    finally:
        for table, entries in saved:
            _put_back(table, entries)


def _put_back(table: dict, entries: list) -> None:
    """``table`` as ``entries`` had it, less what was removed from it meanwhile, plus what was added."""
    now = dict(table)
    table.clear()
    for key, hook in entries:
        if key in now or not _torch_machinery(hook):
            table[key] = hook
    table.update((key, hook) for key, hook in now.items() if key not in table)


def _torch_machinery(hook) -> bool:
    """Whether ``hook`` (a function, a bound method, a callable object or a ``functools.partial`` of one) is
    defined in torch."""
    target = hook.func if isinstance(hook, functools.partial) else hook
    owner = getattr(target, "__module__", None) or type(target).__module__
    return owner == "torch" or owner.startswith("torch.")
