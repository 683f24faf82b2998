"""The task-stream benchmark that ranks the plasticity methods (``experiment=continual_digits``).

Three parts, every method found in ``configs/method/`` (a user's too, with ``--config-dir``):

- ``ranking``: random-label memorization, ``--tasks`` tasks × ``--steps`` steps, every method and
  seed; a budget at which end-of-task accuracy is below the ceiling, so methods separate.
- ``long``: permuted digits, ``--long-tasks`` tasks of one pass each (11 batches of 128 over the
  1438 training images), every method, the first seed: the slope of accuracy over many tasks.
- ``sensitivity``: each method's main hyperparameter (its ``sensitivity:`` block) over its values,
  on the ranking stream shortened to ``--sensitivity-tasks`` tasks, the first seed.

Runs go through the same Hydra configs as ``plasticity-train``, in this one process (one import,
one intra-op thread), methods interleaved so machine noise hits all alike. Each part ends with its
``plasticity-report`` (``<out>/<part>/report/``); with ``--docs DIR`` the reports' tables and figures
are copied there. CPU seconds (this process) and wall seconds are printed: on a shared machine the
CPU time is the cost, the wall time depends on the neighbours.

    python benchmarks/task_streams.py                                 # the default benchmark
    python benchmarks/task_streams.py --docs docs                     # ... and refresh docs/task_streams_*
    python benchmarks/task_streams.py --parts ranking --methods warm fire --seeds 0 --tasks 5 --steps 20
    python benchmarks/task_streams.py --config-dir ~/my_configs --methods warm my_method
"""
from __future__ import annotations

import argparse
import logging
import shutil
import time
from pathlib import Path

import torch
import yaml
from hydra import compose, initialize_config_dir

from plasticity_callbacks.app.console import configure_run_output
from plasticity_callbacks.app.methods import method_names, sensitivity
from plasticity_callbacks.app.report.streams import build_stream_report
from plasticity_callbacks.app.train import config_dir, fit

REPO = Path(__file__).resolve().parents[1]
PARTS = ("ranking", "long", "sensitivity")


def compose_run(out: Path, overrides: list[str], user_config_dir: Path | None):
    extra = [f"hydra.searchpath=[file://{user_config_dir.absolute()}]"] if user_config_dir else []
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        return compose("config", overrides=["experiment=continual_digits", f"paths.output_dir={out}",
                                             *extra, *overrides])


def run(out: Path, overrides: list[str], user_config_dir: Path | None) -> None:
    """One stream run into ``out`` (skipped when it finished earlier); its overrides recorded for the report."""
    if (out / "logs" / "stream.json").is_file():
        return
    (out / ".hydra").mkdir(parents=True, exist_ok=True)
    (out / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    fit(compose_run(out, overrides, user_config_dir))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "task_streams")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--config-dir", type=Path, default=None, help="a config folder with more method/*.yaml")
    parser.add_argument("--methods", nargs="+", default=None, help="default: every method/<name>.yaml")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--tasks", type=int, default=20, help="ranking and sensitivity: tasks")
    parser.add_argument("--steps", type=int, default=100, help="ranking and sensitivity: steps per task")
    parser.add_argument("--sensitivity-tasks", type=int, default=10, help="sensitivity: tasks (steps: --steps)")
    parser.add_argument("--long-tasks", type=int, default=100, help="long permuted stream: tasks")
    parser.add_argument("--docs", type=Path, default=None, help="also copy each report's table and figure here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    configure_run_output()
    for name in ("lightning", "lightning.pytorch", "plasticity_callbacks"):
        logging.getLogger(name).setLevel(logging.WARNING)
    methods = args.methods or method_names([args.config_dir] if args.config_dir else [])
    ranking = [f"data.num_tasks={args.tasks}", f"data.steps_per_task={args.steps}",
               f"trainer.log_every_n_steps={args.steps}"]
    long = ["data=digits_permuted", f"data.num_tasks={args.long_tasks}", "data.steps_per_task=11",
            "trainer.log_every_n_steps=11", "callbacks.task_metrics.probe_every_n_tasks=10"]
    jobs: dict[str, list[tuple[Path, list[str]]]] = {part: [] for part in args.parts}
    for seed in args.seeds:
        for method in methods:
            if "ranking" in jobs:
                jobs["ranking"].append((Path(method, f"seed{seed}"), [f"+method={method}", f"seed={seed}", *ranking]))
            if "long" in jobs and seed == args.seeds[0]:
                jobs["long"].append((Path(method, f"seed{seed}"), [f"+method={method}", f"seed={seed}", *long]))
    if "sensitivity" in jobs:
        for method in methods:
            found = sensitivity(compose_run(args.out, [f"+method={method}"], args.config_dir).method)
            for value in found[1] if found else []:
                setting = f"method.{found[0]}={value}"
                folder = f"{found[0].rsplit('.', 1)[-1]}_{value}"  # e.g. shrink_0.4 ("=" would end the path)
                jobs["sensitivity"].append((Path(method, folder, f"seed{args.seeds[0]}"),
                                            [f"+method={method}", f"seed={args.seeds[0]}", *ranking,
                                             f"data.num_tasks={args.sensitivity_tasks}", setting]))
    cpu, wall = time.process_time(), time.perf_counter()
    for part, part_jobs in jobs.items():
        started = time.process_time(), time.perf_counter()
        for folder, overrides in part_jobs:
            run(args.out / part / folder, overrides, args.config_dir)
        text, figures = build_stream_report(args.out / part)
        print(text)
        print(f"[{part}] {len(part_jobs)} runs: {time.process_time() - started[0]:.0f} CPU s, "
              f"{time.perf_counter() - started[1]:.0f} wall s")
        if args.docs is not None:
            args.docs.mkdir(exist_ok=True)
            table = "\n".join(line for line in text.splitlines() if not line.startswith("!["))
            (args.docs / f"task_streams_{part}.md").write_text(table + f"\n\n![{part}](task_streams_{part}.png)\n")
            shutil.copyfile(figures[0], args.docs / f"task_streams_{part}.png")
    print(f"total: {time.process_time() - cpu:.0f} CPU s, {time.perf_counter() - wall:.0f} wall s "
          f"(one thread; reports in {args.out}/<part>/report)")


if __name__ == "__main__":
    main()
