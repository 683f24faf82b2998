"""Running the benchmark's jobs: one ``experiment=continual_digits`` fit per (stream, method, setting, seed),
in this process, each into its own folder, which a later call finds and does not run again.

Example:
    >>> job = Job(STREAMS[0], "warm", "", 0)
    >>> result = run_job(job, Path("outputs/plasticity_benchmark"), user_config_dir=None)
"""
from __future__ import annotations

import csv
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from ..methods import DESCRIPTION_KEYS, sensitivity
from ..train import config_dir, fit
from .results import RunResult, Stream

# Random labels: 1024 images relabeled at random per task, accuracy on those images (memorization), at a
# budget where end-of-task accuracy stays below the ceiling so methods separate. Permuted digits: true
# labels, a new pixel permutation per task, accuracy on the held-out fifth of the images (generalization);
# 25 steps of batch 128 are about two passes over a task's 1438 training images, where warm start ends a
# 20-task stream below a full reset.
STREAMS = (Stream("memorization", "digits_labels", 20, 100, "the task's own randomly labeled images"),
           Stream("generalization", "digits_permuted", 20, 25, "held-out images of the task's permutation"))
# Only what the ranking uses is measured: the plasticity probe (20 full-batch steps per task) is left out.
MEASUREMENT = ["callbacks.task_metrics.probe_steps=0"]
COST_FILE = "benchmark_cost.json"  # the run's CPU seconds, written next to its logs once it finished
CONFIG_FILE = "benchmark_config.yaml"  # the composed config it ran: an edited method file runs again


@dataclass(frozen=True)
class Job:
    stream: Stream
    method: str
    setting: str   # "" or one override of the method file ("callbacks.x.y=0.1")
    seed: int

    def folder(self, out: Path) -> Path:
        key, _, value = self.setting.partition("=")
        setting = f"{key.rsplit('.', 1)[-1]}_{value}" if self.setting else "default"  # kappa_2.0
        return out / "runs" / self.stream.name / self.method / setting / f"seed{self.seed}"

    def overrides(self) -> list[str]:
        setting = [f"++method.{self.setting}"] if self.setting else []  # ++: model.lr, which the file may not set
        return [f"+method={self.method}", f"seed={self.seed}", *self.stream.overrides(), *MEASUREMENT, *setting]


def compose_run(out: Path, overrides: list[str], user_config_dir: Path | None):
    """The run's config, as ``plasticity-train experiment=continual_digits <overrides>`` composes it."""
    extra = [f"hydra.searchpath=[file://{Path(user_config_dir).expanduser().absolute()}]"] if user_config_dir else []
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        return compose("config", overrides=["experiment=continual_digits", f"paths.output_dir={out}",
                                             *extra, *overrides])


def sweep(method: str, user_config_dir: Path | None) -> tuple[str, list[str], str] | None:
    """The method's sensitivity sweep as ``(key, the values as override strings, its file's own value's string)``
    (the values as the file lists them: the benchmark checks that the file's own is among them), or None for a
    method without a ``sensitivity:`` block."""
    cfg = compose_run(Path("unused"), [f"+method={method}"], user_config_dir)
    found = sensitivity(cfg.method)
    if found is None:
        return None
    key, values = found
    default = OmegaConf.select(cfg.method, key)
    return key, [str(v) for v in values], str(OmegaConf.select(cfg, key) if default is None else default)


def configuration(stream: Stream, method: str, setting: str, user_config_dir: Path | None) -> str:
    """The :func:`fingerprint` of ``method`` at ``setting`` on ``stream`` (seed 0): two methods with equal ones
    are one configuration under two names."""
    return fingerprint(compose_run(Path("unused"), Job(stream, method, setting, 0).overrides(), user_config_dir))


def identical_groups(configurations: dict[str, str]) -> list[list[str]]:
    """The names whose configurations are equal, each group of two or more in the order given.

    Example:
        >>> identical_groups({"fire_continual": "a", "fire_lm": "a", "warm": "b"})
        [['fire_continual', 'fire_lm']]
    """
    groups: dict[str, list[str]] = {}
    for name, config in configurations.items():
        groups.setdefault(config, []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def fingerprint(cfg) -> str:
    """The composed config as text, interpolations unresolved, without what is not a setting of the run: ``paths``
    (a folder moved elsewhere is still the same run) and what the method file says about itself (its name, regime,
    sweep grid: :data:`~app.methods.DESCRIPTION_KEYS`; a reworded regime line is still the same run, and two
    method files with equal fingerprints are one configuration)."""
    config = OmegaConf.to_container(cfg, resolve=False)
    config.pop("paths", None)
    for block in ("method", "default_method"):
        for key in DESCRIPTION_KEYS:
            (config.get(block) or {}).pop(key, None)
    config.get("callbacks", {}).get("task_metrics", {}).pop("method", None)  # the name, recorded in stream.json
    return yaml.safe_dump(config, sort_keys=True)


def read_tasks(folder: Path) -> list[dict]:
    """The run's ``logs/tasks.csv`` rows in task order (none when it wrote no file)."""
    path = folder / "logs" / "tasks.csv"
    if not path.is_file():
        return []
    with path.open(newline="") as f:
        return sorted(csv.DictReader(f), key=lambda row: int(row["task"]))


def run_job(job: Job, out: Path, user_config_dir: Path | None) -> RunResult:
    """Run ``job`` into its folder (unless it finished there before with the same composed config) and read its
    per-task accuracies back."""
    folder = job.folder(out)
    cost_file, config_file = folder / COST_FILE, folder / CONFIG_FILE
    cfg = compose_run(folder, job.overrides(), user_config_dir)
    config = fingerprint(cfg)
    if (not cost_file.is_file() or not config_file.is_file() or config_file.read_text() != config
            or len(read_tasks(folder)) != job.stream.num_tasks):
        shutil.rmtree(folder, ignore_errors=True)  # unfinished, or run with another config: from scratch
        (folder / ".hydra").mkdir(parents=True)
        (folder / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(job.overrides()))
        started = time.process_time()
        fit(cfg)
        if len(read_tasks(folder)) != job.stream.num_tasks:  # stopped early (a signal): no cost file, runs again
            raise RuntimeError(f"{folder}: the run stopped after {len(read_tasks(folder))} of "
                               f"{job.stream.num_tasks} tasks")
        config_file.write_text(config)
        cost_file.write_text(json.dumps({"cpu_seconds": time.process_time() - started}) + "\n")
    rows = read_tasks(folder)
    return RunResult(job.stream.name, job.method, job.setting, job.seed,
                     [float(row["accuracy"]) for row in rows], [float(row["online_accuracy"]) for row in rows],
                     json.loads(cost_file.read_text())["cpu_seconds"])
