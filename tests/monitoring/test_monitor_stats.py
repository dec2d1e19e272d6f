"""Unit tests of the monitor's sampler, per-slice statistics, alert records and configuration."""

import math

import numpy as np
import pytest

from tailguard.core.errors import SpecError
from tailguard.core.spec import parse_spec
from tailguard.monitoring import testing as T
from tailguard.monitoring.config import Bound, clean_label, resolve_config
from tailguard.monitoring.cusum import alarm_threshold, bettings, sprt_expected_samples
from tailguard.monitoring.detector import SliceStatistics
from tailguard.monitoring.sampler import LongTailSampler

TOP1 = {"top1_agree": Bound("top1_agree", 0.97, True, "min")}


# ------------------------------------------------------------------------------------------------ sampler
def test_sampler_rate_matches_base_rate_when_no_slice_is_rare():
    s = LongTailSampler(0.1, rare_slice_frequency=0.05, seed=0)
    n = sum(s.decide(["all", f"d={i % 2}"]).sampled for i in range(20000))
    assert abs(n / 20000 - 0.1) < 0.01


def test_sampler_oversamples_rare_slice_with_inverse_weights_when_slice_is_rare():
    s = LongTailSampler(0.05, rare_slice_frequency=0.05, max_oversample=20, seed=0)
    rng = np.random.default_rng(12345)  # not the sampler's seed: equal streams would correlate the draws
    rare_sampled, rare_seen, wsum = 0, 0, 0.0
    for _ in range(30000):
        rare = rng.random() < 0.01
        d = s.decide(["all", "dom=legal" if rare else "dom=web"])
        if rare:
            rare_seen += 1
            rare_sampled += d.sampled
            wsum += d.weight * d.sampled
    assert rare_sampled / rare_seen > 0.2  # ~0.05 * 5 = 0.25, far above the base rate
    # Horvitz-Thompson: sum of weights of sampled rare rows estimates the number of rare rows
    assert abs(wsum - rare_seen) / rare_seen < 0.2


def test_sampler_decisions_equal_when_seeds_equal():
    keys = [["all", f"d={i % 7}"] for i in range(2000)]
    s1, s2, s3 = LongTailSampler(0.1, seed=3), LongTailSampler(0.1, seed=3), LongTailSampler(0.1, seed=4)
    a = [s1.decide(k).sampled for k in keys]
    assert a == [s2.decide(k).sampled for k in keys]
    assert a != [s3.decide(k).sampled for k in keys]


def test_sampler_rejects_rate_when_outside_unit_interval():
    with pytest.raises(ValueError):
        LongTailSampler(0.0)


# ---------------------------------------------------------------------------------------- the detector
def _stats(**kw):
    # one-row requests: the declared bound M on a request's rows is 1 (full power per row, detector.py)
    args = dict(streams_per_request=2, alpha=0.01, horizon=10_000, window_size=500, min_support=30,
                max_request_rows=1)
    args.update(kw)
    return SliceStatistics("m", ["top1_agree", "kl_divergence"], TOP1, **args)


def _feed(st, keys, agree_p, n, rng, start=0, ratios=None):
    fired = []
    for i in range(n):
        ev = st.update(keys, {"top1_agree": float(rng.random() < agree_p), "kl_divergence": 0.001}, 1.0, ratios,
                       request_index=start + i)
        fired += ev.fired
    return fired


def test_alarm_threshold_is_log_of_horizon_times_streams_over_alpha_when_computed():
    st = _stats()
    assert st.h == pytest.approx(math.log(10_000 * 2 * 1 / 0.01))
    assert alarm_threshold(0.01, 10_000, 2) == st.h


def test_bets_stay_admissible_when_excess_reaches_the_metric_range_end():
    # 1 + lam * y must stay > 0 for the worst good-side excess: y = threshold - 1 for agreement
    alarm, recovery = bettings(Bound("top1_agree", 0.97, True, "min"))
    assert all(1 + lam * (0.97 - 1.0) > 0 for lam in alarm.lambdas)
    assert all(1 + lam * -(0.97 - 0.0) > 0 for lam in recovery.lambdas)
    alarm_kl, recovery_kl = bettings(Bound("kl_divergence", 0.05, False, "max"))
    assert all(1 + lam * (0.0 - 0.05) > 0 for lam in alarm_kl.lambdas)  # KL >= 0 bounds the good side
    assert recovery_kl is None  # unbounded bad side, no truncate_at: no evidence-based clearing
    _, recovery_cut = bettings(Bound("kl_divergence", 0.05, False, "max", truncate_at=0.5))
    assert recovery_cut.span == pytest.approx(0.45)  # the declared truncation is the bad end


def test_bernoulli_bet_equals_likelihood_ratio_when_metric_is_binary():
    # lam = (q1/q0 - 1) / threshold makes 1 + lam * y Page's Bernoulli CUSUM likelihood ratio
    t, q1 = 0.97, 0.06
    q0, lam = 1 - t, (0.06 / 0.03 - 1) / 0.97
    assert 1 + lam * (t - 0.0) == pytest.approx(q1 / q0)
    assert 1 + lam * (t - 1.0) == pytest.approx((1 - q1) / (1 - q0))


def test_statistics_fire_alert_with_change_point_when_slice_agreement_drops():
    st, rng = _stats(), np.random.default_rng(0)
    assert _feed(st, ["all", "dom=legal"], 1.0, 300, rng) == []
    fired = _feed(st, ["all", "dom=legal"], 0.80, 400, rng, start=300)
    assert fired, "a drop to 0.80 against a 0.97 threshold must alert"
    rec = fired[0]
    assert rec.metric == "top1_agree" and rec.threshold == 0.97 and rec.direction == "min"
    assert rec.detector == "betting_cusum" and rec.statistic >= rec.alarm_threshold == pytest.approx(st.h)
    assert 280 <= rec.change_point_request_index <= 330  # estimated change point near the true one (300)
    assert rec.samples_since_change == rec.samples_seen - rec.change_point_sample + 1 > 0
    assert rec.request_index >= 300 and rec.fired_at and rec.value < 0.97
    assert st.slices[rec.slice].streams["top1_agree"].active


def test_statistics_never_alert_when_noise_floor_rows_agree_perfectly():
    st, rng = _stats(), np.random.default_rng(1)
    fired = _feed(st, ["all", "dom=a"], 1.0, 3000, rng)
    assert fired == [] and st.active_alerts() == []
    assert st.slices["dom=a"].streams["top1_agree"].alarm.statistic() == 0.0


def test_statistics_do_not_alert_when_rows_below_min_support():
    st, rng = _stats(min_support=100), np.random.default_rng(2)
    fired = _feed(st, ["all", "dom=x"], 0.0, 99, rng)  # every row disagrees, but 99 < min_support
    assert fired == []
    assert st.slice_summary()["dom=x"]["metrics"]["top1_agree"]["status"] == "insufficient_data"
    assert _feed(st, ["all", "dom=x"], 0.0, 1, rng)  # the 100th row may alert


def test_statistics_clear_alert_when_slice_recovers():
    st, rng = _stats(), np.random.default_rng(3)
    assert _feed(st, ["all"], 0.5, 200, rng)
    cleared = []
    for i in range(5000):
        cleared += st.update(["all"], {"top1_agree": 1.0, "kl_divergence": 0.0}, 1.0, request_index=i).cleared
        if cleared:
            break
    assert cleared and cleared[0].cleared_at is not None
    assert not st.slices["all"].streams["top1_agree"].active and st.active_alerts() == []


def _null_alarm_fraction(threshold, n_streams, n_rows, alpha, horizon, seed, h=None):
    """Streams whose agreement sits exactly at the threshold (the hardest case of H0): fraction that alarm
    (h overrides the calibrated alarm level)."""
    st = SliceStatistics("m", ["top1_agree"], {"top1_agree": Bound("top1_agree", threshold, True, "min")},
                         streams_per_request=1, alpha=alpha, horizon=horizon, min_support=1, max_request_rows=1)
    st.h = st.h if h is None else h
    rng = np.random.default_rng(seed)
    x = (rng.random((n_streams, n_rows)) < threshold).astype(float)
    alarmed = 0
    for s in range(n_streams):
        key = f"s={s}"
        for v in x[s]:
            if st.update([key], {"top1_agree": v}, 1.0).fired:
                alarmed += 1
                break
    return alarmed / n_streams, st.h


def test_detector_false_alarm_probability_within_horizon_below_alpha_when_slices_sit_at_threshold():
    # Each stream alone: P(alarm within `horizon` rows) <= alpha at the threshold itself (Ville + SR bound).
    # alpha = 0.2 keeps h small (log(400 / 0.2) = 7.6) so that false alarms happen often enough to be counted.
    frac, h = _null_alarm_fraction(0.9, n_streams=300, n_rows=400, alpha=0.2, horizon=400, seed=5)
    # 0.27: binomial 99.9% upper bound of 300 trials at p = 0.2 (measured here: about 0.005, the bound is loose)
    assert frac <= 0.27, (frac, h)
    # the check has power: the same streams with an alarm level that ignores the horizon (h = log(1/alpha)) fail it
    wrong, _ = _null_alarm_fraction(0.9, n_streams=300, n_rows=400, alpha=0.2, horizon=400, seed=5, h=math.log(5))
    assert wrong > 0.27, wrong


def test_detector_delay_within_twice_sprt_sample_size_when_agreement_drops_to_known_value():
    # Known answer: Wald's SPRT for p0 = 0.97 vs p1 = 0.94 at the detector's per-start level e^-h, beta = 0.05.
    st = _stats(streams_per_request=1, horizon=100_000, alpha=0.01, min_support=1)
    sprt = sprt_expected_samples(0.97, 0.94, math.exp(-st.h), 0.05)["asn_h1"]
    delays = []
    for seed in range(8):
        st = _stats(streams_per_request=1, horizon=100_000, alpha=0.01, min_support=1)
        rng = np.random.default_rng(100 + seed)
        assert _feed(st, ["all"], 1.0, 500, rng) == []
        fired = _feed(st, ["all"], 0.94, int(6 * sprt), rng, start=500)
        assert fired, f"seed {seed}: no alarm within 6x the SPRT sample size"
        delays.append(fired[0].request_index - 500 + 1)
    assert np.median(delays) <= 2 * sprt, (delays, sprt)


def test_detector_tests_traffic_mean_when_rare_slice_rows_are_oversampled():
    # 1% of traffic (oversampled 20x) agrees at 0.5, the rest at 1.0: the traffic mean of `all` is 0.995 > 0.97.
    # Unweighted, `all` would see 0.92 (the oversampled mean) and alarm; weighted by pi/p it must not.
    st, rng = _stats(horizon=100_000), np.random.default_rng(6)
    fired = []
    for _ in range(40_000):
        rare = rng.random() < 0.01 * 20 / (0.01 * 20 + 0.99)  # share of sampled rows from the rare slice
        key = "dom=rare" if rare else "dom=web"
        agree = float(rng.random() < (0.5 if rare else 1.0))
        ratios = (1 / 20, 1.0) if rare else (1.0, 1.0)  # pi_all / p = base / (20 base) for a rare row
        fired += st.update(["all", key], {"top1_agree": agree, "kl_divergence": 0.0}, 1.0, ratios).fired
    assert {r.slice for r in fired} == {"dom=rare"}


def test_statistics_evict_idle_slices_and_keep_alerting_ones_when_memory_bound_reached():
    st, rng = _stats(max_tracked_slices=50), np.random.default_rng(7)
    assert _feed(st, ["all", "dom=bad"], 0.0, 60, rng)  # alerting
    for i in range(500):
        st.update(["all", f"flood={i}"], {"top1_agree": 1.0, "kl_divergence": 0.0}, 1.0)
    assert len(st.slices) == 50 and st.evicted == 500 + 2 - 50
    assert "dom=bad" in st.slices and "all" in st.slices


def test_exported_slices_are_all_alerting_and_k_worst_when_many_slices_tracked():
    st, rng = _stats(), np.random.default_rng(8)
    _feed(st, ["all", "dom=bad"], 0.0, 60, rng)
    for j in range(200):
        _feed(st, [f"flood={j}"], 0.7 if j == 7 else 1.0, 40, rng)
    out = st.exported(5)
    alerting = {a.slice for a in st.active_alerts()} - {"all"}
    assert "dom=bad" in alerting and out[0] == "all" and set(out[1:1 + len(alerting)]) == alerting
    assert len(out) == len(set(out)) == 1 + len(alerting) + 5  # bounded: all + alerting + the 5 worst
    assert "flood=7" in out  # the one with evidence against it is exported (alerting or among the worst)


def test_sprt_expected_samples_match_wald_formula_when_computed():
    r = sprt_expected_samples(0.99, 0.94, 0.01, 0.05)
    a, b = math.log(0.95 / 0.01), math.log(0.05 / 0.99)
    kl = 0.94 * math.log(0.94 / 0.99) + 0.06 * math.log(0.06 / 0.01)
    assert r["asn_h1"] == pytest.approx((0.95 * a + 0.05 * b) / kl)
    assert r["asn_h1"] < r["fixed_n"]


# ------------------------------------------------------------------------------------------------ config
def test_sampler_evicts_least_recent_keys_and_counts_them_when_key_bound_reached():
    s = LongTailSampler(0.1, seed=0, max_keys=10)
    for i in range(100):
        s.decide(["all", f"id={i}"])
    assert len(s.counts) == 10 and s.evicted == 91  # "all" stays: it is seen by every request
    assert s.seen("all") == 100 and s.seen("id=0") == 0 and s.seen("id=99") == 1


def test_sampler_ratios_are_own_rate_over_request_rate_when_request_is_sampled():
    s = LongTailSampler(0.1, rare_slice_frequency=0.05, max_oversample=20, seed=0)
    for _ in range(1000):
        s.decide(["all", "d=common"])
    d = next(d for d in (s.decide(["all", "d=common", "x=rare"]) for _ in range(200)) if d.sampled)
    assert d.probability > 0.1 and d.ratios[2] == pytest.approx(1.0)
    assert d.ratios[0] == pytest.approx(0.1 / d.probability) and d.ratios[1] == pytest.approx(0.1 / d.probability)


def test_clean_label_replaces_surrogates_and_cuts_long_values_when_unexportable():
    assert clean_label("noun.plant") == ("noun.plant", False)
    text, changed = clean_label("a\ud800b")
    assert changed and text.encode("utf-8") and "\ud800" not in text
    text, changed = clean_label("x" * 5000)
    assert changed and len(text) == 64 and text.endswith("~")


def test_config_adds_pair_keys_when_slice_pairs_on():
    spec = parse_spec(T.spec_dict({"sample_rate": 0.1, "slice_columns": ["domain", "ink"], "slice_pairs": True}))
    cfg = resolve_config(spec)
    keys, cut = cfg.slice_keys({"domain": "legal", "ink": "low"})
    assert keys == ["all", "domain=legal", "ink=low", "domain=legal&ink=low"] and cut == 0
    assert cfg.keys_per_request == 4


def test_config_reports_field_path_when_slice_pair_names_unknown_slice():
    spec = parse_spec(T.spec_dict({"sample_rate": 0.1, "slice_columns": ["domain"], "slice_pairs": [["domain", "x"]]}))
    with pytest.raises(SpecError) as e:
        resolve_config(spec)
    assert {err.loc for err in e.value.errors} == {"monitoring.slice_pairs.0"}


def test_config_bins_declared_slice_when_slice_has_bins():
    spec = parse_spec(T.spec_dict({"sample_rate": 0.1, "slice_columns": ["len", "domain"]},
                                  slices=[{"name": "len", "column": "n_tokens", "bins": [0, 16, 64]}]))
    cfg = resolve_config(spec)
    assert cfg.slice_keys({"n_tokens": 20, "domain": "x"})[0] == ["all", "len=[16,64)", "domain=x"]
    assert cfg.slice_keys({"n_tokens": 99})[0] == ["all", "len=out_of_range", "domain=missing"]


def test_spec_requires_sample_rate_when_monitoring_given():
    with pytest.raises(SpecError) as e:
        parse_spec(T.spec_dict({"window_size": 100}))
    assert any(err.loc == "monitoring.sample_rate" for err in e.value.errors)


def test_config_reports_every_error_when_metrics_do_not_suit_task():
    # `spec check` (parse_spec) reports them now; resolve_config still does for a spec built without the
    # cross-field rules (tests/core/test_metric_catalogue.py)
    doc = T.spec_dict({"sample_rate": 0.1, "metrics": ["top1_agree", "cosine_similarity"],
                       "thresholds": {"top1_agree": {"max": 0.5}}})
    with pytest.raises(SpecError) as e:
        parse_spec(doc)
    locs = {err.loc for err in e.value.errors}
    assert locs == {"monitoring.metrics.1", "monitoring.thresholds.top1_agree.max"}


def test_config_relative_threshold_subtracts_drop_when_higher_is_better():
    spec = parse_spec(T.spec_dict({"sample_rate": 0.1, "thresholds": {
        "top1_agree": {"baseline": 0.99, "max_drop": 0.02}}}))
    b = resolve_config(spec).bounds["top1_agree"]
    assert b.value == pytest.approx(0.97) and b.higher_is_better and b.source == "baseline-max_drop"
