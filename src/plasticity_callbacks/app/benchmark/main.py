"""``plasticity-benchmark``: run the task-stream ranking, or place your own method in it.

    plasticity-benchmark                                    # every ranked method, 5 seeds, both streams, the sweep
    plasticity-benchmark --methods mine --config-dir ~/mine # only yours, against the shipped baselines
    plasticity-benchmark --methods mine --config-dir ~/mine --tasks 10 --rerun-baselines  # other settings
    plasticity-benchmark --methods warm sp --seeds 0 1 --tasks 3 --memorization-steps 10 --no-tuning

Every method is tuned the same way: its file's ``sensitivity:`` values (the same number for every method) run on
each stream, as long as the ranked one (``--tuning-tasks``), on the tuning seeds; on each stream separately the
value with the best late-stream accuracy is the one its single row runs at on the ranking seeds. Runs go through
the same Hydra configs as ``plasticity-train experiment=continual_digits``, one after the other in this process on
one thread (``--jobs N``: N processes); each prints a line (stream, method, setting, seed, CPU seconds) when it
ends, and a run folder that finished is not run again. The outputs (``--out``): ``results.json`` (per run, per
task), ``per_seed.csv``, ``ranking.md`` and ``ranking.png``. ``--ship`` writes ``results.json`` into the package's
shipped runs: with ``--methods``, every other method's shipped runs stay in it as they were and the methods named
replace their own.
"""
from __future__ import annotations

from ...extras import require_module

for _module in ("sklearn", "scipy", "hydra", "omegaconf", "matplotlib"):  # one line naming the install instead
    require_module(_module, "digits", "plasticity-benchmark (the digits task streams)")

import argparse
import logging
import resource
import shutil
import statistics
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import replace
from multiprocessing import get_context
from pathlib import Path

import torch

from ..console import configure_run_output
from ...errors import ConfigError
from ..methods import check_method_targets, method_names
from .figure import plot_ranking
from .metrics import late_stream_accuracy
from .results import (SHIPPED_RESULTS, Results, ResultsError, RunResult, check_comparable, load_results,
                      save_results, short_setting)
from .runs import STREAMS, Job, compose_run, configuration, identical_groups, run_job, sweep
from .table import (BASELINES, caption, per_seed_csv, ranking_table, regime_lines, short_table,
                    tuning_table)

README_MARKERS = ("<!-- plasticity-benchmark: table -->", "<!-- plasticity-benchmark: end -->")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="plasticity-benchmark", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("outputs") / "plasticity_benchmark",
                        help="the run folders, results and report (default: ./outputs/plasticity_benchmark)")
    parser.add_argument("--methods", nargs="+", default=None,
                        help="default: every method/<name>.yaml; given: only these run, the others' shipped "
                             "results fill the table")
    parser.add_argument("--config-dir", type=Path, default=None, help="a config folder with more method/*.yaml")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4], help="the ranking seeds")
    parser.add_argument("--tuning-seeds", type=int, nargs="+", default=[100, 101, 102],
                        help="the sensitivity sweep's seeds (none of the ranking seeds; default 100 101 102)")
    parser.add_argument("--no-tuning", action="store_true", help="rank each method file as it is, no sweep")
    parser.add_argument("--tuning-tasks", type=int, default=None,
                        help="the sweep's streams: their tasks (default: the ranked streams' length; steps as theirs)")
    parser.add_argument("--tasks", type=int, default=None, help="tasks of every stream (default: 20)")
    parser.add_argument("--memorization-steps", type=int, default=None, help="steps per task (default: 100)")
    parser.add_argument("--generalization-steps", type=int, default=None, help="steps per task (default: 25)")
    parser.add_argument("--last-k", type=int, default=5, help="the late-stream metric averages the last k tasks")
    parser.add_argument("--rerun-baselines", action="store_true",
                        help="with --methods: run warm and reset too instead of reading the shipped results")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time, one process and one thread each")
    parser.add_argument("--docs", type=Path, default=None, help="also write the tables and the figure here")
    parser.add_argument("--readme", type=Path, default=None,
                        help="replace the short table between the README's plasticity-benchmark markers")
    parser.add_argument("--ship", action="store_true", help="write results.json into the package's shipped results")
    args = parser.parse_args(argv)
    if set(args.seeds) & set(args.tuning_seeds) and not args.no_tuning:
        parser.error(f"--tuning-seeds {args.tuning_seeds} overlap the ranking --seeds {args.seeds}: a setting "
                     "must be chosen on seeds the ranking does not use")
    if args.tuning_tasks is not None and args.tuning_tasks < 1:
        parser.error(f"--tuning-tasks {args.tuning_tasks}: at least 1")
    if args.jobs < 1:
        parser.error(f"--jobs {args.jobs}: at least 1")
    if args.last_k < 1:
        parser.error(f"--last-k {args.last_k}: at least 1")
    if args.ship and args.methods and args.rerun_baselines:
        parser.error("--ship with --methods and --rerun-baselines would replace every shipped run by these methods' "
                     "and the baselines' alone: ship a full run (no --methods), or drop --rerun-baselines to add "
                     "these methods' runs to the shipped ones")
    return args


def streams_of(args: argparse.Namespace):
    steps = {"memorization": args.memorization_steps, "generalization": args.generalization_steps}
    return [replace(s, num_tasks=args.tasks or s.num_tasks, steps_per_task=steps[s.name] or s.steps_per_task)
            for s in STREAMS]


def cpu_seconds() -> float:
    """CPU time of this process and of its finished worker processes."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def quiet() -> None:
    """One thread and warnings only, in this process and in every worker process."""
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    configure_run_output()
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "plasticity_callbacks"):
        logging.getLogger(name).setLevel(logging.WARNING)


class Progress:
    """Runs jobs, ``workers`` at a time, and prints one line per finished run."""

    def __init__(self, out: Path, config_dir: Path | None, k: int, workers: int):
        self.out, self.config_dir, self.k, self.workers = out, config_dir, k, workers
        self.done = self.total = 0

    def run(self, jobs: list[Job]) -> list[RunResult]:
        self.total += len(jobs)
        if self.workers == 1:
            return [self.report(job, run_job(job, self.out, self.config_dir)) for job in jobs]
        # spawn: a fresh interpreter per worker, none of this process's threads or Hydra state
        with ProcessPoolExecutor(self.workers, mp_context=get_context("spawn"), initializer=quiet) as pool:
            futures = {pool.submit(run_job, job, self.out, self.config_dir): job for job in jobs}
            return [self.report(futures[f], f.result()) for f in as_completed(futures)]

    def report(self, job: Job, result: RunResult) -> RunResult:
        self.done += 1
        setting = f" {job.setting}" if job.setting else ""
        print(f"[{self.done}/{self.total}] {job.stream.name} {job.method}{setting} seed {job.seed}: "
              f"{result.cpu_seconds:.1f} CPU s, end-of-task acc (last {self.k}) "
              f"{late_stream_accuracy(result.accuracy, self.k):.3f}", flush=True)
        return result


def best_setting(method: str, stream: str, key: str, values: list[str], default: str, results: Results,
                 k: int) -> str:
    """The swept value with the highest late-stream accuracy on ``stream``'s tuning runs (mean over the tuning
    seeds), as ``key=value``; a tie goes to the method file's own value, then to the value listed first."""
    runs = [r for r in results.tuning_runs() if r.method == method and r.stream == stream]
    score = {value: statistics.fmean(late_stream_accuracy(r.accuracy, k) for r in runs
                                     if r.setting == f"{key}={value}") for value in values}
    return f"{key}={max(values, key=lambda v: (score[v], v == default))}"


def check_grids(sweeps: dict[str, tuple[str, list[str], str] | None], shipped: dict[str, int]) -> None:
    """Every method is tuned over the same number of values, its file's own among them (a method given more
    values has more chances to look good on the tuning seeds). ``shipped``: method -> grid size of the runs
    kept from the shipped file.

    Raises:
        SystemExit: one line naming the methods and their grid sizes, or the file whose value is not swept.
    """
    missing = sorted(m for m, found in sweeps.items() if found is None)
    if missing:
        raise SystemExit(f"plasticity-benchmark: {missing} have no sensitivity: block; every ranked method is tuned "
                         "over the same number of values: add one (a knob of its own, else model.lr) or run --no-tuning")
    for method, (key, values, default) in sweeps.items():
        if default not in values:
            raise SystemExit(f"plasticity-benchmark: method {method}: its own {key}={default} is not among its "
                             f"sensitivity values {values}; list it there")
    sizes = {**shipped, **{m: len(found[1]) for m, found in sweeps.items()}}
    if len(set(sizes.values())) > 1:
        raise SystemExit(f"plasticity-benchmark: every method's sensitivity sweep must try the same number of values, "
                         f"got {dict(sorted(sizes.items()))}; give each method file's sensitivity: that many")


def ranked_methods(names: list[str], config_dir: Path | None) -> tuple[list[str], dict[str, str]]:
    """The methods among ``names`` whose file does not say ``ranked: false``, and every method's regime line."""
    ranked, regimes = [], {}
    for name in names:
        method = compose_run(Path("unused"), [f"+method={name}"], config_dir).method
        regimes[name] = str(method.get("regime") or "")
        if method.get("ranked", True):
            ranked.append(name)
    return ranked, regimes


def refuse_identical(streams, methods: list[str], config_dir: Path | None) -> None:
    """Two method files that compose the same run would print one configuration as two rows: refused, naming them."""
    for stream in streams:
        for group in identical_groups({m: configuration(stream, m, "", config_dir) for m in methods}):
            raise SystemExit(f"plasticity-benchmark: {' and '.join(group)} compose the same configuration on "
                             f"{stream.name}: two rows would be one run twice; delete one file, mark one "
                             "ranked: false, or change a setting")


def merge_identical(streams, methods: list[str], results: Results, config_dir: Path | None) -> dict[str, set[str]]:
    """Per stream, methods whose selected settings compose the same run: the first keeps its row, the others
    get no cell on that stream, each with a line in ``results.notes``. Returns stream -> the methods left out."""
    left_out: dict[str, set[str]] = {s.name: set() for s in streams}
    for stream in streams:
        tuned = {m: results.tuned[m][stream.name] for m in methods if stream.name in results.tuned.get(m, {})}
        for kept, *others in identical_groups({m: configuration(stream, m, s, config_dir) for m, s in tuned.items()}):
            for other in others:
                left_out[stream.name].add(other)
                note = (f"{other} ({short_setting(tuned[other])}) on {stream.name} is the configuration of {kept} "
                        f"({short_setting(tuned[kept])}): one row, {kept}'s")
                results.notes.append(note)
                print(f"note: {note}")
    return left_out


def cost_estimate(jobs: list[Job], reference: Results | None) -> str:
    """The plan's CPU cost from a reference's runs (CPU seconds per task-step, per stream), in one line."""
    per_step: dict[str, float] = {}
    for name, settings in (reference.streams.items() if reference else []):
        costs = [r.cpu_seconds / (len(r.accuracy) * settings["steps_per_task"]) for r in reference.runs
                 if r.stream == name]
        if costs:
            per_step[name] = statistics.fmean(costs)
    if any(job.stream.name not in per_step for job in jobs):
        return f"plan: {len(jobs)} runs (no reference runs to estimate their cost from)"
    seconds = sum(per_step[j.stream.name] * j.stream.num_tasks * j.stream.steps_per_task for j in jobs)
    return (f"plan: {len(jobs)} runs, about {seconds / 60:.0f} CPU-minutes at the shipped runs' cost per step "
            f"({', '.join(f'{n} {1000 * c:.1f} ms' for n, c in per_step.items())})")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    quiet()
    known = method_names([args.config_dir] if args.config_dir else [])
    unknown = sorted(set(args.methods or []) - set(known))
    if unknown:
        raise SystemExit(f"plasticity-benchmark: no method file for {unknown}; known: {known}")
    ranked, regimes = ranked_methods(known, args.config_dir)
    unranked = sorted(set(args.methods or known) - set(ranked))
    if args.methods and unranked:
        raise SystemExit(f"plasticity-benchmark: {unranked} say ranked: false in their file, another regime "
                         f"({' '.join(f'{m}: {regimes[m]}' for m in unranked)}); name the others")
    for method in unranked:
        print(f"not ranked: {method} (ranked: false in its file): {regimes[method]}")
    streams = streams_of(args)
    tuning_tasks = args.tuning_tasks or streams[0].num_tasks
    results = Results({s.name: s.settings() for s in streams}, args.seeds, args.tuning_seeds, tuning_tasks)
    methods = args.methods or ranked
    shipped_grids: dict[str, int] = {}
    shipped = None
    if args.methods and not args.rerun_baselines:
        if not SHIPPED_RESULTS.is_file():
            raise SystemExit(f"plasticity-benchmark: no shipped results at {SHIPPED_RESULTS}; add --rerun-baselines")
        try:
            shipped = load_results(SHIPPED_RESULTS, require_checksum=True)
        except ResultsError as error:
            raise SystemExit(f"plasticity-benchmark: {error}") from None
        try:
            check_comparable(shipped, results)
        except ValueError as error:
            raise SystemExit(f"plasticity-benchmark: {error}") from None
        if shipped.version != results.version and args.ship:
            # the file names one version for all its runs: the shipped ones would be relabeled as this one's
            raise SystemExit(f"plasticity-benchmark: the shipped runs were made with plasticity_callbacks "
                             f"{shipped.version}, this is {results.version}: --ship adds runs only of the same "
                             "version; ship a full run (no --methods) instead")
        if shipped.version != results.version:
            print(f"note: the shipped runs were made with plasticity_callbacks {shipped.version}, this is "
                  f"{results.version}; --rerun-baselines runs them again with this one")
        # every other method's runs, selected settings, regimes and notes as shipped: --ship adds these methods' runs
        results.runs = [r for r in shipped.runs if r.method not in methods]
        results.tuned = {m: s for m, s in shipped.tuned.items() if m not in methods}
        results.regimes = {m: s for m, s in shipped.regimes.items() if m not in methods}
        results.notes = [n for n in shipped.notes if n.split(" ", 1)[0] not in methods]
        grids: dict[tuple[str, str], set[str]] = {}
        for run in results.tuning_runs():
            grids.setdefault((run.method, run.stream), set()).add(run.setting)
        shipped_grids = {f"{m} (shipped)": len(s) for (m, _), s in grids.items()}
    elif args.methods:
        methods = [*[b for b in BASELINES if b not in methods], *methods]
    for method in methods:  # a user's method file instantiates only the package's classes, checked before any run
        try:
            check_method_targets(compose_run(Path("unused"), [f"+method={method}"], args.config_dir).method,
                                 [args.config_dir] if args.config_dir else [])
        except ConfigError as error:
            raise SystemExit(f"plasticity-benchmark: {error}") from None
    results.regimes.update({m: regimes[m] for m in methods})
    refuse_identical(streams, [*methods, *sorted({r.method for r in results.runs} & set(known))], args.config_dir)
    sweeps = {} if args.no_tuning else {m: sweep(m, args.config_dir) for m in methods}
    check_grids(sweeps, shipped_grids)
    tuning_streams = [replace(s, num_tasks=tuning_tasks) for s in streams]
    jobs = [Job(s, m, f"{key}={value}", seed) for seed in args.tuning_seeds for m, (key, values, _) in sweeps.items()
            for value in values for s in tuning_streams]
    ranking_count = len(methods) * len(streams) * len(args.seeds)
    print(f"{len(jobs)} tuning runs + {ranking_count} ranking runs; "
          + cost_estimate([*jobs, *(Job(s, m, "", 0) for m in methods for s in streams for _ in args.seeds)],
                          shipped or (load_results(SHIPPED_RESULTS) if SHIPPED_RESULTS.is_file() else None)),
          flush=True)
    started = cpu_seconds(), time.perf_counter()
    progress = Progress(args.out, args.config_dir, args.last_k, args.jobs)
    results.runs += progress.run(jobs)
    for method, (key, values, default) in sweeps.items():
        results.tuned[method] = {s.name: best_setting(method, s.name, key, values, default, results, args.last_k)
                                 for s in streams}
    left_out = merge_identical(streams, methods, results, args.config_dir) if sweeps else {}
    results.runs += progress.run([Job(s, m, results.tuned.get(m, {}).get(s.name, ""), seed) for seed in args.seeds
                                  for m in methods for s in streams if m not in left_out.get(s.name, ())])
    cpu_spent = cpu_seconds() - started[0]
    write_outputs(results, args, cpu_spent, time.perf_counter() - started[1])


def write_outputs(results: Results, args: argparse.Namespace, cpu_spent: float, wall_spent: float) -> None:
    out, k = args.out, args.last_k
    save_results(results, out / "results.json")
    (out / "per_seed.csv").write_text(per_seed_csv(results, k))
    tuning = tuning_table(results, k)
    cost = sum(r.cpu_seconds for r in results.runs) / 60
    regimes = regime_lines(results)
    text = "\n".join([caption(results, k), "", ranking_table(results, k), "", *([regimes, ""] if regimes else []),
                      *([*(f"- {note}" for note in results.notes), ""] if results.notes else []),
                      *([tuning, ""] if tuning else []),
                      f"{len(results.runs)} runs, {cost:.1f} CPU-minutes of training in all (one thread each)"])
    (out / "ranking.md").write_text(text + "\n")
    figure = plot_ranking(results, k, out / "ranking.png")
    print(text)
    print(f"this call: {cpu_spent / 60:.1f} CPU-minutes, {wall_spent / 60:.1f} wall minutes; "
          f"outputs in {out}/ (ranking.md, ranking.png, per_seed.csv, results.json)")
    if args.docs is not None:
        args.docs.mkdir(parents=True, exist_ok=True)
        for name in ("ranking.md", "per_seed.csv"):
            shutil.copyfile(out / name, args.docs / name)
        shutil.copyfile(figure, args.docs / "ranking.png")
    if args.readme is not None:
        replace_readme_table(args.readme, short_table(results, k))
    if args.ship:
        print(f"shipped: {save_results(results, SHIPPED_RESULTS)}")


def replace_readme_table(readme: Path, table: str) -> None:
    """Put ``table`` between the README's markers (both must be there: nothing is appended blindly)."""
    text = readme.read_text()
    start, end = README_MARKERS
    if text.count(start) != 1 or text.count(end) != 1:
        raise SystemExit(f"plasticity-benchmark: {readme} needs the lines {start} and {end} once each")
    head, rest = text.split(start)
    readme.write_text(f"{head}{start}\n{table}\n{end}{rest.split(end, 1)[1]}")


if __name__ == "__main__":
    main()
