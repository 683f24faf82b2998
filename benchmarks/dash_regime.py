"""DASH in its own regime: warm starting on accumulating digits (``experiment=dash_regime``), a BatchNorm MLP
trained by SGD with momentum, each stage fitted to ~100 % train accuracy; the final held-out accuracy of warm,
reset, DASH (λ = 0.3 and 0.5, SGD's momentum carried over the shrink, as the paper does) and shrink & perturb.

    OMP_NUM_THREADS=1 python benchmarks/dash_regime.py [--seeds 0 1 2 3 4] [--jobs 2] [--out outputs/dash_regime]

Every method comes from its ``configs/method/<name>.yaml``, with only the overrides this regime needs
(:data:`RUNS`); each run is ``plasticity-train experiment=dash_regime +method=<name> <overrides> seed=<s>``,
in this process (``--jobs N``: N one-thread processes). Prints one line per run, then the table: the final
held-out accuracy (mean over seeds), the seed-paired difference with warm and its 95 % Student-t interval,
the lowest train accuracy on a stage's last batch, and the CPU cost. docs/dash_regime.md reads it.
"""
from __future__ import annotations

import argparse
import csv
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

from hydra import compose, initialize_config_dir

from plasticity_callbacks.app.benchmark.main import cpu_seconds, quiet
from plasticity_callbacks.app.benchmark.metrics import paired_difference
from plasticity_callbacks.app.benchmark.runs import read_tasks
from plasticity_callbacks.app.train import config_dir, fit

# The paper keeps SGD's momentum across the shrink (the shipped dash.yaml drops it: its ranking runs Adam), and
# its gradient pass reads all the data so far: 11 batches of 128 are one pass over the full training split.
DASH_REGIME = ["method.carry_optimizer=true", "method.task_stream.dash.n_batches=11"]
RUNS = {  # row -> (method file, overrides of it in this regime)
    "warm": ("warm", []),
    "reset": ("reset", []),
    "dash": ("dash", DASH_REGIME),
    "dash λ0.5": ("dash", [*DASH_REGIME, "method.callbacks.dash.min_factor=0.5"]),
    "sp": ("sp", []),
}


def compose_run(method: str, overrides: list[str], seed: int, folder: Path):
    """The config ``plasticity-train experiment=dash_regime +method=<method> <overrides> seed=<seed>`` runs."""
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        return compose("config", overrides=["experiment=dash_regime", f"+method={method}", f"seed={seed}",
                                             f"paths.output_dir={folder}", *overrides])


def stage_end_train_accuracy(folder: Path, steps_per_task: int) -> list[float]:
    """``train/accuracy`` of each stage's last batch, from the run's ``logs/metrics.csv`` (logged every 50 steps,
    which divides the 400 steps of a stage)."""
    with open(folder / "logs" / "metrics.csv", newline="") as f:
        return [float(row["train/accuracy"]) for row in csv.DictReader(f)
                if row.get("train/accuracy") and (int(row["step"]) + 1) % steps_per_task == 0]


def run(row: str, seed: int, out: Path) -> dict:
    """One run of ``row`` at ``seed`` into its own folder; its final held-out accuracy, stage-end train
    accuracies and CPU seconds."""
    method, overrides = RUNS[row]
    folder = Path(tempfile.mkdtemp(prefix=f"{method}-seed{seed}-", dir=out))
    cfg = compose_run(method, overrides, seed, folder)
    started = time.process_time()
    fit(cfg)
    tasks = read_tasks(folder)
    if len(tasks) != len(cfg.data.fractions):
        raise RuntimeError(f"{folder}: {len(tasks)} of {len(cfg.data.fractions)} stages ran")
    return {"row": row, "seed": seed, "accuracy": float(tasks[-1]["accuracy"]),
            "train": stage_end_train_accuracy(folder, cfg.data.steps_per_task),
            "cpu_seconds": time.process_time() - started}


def table(results: list[dict], rows: list[str], seeds: list[int]) -> str:
    """Mean final held-out accuracy per row, the seed-paired difference with warm (95 % interval), the lowest
    stage-end train accuracy and the mean CPU seconds of a run."""
    by_row = {row: sorted((r for r in results if r["row"] == row), key=lambda r: r["seed"]) for row in rows}
    warm = [r["accuracy"] for r in by_row["warm"]]
    lines = [f"| method | held-out accuracy % (mean of {len(seeds)} seeds) | vs warm, points [95 % CI] "
             "| lowest stage-end train acc % | CPU s / run |", "|---|---|---|---|---|"]
    for row, runs in by_row.items():
        accuracy = [r["accuracy"] for r in runs]
        if row == "warm":
            versus = "—"
        else:
            d = paired_difference([100 * a for a in accuracy], [100 * a for a in warm])
            versus = f"{d.mean:+.2f} [{d.low:+.2f}, {d.high:+.2f}]"
        lowest = min(a for r in runs for a in r["train"])
        cpu = statistics.fmean(r["cpu_seconds"] for r in runs)
        lines.append(f"| {row} | {100 * statistics.fmean(accuracy):.1f} | {versus} | {100 * lowest:.1f} "
                     f"| {cpu:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time, one process and one thread each")
    parser.add_argument("--out", type=Path, default=Path("outputs") / "dash_regime")
    parser.add_argument("--only", nargs="*", choices=list(RUNS), help="run only these rows (warm always runs)")
    args = parser.parse_args()
    quiet()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = [r for r in RUNS if not args.only or r in args.only or r == "warm"]
    jobs = [(row, seed, args.out) for row in rows for seed in args.seeds]
    wall = time.perf_counter()
    # spawn: a fresh interpreter per worker, none of this process's threads or Hydra state
    with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn"), initializer=quiet) as pool:
        results = []
        for result in pool.map(run, *zip(*jobs)):
            print(f"{result['row']} seed {result['seed']}: held-out {100 * result['accuracy']:.1f} %, "
                  f"{result['cpu_seconds']:.1f} CPU s", flush=True)
            results.append(result)
    print()
    print(table(results, rows, args.seeds))
    print(f"\n{len(results)} runs: {cpu_seconds():.0f} CPU s in all, {time.perf_counter() - wall:.0f} s wall "
          f"with {args.jobs} process(es)")


if __name__ == "__main__":
    main()
