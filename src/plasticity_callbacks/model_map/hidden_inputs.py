"""Reading hidden units in the forward: the input of a ``down`` layer handed to a reader, through the owning
block's ``hidden_observer`` slot where the block offers a free one, else through a forward pre-hook."""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

Reader = Callable[[nn.Module, torch.Tensor], None]  # (module, h): h as it enters down


class HiddenInputReaders:
    """The readers one callback attaches to a model, removed together.

    A block with a ``hidden_observer`` attribute and ``neuron_layouts()`` (this package's GPT MLPs) calls the
    reader in its slot with ``(block, h)`` from inside its forward. ``torch.compile`` guards on that attribute,
    so a reader set after a graph was traced re-traces once, where a hook added then would never run. Any
    other ``down``, and one whose slot another callback holds, gets a forward pre-hook that calls the reader
    with ``(down, args[0])``.

    Example:
        >>> readers = HiddenInputReaders()
        >>> readers.reset(model)
        >>> readers.read(layer.down, lambda module, h: seen.append(h.detach()))
        >>> model(x)
        >>> readers.remove()
    """

    def __init__(self):
        self._slots: dict[int, nn.Module] = {}  # id(down) -> the block whose hidden_observer receives down's input
        self._handles: list = []
        self._blocks: list[nn.Module] = []  # blocks whose slot holds one of these readers

    def reset(self, model: nn.Module) -> None:
        """Remove the readers attached so far and find the ``hidden_observer`` slots that ``model``'s blocks offer.

        Args:
            model: the module whose ``down`` layers :meth:`read` will be called with.
        """
        self.remove()
        for module in model.modules():
            if hasattr(module, "hidden_observer") and callable(getattr(module, "neuron_layouts", None)):
                self._slots.update({id(layout.down): module for layout in module.neuron_layouts()})

    def read(self, down: nn.Module, reader: Reader) -> None:
        """Hand ``reader`` the input of ``down`` (a layer of the model given to :meth:`reset`) at every forward
        until :meth:`remove`."""
        block = self._slots.get(id(down))
        if block is not None and block.hidden_observer is None:
            block.hidden_observer = reader
            self._blocks.append(block)
        else:
            self._handles.append(down.register_forward_pre_hook(_FirstInput(reader)))

    def pre_hook(self, module: nn.Module, hook: Callable, with_kwargs: bool = False) -> None:
        """A forward pre-hook of the caller's own (one on an experts module, say), removed with the readers."""
        self._handles.append(module.register_forward_pre_hook(hook, with_kwargs=with_kwargs))

    def remove(self) -> None:
        """Detach every reader and hook; a second call does nothing."""
        self._slots.clear()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for block in self._blocks:
            block.hidden_observer = None
        self._blocks.clear()


class _FirstInput:
    """A pre-hook handing its reader the layer's first positional input. A plain object kept for the fit: a
    compiled graph guards on what it reads."""

    def __init__(self, reader: Reader):
        self.reader = reader

    def __call__(self, module: nn.Module, args: tuple) -> None:
        self.reader(module, args[0])
