"""benchmarks/lm_stream_summary.py's table equals direct computations on hand-made runs (no training): the
late-stream mean, each seed's value and the seed-paired differences to warm and to reset, on accuracy and on loss."""
import csv
import json
import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from lm_stream_summary import read_runs, table  # noqa: E402

COLUMNS = ["task", "accuracy", "loss", "online_loss"]
# {method: {seed: [(accuracy, loss) per task]}}: three tasks each
RUNS = {
    "warm": {0: [(0.9, 1.0), (0.6, 2.0), (0.4, 3.0)], 1: [(0.9, 1.0), (0.8, 1.5), (0.6, 2.5)]},
    "reset": {0: [(0.5, 2.0), (0.9, 0.5), (1.0, 0.25)], 1: [(0.5, 2.0), (1.0, 0.5), (0.9, 0.75)]},
    "sp": {0: [(0.7, 1.5), (1.0, 0.2), (1.0, 0.1)]},
}


def write_runs(folder: Path) -> None:
    for method, seeds in RUNS.items():
        for seed, rows in seeds.items():
            logs = folder / f"{method}_{seed}" / "logs"
            logs.mkdir(parents=True)
            (logs / "stream.json").write_text(json.dumps({"method": method, "seed": seed}))
            with (logs / "tasks.csv").open("w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=COLUMNS)
                writer.writeheader()
                writer.writerows({"task": t, "accuracy": a, "loss": l, "online_loss": ""}
                                 for t, (a, l) in enumerate(rows))


def row_of(text: str, method: str) -> list[str]:
    return next(line for line in text.splitlines() if line.startswith(f"| {method} |")).strip("|").split(" | ")


def late(method: str, seed: int, column: int, k: int = 2) -> float:
    return statistics.mean(r[column] for r in RUNS[method][seed][-k:])


@pytest.mark.parametrize("metric, column, other", [("accuracy", 0, 1), ("loss", 1, 0)])
def test_table_pairs_each_seed_against_warm_and_reset(tmp_path, metric, column, other):
    write_runs(tmp_path)
    text = table(read_runs([str(tmp_path)]), k=2, metric=metric)
    warm = [late("warm", s, column) for s in (0, 1)]
    reset = [late("reset", s, column) for s in (0, 1)]
    name, mean, per_seed, minus_warm, minus_reset, others, early = row_of(text, "reset")
    assert mean == f"{statistics.mean(reset):.3f} ± {statistics.stdev(reset):.3f}"
    assert per_seed == " ".join(f"{v:.3f}" for v in reset)
    differences = [r - w for r, w in zip(reset, warm)]
    assert minus_warm == f"{statistics.mean(differences):.3f} ± {statistics.stdev(differences):.3f}"
    assert minus_reset == "0.000 ± 0.000"
    assert others.startswith(f"{statistics.mean(late('reset', s, other) for s in (0, 1)):.3f} ±")
    first = [statistics.mean(r[column] for r in RUNS["reset"][s][:2]) for s in (0, 1)]
    assert early.strip() == f"{statistics.mean(first):.3f} ± {statistics.stdev(first):.3f}"
    # a method run on seed 0 only is paired on that seed alone
    assert row_of(text, "sp")[3] == f"{late('sp', 0, column) - late('warm', 0, column):.3f} (n=1)"
    # best first: the highest accuracy, or the lowest loss
    order = [line.split(" | ")[0].removeprefix("| ") for line in text.splitlines()[2:]]
    assert order == ["sp", "reset", "warm"]
    assert f"end-of-task {'acc' if metric == 'accuracy' else 'loss'}, last 2" in text.splitlines()[0]


def test_an_unknown_metric_is_refused_by_name(tmp_path):
    write_runs(tmp_path)
    with pytest.raises(ValueError, match="'perplexity' is not one of"):
        table(read_runs([str(tmp_path)]), k=2, metric="perplexity")


def test_the_figure_gives_each_method_its_own_color(tmp_path):
    pytest.importorskip("matplotlib")
    from lm_stream_summary import figure
    import matplotlib.pyplot as plt

    write_runs(tmp_path)
    runs = read_runs([str(tmp_path)])
    for index in range(10):  # 13 methods, as the boundary-method sweep has
        runs[f"method_{index}"] = runs["sp"]
    figure(runs, tmp_path / "stream.png")
    assert (tmp_path / "stream.png").read_bytes().startswith(b"\x89PNG")
    fig = plt.gcf()
    lines = {line.get_label(): line.get_color() for line in fig.axes[0].get_lines()}
    assert len(lines) == 13 and len({str(color) for color in lines.values()}) == 13
    assert lines["warm (n=2)"] == "black"
