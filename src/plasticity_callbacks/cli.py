"""The console scripts, kept free of the app's optional imports so that a missing extra is one line.

``plasticity-train``, ``plasticity-report`` and ``plasticity-benchmark`` import the Hydra app only when run; without the
``[app]`` extra they print the install command (for this checkout or for the installed wheel)
and exit with status 1, instead of a traceback from ``import hydra``.

Example:
    $ plasticity-train
    plasticity-train: the Hydra app needs hydra, which is not installed: pip install -e '/path/to/checkout[app]'
"""
from __future__ import annotations

import importlib
import sys

from .extras import MissingExtraError


def _run(program: str, module: str) -> None:
    try:
        main = importlib.import_module(module).main
    except MissingExtraError as error:
        sys.exit(f"{program}: {error}")
    main()


def train() -> None:
    """``plasticity-train``: :func:`plasticity_callbacks.app.train.main`."""
    _run("plasticity-train", "plasticity_callbacks.app.train")


def report() -> None:
    """``plasticity-report``: :func:`plasticity_callbacks.app.report.main`."""
    _run("plasticity-report", "plasticity_callbacks.app.report")


def benchmark() -> None:
    """``plasticity-benchmark``: :func:`plasticity_callbacks.app.benchmark.main.main`."""
    _run("plasticity-benchmark", "plasticity_callbacks.app.benchmark.main")
