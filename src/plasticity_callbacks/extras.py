"""One-line errors for an optional dependency that is not installed, naming the command that installs it.

The package's core needs torch and Lightning only; the Hydra app, the Hugging Face adapter, the
digits experiment and the figures live in extras (``pyproject.toml``). The command differs for a
source checkout (``pip install -e '.[app]'``, run in the checkout) and an installed wheel
(``pip install 'plasticity_callbacks[app]'``), so the message gives the one that applies.

Example:
    >>> transformers = require_module("transformers", "hf", "the Hugging Face Trainer adapter")
"""
from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType


class MissingExtraError(ImportError):
    """An optional dependency is missing; the message is the one line that says how to install it."""


def checkout_root() -> Path | None:
    """The source checkout this package is imported from (its ``pyproject.toml`` folder), or None for a wheel."""
    root = Path(__file__).resolve().parents[3]  # <root>/src/plasticity_callbacks/extras.py
    return root if (root / "pyproject.toml").is_file() and (root / "src" / "plasticity_callbacks").is_dir() else None


def install_command(extra: str) -> str:
    """``pip install -e '<checkout>[extra]'`` from a checkout, ``pip install 'plasticity_callbacks[extra]'`` else."""
    root = checkout_root()
    if root is not None:
        return f"pip install -e '{root}[{extra}]'"
    return f"pip install 'plasticity_callbacks[{extra}]'"


def require_module(module: str, extra: str, purpose: str) -> ModuleType:
    """Import ``module`` or raise :class:`MissingExtraError` naming ``extra``'s install command.

    Args:
        module: the module to import (``"hydra"``, ``"matplotlib.figure"``).
        extra: the ``pyproject.toml`` extra that installs it (``"app"``, ``"hf"``, ``"digits"``, ``"plots"``).
        purpose: what needs it, for the message (``"the plasticity-train app"``).
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        top = module.split(".")[0]
        if error.name is None or error.name.split(".")[0] != top:
            raise  # the module exists but one of its own imports failed: show that error as it is
        raise MissingExtraError(f"{purpose} needs {top}, which is not installed: {install_command(extra)}") from None


def require_app() -> None:
    """The Hydra app's own packages (the ``[app]`` extra), or a one-line error naming the command that installs
    them; called by the app's entry points (``app.train``, ``app.report``), so that ``app.runs`` (checkpoints,
    resume), which the Hugging Face adapter uses, needs none of them."""
    for module in ("hydra", "omegaconf", "matplotlib"):
        require_module(module, "app", "the Hydra app (plasticity-train, plasticity-report)")
