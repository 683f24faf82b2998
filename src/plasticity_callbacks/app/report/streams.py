"""The task-stream part of ``plasticity-report``: a sweep of ``experiment=continual_digits`` runs as a
ranking table, a sensitivity table and one figure.

Every run's :class:`~callbacks.task_metrics.TaskMetrics` wrote
``logs/tasks.csv`` (one row per task) and ``logs/stream.json`` (method, seed, settings). Runs are
grouped by method (plus any other override but the seed), and the report gives:

- ``report.md``: the ranking table (per group, mean ± std over seeds; ranked by end-of-task accuracy
  over the last ``k`` tasks): that accuracy, the slope of end-of-task accuracy over the tasks, online
  accuracy and loss over all tasks, and over the last ``k`` tasks retained accuracy on earlier tasks
  (stability) and probe accuracy; then a diagnostics table (dormant units, feature rank, weight and gradient norms, first
  versus last ``k`` tasks); where a method ran with several settings of one hyperparameter, its
  best setting and the spread of late end-of-task accuracy across the settings.
- ``stream_metrics.png``: one panel per metric against the task index, one line per group (mean over
  seeds, a band of ± one std where two or more seeds ran), the end-of-task error ``1 − accuracy``
  on a log scale, the stream's chance level on the accuracy panels (:func:`chance_level`: 1/10 for the
  digits, 1/256 for the LM stream's random last byte, no line where a stream has none).

Example:
    >>> text, figures = build_stream_report(Path("multirun/2026-01-01/12-00-00"))
"""
from __future__ import annotations

import csv
import json
import math
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from matplotlib.ticker import MaxNLocator

from ...callbacks.figures import plt
from .metric_logs import reading
from .runs import LINE_STYLES, MARKERS, mean_std, read_overrides

# (column, title, y label): the figure's panels, in reading order
PANELS = [("online_accuracy", "online accuracy (mean over the task's steps)", "accuracy"),
          ("accuracy", "end-of-task accuracy", "accuracy"),
          ("error", "end-of-task error, log scale", "1 − accuracy"),
          ("retained_accuracy", "stability: accuracy on the previous tasks", "accuracy"),
          ("probe_accuracy", "plasticity probe: refit of a fixed task", "accuracy"),
          ("online_loss", "online training loss", "cross-entropy (nats)"),
          ("dormant", "dormant units (τ = 0.025)", "fraction of hidden units"),
          ("feature_rank", "feature rank, last hidden layer", "effective rank"),
          ("weight_norm", "weight norm", "L2 norm of all parameters")]
ACCURACY_PANELS = {"online_accuracy", "accuracy", "retained_accuracy", "probe_accuracy"}


@dataclass
class StreamRun:
    path: Path
    label: str
    seed: int
    info: dict
    tasks: list[dict[str, float]]  # one row per task, in task order
    overrides: dict[str, str] = field(default_factory=dict)  # from .hydra/overrides.yaml, seed left out
    chance: float | None = None  # a uniform guess's accuracy on the stream's labels (:func:`chance_level`)

    @property
    def method(self) -> str:
        return str(self.info.get("method"))


def chance_level(run_dir: Path, info: dict) -> float | None:
    """The accuracy of a uniform guess at the run's labels: ``stream.json``'s ``chance`` (the stream's own,
    recorded by TaskMetrics), else the ``chance`` of the stream that the run's stored config
    (``.hydra/config.yaml``, its ``data:``) builds; None when neither tells (no chance line is drawn).

    A run folder is data: its config builds a stream only when the ``_target_`` is one of this package's and
    no argument names a ``_target_`` of its own (instantiating a config runs whatever it names)."""
    if "chance" in info:
        return None if info["chance"] is None else float(info["chance"])
    config = run_dir / ".hydra" / "config.yaml"
    if not config.is_file():
        return None
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        data = OmegaConf.load(config).get("data")
        if data is None or not _our_target_only(OmegaConf.to_container(data, resolve=True)):
            return None
        stream = instantiate(data, _recursive_=False)
    except (InstantiationException, OmegaConfBaseException):  # a config of another version: no level known
        return None
    chance = getattr(stream, "chance", None)
    return None if chance is None else float(chance)


def _our_target_only(spec) -> bool:
    """``spec`` names a ``_target_`` of this package at its top and none below."""
    def nested_targets(value) -> bool:
        if isinstance(value, dict):
            return "_target_" in value or any(nested_targets(v) for v in value.values())
        return isinstance(value, list) and any(nested_targets(v) for v in value)

    target = spec.get("_target_") if isinstance(spec, dict) else None
    return (isinstance(target, str) and target.split(".")[0] == __name__.split(".")[0]
            and not any(nested_targets(v) for k, v in spec.items() if k != "_target_"))


def has_stream_runs(root: Path) -> bool:
    return any(Path(root).rglob("stream.json"))


def find_stream_runs(root: Path) -> list[StreamRun]:
    runs = []
    for info_file in sorted(Path(root).rglob("stream.json")):
        tasks_file = info_file.with_name("tasks.csv")
        if not tasks_file.is_file():
            continue
        with reading(info_file, "a stream record"):
            info = json.loads(info_file.read_text())
            int(info["seed"])
        with reading(tasks_file, "a task table"), tasks_file.open(newline="") as f:
            rows = [{k: float(v) if v != "" else math.nan for k, v in row.items()} for row in csv.DictReader(f)]
            missing = sorted({"task", "accuracy"} - set(rows[0])) if rows else []
            if missing:
                raise KeyError(f"no column {missing}")
        tasks = sorted(rows, key=lambda r: r["task"])
        if not tasks:
            continue
        for row in tasks:
            row["error"] = 1.0 - row["accuracy"]
        run_dir = next((p for p in info_file.parents if (p / ".hydra").is_dir()), info_file.parent)
        runs.append(StreamRun(run_dir, str(info.get("method")), int(info["seed"]), info, tasks,
                              read_overrides(run_dir), chance_level(run_dir, info)))
    # A group is a method plus the overrides that vary across the sweep (not the seed, not the method
    # choice itself): shared ones (data.num_tasks=4 ...) say nothing about a method.
    keys = sorted({k for r in runs for k in r.overrides if k != "method"})
    varying = [k for k in keys if len({r.overrides.get(k) for r in runs}) > 1]
    for run in runs:
        run.label = " ".join([run.label, *(run.overrides[k].removeprefix("method.callbacks.")
                                           for k in varying if k in run.overrides)])
    return runs


def accuracy_slope(values: list[float]) -> float:
    """Least-squares slope of ``values`` against their index (change per task); NaN for fewer than two."""
    n = len(values)
    if n < 2:
        return math.nan
    mean_x, mean_y = (n - 1) / 2, statistics.fmean(values)
    return sum((i - mean_x) * (v - mean_y) for i, v in enumerate(values)) / sum((i - mean_x) ** 2 for i in range(n))


def finite_mean(values) -> float:
    values = [v for v in values if math.isfinite(v)]
    return statistics.fmean(values) if values else math.nan


def run_summary(run: StreamRun, k: int) -> dict[str, float]:
    """One run's ranking numbers: online accuracy and loss over all tasks, the rest over the last ``k``."""
    last = run.tasks[-k:]
    return {"online_accuracy": finite_mean(t.get("online_accuracy", math.nan) for t in run.tasks),
            "online_loss": finite_mean(t.get("online_loss", math.nan) for t in run.tasks),
            "accuracy": finite_mean(t["accuracy"] for t in last),
            "retained_accuracy": finite_mean(t.get("retained_accuracy", math.nan) for t in last),
            "probe_accuracy": finite_mean(t.get("probe_accuracy", math.nan) for t in last),
            "slope": 100 * accuracy_slope([t["accuracy"] for t in run.tasks]),
            "seconds": float(run.info.get("seconds", math.nan))}


# the ranking's name for it too: a fit over the stream's tasks, not a change it forecasts for a longer one
SLOPE_COLUMN = "acc slope ×100 (per task, fit over the stream)"
RANK_COLUMNS = [("accuracy", "end-of-task acc (last {k})", 3), ("slope", SLOPE_COLUMN, 3),
                ("online_accuracy", "online acc (all tasks)", 3), ("online_loss", "online loss (all tasks)", 3),
                ("retained_accuracy", "retained acc (last {k})", 3), ("probe_accuracy", "probe acc (last {k})", 3),
                ("seconds", "seconds", 0)]


def cell(values: list[float], digits: int) -> str:
    """``mean ± std`` over seeds; the mean alone for one seed (a std of one value says nothing)."""
    mean, std = mean_std([v for v in values if math.isfinite(v)] or [math.nan])
    if not math.isfinite(mean):
        return "—"
    return f"{mean:.{digits}f}" + (f" ± {std:.{digits}f}" if len(values) > 1 else "")


def groups_of(runs: list[StreamRun]) -> dict[str, list[StreamRun]]:
    groups: dict[str, list[StreamRun]] = defaultdict(list)
    for run in runs:
        groups[run.label].append(run)
    return dict(groups)


def last_k(runs: list[StreamRun], k: int | None) -> int:
    """``k`` as given, else a quarter of the shortest stream (at least one task)."""
    shortest = min(len(r.tasks) for r in runs)
    return max(1, min(k or shortest // 4, shortest))


def ranking_table(runs: list[StreamRun], k: int | None = None) -> str:
    """Markdown: one row per group, best end-of-task accuracy over the last ``k`` tasks first (what is left
    late in the stream; the all-task online average beside it rewards the early tasks)."""
    k = last_k(runs, k)
    summaries = {label: [run_summary(r, k) for r in members] for label, members in groups_of(runs).items()}
    ranked = sorted(summaries, key=lambda g: -finite_mean(s["accuracy"] for s in summaries[g]))
    header = ["rank", "method", "seeds", *(title.format(k=k) for _, title, _ in RANK_COLUMNS)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for rank, label in enumerate(ranked, 1):
        rows = summaries[label]
        cells = [str(rank), label, str(len(rows)), *(cell([s[key] for s in rows], digits)
                                                      for key, _, digits in RANK_COLUMNS)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def diagnostics_table(runs: list[StreamRun], k: int | None = None) -> str:
    """Markdown: per group, each diagnostic averaged over the first and over the last ``k`` tasks."""
    k = last_k(runs, k)
    shown = [("dormant", 3), ("feature_rank", 1), ("weight_norm", 1), ("grad_norm", 2)]
    header = ["method", *(f"{name} {part} {k}" for name, _ in shown for part in ("first", "last"))]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for label, members in sorted(groups_of(runs).items()):
        cells = [label]
        for name, digits in shown:
            for part in (slice(0, k), slice(-k, None)):
                cells.append(cell([finite_mean(t.get(name, math.nan) for t in r.tasks[part]) for r in members],
                                  digits))  # a diagnostic a table lacks: shown as —
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def sensitivity_table(runs: list[StreamRun], k: int | None = None) -> str | None:
    """Markdown: per method run with several settings, its best (by end-of-task accuracy over the last ``k``
    tasks) and the spread."""
    k = last_k(runs, k)
    by_method: dict[str, dict[str, list[float]]] = defaultdict(dict)
    for label, members in groups_of(runs).items():
        by_method[members[0].method][label] = [run_summary(r, k)["accuracy"] for r in members]
    lines = []
    for method, settings in sorted(by_method.items()):
        if len(settings) < 2:
            continue
        means = {label: finite_mean(values) for label, values in settings.items()}
        best = max(means, key=means.get)
        worst = min(means, key=means.get)
        lines.append(f"| {method} | {len(settings)} | {best} | {cell(settings[best], 3)} | {worst} | "
                     f"{means[best] - means[worst]:.3f} |")
    if not lines:
        return None
    head = [f"| method | settings | best setting | its end-of-task acc (last {k}) | worst setting | spread (best − worst) |",
            "|---|---|---|---|---|---|"]
    return "\n".join(head + lines)


def shared_chance(runs: list[StreamRun]) -> float | None:
    """The chance level the runs share; None when it is unknown or they differ (no line is drawn)."""
    levels = {r.chance for r in runs}
    return levels.pop() if len(levels) == 1 else None


def plot_stream(runs: list[StreamRun], path: Path) -> Path:
    """Save :func:`stream_figure` to ``path``."""
    fig = stream_figure(runs)
    fig.savefig(path, dpi=90, bbox_inches="tight")
    plt.close(fig)
    return path


def stream_figure(runs: list[StreamRun]):
    """One panel per metric against the task index; one line per group (mean over seeds); the runs' shared
    chance level dotted on the accuracy panels (and ``1 − chance`` on the error panel)."""
    groups = groups_of(runs)
    seeds = sorted({len(m) for m in groups.values()})
    panels = [p for p in PANELS if any(math.isfinite(t.get(p[0], math.nan)) for r in runs for t in r.tasks)]
    columns = 3
    fig, axes = plt.subplots(math.ceil(len(panels) / columns), columns, figsize=(15, 3.6 * math.ceil(len(panels) / 3)),
                             squeeze=False)
    n_tasks = min(len(r.tasks) for r in runs)
    chance = shared_chance(runs)
    for ax, (name, title, ylabel) in zip(axes.flat, panels):
        for index, label in enumerate(sorted(groups)):
            members = groups[label]
            points = [(t, mean_std([r.tasks[t][name] for r in members])) for t in range(n_tasks)]
            points = [(t, m, s) for t, (m, s) in points if math.isfinite(m)]
            if not points:
                continue
            tasks, mean, std = zip(*points)
            line, = ax.plot(tasks, mean, linestyle=LINE_STYLES[index % len(LINE_STYLES)],
                            marker=MARKERS[index % len(MARKERS)], markevery=max(1, len(tasks) // 12),
                            markersize=4, label=f"{label} (n={len(members)})")
            if len(members) > 1:
                low = [max(m - s, 1e-4) if name == "error" else m - s for m, s in zip(mean, std)]
                ax.fill_between(tasks, low, [m + s for m, s in zip(mean, std)], color=line.get_color(),
                                alpha=0.15, linewidth=0)
        if name in ACCURACY_PANELS:
            if chance is not None:
                ax.axhline(chance, color="grey", linestyle=":", linewidth=1)
            ax.set_ylim(0, 1.02)
        if name == "error":
            ax.set_yscale("log")
            if chance is not None:
                ax.axhline(1 - chance, color="grey", linestyle=":", linewidth=1)
        ax.set(title=title, xlabel="task", ylabel=ylabel)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8, frameon=False)
    info = runs[0].info
    band = "band ± 1 std over seeds" if seeds[-1] > 1 else "one seed, no band"
    fig.suptitle(f"{info.get('stream')}: {info.get('num_tasks')} tasks × {info.get('steps_per_task')} steps, "
                 f"mean over n = {'/'.join(map(str, seeds))} seeds ({band})"
                 + (f"; dotted: chance ({chance:.3g})" if chance is not None else "; no chance level known"))
    fig.tight_layout()
    return fig


def build_stream_report(root: Path, out: Path | None = None, k: int | None = None) -> tuple[str, list[Path]]:
    """Write ``report.md`` and ``stream_metrics.png`` under ``out`` (default ``root/report``)."""
    runs = find_stream_runs(root)
    if not runs:
        raise FileNotFoundError(f"no task-stream runs (logs/stream.json with tasks.csv) under {root}")
    out = out or Path(root) / "report"
    out.mkdir(parents=True, exist_ok=True)
    figure = plot_stream(runs, out / "stream_metrics.png")
    info, k = runs[0].info, last_k(runs, k)
    sensitivity = sensitivity_table(runs, k)
    text = "\n".join([
        f"# Task stream: {len(runs)} runs under {root}", "",
        f"{info.get('stream')}, {info.get('num_tasks')} tasks × {info.get('steps_per_task')} steps of batch "
        f"{info.get('batch_size')}. Mean ± std over seeds (the mean alone for one seed). Online = mean over a "
        "task's training steps of the batch's accuracy before its update; end-of-task = on the task's evaluation "
        f"data at its end; retained = on the previous {info.get('stability_tasks', 3)} tasks' evaluation data; "
        f"probe = a fixed random-label task refit for {info.get('probe_steps', 0)} Adam steps from the task's end "
        "state; acc slope ×100 = 100 × the least-squares slope of end-of-task accuracy against the task, fit over "
        "the stream's tasks (a trend over them, not a forecast of a longer stream); seconds = one run's training "
        "time. Ranked by end-of-task accuracy over "
        f"the last {k} tasks; plasticity-benchmark adds seed-paired confidence intervals.", "",
        ranking_table(runs, k), "",
        *([f"## Sensitivity (end-of-task accuracy over the last {k} tasks)", "", sensitivity, ""] if sensitivity else []),
        "## Diagnostics", "", diagnostics_table(runs, k), "", f"![{figure.stem}]({figure.name})", "",
    ])
    (out / "report.md").write_text(text)
    return text, [figure]
