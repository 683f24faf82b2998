"""The benchmark's figure: per stream, end-of-task accuracy against the task (mean over the ranking seeds),
and the seed-paired difference from full reset on the late-stream accuracy with its 95 % interval.

Example:
    >>> plot_ranking(load_results(SHIPPED_RESULTS), k=5, path=Path("ranking.png"))
"""
from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path

from ...callbacks.figures import new_figure
from ..report.runs import LINE_STYLES, MARKERS
from .metrics import late_stream_accuracy, paired_difference
from .results import Results
from .table import ordered_methods


def plot_ranking(results: Results, k: int, path: Path) -> Path:
    """Write the figure to ``path``: a column per stream, accuracy curves on top, the forest plot below."""
    labels = ordered_methods(results, k)
    streams = list(results.streams)
    fig = new_figure(figsize=(7 * len(streams), 5 + 0.28 * len(labels)))
    axes = fig.subplots(2, len(streams), squeeze=False, height_ratios=[5, 0.28 * len(labels) + 1])
    for column, stream in enumerate(streams):
        curves: dict[str, list[list[float]]] = defaultdict(list)
        late: dict[str, dict[int, float]] = defaultdict(dict)
        for run in results.ranking_runs():
            if run.stream == stream:
                curves[run.method].append(run.accuracy)
                late[run.method][run.seed] = late_stream_accuracy(run.accuracy, k)
        top, bottom = axes[0, column], axes[1, column]
        for index, label in enumerate(labels):
            if label in curves:
                mean = [statistics.fmean(task) for task in zip(*curves[label])]
                top.plot(range(len(mean)), mean, color=f"C{index % 10}", linestyle=LINE_STYLES[index // 10 % 4],
                         marker=MARKERS[index % len(MARKERS)], markersize=3, label=label)
        settings = results.streams[stream]
        top.set(title=f"{stream}: {settings['num_tasks']} tasks × {settings['steps_per_task']} steps "
                      f"(mean over {len(results.seeds)} seeds)", xlabel="task", ylabel="end-of-task accuracy",
                ylim=(0, 1.02))
        top.axvspan(settings["num_tasks"] - k - 0.5, settings["num_tasks"] - 0.5, color="grey", alpha=0.1)
        top.grid(alpha=0.3)
        reset = late.get("reset", {})
        for row, label in enumerate(labels):
            seeds = sorted(set(late.get(label, {})) & set(reset))
            if label == "reset" or not seeds:
                continue
            diff = paired_difference([late[label][s] for s in seeds], [reset[s] for s in seeds])
            low, high = (diff.low, diff.high) if diff.seeds > 1 else (diff.mean, diff.mean)
            bottom.errorbar(diff.mean, row, xerr=[[diff.mean - low], [high - diff.mean]], fmt="o",
                            color=f"C{row % 10}", capsize=3)
        bottom.axvline(0, color="grey", linewidth=1)
        bottom.set_yticks(range(len(labels)), labels, fontsize=8)
        bottom.set_ylim(len(labels) - 0.5, -0.5)
        bottom.set(xlabel=f"end-of-task acc (last {k}) − reset's, seed-paired, 95 % CI")
        bottom.grid(alpha=0.3, axis="x")
    handles, names = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, names, loc="upper left", bbox_to_anchor=(1.0, 0.98), fontsize=8, frameon=False)
    fig.suptitle("shaded: the last tasks the ranking counts; below: difference from full reset")
    fig.tight_layout()
    fig.savefig(path, dpi=90, bbox_inches="tight")
    return path
