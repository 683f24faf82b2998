"""Registries of pluggable model blocks, keyed by the names of the Hydra config groups.

``model/mlp=swiglu`` in Hydra selects ``MLPS["swiglu"]``; a block registers itself with a
decorator next to its definition, so adding a block is one class and one YAML file.
"""
from __future__ import annotations

from typing import Callable, Generic, TypeVar

from ..errors import ConfigError

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str):
        self.kind = kind  # e.g. "model.mlp", used in error messages
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def decorator(cls: T) -> T:
            if name in self._entries:
                raise KeyError(f"{self.kind} block {name!r} is registered twice")
            self._entries[name] = cls
            return cls

        return decorator

    def get(self, name: str) -> T:
        if name not in self._entries:
            raise ConfigError(f"{self.kind}={name!r} is not a known block; choose one of {self.names()}")
        return self._entries[name]

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries


MLPS: Registry = Registry("model.mlp")
ATTENTIONS: Registry = Registry("model.attention")
POSITIONS: Registry = Registry("model.position")
