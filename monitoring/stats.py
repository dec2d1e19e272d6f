"""Per-slice sliding-window statistics, one-sided tests against thresholds, multiple-testing control and alerts.

For every slice key and tracked per-row metric, a window holds the last `window_size` sampled rows with their
sampling weights w = 1/p (monitoring/sampler.py). From it:

    mean  = sum(w x) / sum(w)                                (Hajek estimator of the slice's traffic mean)
    n_eff = (sum w)^2 / sum(w^2)                             (Kish's effective sample size)

A (slice, metric) pair with a threshold (monitoring/config.py `Bound`) is tested once n_eff >= min_support:

* 0/1 metrics (top1_agree), H0: agreement >= threshold. The exact one-sided binomial p-value
  P[Bin(n_eff, threshold) <= k] with k = mean * n_eff, written with the regularized incomplete beta so it
  holds for the non-integer n_eff of weighted samples (Korn & Graubard 1998, "Confidence intervals for
  proportions with small expected number of positive counts estimated from survey data", Survey Methodology
  24:193). Rejecting H0 at level a is the same as the one-sided Clopper-Pearson (1934, Biometrika 26:404)
  upper bound at 1-a lying below the threshold; that bound is reported.
* continuous metrics (KL, cosine, abs/rel error), H0: mean on the good side of the threshold. One-sided
  Student t test with n_eff - 1 degrees of freedom on the weighted mean and variance; the one-sided t bound is
  reported. A window holding +inf (a non-finite candidate row, scored worst-case by parity) has mean +inf and
  p-value 0 for lower-is-better metrics.

Across all (slice, metric) pairs with a threshold, each evaluation controls false alarms with
Benjamini-Hochberg (1995, JRSS-B 57:289; FDR <= alpha, valid under positive dependence, Benjamini & Yekutieli
2001) or Bonferroni (family-wise error <= alpha, over a fixed family of (max_slices + 1) x metrics pairs so
that new slices do not loosen it). An alert fires when its pair is rejected and clears (hysteresis) when its
p-value rises above alpha * clear_factor. Re-testing a sliding window after every row is a sequence of looks:
alpha is a per-evaluation level, not a bound over the whole stream; the min_support, the hysteresis and the
window keep repeated looks from firing on noise (docs/monitor.md shows the measured false-alarm rate), and a
benchmark compares the samples needed with Wald's SPRT optimum (`sprt_expected_samples`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any, Iterable, Mapping

import numpy as np
from scipy import special, stats

from tailguard.monitoring.config import BINARY_METRICS, Bound

RECOMPUTE_EVERY = 4096  # rebuild running sums from the ring buffer this often (float drift of add/subtract)


@dataclass
class AlertRecord:
    """One alert, as written to alerts.json and served at /v1/alerts.

    Attributes:
        model: model name (metric label).
        slice: slice key, e.g. "domain=legal".
        metric: per-row metric, e.g. "top1_agree".
        value: the window's weighted mean when it fired.
        threshold: the bound it was tested against.
        direction: "min" (bad when below) or "max" (bad when above).
        bound: the one-sided confidence bound at the per-test level the correction used (`bound_level`); it lies on
            the bad side of the threshold.
        p_value: the test's p-value.
        samples_seen: rows in the slice's window (the support).
        effective_samples: Kish effective sample size of the window.
        slice_samples_total: rows of this slice sampled since start.
        method: test and correction, e.g. "clopper_pearson+benjamini_hochberg".
        alpha: the configured false-alarm level.
        fired_at: ISO-8601 UTC time it fired.
        request_index: sequence number of the request that completed the evidence (replay: row index).
        cleared_at: ISO-8601 UTC time it cleared, or None while active.
        threshold_source: "min", "max" or "baseline-max_drop".
    """

    model: str
    slice: str
    metric: str
    value: float
    threshold: float
    direction: str
    bound: float
    p_value: float
    samples_seen: int
    effective_samples: float
    slice_samples_total: int
    method: str
    alpha: float
    fired_at: str
    request_index: int | None
    cleared_at: str | None = None
    threshold_source: str = ""
    bound_level: float = math.nan

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


class SliceWindow:
    """Ring buffer of the last `size` rows of one slice: per-metric values and the rows' weights.

    Args:
        metrics: tracked per-row metric names.
        size: window length (rows).
    """

    def __init__(self, metrics: Iterable[str], size: int) -> None:
        self.metrics = tuple(metrics)
        self.size = size
        self.values = np.zeros((len(self.metrics), size), dtype=np.float64)
        self.weights = np.zeros(size, dtype=np.float64)
        self.pos = 0
        self.n = 0
        self.total = 0
        m = len(self.metrics)
        self.sw = 0.0
        self.sww = 0.0
        self.swx = np.zeros(m)
        self.swxx = np.zeros(m)
        self.ninf = np.zeros(m, dtype=np.int64)  # +-inf values in the window (kept out of the sums)
        self._since_rebuild = 0

    def add(self, values: np.ndarray, weight: float) -> None:
        """Append one row.

        Args:
            values: (metrics,) float64 per-row metric values in `metrics` order (NaN not allowed; +-inf allowed).
            weight: its sampling weight 1/p (> 0).
        """
        i = self.pos
        if self.n == self.size:  # evict the oldest row
            self._remove(self.values[:, i], self.weights[i])
        else:
            self.n += 1
        self.values[:, i] = values
        self.weights[i] = weight
        self._insert(values, weight)
        self.pos = (i + 1) % self.size
        self.total += 1
        self._since_rebuild += 1
        if self._since_rebuild >= RECOMPUTE_EVERY:
            self._rebuild()

    def _insert(self, x: np.ndarray, w: float) -> None:
        fin = np.isfinite(x)
        xf = np.where(fin, x, 0.0)
        self.sw += w
        self.sww += w * w
        self.swx += w * xf
        self.swxx += w * xf * xf
        self.ninf += ~fin

    def _remove(self, x: np.ndarray, w: float) -> None:
        fin = np.isfinite(x)
        xf = np.where(fin, x, 0.0)
        self.sw -= w
        self.sww -= w * w
        self.swx -= w * xf
        self.swxx -= w * xf * xf
        self.ninf -= ~fin

    def _rebuild(self) -> None:
        w = self.weights[: self.n] if self.n < self.size else self.weights
        v = self.values[:, : self.n] if self.n < self.size else self.values
        fin = np.isfinite(v)
        vf = np.where(fin, v, 0.0)
        self.sw, self.sww = float(w.sum()), float((w * w).sum())
        self.swx, self.swxx = (vf * w).sum(axis=1), (vf * vf * w).sum(axis=1)
        self.ninf = (~fin).sum(axis=1)
        self._since_rebuild = 0

    @property
    def n_eff(self) -> float:
        """Kish effective sample size (sum w)^2 / sum w^2 (= n for equal weights)."""
        return self.sw * self.sw / self.sww if self.sww > 0 else 0.0

    def mean(self, j: int) -> float:
        """Weighted mean of metric j (+-inf when the window holds an infinite value; NaN when empty)."""
        if self.n == 0:
            return math.nan
        if self.ninf[j]:
            v = self.values[j, : self.n] if self.n < self.size else self.values[j]
            inf = v[~np.isfinite(v)]
            return float(inf[0]) if np.all(inf == inf[0]) else math.nan
        return float(self.swx[j] / self.sw)

    def variance(self, j: int) -> float:
        """Weighted variance of metric j with the n_eff/(n_eff-1) small-sample correction."""
        if self.n < 2 or self.sw <= 0:
            return math.nan
        m = self.swx[j] / self.sw
        var = max(self.swxx[j] / self.sw - m * m, 0.0)
        ne = self.n_eff
        return var * ne / (ne - 1) if ne > 1 else math.nan


def binomial_p_value(mean: float, n_eff: float, threshold: float, higher_is_better: bool) -> float:
    """One-sided exact binomial p-value for a 0/1 metric at real-valued n (Korn & Graubard 1998).

    Args:
        mean: observed proportion in [0, 1].
        n_eff: (effective) number of trials, > 0.
        threshold: H0 proportion boundary in (0, 1).
        higher_is_better: True: H0 p >= threshold, p-value P[X <= k]; False: H0 p <= threshold, P[X >= k].

    Returns:
        p-value in [0, 1], with k = mean * n_eff and X ~ Bin(n_eff, threshold) via the incomplete beta.
    """
    if not higher_is_better:
        return binomial_p_value(1.0 - mean, n_eff, 1.0 - threshold, True)
    if threshold >= 1.0:
        return 0.0 if mean < 1.0 else 1.0
    if threshold <= 0.0:
        return 1.0
    k = mean * n_eff
    if k >= n_eff:
        return 1.0
    # P[X <= k] = I_{1-t}(n - k, k + 1)
    return float(special.betainc(n_eff - k, k + 1.0, 1.0 - threshold))


def clopper_pearson_bound(mean: float, n_eff: float, level: float, higher_is_better: bool) -> float:
    """One-sided Clopper-Pearson bound at confidence 1-level: the upper bound when higher is better (a low
    upper bound is evidence of a drop), else the lower bound."""
    k = mean * n_eff
    if higher_is_better:
        return 1.0 if k >= n_eff else float(stats.beta.ppf(1.0 - level, k + 1.0, n_eff - k))
    return 0.0 if k <= 0 else float(stats.beta.ppf(level, k, n_eff - k + 1.0))


def t_p_value(mean: float, var: float, n_eff: float, threshold: float, higher_is_better: bool
              ) -> tuple[float, float]:
    """One-sided Student t p-value and the standard error for H0: mean on the good side of `threshold`.

    Returns:
        (p-value, standard error). A zero variance gives p 0 (mean on the bad side) or 1.
    """
    bad_side = (mean < threshold) if higher_is_better else (mean > threshold)
    if math.isinf(mean):
        return (0.0 if bad_side else 1.0), math.inf
    if not (var > 0) or n_eff <= 1:
        return (0.0 if bad_side else 1.0), 0.0
    se = math.sqrt(var / n_eff)
    t = (mean - threshold) / se
    df = n_eff - 1.0
    p = stats.t.cdf(t, df) if higher_is_better else stats.t.sf(t, df)
    return float(p), se


def sprt_expected_samples(p0: float, p1: float, alpha: float, beta: float) -> dict[str, float]:
    """Wald's SPRT expected sample numbers for Bernoulli H0: p = p0 vs H1: p = p1 (Wald 1945, Ann. Math.
    Statist. 16:117; boundary-overshoot ignored, the usual approximation).

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


@dataclass
class PairState:
    """Test state of one (slice, metric) pair with a threshold."""

    slice: str
    metric: str
    p_value: float = 1.0
    value: float = math.nan
    tested: bool = False
    active: bool = False
    alerts: int = 0


@dataclass
class Evaluation:
    """What changed after one update: alerts fired and cleared (each an AlertRecord)."""

    fired: list[AlertRecord] = field(default_factory=list)
    cleared: list[AlertRecord] = field(default_factory=list)


class SliceStatistics:
    """Sliding windows per slice, tests per (slice, metric), false-alarm control and alert state.

    Args:
        model: model name for alert records.
        metrics: tracked per-row metrics (window columns).
        bounds: {metric: Bound} for the metrics alerted on.
        window_size: rows per slice window.
        min_support: minimum effective sample size before a pair is tested.
        alpha: false-alarm level per evaluation (FDR or FWER).
        correction: "benjamini_hochberg" or "bonferroni".
        max_slices: the slice bound (fixes the Bonferroni family size).
        clear_factor: an active alert clears when p > alpha * clear_factor.
    """

    def __init__(self, model: str, metrics: Iterable[str], bounds: Mapping[str, Bound], *, window_size: int,
                 min_support: int, alpha: float, correction: str = "benjamini_hochberg", max_slices: int = 50,
                 clear_factor: float = 10.0) -> None:
        self.model = model
        self.metrics = tuple(metrics)
        self.bounds = dict(bounds)
        self.window_size = window_size
        self.min_support = min_support
        self.alpha = alpha
        self.correction = correction
        self.clear_factor = clear_factor
        self.family_size = (max_slices + 1) * max(len(self.bounds), 1)
        self.windows: dict[str, SliceWindow] = {}
        self.pairs: dict[tuple[str, str], PairState] = {}
        self.history: list[AlertRecord] = []
        self._active_records: dict[tuple[str, str], AlertRecord] = {}
        self._midx = {m: i for i, m in enumerate(self.metrics)}

    def method(self, metric: str) -> str:
        """Name of the test used for a metric, with the correction: e.g. 'clopper_pearson+benjamini_hochberg'."""
        test = "clopper_pearson" if metric in BINARY_METRICS else "student_t"
        return f"{test}+{self.correction}"

    def update(self, keys: Iterable[str], values: Mapping[str, float], weight: float,
               request_index: int | None = None, now: datetime | None = None) -> Evaluation:
        """Add one sampled row to each of its slices' windows, re-test those slices and update alert state.

        Args:
            keys: the row's bounded slice keys (including "all").
            values: {metric: per-row value} for every tracked metric (NaN rows must be dropped before).
            weight: sampling weight 1/p.
            request_index: sequence number recorded in alerts fired by this update.
            now: time stamp for fired/cleared records (default: now, UTC).

        Returns:
            The alerts fired and cleared by this update.
        """
        x = np.array([values[m] for m in self.metrics], dtype=np.float64)
        touched = []
        for k in keys:
            w = self.windows.get(k)
            if w is None:
                w = self.windows[k] = SliceWindow(self.metrics, self.window_size)
                for m in self.bounds:
                    self.pairs[(k, m)] = PairState(k, m)
            w.add(x, weight)
            touched.append(k)
        for k in touched:
            self._test_slice(k)
        return self._decide(request_index, now)

    def _test_slice(self, key: str) -> None:
        w = self.windows[key]
        ne = w.n_eff
        for m, b in self.bounds.items():
            st = self.pairs[(key, m)]
            j = self._midx[m]
            st.value = w.mean(j)
            if ne < self.min_support or math.isnan(st.value):
                st.tested, st.p_value = False, 1.0
                continue
            st.tested = True
            if m in BINARY_METRICS:
                st.p_value = binomial_p_value(min(max(st.value, 0.0), 1.0), ne, b.value, b.higher_is_better)
            else:
                st.p_value, _ = t_p_value(st.value, w.variance(j), ne, b.value, b.higher_is_better)

    def bound(self, key: tuple[str, str], level: float) -> float:
        """One-sided confidence bound of a pair's window mean at per-test level `level` (Clopper-Pearson for 0/1
        metrics, Student t otherwise): the upper bound for higher-is-better metrics, else the lower bound."""
        st = self.pairs[key]
        w, b = self.windows[st.slice], self.bounds[st.metric]
        ne, j = w.n_eff, self._midx[st.metric]
        if not st.tested:
            return math.nan
        if st.metric in BINARY_METRICS:
            return clopper_pearson_bound(min(max(st.value, 0.0), 1.0), ne, level, b.higher_is_better)
        _, se = t_p_value(st.value, w.variance(j), ne, b.value, b.higher_is_better)
        q = stats.t.ppf(1 - level, ne - 1) if ne > 1 else math.inf
        return st.value + q * se if b.higher_is_better else st.value - q * se

    def rejected(self) -> tuple[set[tuple[str, str]], float]:
        """Pairs whose H0 (slice fine) is rejected now under the configured correction, and the per-test level
        that decided it (Bonferroni: alpha / family size; Benjamini-Hochberg: alpha * R / m for R rejections
        among m pairs; untested pairs count in m with p = 1, which is conservative)."""
        tested = [(k, s.p_value) for k, s in self.pairs.items() if s.tested]
        if self.correction == "bonferroni":
            level = self.alpha / self.family_size
            return {k for k, p in tested if p <= level}, level
        m = max(len(self.pairs), 1)
        if not tested:
            return set(), self.alpha / m
        ps = np.array([p for _, p in tested])
        order = np.argsort(ps, kind="stable")
        crit = self.alpha * np.arange(1, len(ps) + 1) / m
        ok = np.nonzero(ps[order] <= crit)[0]
        if ok.size == 0:
            return set(), self.alpha / m
        r = int(ok[-1]) + 1
        return {k for k, p in tested if p <= ps[order][r - 1]}, self.alpha * r / m

    def _decide(self, request_index: int | None, now: datetime | None) -> Evaluation:
        ev = Evaluation()
        rej, level = self.rejected()
        stamp = (now or datetime.now(timezone.utc)).isoformat()
        for key in rej:
            st = self.pairs[key]
            if st.active:
                continue
            st.active = True
            st.alerts += 1
            w = self.windows[st.slice]
            b = self.bounds[st.metric]
            rec = AlertRecord(model=self.model, slice=st.slice, metric=st.metric, value=st.value,
                              threshold=b.value, direction="min" if b.higher_is_better else "max",
                              bound=self.bound(key, level), bound_level=level,
                              p_value=st.p_value, samples_seen=w.n, effective_samples=w.n_eff,
                              slice_samples_total=w.total, method=self.method(st.metric), alpha=self.alpha,
                              fired_at=stamp, request_index=request_index, threshold_source=b.source)
            self.history.append(rec)
            self._active_records[key] = rec
            ev.fired.append(rec)
        for key in list(self._active_records):
            st = self.pairs[key]
            if key not in rej and st.p_value > self.alpha * self.clear_factor:
                st.active = False
                rec = self._active_records.pop(key)
                rec.cleared_at = stamp
                ev.cleared.append(rec)
        return ev

    def active_alerts(self) -> list[AlertRecord]:
        """Alerts currently active."""
        return list(self._active_records.values())

    def slice_summary(self) -> dict[str, Any]:
        """Per-slice statistics (slices.json): window rows, totals, n_eff and per-metric mean/test state."""
        out: dict[str, Any] = {}
        _, level = self.rejected()
        for key in sorted(self.windows):
            w = self.windows[key]
            ms: dict[str, Any] = {}
            for j, m in enumerate(self.metrics):
                entry: dict[str, Any] = {"mean": _json_float(w.mean(j))}
                if m in self.bounds:
                    st, b = self.pairs[(key, m)], self.bounds[m]
                    entry.update(threshold=b.value, direction="min" if b.higher_is_better else "max",
                                 tested=st.tested, p_value=_json_float(st.p_value),
                                 bound=_json_float(self.bound((key, m), level)), bound_level=_json_float(level),
                                 alert_active=st.active, alerts_fired=st.alerts, method=self.method(m),
                                 status=("alert" if st.active else "ok" if st.tested else "insufficient_data"))
                ms[m] = entry
            out[key] = {"window_samples": w.n, "samples_total": w.total, "effective_samples": _json_float(w.n_eff),
                        "weight_sum": _json_float(w.sw), "metrics": ms}
        return out
