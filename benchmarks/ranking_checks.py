"""Checks of the ``plasticity-benchmark`` ranking beyond its 20-task streams and 5 seeds ([long_stream.md]).

Every method runs at the setting the shipped sweep selected for it (``ranking_runs.json``'s ``tuned``), through
the benchmark's own jobs (``experiment=continual_digits``, one thread per run, ``--jobs`` processes):

    python benchmarks/ranking_checks.py long --tasks 100 --seeds 0 1 2 --jobs 2   # memorization, 100 tasks
    python benchmarks/ranking_checks.py fresh --seeds 0 1 2 --jobs 2              # fresh images per task
    python benchmarks/ranking_checks.py spread --jobs 2                           # generalization: seeds × splits
    python benchmarks/ranking_checks.py multiplicity                              # the shipped table, adjusted

``long``: the memorization stream (1024 images relabeled per task, 100 steps) for ``--tasks`` tasks; the
accuracy over the 5 tasks ending at tasks 20, 50, 100, the task of the windowed curve's peak, and the trend over
the last 25 tasks with its interval over seeds (``rising`` / ``falling`` only where the interval excludes 0).
``fresh``: random labels on images no earlier task saw (``data=digits_fresh_labels``: 20 disjoint blocks of 89
images) beside the same stream with each task's 89 images drawn from all 1797 (images recur across tasks).
``spread``: the generalization stream's top methods and reset on init seeds × held-out split seeds (crossed),
plus further seeds on their own split as the ranking draws it: the gap to reset across seeds and across splits.
``multiplicity``: every interval of the shipped table against its family: Bonferroni intervals and Holm's test.
Each prints its table and writes ``results.json`` (every run, every task) and the figure under ``--out``.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from pathlib import Path

from plasticity_callbacks.app.benchmark.main import Progress, cpu_seconds, quiet
from plasticity_callbacks.app.benchmark.metrics import (holm_rejections, late_stream_accuracy, mean_interval,
                                                        paired_difference, paired_p_value, slope_per_100_tasks,
                                                        windowed_accuracy)
from plasticity_callbacks.app.benchmark.results import (SHIPPED_RESULTS, Results, Stream, load_results, save_results,
                                                        short_setting)
from plasticity_callbacks.app.benchmark.runs import STREAMS, Job
from plasticity_callbacks.app.benchmark.table import BASELINES

K = 5  # the ranking's late-stream window, and the window of every "accuracy at task t"
TREND_TASKS = 25  # "still rising": the slope over this many last tasks, its interval over seeds
LONG_METHODS = ["warm", "reset", "fire_exact", "fire_exact_head", "head_reset", "isometric_reset", "ln_wd", "redo",
                "l2_init", "sp", "dash"]
SPREAD_METHODS = ["reset", "fire_exact", "isometric_reset", "fire_exact_head", "head_reset"]
MEMORIZATION, GENERALIZATION = STREAMS
FRESH = Stream("fresh", "digits_fresh_labels", 20, 25, "the task's own 89 fresh, randomly labeled images")
# The control: as many images per task and the same batches, but drawn from all 1797 (they recur across tasks).
REUSED = Stream("reused", "digits_labels", 20, 25, "the task's own 89 randomly labeled images (recurring)",
                ("data.samples_per_task=89", "data.batch_size=32"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("study", choices=["long", "fresh", "spread", "multiplicity"])
    parser.add_argument("--methods", nargs="+", default=None,
                        help=f"default: long, fresh {LONG_METHODS}; spread {SPREAD_METHODS} (reset always runs)")
    parser.add_argument("--seeds", type=int, nargs="+", default=None,
                        help="init seeds (default: long, fresh 0 1 2; spread 0 1 2 3 4, the ranking's)")
    parser.add_argument("--tasks", type=int, default=100, help="long: tasks of the memorization stream")
    parser.add_argument("--steps", type=int, default=None, help="fresh: steps per task (default 25)")
    parser.add_argument("--split-seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4],
                        help="spread: held-out split seeds, each run with every --seeds seed")
    parser.add_argument("--extra-seeds", type=int, nargs="*", default=[5, 6, 7, 8, 9],
                        help="spread: more seeds, each on its own split (split seed = seed), as the ranking runs")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time, one process and one thread each")
    parser.add_argument("--out", type=Path, default=Path("outputs") / "ranking_checks")
    parser.add_argument("--docs", type=Path, default=None, help="also copy the figure here")
    args = parser.parse_args(argv)
    if args.study == "long" and args.tasks < 2 * TREND_TASKS:
        parser.error(f"--tasks {args.tasks}: a long stream has at least {2 * TREND_TASKS} (its trend is taken over "
                     f"the last {TREND_TASKS})")
    if args.jobs < 1:
        parser.error(f"--jobs {args.jobs}: at least 1")
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps {args.steps}: at least 1")
    if args.seeds is None:
        args.seeds = [0, 1, 2, 3, 4] if args.study == "spread" else [0, 1, 2]
    if args.study == "spread" and set(args.extra_seeds) & set(args.seeds):
        parser.error(f"--extra-seeds {args.extra_seeds} overlap --seeds {args.seeds}: each seed is crossed with "
                     "the split seeds or runs on its own split, not both")
    methods = args.methods or (SPREAD_METHODS if args.study == "spread" else LONG_METHODS)
    args.methods = ["reset", *(m for m in methods if m != "reset")]
    return args


def selected_settings(stream: str, methods: list[str]) -> dict[str, str]:
    """method -> the setting the shipped sweep selected on ``stream`` (``model.lr=0.003``), refusing a method
    the shipped runs did not tune."""
    tuned = load_results(SHIPPED_RESULTS, require_checksum=True).tuned
    missing = [m for m in methods if stream not in tuned.get(m, {})]
    if missing:
        raise SystemExit(f"ranking_checks: {missing} have no selected setting on {stream} in the shipped runs; "
                         f"known: {sorted(tuned)}")
    return {m: tuned[m][stream] for m in methods}


def jobs_for(study: str, args: argparse.Namespace) -> tuple[list[Job], list[Stream]]:
    if study == "long":
        stream = Stream("memorization_long", MEMORIZATION.data, args.tasks, MEMORIZATION.steps_per_task,
                        MEMORIZATION.measures)
        settings = selected_settings("memorization", args.methods)
        return [Job(stream, m, settings[m], s) for s in args.seeds for m in args.methods], [stream]
    if study == "fresh":
        streams = [Stream(s.name, s.data, s.num_tasks, args.steps or s.steps_per_task, s.measures, s.data_overrides)
                   for s in (FRESH, REUSED)]
        settings = selected_settings("memorization", args.methods)
        return [Job(st, m, settings[m], s) for s in args.seeds for m in args.methods for st in streams], streams
    settings = selected_settings("generalization", args.methods)
    splits = sorted({*args.split_seeds, *args.extra_seeds})
    streams = {p: Stream(f"generalization_split{p}", GENERALIZATION.data, GENERALIZATION.num_tasks,
                         GENERALIZATION.steps_per_task, GENERALIZATION.measures, (f"data.split_seed={p}",))
               for p in splits}
    # a seed on its own split is the shipped run (split seed = seed is the stream's default): read, not rerun
    shipped = set(load_results(SHIPPED_RESULTS, require_checksum=True).seeds)
    cells = [(s, p) for s in args.seeds for p in args.split_seeds] + [(s, s) for s in args.extra_seeds]
    cells = [(s, p) for s, p in dict.fromkeys(cells) if not (s == p and s in shipped)]
    return [Job(streams[p], m, settings[m], s) for s, p in cells for m in args.methods], list(streams.values())


def per_method(results: Results, stream: str) -> dict[str, dict[int, list[float]]]:
    """method -> seed -> end-of-task accuracy per task, on ``stream``."""
    table: dict[str, dict[int, list[float]]] = defaultdict(dict)
    for run in results.runs:
        if run.stream == stream:
            table[run.method][run.seed] = run.accuracy
    return table


def trend(curves: list[list[float]]) -> tuple[str, str]:
    """The slope per 100 tasks over the last ``TREND_TASKS`` tasks, with its interval over seeds, and its word."""
    diff = mean_interval([slope_per_100_tasks(c[-TREND_TASKS:]) for c in curves])
    word = "rising" if diff.low > 0 else "falling" if diff.high < 0 else "flat (interval spans 0)"
    return str(diff), word


def long_report(results: Results) -> str:
    (stream,) = results.streams
    tasks = results.streams[stream]["num_tasks"]
    marks = [t for t in (20, 50, 100, 200) if t <= tasks] + ([tasks] if tasks not in (20, 50, 100, 200) else [])
    curves = per_method(results, stream)
    header = ["method", "setting", "seeds", *(f"acc at task {t} (tasks {t - K + 1}–{t})" for t in marks),
              "peak (task, windowed mean)", "change per 100 tasks, extrapolated from tasks 1–20",
              f"measured change, task 20 → {tasks}", f"slope per 100 tasks over tasks {tasks - TREND_TASKS + 1}–{tasks}",
              "still rising?"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    order = sorted(curves, key=lambda m: -statistics.fmean(windowed_accuracy(c, tasks, K) for c in curves[m].values()))
    for method in order:
        runs = list(curves[method].values())
        mean_curve = [statistics.fmean(v) for v in zip(*runs)]
        windowed = [windowed_accuracy(mean_curve, t, K) for t in range(K, tasks + 1)]
        peak = max(range(len(windowed)), key=windowed.__getitem__)
        cells = [method, short_setting(setting_of(results, method, stream)), str(len(runs)),
                 *(mean_sd([windowed_accuracy(c, t, K) for c in runs]) for t in marks),
                 f"{peak + K} ({windowed[peak]:.3f})",
                 mean_sd([slope_per_100_tasks(c[:20]) for c in runs]),
                 mean_sd([(windowed_accuracy(c, tasks, K) - windowed_accuracy(c, 20, K)) * 100 / (tasks - 20)
                          for c in runs]) + " per 100",
                 *trend(runs)]
        lines.append("| " + " | ".join(cells) + " |")
    # the first 20 tasks are the ranked stream's (a task's data depends on the seed and its index only)
    shipped = {(r.method, r.setting, r.seed): r.accuracy for r in load_results(SHIPPED_RESULTS).ranking_runs()
               if r.stream == "memorization"}
    same = [max(abs(a - b) for a, b in zip(run.accuracy, shipped[run.method, run.setting, run.seed]))
            for run in results.runs if (run.method, run.setting, run.seed) in shipped]
    if same:
        lines += ["", f"tasks 1–20 against the shipped 20-task runs of the same method, setting and seed ({len(same)} "
                  f"runs): largest |difference| in end-of-task accuracy {max(same):.1e}"]
    return "\n".join(lines)


def fresh_report(results: Results) -> str:
    fresh, reused = (per_method(results, s) for s in results.streams)
    late = {name: {m: {s: late_stream_accuracy(c, K) for s, c in seeds.items()} for m, seeds in table.items()}
            for name, table in (("fresh", fresh), ("reused", reused))}
    header = ["method", "setting", "seeds", f"fresh images: acc (last {K})", "vs warm", "vs reset",
              f"recurring images: acc (last {K})", "vs reset", "fresh − recurring",
              "fresh: acc slope ×100 (per task, 20 tasks)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for method in sorted(late["fresh"], key=lambda m: -statistics.fmean(late["fresh"][m].values())):
        f, r = late["fresh"][method], late["reused"].get(method, {})
        cells = [method, short_setting(setting_of(results, method, "fresh")), str(len(f)),
                 mean_sd(list(f.values())),
                 *(paired(f, late["fresh"].get(b, {})) if method != b else "·" for b in BASELINES),
                 mean_sd(list(r.values())), paired(r, late["reused"].get("reset", {})) if method != "reset" else "·",
                 paired(f, r), mean_sd([slope_per_100_tasks(c) for c in fresh[method].values()])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def spread_report(results: Results, seeds: list[int], splits: list[int], extra: list[int]) -> str:
    """Per method: its gap to reset on the shipped runs, on this run's own-split seeds, and on the crossed
    seeds × splits, across seeds (each seed's gap averaged over the splits) and across splits."""
    late: dict[str, dict[tuple[int, int], float]] = defaultdict(dict)  # method -> (seed, split) -> late acc
    for run in results.runs:
        late[run.method][run.seed, int(run.stream.rsplit("split", 1)[1])] = late_stream_accuracy(run.accuracy, K)
    shipped = load_results(SHIPPED_RESULTS, require_checksum=True)
    for run in shipped.ranking_runs():  # the shipped seeds, each on its own split
        if run.stream == "generalization" and run.method in late:
            late[run.method][run.seed, run.seed] = late_stream_accuracy(run.accuracy, K)
    own_seeds = shipped.seeds
    methods = [m for m in SPREAD_METHODS + sorted(late) if m in late and m != "reset"]
    methods = list(dict.fromkeys(methods))
    family = len(methods)
    header = ["method", f"shipped seeds {own_seeds}, own split", f"seeds {extra}, own split",
              f"all {len(own_seeds) + len(extra)} seeds, own split",
              f"… Bonferroni ({family} gaps: {100 - 5 / family:.2f} %)",
              f"crossed {len(seeds)} seeds × {len(splits)} splits: across seeds", "… across splits",
              "seed-to-seed sd (fixed split)", "split-to-split sd (fixed seed)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    reset = late["reset"]
    for method in methods:
        gap = {cell: late[method][cell] - reset[cell] for cell in late[method] if cell in reset}
        own = [gap[s, s] for s in [*own_seeds, *extra]]
        by_seed = [statistics.fmean(gap[s, p] for p in splits) for s in seeds]
        by_split = [statistics.fmean(gap[s, p] for s in seeds) for p in splits]
        seed_sd = statistics.fmean(statistics.stdev(gap[s, p] for s in seeds) for p in splits)
        split_sd = statistics.fmean(statistics.stdev(gap[s, p] for p in splits) for s in seeds)
        cells = [method, str(mean_interval([gap[s, s] for s in own_seeds])),
                 str(mean_interval([gap[s, s] for s in extra])),
                 str(mean_interval(own)), str(mean_interval(own, 1 - 0.05 / family)), str(mean_interval(by_seed)),
                 str(mean_interval(by_split)), f"{seed_sd:.3f}", f"{split_sd:.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    accuracy = ["", "| method | " + " | ".join(f"acc (last {K}), seeds {g}, own split" for g in (own_seeds, extra))
                + f" | crossed, mean of {len(seeds) * len(splits)} |", "|---|---|---|---|"]
    for method in ["reset", *methods]:
        cells = [mean_sd([late[method][s, s] for s in group]) for group in (own_seeds, extra)]
        crossed = statistics.fmean(late[method][s, p] for s in seeds for p in splits)
        accuracy.append(f"| {method} | {' | '.join(cells)} | {crossed:.3f} |")
    return "\n".join([*lines, *accuracy, "", f"seeds {own_seeds} on their own split: the shipped runs"])


def multiplicity_report() -> str:
    """Every vs-warm / vs-reset interval of the shipped table, as printed (95 %), with a Bonferroni interval for
    the whole family and Holm's test, and the claims whose verdict the adjustment changes."""
    shipped = load_results(SHIPPED_RESULTS, require_checksum=True)
    late: dict[tuple[str, str], dict[int, float]] = defaultdict(dict)
    for run in shipped.ranking_runs():
        late[run.stream, run.method][run.seed] = late_stream_accuracy(run.accuracy, K)
    comparisons = [(stream, method, base) for stream in shipped.streams for base in BASELINES
                   for (st, method) in sorted(late)  # reset vs warm once: not again as warm vs reset
                   if st == stream and method not in BASELINES[:BASELINES.index(base) + 1]]
    m = len(comparisons)
    pairs = {c: ([late[c[0], c[1]][s] for s in shipped.seeds], [late[c[0], c[2]][s] for s in shipped.seeds])
             for c in comparisons}
    p_values = [paired_p_value(*pairs[c]) for c in comparisons]
    holm = holm_rejections(p_values)
    plain = [paired_difference(*pairs[c]) for c in comparisons]
    bonferroni = [paired_difference(*pairs[c], confidence=1 - 0.05 / m) for c in comparisons]
    lines = [f"{m} comparisons ({len(shipped.streams)} streams × every row vs warm and vs reset, warm vs reset "
             f"once; {len(shipped.seeds)} seeds each): {sum(d.excludes_zero for d in plain)} exclude 0 at 95 %, {sum(d.excludes_zero for d in bonferroni)}"
             f" at Bonferroni's {100 * (1 - 0.05 / m):.3f} %, {sum(holm)} rejected by Holm at family-wise 5 %",
             "", "| stream | method | vs | 95 % (as shipped) | p | Bonferroni interval | Holm |", "|---|---|---|---|---|---|---|"]
    for c, p, d, b, h in zip(comparisons, p_values, plain, bonferroni, holm):
        if d.excludes_zero != h or c[0] == "generalization" and c[2] == "reset":
            lines.append(f"| {c[0]} | {c[1]} | {c[2]} | {d} | {p:.2g} | {b} | {'yes' if h else 'no'} |")
    return "\n".join(lines)


def setting_of(results: Results, method: str, stream: str) -> str:
    return next((r.setting for r in results.runs if r.method == method and r.stream == stream), "")


def paired(a: dict[int, float], b: dict[int, float]) -> str:
    seeds = sorted(set(a) & set(b))
    return str(paired_difference([a[s] for s in seeds], [b[s] for s in seeds])) if seeds else "—"


def mean_sd(values: list[float]) -> str:
    spread = f" ± {statistics.stdev(values):.3f}" if len(values) > 1 else ""
    return f"{statistics.fmean(values):.3f}{spread}"


# Matplotlib's ten cycle colours, then four dark ones, so that up to 14 methods each get their own colour.
PALETTE = [f"C{i}" for i in range(10)] + ["black", "navy", "darkgoldenrod", "darkgreen"]


def plot_long(results: Results, path: Path) -> Path:
    """Per method, the end-of-task accuracy per task (mean over seeds, thin) and its 5-task windowed mean."""
    from plasticity_callbacks.app.report.runs import LINE_STYLES
    from plasticity_callbacks.callbacks.figures import new_figure

    (stream,) = results.streams
    tasks = results.streams[stream]["num_tasks"]
    curves = per_method(results, stream)
    fig = new_figure(figsize=(10, 6))
    ax = fig.subplots()
    order = sorted(curves, key=lambda m: -statistics.fmean(windowed_accuracy(c, tasks, K) for c in curves[m].values()))
    for index, method in enumerate(order):
        mean = [statistics.fmean(v) for v in zip(*curves[method].values())]
        color, style = PALETTE[index % len(PALETTE)], LINE_STYLES[index // len(PALETTE) % len(LINE_STYLES)]
        ax.plot(range(1, tasks + 1), mean, color=color, linewidth=0.6, alpha=0.35)
        ax.plot(range(K, tasks + 1), [windowed_accuracy(mean, t, K) for t in range(K, tasks + 1)], color=color,
                linestyle=style, linewidth=1.8, label=f"{method} ({short_setting(setting_of(results, method, stream))})")
    for t in (20, 50, 100):
        if t <= tasks:
            ax.axvline(t, color="grey", linewidth=0.8, alpha=0.5)
    ax.set(xlabel="task", ylabel="end-of-task accuracy", ylim=(0, 1.02), xlim=(1, tasks),
           title=f"memorization, {tasks} tasks × {results.streams[stream]['steps_per_task']} steps, mean over "
                 f"{len(results.seeds)} seeds (bold: mean over the last {K} tasks)")
    ax.grid(alpha=0.3)
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=90, bbox_inches="tight")
    return path


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    quiet()
    if args.study == "multiplicity":
        print(multiplicity_report())
        return
    jobs, streams = jobs_for(args.study, args)
    out = args.out / args.study
    seeds = sorted({j.seed for j in jobs})
    results = Results({s.name: s.settings() for s in streams}, seeds, [], 0)
    print(f"{args.study}: {len(jobs)} runs", flush=True)
    started = cpu_seconds(), time.perf_counter()
    results.runs = Progress(out, None, K, args.jobs).run(jobs)
    save_results(results, out / "results.json")
    if args.study == "long":
        text = long_report(results)
        figure = plot_long(results, out / "long_stream.png")
        if args.docs is not None:
            args.docs.mkdir(parents=True, exist_ok=True)
            (args.docs / figure.name).write_bytes(figure.read_bytes())
    elif args.study == "fresh":
        text = fresh_report(results)
    else:
        text = spread_report(results, args.seeds, args.split_seeds, args.extra_seeds)
    cost = sum(r.cpu_seconds for r in results.runs)
    text += (f"\n\n{len(results.runs)} runs, {cost / 60:.1f} CPU-minutes of training (one thread each, "
             f"{cost / len(results.runs):.1f} CPU s per run)")
    (out / f"{args.study}.md").write_text(text + "\n")
    print(text)
    print(f"this call: {(cpu_seconds() - started[0]) / 60:.1f} CPU-minutes, "
          f"{(time.perf_counter() - started[1]) / 60:.1f} wall minutes; outputs in {out}/")


if __name__ == "__main__":
    main()

