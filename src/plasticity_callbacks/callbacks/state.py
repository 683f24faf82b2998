"""The check every callback's ``load_state_dict`` runs first: the state has exactly the expected keys and types.

A checkpoint from another callback, another version or a damaged file must not half-load (a raw
``KeyError: 'applied'``) or load wrongly (``bool("no")`` is True). The error names the callback
and the keys.

Example:
    >>> def load_state_dict(self, state_dict):
    ...     check_state(self, state_dict, {"applied": bool, "history": list})
    ...     self.applied = state_dict["applied"]
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import CheckpointError

OPTIONAL_INT = (int, type(None))
OPTIONAL_NUMBER = (int, float, type(None))


def _type_ok(value: Any, allowed: type | tuple[type, ...]) -> bool:
    allowed = allowed if isinstance(allowed, tuple) else (allowed,)
    if isinstance(value, bool):  # a bool is an int to Python, never a count or a number here
        return bool in allowed
    return isinstance(value, allowed)


def _names(allowed: type | tuple[type, ...]) -> str:
    allowed = allowed if isinstance(allowed, tuple) else (allowed,)
    return " or ".join("None" if t is type(None) else t.__name__ for t in allowed)


def check_state(owner: Any, state: Any, expected: Mapping[str, type | tuple[type, ...]],
                optional: Mapping[str, type | tuple[type, ...]] | None = None) -> None:
    """Raise :class:`CheckpointError` unless ``state`` is a dict with every key of ``expected``, keys of
    ``optional`` at most besides, each value of an allowed type (``torch.Tensor`` for tensors).

    Args:
        owner: the callback (or its name), named in the message.
        state: what ``load_state_dict`` received.
        expected: key -> allowed type(s), required.
        optional: key -> allowed type(s) (e.g. ``torch.Tensor``), may be absent.
    """
    name = owner if isinstance(owner, str) else type(owner).__name__
    optional = dict(optional or {})
    if not isinstance(state, Mapping):
        raise CheckpointError(f"{name}.load_state_dict got a {type(state).__name__}, not a state dict with keys "
                              f"{sorted(expected)}")
    missing = sorted(set(expected) - set(state))
    unknown = sorted(set(state) - set(expected) - set(optional), key=str)
    if missing or unknown:
        raise CheckpointError(f"{name}.load_state_dict: the state is not a {name} state: missing keys {missing}, "
                              f"unknown keys {unknown}; expected {sorted(expected)} (a checkpoint of another callback "
                              "or version?)")
    wrong = [f"{key}={state[key]!r:.40} (must be {_names(allowed)})" for key, allowed in {**expected, **optional}.items()
             if key in state and not _type_ok(state[key], allowed)]
    if wrong:
        raise CheckpointError(f"{name}.load_state_dict: wrong types in the state: {', '.join(wrong)}")

