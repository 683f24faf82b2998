"""The benchmark's tables: the ranking (one row per method at its selected setting, late-stream accuracy
first, seed-paired differences against warm start and full reset with 95 % intervals), the README's short
version, the sensitivity sweep (every value's score, per stream), the regime lines and the per-seed rows.

Example:
    >>> print(ranking_table(load_results(SHIPPED_RESULTS), k=5))
"""
from __future__ import annotations

import csv
import io
import statistics
from collections import defaultdict

from ..report.streams import SLOPE_COLUMN
from .metrics import late_stream_accuracy, online_average, paired_difference, slope_per_100_tasks
from .results import Results, RunResult, short_setting

BASELINES = ("warm", "reset")  # every method is compared with these two, seed by seed
PRIMARY = "memorization"       # the stream whose late-stream accuracy orders the table


def summary(run: RunResult, k: int) -> dict[str, float]:
    """One run's numbers: late-stream end-of-task accuracy, its slope, the all-task online average."""
    return {"late": late_stream_accuracy(run.accuracy, k), "slope": slope_per_100_tasks(run.accuracy),
            "online": online_average(run.online_accuracy)}


def by_method(runs: list[RunResult], stream: str, k: int) -> dict[str, dict[int, dict[str, float]]]:
    """method -> seed -> summary, for one stream (a method's ranking runs are all at its selected setting)."""
    table: dict[str, dict[int, dict[str, float]]] = defaultdict(dict)
    for run in runs:
        if run.stream == stream:
            table[run.method][run.seed] = summary(run, k)
    return dict(table)


def mean_std(values: list[float]) -> str:
    if not values:
        return "—"
    spread = f" ± {statistics.stdev(values):.3f}" if len(values) > 1 else ""
    return f"{statistics.fmean(values):.3f}{spread}"


def versus(rows: dict[int, dict[str, float]], baseline: dict[int, dict[str, float]] | None, metric: str = "late") -> str:
    """The seed-paired difference ``rows − baseline`` on ``metric`` with its 95 % interval, over shared seeds."""
    seeds = sorted(set(rows) & set(baseline or {}))
    if not seeds:
        return "—"
    return str(paired_difference([rows[s][metric] for s in seeds], [baseline[s][metric] for s in seeds]))


def ordered_methods(results: Results, k: int) -> list[str]:
    """Every row's method, best late-stream accuracy on the primary stream first."""
    primary = by_method(results.ranking_runs(), PRIMARY, k)
    methods = sorted({r.method for r in results.ranking_runs()})
    score = {m: statistics.fmean(s["late"] for s in primary[m].values()) if m in primary else -1.0 for m in methods}
    return sorted(methods, key=lambda m: -score[m])


def row_setting(results: Results, method: str, stream: str) -> str:
    """The setting a method's row ran at on ``stream`` (``replacement_rate=0.001``), from its ranking runs."""
    settings = sorted({r.setting for r in results.ranking_runs() if r.method == method and r.stream == stream})
    return " / ".join(short_setting(s) for s in settings) if settings else "—"


def caption(results: Results, k: int) -> str:
    """What the ranking table was measured on, in a paragraph above it."""
    streams = "; ".join(f"{name}: {s['data']}, {s['num_tasks']} tasks × {s['steps_per_task']} steps"
                        for name, s in results.streams.items())
    tuning = (f"One row per method, at the setting its sensitivity sweep selected on each stream separately: the "
              f"highest end-of-task accuracy over the last {k} tasks, mean over tuning seeds {results.tuning_seeds} "
              f"(never ranking seeds), on streams of {results.tuning_tasks} tasks (the sweep table below lists "
              "every value's score). " if results.tuned else "Every method file as it is (no sweep). ")
    return (f"Streams: {streams}. Ranking seeds {results.seeds}; mean ± std over them. Ranked by {PRIMARY}'s "
            f"end-of-task accuracy over the last {k} tasks. vs warm / vs reset: the seed-paired difference of "
            "that column from warm start's / full reset's, mean [95 % Student-t interval]. " + tuning +
            f"Package {results.version}.")


def ranking_table(results: Results, k: int) -> str:
    """Markdown: one row per method at its selected setting per stream, ordered by memorization's late-stream
    accuracy."""
    streams = list(results.streams)
    per_stream = {s: by_method(results.ranking_runs(), s, k) for s in streams}
    header = ["rank", "method", "seeds"]
    for stream in streams:
        header += [f"{stream}: setting", f"end-of-task acc (last {k})", "vs warm", "vs reset"]
        if stream == PRIMARY:
            header += [SLOPE_COLUMN, "online acc (all tasks)"]
    header.append("CPU s per run")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    cost = defaultdict(list)
    for run in results.ranking_runs():
        cost[run.method].append(run.cpu_seconds)
    for rank, method in enumerate(ordered_methods(results, k), 1):
        seeds = {seed for s in streams for seed in per_stream[s].get(method, {})}
        cells = [str(rank), method, str(len(seeds))]
        for stream in streams:
            rows = per_stream[stream].get(method, {})
            cells += [row_setting(results, method, stream), mean_std([r["late"] for r in rows.values()]),
                      *(versus(rows, per_stream[stream].get(b)) if method != b else "·" for b in BASELINES)]
            if stream == PRIMARY:
                cells += [mean_std([r["slope"] for r in rows.values()]), mean_std([r["online"] for r in rows.values()])]
        cells.append(f"{statistics.fmean(cost[method]):.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def short_table(results: Results, k: int) -> str:
    """Markdown for the README: per method, its selected setting per stream, the late-stream accuracy of each
    stream and the difference from full reset."""
    streams = list(results.streams)
    per_stream = {s: by_method(results.ranking_runs(), s, k) for s in streams}
    header = ["method", f"setting ({' / '.join(streams)})"]
    for stream in streams:
        header += [f"{stream} (last {k})", "vs reset [95 % CI]"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for method in ordered_methods(results, k):
        settings = [row_setting(results, method, s) for s in streams]
        cells = [f"`{method}`", settings[0] if len(set(settings)) == 1 else " / ".join(settings)]
        for stream in streams:
            rows = per_stream[stream].get(method, {})
            mean = statistics.fmean(r["late"] for r in rows.values()) if rows else float("nan")
            cells += [f"{mean:.3f}", versus(rows, per_stream[stream].get("reset")) if method != "reset" else "·"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def regime_lines(results: Results) -> str | None:
    """Markdown: what each ranked method was designed for and where that does not apply here (its file's
    ``regime:``), in the table's order; None when the results carry none."""
    if not results.regimes:
        return None
    methods = sorted({r.method for r in results.ranking_runs()})
    return "\n".join(["Regimes (each method file's `regime:`):", "",
                      *(f"- `{m}`: {results.regimes.get(m, '(no regime: line in its file)')}" for m in methods)])


def swept_value_order(setting: str) -> tuple:
    """Sort key of ``key=value``: numbers by size (``1e-05`` before ``0.0001``), anything else after, by text."""
    value = setting.partition("=")[2]
    try:
        return (0, float(value), value)
    except ValueError:
        return (1, 0.0, value)


def tuning_table(results: Results, k: int) -> str | None:
    """Markdown: per method swept and per stream, each value's late-stream accuracy (mean over the tuning seeds)
    and the value its row runs at."""
    values: dict[tuple[str, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for run in results.tuning_runs():
        values[run.method, run.stream][run.setting].append(late_stream_accuracy(run.accuracy, k))
    if not values:
        return None
    lines = [f"| method | stream | setting | end-of-task acc (last {k}) per value, mean over {len(results.tuning_seeds)} "
             "tuning seeds | selected |", "|---|---|---|---|---|"]
    order = {stream: index for index, stream in enumerate(results.streams)}
    for (method, stream), settings in sorted(values.items(), key=lambda item: (item[0][0], order.get(item[0][1], 9))):
        key = next(iter(settings)).partition("=")[0]
        cells = [f"{s.partition('=')[2]}: {statistics.fmean(v):.3f}"
                 for s, v in sorted(settings.items(), key=lambda item: swept_value_order(item[0]))]
        chosen = results.tuned.get(method, {}).get(stream)
        lines.append(f"| {method} | {stream} | {key} | {', '.join(cells)} | "
                     f"{chosen.partition('=')[2] if chosen else '—'} |")
    return "\n".join(lines)


def per_seed_csv(results: Results, k: int) -> str:
    """One row per (stream, method, setting, seed): the numbers each table cell is computed from."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["stream", "label", "method", "setting", "seed", f"end_of_task_acc_last_{k}",
                     "acc_slope_per_task_x100", "online_acc_all_tasks", "cpu_seconds"])
    for run in sorted(results.runs, key=lambda r: (r.stream, r.method, r.setting, r.seed)):
        numbers = summary(run, k)
        writer.writerow([run.stream, run.label, run.method, run.setting, run.seed, f"{numbers['late']:.4f}",
                         f"{numbers['slope']:.4f}", f"{numbers['online']:.4f}", f"{run.cpu_seconds:.1f}"])
    return buffer.getvalue()
