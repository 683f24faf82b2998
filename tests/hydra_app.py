"""The application as the tests drive it: its Hydra config composed in this process, and its command-line
entry points run by the interpreter under test (``sys.executable -m ...``), never by whichever
``plasticity-train`` comes first on ``PATH`` (absent in an un-activated venv, another installation's if one
comes first)."""
from __future__ import annotations

import copy
import functools
import os
import subprocess
import sys

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from plasticity_callbacks.app.train import config_dir

COMPOSE_DIR = "/tmp/plasticity-compose"  # a run directory composing resolves to; nothing is written there


def compose_config(*overrides: str, output_dir: str | os.PathLike | None = COMPOSE_DIR) -> DictConfig:
    """The package's ``config.yaml`` with ``overrides``, as ``plasticity-train`` would compose it; ``output_dir``
    sets ``paths.output_dir`` (None: the config's own). A copy: the test may change it."""
    paths = () if output_dir is None else (f"paths.output_dir={output_dir}",)
    return copy.deepcopy(_composed(config_dir(), (*paths, *overrides)))


@functools.cache
def _composed(directory: str, overrides: tuple[str, ...]) -> DictConfig:
    """Composed once a session: Hydra reads and merges some twenty YAML files each time (about 0.1 CPU-s), and
    many tests compose the same method or experiment; a copy costs a thirtieth of that."""
    with initialize_config_dir(config_dir=directory, version_base="1.3"):
        return compose("config", overrides=list(overrides))


def run_app(module: str, *args: str, cwd=None, env: dict | None = None, timeout: float = 300, stdout=None):
    """``python -m plasticity_callbacks.app.<module> ARGS`` by this interpreter; ``env`` adds to the environment;
    ``stdout``: an open file that takes standard output (default: captured, like standard error)."""
    return subprocess.run([sys.executable, "-m", f"plasticity_callbacks.app.{module}", *map(str, args)], cwd=cwd,
                          env=dict(os.environ, **(env or {})), stdout=stdout or subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, timeout=timeout)


def run_train(*args: str, **kwargs):
    """``plasticity-train ARGS``, run as ``python -m plasticity_callbacks.app.train``."""
    return run_app("train", *args, **kwargs)


def run_report(*args: str, **kwargs):
    """``plasticity-report ARGS``, run as ``python -m plasticity_callbacks.app.report``."""
    return run_app("report", *args, **kwargs)
