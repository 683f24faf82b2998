"""Summarizes ``experiment=continual_lm`` sweeps: a late-stream table and a figure per task.

Reads every run's ``logs/tasks.csv`` and ``logs/stream.json`` (TaskMetrics) under the given folders,
groups the runs by method, and prints, per method: end-of-task accuracy and loss on the task's own
targets over the last ``k`` tasks (mean ± std over seeds, and each seed's value), the first ``k``
tasks beside them, and the seed-paired difference to warm start and to full reset (``--metric loss``: the same
on the end-of-task loss, lower first, e.g. the held-out loss of ``design.name=slices``). The figure
(``--figure``) shows end-of-task accuracy and online loss against the task index, mean over seeds.
``--saturation`` reads each run's last checkpoint and prints how far its output head drives the
logits into the GPT's soft cap ``c·tanh(z/c)`` on the last task's windows (the cap's slope
``1 − tanh²(z/c)`` is the share of the gradient that passes it).

    python benchmarks/lm_stream_summary.py multirun/a multirun/b --k 5 --figure docs/lm_stream.png
    python benchmarks/lm_stream_summary.py multirun/slices --k 1 --metric loss
"""
from __future__ import annotations

import argparse
import csv
import json
import statistics
from collections import defaultdict
from pathlib import Path


def read_runs(folders: list[str]) -> dict[str, dict[int, list[dict]]]:
    """``{method: {seed: rows}}`` from every ``stream.json`` found under ``folders``."""
    runs: dict[str, dict[int, list[dict]]] = defaultdict(dict)
    for folder in folders:
        for info_file in sorted(Path(folder).rglob("stream.json")):
            info = json.loads(info_file.read_text())
            with info_file.with_name("tasks.csv").open(newline="") as f:
                rows = [{k: float(v) if v not in ("", "nan") else float("nan") for k, v in row.items()}
                        for row in csv.DictReader(f)]
            runs[info["method"]][int(info["seed"])] = sorted(rows, key=lambda r: r["task"])
    return runs


def window_mean(rows: list[dict], key: str, part: slice) -> float:
    values = [r[key] for r in rows[part]]
    return sum(values) / len(values)


def spread(values: list[float]) -> str:
    """``mean ± std`` over seeds; one seed has no spread, so its value alone (with ``(n=1)``)."""
    if len(values) == 1:
        return f"{values[0]:.3f} (n=1)"
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}"


METRICS = {"accuracy": "acc", "loss": "loss"}  # what the table ranks and pairs on: higher accuracy, lower loss


def table(runs: dict[str, dict[int, list[dict]]], k: int, metric: str = "accuracy") -> str:
    """One row per method: ``metric`` at each task's end over the last ``k`` tasks (mean ± std over seeds, each
    seed's value, the seed-paired differences to warm and to reset), the other metric over the same tasks, and
    ``metric`` over the first ``k``. Rows best first (highest accuracy or lowest loss)."""
    if metric not in METRICS:
        raise ValueError(f"--metric {metric!r} is not one of {sorted(METRICS)}")
    other = "loss" if metric == "accuracy" else "accuracy"
    last, first = slice(-k, None), slice(0, k)
    late = {m: {s: window_mean(rows, metric, last) for s, rows in seeds.items()} for m, seeds in runs.items()}
    lines = [f"| method | end-of-task {METRICS[metric]}, last {k} | per seed | − warm (paired) | − reset (paired) | "
             f"end-of-task {METRICS[other]}, last {k} | end-of-task {METRICS[metric]}, first {k} |",
             "|---|---|---|---|---|---|---|"]
    sign = -1 if metric == "accuracy" else 1
    for method in sorted(late, key=lambda m: sign * statistics.mean(late[m].values())):
        seeds = sorted(late[method])
        paired = []
        for base in ("warm", "reset"):
            common = [s for s in seeds if s in late.get(base, {})]
            paired.append(spread([late[method][s] - late[base][s] for s in common]) if common else "—")
        others = [window_mean(runs[method][s], other, last) for s in seeds]
        early = [window_mean(runs[method][s], metric, first) for s in seeds]
        per_seed = " ".join(f"{late[method][s]:.3f}" for s in seeds)
        lines.append(f"| {method} | {spread(list(late[method].values()))} | {per_seed} | {paired[0]} | {paired[1]} | "
                     f"{spread(others)} | {spread(early)} |")
    return "\n".join(lines)


def figure(runs: dict[str, dict[int, list[dict]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, 2, figsize=(14, 4.6))
    styles = ["-", "--", "-.", ":"]
    # the two references stand out in black and grey, drawn over the others; the rest take tab10's colors but its
    # grey, then two more: 11 methods besides the references keep distinct colors
    references = {"warm": ("black", "-"), "reset": ("dimgray", "--")}
    palette = [c for i, c in enumerate(plt.get_cmap("tab10").colors) if i != 7] + ["navy", "gold"]
    others = [m for m in sorted(runs) if m not in references]
    for method in others + [m for m in references if m in runs]:
        index = others.index(method) if method in others else 0
        color, style = references.get(method, (palette[index % len(palette)], styles[index % len(styles)]))
        seeds = runs[method]
        n_tasks = min(len(rows) for rows in seeds.values())
        for ax, key in zip(axes, ("accuracy", "online_loss")):
            mean = [statistics.mean(rows[t][key] for rows in seeds.values()) for t in range(n_tasks)]
            low = [min(rows[t][key] for rows in seeds.values()) for t in range(n_tasks)]
            high = [max(rows[t][key] for rows in seeds.values()) for t in range(n_tasks)]
            ax.plot(range(n_tasks), mean, style, marker="os^vDP"[index % 6], color=color, markersize=3,
                    linewidth=2.2 if method in references else 1.4, label=f"{method} (n={len(seeds)})")
            ax.fill_between(range(n_tasks), low, high, color=color, alpha=0.10, linewidth=0)
    axes[0].set(title="end-of-task accuracy on the task's random last bytes", xlabel="task", ylabel="accuracy",
                ylim=(0, 1.02))
    axes[1].set(title="online training loss (mean over the task's steps)", xlabel="task", ylabel="nats")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    # outside the axes: with many methods any corner inside one covers a curve
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8, frameon=False)
    fig.suptitle("LM stream (experiment=continual_lm): mean over seeds, band = min–max over seeds")
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")


def saturation(folders: list[str]) -> None:
    """Per run: the head's norm, the share of raw last-position logits beyond ``2c`` and the median cap slope."""
    import torch
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from plasticity_callbacks.models.gpt import GPT, GPTConfig

    for folder in folders:
        for info_file in sorted(Path(folder).rglob("stream.json")):
            run = info_file.parent.parent
            checkpoint = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True, map_location="cpu")
            fields = dict(checkpoint["hyper_parameters"]["model"])
            cap = fields["logit_softcap"]
            model = GPT(GPTConfig(**{**fields, "logit_softcap": 0.0}))  # raw logits, before the cap
            model.load_state_dict({k.removeprefix("model."): v for k, v in checkpoint["state_dict"].items()})
            stream = instantiate(OmegaConf.load(run / ".hydra" / "config.yaml").data)
            x, y = stream.eval_data(stream.num_tasks - 1)
            with torch.no_grad():
                raw = model(x)[:, -1]  # (windows, vocab)
            slope = 1 - torch.tanh(raw / cap) ** 2
            info = json.loads(info_file.read_text())
            print(f"{info['method']:10s} seed {info['seed']}: head norm {model.lm_head.weight.norm():6.1f}, "
                  f"|raw logit| > {2 * cap:g}: {(raw.abs() > 2 * cap).float().mean():.2f}, median cap slope "
                  f"{slope.median():.3f} (at the target byte {slope.gather(1, y[:, -1:]).median():.3f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+")
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--metric", choices=sorted(METRICS), default="accuracy",
                        help="what the table ranks and pairs on (loss: the held-out loss of design.name=slices)")
    parser.add_argument("--figure", default=None)
    parser.add_argument("--saturation", action="store_true", help="the head's soft-cap saturation per run")
    args = parser.parse_args()
    runs = read_runs(args.folders)
    print(table(runs, args.k, args.metric))
    if args.figure:
        figure(runs, Path(args.figure))
        print(f"figure: {args.figure}")
    if args.saturation:
        saturation(args.folders)


if __name__ == "__main__":
    main()
