"""tailguard's fixed-sample statistics: confidence bounds, two-sample tests and the false discovery rate.

Validation gates (components/validate/intervals.py, gates.py), worst-slice discovery
(components/validate/discovery.py) and the interleaved speed ratios (core/latency.py) take their numbers from
here. The monitor's betting CUSUM (monitoring/detector.py) is sequential change detection, not a bound or a test of
this kind, and stays beside the monitor.

Library first: where scipy computes the same thing it is used (`scipy.stats.beta` for Clopper-Pearson,
`scipy.stats.bootstrap` for every bootstrap, `scipy.stats.hypergeom` for Fisher's exact test,
`scipy.stats.false_discovery_control` for Benjamini-Hochberg). Wilson's score bound, Newcombe's paired
difference bound and the vectorised Mann-Whitney U approximation are written out (a few lines each, every
slice tested by a discovery run at once); tests/core/test_core_stats.py checks each against statsmodels or scipy and
against published worked examples. statsmodels (`proportion_confint`) computes the Wilson and Clopper-Pearson
limits too, but it is not a declared dependency of tailguard (it is installed only through another package), so
it is a test reference, not a runtime import.

Conventions: `confidence` is one-sided for a `*_bound` (P(true value >= lower bound) ~ confidence) and
two-sided for an `*_interval`; a one-sided bound at level c is the matching end of the two-sided interval at
level 2c - 1. `side` is "lower" or "upper". Bad arguments (a level outside (0, 1), an unknown side or
statistic, counts outside [0, n], arrays of different lengths) raise ValueError: callers that pass user data
check it first and raise a TailguardError naming the field.

Sequential decisions (a gate decided before the last validation row, a timing that stops at a precision) are in
`tailguard.core.sequential_stats`.

Formulas and sources are in each function's docstring.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Literal

import numpy as np


def _st():  # scipy.stats costs 0.6-1.5 s to import: only the functions that use it pay for it
    from scipy import stats

    return stats


Side = Literal["lower", "upper"]
BOOTSTRAP_BLOCK_ELEMENTS = 8 * 2**20  # resampled values held at once by a bootstrap (float64: 64 MiB)
STATISTICS = ("mean", "max", "min")  # bootstrap statistics, plus percentiles "p<q>" ("p01", "p99")

__all__ = [
    "BOOTSTRAP_BLOCK_ELEMENTS", "STATISTICS", "Side", "benjamini_hochberg", "bootstrap_bound",
    "bootstrap_distribution", "check_statistic", "clopper_pearson_bound", "clopper_pearson_interval",
    "fisher_exact_greater", "mann_whitney_u_greater", "median_ratio", "newcombe_paired_bound",
    "newcombe_paired_interval", "paired_counts", "paired_ratio_bootstrap", "percentile", "rank_with_ties",
    "row_statistic", "wilson_bound", "wilson_interval", "z_value", "check_level",
]


# --------------------------------------------------------------------------------------------- arguments
def check_level(confidence: float, side: str | None) -> None:
    """Raise ValueError unless 0 < `confidence` < 1 and `side` is None, "lower" or "upper"."""
    if not (0.0 < float(confidence) < 1.0):
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
    if side is not None and side not in ("lower", "upper"):
        raise ValueError(f"side must be 'lower' or 'upper', got {side!r}")


def _counts(successes, n) -> tuple[np.ndarray, np.ndarray]:
    x = np.asarray(successes, dtype=np.float64)
    nn = np.asarray(n, dtype=np.float64)
    if np.any(nn < 0) or np.any(x < 0) or np.any(x > nn):
        raise ValueError(f"need 0 <= successes <= n, got successes={successes!r}, n={n!r}")
    return x, nn


def _out(a: np.ndarray) -> float | np.ndarray:
    return float(a) if np.ndim(a) == 0 else a


@functools.lru_cache(maxsize=256)  # pure; sequential validation asks for the same level hundreds of times
def z_value(confidence: float, two_sided: bool = False) -> float:
    """Standard normal quantile for a confidence level: Phi^-1(confidence) one-sided, Phi^-1(1 - (1 -
    confidence) / 2) two-sided (`scipy.stats.norm.ppf`); e.g. 0.95 -> 1.6449 one-sided, 1.9600 two-sided.

    Raises:
        ValueError: confidence outside (0, 1).
    """
    check_level(confidence, None)
    return float(_st().norm.ppf(1.0 - (1.0 - confidence) / 2.0 if two_sided else confidence))


# ------------------------------------------------------------------------------ one binomial proportion
def _wilson(successes: np.ndarray, n: np.ndarray, z: float) -> tuple[np.ndarray, np.ndarray]:
    """Wilson limits (lower, upper) at normal quantile z, vectorised; NaN where n == 0."""
    x = np.asarray(successes, dtype=np.float64)
    nn = np.asarray(n, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = x / nn
        z2n = z * z / nn
        centre = (p + z2n / 2.0) / (1.0 + z2n)
        half = z / (1.0 + z2n) * np.sqrt(np.maximum(p * (1.0 - p) / nn, 0.0) + z2n / (4.0 * nn))
    lo = np.where(x == 0, 0.0, np.clip(centre - half, 0.0, 1.0))  # the exact limits at 0 and n successes
    hi = np.where(x == nn, 1.0, np.clip(centre + half, 0.0, 1.0))
    return np.where(nn > 0, lo, np.nan), np.where(nn > 0, hi, np.nan)


def wilson_bound(successes: int | np.ndarray, n: int | np.ndarray, confidence: float,
                 side: Side) -> float | np.ndarray:
    """One-sided Wilson score bound of a binomial proportion.

    Wilson 1927 ("Probable inference, the law of succession, and statistical inference", JASA 22:209-212),
    recommended over the Wald interval by Brown, Cai & DasGupta 2001 ("Interval estimation for a binomial
    proportion", Statistical Science 16:101-133). For x successes in n trials, p = x / n, z = Phi^-1(confidence):

        centre = (p + z^2 / (2n)) / (1 + z^2 / n)
        half   = z / (1 + z^2 / n) * sqrt(p (1 - p) / n + z^2 / (4 n^2))
        lower  = centre - half (0 when x = 0),  upper = centre + half (1 when x = n)

    The same as statsmodels `proportion_confint(x, n, alpha=2 * (1 - confidence), method="wilson")`. Coverage
    oscillates with n and p around the nominal level (Brown, Cai & DasGupta 2001, fig. 5).

    Args:
        successes: rows with value 1: int, or an int array of any shape.
        n: rows: int, or an array broadcastable with `successes`.
        confidence: one-sided level in (0, 1), e.g. 0.95 (z = 1.645).
        side: "lower" or "upper".

    Returns:
        The bound in [0, 1]: float for scalar inputs, else a float64 array of the broadcast shape; NaN where
        n == 0.

    Raises:
        ValueError: confidence outside (0, 1), an unknown side, or successes outside [0, n].
    """
    check_level(confidence, side)
    x, nn = _counts(successes, n)
    lo, hi = _wilson(x, nn, z_value(confidence))
    return _out(lo if side == "lower" else hi)


def wilson_interval(successes: int, n: int, confidence: float) -> tuple[float, float]:
    """Two-sided Wilson score interval (formula: `wilson_bound`, with z = Phi^-1(1 - (1 - confidence) / 2)).

    Args:
        successes: rows with value 1.
        n: rows.
        confidence: two-sided level in (0, 1), e.g. 0.95 (z = 1.96).

    Returns:
        (lower, upper), both in [0, 1]; (NaN, NaN) when n == 0.

    Raises:
        ValueError: confidence outside (0, 1) or successes outside [0, n].
    """
    check_level(confidence, None)
    x, nn = _counts(successes, n)
    lo, hi = _wilson(x, nn, z_value(confidence, two_sided=True))
    return float(lo), float(hi)


def _clopper_pearson(x: np.ndarray, nn: np.ndarray, tail: float) -> tuple[np.ndarray, np.ndarray]:
    with np.errstate(divide="ignore", invalid="ignore"):
        lo = np.where(x > 0, _st().beta.ppf(tail, np.maximum(x, 1.0), nn - x + 1.0), 0.0)
        hi = np.where(x < nn, _st().beta.ppf(1.0 - tail, x + 1.0, np.maximum(nn - x, 1.0)), 1.0)
    return np.where(nn > 0, lo, np.nan), np.where(nn > 0, hi, np.nan)


def clopper_pearson_bound(successes: int | np.ndarray, n: int | np.ndarray, confidence: float,
                          side: Side) -> float | np.ndarray:
    """One-sided Clopper-Pearson ("exact") bound of a binomial proportion.

    Clopper & Pearson 1934 ("The use of confidence or fiducial limits illustrated in the case of the binomial",
    Biometrika 26:404-413), in its beta-quantile form (Agresti & Coull 1998, The American Statistician 52:119,
    eq. 3), computed with `scipy.stats.beta.ppf`; alpha = 1 - confidence:

        lower = Beta^-1(alpha; x, n - x + 1)        (0 when x = 0)
        upper = Beta^-1(1 - alpha; x + 1, n - x)    (1 when x = n)

    For x = 0 the upper bound is 1 - alpha^(1/n) (about 3 / n at 95%, the "rule of three"). The coverage is at
    least `confidence` for every p (conservative), unlike Wilson's, which is on target on average. The same as
    `scipy.stats.binomtest(x, n, alternative=...).proportion_ci(confidence, method="exact")`.

    Args:
        successes: rows with value 1: int, or an int array of any shape.
        n: rows: int, or an array broadcastable with `successes`.
        confidence: one-sided level in (0, 1).
        side: "lower" or "upper".

    Returns:
        The bound in [0, 1]: float for scalar inputs, else a float64 array of the broadcast shape; NaN where
        n == 0.

    Raises:
        ValueError: confidence outside (0, 1), an unknown side, or successes outside [0, n].
    """
    check_level(confidence, side)
    x, nn = _counts(successes, n)
    lo, hi = _clopper_pearson(x, nn, 1.0 - confidence)
    return _out(lo if side == "lower" else hi)


def clopper_pearson_interval(successes: int, n: int, confidence: float) -> tuple[float, float]:
    """Two-sided Clopper-Pearson interval (formula: `clopper_pearson_bound`, alpha / 2 in each tail).

    Args:
        successes: rows with value 1.
        n: rows.
        confidence: two-sided level in (0, 1).

    Returns:
        (lower, upper), both in [0, 1]; (NaN, NaN) when n == 0.

    Raises:
        ValueError: confidence outside (0, 1) or successes outside [0, n].
    """
    check_level(confidence, None)
    x, nn = _counts(successes, n)
    lo, hi = _clopper_pearson(x, nn, (1.0 - confidence) / 2.0)
    return float(lo), float(hi)


# ---------------------------------------------------------------------------- two paired proportions
def paired_counts(first: np.ndarray, second: np.ndarray) -> tuple[int, int, int, int]:
    """The paired 2x2 table of two 0/1 arrays on the same rows.

    Args:
        first: bool or 0/1 array, shape (rows,) (any shape is flattened).
        second: bool or 0/1 array of the same size, the same rows.

    Returns:
        (a, b, c, d): rows with both 1, first 1 / second 0, first 0 / second 1, both 0 (ints, sum = rows).

    Raises:
        ValueError: arrays of different sizes, or values other than 0/1.
    """
    f, s = np.asarray(first).reshape(-1), np.asarray(second).reshape(-1)
    if f.shape != s.shape:
        raise ValueError(f"paired arrays differ in length: {f.shape[0]} vs {s.shape[0]}")
    if not (np.isin(f, (0, 1)).all() and np.isin(s, (0, 1)).all()):
        raise ValueError("paired proportions need 0/1 values")
    f, s = f.astype(bool), s.astype(bool)
    return (int(np.count_nonzero(f & s)), int(np.count_nonzero(f & ~s)), int(np.count_nonzero(~f & s)),
            int(np.count_nonzero(~f & ~s)))


def _newcombe(a: float, b: float, c: float, d: float, z: float) -> tuple[float, float]:
    n = a + b + c + d
    if n == 0:
        return math.nan, math.nan
    p1, p2 = (a + b) / n, (a + c) / n
    (l1, l2), (u1, u2) = _wilson(np.array([a + b, a + c]), np.array([n, n]), z)
    margins = (a + b) * (c + d) * (a + c) * (b + d)
    psi = 0.0
    if margins > 0:
        big_a = a * d - b * c
        if big_a > n / 2:
            psi = (big_a - n / 2) / math.sqrt(margins)
        elif big_a < 0:
            psi = big_a / math.sqrt(margins)
    x, y = p1 - l1, u2 - p2
    lower = max(-1.0, (p1 - p2) - math.sqrt(max(x * x + y * y - 2 * psi * x * y, 0.0)))
    x, y = p2 - l2, u1 - p1
    upper = min(1.0, (p1 - p2) + math.sqrt(max(x * x + y * y - 2 * psi * x * y, 0.0)))
    return lower, upper


def newcombe_paired_interval(a: int, b: int, c: int, d: int, confidence: float) -> tuple[float, float]:
    """Two-sided interval of p1 - p2 for paired proportions from the paired 2x2 table (Newcombe method 10).

    Newcombe's square-and-add hybrid score interval, method 10 of Newcombe 1998 ("Improved confidence intervals
    for the difference between binomial proportions based on paired data", Statistics in Medicine
    17:2635-2650), as given by Fagerland, Lydersen & Laake 2017 ("Statistical Analysis of Contingency Tables",
    sec. 8.5). With n = a + b + c + d, p1 = (a + b) / n, p2 = (a + c) / n, Wilson limits (l1, u1), (l2, u2) of
    p1 and p2 at the same z, and the continuity-corrected correlation psi (A = ad - bc; psi = (A - n/2) /
    sqrt((a+b)(c+d)(a+c)(b+d)) when A > n/2, 0 when 0 <= A <= n/2, A / sqrt(...) when A < 0, 0 when a margin
    is empty):

        lower = (p1 - p2) - sqrt((p1 - l1)^2 + (u2 - p2)^2 - 2 psi (p1 - l1)(u2 - p2))
        upper = (p1 - p2) + sqrt((p2 - l2)^2 + (u1 - p1)^2 - 2 psi (p2 - l2)(u1 - p1))

    truncated to [-1, 1]. Worked example (Fagerland et al. 2017, Cavo et al. 2012 data): a, b, c, d = 59, 6,
    16, 80 gives -0.0621 (95% CI -0.1186 to -0.0046).

    Args:
        a: rows with both 1.
        b: rows with first 1, second 0.
        c: rows with first 0, second 1.
        d: rows with both 0.
        confidence: two-sided level in (0, 1).

    Returns:
        (lower, upper) in [-1, 1]; (NaN, NaN) when the table is empty.

    Raises:
        ValueError: a negative count or a confidence outside (0, 1).
    """
    check_level(confidence, None)
    if min(a, b, c, d) < 0:
        raise ValueError(f"counts must be >= 0, got {(a, b, c, d)!r}")
    return _newcombe(float(a), float(b), float(c), float(d), z_value(confidence, two_sided=True))


def newcombe_paired_bound(first: np.ndarray, second: np.ndarray, confidence: float, side: Side) -> float:
    """One-sided bound of mean(first) - mean(second) for 0/1 values paired by row (Newcombe 1998 method 10).

    Formula: `newcombe_paired_interval`, with the Wilson limits at the one-sided z = Phi^-1(confidence) (the
    matching end of the two-sided interval at level 2 * confidence - 1). Used for relative accuracy gates:
    first = a candidate's per-row `correct`, second = the reference's on the same rows, so the lower bound says
    how much accuracy the candidate may have lost at most.

    Args:
        first: bool or 0/1 array of shape (rows,).
        second: bool or 0/1 array of shape (rows,), the same rows.
        confidence: one-sided level in (0, 1).
        side: "lower" or "upper".

    Returns:
        The bound in [-1, 1]; NaN when rows == 0.

    Raises:
        ValueError: arrays of different lengths, values other than 0/1, a bad confidence or side.
    """
    check_level(confidence, side)
    a, b, c, d = paired_counts(first, second)
    lower, upper = _newcombe(float(a), float(b), float(c), float(d), z_value(confidence))
    return lower if side == "lower" else upper


# ------------------------------------------------------------------------------------------- bootstrap
def percentile(x: np.ndarray, q: float) -> float:
    """numpy's default ("linear", Hyndman & Fan 1996 type 7) percentile, except that an interpolation touching
    +-inf gives +-inf instead of NaN (the `parity.aggregate` percentile rule).

    Args:
        x: values, any shape (flattened), at least one.
        q: percentile in [0, 100].

    Returns:
        float: s[lo] + (s[hi] - s[lo]) * frac on the sorted values s at position q / 100 * (size - 1).
    """
    s = np.sort(np.asarray(x, dtype=np.float64).reshape(-1))
    pos = (q / 100.0) * (s.size - 1)
    lo, hi = int(math.floor(pos)), int(math.ceil(pos))
    frac = pos - lo
    a, b = float(s[lo]), float(s[hi])
    if frac == 0 or a == b:
        return a
    if b == math.inf:
        return math.inf
    if a == -math.inf:
        return -math.inf
    return a + (b - a) * frac


def check_statistic(statistic: str) -> None:
    """Raise ValueError unless `statistic` is "mean", "max", "min" or a percentile "p<q>" with 0 <= q <= 100."""
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


def row_statistic(block: np.ndarray, statistic: str) -> np.ndarray:
    """The statistic of each row of a 2-D block, with `percentile`'s +-inf rule for percentiles.

    Args:
        block: float64 array of shape (resamples, rows).
        statistic: "mean", "max", "min" or "p<q>" (linear interpolation, q in percent).

    Returns:
        float64 array of shape (resamples,).
    """
    if statistic == "mean":
        with np.errstate(invalid="ignore"):
            return block.mean(axis=-1)
    if statistic == "max":
        return block.max(axis=-1)
    if statistic == "min":
        return block.min(axis=-1)
    q = float(statistic[1:])
    n = block.shape[-1]
    pos = (q / 100.0) * (n - 1)
    lo, hi = int(math.floor(pos)), int(math.ceil(pos))
    frac = pos - lo
    part = np.partition(block, sorted({lo, hi}), axis=-1)
    a, b = part[..., lo], part[..., hi]
    if frac == 0:
        return a
    with np.errstate(invalid="ignore"):
        mid = a + (b - a) * frac
    out = np.where(a == b, a, mid)
    out = np.where((a != b) & (b == np.inf), np.inf, out)
    return np.where((a != b) & (a == -np.inf), -np.inf, out)


def bootstrap_distribution(values: np.ndarray, statistic: str, samples: int, seed: int, *,
                           block_elements: int = BOOTSTRAP_BLOCK_ELEMENTS) -> np.ndarray:
    """The statistic over `samples` resamples (rows drawn with replacement) of `values`.

    Resampling by `scipy.stats.bootstrap` (`batch` = max(1, block_elements // rows) resamples at a time, so a
    block of (batch, rows) float64 values is held at once) with `rng=numpy.random.default_rng(seed)`: batch k
    draws `rng.integers(0, rows, (batch, rows))`, the same draws tailguard's own resampler made before it used
    scipy, so the distribution is unchanged for a given seed and block size.

    Args:
        values: per-row values, shape (rows,) (any shape is flattened), float or bool.
        statistic: "mean", "max", "min" or a percentile "p<q>" ("p01", "p99"); see `row_statistic`.
        samples: number of resamples (>= 1).
        seed: seed of numpy.random.default_rng: the same inputs give the same distribution.
        block_elements: resampled values held at once (memory bound).

    Returns:
        float64 array of shape (samples,); empty when rows == 0; every entry the statistic of the one value
        when rows == 1.

    Raises:
        ValueError: an unknown statistic or samples < 1.
    """
    check_statistic(statistic)
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    x = np.asarray(values).reshape(-1).astype(np.float64)
    n = x.size
    if n == 0:
        return np.zeros(0)
    if n == 1:  # scipy needs two rows; every resample of one row is that row
        return np.full(samples, row_statistic(x[None, :], statistic)[0])

    def stat(resample: np.ndarray, axis: int = -1) -> np.ndarray:
        return row_statistic(resample, statistic)

    with warnings.catch_warnings(), np.errstate(invalid="ignore", over="ignore"):
        # scipy's own interval (unused here) is NaN next to an infinite resample and warns about it
        warnings.simplefilter("ignore", _st().DegenerateDataWarning)
        warnings.simplefilter("ignore", RuntimeWarning)
        res = _st().bootstrap((x,), stat, vectorized=True, axis=-1, n_resamples=int(samples),
                            batch=max(1, int(block_elements) // n), method="percentile",
                            rng=np.random.default_rng(seed))
    return np.asarray(res.bootstrap_distribution, dtype=np.float64).reshape(-1)


def bootstrap_bound(values: np.ndarray, statistic: str, confidence: float, side: Side, samples: int = 1000,
                    seed: int = 0, *, block_elements: int = BOOTSTRAP_BLOCK_ELEMENTS) -> float:
    """One-sided percentile-bootstrap bound of a statistic of per-row values.

    Percentile bootstrap (Efron & Tibshirani 1993, "An Introduction to the Bootstrap", ch. 13): the lower bound
    is the (1 - confidence) quantile, the upper bound the `confidence` quantile, of `bootstrap_distribution`.
    The quantile is `percentile` (numpy "linear", +-inf next to an infinite resample) read from scipy's
    `BootstrapResult.bootstrap_distribution`; scipy's `confidence_interval` (percentile method,
    alternative "greater" / "less") is the same linear quantile up to rounding (~1e-14 relative) but NaN next to
    an infinity, so the distribution is read directly and bounds stay bit-identical to earlier tailguard runs.
    For "max" / "min" the bootstrap cannot go beyond the observed extreme (it is inconsistent for extremes,
    Bickel & Freedman 1981), so the bad-side bound of a maximum equals the observed maximum.

    Args:
        values: per-row values, shape (rows,), float or bool (e.g. `cosine_similarity`, `abs_error`).
        statistic: "mean", "max", "min" or a percentile "p<q>", as in `parity.aggregate`.
        confidence: one-sided level in (0, 1).
        side: "lower" or "upper".
        samples: resamples (spec `analysis.bootstrap.samples`).
        seed: rng seed (spec `analysis.bootstrap.seed`).
        block_elements: resampled values held at once (memory bound).

    Returns:
        The bound in the units of `values`; NaN when rows == 0; +-inf when the resampled statistics reach +-inf
        (non-finite rows) on that side.

    Raises:
        ValueError: an unknown statistic, samples < 1, a bad confidence or side.
    """
    check_level(confidence, side)
    dist = bootstrap_distribution(values, statistic, samples, seed, block_elements=block_elements)
    if dist.size == 0:
        return float("nan")
    q = (1.0 - confidence) if side == "lower" else confidence
    return percentile(dist, q * 100.0)


def median_ratio(numerator: np.ndarray, denominator: np.ndarray, axis: int = -1) -> np.ndarray:
    """median(numerator) / median(denominator) along `axis` (float64; the statistic of `paired_ratio_bootstrap`)."""
    return np.median(numerator, axis=axis) / np.median(denominator, axis=axis)


def paired_ratio_bootstrap(numerator: np.ndarray, denominator: np.ndarray, confidence: float, *,
                           samples: int = 1000, seed: int = 0) -> tuple[float, float, float]:
    """Ratio of medians of two paired samples with one-sided paired percentile-bootstrap bounds.

    Estimate: median(numerator) / median(denominator) (for latency: baseline ms / variant ms per interleaved
    round = how many times faster the variant is). Bounds: paired percentile bootstrap over pairs (Efron &
    Tibshirani 1993, ch. 13), `scipy.stats.bootstrap((numerator, denominator), median_ratio, paired=True,
    method="percentile", rng=numpy.random.default_rng(seed))`: pairs are resampled with replacement, each pair's
    two values kept together, so what hit both in one round (a noisy neighbour) stays paired. The one-sided
    bounds at `confidence` are the ends of the two-sided interval at level 2 * confidence - 1.

    Args:
        numerator: float array of shape (pairs,), > 0 and finite (e.g. baseline ms per round).
        denominator: float array of shape (pairs,), the same pairs.
        confidence: one-sided level in (0.5, 1).
        samples: bootstrap resamples.
        seed: rng seed (the same inputs give the same bounds).

    Returns:
        (ratio, lower, upper) as floats; the bounds equal the ratio when every pair is alike (scipy would warn
        on that degenerate sample, so it is not called).

    Raises:
        ValueError: confidence outside (0.5, 1), lengths differ, fewer than 2 pairs, or a non-finite or
            non-positive value.
    """
    if not (0.5 < float(confidence) < 1.0):
        raise ValueError(f"confidence must be in (0.5, 1), got {confidence!r}")
    b = np.asarray(numerator, dtype=np.float64).reshape(-1)
    v = np.asarray(denominator, dtype=np.float64).reshape(-1)
    if b.shape != v.shape:
        raise ValueError(f"paired samples differ in length: {b.size} vs {v.size}")
    if b.size < 2:
        raise ValueError(f"need at least 2 pairs, got {b.size}")
    if not (np.isfinite(b).all() and np.isfinite(v).all() and (b > 0).all() and (v > 0).all()):
        raise ValueError("every value must be finite and > 0")
    ratio = float(median_ratio(b, v))
    if np.all(b == b[0]) and np.all(v == v[0]):
        return ratio, ratio, ratio
    res = _st().bootstrap((b, v), median_ratio, paired=True, vectorized=True, axis=-1, n_resamples=samples,
                        confidence_level=2.0 * confidence - 1.0, method="percentile",
                        rng=np.random.default_rng(seed))
    return ratio, float(res.confidence_interval.low), float(res.confidence_interval.high)


# ----------------------------------------------------------------------------------- two-sample tests
def fisher_exact_greater(bad_in_group: np.ndarray, group_size: np.ndarray, bad_total: int,
                         rows: int) -> np.ndarray:
    """One-sided Fisher exact test p-values (H1: the group holds a larger share of bad rows than the rest).

    Fisher 1935; Agresti 2013 ("Categorical Data Analysis", 3rd ed., sec. 3.5): for the 2x2 table group/rest x
    bad/good with fixed margins, p = P(X >= k) with X ~ Hypergeometric(rows, bad_total, group_size), computed
    for many groups at once as `scipy.stats.hypergeom.sf(k - 1, rows, bad_total, group_size)`; equal to
    `scipy.stats.fisher_exact([[k, n - k], [K - k, N - n - K + k]], alternative="greater").pvalue`.

    Args:
        bad_in_group: bad rows in each group, int or float array of shape (groups,) (rounded to integers).
        group_size: rows in each group, shape (groups,).
        bad_total: bad rows over all rows.
        rows: all rows (group + rest).

    Returns:
        float64 p-values in [0, 1], shape (groups,).
    """
    k = np.round(np.asarray(bad_in_group, dtype=np.float64))
    return np.asarray(_st().hypergeom.sf(k - 1, rows, bad_total, np.asarray(group_size)), dtype=np.float64)


def rank_with_ties(values: np.ndarray) -> tuple[np.ndarray, float]:
    """Average ranks (1-based) of `values` and the tie term sum(t^3 - t) over groups of t tied values.

    Args:
        values: float array of shape (rows,); +inf values tie as the largest.

    Returns:
        (ranks, tie_term): float64 array of shape (rows,) (`scipy.stats.rankdata`, method "average"), float.
    """
    x = np.asarray(values, dtype=np.float64).reshape(-1)
    _, t = np.unique(x, return_counts=True)
    return _st().rankdata(x), float(np.sum(t.astype(np.float64) ** 3 - t))


def mann_whitney_u_greater(rank_sum: np.ndarray, group_size: np.ndarray, rows: int, tie_term: float) -> np.ndarray:
    """One-sided Mann-Whitney U test p-values (H1: the group's values tend to be larger than the rest's).

    Mann & Whitney 1947; Hollander, Wolfe & Chicken 2014 ("Nonparametric Statistical Methods", 3rd ed., sec.
    4.1): normal approximation with tie and continuity correction, for many groups at once from the rank sums of
    one ranking of all rows (`rank_with_ties`). With n1 = group size, n2 = rows - n1, U = R1 - n1 (n1 + 1) / 2:

        sd = sqrt(n1 n2 / 12 * ((rows + 1) - tie_term / (rows (rows - 1))))
        z  = (U - n1 n2 / 2 - 0.5) / sd,       p = 1 - Phi(z)

    equal to `scipy.stats.mannwhitneyu(group, rest, alternative="greater", method="asymptotic")`; p = 1 when
    sd = 0 (every row tied).

    Args:
        rank_sum: sum of the group's ranks, float array of shape (groups,).
        group_size: rows in each group, shape (groups,).
        rows: all rows.
        tie_term: sum(t^3 - t) over tie groups of all rows (`rank_with_ties`).

    Returns:
        float64 p-values in [0, 1], shape (groups,).
    """
    n1 = np.asarray(group_size, dtype=np.float64)
    n2 = rows - n1
    u = np.asarray(rank_sum, dtype=np.float64) - n1 * (n1 + 1) / 2.0
    sd = np.sqrt(n1 * n2 / 12.0 * ((rows + 1) - tie_term / (rows * (rows - 1.0))))
    with np.errstate(divide="ignore", invalid="ignore"):
        z = (u - n1 * n2 / 2.0 - 0.5) / sd
    return np.where(sd > 0, _st().norm.sf(z), 1.0)


# ------------------------------------------------------------------------------- false discovery rate
def benjamini_hochberg(p_values: np.ndarray) -> np.ndarray:
    """Benjamini-Hochberg adjusted p-values (q-values) of a family of tests.

    Benjamini & Hochberg 1995 ("Controlling the false discovery rate", JRSS B 57:289-300), step-up:
    q_(i) = min over j >= i of p_(j) * m / j on the p-values sorted ascending, capped at 1; rejecting every test
    with q <= alpha controls the FDR at alpha under independence or positive regression dependence (Benjamini &
    Yekutieli 2001). Computed by `scipy.stats.false_discovery_control(p, method="bh")`. Worked example (BH 1995,
    sec. 4, 15 p-values): q_(4) = 0.0095 * 15 / 4 = 0.0356, and at alpha = 0.05 the four smallest are rejected.

    Args:
        p_values: float array of shape (tests,), each in [0, 1] (NaN is treated as 1).

    Returns:
        float64 q-values of shape (tests,), in the input order; empty for an empty family.

    Raises:
        ValueError: a p-value outside [0, 1].
    """
    p = np.asarray(p_values, dtype=np.float64).reshape(-1)
    p = np.nan_to_num(p, nan=1.0)
    if p.size == 0:
        return np.zeros(0)
    if (p < 0).any() or (p > 1).any():
        raise ValueError("p-values must be in [0, 1]")
    return np.asarray(_st().false_discovery_control(p, method="bh"), dtype=np.float64)
