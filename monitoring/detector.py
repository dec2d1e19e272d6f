"""Per-slice sequential change detection of the gate's quantity, with a false-alarm guarantee over the stream.

Every slice key the configured columns produce is measured (up to a memory bound, `max_tracked_slices`, past
which the least recently updated slice without an active alert is evicted and counted). For every slice and
every metric with a threshold (monitoring/config.py `Bound`), a one-sided **betting CUSUM** watches for the
slice's per-row mean crossing the threshold.

The tested quantity is the gate's. The pipeline's gates are row-weighted (per slice: agreeing rows / rows >=
0.97), so the detector tests the row-weighted mean: every row counts once, whatever the size of the request it
came in. (Before issue 41 it tested the mean of per-request means: on honest traffic whose difficulty correlates
with request size the two disagree, and it alarmed on slices the gate passes and missed ones it fails.)

Write the per-row excess over the threshold on the bad side as

    y = threshold - x   (higher-is-better metrics: agreement, cosine)      y = x - threshold   (lower-is-better)

and a request's excess as the SUM over its n rows, S = sum_i y_i (each y_i clipped to [-span, cap] first: cap
is the distance from the threshold to the range's bad end, or to `truncate_at`; clipping above only lowers an
e-value, and no row is below -span).

Null. H0 for one (slice, metric): given the past, every sampled request's expected excess sum is <= 0,

    E[ S_t | F_{t-1} ] <= 0    (the conditional null; F_{t-1}: everything before request t)

so in expectation the rows arriving next are on the good side of the threshold *per row*: a request of 64 rows
weighs 64 times a one-row request, as in the gate. Under a stationary mix of request sizes and contents this is
exactly "the traffic's per-row mean is at or on the good side of the threshold". The rows of one request may be
dependent in any way (same source, same content, one sampling draw): the request is the unit of evidence.

Bets. With a declared bound M on a request's rows (monitoring.max_request_rows, default 64, at most
monitoring.max_batch_rows) and span = |good end of the metric's range - threshold| (agreement, cosine <= 1; KL and
errors >= 0), S >= -span n >= -span M, so for every 0 <= lam < 1 / span the factor

    1 + lam * r * S / M    >= 1 - lam * span > 0

is non-negative whatever the dependence of the rows, and E_H0[factor | past] <= 1: an e-value (testing by
betting: Waudby-Smith & Ramdas 2024, JRSS-B 86:1). It must be linear in S with one slope for every request size
(an e-value for the mean null over all distributions of (S, n) is dominated by 1 + mu S), which is the price of
the row-weighted null: a one-row request carries at most 1/M of a full bet, so declare M as small as your
largest batch (replay, whose requests are single rows, uses M = 1). A request of more than M rows is split into
ceil(n / M) consecutive chunks of at most M rows, each one bet and one evidence unit (counted per slice:
`oversize_requests`); for those requests the guarantee also assumes each chunk is on the good side given the
chunks before it (true for independent rows; not for a request whose rows all fail together, hence the bound).
For one-row requests of a 0/1 metric with M = 1 and lam = (q1/q0 - 1)/threshold the factor *is* the likelihood
ratio of disagreement rate q1 against q0 = 1 - threshold: Page's Bernoulli CUSUM (Page 1954; Reynolds &
Stoumbos 1999, JQT 31:87). The post-change value and the request sizes are unknown, so K = N_BETS bets lam_j =
f_j / span run side by side, f_j in BET_FRACTIONS = (0.95, 0.9, 0.75, 2^-1, ..., 2^-10): the best bet for
one-row requests of a small shift is near 2^-5, for 64-row requests near 0.95 (issue 41: without the top
three the 64-row delay was 1.6x the best linear bet):

    S_j <- max(0, S_j + log(1 + lam_j * r * S / M))       (one CUSUM per bet, updated once per evidence unit)
    alarm when  log( mean_j exp(S_j) ) >= h                (the mixture e-detector; a mean, whatever K)

`r = pi_slice / p` (<= 1) weights a request sampled with probability p by the probability pi_slice the slice's
own frequency gives (monitoring/sampler.py): E[sampled * r * S] = pi_slice * E_traffic[S], so the factor stays an
e-value for the slice's *traffic* (Horvitz-Thompson weighting inside the bet).

Guarantee. exp(S_j) = max over start points k of the product of factors since k, so mean_j exp(S_j) is at most
the Shiryaev-Roberts sum over start points of the mixture e-processes; that sum minus the number of start
points is a supermartingale under H0 (Shin, Ramdas & Rinaldo 2024, "E-detectors: a nonparametric framework for
sequential change detection", NEJSDS 2:229). Summing over every (slice, metric) stream, each evidence unit
starts G x B e-processes (G = slice keys a request carries: `all` + one per column + one per pair; B = metrics
with a threshold). With h = log(horizon x G x B / alpha), Ville's inequality gives

    P_H0[ any false alarm, in any slice and metric, within the first `horizon` evidence units ] <= alpha

and an average run length to a false alarm of at least horizon / alpha units (sampled requests; an oversize
request counts as its chunks), whatever the number of slices or bets. H0 here is "every slice's stream satisfies
the conditional null": it holds at the threshold itself, the hardest case. Assumptions: the conditional null
(requests need not be independent: each bet only needs its conditional mean), the sampling draw does not depend
on the request's metric values (it depends on slice frequencies only), requests of a slice are compared in
arrival order, and no request has more than M rows (or the chunk assumption above).

What a time-varying mix means. The null is conditional: it asks that the traffic arriving *next* be fine per row,
given the past. A mix that changes predictably over time (a nightly batch job sending 64-row requests, one-row
interactive traffic by day) can satisfy the gate on the day's total while a stretch of it fails per row: the
CUSUM restarts its evidence at each estimated change point, so it tests the per-row mean of the recent stretch,
and it alarms on a stretch whose own rows fail the threshold (a true statement about those hours, reported with
its window: `change_point_request_index`, `window_rows`, `value`). A stretch whose rows pass does not alarm,
whatever the request sizes. Stratify by the mix's driver (a slice on the tenant, the hour, or the size) to see
it per stratum.

Recovery. After an alarm the alert stays active while a recovery CUSUM (the same bets and scale on the good side,
-S) looks for evidence that the slice's per-row mean is back; when it crosses h the alert clears and the alarm
detector restarts from zero. The recovery bets need the excess bounded on the *bad* side (-y >= -(distance to
the bad end)): a metric with a finite bad end (agreement 0, cosine -1) has it; a lower-is-better metric without
an upper end (kl_divergence, abs_error, rel_error) has it only with a declared `truncate_at` c, and then both
tests are about the truncated mean E[min(x, c)] (the alarm's evidence for it is also evidence for the untruncated
mean, which is larger; the recovery certifies the truncated mean only, as documented). Without `truncate_at` such
a metric gets no evidence-based clearing: its alert stays active until the monitor restarts (`clears: "never"` in
the record).

Alert records. The estimated change point is where the winning CUSUM last left zero (the CUSUM
maximum-likelihood change-point estimate, Page 1954). The record's `value` is the tested quantity over the
window from that change point to the alarm: the rows' r-weighted per-row mean (a Hajek ratio estimator), with a
95% interval from the ratio estimator's linearization variance with requests as clusters (`window_estimate`).
It is on the failing side of the threshold by construction (the winning CUSUM is positive, and log(1 + x) <= x
makes its window's weighted excess sum positive); a record without a value says why in `reason`. The window is
chosen by the detector, so value and interval describe it, they are not a test.

For display, each slice also keeps an exponentially weighted Hajek mean (span `window_size` rows, weights 1/p)
and Kish's effective sample size of those weights; they never decide an alert (`recent_mean` in the record).
"""

from __future__ import annotations

import heapq
import math
import operator
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from tailguard.monitoring.config import ALL_SLICE, Bound
from tailguard.monitoring.cusum import (
    ACC_FIELDS,
    CI_METHOD,
    N_BETS,
    Cusum,
    add_sums,
    add_walk,
    alarm_threshold,
    bettings,
    window_estimate,
)
from tailguard.monitoring.units import BatchSums, GroupedRequest, Prepared, RowReducer

DEFAULT_MAX_REQUEST_ROWS = 64  # monitoring.max_request_rows' default (the bound M on a request's rows)
DETECTOR = "betting_cusum"
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
        value: the estimate of the tested quantity: the slice's per-row mean of the metric (rows weighted
            equally, sampled rows weighted by r = pi_slice / p: a Hajek ratio estimator) over the post-change
            window the detector estimated (from the winning CUSUM's change point to the alarm); for a metric
            with truncate_at, of the truncated values. On the failing side of `threshold` by construction (the
            winning CUSUM is positive only when the window's weighted excess sum is); None (JSON null) when it
            cannot be computed, with `reason` saying why.
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
        value_ci_low, value_ci_high: 95% confidence interval of `value` (`value_ci_method`), clipped to the
            metric's range; None with `value`.
        value_ci_method: how the interval was computed (`window_estimate`).
        window_rows: sampled rows in the post-change window (`value` is their weighted mean).
        window_requests: evidence units (sampled requests; an oversize request counts as its chunks) in it.
        recent_mean: the slice's exponentially weighted display estimate (span `window_size` rows) when it fired
            (what the parity gauges show; it may lie on the passing side: it mixes pre-change rows in).
        reason: None, or why `value` is missing or on the passing side of the threshold.
        max_request_rows: the bound M the bets were scaled by.
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
    value_ci_low: float | None = None
    value_ci_high: float | None = None
    value_ci_method: str = ""
    window_rows: int = 0
    window_requests: int = 0
    recent_mean: float | None = None
    reason: str | None = None
    max_request_rows: int = DEFAULT_MAX_REQUEST_ROWS

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


class Stream:
    """Detector state of one (slice, metric) with a threshold: the alarm CUSUM, the recovery CUSUM, alert state,
    (replicas only) the recovery-side walk of every sampled request, for the combiner, and `acc`, the cumulative
    window sums (ACC_FIELDS) of every unit so far (`sums_ok` False once a merged batch came without them)."""

    __slots__ = ("alarm", "recovery", "active", "alerts", "record", "rec_walk", "acc", "sums_ok")

    def __init__(self, export_walks: bool = False) -> None:
        self.alarm = Cusum()
        self.acc = [0.0] * len(ACC_FIELDS)
        self.sums_ok = True
        self.rec_walk: list[float] | None = [0.0] * N_BETS if export_walks else None
        self.recovery: Cusum | None = None
        self.active = False
        self.alerts = 0
        self.record: AlertRecord | None = None


class SliceState:
    """Everything kept for one slice key: counts, the display estimate and one Stream per thresholded metric.

    Attributes:
        rows: sampled rows compared in this slice.
        requests: evidence units compared in this slice (the detectors' clock): sampled requests, one of more
            than max_request_rows rows counting as ceil(rows / max_request_rows).
        sw, sww: exponentially weighted sums of the rows' weights w = 1/p and of w^2.
        swm: {metric: exponentially weighted sum of w over the rows that have a value of the metric} (a
            candidate failure leaves metrics other than agreement and candidate_error_rate without one).
        swx: {metric: exponentially weighted sum of w x}.
        ninf: {metric: decayed count of infinite values (non-finite candidate rows)}.
        reference_failures: sampled rows of this slice the reference could not judge (error, timeout, NaN):
            excluded from the evidence (not the candidate's fault), counted and shown.
        oversize: sampled requests with more than max_request_rows rows here (each split into chunks).
        streams: {metric: Stream} for metrics with a threshold.
    """

    __slots__ = ("rows", "requests", "sw", "sww", "swm", "swx", "ninf", "streams", "last_request", "incarnation",
                 "version", "peak", "reference_failures", "oversize")

    def __init__(self, metrics: Sequence[str], bounded: Iterable[str], incarnation: int = 0,
                 export_walks: bool = False) -> None:
        self.incarnation = incarnation
        self.version = incarnation
        self.peak = 0.0  # largest alarm CUSUM over the slice's metrics after its last update (ranking for export;
        # 0: every alarm CUSUM at 0, `apply_batch`'s idle check): every update that moves a CUSUM sets it
        self.rows = 0
        self.requests = 0
        self.reference_failures = 0
        self.oversize = 0
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
        max_request_rows: M, the declared bound on a request's rows in one slice (monitoring.max_request_rows):
            each bet is on a request's excess sum over M; a request with more rows is split into chunks of M.

    Raises:
        ValueError: alpha outside (0, 1), horizon, max_tracked_slices or max_request_rows < 1.
    """

    def __init__(self, model: str, metrics: Iterable[str], bounds: Mapping[str, Bound], *,
                 streams_per_request: int, alpha: float, horizon: int, window_size: int = 1000,
                 min_support: int = 30, max_tracked_slices: int = 100_000, source: str = "local",
                 export_walks: bool = False, alerting: bool = True,
                 max_request_rows: int = DEFAULT_MAX_REQUEST_ROWS) -> None:
        if not 0 < alpha < 1:
            raise ValueError(f"alpha must be in (0, 1), got {alpha}")
        if horizon < 1 or max_tracked_slices < 1 or max_request_rows < 1:
            raise ValueError("horizon, max_tracked_slices and max_request_rows must be >= 1")
        self.max_request_rows = int(max_request_rows)
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
        self.reducer = RowReducer(self.metrics, self.bounds, self.bets, self.decay, self.max_request_rows)
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

        The display estimate takes every row; each detector takes one bet on the request's excess sum over
        max_request_rows (module docstring: the request is the unit of evidence; a request of more than
        max_request_rows rows takes one bet per chunk of that many rows). Callers with per-row slices call it
        once per (request, slice group) with that group's rows.

        Args:
            keys: the request's slice keys (including "all").
            values: {metric: (rows,) float64 per-row values} for the tracked metrics (a float for a one-row
                request); a metric left out, or NaN, marks rows without a value of that metric (a candidate failure
                leaves metrics other than agreement and candidate_error_rate without one); rows whose reference was
                non-finite must be dropped before.
            weight: sampling weight w = 1/p of the request (each of its rows).
            ratios: per key, pi_slice / p in (0, 1] (sampler.Decision.ratios); None = all 1 (uniform sampling).
            request_index: sequence number recorded in alerts (and as change points).
            now: time stamp for fired/cleared records (default: now, UTC).

        Returns:
            The alerts fired and cleared by this update.
        """
        ev = Evaluation()
        prepared = self.reducer.prepare(values, weight)
        if prepared[0]:
            self._apply(keys, prepared, ratios, request_index, now, ev)
        return ev

    def update_groups(self, groups: Sequence[tuple[Sequence[str], Sequence[int] | None]], values: Mapping[str, Any],
                      weight: float, ratios: Sequence[Sequence[float] | None] | None = None,
                      request_index: int | None = None, now: datetime | None = None) -> Evaluation:
        """Add one sampled request whose rows fall into several slice groups (per-row slices): each group is one
        `update` with its rows only, the groups' sums computed for all of them at once (`update_batch` of one
        request).

        Args:
            groups: [(keys whose rows are the same, row indices (ints) into the values, ascending,
                or None for every row)] (monitoring/config.py `MonitorConfig.row_groups`).
            values: {metric: (rows,) float64 per-row values} of the whole request (as `update`).
            weight: sampling weight w = 1/p of the request.
            ratios: per group, its keys' ratios pi_slice / p (as `update`'s), or None (all 1).
            request_index: sequence number recorded in alerts.
            now: time stamp for fired/cleared records.

        Returns:
            The alerts fired and cleared by this update.
        """
        return self.update_batch([GroupedRequest(groups, values, weight, ratios, request_index)], now)[0]

    def update_batch(self, requests: Sequence[GroupedRequest], now: datetime | None = None) -> list[Evaluation]:
        """Add several sampled requests (a shadow worker's micro-batch), in order, each as `update_groups` would:
        every (request, slice group) is one `update` with that group's rows. The groups' sums of every request
        are computed at once (`RowReducer.reduce_batch`, monitoring/units.py: a handful of numpy calls for the
        whole batch instead of a handful per request); then each request's groups update their slices in request
        order, so the statistics, CUSUMs and alerts are those of one `update` per group in that order (the sums
        may differ in the last bits: a segmented sum instead of a sum per group).

        Args:
            requests: the requests in arrival order (GroupedRequest; a request with request-level slices is one
                group [(keys, None)]).
            now: time stamp for fired/cleared records.

        Returns:
            One Evaluation per request (the alerts its update fired and cleared).
        """
        return self.apply_batch(requests, self.reducer.reduce_batch(requests), now)

    def apply_groups(self, req: GroupedRequest, prepared: Sequence[Prepared], now: datetime | None = None
                     ) -> Evaluation:
        """Add one request's groups, prepared by `RowReducer.reduce_batch` (`BatchSums.per_request`), to their
        slices' statistics and detectors, one group after another (`apply_batch`'s rare path, and the one a request
        with reference failures or a replica takes).

        Returns:
            The alerts this request fired and cleared.
        """
        ev = Evaluation()
        ratios = req.ratios if req.ratios is not None else [None] * len(req.groups)
        for (keys, _), p, r in zip(req.groups, prepared, ratios):
            if p[0]:
                self._apply(keys, p, r, req.request_index, now, ev)
        return ev

    def apply_batch(self, requests: Sequence[GroupedRequest], batch: BatchSums, now: datetime | None = None,
                    first: int = 0) -> list[Evaluation]:
        """`apply_groups` of several requests, in order, with the common case composed per slice key: the
        statistics, CUSUMs, alerts, version numbers and slice order are those of one `apply_groups` per request
        (the sums may differ in the last bits: summed in another order).

        The common case is a (request, slice group) unit of at most max_request_rows rows with finite values
        (`BatchSums.composable`) whose every bounded metric's excess sum is on the good side (alarm excess <= 0),
        added to a slice whose detectors are calm (no active alert, no CUSUM at the alarm level h): its CUSUMs can
        only fall, so none fires. The unit moves the display recursion s <- decay^n s + a and the window sums
        (`add_sums`), both of which compose, and on an idle detector (every alarm CUSUM at 0) nothing else; CUSUMs
        above 0 fall in closed form (`_compose_cusums`). Per key, the run of such units from the batch's start is
        composed with numpy, k units as s <- decay^(n_1 + .. + n_k) s + sum_i decay^(n_(i+1) + .. + n_k) a_i, one
        Python update per key; a key's first unit outside the common case, and every later unit of that key, go
        through `_apply` in arrival order (alerts fire only there), the keys of one group in one call. A batch that
        creates a slice (eviction order), or a replica keeping walks (`export_walks`), takes `apply_groups` per
        request.

        Args:
            requests: the requests in arrival order (`GroupedRequest`).
            batch: their groups' sums (`RowReducer.reduce_batch`); requests[j] is the batch's request first + j.
            now: time stamp for fired/cleared records.
            first: the batch position of requests[0].

        Returns:
            One Evaluation per request (the alerts it fired and cleared).
        """
        def each() -> list[Evaluation]:
            return [self.apply_groups(r, batch.per_request(first + i), now) for i, r in enumerate(requests)]

        if self.export_walks or len(requests) < 2:
            return each()
        slices = self.slices
        per_group: list[int] = []  # per group of the requests, in order: its keys
        pk: list[str] = []  # per (group, key) pair, group after group: the key, its ratio
        pr: list[float] = []
        for req in requests:
            groups, ratios = req.groups, req.ratios
            counts = [len(keys) for keys, _ in groups]
            per_group += counts
            for keys, _ in groups:
                pk += keys
            if ratios is None:
                pr += [1.0] * sum(counts)
            else:
                for r, c in zip(ratios, counts):
                    pr += [1.0] * c if r is None else r
        lo, hi = int(batch.starts[first]), int(batch.starts[first + len(requests)])
        has_rows = batch.rows[lo:hi] > 0
        if not has_rows.all():  # a group of no rows adds nothing: its pairs leave the lists
            keep = np.repeat(has_rows, per_group)
            pk = [key for key, kept in zip(pk, keep.tolist()) if kept]
            pr = [r for r, kept in zip(pr, keep.tolist()) if kept]
            per_group = [c for c, kept in zip(per_group, has_rows.tolist()) if kept]
        flat_row = (np.flatnonzero(has_rows) + lo).tolist()  # per group with rows: its row in `batch`
        flat_req = (np.searchsorted(batch.starts, flat_row, side="right") - 1 - first).tolist()  # its request
        if len(flat_row) < 2:
            return each()
        slot_of: dict[str, int] = {}
        ps = [slot_of.setdefault(key, len(slot_of)) for key in pk]  # each pair's key slot, by first appearance
        keys_at = list(slot_of)
        if any(key not in slices for key in keys_at):  # a new slice: creation and eviction in arrival order
            return each()
        pg = np.repeat(np.arange(len(flat_row)), per_group).tolist()
        evs = [Evaluation() for _ in requests]
        metrics, bounded = self.metrics, self.reducer.bounded
        k = len(metrics)
        fr = np.asarray(flat_row, dtype=np.int64)
        n_g = batch.rows[fr]
        alarm_g = batch.alarm[fr]
        common_g = batch.composable[fr] & (alarm_g <= 0.0).all(axis=1)
        n_keys = len(keys_at)
        # per key: idle (no alert, every alarm CUSUM at 0), or calm: no alert and no CUSUM at the alarm level (good
        # units only lower its CUSUMs, so none can fire: `_compose_cusums`)
        h = self.h
        idle = np.zeros(n_keys, dtype=bool)
        calm = np.zeros(n_keys, dtype=bool)
        for u, key in enumerate(keys_at):
            streams = slices[key].streams.values()
            if any(st.active for st in streams):
                continue
            if slices[key].peak <= 0.0:  # the largest alarm CUSUM after the slice's last update
                idle[u] = calm[u] = True
            else:
                calm[u] = not any(st.alarm.crossed(h) for st in streams)
        pg_a = np.asarray(pg, dtype=np.int64)
        ps_a = np.asarray(ps, dtype=np.int64)
        order = np.argsort(ps_a, kind="stable")  # pairs by key, arrival order within a key
        counts = np.bincount(ps_a, minlength=n_keys)
        bad = np.cumsum(~(common_g[pg_a] & calm[ps_a])[order])
        before = np.repeat(np.concatenate(([0], bad))[np.cumsum(counts) - counts], counts)
        in_prefix = bad == before  # no unit outside the common case so far in its key
        sel = order[in_prefix]  # the composed pairs, by key
        tail = np.sort(order[~in_prefix])  # the rest, in arrival order
        last_pair = np.zeros(n_keys, dtype=np.int64)
        np.maximum.at(last_pair, ps_a, np.arange(ps_a.shape[0]))
        v0 = self.version
        if sel.shape[0]:
            slot = ps_a[sel]
            g = pg_a[sel]
            nn = n_g[g]
            taken = np.bincount(slot, minlength=n_keys)
            begin = np.cumsum(taken) - taken
            live = np.flatnonzero(taken)
            ends = np.cumsum(nn)
            n_key = np.add.reduceat(nn, begin[live])  # rows composed per key (keys with any)
            total = np.zeros(n_keys, dtype=np.int64)
            total[live] = n_key
            base = np.zeros(n_keys, dtype=np.int64)
            base[live] = (ends - nn)[begin[live]]
            after = total[slot] - (ends - base[slot])  # rows of the key's later composed units
            w = self.decay ** after.astype(np.float64)
            r = np.asarray(pr)[sel]
            rn = r * nn
            cols = [batch.display[fr[g]] * w[:, None]]
            for b in range(len(bounded)):  # the window sums (ACC_FIELDS) of each unit: n rows per metric
                rs = r * alarm_g[g, b]
                cols.append(np.stack([np.ones_like(r), nn.astype(np.float64), rn, rs, rs * rs, rn * rs, rn * rn],
                                     axis=1))
            per_key = np.add.reduceat(np.concatenate(cols, axis=1), begin[live], axis=0)
            decays = self.decay ** n_key.astype(np.float64)
            last_of = sel[np.cumsum(taken)[live] - 1]  # each key's last composed pair
            width = len(ACC_FIELDS)
            units_x = r[:, None] * alarm_g[g] / self.max_request_rows  # per composed unit and bounded metric: r x u
            for u, row, d, rows, c, lp in zip(live.tolist(), per_key.tolist(), decays.tolist(), n_key.tolist(),
                                              taken[live].tolist(), last_of.tolist()):
                s = slices[keys_at[u]]
                if not idle[u]:
                    self._compose_cusums(s, units_x[begin[u]:begin[u] + c])
                gi = pg[lp]
                s.version = v0 + gi + 1
                s.rows += rows
                s.requests += c
                s.last_request = requests[flat_req[gi]].request_index
                s.sw = d * s.sw + row[0]
                s.sww = d * s.sww + row[1]
                swm, swx, ninf = s.swm, s.swx, s.ninf
                for m, a, x in zip(metrics, row[2:2 + k], row[2 + k:2 + 2 * k]):
                    swm[m] = d * swm[m] + a
                    swx[m] = d * swx[m] + x
                for m in metrics:
                    if ninf[m]:
                        ninf[m] *= d
                at = 2 + 2 * k
                streams = s.streams
                for m in bounded:
                    acc = streams[m].acc
                    acc[:] = map(operator.add, acc, row[at:at + width])
                    at += width
        tail_l = tail.tolist()
        t0 = 0
        while t0 < len(tail_l):  # a group's tail pairs are adjacent in arrival order: one `_apply` for them
            gi = pg[tail_l[t0]]
            end = t0 + 1
            while end < len(tail_l) and pg[tail_l[end]] == gi:
                end += 1
            run = tail_l[t0:end]
            i = flat_req[gi]
            self._apply([keys_at[ps[t]] for t in run], batch.prepared(flat_row[gi]), [pr[t] for t in run],
                        requests[i].request_index, now, evs[i], version=v0 + gi + 1)
            t0 = end
        self.version = v0 + len(flat_row)
        for u in np.argsort(last_pair, kind="stable").tolist():  # the slice order one update per group leaves
            key = keys_at[u]
            if key in slices:
                slices.move_to_end(key)
        return evs

    def _compose_cusums(self, s: SliceState, units_x: np.ndarray) -> None:
        """The alarm CUSUMs of a calm slice (no alert, no CUSUM at the alarm level) after k more units, all on the
        good side, as k `_step`s in order leave them (`apply_batch`; before its window sums and counts move).

        Each unit's log factors log(1 + lam_j r u) are <= 0 (u <= 0), so CUSUM j only falls: after the k units it
        is max(0, S_j + the factors' sum), and none can fire. A stream whose CUSUMs are all 0 takes the idle path
        (`_apply`: nothing moves); one with some CUSUM above 0 takes `Cusum.update` until every CUSUM has reached
        0: each CUSUM at 0 then has its start one past the last such unit, and the walk holds those units' factors.
        A unit with u = 0 moves nothing (`Cusum.update`).

        Args:
            s: the slice (its `requests`: the units before these).
            units_x: (k, bounded metrics) float64, r x u of each unit and metric of `RowReducer.bounded`, <= 0.
        """
        base = s.requests
        for b, m in enumerate(self.reducer.bounded):
            cusum = s.streams[m].alarm
            s0 = cusum.s
            if not any(s0):
                continue
            x = units_x[:, b]
            moved = np.flatnonzero(x)
            if not moved.shape[0]:
                continue
            lam = np.asarray(self.bets[m][0].lambdas)
            walked = np.cumsum(np.log1p(x[moved, None] * lam[None, :]), axis=0)  # (moved units, N_BETS)
            level = walked + np.asarray(s0)[None, :]
            zero = (level <= 0.0).all(axis=1)
            last = int(np.argmax(zero)) if zero.any() else moved.shape[0] - 1  # the last unit taking `update`
            row = base + int(moved[last]) + 1  # that unit's number in the slice
            end = np.maximum(level[-1], 0.0).tolist()
            cusum.walk = [w + inc for w, inc in zip(cusum.walk, walked[last].tolist())]
            for j, v in enumerate(end):
                if v <= 0.0:
                    cusum.s[j] = 0.0
                    cusum.start[j] = row + 1
                    cusum.start_request[j] = None
                else:
                    cusum.s[j] = v
        s.peak = max((max(st.alarm.s) for st in s.streams.values()), default=0.0)

    def _apply(self, keys: Sequence[str], prepared: Prepared, ratios: Sequence[float] | None,
               request_index: int | None, now: datetime | None, ev: Evaluation, version: int | None = None) -> None:
        """Add one prepared request (`RowReducer.prepare`) to each of its slices' counts, display sums and detectors
        (`version`: the update's number when the caller numbers it, `apply_batch`; else the next one)."""
        n, sw_add, sww_add, gm, gx, ginf, excess = prepared
        metrics = self.metrics
        dn = self.decay ** n
        units = -(-n // self.max_request_rows)
        if version is None:
            self.version += 1
            version = self.version
        for i, k in enumerate(keys):
            s = self.state(k)
            s.version = version
            s.rows += n
            base = s.requests
            s.requests += units
            if units > 1:
                s.oversize += 1
            s.last_request = request_index
            s.sw = dn * s.sw + sw_add
            s.sww = dn * s.sww + sww_add
            swm, swx, ninf = s.swm, s.swx, s.ninf
            for m, a, b in zip(metrics, gm, gx):
                swm[m] = dn * swm[m] + a
                swx[m] = dn * swx[m] + b
            if ginf is not None:
                for m, c in zip(metrics, ginf):
                    ninf[m] = dn * ninf[m] + c
            else:
                for m in metrics:
                    if ninf[m]:
                        ninf[m] *= dn
            r = ratios[i] if ratios is not None else 1.0
            streams = s.streams
            moved = False
            for m, au, ru in excess:
                stream = streams.get(m)
                if stream is None:
                    continue
                if units == 1 and au[0][1] <= 0.0 and stream.rec_walk is None and not stream.active \
                        and not any(stream.alarm.s):
                    # the common case, inlined: one unit on the good side of an idle CUSUM leaves every CUSUM at
                    # zero (Cusum.update) and moves only the window sums (and the unclipped walk, which is kept
                    # for export: with export_walks, rec_walk is set and this path is not taken)
                    add_sums(stream.acc, r, au[0][0], au[0][1])
                    continue
                moved = True
                self._step(k, m, s, stream, au, ru, r, base, request_index, now, ev)
            if moved:  # the fast path leaves every CUSUM where it was, and so the peak
                peak = 0.0
                for st in streams.values():
                    top = max(st.alarm.s)
                    if top > peak:
                        peak = top
                s.peak = peak

    def _step(self, key: str, metric: str, s: SliceState, stream: Stream, au: list[tuple[int, float]],
              ru: list[tuple[int, float]] | None, r: float, base: int, request_index: int | None,
              now: datetime | None, ev: Evaluation) -> None:
        """Add one request's units of one metric to a stream: `base` is the slice's unit count before them."""
        alarm_bet, rec_bet = self.bets[metric]
        scale = 1.0 / self.max_request_rows
        acc = stream.acc
        for k, (n, total) in enumerate(au):
            sample = base + k + 1
            u = total * scale
            ry = ru[k][1] * scale if ru is not None and rec_bet is not None else None
            if stream.rec_walk is not None and ry is not None:
                add_walk(stream.rec_walk, rec_bet, ry, r)  # type: ignore[arg-type]
            stream.alarm.update(alarm_bet, u, r, sample, request_index, acc)  # active: keeps the walk current
            add_sums(acc, r, n, total)
            if stream.active:
                if stream.recovery is not None and ry is not None:
                    stream.recovery.update(rec_bet, ry, r, sample, request_index)  # type: ignore[arg-type]
                    if stream.recovery.crossed(self.h):
                        self._clear(stream, sample, now, ev)
            elif self.alerting and s.rows >= self.min_support and stream.alarm.crossed(self.h):
                self._fire(key, metric, s, stream, request_index, now, ev, sample)

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
              now: datetime | None, ev: Evaluation, sample: int | None = None) -> None:
        b = self.bounds[metric]
        c = stream.alarm
        j = c.winner()
        sample = s.requests if sample is None else sample
        mark = c.mark[j]
        reason = None
        if not stream.sums_ok or mark is None:
            value = lo = hi = math.nan
            w: Sequence[float] = (0.0,) * len(ACC_FIELDS)
            reason = ("no row sums for the window: merged evidence came without them (a replica that does not "
                      "export `sums`); the detector's evidence is complete, only the estimate is missing")
        else:
            w = [a - m for a, m in zip(stream.acc, mark)]
            value, lo, hi = window_estimate(w, b)
            passing = value >= b.value if b.higher_is_better else value <= b.value
            if math.isnan(value):
                reason = "the estimated window has no rows"
            elif passing:  # not expected: a positive CUSUM has a positive weighted excess sum (log1p(x) <= x)
                reason = ("the window's weighted mean is on the passing side although its bets won: rounding at "
                          "the threshold")
        rec = AlertRecord(model=self.model, slice=key, metric=metric, value=value, threshold=b.value,
                          direction="min" if b.higher_is_better else "max", detector=DETECTOR,
                          statistic=c.statistic(), alarm_threshold=self.h,
                          change_point_request_index=c.start_request[j], change_point_sample=c.start[j],
                          samples_since_change=sample - c.start[j] + 1, samples_seen=sample,
                          effective_samples=s.n_eff, requests_seen=int(self.requests_seen.get(key, 0)),
                          method=self.method, alpha=self.alpha, horizon=self.horizon,
                          fired_at=(now or datetime.now(timezone.utc)).isoformat(), request_index=request_index,
                          threshold_source=b.source, source=self.source, rows_seen=s.rows,
                          clears="on_recovery" if self.bets[metric][1] is not None else "never",
                          value_ci_low=lo, value_ci_high=hi, value_ci_method=CI_METHOD if reason is None else "",
                          window_rows=int(round(w[1])), window_requests=int(round(w[0])),
                          recent_mean=s.mean(metric), reason=reason, max_request_rows=self.max_request_rows)
        stream.active = True
        self.alerting_keys.add(key)
        stream.alerts += 1
        stream.record = rec
        stream.recovery = Cusum() if self.bets[metric][1] is not None else None
        c.reset(sample)
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
              requests: int | None = None, now: datetime | None = None,
              sums: Mapping[str, Sequence[float]] | None = None) -> Evaluation:
        """Add a replica's evidence for one slice: `requests` new sampled requests (`rows` rows) and, per metric,
        the summed log factors per bet on the alarm and the recovery side (monitoring/combine.py). The CUSUMs clip
        at zero between merges only.

        Args:
            key: slice key.
            walks: {metric: (alarm increments (N_BETS,), recovery increments (N_BETS,) or empty)}.
            rows: rows the increments cover.
            requests: evidence units (sampled requests) the increments cover (None: as many as rows).
            now: time stamp for alert records.
            sums: {metric: increments (7,) of the replica's window sums (`evidence` "sums", ACC_FIELDS)} over the
                same units, for the alert's value; a metric without them leaves later alerts of that stream with
                no value (`reason` says so), its detection unchanged.

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
            inc = sums.get(metric) if sums is not None else None
            stream.alarm.add_batch(alarm, s.requests, stream.acc)
            if inc is not None and len(inc) == len(ACC_FIELDS):
                for i, v in enumerate(inc):
                    stream.acc[i] += float(v)
            else:
                stream.sums_ok = False
            if stream.active:
                if stream.recovery is not None and len(recovery):
                    stream.recovery.add_batch(recovery, s.requests)
                    if stream.recovery.crossed(self.h):
                        self._clear(stream, s.requests, now, ev)
                continue
            if self.alerting and s.rows >= self.min_support and stream.alarm.crossed(self.h):
                self._fire(key, metric, s, stream, None, now, ev)
        s.peak = max((max(st.alarm.s) for st in s.streams.values()), default=0.0)
        return ev

    def evidence(self, since: int = 0) -> dict[str, Any]:
        """The walks of every slice updated after version `since` (what a combiner merges; needs export_walks).

        Returns:
            {"version": the current version (the next cursor), "slices": {key: {"incarnation", "rows", "requests",
            "metrics": {metric: {"alarm": [N_BETS walks], "recovery": [N_BETS walks, or [] when the metric has no
            recovery test], "sums": [the stream's cumulative window sums, ACC_FIELDS order: the combiner merges
            their increments for the alert's value]}}}}}.
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
                                                     and self.bets[m][1] is not None else []),
                                        "sums": list(st.acc)}
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
        return {"samples_total": s.rows, "sampled_requests": s.requests, "oversize_requests": s.oversize,
                "reference_failures": s.reference_failures, "effective_samples": _json_float(s.n_eff),
                "weight_sum": _json_float(s.sw), "evidence": _json_float(s.evidence(self.h)), "metrics": ms}

    def slice_summary(self, keys: Iterable[str] | None = None) -> dict[str, Any]:
        """{slice key: slice_entry} for `keys` (default: every tracked slice, sorted)."""
        return {k: self.slice_entry(k) for k in (sorted(self.slices) if keys is None else keys)}
