"""Per-slice sequential change detection with a false-alarm guarantee over the whole stream.

Every slice key the configured columns produce is measured (up to a memory bound, `max_tracked_slices`, past
which the least recently updated slice without an active alert is evicted and counted). For every slice and
every metric with a threshold (monitoring/config.py `Bound`), a one-sided **betting CUSUM** watches for the
slice's traffic mean crossing the threshold.

The request is the unit of evidence. Rows of one request share a source, the slice keys, the sampling draw and
usually content: they are not independent, and betting on each row as if it were lets one bad request add as
much evidence as many independent ones (a fully disagreeing 32-row request: ~91 nats, far above h). So the
detector bets once per (sampled request, slice, metric), on the request's mean excess.

Detector. Write the per-row excess over the threshold on the bad side as

    y = threshold - x   (higher-is-better metrics: agreement, cosine)      y = x - threshold   (lower-is-better)

and a request's excess as the mean over its n rows, ybar = (1/n) sum_i y_i. H0 "the slice is fine" is: given the
past and the request's size n, E[ybar] <= 0, i.e. among requests of every size the mean over their rows is on
the good side. That is the per-row mean the validation gates measure (within one size class the request mean
and the row mean are the same number; across sizes H0 implies the traffic's row mean is on the good side). It
differs from "the traffic's row mean is fine" only when requests of one size are worse than the threshold and
requests of another size better: then the worse size class is reported, which is a real defect of its own.
The metric is bounded on its good side (agreement, cosine <= 1; KL and errors >= 0), so y and ybar are >= -span
with span = |good bound - threshold|, and for any bet 0 <= lam < 1/span the factor 1 + lam * ybar is
non-negative with E_H0[1 + lam ybar] <= 1: an e-value (testing by betting: Waudby-Smith & Ramdas 2024, JRSS-B
86:1, "Estimating means of bounded random variables by betting"). For one-row requests of a 0/1 metric with
lam = (q1/q0 - 1)/threshold this factor *is* the likelihood ratio of disagreement rate q1 against q0 = 1 -
threshold, so the detector below is Page's Bernoulli CUSUM (Page 1954; Reynolds & Stoumbos 1999, JQT 31:87).
The post-change value is unknown, so K = 10 bets lam_j = 2^-j / span (j = 1..10) run side by side:

    S_j <- max(0, S_j + log(1 + lam_j * r * ybar))       (one CUSUM per bet, updated once per sampled request)
    alarm when  log( mean_j exp(S_j) ) >= h              (the mixture e-detector)

The excess of each row is clipped to [-span, cap] before the mean (cap: the distance from the threshold to the
range's bad end, or to `truncate_at`; clipping above only lowers an e-value, and no row is below -span).

`r = pi_slice / p` (<= 1) weights a row sampled with probability p by the probability pi_slice the slice's
own frequency gives (monitoring/sampler.py): E[sampled * r * y] = pi_slice * E_traffic[y], so the factor stays an
e-value for the slice's *traffic* mean although rare-slice oversampling draws the slice's rows unequally
(Horvitz-Thompson weighting inside the bet).

Guarantee. exp(S_j) = max over start points k of the product of factors since k, so mean_j exp(S_j) is at most
the Shiryaev-Roberts sum over start points of the mixture e-processes; that sum minus the number of start
points is a supermartingale under H0 (Shin, Ramdas & Rinaldo 2024, "E-detectors: a nonparametric framework for
sequential change detection", NEJSDS 2:229). Summing over every (slice, metric) stream, each sampled request
starts G x B e-processes (G = slice keys a request carries: `all` + one per column + one per pair; B = metrics
with a threshold). With h = log(horizon x G x B / alpha), Ville's inequality gives

    P_H0[ any false alarm, in any slice and metric, within the first `horizon` sampled requests ] <= alpha

and an average run length to a false alarm of at least horizon / alpha sampled requests, whatever the number of
slices (the family is counted by the updates a request makes, not by the slices that exist). H0 here is
"every slice's traffic mean is on the good side of its threshold or on it": the guarantee holds at the
threshold itself, the hardest case. Assumptions: sampled requests are independent of each other given the past (the rows
*within* a request need not be), the sampling draw does not depend on the request's metric values (it depends on
slice frequencies only), and requests of a slice are compared in arrival order. `horizon` counts sampled requests,
whatever their number of rows.

Recovery. After an alarm the alert stays active while a recovery CUSUM (the same bets on the good side, -ybar)
looks for evidence that the slice is back; when it crosses h the alert clears and the alarm detector restarts
from zero. The recovery bets need the excess bounded on the *bad* side (-y >= -(distance to the bad end)): a
metric with a finite bad end (agreement 0, cosine -1) has it; a lower-is-better metric without an upper end
(kl_divergence, abs_error, rel_error) has it only with a declared `truncate_at` c, and then both tests are about
the truncated mean E[min(x, c)] (the alarm's evidence for it is also evidence for the untruncated mean, which is
larger; the recovery certifies the truncated mean only, as documented). Without `truncate_at` such a metric gets
no evidence-based clearing: its alert stays active until the monitor restarts (`clears: "never"` in the record). The estimated change point is where the winning CUSUM last
left zero (the CUSUM maximum-likelihood change-point estimate, Page 1954).

For display, each slice also keeps an exponentially weighted Hajek mean (span `window_size` rows, weights 1/p)
and Kish's effective sample size of those weights; they never decide an alert.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
from scipy import stats

from tailguard.monitoring.config import ALL_SLICE, METRIC_RANGE, Bound

N_BETS = 10  # bets 2^-1 .. 2^-10 of the largest admissible one: covers a 1.03x to 500x shift in a 0/1 error rate
DETECTOR = "betting_cusum"
Y_CAP = 1e12  # an infinite excess (non-finite candidate row) bets as this finite value
# Eviction protects a slice whose evidence (alarm statistic / h) is at least this: half-way to an alarm is far
# above what a fine slice shows (under H0 the statistic exceeds 0.5 h with probability <= exp(-h/2) per start
# point, Ville's inequality), so such a slice is drifting or about to be judged; it goes after every weaker one.
PROTECT_FRACTION = 0.5


@dataclass
class AlertRecord:
    """One alert, as written to alerts.json and served at /v1/alerts.

    Attributes:
        model: model name (metric label).
        slice: slice key, e.g. "locale=37" or "locale=37&ink=low".
        metric: per-row metric, e.g. "top1_agree".
        value: the slice's display estimate when it fired (exponentially weighted Hajek mean).
        threshold: the metric threshold the detector tests against.
        direction: "min" (bad when below) or "max" (bad when above).
        detector: "betting_cusum".
        statistic: the detector's log e-value when it fired (>= alarm_threshold).
        alarm_threshold: h = log(horizon x G x B / alpha).
        change_point_request_index: request index of the first request of the excursion that fired (the
            estimated change point), or None when unknown.
        change_point_sample: the slice's sampled-request number (1-based) at the estimated change point (a
            "sample" is a sampled request, the unit of evidence).
        samples_since_change: the slice's sampled requests from the change point to the alarm (detection delay).
        samples_seen: the slice's sampled requests so far.
        effective_samples: Kish effective sample size of the display estimate.
        requests_seen: requests carrying this slice key so far (sampled or not).
        method: detector and family control, "betting_cusum+stream_alpha".
        alpha: the configured probability of any false alarm within `horizon` sampled requests.
        horizon: sampled requests the alpha guarantee covers.
        fired_at: ISO-8601 UTC time it fired.
        request_index: sequence number of the request that completed the evidence (replay: row index).
        cleared_at: ISO-8601 UTC time it cleared, or None while active.
        threshold_source: "min", "max" or "baseline-max_drop".
        source: "local" or "combined" (evidence merged from replicas, monitoring/combine.py).
        rows_seen: the slice's sampled rows so far.
        clears: "on_recovery" (a recovery detector clears it on evidence) or "never" (a metric without a finite
            bad end and no truncate_at: it stays active until the monitor restarts).
    """

    model: str
    slice: str
    metric: str
    value: float
    threshold: float
    direction: str
    detector: str
    statistic: float
    alarm_threshold: float
    change_point_request_index: int | None
    change_point_sample: int
    samples_since_change: int
    samples_seen: int
    effective_samples: float
    requests_seen: int
    method: str
    alpha: float
    horizon: int
    fired_at: str
    request_index: int | None
    cleared_at: str | None = None
    threshold_source: str = ""
    source: str = "local"
    rows_seen: int = 0
    clears: str = "on_recovery"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (floats rounded to 6 significant digits; inf as the string 'inf')."""
        d = asdict(self)
        for k, v in d.items():
            if isinstance(v, float):
                d[k] = _json_float(v)
        return d


def _json_float(v: float) -> float | str | None:
    if math.isnan(v):
        return None
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return float(f"{v:.6g}")


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
    return Betting(sign, tuple(2.0 ** -j / span for j in range(1, N_BETS + 1)), span, cap)


def request_excess(bet: Betting, excess: Any) -> float:
    """A request's excess on the side `bet` bets on: the mean over its rows of each row's excess clipped to
    [-span, cap] (every factor 1 + lam * r * ybar stays >= 0).

    Args:
        bet: the bets (its sign picks the side).
        excess: (rows,) float64 per-row excess on the alarm side (y), NaN-free; a float for one row.

    Returns:
        ybar in [-span, cap].
    """
    if isinstance(excess, float):
        return min(max(bet.sign * excess, -bet.span), bet.cap)
    return float(np.clip(bet.sign * excess, -bet.span, bet.cap).mean())


def _add_walk(walk: list[float], bet: Betting, y: float, r: float) -> None:
    """Accumulate one request's log factors per bet (y already from `request_excess`) into an unclipped walk (a
    replica's recovery-side evidence)."""
    for j, lam in enumerate(bet.lambdas):
        walk[j] += math.log1p(lam * r * y)


class Cusum:
    """N_BETS one-sided CUSUMs of one (slice, metric) stream (formula: module docstring).

    Attributes:
        s: (N_BETS,) current CUSUM statistics (log scale, >= 0).
        start: (N_BETS,) the slice's sampled-request number where each CUSUM last left zero.
        start_request: (N_BETS,) the request index of that request.
        walk: (N_BETS,) unclipped sum of the log factors since start (replicas export it, monitoring/combine.py).
    """

    __slots__ = ("s", "start", "start_request", "walk")

    def __init__(self) -> None:
        self.s = [0.0] * N_BETS
        self.start = [0] * N_BETS
        self.start_request: list[int | None] = [None] * N_BETS
        self.walk = [0.0] * N_BETS

    def update(self, bet: Betting, y: float, r: float, row: int, request_index: int | None) -> None:
        """Add one sampled request: its excess y from `request_excess` (in the bet's sign, clipped), weight ratio
        r in (0, 1], `row` the slice's sampled-request number."""
        s, walk = self.s, self.walk
        for j, lam in enumerate(bet.lambdas):
            inc = math.log1p(lam * r * y)
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
                s[j] = v

    def add_batch(self, increments: Sequence[float], row: int) -> None:
        """Add a batch's summed log factors per bet (evidence from a replica); clipping at batch boundaries only."""
        for j, inc in enumerate(increments):
            v = self.s[j] + inc
            if v <= 0.0:
                self.s[j], self.start[j], self.start_request[j] = 0.0, row + 1, None
            else:
                if self.s[j] == 0.0:
                    self.start[j], self.start_request[j] = row, None
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


class Stream:
    """Detector state of one (slice, metric) with a threshold: the alarm CUSUM, the recovery CUSUM, alert state,
    and (replicas only) the recovery-side walk of every sampled request, for the combiner."""

    __slots__ = ("alarm", "recovery", "active", "alerts", "record", "rec_walk")

    def __init__(self, export_walks: bool = False) -> None:
        self.alarm = Cusum()
        self.rec_walk: list[float] | None = [0.0] * N_BETS if export_walks else None
        self.recovery: Cusum | None = None
        self.active = False
        self.alerts = 0
        self.record: AlertRecord | None = None


class SliceState:
    """Everything kept for one slice key: counts, the display estimate and one Stream per thresholded metric.

    Attributes:
        rows: sampled rows compared in this slice.
        requests: sampled requests compared in this slice (the detectors' clock).
        sw, sww: exponentially weighted sums of the rows' weights w = 1/p and of w^2.
        swm: {metric: exponentially weighted sum of w over the rows that have a value of the metric} (a
            candidate failure leaves metrics other than agreement and candidate_error_rate without one).
        swx: {metric: exponentially weighted sum of w x}.
        ninf: {metric: decayed count of infinite values (non-finite candidate rows)}.
        reference_failures: sampled rows of this slice the reference could not judge (error, timeout, NaN):
            excluded from the evidence (not the candidate's fault), counted and shown.
        streams: {metric: Stream} for metrics with a threshold.
    """

    __slots__ = ("rows", "requests", "sw", "sww", "swm", "swx", "ninf", "streams", "last_request", "incarnation",
                 "version", "peak", "reference_failures")

    def __init__(self, metrics: Sequence[str], bounded: Iterable[str], incarnation: int = 0,
                 export_walks: bool = False) -> None:
        self.incarnation = incarnation
        self.version = incarnation
        self.peak = 0.0  # largest alarm CUSUM over the slice's metrics after its last update (ranking for export)
        self.rows = 0
        self.requests = 0
        self.reference_failures = 0
        self.sw = 0.0
        self.sww = 0.0
        self.swm = dict.fromkeys(metrics, 0.0)
        self.swx = dict.fromkeys(metrics, 0.0)
        self.ninf = dict.fromkeys(metrics, 0.0)
        self.streams = {m: Stream(export_walks) for m in bounded}
        self.last_request: int | None = None

    def mean(self, metric: str) -> float:
        """Display estimate: exponentially weighted Hajek mean (+inf while a recent row was infinite)."""
        if self.swm[metric] <= 0:
            return math.nan
        if self.ninf[metric] > 1e-3:  # parity scores a non-finite candidate row +inf (lower-is-better metrics)
            return math.inf
        return self.swx[metric] / self.swm[metric]

    @property
    def n_eff(self) -> float:
        """Kish effective sample size (sum w)^2 / sum w^2 of the decayed weights."""
        return self.sw * self.sw / self.sww if self.sww > 0 else 0.0

    def evidence(self, h: float) -> float:
        """Largest alarm statistic over the slice's metrics as a fraction of h (1.0 = alarm level)."""
        return max((st.alarm.statistic() / h for st in self.streams.values()), default=0.0)


@dataclass
class Evaluation:
    """What changed after one update: alerts fired and cleared (each an AlertRecord)."""

    fired: list[AlertRecord] = field(default_factory=list)
    cleared: list[AlertRecord] = field(default_factory=list)


class SliceStatistics:
    """Every slice measured (memory-bounded), a detector per (slice, metric) with a threshold, alert state.

    Args:
        model: model name for alert records.
        metrics: tracked per-row metrics (display estimates for all of them).
        bounds: {metric: Bound} for the metrics alerted on.
        streams_per_request: G, the slice keys one request carries (`all` + columns + pairs).
        alpha: probability of any false alarm within `horizon` sampled requests (module docstring).
        horizon: sampled requests the alpha guarantee covers.
        window_size: span (rows) of the display estimate's exponential weighting.
        min_support: a slice alerts only once it has this many sampled rows (a guard; the guarantee needs none).
        max_tracked_slices: memory bound on slice keys; past it the least recently updated slice without an
            active alert and with evidence below PROTECT_FRACTION of h is evicted (`evicted` counts them;
            `_evict`).
        source: "local", or "combined" for the replica combiner (recorded in alerts).
        export_walks: also keep every stream's recovery-side walk (replicas whose evidence a combiner reads).
        alerting: False for a replica that only exports evidence (`--evidence-only`): detectors run, never fire.

    Raises:
        ValueError: alpha outside (0, 1), horizon or max_tracked_slices < 1.
    """

    def __init__(self, model: str, metrics: Iterable[str], bounds: Mapping[str, Bound], *,
                 streams_per_request: int, alpha: float, horizon: int, window_size: int = 1000,
                 min_support: int = 30, max_tracked_slices: int = 100_000, source: str = "local",
                 export_walks: bool = False, alerting: bool = True) -> None:
        if not 0 < alpha < 1:
            raise ValueError(f"alpha must be in (0, 1), got {alpha}")
        if horizon < 1 or max_tracked_slices < 1:
            raise ValueError("horizon and max_tracked_slices must be >= 1")
        self.model = model
        self.metrics = tuple(metrics)
        self.bounds = dict(bounds)
        self.alpha = alpha
        self.horizon = int(horizon)
        self.streams_per_request = int(streams_per_request)
        self.h = alarm_threshold(alpha, horizon, streams_per_request * max(len(self.bounds), 1))
        self.decay = 1.0 - 1.0 / max(window_size, 1)
        self.window_size = window_size
        self.min_support = min_support
        self.max_tracked_slices = max_tracked_slices
        self.source = source
        self.export_walks = export_walks
        self.alerting = alerting
        self.version = 0  # updates so far; each slice records the version of its last update (evidence cursor)
        self.bets = {m: bettings(b) for m, b in self.bounds.items()}
        self.slices: OrderedDict[str, SliceState] = OrderedDict()
        self.evicted = 0
        self.evicted_strong = 0  # evicted with evidence >= PROTECT_FRACTION of h (no weak slice was left)
        self.alerting_keys: set[str] = set()  # slice keys with an active alert
        self.history: list[AlertRecord] = []
        self.requests_seen: Mapping[str, int] = {}

    @property
    def method(self) -> str:
        """Detector and family control as recorded in alerts."""
        return f"{DETECTOR}+stream_alpha"

    # ------------------------------------------------------------------------------------------ updates
    def state(self, key: str) -> SliceState:
        """The slice's state, created (evicting the least recently updated idle slice when full) if new."""
        st = self.slices.get(key)
        if st is not None:
            self.slices.move_to_end(key)
            return st
        if len(self.slices) >= self.max_tracked_slices:
            self._evict()
        self.version += 1
        st = self.slices[key] = SliceState(self.metrics, self.bounds, self.version, self.export_walks)
        return st

    def _evict(self) -> None:
        """Free one slot: the least recently updated *weak* slice (no active alert, evidence below
        PROTECT_FRACTION of the alarm level h) goes first, so a flood of new keys cannot push out a slice that is
        drifting but not yet alerting (issue 22). A protected slice met on the way (strong, alerting, `all`) is
        moved to the recent end, so each eviction costs O(1) amortized and the LRU order among the weak ones is
        kept. With no weak slice left, the least recently updated strong one without an alert goes (counted in
        `evicted_strong` too); with only alerting ones, the oldest of those (the bound wins)."""
        slices = self.slices
        limit = PROTECT_FRACTION * self.h
        for _ in range(len(slices)):
            k = next(iter(slices))
            s = slices[k]
            if k != ALL_SLICE and not any(x.active for x in s.streams.values()) and (
                    s.peak < limit or s.evidence(self.h) < PROTECT_FRACTION):
                del slices[k]
                self.evicted += 1
                return
            slices.move_to_end(k)
        strong = next((k for k, s in slices.items()
                       if k != ALL_SLICE and not any(x.active for x in s.streams.values())), None)
        if strong is not None:
            del slices[strong]
            self.evicted += 1
            self.evicted_strong += 1
            return
        # every tracked slice is alerting: the bound wins, the oldest alerting slice goes (still counted)
        k = next(k for k in slices if k != ALL_SLICE)
        del slices[k]
        self.alerting_keys.discard(k)
        self.evicted += 1

    def update(self, keys: Sequence[str], values: Mapping[str, Any], weight: float,
               ratios: Sequence[float] | None = None, request_index: int | None = None,
               now: datetime | None = None) -> Evaluation:
        """Add one sampled request (all its rows) to each of its slices; update detectors and alert state.

        The display estimate takes every row; each detector takes one bet on the request's mean excess (module
        docstring: the request is the unit of evidence).

        Args:
            keys: the request's slice keys (including "all").
            values: {metric: (rows,) float64 per-row values} for the tracked metrics (a float for a one-row
                request); a metric left out, or NaN, marks rows without a value of that metric (a candidate failure leaves metrics other
                than agreement and candidate_error_rate without one); rows whose reference was non-finite must be
                dropped before.
            weight: sampling weight w = 1/p of the request (each of its rows).
            ratios: per key, pi_slice / p in (0, 1] (sampler.Decision.ratios); None = all 1 (uniform sampling).
            request_index: sequence number recorded in alerts (and as change points).
            now: time stamp for fired/cleared records (default: now, UTC).

        Returns:
            The alerts fired and cleared by this update.
        """
        ev = Evaluation()
        n, display, excess = self._prepare(values)
        if n == 0:
            return ev
        d = self.decay
        dn = d ** n
        g_all = display[""][0]
        self.version += 1
        for i, k in enumerate(keys):
            s = self.state(k)
            s.version = self.version
            s.rows += n
            s.requests += 1
            s.last_request = request_index
            s.sw = dn * s.sw + weight * g_all
            s.sww = dn * s.sww + weight * weight * g_all
            for m in self.metrics:
                gm, gx, ginf = display[m]
                s.swm[m] = dn * s.swm[m] + weight * gm
                s.swx[m] = dn * s.swx[m] + weight * gx
                s.ninf[m] = dn * s.ninf[m] + ginf
            r = ratios[i] if ratios is not None else 1.0
            for m, (ay, ry) in excess.items():
                stream = s.streams.get(m)
                if stream is not None:
                    self._step(k, m, s, stream, ay, ry, r, request_index, now, ev)
            s.peak = max((max(st.alarm.s) for st in s.streams.values()), default=0.0)
        return ev

    def _prepare(self, values: Mapping[str, Any]
                 ) -> tuple[int, dict[str, tuple[float, float, float]], dict[str, tuple[float, float | None]]]:
        """One request's rows reduced once for all its slices: (rows, {metric: (sum of decay weights over rows
        with a value, decayed sum of finite values, decayed count of infinite values)} with key "" holding the
        decay weight sum over all rows, {bounded metric: (alarm excess, recovery excess or None)})."""
        arrays = {m: np.atleast_1d(np.asarray(values[m], dtype=np.float64)) for m in self.metrics if m in values}
        n0 = max((a.shape[0] for a in arrays.values()), default=0)
        for m in self.metrics:  # a metric the caller did not give has no value on these rows
            if m not in arrays:
                arrays[m] = np.full(n0, np.nan)
        n = max((a.shape[0] for a in arrays.values()), default=0)
        if n == 0:
            return 0, {}, {}
        d = self.decay
        geo = d ** np.arange(n - 1, -1, -1, dtype=np.float64) if n > 1 else None
        display: dict[str, tuple[float, float, float]] = {"": (float(geo.sum()) if geo is not None else 1.0,
                                                               0.0, 0.0)}
        excess: dict[str, tuple[float, float | None]] = {}
        for m, a in arrays.items():
            if a.shape[0] != n:
                raise ValueError(f"metric {m!r} has {a.shape[0]} rows, the request {n}")
            valid = ~np.isnan(a)
            finite = np.isfinite(a)
            if geo is None:
                x = float(a[0])
                display[m] = ((1.0, x, 0.0) if finite[0] else (1.0, 0.0, 1.0)) if valid[0] else (0.0, 0.0, 0.0)
            else:
                display[m] = (float(geo[valid].sum()), float((geo[finite] * a[finite]).sum()),
                              float(geo[valid & ~finite].sum()))
            b = self.bounds.get(m)
            if b is None or not valid.any():
                continue
            x = a[valid] if not valid.all() else a
            if b.higher_is_better:
                y = b.value - x
            else:
                y = (np.minimum(x, b.truncate_at) if b.truncate_at is not None else x) - b.value
            y = float(y[0]) if y.shape[0] == 1 else y
            alarm_bet, rec_bet = self.bets[m]
            excess[m] = (request_excess(alarm_bet, y), request_excess(rec_bet, y) if rec_bet is not None else None)
        return n, display, excess

    def _step(self, key: str, metric: str, s: SliceState, stream: Stream, ay: float, ry: float | None, r: float,
              request_index: int | None, now: datetime | None, ev: Evaluation) -> None:
        alarm_bet, rec_bet = self.bets[metric]
        sample = s.requests
        if stream.rec_walk is not None and rec_bet is not None and ry is not None:
            _add_walk(stream.rec_walk, rec_bet, ry, r)
        if stream.active:
            stream.alarm.update(alarm_bet, ay, r, sample, request_index)  # keeps the walk (replicas) current
            if stream.recovery is not None and rec_bet is not None and ry is not None:
                stream.recovery.update(rec_bet, ry, r, sample, request_index)
                if stream.recovery.crossed(self.h):
                    self._clear(stream, sample, now, ev)
            return
        stream.alarm.update(alarm_bet, ay, r, sample, request_index)
        if self.alerting and s.rows >= self.min_support and stream.alarm.crossed(self.h):
            self._fire(key, metric, s, stream, request_index, now, ev)

    def reference_failed(self, keys: Sequence[str], rows: int) -> None:
        """Count `rows` sampled rows of a request whose reference could not judge them (error, timeout, NaN
        output) in each of its slices: excluded from the evidence, shown in slices.json (`reference_failures`)."""
        if rows <= 0:
            return
        self.version += 1
        for k in keys:
            s = self.state(k)
            s.version = self.version
            s.reference_failures += rows

    def _fire(self, key: str, metric: str, s: SliceState, stream: Stream, request_index: int | None,
              now: datetime | None, ev: Evaluation) -> None:
        b = self.bounds[metric]
        c = stream.alarm
        j = c.winner()
        rec = AlertRecord(model=self.model, slice=key, metric=metric, value=s.mean(metric), threshold=b.value,
                          direction="min" if b.higher_is_better else "max", detector=DETECTOR,
                          statistic=c.statistic(), alarm_threshold=self.h,
                          change_point_request_index=c.start_request[j], change_point_sample=c.start[j],
                          samples_since_change=s.requests - c.start[j] + 1, samples_seen=s.requests,
                          effective_samples=s.n_eff, requests_seen=int(self.requests_seen.get(key, 0)),
                          method=self.method, alpha=self.alpha, horizon=self.horizon,
                          fired_at=(now or datetime.now(timezone.utc)).isoformat(), request_index=request_index,
                          threshold_source=b.source, source=self.source, rows_seen=s.rows,
                          clears="on_recovery" if self.bets[metric][1] is not None else "never")
        stream.active = True
        self.alerting_keys.add(key)
        stream.alerts += 1
        stream.record = rec
        stream.recovery = Cusum() if self.bets[metric][1] is not None else None
        c.reset(s.requests)
        self.history.append(rec)
        ev.fired.append(rec)

    def _clear(self, stream: Stream, row: int, now: datetime | None, ev: Evaluation) -> None:
        rec = stream.record
        stream.active = False
        stream.recovery = None
        stream.alarm.reset(row)
        stream.record = None
        if rec is not None:
            rec.cleared_at = (now or datetime.now(timezone.utc)).isoformat()
            ev.cleared.append(rec)
            s = self.slices.get(rec.slice)
            if s is None or not any(x.active for x in s.streams.values()):
                self.alerting_keys.discard(rec.slice)

    def merge(self, key: str, walks: Mapping[str, tuple[Sequence[float], Sequence[float]]], rows: int,
              requests: int | None = None, now: datetime | None = None) -> Evaluation:
        """Add a replica's evidence for one slice: `requests` new sampled requests (`rows` rows) and, per metric,
        the summed log factors per bet on the alarm and the recovery side (monitoring/combine.py). The CUSUMs clip
        at zero between merges only.

        Args:
            key: slice key.
            walks: {metric: (alarm increments (N_BETS,), recovery increments (N_BETS,) or empty)}.
            rows: rows the increments cover.
            requests: sampled requests the increments cover (None: as many as rows, one-row requests).
            now: time stamp for alert records.

        Returns:
            Alerts fired or cleared (the combiner's).
        """
        ev = Evaluation()
        requests = rows if requests is None else requests
        if rows <= 0 or requests <= 0:
            return ev
        s = self.state(key)
        self.version += 1
        s.version = self.version
        s.rows += rows
        s.requests += requests
        for metric, (alarm, recovery) in walks.items():
            stream = s.streams.get(metric)
            if stream is None:
                continue
            if stream.active:
                stream.alarm.add_batch(alarm, s.requests)
                if stream.recovery is not None and len(recovery):
                    stream.recovery.add_batch(recovery, s.requests)
                    if stream.recovery.crossed(self.h):
                        self._clear(stream, s.requests, now, ev)
                continue
            stream.alarm.add_batch(alarm, s.requests)
            if self.alerting and s.rows >= self.min_support and stream.alarm.crossed(self.h):
                self._fire(key, metric, s, stream, None, now, ev)
        s.peak = max((max(st.alarm.s) for st in s.streams.values()), default=0.0)
        return ev

    def evidence(self, since: int = 0) -> dict[str, Any]:
        """The walks of every slice updated after version `since` (what a combiner merges; needs export_walks).

        Returns:
            {"version": the current version (the next cursor), "slices": {key: {"incarnation", "rows", "requests",
            "metrics": {metric: {"alarm": [N_BETS walks], "recovery": [N_BETS walks, or [] when the metric has no
            recovery test]}}}}}.
        """
        version, keys = self.evidence_keys(since)
        return {"version": version, "slices": self.evidence_entries(keys)}

    def evidence_keys(self, since: int = 0) -> tuple[int, list[str]]:
        """(the current version, the keys of the slices updated after version `since`): what `evidence` builds,
        chosen without building it (the service builds the entries in chunks, monitoring/service.py)."""
        return self.version, [key for key, s in self.slices.items() if s.version > since]

    def evidence_entries(self, keys: Iterable[str]) -> dict[str, Any]:
        """{key: {"incarnation", "rows", "requests", "metrics"}} (`evidence`) for those of `keys` still tracked."""
        out: dict[str, Any] = {}
        for key in keys:
            s = self.slices.get(key)
            if s is None:
                continue
            out[key] = {"incarnation": s.incarnation, "rows": s.rows, "requests": s.requests,
                        "metrics": {m: {"alarm": list(st.alarm.walk),
                                        "recovery": (list(st.rec_walk) if st.rec_walk is not None
                                                     and self.bets[m][1] is not None else [])}
                                    for m, st in s.streams.items()}}
        return out

    # ------------------------------------------------------------------------------------------ reports
    def active_alerts(self) -> list[AlertRecord]:
        """Alerts currently active."""
        return [st.record for k in sorted(self.alerting_keys) for st in self.slices[k].streams.values()
                if st.active and st.record is not None]

    def exported(self, k: int) -> list[str]:
        """The bounded label set for Prometheus: `all`, every slice with an active alert, and the k others with
        the most evidence (alarm statistic / h), in that order."""
        alerting = sorted(self.alerting_keys - {ALL_SLICE})
        chosen = set(alerting) | {ALL_SLICE}
        # rank by the largest CUSUM (within log N_BETS of the statistic; kept per slice: cheap at 100k slices)
        rest = ((s.peak, key) for key, s in self.slices.items() if key not in chosen)
        worst = [key for _, key in heapq.nlargest(k, rest)]
        return ([ALL_SLICE] if ALL_SLICE in self.slices else []) + alerting + worst

    def slice_entry(self, key: str) -> dict[str, Any]:
        """One slice's statistics (an entry of slices.json and /v1/slices)."""
        s = self.slices[key]
        ms: dict[str, Any] = {}
        for m in self.metrics:
            entry: dict[str, Any] = {"mean": _json_float(s.mean(m))}
            stream = s.streams.get(m)
            if stream is not None:
                b = self.bounds[m]
                stat = stream.alarm.statistic()
                entry.update(threshold=b.value, direction="min" if b.higher_is_better else "max",
                             statistic=_json_float(stat), alarm_threshold=_json_float(self.h),
                             evidence=_json_float(stat / self.h), alert_active=stream.active,
                             alerts_fired=stream.alerts, detector=DETECTOR,
                             clears="on_recovery" if self.bets[m][1] is not None else "never",
                             status=("alert" if stream.active else "ok" if s.rows >= self.min_support
                                     else "insufficient_data"))
            ms[m] = entry
        return {"samples_total": s.rows, "sampled_requests": s.requests,
                "reference_failures": s.reference_failures, "effective_samples": _json_float(s.n_eff),
                "weight_sum": _json_float(s.sw), "evidence": _json_float(s.evidence(self.h)), "metrics": ms}

    def slice_summary(self, keys: Iterable[str] | None = None) -> dict[str, Any]:
        """{slice key: slice_entry} for `keys` (default: every tracked slice, sorted)."""
        return {k: self.slice_entry(k) for k in (sorted(self.slices) if keys is None else keys)}


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
