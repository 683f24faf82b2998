"""Saving matplotlib figures next to the run's logs and on the logger's dashboard (rank zero only).

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


def can_draw(owner: str, option: str) -> bool:
    """Whether matplotlib is installed; if not, warn once that ``owner``'s ``option`` draws nothing and how to fix it.

    A missing figure never stops training: the metrics are logged either way.

    Args:
        owner: the callback's name, e.g. ``"FIREReinit"``.
        option: the argument that asked for the figure, e.g. ``"save_spectra"``.
    """
    from ..extras import MissingExtraError, require_module

    try:
        require_module("matplotlib", "plots", f"{owner}({option}=True)")
    except MissingExtraError as error:
        if (owner, option) not in _WARNED:
            _WARNED.add((owner, option))
            from lightning.pytorch.utilities import rank_zero_warn

            rank_zero_warn(f"{error}; no figure is drawn (or set {option}=False)")
        return False
    return True


_WARNED: set[tuple[str, str]] = set()


def new_figure(**kwargs) -> Figure:
    """A matplotlib ``Figure`` (keyword arguments as ``Figure``'s, e.g. ``figsize``); axes: ``fig.subplots()``."""
    from matplotlib.figure import Figure

    return Figure(**kwargs)


def run_output_dir(trainer) -> Path | None:
    """Where a callback writes this run's files: the logger's directory; without a logger the trainer's
    ``default_root_dir`` when it is not the current directory (Lightning's default); else None, so that
    nothing lands in the current directory unless asked for."""
    for logger in getattr(trainer, "loggers", None) or ([trainer.logger] if trainer.logger is not None else []):
        base = getattr(logger, "log_dir", None) or getattr(logger, "save_dir", None)
        if base:
            return Path(base)
    root = Path(trainer.default_root_dir)
    return None if root.resolve() == Path.cwd().resolve() else root


def figure_dir(trainer) -> Path | None:
    """``<run_output_dir>/figures``, created; None when there is no run directory (see :func:`run_output_dir`)."""
    base = run_output_dir(trainer)
    if base is None:
        return None
    path = base / "figures"
    path.mkdir(parents=True, exist_ok=True)
    return path


def save_figure(fig, trainer, name: str) -> Path | None:
    """Save ``fig`` as ``<figure_dir>/<name>.png`` and send it to every logger that shows images, on global rank 0.

    The one place figures leave the package: a PNG beside the logs, and TensorBoard (``add_figure``),
    MLflow (``log_figure``) or Weights & Biases (``log_image``) under ``figures/<name>``. Without a
    logger and with the trainer's default root in the current directory, no file is written (a warning
    says how to get one). A logger that fails to take the figure is warned about, not fatal.

    Args:
        fig: a matplotlib ``Figure`` (from :func:`new_figure`, or pyplot's; a pyplot figure is closed).
        trainer: the Lightning trainer (or a view of another trainer with ``loggers``, ``global_step``).
        name: the file name without ``.png``, also the logger's tag.

    Returns:
        The PNG's path, or None (another rank, or nowhere to write).

    Example:
        >>> fig = new_figure(figsize=(4, 3)); fig.subplots().plot([3, 1, 2])
        >>> save_figure(fig, trainer, "my_curve")   # <log_dir>/figures/my_curve.png + the dashboard
    """
    path = None
    if trainer.global_rank == 0:
        folder = figure_dir(trainer)
        if folder is not None:
            path = folder / f"{name}.png"
            fig.savefig(path, dpi=120, bbox_inches="tight")
        loggers = getattr(trainer, "loggers", None) or ([trainer.logger] if trainer.logger is not None else [])
        sent = [_send_to_logger(logger, fig, name, trainer.global_step) for logger in loggers]
        if path is None and not any(sent):
            from lightning.pytorch.utilities import rank_zero_warn

            rank_zero_warn(f"figure {name!r} was not saved: the trainer has no logger and its default_root_dir is "
                           "the current directory; pass L.Trainer(default_root_dir=...) or a logger")
    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is not None:  # a pyplot-made figure stays open until closed
        pyplot.close(fig)
    return path


def _send_to_logger(logger, fig, name: str, step: int) -> bool:
    """Hand ``fig`` to a logger that shows images; whether it took it (CSV and others: False)."""
    kind = type(logger).__name__
    tag = f"figures/{name}"
    try:
        if kind == "TensorBoardLogger":
            logger.experiment.add_figure(tag, fig, global_step=step, close=False)
        elif kind == "MLFlowLogger":
            logger.experiment.log_figure(logger.run_id, fig, f"{tag}.png")
        elif kind == "WandbLogger":
            logger.log_image(key=tag, images=[_rgb_array(fig)], step=step)
        else:
            return False
    except Exception as error:  # the PNG is saved; a dashboard that refuses the figure must not stop training
        from lightning.pytorch.utilities import rank_zero_warn

        rank_zero_warn(f"figure {name!r} could not be sent to {kind}: {type(error).__name__}: {error}")
        return False
    return True


def _rgb_array(fig):
    """The figure rendered as an ``(H, W, 3)`` uint8 array."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


def __getattr__(name: str):
    if name == "plt":  # pyplot on first use, for code that draws with it
        import matplotlib.pyplot as plt

        return plt
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
