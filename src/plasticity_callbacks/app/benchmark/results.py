"""What a benchmark run keeps: the streams it ran, and per (stream, method, setting, seed) the per-task
accuracies and the CPU seconds, in one JSON file.

The package ships the baselines' file (``benchmark_results/ranking_runs.json``), so a user's method is
placed against them, paired by seed, without re-running them; :func:`check_comparable` refuses to pair
runs of unlike settings (another stream length, other seeds) instead of comparing them silently.

Example:
    >>> shipped = load_results(SHIPPED_RESULTS)
    >>> sorted({r.method for r in shipped.runs})[:3]
    ['cbp', 'dash', 'fire']
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ... import __version__

SHIPPED_RESULTS = Path(__file__).resolve().parents[1] / "benchmark_results" / "ranking_runs.json"


@dataclass(frozen=True)
class Stream:
    """One task stream of the benchmark, run through ``experiment=continual_digits``."""

    name: str            # the column's name: memorization, generalization
    data: str            # its Hydra data config (configs/data/<data>.yaml)
    num_tasks: int
    steps_per_task: int
    measures: str        # what its end-of-task accuracy is measured on, for the table's caption

    def overrides(self) -> list[str]:
        return [f"data={self.data}", f"data.num_tasks={self.num_tasks}", f"data.steps_per_task={self.steps_per_task}",
                f"trainer.log_every_n_steps={self.steps_per_task}"]

    def settings(self) -> dict:
        """What must match for two runs of this stream to be compared."""
        return {"data": self.data, "num_tasks": self.num_tasks, "steps_per_task": self.steps_per_task}


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
        """The method as a table row names it: ``cbp`` or ``cbp (replacement_rate=0.001, tuned)``."""
        if not self.setting:
            return self.method
        key, _, value = self.setting.partition("=")
        return f"{self.method} ({key.rsplit('.', 1)[-1]}={value}, tuned)"


@dataclass
class Results:
    """Everything one benchmark run measured, and the settings it measured it with."""

    streams: dict[str, dict]       # stream name -> Stream.settings()
    seeds: list[int]               # the ranking seeds
    tuning_seeds: list[int]        # the seeds of the sensitivity sweep (never ranking seeds)
    tuning_tasks: int              # the sweep's memorization stream: its tasks (steps as the ranking's)
    tuned: dict[str, str] = field(default_factory=dict)  # method -> its best setting, where not its default
    runs: list[RunResult] = field(default_factory=list)
    version: str = __version__

    def ranking_runs(self) -> list[RunResult]:
        return [r for r in self.runs if r.seed in self.seeds]

    def tuning_runs(self) -> list[RunResult]:
        return [r for r in self.runs if r.seed in self.tuning_seeds]


def save_results(results: Results, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = asdict(results)
    data["runs"] = sorted(data["runs"], key=lambda r: (r["stream"], r["method"], r["setting"], r["seed"]))
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


def load_results(path: Path) -> Results:
    data = json.loads(Path(path).read_text())
    runs = [RunResult(**r) for r in data.pop("runs")]
    return Results(**data, runs=runs)


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
