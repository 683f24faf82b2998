"""Constructor-argument checks shared by the callbacks: each error names the argument and what is allowed.

A config system hands over whatever the command line said (``alpha=abc`` arrives as a string, ``every=true``
as a bool), so types are checked before ranges: a clear message beats a TypeError from a comparison.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence


def check_int(name: str, value, minimum: int = 1, optional: bool = False, hint: str = "") -> None:
    """``value`` must be an int (not a bool) ``>= minimum``, or None when ``optional``."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        allowed = f"an integer >= {minimum}" + (" or None" if optional else "")
        raise ValueError(f"{name}={value!r} must be {allowed} {hint}".rstrip())


def check_number(name: str, value, low: float = -math.inf, high: float = math.inf, hint: str = "") -> None:
    """``value`` must be a finite int or float (not a bool) in the closed interval ``[low, high]``."""
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or not low <= value <= high):
        raise ValueError(f"{name}={value!r} must be a finite number in [{low:g}, {high:g}] {hint}".rstrip())


def check_bool(name: str, value) -> None:
    """``value`` must be True or False (a config's ``yes``, ``1`` or ``"false"`` is refused by name)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r} must be true or false")


def sorted_int_list(name: str, values) -> list[int]:
    """``values`` (None, or a list of integers >= 0, e.g. epochs or steps) as a sorted list without repeats."""
    if values is None:
        return []
    if isinstance(values, str) or not isinstance(values, Sequence) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ValueError(f"{name}={values!r} must be a list of non-negative integers or None")
    return sorted(set(values))


def build_options(cls, value, owner: str, field_name: str):
    """``value`` as an instance of the options dataclass ``cls``: an instance is kept; a mapping (a dict or
    a config system's mapping type, with or without ``_target_``) becomes one; anything else is refused by name."""
    if isinstance(value, cls):
        return value
    if isinstance(value, Mapping):
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known - {"_target_"})
        if unknown:
            raise ValueError(f"{owner} {field_name}: unknown field(s) {unknown}; known: {sorted(known)}")
        return cls(**{k: v for k, v in value.items() if k != "_target_"})
    raise ValueError(f"{owner} {field_name}={value!r} must be a {cls.__name__} or a mapping of its fields")
