"""``plasticity-report RUN_DIR``: a sweep's pipeline runs as one markdown table and a few figures.

Finds every ``pipeline.json`` under ``RUN_DIR`` (one per pipeline run, e.g. each job of
``plasticity-train -m experiment=continual_pretrain +method=warm,fire seed=0,1,2``), groups the
runs by method (plus any other override that is not the seed), and writes into
``RUN_DIR/report/`` (or ``--out``):

- ``report.md``: per method, mean ± std over seeds of the last phase's final validation loss,
  the retention loss (the first phase's validation set, measured after the last phase), the
  dormant fraction and the minutes the run took;
- ``loss_curves.png``: validation loss of the current phase and retention loss over the whole
  pipeline's steps, mean over seeds, phase boundaries marked;
- ``dormant_fraction.png``: ReDo's dormant fraction over the steps, when logged;
- ``spectra_<method>.png``: FIRE's singular values before/after, when a run saved them.
"""
from __future__ import annotations

import argparse
import csv
import json
import shutil
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from ..core.figures import plt

COLUMNS = [("new-phase val loss", "val_loss"), ("retention loss", "retention_loss"),
           ("dormant fraction", "dormant_fraction"), ("minutes", "minutes")]


@dataclass
class Run:
    path: Path
    label: str
    seed: int
    state: dict
    curves: dict[str, dict[int, float]] = field(default_factory=dict)  # metric -> {global step: value}


def run_label(run_dir: Path, method: str) -> str:
    """The method, plus the run's other overrides except the seed (what distinguishes a sweep's cells)."""
    overrides_file = run_dir / ".hydra" / "overrides.yaml"
    extra = []
    if overrides_file.is_file():
        import yaml

        for item in yaml.safe_load(overrides_file.read_text()) or []:
            key = item.split("=", 1)[0].lstrip("+~")
            if key not in ("seed", "method", "experiment") and not key.startswith(("hydra", "pipeline.init_from")):
                extra.append(item)
    return " ".join([method, *extra])


def read_curves(run_dir: Path, state: dict) -> dict[str, dict[int, float]]:
    """``val`` (each phase's own validation loss), ``retention`` (the first phase's validation set)
    and ``dormant`` over the pipeline's global steps."""
    first = (state.get("phase_order") or list(state["phases"]))[0]
    curves: dict[str, dict[int, float]] = defaultdict(dict)
    for name, phase in state["phases"].items():
        path = run_dir / "logs" / name / "metrics.csv"
        if not path.is_file():
            continue
        retention_key = "val/loss" if name == first else f"retention/{first}/loss"
        with path.open(newline="") as f:
            for row in csv.DictReader(f):
                step = int(row["step"]) + int(phase.get("step_offset", 0))
                for curve, key in (("val", "val/loss"), ("retention", retention_key), ("dormant", "redo/dormant"),
                                   ("train", "train/loss")):
                    if row.get(key):
                        curves[curve][step] = float(row[key])
    return dict(curves)


def find_runs(root: Path) -> list[Run]:
    runs = []
    for state_file in sorted(root.rglob("pipeline.json")):
        state = json.loads(state_file.read_text())
        if not state.get("phases"):
            continue
        run = Run(state_file.parent, run_label(state_file.parent, state["method"]), int(state["seed"]), state)
        run.curves = read_curves(run.path, state)
        runs.append(run)
    return runs


def last_phase(run: Run) -> dict:
    return list(run.state["phases"].values())[-1]


def mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def summarize(runs: list[Run]) -> dict[str, dict[str, tuple[float, float, int]]]:
    """label -> column -> (mean, std, number of seeds with a value)."""
    groups: dict[str, list[Run]] = defaultdict(list)
    for run in runs:
        groups[run.label].append(run)
    table = {}
    for label, members in groups.items():
        row = {}
        for _, key in COLUMNS:
            if key == "minutes":
                values = [sum(p["minutes"] for p in r.state["phases"].values()) for r in members]
            else:
                values = [float(last_phase(r)[key]) for r in members if last_phase(r).get(key) is not None]
            if values:
                row[key] = (*mean_std(values), len(values))
        row["seeds"] = (len(members), 0.0, len(members))
        table[label] = row
    return table


def markdown_table(table: dict[str, dict[str, tuple[float, float, int]]]) -> str:
    """Rows sorted by the new-phase validation loss (best first)."""
    header = "| method | seeds | " + " | ".join(name for name, _ in COLUMNS) + " |"
    lines = [header, "|" + "---|" * (len(COLUMNS) + 2)]
    order = sorted(table, key=lambda label: table[label].get("val_loss", (float("inf"),))[0])
    for label in order:
        row = table[label]
        cells = []
        for _, key in COLUMNS:
            if key not in row:
                cells.append("-")
                continue
            mean, std, _ = row[key]
            digits = 2 if key == "minutes" else 4
            cells.append(f"{mean:.{digits}f} ± {std:.{digits}f}")
        lines.append(f"| {label} | {row['seeds'][2]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def mean_curve(runs: list[Run], name: str) -> tuple[list[int], list[float]]:
    steps = sorted({s for r in runs for s in r.curves.get(name, {})})
    values = [statistics.fmean(r.curves[name][s] for r in runs if s in r.curves.get(name, {})) for s in steps]
    return steps, values


def boundaries(runs: list[Run]) -> list[int]:
    return sorted({int(p["step_offset"]) for r in runs for p in r.state["phases"].values() if p["step_offset"] > 0})


def plot_curves(runs: list[Run], out: Path) -> list[Path]:
    groups: dict[str, list[Run]] = defaultdict(list)
    for run in runs:
        groups[run.label].append(run)
    written = []
    panels = [("loss_curves", [("val", "validation loss of the current phase"),
                               ("retention", "retention: first phase's validation loss")])]
    if any(r.curves.get("dormant") for r in runs):
        panels.append(("dormant_fraction", [("dormant", "dormant fraction (ReDo, τ-dormant)")]))
    for filename, curves in panels:
        fig, axes = plt.subplots(1, len(curves), figsize=(6 * len(curves), 4), squeeze=False)
        for ax, (name, title) in zip(axes[0], curves):
            shown = []
            for label, members in sorted(groups.items()):
                steps, values = mean_curve(members, name)
                if steps:
                    ax.plot(steps, values, marker="." if len(steps) < 30 else None, label=f"{label} (n={len(members)})")
                    shown += values
            if name != "dormant" and len(shown) > 10:
                # Zoom on where methods differ: a full reset starts far above everyone else.
                ordered = sorted(shown)
                low, high = ordered[0], ordered[int(0.9 * (len(ordered) - 1))]
                ax.set_ylim(low - 0.05 * (high - low), high)
            for step in boundaries(runs):
                ax.axvline(step, color="grey", linestyle="--", linewidth=1)
            ax.set(title=title, xlabel="step (whole pipeline; dashed = phase boundary)")
            ax.legend(fontsize=7)
        path = out / f"{filename}.png"
        fig.savefig(path, dpi=120, bbox_inches="tight")
        plt.close(fig)
        written.append(path)
    for label, members in sorted(groups.items()):  # FIRE's own before/after spectra, one run per method
        spectra = sorted(p for r in members for p in r.path.glob("logs/*/figures/fire_spectra_*.png"))
        if spectra:
            target = out / f"spectra_{label.replace(' ', '_').replace('/', '_')}.png"
            shutil.copyfile(spectra[0], target)
            written.append(target)
    return written


def build_report(root: Path, out: Path | None = None) -> tuple[str, list[Path]]:
    runs = find_runs(root)
    if not runs:
        raise FileNotFoundError(f"no pipeline runs (pipeline.json) under {root}")
    out = out or root / "report"
    out.mkdir(parents=True, exist_ok=True)
    table = markdown_table(summarize(runs))
    figures = plot_curves(runs, out)
    phases = " → ".join(runs[0].state.get("phase_order") or runs[0].state["phases"])
    text = "\n".join([
        f"# Plasticity study: {len(runs)} runs under {root}", "",
        f"Phases: {phases}. Mean ± std over seeds; losses in nats per byte; retention = loss on the first "
        "phase's validation set after the last phase; minutes = the phases each run trained.", "",
        table, "", *[f"![{p.stem}]({p.name})" for p in figures], "",
    ])
    (out / "report.md").write_text(text)
    return text, figures


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="plasticity-report", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="a sweep directory (multirun/...) or a single run directory")
    parser.add_argument("--out", type=Path, default=None, help="where to write report.md and the PNGs "
                                                                "(default RUN_DIR/report)")
    args = parser.parse_args(argv)
    from .stream_report import build_stream_report, has_stream_runs

    try:
        report = build_stream_report if has_stream_runs(args.run_dir) else build_report  # task streams: their own
        text, figures = report(args.run_dir, args.out)
    except FileNotFoundError as err:
        parser.exit(2, f"plasticity-report: {err}\n")
    print(text)
    print("\n".join(f"wrote {p}" for p in figures))


if __name__ == "__main__":
    main()
