"""What a benchmark run keeps: the streams it ran, and per (stream, method, setting, seed) the per-task
accuracies and the CPU seconds, in one JSON file.

The package ships the baselines' file (``benchmark_results/ranking_runs.json``), so a user's method is
placed against them, paired by seed, without re-running them; :func:`check_comparable` refuses to pair
runs of unlike settings (another stream length, other seeds) instead of comparing them silently.
The file is written with its SHA-256 beside it (``ranking_runs.json.sha256``) and :func:`load_results` checks it
and the file's shape: numbers edited by hand, a truncated or foreign file is one :class:`ResultsError` line
naming the file, never a ranking built on them.

Example:
    >>> shipped = load_results(SHIPPED_RESULTS)
    >>> sorted({r.method for r in shipped.runs})[:3]
    ['cbp', 'dash', 'fire_continual']
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from ... import __version__
from ..runs.verified_files import recorded_checksum, sha256_of_file, write_verified

SHIPPED_RESULTS = Path(__file__).resolve().parents[1] / "benchmark_results" / "ranking_runs.json"


@dataclass(frozen=True)
class Stream:
    """One task stream of the benchmark, run through ``experiment=continual_digits``."""

    name: str            # the column's name: memorization, generalization
    data: str            # its Hydra data config (configs/data/<data>.yaml)
    num_tasks: int
    steps_per_task: int
    measures: str        # what its end-of-task accuracy is measured on, for the table's caption
    data_overrides: tuple[str, ...] = ()  # further settings of its data config ("data.split_seed=3")

    def overrides(self) -> list[str]:
        return [f"data={self.data}", f"data.num_tasks={self.num_tasks}", f"data.steps_per_task={self.steps_per_task}",
                *self.data_overrides, f"trainer.log_every_n_steps={self.steps_per_task}"]

    def settings(self) -> dict:
        """What must match for two runs of this stream to be compared."""
        settings = {"data": self.data, "num_tasks": self.num_tasks, "steps_per_task": self.steps_per_task}
        return {**settings, "data_overrides": list(self.data_overrides)} if self.data_overrides else settings


@dataclass
class RunResult:
    """One run: a method file (with one setting changed, or as it is) on one stream and seed."""

    stream: str
    method: str                    # configs/method/<method>.yaml
    setting: str                   # "" for the file as is, else one override under it ("callbacks.x.y=0.1")
    seed: int
    accuracy: list[float]          # end-of-task accuracy per task
    online_accuracy: list[float]   # online accuracy per task
    cpu_seconds: float             # the run's CPU time (one thread)

    @property
    def label(self) -> str:
        """The method with its setting: ``cbp`` (its file as is) or ``cbp (replacement_rate=0.001)``."""
        return f"{self.method} ({short_setting(self.setting)})" if self.setting else self.method


def short_setting(setting: str) -> str:
    """``callbacks.continual_backprop.replacement_rate=0.001`` as a table shows it: ``replacement_rate=0.001``;
    ``""`` (a method file as is) as ``as in its file``."""
    if not setting:
        return "as in its file"
    key, _, value = setting.partition("=")
    return f"{key.rsplit('.', 1)[-1]}={value}"


@dataclass
class Results:
    """Everything one benchmark run measured, and the settings it measured it with."""

    streams: dict[str, dict]       # stream name -> Stream.settings()
    seeds: list[int]               # the ranking seeds
    tuning_seeds: list[int]        # the seeds of the sensitivity sweep (never ranking seeds)
    tuning_tasks: int              # the sweep's streams: their tasks (steps as the ranking's)
    # method -> stream -> the setting its row runs at: the sweep's best on that stream's tuning runs
    tuned: dict[str, dict[str, str]] = field(default_factory=dict)
    runs: list[RunResult] = field(default_factory=list)
    regimes: dict[str, str] = field(default_factory=dict)  # method -> its file's regime: line
    notes: list[str] = field(default_factory=list)          # what the run merged or left out, one line each
    version: str = __version__

    def ranking_runs(self) -> list[RunResult]:
        return [r for r in self.runs if r.seed in self.seeds]

    def tuning_runs(self) -> list[RunResult]:
        return [r for r in self.runs if r.seed in self.tuning_seeds]


class ResultsError(ValueError):
    """A benchmark results file that cannot be trusted or read: one line naming it and what is wrong."""


def save_results(results: Results, path: Path) -> Path:
    """Write ``results`` as JSON with its ``.sha256`` beside it (:func:`load_results` checks both)."""
    data = asdict(results)
    data["runs"] = sorted(data["runs"], key=lambda r: (r["stream"], r["method"], r["setting"], r["seed"]))
    write_verified((json.dumps(data, indent=1) + "\n").encode(), path)
    return path


def load_results(path: Path, require_checksum: bool = False) -> Results:
    """The results in ``path``, checked: against the SHA-256 recorded beside it (required with
    ``require_checksum``, as for the shipped runs), and its shape (the fields, every run's numbers finite,
    accuracies in [0, 1], one per task of its stream, its seed among the file's seeds).

    Raises:
        ResultsError: one line naming the file and what is wrong.

    Example:
        >>> shipped = load_results(SHIPPED_RESULTS, require_checksum=True)
    """
    path = Path(path)
    try:
        recorded = recorded_checksum(path)
    except ValueError as err:  # a malformed checksum file
        raise ResultsError(str(err)) from None
    if recorded is None and require_checksum:
        raise ResultsError(f"{path} has no .sha256 beside it: its numbers cannot be verified; reinstall the package "
                           "or rerun the baselines (--rerun-baselines)")
    if recorded is not None and (not path.is_file() or sha256_of_file(path) != recorded[0]):
        raise ResultsError(f"{path} does not match its recorded SHA-256: its numbers were edited or the file replaced; "
                           "reinstall the package or rerun the baselines (--rerun-baselines)")
    try:
        data = json.loads(path.read_text())
        runs = [RunResult(**r) for r in data.pop("runs")]
        results = Results(**data, runs=runs)
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise ResultsError(f"{path} is not a benchmark results file ({type(err).__name__}: "
                           f"{str(err).splitlines()[0] if str(err) else ''}); expected the fields "
                           f"{[f.name for f in fields(Results)]}") from None
    problem = _first_problem(results)
    if problem:
        raise ResultsError(f"{path}: {problem}; the file was edited or written by something else")
    return results


def _first_problem(results: Results) -> str | None:
    if not isinstance(results.streams, dict) or not all(isinstance(s, dict) and isinstance(s.get("num_tasks"), int)
                                                        for s in results.streams.values()):
        return f"streams={results.streams!r} is not {{name: {{data, num_tasks, steps_per_task}}}}"
    seeds = set(results.seeds) | set(results.tuning_seeds)
    for run in results.runs:
        what = f"run {run.stream}/{run.method}/{run.setting or 'default'}/seed {run.seed}"
        if run.stream not in results.streams:
            return f"{what} names a stream the file does not describe"
        if run.seed not in seeds:
            return f"{what}: seed {run.seed} is neither a ranking nor a tuning seed"
        numbers = [*run.accuracy, *run.online_accuracy]
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and 0 <= v <= 1
                   for v in numbers):
            return f"{what}: an accuracy outside [0, 1] or not a number"
        tasks = results.streams[run.stream]["num_tasks"] if run.seed in results.seeds else None
        if tasks is not None and len(run.accuracy) != tasks:
            return f"{what}: {len(run.accuracy)} accuracies for {tasks} tasks"
        if not isinstance(run.cpu_seconds, (int, float)) or not math.isfinite(run.cpu_seconds) or run.cpu_seconds < 0:
            return f"{what}: cpu_seconds={run.cpu_seconds!r}"
    return None


def check_comparable(shipped: Results, mine: Results) -> None:
    """Raise ``ValueError`` naming what differs when ``mine``'s runs would be paired with ``shipped`` runs of
    other settings (stream, tasks, steps, seeds, the sweep's seeds and tasks)."""
    differences = [f"{what}: yours {getattr(mine, what)}, shipped {getattr(shipped, what)}"
                   for what in ("streams", "seeds", "tuning_seeds", "tuning_tasks")
                   if getattr(mine, what) != getattr(shipped, what)]
    if differences:
        raise ValueError("the shipped baseline runs were made with other settings, so your runs cannot be paired "
                         f"with them ({'; '.join(differences)}); use the shipped settings (the defaults), or add "
                         "--rerun-baselines to run warm, reset and the other methods at yours")
