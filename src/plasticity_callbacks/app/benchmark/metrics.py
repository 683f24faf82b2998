"""The benchmark's numbers, plain functions of one run's per-task accuracies and of seed-paired runs.

A run gives two series, one value per task: the end-of-task accuracy (on the task's evaluation data at
its end: the task's own images for random labels, held-out images for permuted digits) and the online
accuracy (the mean over the task's steps of the training batch's accuracy before its update). A method
is ranked on what is left late in the stream, the end-of-task accuracy over the last ``k`` tasks, with
its trend and the all-task online average beside it. Two methods are compared on the same seeds: the
difference of each seed's metric, with a Student-t confidence interval over those differences.

Example:
    >>> late_stream_accuracy([0.5, 0.4, 0.3, 0.2], k=2)
    0.25
    >>> paired_difference([0.9, 0.8, 0.85], [0.5, 0.6, 0.5]).mean
    0.31666666666666665
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from ..report.streams import accuracy_slope


def late_stream_accuracy(accuracy: list[float], k: int) -> float:
    """The mean end-of-task accuracy over the last ``k`` tasks (all of them in a shorter stream).

    Args:
        accuracy: end-of-task accuracy per task, in task order.
        k: how many of the last tasks count (at least 1).
    """
    if k < 1:
        raise ValueError(f"k={k!r}: the late-stream metric needs at least the last task (k >= 1)")
    return statistics.fmean(accuracy[-k:])


def slope_per_100_tasks(accuracy: list[float]) -> float:
    """100 × the least-squares slope of end-of-task accuracy against the task index (NaN below two tasks).
    A trend over the stream's own tasks, not a forecast: the curves are not linear, and on a 20-task stream this
    number overstates what a 100-task stream measures many times over (docs/long_stream.md)."""
    return 100 * accuracy_slope(accuracy)


def windowed_accuracy(accuracy: list[float], task: int, width: int = 5) -> float:
    """The mean end-of-task accuracy over the ``width`` tasks ending at ``task`` (counted from 1, as a reader
    counts them: ``task=20, width=5`` is tasks 16–20), so one noisy task end does not stand for the stream there.

    Raises:
        ValueError: ``task`` is not in ``width … len(accuracy)``.
    """
    if not 1 <= width <= task <= len(accuracy):
        raise ValueError(f"task={task}, width={width}: the window must lie within the stream's {len(accuracy)} tasks")
    return statistics.fmean(accuracy[task - width:task])


def online_average(online_accuracy: list[float]) -> float:
    """The online accuracy averaged over every task of the stream (early tasks weigh as much as late ones)."""
    return statistics.fmean(online_accuracy)


@dataclass(frozen=True)
class PairedDifference:
    """``a − b`` over seeds both ran: the mean of the per-seed differences and its confidence interval."""

    mean: float
    low: float   # the interval's ends; NaN with fewer than two seeds (no spread to estimate)
    high: float
    seeds: int

    @property
    def excludes_zero(self) -> bool:
        """Whether the interval lies wholly on one side of 0 (False when there is no interval)."""
        return self.low > 0 or self.high < 0

    def __str__(self) -> str:
        if not math.isfinite(self.low):
            return f"{self.mean:+.3f}"
        return f"{self.mean:+.3f} [{self.low:+.3f}, {self.high:+.3f}]"


def paired_difference(a: list[float], b: list[float], confidence: float = 0.95) -> PairedDifference:
    """The seed-paired difference ``a[i] − b[i]`` with a Student-t interval over the ``n`` differences:
    mean ± t_{(1+confidence)/2, n−1} · sd / √n.

    Args:
        a, b: one value per seed, the same seeds in the same order.
        confidence: the interval's coverage (0.95: a 95 % interval).

    Raises:
        ValueError: the lists differ in length or are empty, or ``confidence`` is not in (0, 1).
    """
    from scipy.stats import t  # scipy comes with scikit-learn, the [digits] extra this benchmark needs

    if len(a) != len(b) or not a:
        raise ValueError(f"paired_difference needs one value per seed on both sides, got {len(a)} and {len(b)}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence={confidence!r} must be in (0, 1)")
    differences = [x - y for x, y in zip(a, b)]
    mean, n = statistics.fmean(differences), len(differences)
    if n < 2:
        return PairedDifference(mean, math.nan, math.nan, n)
    half = t.ppf((1 + confidence) / 2, n - 1) * statistics.stdev(differences) / math.sqrt(n)
    return PairedDifference(mean, mean - half, mean + half, n)


def mean_interval(values: list[float], confidence: float = 0.95) -> PairedDifference:
    """The mean of ``values`` (one per seed, or per split) with its Student-t interval: a paired difference from 0."""
    return paired_difference(list(values), [0.0] * len(values), confidence)


def paired_p_value(a: list[float], b: list[float]) -> float:
    """The two-sided p-value of the paired t-test of ``a − b`` = 0 (the test the intervals invert: a 95 %
    interval excludes 0 exactly when p < 0.05); NaN below two pairs or with no spread."""
    from scipy.stats import t

    differences = [x - y for x, y in zip(a, b, strict=True)]
    n = len(differences)
    if n < 2 or statistics.stdev(differences) == 0:
        return math.nan
    statistic = statistics.fmean(differences) / (statistics.stdev(differences) / math.sqrt(n))
    return float(2 * t.sf(abs(statistic), n - 1))


def holm_rejections(p_values: list[float], alpha: float = 0.05) -> list[bool]:
    """Holm's step-down test of ``m`` hypotheses at family-wise error ``alpha``: the ``i``-th smallest p-value
    (from 0) is rejected while every p-value up to it is below ``alpha / (m − i)``; at the first that is not,
    it and every larger one stand (a NaN p-value is never rejected). Uniformly more powerful than Bonferroni
    (every p below ``alpha / m``), with the same family-wise guarantee."""
    m = len(p_values)
    rejected = [False] * m
    for rank, index in enumerate(sorted(range(m), key=lambda i: (math.isnan(p_values[i]), p_values[i]))):
        if not p_values[index] < alpha / (m - rank):  # NaN stops it too
            break
        rejected[index] = True
    return rejected
