"""The task-stream part of ``plasticity-report``: a sweep of ``experiment=continual_digits`` runs as a
table and one figure.

Every run's :class:`~plasticity_callbacks.callbacks.task_metrics.TaskMetrics` wrote
``logs/tasks.csv`` (one row per task) and ``logs/stream.json`` (method, seed, settings). Runs are
grouped by method (plus any other override but the seed), and the report gives:

- ``report.md``: per method, mean ± std over seeds of each metric averaged over the first
  and over the last ``k`` tasks (``k`` = 3, or fewer on a short stream);
- ``stream_metrics.png``: each metric against the task index, one line per method (mean over
  seeds), a band of ± one standard deviation.

Example:
    >>> text, figures = build_stream_report(Path("multirun/2026-01-01/12-00-00"))
"""
from __future__ import annotations

import csv
import json
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from matplotlib.ticker import MaxNLocator

from ..core.figures import plt
from .report import mean_std, read_overrides

METRICS = [("accuracy", "end-of-task accuracy"), ("dormant", "dormant fraction (τ = 0.025)"),
           ("feature_rank", "feature rank (last hidden layer)"), ("stable_rank", "stable rank (last hidden layer)"),
           ("weight_norm", "weight norm"), ("grad_norm", "gradient norm (mean over the task)")]
METHOD_ORDER = ["warm", "reset", "sp", "fire_exact", "fire", "dash", "redo"]


@dataclass
class StreamRun:
    path: Path
    label: str
    seed: int
    info: dict
    tasks: list[dict[str, float]]  # one row per task, in task order
    overrides: dict[str, str] = field(default_factory=dict)  # from .hydra/overrides.yaml, seed left out


def has_stream_runs(root: Path) -> bool:
    return any(Path(root).rglob("stream.json"))


def find_stream_runs(root: Path) -> list[StreamRun]:
    runs = []
    for info_file in sorted(Path(root).rglob("stream.json")):
        tasks_file = info_file.with_name("tasks.csv")
        if not tasks_file.is_file():
            continue
        info = json.loads(info_file.read_text())
        with tasks_file.open(newline="") as f:
            rows = [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)]
        tasks = sorted(rows, key=lambda r: r["task"])
        if not tasks:
            continue
        run_dir = next((p for p in info_file.parents if (p / ".hydra").is_dir()), info_file.parent)
        runs.append(StreamRun(run_dir, str(info.get("method")), int(info["seed"]), info, tasks,
                              read_overrides(run_dir)))
    # A group is a method plus the overrides that vary across the sweep (not the seed): shared ones
    # (data.num_tasks=4 ...) say nothing about a method.
    keys = sorted({k for r in runs for k in r.overrides})
    varying = [k for k in keys if len({r.overrides.get(k) for r in runs}) > 1]
    for run in runs:
        run.label = " ".join([run.label, *(run.overrides.get(k, f"{k}=(default)") for k in varying)])
    return runs


def _order(labels) -> list[str]:
    def key(label: str):
        name = label.split(" ", 1)[0]
        return (METHOD_ORDER.index(name) if name in METHOD_ORDER else len(METHOD_ORDER), label)

    return sorted(labels, key=key)


def stream_table(runs: list[StreamRun], k: int = 3) -> str:
    """Markdown: per method, mean ± std over seeds of each metric's average over the first / last ``k`` tasks."""
    groups: dict[str, list[StreamRun]] = defaultdict(list)
    for run in runs:
        groups[run.label].append(run)
    shortest = min(len(r.tasks) for r in runs)
    k = max(1, min(k, shortest // 2 or 1))
    shown = [("accuracy", 3), ("dormant", 3), ("feature_rank", 1), ("weight_norm", 1), ("grad_norm", 2)]
    columns = [f"{name} {part} {k}" for name, _ in shown for part in ("first", "last")]
    header = ["method", "seeds", *columns, "seconds"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for label in _order(groups):
        members = groups[label]
        cells = [label, str(len(members))]
        for name, digits in shown:
            for part in (slice(0, k), slice(-k, None)):
                mean, std = mean_std([statistics.fmean(t[name] for t in r.tasks[part]) for r in members])
                cells.append(f"{mean:.{digits}f} ± {std:.{digits}f}")
        mean, std = mean_std([float(r.info.get("seconds", 0.0)) for r in members])
        cells.append(f"{mean:.0f} ± {std:.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_stream(runs: list[StreamRun], path: Path) -> Path:
    """Each metric against the task index; one line per method (mean over seeds), band = ± one std."""
    groups: dict[str, list[StreamRun]] = defaultdict(list)
    for run in runs:
        groups[run.label].append(run)
    fig, axes = plt.subplots(2, 3, figsize=(13, 7), squeeze=False)
    for ax, (name, title) in zip(axes.flat, METRICS):
        for label in _order(groups):
            members = groups[label]
            n_tasks = min(len(r.tasks) for r in members)
            tasks = list(range(n_tasks))
            per_task = [[r.tasks[t][name] for r in members] for t in tasks]
            mean, std = zip(*(mean_std(v) for v in per_task))
            line, = ax.plot(tasks, mean, marker=".", label=f"{label} (n={len(members)})")
            ax.fill_between(tasks, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                            color=line.get_color(), alpha=0.2, linewidth=0)
        ax.set(title=title, xlabel="task")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    info = runs[0].info
    fig.suptitle(f"{info.get('stream')}: {info.get('num_tasks')} tasks × {info.get('steps_per_task')} steps "
                 f"(mean over seeds, band ± 1 std)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def build_stream_report(root: Path, out: Path | None = None, k: int = 3) -> tuple[str, list[Path]]:
    """Write ``report.md`` and ``stream_metrics.png`` under ``out`` (default ``root/report``)."""
    runs = find_stream_runs(root)
    if not runs:
        raise FileNotFoundError(f"no task-stream runs (logs/stream.json with tasks.csv) under {root}")
    out = out or Path(root) / "report"
    out.mkdir(parents=True, exist_ok=True)
    figure = plot_stream(runs, out / "stream_metrics.png")
    info = runs[0].info
    text = "\n".join([
        f"# Task stream: {len(runs)} runs under {root}", "",
        f"{info.get('stream')}, {info.get('num_tasks')} tasks × {info.get('steps_per_task')} steps of batch "
        f"{info.get('batch_size')}. Mean ± std over seeds of each metric averaged over the first and the last "
        "tasks, measured at each task's end; seconds = training time of one run.", "",
        stream_table(runs, k), "", f"![{figure.stem}]({figure.name})", "",
    ])
    (out / "report.md").write_text(text)
    return text, [figure]
