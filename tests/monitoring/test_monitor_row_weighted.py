"""The detector tests the gate's quantity (issue 41): the per-row mean of a slice, rows weighted equally whatever
the size of the request that brought them, with bets on a request's row sum over the declared bound M; alert
records whose value is that quantity over the estimated post-change window. Simulations with fixed seeds drive
the real SliceStatistics; counts of alarms, no wall clock."""

import math

import numpy as np
import pytest

from tailguard.monitoring.config import Bound
from tailguard.monitoring.cusum import ACC_FIELDS, BET_FRACTIONS, bettings, request_units, window_estimate
from tailguard.monitoring.detector import SliceStatistics

AGREE = Bound("top1_agree", 0.97, True, "min")
# rows per request -> (share of requests, per-row agreement); issue 41's scenario (benchmarks/bench_monitor.py)
HONEST = {1: (0.7, 0.90), 16: (0.1, 0.98), 64: (0.2, 0.995)}  # per row 0.989 (> 0.97 + 1 pt), per request 0.927
BAD = {1: (0.9, 1.00), 16: (0.05, 0.95), 64: (0.05, 0.93)}  # per row 0.946 (< 0.97 - 2 pts), per request 0.994


def _stats(**kw):
    args = dict(streams_per_request=1, alpha=0.01, horizon=1_000_000, min_support=30, max_request_rows=64)
    args.update(kw)
    return SliceStatistics("m", ("top1_agree",), {"top1_agree": AGREE}, **args)


def _mix_stream(st, mix, n, seed, stop_at_alarm=True):
    """n requests drawn from a size mix into slice `all`; returns the fired alerts (and the request of each)."""
    rng = np.random.default_rng(seed)
    sizes = np.array(list(mix))
    size = rng.choice(sizes, size=n, p=[mix[k][0] for k in sizes])
    fired = []
    for i in range(n):
        k = int(size[i])
        ev = st.update(["all"], {"top1_agree": (rng.random(k) < mix[k][1]).astype(float)}, 1.0, request_index=i)
        fired += ev.fired
        if fired and stop_at_alarm:
            break
    return fired


def _per_row_and_per_request(mix):
    rows = sum(q * n for n, (q, _) in mix.items())
    return sum(q * n * a for n, (q, a) in mix.items()) / rows, sum(q * a for _, (q, a) in mix.items())


def test_scenarios_separate_row_weighted_and_request_weighted_means_when_defined():
    per_row, per_request = _per_row_and_per_request(HONEST)
    assert per_row >= 0.98 and per_request < 0.97  # fine by the gate, bad by request means
    per_row, per_request = _per_row_and_per_request(BAD)
    assert per_row <= 0.95 and per_request > 0.97  # failing the gate, fine by request means


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_detector_never_alarms_when_mixed_size_traffic_is_above_threshold_per_row(seed):
    # the request-weighted detector (before issue 41) alarms on this stream within ~1,200 requests (value ~0.99)
    st = _stats()
    assert _mix_stream(st, HONEST, 20_000, seed) == []
    assert st.slices["all"].requests == 20_000


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
def test_detector_alarms_when_per_row_agreement_falls_below_threshold_while_request_mean_stays_above(seed):
    st = _stats()
    fired = _mix_stream(st, BAD, 20_000, 100 + seed)
    assert fired, "a per-row agreement 2 points below the threshold must alarm"
    rec = fired[0]
    assert rec.value < rec.threshold and rec.reason is None
    assert rec.value_ci_low <= rec.value <= rec.value_ci_high
    # the request-weighted view of the same window sits above the threshold: the value is the row-weighted one
    assert rec.window_rows > rec.window_requests


def test_bet_factors_stay_positive_when_rows_are_adversarial():
    M = 64
    alarm, recovery = bettings(AGREE)
    assert len(alarm.lambdas) == len(BET_FRACTIONS) and max(alarm.lambdas) * alarm.span < 1
    assert max(BET_FRACTIONS) >= 0.95  # the best bet for 64-row requests is on the grid
    for rows in (1, 7, 64, 65, 1000):
        for good in (np.ones(rows), np.zeros(rows)):  # every row at the good end, or at the bad end
            y = 0.97 - good
            for bet in (alarm, recovery):
                units = request_units(bet, y, M)
                assert len(units) == -(-rows // M) and sum(n for n, _ in units) == rows
                for n, total in units:
                    assert n <= M
                    assert all(1 + lam * total / M > 0 for lam in bet.lambdas)
    # an unbounded metric's infinite excess is capped, its good side bounded: every walk stays finite
    kl = Bound("kl_divergence", 0.05, False, "max")
    st = SliceStatistics("m", ("kl_divergence",), {"kl_divergence": kl}, streams_per_request=1, alpha=0.01,
                         horizon=1000, min_support=1, max_request_rows=M, export_walks=True, alerting=False)
    for rows in (1, 64, 200):
        st.update(["all"], {"kl_divergence": np.zeros(rows)}, 1.0)
        st.update(["all"], {"kl_divergence": np.full(rows, np.inf)}, 1.0)
    walk = st.slices["all"].streams["kl_divergence"].alarm.walk
    assert all(math.isfinite(w) for w in walk)


def test_detector_splits_request_into_bounded_chunks_when_rows_exceed_declared_bound():
    st = _stats(max_request_rows=64)
    st.update(["all"], {"top1_agree": np.ones(150)}, 1.0)
    s = st.slices["all"]
    assert s.requests == 3 and s.oversize == 1 and s.rows == 150
    assert st.slice_entry("all")["oversize_requests"] == 1


def test_one_request_adds_at_most_one_full_bet_when_its_rows_all_disagree():
    # within-request dependence: 64 disagreeing rows add one bounded factor, never 64 row-level bets
    st = _stats()
    st.update(["all"], {"top1_agree": np.zeros(64)}, 1.0)
    alarm, _ = bettings(AGREE)
    most = max(math.log1p(lam * 0.97) for lam in alarm.lambdas)
    assert st.slices["all"].streams["top1_agree"].alarm.statistic() <= most + 1e-12 < st.h


def test_alert_value_estimates_post_change_rows_when_detector_fires():
    st, rng = _stats(max_request_rows=16), np.random.default_rng(11)
    for i in range(400):  # good 16-row requests, then 0.90 agreement
        assert not st.update(["all"], {"top1_agree": np.ones(16)}, 1.0, request_index=i).fired
    fired = []
    for i in range(400, 4000):
        fired += st.update(["all"], {"top1_agree": (rng.random(16) < 0.90).astype(float)}, 1.0,
                           request_index=i).fired
        if fired:
            break
    rec = fired[0]
    assert rec.change_point_request_index >= 395
    assert rec.value_ci_low <= rec.value <= rec.value_ci_high < 0.97  # the whole interval fails the gate here
    assert 0.80 <= rec.value <= 0.95 and rec.reason is None and rec.value_ci_method
    assert rec.window_rows == 16 * rec.window_requests
    assert rec.recent_mean > rec.value  # the display mean mixes the pre-change rows in
    d = rec.to_dict()
    assert d["value"] < d["threshold"] and d["max_request_rows"] == 16


def test_window_estimate_weights_rows_when_requests_differ_in_size():
    # units: one 1-row request at 0 (excess 0.97), one 9-row request at 1 (excess -0.03 each): row mean 0.9
    acc = [0.0] * len(ACC_FIELDS)
    for n, s in ((1, 0.97), (9, -0.27)):
        for i, v in enumerate((1, n, n, s, s * s, n * s, n * n)):
            acc[i] += v
    value, lo, hi = window_estimate(acc, AGREE)
    assert value == pytest.approx(0.9) and lo <= value <= hi <= 1.0


def test_combined_alert_value_comes_from_merged_sums_or_says_why_when_missing():
    bounds = {"top1_agree": AGREE}
    kw = dict(streams_per_request=1, alpha=0.01, horizon=1000, min_support=1, max_request_rows=16)
    rep = SliceStatistics("m", ["top1_agree"], bounds, export_walks=True, alerting=False, **kw)
    with_sums = SliceStatistics("m", ["top1_agree"], bounds, source="combined", **kw)
    without = SliceStatistics("m", ["top1_agree"], bounds, source="combined", **kw)
    rng = np.random.default_rng(3)
    last = {"walk": [0.0] * len(BET_FRACTIONS), "sums": [0.0] * len(ACC_FIELDS), "rows": 0, "requests": 0}
    fired_a, fired_b = [], []
    for _ in range(200):  # 5 requests of 16 rows at 0.85 per poll
        for _ in range(5):
            rep.update(["all"], {"top1_agree": (rng.random(16) < 0.85).astype(float)}, 1.0)
        e = rep.evidence()["slices"]["all"]
        m = e["metrics"]["top1_agree"]
        inc = [a - b for a, b in zip(m["alarm"], last["walk"])]
        sums = [a - b for a, b in zip(m["sums"], last["sums"])]
        rows, reqs = e["rows"] - last["rows"], e["requests"] - last["requests"]
        last = {"walk": m["alarm"], "sums": m["sums"], "rows": e["rows"], "requests": e["requests"]}
        fired_a += with_sums.merge("all", {"top1_agree": (inc, [])}, rows, reqs, sums={"top1_agree": sums}).fired
        fired_b += without.merge("all", {"top1_agree": (inc, [])}, rows, reqs).fired
        if fired_a and fired_b:
            break
    a, b = fired_a[0], fired_b[0]
    assert a.source == "combined" and a.value < 0.97 and a.reason is None and a.value_ci_low <= a.value
    assert math.isnan(b.value) and b.reason and b.to_dict()["value"] is None
