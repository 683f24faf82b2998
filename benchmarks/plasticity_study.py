"""The method-comparison study: which boundary method gives the lowest new-phase loss, and keeps most of the old?

For each seed: train phase 1 once (``experiment=study_sft``: a small GPT overtrained on a small
slice of the library's code), then run phase 2 (SFT on instruction/response pairs) from that
checkpoint once per method, methods interleaved so machine noise hits all alike. Everything runs
in this one process through the same Hydra configs as ``plasticity-train`` (one import, cached
SFT data), one intra-op thread (fastest on a shared 2-core machine). Then ``plasticity-report``
aggregates the phase-2 runs into ``<out>/report_<name>/``; with ``--docs DIR`` the table and the
loss-curve figure are also copied there (``--docs docs`` refreshes the README's study).

    python benchmarks/plasticity_study.py                          # the study; results under outputs/study/
    python benchmarks/plasticity_study.py --docs docs               # ... and replace docs/study.md + figure
    python benchmarks/plasticity_study.py --name study_long --phase2-steps 1500 --methods warm sp fire_lm fire_exact reset
    python benchmarks/plasticity_study.py --seeds 0 --methods warm fire_lm --phase1-steps 100 --phase2-steps 50

The same runs as a Hydra sweep (one process per run):
    plasticity-train experiment=study_sft +method=warm pipeline.stop_phase=pretrain hydra.run.dir=study/p1
    plasticity-train -m experiment=study_sft +method=warm,fire_lm seed=0,1,2 pipeline.start_phase=sft \\
        pipeline.init_from=study/p1/checkpoints/pretrain/final.ckpt
"""
from __future__ import annotations

import argparse
import logging
import shutil
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from plasticity_callbacks.app.console import configure_run_output
from plasticity_callbacks.app.methods import method_names
from plasticity_callbacks.app.pipeline import Pipeline
from plasticity_callbacks.app.report.runs import build_report
from plasticity_callbacks.app.train import config_dir

REPO = Path(__file__).resolve().parents[1]


def run(out: Path, *overrides: str) -> dict:
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        cfg = compose("config", overrides=["experiment=study_sft", f"paths.output_dir={out}", *overrides])
    return Pipeline(cfg).run()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "study")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--methods", nargs="+", default=method_names(),
                        help="default: every configs/method/<name>.yaml")
    parser.add_argument("--phase1-steps", type=int, default=None, help="default: the experiment's")
    parser.add_argument("--phase2-steps", type=int, default=None, help="default: the experiment's")
    parser.add_argument("--budget-minutes", type=float, default=45.0, help="stop starting runs after this")
    parser.add_argument("--docs", type=Path, default=None,
                        help="also copy the table and figure here (e.g. docs; default: only the report under --out)")
    parser.add_argument("--name", default="study", help="names the runs folder and the docs files (a variant "
                                                         "such as a longer phase 2 reuses the phase-1 checkpoints)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # what plasticity-train's console shows
    configure_run_output()  # Lightning's notices once, not once per run
    steps = [f"phases.pretrain.steps={args.phase1_steps}"] if args.phase1_steps else []
    steps += [f"phases.sft.steps={args.phase2_steps}"] if args.phase2_steps else []
    started = time.perf_counter()
    for seed in args.seeds:
        phase1 = args.out / "phase1" / f"seed{seed}"
        checkpoint = phase1 / "checkpoints" / "pretrain" / "final.ckpt"
        if not checkpoint.is_file():
            run(phase1, "+method=warm", f"seed={seed}", "pipeline.stop_phase=pretrain", *steps)
        for method in args.methods:
            if (time.perf_counter() - started) / 60 > args.budget_minutes:
                print(f"budget of {args.budget_minutes} min spent: skipping {method} seed {seed}")
                continue
            target = args.out / args.name / method / f"seed{seed}"
            if (target / "pipeline.json").is_file():
                continue  # done in an earlier invocation
            run(target, f"+method={method}", f"seed={seed}", "pipeline.start_phase=sft",
                f"pipeline.init_from={checkpoint}", *steps)
            print(f"[{(time.perf_counter() - started) / 60:.1f} min] {method} seed {seed} done")
    report_dir = args.out / f"report_{args.name}"
    text, figures = build_report(args.out / args.name, report_dir)
    print(text)
    if args.docs is not None:
        args.docs.mkdir(exist_ok=True)
        table = "\n".join(line for line in text.splitlines() if not line.startswith("!["))
        (args.docs / f"{args.name}.md").write_text(
            table.rstrip() + f"\n\n![loss curves]({args.name}_loss_curves.png)\n")
        for figure in figures:
            if figure.name == "loss_curves.png":
                shutil.copyfile(figure, args.docs / f"{args.name}_loss_curves.png")
        print(f"copied the table and figure to {args.docs}")
    print(f"total {(time.perf_counter() - started) / 60:.1f} min; report in {report_dir} "
          f"(report.md, {', '.join(f.name for f in figures)})")


if __name__ == "__main__":
    main()
