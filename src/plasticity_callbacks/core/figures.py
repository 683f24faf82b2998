"""Saving matplotlib figures next to the run's logs (rank zero only).

Figures come from :func:`new_figure`: a plain ``matplotlib.figure.Figure``, not registered with
pyplot, so drawing and saving needs no display and leaves the user's backend and open figures
alone. Importing this module imports nothing from matplotlib.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def new_figure(**kwargs) -> Figure:
    """A matplotlib ``Figure`` (keyword arguments as ``Figure``'s, e.g. ``figsize``); axes: ``fig.subplots()``."""
    from matplotlib.figure import Figure

    return Figure(**kwargs)


def figure_dir(trainer) -> Path:
    """The logger's directory if there is a logger, else the trainer's root dir; created if needed."""
    base = None
    if trainer.logger is not None:
        base = getattr(trainer.logger, "log_dir", None) or getattr(trainer.logger, "save_dir", None)
    path = Path(base or trainer.default_root_dir) / "figures"
    path.mkdir(parents=True, exist_ok=True)
    return path


def save_figure(fig, trainer, name: str) -> Path | None:
    """Save ``fig`` as ``<figure_dir>/<name>.png`` on global rank 0; return the path (None elsewhere)."""
    path = None
    if trainer.global_rank == 0:
        path = figure_dir(trainer) / f"{name}.png"
        fig.savefig(path, dpi=120, bbox_inches="tight")
    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is not None:  # a pyplot-made figure stays open until closed
        pyplot.close(fig)
    return path


def __getattr__(name: str):
    if name == "plt":  # pyplot on first use, for code that draws with it
        import matplotlib.pyplot as plt

        return plt
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
