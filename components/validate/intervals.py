"""Confidence bounds for parity metrics: Wilson score bounds, a paired-difference bound, percentile bootstrap.

Gates with `confidence` (spec `GateSpec.confidence`) compare a one-sided bound on the bad side instead of the
point estimate, so a small group neither passes vacuously nor fails on one unlucky row.

Methods:

Wilson score bound (Wilson 1927, "Probable inference, the law of succession, and statistical inference",
JASA 22:209-212; recommended over the Wald interval by Brown, Cai & DasGupta 2001, "Interval estimation
for a binomial proportion", Statistical Science 16:101-133). For x successes in n trials, p = x / n and
z = Phi^-1(confidence) (one-sided) or Phi^-1(1 - (1 - confidence) / 2) (two-sided):

    centre = (p + z^2 / (2n)) / (1 + z^2 / n)
    half   = z / (1 + z^2 / n) * sqrt(p (1 - p) / n + z^2 / (4 n^2))
    lower  = centre - half,  upper = centre + half          (always inside [0, 1])

Paired difference of two proportions measured on the same rows (candidate accuracy minus reference
accuracy): Newcombe's square-and-add hybrid score interval, method 10 of Newcombe 1998 ("Improved
confidence intervals for the difference between binomial proportions based on paired data", Statistics
in Medicine 17:2635-2650; also Fagerland, Lydersen & Laake 2017, "Statistical Analysis of Contingency
Tables", ch. 8). With the 2x2 table a = both 1, b = first 1 / second 0, c = first 0 / second 1, d = both 0,
p1 = (a + b) / n, p2 = (a + c) / n, Wilson limits (l1, u1), (l2, u2) of p1 and p2 at the same z, and the
continuity-corrected correlation psi (A = ad - bc; psi = (A - n/2) / sqrt((a+b)(c+d)(a+c)(b+d)) when
A > n/2, 0 when 0 <= A <= n/2, A / sqrt(...) when A < 0, and 0 when a margin is empty):

    lower = (p1 - p2) - sqrt((p1 - l1)^2 + (u2 - p2)^2 - 2 psi (p1 - l1)(u2 - p2))
    upper = (p1 - p2) + sqrt((p2 - l2)^2 + (u1 - p1)^2 - 2 psi (p2 - l2)(u1 - p1))

Percentile bootstrap (Efron & Tibshirani 1993, "An Introduction to the Bootstrap", ch. 13): `samples`
resamples of the rows with replacement (numpy.random.default_rng(seed)), the statistic of each, and the
(1 - confidence) / confidence quantile (numpy "linear") of those values as the lower / upper bound. The
statistics are those of `parity.aggregate`: "mean", percentiles "p01"/"p99" (linear interpolation; one
touching +-inf gives +-inf), "max", "min". For "max"/"min" the bootstrap cannot go beyond the observed
extreme (the bootstrap is inconsistent for extremes, Bickel & Freedman 1981), so the bad-side bound of a
maximum error equals the observed maximum: such a gate is decided as on the point value.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
from scipy.stats import norm

from tailguard.errors import InputError
from tailguard.spec import PROPORTION_METRICS, TASK_METRICS, BootstrapSpec

from .parity import _percentile, _source

Side = Literal["lower", "upper"]
BOOTSTRAP_BLOCK_ELEMENTS = 8 * 2**20  # resampled values held at once (float64: 64 MiB)
STATISTICS = ("mean", "max", "min")  # plus "p<q>" percentiles


def _check(confidence: float, side: str | None) -> None:
    if not (0.0 < float(confidence) < 1.0):
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
    if side is not None and side not in ("lower", "upper"):
        raise ValueError(f"side must be 'lower' or 'upper', got {side!r}")


def _wilson(successes: np.ndarray, n: np.ndarray, z: float) -> tuple[np.ndarray, np.ndarray]:
    """Vectorised Wilson limits (lower, upper) at normal quantile z; NaN where n == 0."""
    x = np.asarray(successes, dtype=np.float64)
    nn = np.asarray(n, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = x / nn
        z2n = z * z / nn
        centre = (p + z2n / 2.0) / (1.0 + z2n)
        half = z / (1.0 + z2n) * np.sqrt(np.maximum(p * (1.0 - p) / nn, 0.0) + z2n / (4.0 * nn))
    lo = np.where(x == 0, 0.0, np.clip(centre - half, 0.0, 1.0))  # exact limits at 0 / n successes
    hi = np.where(x == nn, 1.0, np.clip(centre + half, 0.0, 1.0))
    return np.where(nn > 0, lo, np.nan), np.where(nn > 0, hi, np.nan)


def _counts(successes, n) -> tuple[np.ndarray, np.ndarray]:
    x = np.asarray(successes, dtype=np.float64)
    nn = np.asarray(n, dtype=np.float64)
    if np.any(nn < 0) or np.any(x < 0) or np.any(x > nn):
        raise ValueError(f"need 0 <= successes <= n, got successes={successes!r}, n={n!r}")
    return x, nn


def _out(a: np.ndarray) -> float | np.ndarray:
    return float(a) if np.ndim(a) == 0 else a


def wilson_bound(successes: int | np.ndarray, n: int | np.ndarray, confidence: float,
                 side: Side) -> float | np.ndarray:
    """One-sided Wilson score bound of a binomial proportion (formula: module docstring).

    P(p >= lower) is about `confidence` (and P(p <= upper)); the coverage oscillates with n and p around
    the nominal level (Brown, Cai & DasGupta 2001, fig. 5).

    Args:
        successes: rows with value 1 (int, or an int array of any shape).
        n: rows (int, or an array broadcastable with `successes`).
        confidence: one-sided level in (0, 1), e.g. 0.95 (z = Phi^-1(confidence) = 1.645).
        side: "lower" or "upper".

    Returns:
        The bound in [0, 1] (float for scalar inputs, else float64 array of the broadcast shape); NaN where
        n == 0.

    Raises:
        ValueError: confidence outside (0, 1), an unknown side, or successes outside [0, n].
    """
    _check(confidence, side)
    x, nn = _counts(successes, n)
    lo, hi = _wilson(x, nn, float(norm.ppf(confidence)))
    return _out(lo if side == "lower" else hi)


def wilson_interval(successes: int, n: int, confidence: float) -> tuple[float, float]:
    """Two-sided Wilson score interval at level `confidence` (z = Phi^-1(1 - (1 - confidence) / 2)).

    Args:
        successes: rows with value 1.
        n: rows.
        confidence: two-sided level in (0, 1), e.g. 0.95 (z = 1.96).

    Returns:
        (lower, upper), both in [0, 1]; (NaN, NaN) when n == 0.

    Raises:
        ValueError: confidence outside (0, 1) or successes outside [0, n].
    """
    _check(confidence, None)
    x, nn = _counts(successes, n)
    lo, hi = _wilson(x, nn, float(norm.ppf(1.0 - (1.0 - confidence) / 2.0)))
    return float(lo), float(hi)


def paired_difference_bound(first: np.ndarray, second: np.ndarray, confidence: float, side: Side) -> float:
    """One-sided bound of mean(first) - mean(second) for 0/1 values paired by row (Newcombe 1998 method 10).

    Used for relative accuracy gates: first = the candidate's per-row `correct`, second = the reference's
    `reference_correct` on the same rows, so the lower bound says how much accuracy the variant may have
    lost at most (formula: module docstring; the Wilson limits use the one-sided z = Phi^-1(confidence)).

    Args:
        first: bool or 0/1 array of shape (rows,).
        second: bool or 0/1 array of shape (rows,), the same rows.
        confidence: one-sided level in (0, 1).
        side: "lower" or "upper".

    Returns:
        The bound in [-1, 1]; NaN when rows == 0.

    Raises:
        ValueError: arrays of different shapes, values other than 0/1, a bad confidence or side.
    """
    _check(confidence, side)
    f, s = np.asarray(first).reshape(-1), np.asarray(second).reshape(-1)
    if f.shape != s.shape:
        raise ValueError(f"paired arrays differ in length: {f.shape[0]} vs {s.shape[0]}")
    if f.size == 0:
        return float("nan")
    if not (np.isin(f, (0, 1)).all() and np.isin(s, (0, 1)).all()):
        raise ValueError("paired_difference_bound needs 0/1 values")
    f, s = f.astype(bool), s.astype(bool)
    n = float(f.size)
    a = float(np.sum(f & s))
    b = float(np.sum(f & ~s))
    c = float(np.sum(~f & s))
    d = float(np.sum(~f & ~s))
    p1, p2 = (a + b) / n, (a + c) / n
    z = float(norm.ppf(confidence))
    (l1, l2), (u1, u2) = _wilson(np.array([a + b, a + c]), np.array([n, n]), z)
    margins = (a + b) * (c + d) * (a + c) * (b + d)
    psi = 0.0
    if margins > 0:
        big_a = a * d - b * c
        if big_a > n / 2:
            psi = (big_a - n / 2) / math.sqrt(margins)
        elif big_a < 0:
            psi = big_a / math.sqrt(margins)
    if side == "lower":
        x, y = p1 - l1, u2 - p2
        return max(-1.0, (p1 - p2) - math.sqrt(max(x * x + y * y - 2 * psi * x * y, 0.0)))
    x, y = p2 - l2, u1 - p1
    return min(1.0, (p1 - p2) + math.sqrt(max(x * x + y * y - 2 * psi * x * y, 0.0)))


def _row_stat(block: np.ndarray, statistic: str) -> np.ndarray:
    """The statistic of each row of `block` (resamples, n) -> (resamples,), with parity._stat semantics."""
    if statistic == "mean":
        with np.errstate(invalid="ignore"):
            return block.mean(axis=1)
    if statistic == "max":
        return block.max(axis=1)
    if statistic == "min":
        return block.min(axis=1)
    q = float(statistic[1:])
    n = block.shape[1]
    pos = (q / 100.0) * (n - 1)
    lo, hi = int(math.floor(pos)), int(math.ceil(pos))
    frac = pos - lo
    part = np.partition(block, sorted({lo, hi}), axis=1)
    a, b = part[:, lo], part[:, hi]
    if frac == 0:
        return a
    with np.errstate(invalid="ignore"):
        mid = a + (b - a) * frac
    out = np.where(a == b, a, mid)
    out = np.where((a != b) & (b == np.inf), np.inf, out)
    return np.where((a != b) & (a == -np.inf), -np.inf, out)


def _check_statistic(statistic: str) -> None:
    if statistic in STATISTICS:
        return
    if statistic.startswith("p"):
        try:
            q = float(statistic[1:])
        except ValueError:
            q = -1.0
        if 0.0 <= q <= 100.0:
            return
    raise ValueError(f"unknown statistic {statistic!r}: use 'mean', 'max', 'min' or 'p<q>' (e.g. 'p99')")


def bootstrap_distribution(values: np.ndarray, statistic: str, samples: int, seed: int) -> np.ndarray:
    """The statistic over `samples` resamples (rows drawn with replacement) of `values`.

    Args:
        values: per-row values, shape (rows,), float or bool.
        statistic: "mean", "max", "min" or a percentile "p<q>" ("p01", "p99").
        samples: number of resamples (>= 1).
        seed: seed of numpy.random.default_rng: the same inputs give the same distribution.

    Returns:
        float64 array of shape (samples,); empty when rows == 0.

    Raises:
        ValueError: an unknown statistic or samples < 1.
    """
    _check_statistic(statistic)
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    x = np.asarray(values).reshape(-1).astype(np.float64)
    n = x.size
    if n == 0:
        return np.zeros(0)
    rng = np.random.default_rng(seed)
    out = np.empty(samples, dtype=np.float64)
    block = max(1, BOOTSTRAP_BLOCK_ELEMENTS // n)
    for start in range(0, samples, block):
        stop = min(samples, start + block)
        idx = rng.integers(0, n, size=(stop - start, n))  # (resamples, rows)
        out[start:stop] = _row_stat(x[idx], statistic)
    return out


def bootstrap_bound(values: np.ndarray, statistic: str, confidence: float, side: Side, samples: int = 1000,
                    seed: int = 0) -> float:
    """One-sided percentile-bootstrap bound of a statistic of per-row values (Efron & Tibshirani 1993).

    Args:
        values: per-row values, shape (rows,), float or bool (e.g. `cosine_similarity`, `abs_error`).
        statistic: "mean", "max", "min" or a percentile "p<q>", as in `parity.aggregate`.
        confidence: one-sided level in (0, 1).
        side: "lower" (the (1 - confidence) quantile of the bootstrap distribution) or "upper" (its
            `confidence` quantile), numpy "linear" quantiles.
        samples: resamples (spec `analysis.bootstrap.samples`).
        seed: rng seed (spec `analysis.bootstrap.seed`).

    Returns:
        The bound, in the units of `values`; NaN when rows == 0; +-inf when the resampled statistics
        reach +-inf (non-finite rows) on that side.

    Raises:
        ValueError: an unknown statistic, samples < 1, a bad confidence or side.
    """
    _check(confidence, side)
    dist = bootstrap_distribution(values, statistic, samples, seed)
    if dist.size == 0:
        return float("nan")
    q = (1.0 - confidence) if side == "lower" else confidence
    # parity's percentile: numpy "linear", but +-inf (never NaN) when interpolating next to an infinity
    return _percentile(dist, q * 100.0)


def metric_bound(task: str, metric: str, per_sample: dict[str, np.ndarray], mask: np.ndarray | None,
                 confidence: float, side: Side, bootstrap: BootstrapSpec | None = None) -> float:
    """One-sided confidence bound of a parity metric over all rows or the rows under `mask`.

    Wilson score bound for PROPORTION_METRICS (successes = the sum of the 0/1 per-row values), the
    percentile bootstrap (`bootstrap.samples`, `bootstrap.seed`) of the metric's statistic otherwise.

    Args:
        task: spec `model.task`.
        metric: a parity metric of TASK_METRICS[task], e.g. "top1_agreement", "cosine_similarity.p01".
        per_sample: `parity.per_sample_metrics` output, arrays of shape (rows,).
        mask: bool array of shape (rows,) selecting the rows (a slice group), or None for all rows.
        confidence: one-sided level in (0, 1).
        side: "lower" or "upper".
        bootstrap: resamples and seed (default: BootstrapSpec() = 1000 resamples, seed 0).

    Returns:
        The bound in the metric's units; NaN when no row is selected.

    Raises:
        InputError: a metric the task does not produce, its per-row values missing, or a mask of another
            length.
        ValueError: a bad confidence or side.
    """
    if task not in TASK_METRICS or metric not in TASK_METRICS[task]:
        raise InputError(f"metric_bound: {metric!r} is not a parity metric of task {task!r}")
    key, how = _source(metric)
    if key not in per_sample:
        raise InputError(f"metric_bound: per-row values {key!r} missing for metric {metric!r}",
                         hint="pass the output of per_sample_metrics for the same task")
    x = np.asarray(per_sample[key]).reshape(-1)
    if mask is not None:
        m = np.asarray(mask, dtype=bool).reshape(-1)
        if m.shape[0] != x.shape[0]:
            raise InputError(f"metric_bound: mask has {m.shape[0]} rows, per-row values have {x.shape[0]}")
        x = x[m]
    if metric in PROPORTION_METRICS:
        return float(wilson_bound(int(np.count_nonzero(x)), int(x.size), confidence, side))
    bs = bootstrap or BootstrapSpec()
    return bootstrap_bound(x, how, confidence, side, samples=bs.samples, seed=bs.seed)


def method_words(metric: str, confidence: float, side: Side, bootstrap: BootstrapSpec | None = None) -> str:
    """How `metric_bound` bounds a metric, in words (recorded in GateResult.method)."""
    level = f"{confidence * 100:g}%"
    if metric in PROPORTION_METRICS:
        return f"one-sided {level} Wilson score {side} bound"
    bs = bootstrap or BootstrapSpec()
    return f"one-sided {level} percentile-bootstrap {side} bound ({bs.samples} resamples, seed {bs.seed})"
