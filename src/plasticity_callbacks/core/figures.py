"""Saving matplotlib figures next to the run's logs (rank zero only, headless)."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # never needs a display
import matplotlib.pyplot as plt  # noqa: E402


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
    if trainer.global_rank != 0:
        plt.close(fig)
        return None
    path = figure_dir(trainer) / f"{name}.png"
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path
