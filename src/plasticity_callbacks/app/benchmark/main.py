"""``plasticity-benchmark``: run the task-stream ranking, or place your own method in it.

    plasticity-benchmark                                    # every method, 5 seeds, both streams, the sweep
    plasticity-benchmark --methods mine --config-dir ~/mine # only yours, against the shipped baselines
    plasticity-benchmark --methods mine --config-dir ~/mine --tasks 10 --rerun-baselines  # other settings
    plasticity-benchmark --methods warm fire_lm --seeds 0 1 --tasks 3 --memorization-steps 10 --no-tuning

Runs go through the same Hydra configs as ``plasticity-train experiment=continual_digits``, one after
the other in this process on one thread (``--jobs N``: N processes); each prints a line (stream,
method, seed, CPU seconds) when it ends, and a run folder that finished is not run again. The outputs
(``--out``): ``results.json`` (per run, per task), ``per_seed.csv``, ``ranking.md`` and ``ranking.png``.
``--ship`` writes ``results.json`` into the package's shipped runs: with ``--methods``, every other method's
shipped runs stay in it as they were and the methods named replace their own.
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
                      save_results)
from .runs import STREAMS, Job, compose_run, run_job, sweep
from .table import BASELINES, PRIMARY, caption, per_seed_csv, ranking_table, short_table, tuning_table

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
    parser.add_argument("--tuning-seeds", type=int, nargs="+", default=[100],
                        help="the sensitivity sweep's seeds (none of the ranking seeds)")
    parser.add_argument("--no-tuning", action="store_true", help="rank each method file as it is, no sweep")
    parser.add_argument("--tuning-tasks", type=int, default=10,
                        help="the sweep's memorization stream: its tasks (default 10; steps as the ranking's)")
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
    if args.tuning_tasks < 1:
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


def best_setting(method: str, key: str, values: list[str], default: str, results: Results, k: int) -> str | None:
    """The swept value with the highest late-stream accuracy on the primary stream (mean over the tuning seeds)
    as ``key=value``, or None when the method file's own value is best (ties go to it)."""
    score = {value: statistics.fmean(late_stream_accuracy(r.accuracy, k) for r in results.tuning_runs()
                                     if r.method == method and r.stream == PRIMARY and r.setting == f"{key}={value}")
             for value in values}
    best = max(values, key=lambda v: score[v])
    return f"{key}={best}" if score[best] > score[default] else None


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    quiet()
    known = method_names([args.config_dir] if args.config_dir else [])
    unknown = sorted(set(args.methods or []) - set(known))
    if unknown:
        raise SystemExit(f"plasticity-benchmark: no method file for {unknown}; known: {known}")
    streams = streams_of(args)
    results = Results({s.name: s.settings() for s in streams}, args.seeds, args.tuning_seeds, args.tuning_tasks)
    methods = args.methods or known
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
        # every other method's runs and tuned setting as shipped, so --ship adds these methods' runs to them
        results.runs = [r for r in shipped.runs if r.method not in methods]
        results.tuned = {m: s for m, s in shipped.tuned.items() if m not in methods}
    elif args.methods:
        methods = [*[b for b in BASELINES if b not in methods], *methods]
    for method in methods:  # a user's method file instantiates only the package's classes, checked before any run
        try:
            check_method_targets(compose_run(Path("unused"), [f"+method={method}"], args.config_dir).method,
                                 [args.config_dir] if args.config_dir else [])
        except ConfigError as error:
            raise SystemExit(f"plasticity-benchmark: {error}") from None
    started = cpu_seconds(), time.perf_counter()
    jobs = [Job(s, m, "", seed) for seed in args.seeds for m in methods for s in streams]
    sweeps = {} if args.no_tuning else {m: found for m in methods if (found := sweep(m, args.config_dir))}
    primary = replace(next(s for s in streams if s.name == PRIMARY), num_tasks=args.tuning_tasks)
    jobs += [Job(primary, m, f"{key}={value}", seed) for m, (key, values, _) in sweeps.items()
             for value in values for seed in args.tuning_seeds]
    progress = Progress(args.out, args.config_dir, args.last_k, args.jobs)
    results.runs += progress.run(jobs)
    for method, (key, values, default) in sweeps.items():
        if best := best_setting(method, key, values, default, results, args.last_k):
            results.tuned[method] = best
    results.runs += progress.run([Job(s, m, results.tuned[m], seed) for m in methods if m in results.tuned
                                  for seed in args.seeds for s in streams])
    cpu_spent = cpu_seconds() - started[0]
    write_outputs(results, args, cpu_spent, time.perf_counter() - started[1])


def write_outputs(results: Results, args: argparse.Namespace, cpu_spent: float, wall_spent: float) -> None:
    out, k = args.out, args.last_k
    save_results(results, out / "results.json")
    (out / "per_seed.csv").write_text(per_seed_csv(results, k))
    tuning = tuning_table(results, k)
    cost = sum(r.cpu_seconds for r in results.runs) / 60
    text = "\n".join([caption(results, k), "", ranking_table(results, k), "", *([tuning, ""] if tuning else []),
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
