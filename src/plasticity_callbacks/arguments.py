"""Constructor-argument checks shared by the callbacks: each error names the argument and what is allowed.

A config system hands over whatever the command line said (``alpha=abc`` arrives as a string, ``every=true``
as a bool), so types are checked before ranges: a clear message beats a TypeError from a comparison.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import math
from collections.abc import Mapping, Sequence


def check_int(name: str, value, minimum: int = 1, optional: bool = False, hint: str = "") -> None:
    """``value`` must be an int (not a bool) ``>= minimum``, or None when ``optional``."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        allowed = f"an integer >= {minimum}" + (" or None" if optional else "")
        raise ValueError(f"{name}={value!r} must be {allowed} {hint}".rstrip())


def check_number(name: str, value, low: float = -math.inf, high: float = math.inf, hint: str = "",
                 low_open: bool = False, high_open: bool = False) -> None:
    """``value`` must be a finite int or float (not a bool) in the interval from ``low`` to ``high``: closed
    by default, open at ``low`` with ``low_open`` (``> low``) and at ``high`` with ``high_open`` (``< high``),
    where the math needs it (a rate of 0 that does nothing, a decay of 1 that never moves).

    Example:
        >>> check_number("kappa", kappa, 0.0, low_open=True, hint="(paper: 1 to 4)")   # kappa > 0
        >>> check_number("decay", decay, 0.0, 1.0, high_open=True)                       # 0 <= decay < 1
    """
    number = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if not number or not (value > low if low_open else value >= low) or not (
            value < high if high_open else value <= high):
        raise ValueError(f"{name}={value!r} must be a finite number {interval(low, high, low_open, high_open)} "
                         f"{hint}".rstrip())


def interval(low: float, high: float, low_open: bool = False, high_open: bool = False) -> str:
    """The interval as a reader writes it: ``"> 0"``, ``">= 0"``, ``"in (0, 1]"``, ``"in [0, 1)"``."""
    if high == math.inf:
        return f"{'>' if low_open else '>='} {low:g}" if low != -math.inf else "(any finite value)"
    if low == -math.inf:
        return f"{'<' if high_open else '<='} {high:g}"
    return f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"


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


def close_matches(name: str, known) -> str:
    """``" (did you mean 'x'?)"`` for the nearest of ``known`` to ``name`` (difflib), else ``""``."""
    near = difflib.get_close_matches(str(name), [str(k) for k in known], n=3, cutoff=0.6)
    return f" (did you mean {', '.join(repr(n) for n in near)}?)" if near else ""


def refuse_unknown_fields(cls):
    """Class decorator for an options dataclass: an unknown keyword (``Schedule(bogus=1)``) is one ValueError
    naming it, the nearest field and every field, instead of Python's bare ``TypeError`` about ``__init__``.

    Example:
        >>> @refuse_unknown_fields
        ... @dataclass(frozen=True)
        ... class Options:
        ...     rate: float = 0.1
    """
    init = cls.__init__
    known = [f.name for f in dataclasses.fields(cls) if f.init]

    @functools.wraps(init)
    def checked_init(self, *args, **kwargs):
        unknown = [k for k in kwargs if k not in known]
        if unknown:
            name = unknown[0]
            raise ValueError(f"{cls.__name__} has no argument {name}={kwargs[name]!r}{close_matches(name, known)}; "
                             f"its arguments: {', '.join(known)}")
        init(self, *args, **kwargs)

    cls.__init__ = checked_init
    return cls
