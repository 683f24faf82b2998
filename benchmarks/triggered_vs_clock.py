"""FIRE and ReDo triggered by PlasticityMonitor's diagnostics vs the same methods at every task boundary, on the
random-label digits stream: accuracy late in the stream, and how many times each method acted.

Every run: a 128-128 MLP (Adam 1e-2) trained warm through the stream, with ``PlasticityMonitor`` (activations and
weights every 25 steps, spectra every 50) and ``TaskMetrics``; the method under test acts either at each task
boundary (the clock) or when the monitor's metric crosses its threshold (``Schedule(threshold=...)``).

    python benchmarks/triggered_vs_clock.py [--tasks 8] [--steps-per-task 150] [--seeds 0]

Small by design (CPU, minutes): one reading of the question, not a ranking.
"""
from __future__ import annotations

import argparse
import statistics

import lightning as L
import torch

from plasticity_callbacks import FIREReinit, PlasticityMonitor, ReDoMonitor, Schedule, Threshold
from plasticity_callbacks.callbacks.task_metrics import TaskMetrics
from plasticity_callbacks.data.digits import RandomLabelDigits
from plasticity_callbacks.models.classifier import DigitsClassifier


def methods(steps_per_task: int) -> dict[str, object]:
    """Name -> a factory of the method callback (None: warm, no method)."""
    cooldown = steps_per_task  # at most once a task, as the clock
    return {
        "warm": None,
        "fire at boundaries": lambda: FIREReinit(schedule=Schedule(at_task_boundaries=True)),
        "fire when weight_srank < 7.5": lambda: FIREReinit(schedule=Schedule(
            threshold=Threshold("monitor/weight_srank", below=7.5, cooldown=cooldown))),
        "fire when weight_dfi > 1000": lambda: FIREReinit(schedule=Schedule(
            threshold=Threshold("monitor/weight_dfi", above=1000.0, cooldown=cooldown))),
        "redo at boundaries": lambda: ReDoMonitor(collect_every_n_steps=1, schedule=Schedule(at_task_boundaries=True)),
        "redo when dormant > 0.2": lambda: ReDoMonitor(collect_every_n_steps=1, schedule=Schedule(
            threshold=Threshold("monitor/dormant", above=0.2, cooldown=cooldown))),
    }


def run(factory, tasks: int, steps_per_task: int, seed: int) -> tuple[float, int]:
    """Mean end-of-task accuracy over the last half of the stream, and the method's action count."""
    L.seed_everything(seed, verbose=False)
    monitor = PlasticityMonitor(activations_every_n_steps=25, weights_every_n_steps=25, spectra_every_n_steps=50,
                                plot=False)
    method = factory() if factory is not None else None
    metrics = TaskMetrics()
    callbacks = [monitor, *([method] if method is not None else []), metrics]
    trainer = L.Trainer(max_steps=tasks * steps_per_task, callbacks=callbacks, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(DigitsClassifier(widths=[128, 128], lr=1e-2),
                datamodule=RandomLabelDigits(num_tasks=tasks, steps_per_task=steps_per_task, batch_size=64,
                                             seed=seed))
    late = [row["accuracy"] for row in metrics.history if row["task"] >= tasks // 2]
    return statistics.mean(late), 0 if method is None else len(method.firing.fired)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=8)
    parser.add_argument("--steps-per-task", type=int, default=150)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--only", nargs="*", help="run only the methods whose name contains one of these")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"digits stream, {args.tasks} tasks x {args.steps_per_task} steps, MLP 128-128, seeds {args.seeds}")
    print(f"{'method':<32}{'late accuracy':>14}{'actions':>9}")
    for name, factory in methods(args.steps_per_task).items():
        if args.only and not any(word in name for word in args.only):
            continue
        results = [run(factory, args.tasks, args.steps_per_task, seed) for seed in args.seeds]
        accuracy = statistics.mean(a for a, _ in results)
        actions = statistics.mean(n for _, n in results)
        print(f"{name:<32}{accuracy:>14.3f}{actions:>9.1f}", flush=True)


if __name__ == "__main__":
    main()
