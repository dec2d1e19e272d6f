"""The sequential test of one (slice, metric) stream: the bets, a request's evidence units, the betting CUSUMs and
their window sums, the alarm level and the alert value's interval (the theory, its guarantee and its sources:
monitoring/detector.py's module docstring). monitoring/detector.py keeps one stream per slice and thresholded metric
(`SliceStatistics`); monitoring/combine.py merges replicas' walks of the same bets.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Sequence

from scipy import stats

from tailguard.monitoring.config import METRIC_RANGE, Bound

# Bets as fractions of the largest admissible one (1 / span): 2^-1 .. 2^-10 cover a 1.03x to 500x shift in a 0/1
# error rate on one-row requests; 0.75, 0.9 and 0.95 are the best bets on the row sum of large requests (a 64-row
# request at 0.94 against 0.97: ~0.95; issue 41), so the mixture's best bet is on the grid for every request size.
BET_FRACTIONS: tuple[float, ...] = (0.95, 0.9, 0.75) + tuple(2.0 ** -j for j in range(1, 11))
N_BETS = len(BET_FRACTIONS)
CI_Z = 1.959963984540054  # two-sided 95% normal quantile of the alert value's interval
# The stream's cumulative window sums (Stream.acc): evidence units, rows, and with r the unit's weight ratio, n its
# rows and S its clipped row-excess sum: sum r n, sum r S, sum r^2 S^2, sum r^2 n S, sum r^2 n^2 (the ratio
# estimator's request-clustered variance, `window_estimate`).
ACC_FIELDS = ("units", "rows", "rn", "rs", "rss", "rns", "rnn")
Y_CAP = 1e12  # an infinite excess (non-finite candidate row) bets as this finite value

CI_METHOD = ("request-clustered normal interval of the weighted ratio estimator (linearization variance, "
             "Cochran 1977 Sampling Techniques 6.9; requests as clusters), 95%, over the estimated window: not "
             "adjusted for the window being chosen by the detector")


def window_estimate(w: Sequence[float], bound: Bound, z: float = CI_Z) -> tuple[float, float, float]:
    """The tested quantity's estimate over a window and its confidence interval, from window sums (ACC_FIELDS).

    Over the window's evidence units t (rows n_t, clipped alarm-side excess sum S_t, weight ratio r_t) the
    per-row mean excess is ybar = sum r S / sum r n (a Hajek ratio estimator, each row weighted by its r), its
    variance with requests as clusters (rows of one request may be dependent) is

        V = K / (K - 1) * sum r^2 (S - n ybar)^2 / (sum r n)^2     (K = units in the window)

    (the linearization variance of a ratio estimator, Cochran 1977, Sampling Techniques, 6.9), and the interval is
    ybar -+ z sqrt(V) (normal approximation: it needs a few dozen units; the window is the one the detector chose,
    which biases both toward the failing side, so it describes the window, it is not a test).

    Args:
        w: (7,) window sums in ACC_FIELDS order (units, rows, rn, rs, rss, rns, rnn).
        bound: the threshold (its direction maps the excess back to the metric's units).
        z: normal quantile of the interval (default: 95% two-sided).

    Returns:
        (value, ci_low, ci_high) in the metric's units; NaNs when the window has no rows.
    """
    units, _, rn, rs, rss, rns, rnn = w
    if rn <= 0 or units < 1:
        return math.nan, math.nan, math.nan
    ybar = rs / rn
    v = max(rss - 2.0 * ybar * rns + ybar * ybar * rnn, 0.0)
    half = z * math.sqrt(v * (units / (units - 1) if units > 1 else 1.0)) / rn
    lo_y, hi_y = ybar - half, ybar + half
    t = bound.value
    if bound.higher_is_better:
        value, lo, hi = t - ybar, t - hi_y, t - lo_y
    else:
        value, lo, hi = t + ybar, t + lo_y, t + hi_y
    r_lo, r_hi = METRIC_RANGE.get(bound.metric, (-math.inf, math.inf))
    return value, max(lo, r_lo), min(hi, r_hi)


def alarm_threshold(alpha: float, horizon: int, streams_per_request: int) -> float:
    """The detector's alarm level h = log(horizon x streams_per_request / alpha) (module docstring).

    Args:
        alpha: probability of any false alarm within the horizon, in (0, 1).
        horizon: sampled requests the guarantee covers (>= 1).
        streams_per_request: G x B, the (slice, metric) streams one sampled request updates (>= 1).

    Returns:
        h in nats.
    """
    return math.log(horizon * max(streams_per_request, 1) / alpha)


def _logmeanexp(xs: Sequence[float]) -> float:
    m = max(xs)
    return m + math.log(sum(math.exp(x - m) for x in xs) / len(xs))


@dataclass(frozen=True)
class Betting:
    """The bets of one (metric, direction) detector.

    Attributes:
        sign: +1 for the alarm side (y = excess on the bad side), -1 for recovery (bets on the good side).
        lambdas: (N_BETS,) bets, each < 1 / span.
        cap: the row excess is clipped to [-span, cap] (cap only ever lowers an e-value; span keeps it >= 0): the
            distance from the threshold to the other end of the range (or truncate_at), Y_CAP when unbounded.
        span: the largest loss per unit bet (the excess's bound on the side bet against).
    """

    sign: float
    lambdas: tuple[float, ...]
    span: float
    cap: float = Y_CAP


def bettings(bound: Bound) -> tuple[Betting, Betting | None]:
    """(alarm, recovery) bets for a threshold, from the metric's range (config.METRIC_RANGE) and truncate_at.

    Args:
        bound: the resolved threshold.

    Returns:
        The alarm bets (excess y >= -(distance from the threshold to the good end of the range)) and the recovery
        bets (-y >= -(distance to the bad end: the range's, or truncate_at)), or None for recovery when the bad
        side is unbounded and not truncated (no evidence-based clearing: module docstring, Recovery).
    """
    lo, hi = METRIC_RANGE.get(bound.metric, (-math.inf, math.inf))
    t = bound.value
    if bound.higher_is_better:
        good, bad = hi, lo
    else:
        good, bad = lo, hi
        if bound.truncate_at is not None:
            bad = min(bad, bound.truncate_at)
    span_alarm = abs(good - t) if math.isfinite(good) else abs(t) or 1.0
    to_bad = abs(bad - t) if math.isfinite(bad) else Y_CAP
    alarm = _betting(1.0, span_alarm, to_bad)
    if not math.isfinite(bad):
        return alarm, None
    return alarm, _betting(-1.0, to_bad, span_alarm if math.isfinite(good) else Y_CAP)


def _betting(sign: float, span: float, cap: float = Y_CAP) -> Betting:
    span = max(span, 1e-9)  # a threshold at the range's end: every excess is >= 0 under H0, any bet is valid
    return Betting(sign, tuple(f / span for f in BET_FRACTIONS), span, cap)


def request_units(bet: Betting, excess: Any, max_rows: int) -> list[tuple[int, float]]:
    """A request's evidence units on the side `bet` bets on: its rows in consecutive chunks of at most `max_rows`
    (one chunk unless the request has more than M = max_rows rows), each with the sum of its rows' excess clipped
    to [-span, cap]. The bet on a unit is 1 + lam * r * sum / M >= 1 - lam * span > 0 (n <= M rows, each
    >= -span), whatever the dependence between the rows.

    Args:
        bet: the bets (its sign picks the side).
        excess: (rows,) float64 per-row excess on the alarm side (y), NaN-free; a float for one row.
        max_rows: M, the declared bound on a request's rows (>= 1).

    Returns:
        [(rows n_k, clipped excess sum S_k in [-span n_k, cap n_k])], ceil(rows / M) entries.
    """
    if isinstance(excess, float):
        return [(1, min(max(bet.sign * excess, -bet.span), bet.cap))]
    y = (bet.sign * excess).clip(-bet.span, bet.cap)
    n = y.shape[0]
    if n <= max_rows:
        return [(n, float(y.sum()))]
    return [(min(max_rows, n - a), float(y[a:a + max_rows].sum())) for a in range(0, n, max_rows)]


@functools.lru_cache(maxsize=8192)
def log_factors(lambdas: tuple[float, ...], x: float) -> tuple[float, ...]:
    """log(1 + lam_j * x) for each bet lam_j, x = r * S / M (memoized: a 0/1 metric's request sums take few
    values, and the keys of one slice group share them)."""
    return tuple(math.log1p(lam * x) for lam in lambdas)


def add_walk(walk: list[float], bet: Betting, u: float, r: float) -> None:
    """Accumulate one unit's log factors per bet (u = S / M from `request_units`) into an unclipped walk (a
    replica's recovery-side evidence)."""
    for j, inc in enumerate(log_factors(bet.lambdas, r * u)):
        walk[j] += inc


def add_sums(acc: list[float], r: float, n: int, total: float) -> None:
    """Add one evidence unit (n rows, excess sum `total`, weight ratio r) to a stream's window sums (ACC_FIELDS)."""
    rn, rs = r * n, r * total
    acc[0] += 1.0
    acc[1] += n
    acc[2] += rn
    acc[3] += rs
    acc[4] += rs * rs
    acc[5] += rn * rs
    acc[6] += rn * rn


class Cusum:
    """N_BETS one-sided CUSUMs of one (slice, metric) stream (formula: module docstring).

    Attributes:
        s: (N_BETS,) current CUSUM statistics (log scale, >= 0).
        start: (N_BETS,) the slice's evidence-unit number (sampled request) where each CUSUM last left zero (read
            only while it is above zero: an idle CUSUM's entry is stale).
        start_request: (N_BETS,) the request index of that request.
        walk: (N_BETS,) unclipped sum of the log factors since start (replicas export it, monitoring/combine.py).
        mark: (N_BETS,) the stream's window sums (Stream.acc, ACC_FIELDS) just before each CUSUM left zero, so
            acc - mark[j] sums the rows since CUSUM j's change point (the alert's `value`); None when not kept.
    """

    __slots__ = ("s", "start", "start_request", "walk", "mark")

    def __init__(self) -> None:
        self.s = [0.0] * N_BETS
        self.start = [0] * N_BETS
        self.start_request: list[int | None] = [None] * N_BETS
        self.walk = [0.0] * N_BETS
        self.mark: list[tuple[float, ...] | None] = [None] * N_BETS

    def update(self, bet: Betting, u: float, r: float, row: int, request_index: int | None,
               acc: Sequence[float] | None = None) -> None:
        """Add one evidence unit: u = S / M (S its clipped excess sum in the bet's sign, `request_units`), weight
        ratio r in (0, 1], `row` the slice's unit number, `acc` the stream's window sums before this unit."""
        s, walk = self.s, self.walk
        if u == 0.0:  # every factor is 1 (e.g. candidate_error_rate 0 at threshold 0): nothing moves
            return
        if u < 0.0 and not any(s):  # idle, and a unit on the good side (every factor < 1): all stay at 0 (the
            # change points of idle CUSUMs are set when they leave 0, below, and read only then)
            self.walk = [w + inc for w, inc in zip(walk, log_factors(bet.lambdas, r * u))]
            return
        for j, inc in enumerate(log_factors(bet.lambdas, r * u)):
            walk[j] += inc
            v = s[j] + inc
            if v <= 0.0:
                s[j] = 0.0
                self.start[j] = row + 1
                self.start_request[j] = None
            else:
                if s[j] == 0.0:
                    self.start[j] = row
                    self.start_request[j] = request_index
                    self.mark[j] = tuple(acc) if acc is not None else None
                s[j] = v

    def add_batch(self, increments: Sequence[float], row: int, acc: Sequence[float] | None = None) -> None:
        """Add a batch's summed log factors per bet (evidence from a replica); clipping at batch boundaries only.
        `row`: the first unit number of the batch; `acc`: the window sums before it (None: unknown)."""
        for j, inc in enumerate(increments):
            v = self.s[j] + inc
            if v <= 0.0:
                self.s[j], self.start[j], self.start_request[j] = 0.0, row + 1, None
            else:
                if self.s[j] == 0.0:
                    self.start[j], self.start_request[j] = row, None
                    self.mark[j] = tuple(acc) if acc is not None else None
                self.s[j] = v

    def statistic(self) -> float:
        """log(mean_j exp(S_j)): the mixture e-detector's log value."""
        return _logmeanexp(self.s)

    def crossed(self, h: float) -> bool:
        """statistic() >= h (cheap: the statistic is at most max_j S_j, so most rows skip the sum)."""
        return max(self.s) >= h and self.statistic() >= h

    def winner(self) -> int:
        """Index of the largest CUSUM (its start is the change-point estimate)."""
        return max(range(N_BETS), key=self.s.__getitem__)

    def reset(self, row: int) -> None:
        """Back to zero (after an alarm or a recovery)."""
        self.s = [0.0] * N_BETS
        self.start = [row + 1] * N_BETS
        self.start_request = [None] * N_BETS
        self.mark = [None] * N_BETS


def sprt_expected_samples(p0: float, p1: float, alpha: float, beta: float) -> dict[str, float]:
    """Wald's SPRT expected sample numbers for Bernoulli H0: p = p0 vs H1: p = p1 (Wald 1945, Ann. Math.
    Statist. 16:117; boundary overshoot ignored, the usual approximation).

    Args:
        p0: success (e.g. agreement) probability under H0.
        p1: under H1.
        alpha: type-I error (false alarm).
        beta: type-II error (miss).

    Returns:
        {"asn_h1": E[N | H1], "asn_h0": E[N | H0], "fixed_n": the fixed-sample one-sided binomial test size with
        the same alpha/beta (normal approximation), "a": log((1-beta)/alpha), "b": log(beta/(1-alpha))}.
    """
    a = math.log((1 - beta) / alpha)
    b = math.log(beta / (1 - alpha))

    def kl(p: float, q: float) -> float:  # KL(Bern(p) || Bern(q)), nats
        return p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))

    asn_h1 = ((1 - beta) * a + beta * b) / kl(p1, p0)
    asn_h0 = ((1 - alpha) * b + alpha * a) / -kl(p0, p1)
    za, zb = stats.norm.ppf(1 - alpha), stats.norm.ppf(1 - beta)
    fixed = ((za * math.sqrt(p0 * (1 - p0)) + zb * math.sqrt(p1 * (1 - p1))) / (p0 - p1)) ** 2
    return {"asn_h1": asn_h1, "asn_h0": asn_h0, "fixed_n": fixed, "a": a, "b": b}
