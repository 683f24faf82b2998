"""``plasticity-report RUN_DIR``: a sweep's runs as one markdown table and a few figures.

Finds every run under ``RUN_DIR``: pipeline runs (a ``pipeline.json``, e.g. each job of
``plasticity-train -m experiment=continual_pretrain +method=warm,fire_lm seed=0,1,2``), single
fits (``~experiment``: a ``logs/metrics.csv``, or TensorBoard event files under ``tensorboard/``, next to
Hydra's ``.hydra/``) and plain Lightning log folders (``lightning_logs/version_0``: CSV or TensorBoard, named
by their folder; their summary columns are those of the built-in callbacks). Runs that differ only
in the seed form one group; a group is labelled by what varies across the sweep (the method,
``optimizer.lr=...``), while the settings every run shares are listed once in ``report.md``.
Writes into ``RUN_DIR/report/`` (or ``--out``):

- ``report.md``: per group, mean ± std over seeds (the value alone for one seed) of the last phase's final
  validation loss, the retention loss (the first phase's validation set, measured after the last phase), the
  dormant fraction, each callback's summary values (``summary_metrics``, e.g. FIRE's DfI) and the minutes
  the run took;
- ``loss_curves.png``: validation loss of the current phase (and retention loss, for pipelines)
  over the whole run's steps: mean over seeds, a band of ± one standard deviation where two or
  more seeds logged the step, phase boundaries dashed;
- ``dormant_fraction.png``: ReDo's dormant fraction over the steps, when logged;
- ``spectra_<group>.png``: FIRE's singular values before/after, when a run saved them.

Other reports reuse :func:`summarize`/:func:`markdown_table` (the mean ± std table) and
:func:`metric_figure` (metric-vs-step panels with seed bands).
"""
from __future__ import annotations

import json
import logging
import math
import re
import shutil
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from .metric_logs import has_metrics, read_rows, reading

log = logging.getLogger(__name__)

COLUMNS = [("new-phase val loss", "val_loss"), ("retention loss", "retention_loss"),
           ("dormant fraction", "dormant_fraction"), ("minutes", "minutes")]
SINGLE_FIT_COLUMNS = [("final val loss", "val_loss"), ("dormant fraction", "dormant_fraction")]
LOSS_UNIT = "loss (nats per byte)"
# Overrides that say how a run was launched or resumed, not what it studies: never a group label.
MECHANICS = ("seed", "hydra", "pipeline.", "paths.", "ckpt_path")
LINE_STYLES = ["-", "--", "-.", ":"]
MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*"]


@dataclass
class Run:
    path: Path
    method: str
    seed: int
    state: dict  # pipeline.json's content (a single fit: one phase named "fit")
    overrides: dict[str, str] = field(default_factory=dict)  # key -> the override as typed, without mechanics
    label: str = ""  # what distinguishes the run's group from the others (set by label_runs)
    curves: dict[str, dict[int, float]] = field(default_factory=dict)  # metric -> {global step: value}


# ------------------------------------------------------------------------------ finding runs

def read_overrides(run_dir: Path) -> dict[str, str]:
    """``key -> override`` (as typed, ``+`` dropped) from ``.hydra/overrides.yaml``, mechanics left out."""
    path = run_dir / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return {}
    import yaml

    found = {}
    for item in yaml.safe_load(path.read_text()) or []:
        key = item.lstrip("+~").partition("=")[0]
        if key != "method" and not key.startswith(MECHANICS):
            found[key] = item.lstrip("+")
    return found


def phase_rows(run: Run) -> dict[str, list[dict[str, float]]]:
    """Phase name -> its logged rows, from CSV or TensorBoard (a single fit: one phase, ``fit``)."""
    if run.state.get("single_fit"):
        return {"fit": read_rows(run.path, None)}
    return {name: read_rows(run.path, name) for name in run.state["phases"]}


def read_curves(run: Run) -> dict[str, dict[int, float]]:
    """``val`` (each phase's own validation loss), ``retention`` (the first phase's validation set),
    ``dormant`` and ``train`` over the run's global steps."""
    state = run.state
    first = (state.get("phase_order") or list(state["phases"]))[0]
    curves: dict[str, dict[int, float]] = defaultdict(dict)
    for name, rows in phase_rows(run).items():
        offset = int(state["phases"][name].get("step_offset", 0))
        retention_key = "val/loss" if name == first else f"retention/{first}/loss"
        for row in rows:
            step = int(row["step"]) + offset
            for curve, key in (("val", "val/loss"), ("retention", retention_key), ("dormant", "redo/dormant"),
                               ("train", "train/loss")):
                if key in row:
                    curves[curve][step] = float(row[key])
    if state.get("single_fit"):
        curves.pop("retention", None)  # the same numbers as "val"
    return dict(curves)


def single_fit_state(run_dir: Path) -> tuple[str, int, dict] | None:
    """A Hydra single fit's (method, seed, one-phase state) from its config and logged metrics (CSV or TensorBoard)."""
    config = run_dir / ".hydra" / "config.yaml"
    if not (config.is_file() and has_metrics(run_dir)):
        return None
    import yaml

    cfg = yaml.safe_load(config.read_text()) or {}
    callbacks = {k: v for k, v in (cfg.get("callbacks") or {}).items() if v}
    targets = [v["_target_"] for v in callbacks.values() if isinstance(v, dict) and "_target_" in v]
    method = "+".join(sorted(callbacks)) if callbacks else "no callbacks"
    seed = int(cfg.get("seed", 0))
    return method, seed, fit_state(run_dir, method, seed, summary_names(targets))


def fit_state(run_dir: Path, method: str, seed: int, summaries: list[str]) -> dict:
    """One fit as a one-phase pipeline state: its last logged values, ``summaries`` among them as the summary."""
    last: dict[str, float] = {}
    steps = 0
    for row in read_rows(run_dir, None):
        steps = max(steps, int(row["step"]))
        last.update({k: float(v) for k, v in row.items() if k not in ("epoch", "step")})
    phase = {"index": 0, "steps": steps, "step_offset": 0, "val_loss": last.get("val/loss"),
             "retention_loss": None, "dormant_fraction": last.get("redo/dormant"), "minutes": None,
             "summary": {name: last[name] for name in summaries if name in last}}
    return {"method": method, "seed": seed, "single_fit": True, "phase_order": ["fit"], "phases": {"fit": phase}}


def summary_names(targets: list[str] | None) -> list[str]:
    """The metrics the callbacks ``targets`` (``_target_`` paths) name as their summary (``summary_metrics``);
    ``None`` (a run that does not record its callbacks): those of every built-in callback. A class that cannot
    be imported here adds none.

    A run folder is data: a ``_target_`` it names is imported only from this package or when its module is
    already imported, never found afresh (importing a module runs its code, and a planted ``.py`` beside the
    report would be found first). ``PLASTICITY_TRUST_CHECKPOINTS=1`` lifts that, as for checkpoints."""
    import importlib
    import os
    import sys

    from ..runs.verified_files import TRUST_ENV

    if targets is None:
        from ...callbacks.base import callback_classes

        targets = [f"{cls.__module__}.{name}" for name, cls in callback_classes().items()]
    names: dict[str, None] = {}
    trusted = os.environ.get(TRUST_ENV) == "1"
    for target in targets:
        module, _, name = target.rpartition(".")
        if not (trusted or module.split(".")[0] == __name__.split(".")[0] or module in sys.modules):
            log.warning("plasticity-report: %s's summary metrics are not read: a run folder's _target_ is not imported "
                     "(import it first, or set %s=1 if you trust the run folder)", target, TRUST_ENV)
            continue
        try:
            names.update(dict.fromkeys(getattr(getattr(importlib.import_module(module), name), "summary_metrics", ())))
        except (ImportError, AttributeError, ValueError):
            continue
    return list(names)


def plain_run(run_dir: Path, root: Path) -> Run:
    """A run that only its logger wrote (a plain Lightning ``lightning_logs/version_0``), named by its folder."""
    name = run_dir.relative_to(root).as_posix() if run_dir != root else run_dir.name
    return Run(run_dir, name, 0, fit_state(run_dir, name, 0, summary_names(None)))


def find_runs(root: Path) -> list[Run]:
    """Every pipeline run, Hydra single fit and plain Lightning log folder under ``root``, labelled by what
    varies among them."""
    runs = []
    for state_file in sorted(root.rglob("pipeline.json")):
        with reading(state_file, "a pipeline state"):
            state = json.loads(state_file.read_text())
            if state.get("phases"):
                _check_pipeline_state(state)
                runs.append(Run(state_file.parent, str(state["method"]), int(state["seed"]), state))
    pipeline_dirs = {r.path for r in runs}
    single_fits = {config.parent.parent for config in root.rglob(".hydra/config.yaml")}
    for run_dir in sorted(single_fits):
        with reading(run_dir / ".hydra" / "config.yaml", "a run's config with its metrics"):
            if run_dir not in pipeline_dirs and (found := single_fit_state(run_dir)) is not None:
                runs.append(Run(run_dir, found[0], found[1], found[2]))
    known = pipeline_dirs | single_fits
    logged = {p.parent for pattern in ("metrics.csv", "events.out.tfevents.*") for p in root.rglob(pattern)}
    for run_dir in sorted(logged):
        if not any(run_dir == d or run_dir.is_relative_to(d) for d in known):
            runs.append(plain_run(run_dir, root))
    for run in runs:
        with reading(run.path, "a run folder (its .hydra/overrides.yaml and metric logs)"):
            run.overrides = read_overrides(run.path)
            run.curves = read_curves(run)
    label_runs(runs)
    return runs


def _check_pipeline_state(state) -> None:
    """The shape the report reads: ``{method, seed, phases: {name: {step_offset, numbers or null, ...}}}``."""
    phases = state["phases"]
    if not isinstance(phases, dict) or not all(isinstance(p, dict) for p in phases.values()):
        raise TypeError("phases must map each phase name to its record (a mapping)")
    for name, phase in phases.items():
        for key in ("step_offset", "steps", "val_loss", "retention_loss", "dormant_fraction", "minutes"):
            value = phase.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise TypeError(f"phases.{name}.{key}={value!r} is not a number")
        if not isinstance(phase.get("summary") or {}, dict):
            raise TypeError(f"phases.{name}.summary is not a mapping")


def label_runs(runs: list[Run]) -> list[str]:
    """Set each run's label to the settings that vary across ``runs``; return the shared ones."""
    keys = sorted({k for r in runs for k in r.overrides})
    varying = [k for k in keys if len({r.overrides.get(k) for r in runs}) > 1]
    methods_vary = len({r.method for r in runs}) > 1
    for run in runs:
        parts = [run.method] if methods_vary or not varying else []
        parts += [run.overrides.get(k, f"{k}=(default)") for k in varying]
        run.label = " ".join(parts)
    shared = [runs[0].overrides[k] for k in keys if k not in varying]
    if runs and not methods_vary and not runs[0].state.get("single_fit"):  # a single fit's method is its callbacks
        shared.insert(0, f"method {runs[0].method}")
    return shared


def groups_of(runs: list[Run]) -> dict[str, list[Run]]:
    groups: dict[str, list[Run]] = defaultdict(list)
    for run in runs:
        groups[run.label].append(run)
    return dict(sorted(groups.items()))


# ------------------------------------------------------------------------------ the table

def last_phase(run: Run) -> dict:
    """The run's last phase, with each method's summary values (``summary_metrics``) as columns of their own."""
    phase = list(run.state["phases"].values())[-1]
    return {**phase, **phase.get("summary", {})}


def summary_columns(runs: list[Run]) -> list[tuple[str, str]]:
    """One column per summary metric any run's methods named (e.g. ``fire/dfi_after``), in first-seen order."""
    names = dict.fromkeys(name for r in runs for name in list(r.state["phases"].values())[-1].get("summary", {}))
    return [(name, name) for name in names]


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample std over seeds; both NaN when a run has no finite value (a metric it did not measure)."""
    if not all(math.isfinite(v) for v in values):
        return math.nan, math.nan
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def summarize(runs: list[Run], columns=COLUMNS) -> dict[str, dict[str, tuple[float, float, int]]]:
    """label -> column -> (mean, std, number of seeds with a value)."""
    table = {}
    for label, members in groups_of(runs).items():
        row = {}
        for _, key in columns:
            if key == "minutes":
                values = [sum(p["minutes"] for p in r.state["phases"].values()) for r in members
                          if all(p.get("minutes") is not None for p in r.state["phases"].values())]
            else:
                values = [float(last_phase(r)[key]) for r in members if last_phase(r).get(key) is not None]
            if values:
                row[key] = (*mean_std(values), len(values))
        row["seeds"] = (len(members), 0.0, len(members))
        table[label] = row
    return table


def markdown_table(table: dict[str, dict[str, tuple[float, float, int]]], columns=COLUMNS,
                   first_column: str = "runs (what varies)") -> str:
    """Rows sorted by the first column's mean (best first); cells ``mean ± std`` (the value alone where one seed
    measured it: a std of one value says nothing), ``-`` where not logged."""
    header = f"| {first_column} | seeds | " + " | ".join(name for name, _ in columns) + " |"
    lines = [header, "|" + "---|" * (len(columns) + 2)]
    sort_key = columns[0][1]
    order = sorted(table, key=lambda label: table[label].get(sort_key, (float("inf"),))[0])
    for label in order:
        row = table[label]
        cells = []
        for _, key in columns:
            if key not in row:
                cells.append("-")
                continue
            mean, std, n = row[key]
            digits = 2 if key == "minutes" else 4
            cells.append(f"{mean:.{digits}f}" + (f" ± {std:.{digits}f}" if n > 1 else ""))
        lines.append(f"| {label} | {row['seeds'][2]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ the figures

def mean_band(series: list[dict[int, float]]) -> tuple[list[int], list[float], list[float]]:
    """Steps, mean and standard deviation over the series that logged each step (0 where only one did)."""
    steps = sorted({s for curve in series for s in curve})
    means, stds = [], []
    for step in steps:
        values = [curve[step] for curve in series if step in curve]
        mean, std = mean_std(values)
        means.append(mean)
        stds.append(std)
    return steps, means, stds


def merge_identical(groups: dict[str, list[Run]]) -> dict[str, list[Run]]:
    """Groups whose mean curves are equal at every step, for every metric, are drawn once and
    labelled ``a = b``, so that no curve hides another unseen (ReDo that never recycled = warm start)."""
    def means(members: list[Run]) -> dict[str, tuple]:
        names = sorted({name for r in members for name in r.curves})
        return {name: mean_band([r.curves.get(name, {}) for r in members])[:2] for name in names}

    merged: dict[str, list[Run]] = {}
    seen: dict[str, dict[str, tuple]] = {}
    for label, members in groups.items():
        mine = means(members)
        twin = next((other for other, theirs in seen.items() if same_curves(mine, theirs)), None)
        if twin is None:
            merged[label], seen[label] = members, mine
        else:
            merged[f"{twin} = {label}"] = merged.pop(twin)
            seen[f"{twin} = {label}"] = seen.pop(twin)
    return merged


def same_curves(a: dict[str, tuple], b: dict[str, tuple]) -> bool:
    return a.keys() == b.keys() and all(
        a[k][0] == b[k][0] and all(math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-12) for x, y in zip(a[k][1], b[k][1]))
        for k in a)


@dataclass
class Style:
    color: str
    linestyle: str
    marker: str


def styles_for(labels: list[str]) -> dict[str, Style]:
    """One colour, line style and marker per label, the same in every panel of every figure."""
    return {label: Style(f"C{i % 10}", LINE_STYLES[i % len(LINE_STYLES)], MARKERS[i % len(MARKERS)])
            for i, label in enumerate(labels)}


def plot_series(ax, series_by_label: dict[str, list[dict[int, float]]], styles: dict[str, Style] | None = None,
                boundaries: list[int] = ()) -> list[float]:
    """Mean line per label (its seed count in the legend) and a ± std band where n ≥ 2; returns all
    plotted values (for the y-limits). Markers differ per label, so overlapping curves stay apart."""
    styles = styles or styles_for(list(series_by_label))
    shown: list[float] = []
    for label, series in series_by_label.items():
        series = [curve for curve in series if curve]
        if not series:
            continue
        steps, means, stds = mean_band(series)
        style = styles[label]
        ax.plot(steps, means, color=style.color, linestyle=style.linestyle, marker=style.marker, markersize=4,
                markevery=max(1, len(steps) // 12), label=f"{label} (n={len(series)})" if len(series) > 1 else label)
        if len(series) > 1 and any(stds):
            low = [m - s for m, s in zip(means, stds)]
            high = [m + s for m, s in zip(means, stds)]
            ax.fill_between(steps, low, high, color=style.color, alpha=0.15, linewidth=0)
            shown += low + high
        shown += means
    for step in boundaries:
        ax.axvline(step, color="grey", linestyle="--", linewidth=1)
    return shown


def wide_range(values: list[float]) -> bool:
    """Positive values spanning more than a factor 2: a full reset starts far above the others."""
    finite = [v for v in values if math.isfinite(v)]
    return bool(finite) and min(finite) > 0 and max(finite) / min(finite) > 2


def fit_y_axis(ax, values: list[float]) -> None:
    """Every curve stays inside the axes; over a wide range a log scale keeps the close curves apart."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return
    low, high = min(finite), max(finite)
    if wide_range(finite):
        from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter

        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 7.0)))
        ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_ylim(low / 1.03, high * 1.03)
    else:
        pad = 0.04 * (high - low or abs(high) or 1.0)
        ax.set_ylim(low - pad, high + pad)


def zoom_on_the_best(ax, series_by_label: dict[str, list[dict[int, float]]]) -> bool:
    """Limit ``ax`` to the second half of the steps and to the curves that end within 10% of the
    best final value (the comparison a wide log scale squeezes); False when nothing to zoom on."""
    lines = {label: mean_band([c for c in series if c]) for label, series in series_by_label.items()
             if any(series)}
    if not lines:
        return False
    first = min(steps[0] for steps, _, _ in lines.values())
    last = max(steps[-1] for steps, _, _ in lines.values())
    middle = (first + last) / 2
    best = min(means[-1] for _, means, _ in lines.values())
    values = [v for steps, means, stds in lines.values() if means[-1] <= 1.1 * best
              for step, m, sd in zip(steps, means, stds) if step >= middle for v in (m - sd, m + sd)]
    if not values:
        return False
    low, high = min(values), max(values)
    pad = 0.05 * (high - low or abs(high) or 1.0)
    ax.set(xlim=(middle, last + 0.02 * (last - first)), ylim=(low - pad, high + pad))
    return True


@dataclass
class Panel:
    title: str
    ylabel: str
    series: dict[str, list[dict[int, float]]]  # label -> one {step: value} per seed
    xlabel: str = "optimizer step"
    boundaries: list[int] = field(default_factory=list)


def zoom_row(panels: list[Panel], values: dict[str, list[float]]) -> bool:
    """Whether a figure gets a second row zooming on the curves that end near the best: only where it compares
    several curves (one run, or one group, has nothing to pick out) and a wide range squeezes them together."""
    compared = len({label for panel in panels for label, series in panel.series.items() if any(series)}) > 1
    return compared and any(wide_range(v) for v in values.values())


def metric_figure(path: Path, panels: list[Panel], title: str | None = None) -> Path:
    """Panels side by side, one legend to their right (outside the data), saved as a PNG."""
    from matplotlib.figure import Figure

    values = {panel.title: [v for series in panel.series.values() for curve in series for v in curve.values()]
              for panel in panels}
    zoom = zoom_row(panels, values)  # a second row: the close curves, on a linear scale
    fig = Figure(figsize=(5.5 * len(panels) + 2.5, 4.2 * (2 if zoom else 1)), layout="constrained")
    grid = fig.subplots(2 if zoom else 1, len(panels), squeeze=False)
    handles: dict[str, object] = {}
    styles = styles_for(list(dict.fromkeys(label for panel in panels for label in panel.series)))
    for column, panel in enumerate(panels):
        ax = grid[0, column]
        fit_y_axis(ax, plot_series(ax, panel.series, styles, panel.boundaries))
        ax.set(title=panel.title, xlabel=panel.xlabel, ylabel=panel.ylabel)
        ax.grid(alpha=0.3)
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
        if zoom:
            below = grid[1, column]
            plot_series(below, panel.series, styles, panel.boundaries)
            if wide_range(values[panel.title]) and zoom_on_the_best(below, panel.series):
                below.set(title="zoom: second half, curves ending within 10% of the best", xlabel=panel.xlabel,
                          ylabel=panel.ylabel)
                below.grid(alpha=0.3)
            else:
                below.set_visible(False)
    if any(p.boundaries for p in panels):
        from matplotlib.lines import Line2D

        handles["phase boundary"] = Line2D([], [], color="grey", linestyle="--", linewidth=1)
    fig.legend(list(handles.values()), list(handles), loc="outside right upper", fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=120)
    return path


def boundaries(runs: list[Run]) -> list[int]:
    return sorted({int(p["step_offset"]) for r in runs for p in r.state["phases"].values() if p["step_offset"] > 0})


def plot_panels(runs: list[Run], series, xlabel: str, edges: list[int], pipeline: bool) -> list[Panel]:
    """The loss figure's panels, those with a curve: the training loss (logged every few steps, so a jump at a
    phase boundary shows as more than one segment), the validation loss and, for a pipeline, the first phase's
    validation set measured in the later phases (retention)."""
    validation = "validation loss, current phase's data" if pipeline else "validation loss"
    panels = [Panel("training loss, current phase's data" if pipeline else "training loss", LOSS_UNIT,
                    series("train"), xlabel, edges),
              Panel(validation, LOSS_UNIT, series("val"), xlabel, edges)]
    if any(r.curves.get("retention") for r in runs):
        first = (runs[0].state.get("phase_order") or list(runs[0].state["phases"]))[0]
        panels.append(Panel(f"retention: validation loss on {first!r} data", LOSS_UNIT, series("retention"),
                            xlabel, edges))
    return [p for p in panels if any(curve for curves in p.series.values() for curve in curves)]


def plot_curves(runs: list[Run], out: Path) -> list[Path]:
    groups = merge_identical(groups_of(runs))
    edges = boundaries(runs)
    pipeline = not all(r.state.get("single_fit") for r in runs)
    xlabel = "optimizer step (whole pipeline)" if pipeline else "optimizer step"

    def series(name: str) -> dict[str, list[dict[int, float]]]:
        return {label: [r.curves.get(name, {}) for r in members] for label, members in groups.items()}

    loss_panels = plot_panels(runs, series, xlabel, edges, pipeline)
    written = [metric_figure(out / "loss_curves.png", loss_panels)] if loss_panels else []  # no empty panel
    if any(r.curves.get("dormant") for r in runs):
        written.append(metric_figure(out / "dormant_fraction.png", [
            Panel("ReDo: dormant neurons", "dormant fraction (share of MLP neurons, 0-1)", series("dormant"),
                  xlabel, edges)]))
    for label, members in groups.items():  # FIRE's own before/after spectra, one run per group
        spectra = sorted(p for r in members for p in r.path.glob("logs/**/figures/fire_spectra_*.png"))
        if spectra:
            target = out / f"spectra_{re.sub(r'[^A-Za-z0-9_.=-]+', '_', label)}.png"
            shutil.copyfile(spectra[0], target)
            written.append(target)
    return written


# ------------------------------------------------------------------------------ the report

def build_report(root: Path, out: Path | None = None) -> tuple[str, list[Path]]:
    runs = find_runs(root)
    if not runs:
        raise FileNotFoundError(f"no runs under {root}: neither a pipeline.json nor logged metrics (a metrics.csv or "
                                "TensorBoard event files, e.g. lightning_logs/version_0)")
    shared = label_runs(runs)
    out = out or root / "report"
    out.mkdir(parents=True, exist_ok=True)
    single = all(r.state.get("single_fit") for r in runs)
    columns = [*SINGLE_FIT_COLUMNS, *summary_columns(runs)] if single else [*COLUMNS[:-1], *summary_columns(runs),
                                                                            COLUMNS[-1]]
    table = markdown_table(summarize(runs, columns), columns)
    figures = plot_curves(runs, out)
    phases = " → ".join(runs[0].state.get("phase_order") or runs[0].state["phases"])
    kind = "single fits" if single else f"phases {phases}"
    settings = ", ".join(shared) or "nothing but the defaults"
    text = "\n".join([
        f"# Plasticity study: {len(runs)} runs under {root}", "",
        f"Runs: {kind}. Shared by every run: {settings}. Mean ± std over seeds (the value alone for one seed); "
        "losses in nats per byte"
        + ("." if single else "; retention = loss on the first phase's validation set after the last phase; "
           "minutes = the phases each run trained."), "",
        table, "", *[f"![{p.stem}]({p.name})" for p in figures], "",
    ])
    (out / "report.md").write_text(text)
    return text, figures
