"""Unit tests of the monitor's sampler, per-slice statistics, alert records and configuration."""

import math

import numpy as np
import pytest
from scipy import stats as sps

from tailguard.errors import SpecError
from tailguard.monitoring import testing as T
from tailguard.monitoring.config import Bound, SliceRegistry, resolve_config
from tailguard.monitoring.sampler import LongTailSampler
from tailguard.monitoring.stats import (SliceStatistics, SliceWindow, binomial_p_value, clopper_pearson_bound,
                                        sprt_expected_samples)
from tailguard.spec import parse_spec

TOP1 = {"top1_agree": Bound("top1_agree", 0.97, True, "min")}


def _stats(**kw):
    args = dict(window_size=500, min_support=50, alpha=0.01, correction="benjamini_hochberg", max_slices=10)
    args.update(kw)
    return SliceStatistics("m", ["top1_agree", "kl_divergence"], TOP1, **args)


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


# --------------------------------------------------------------------------------------------- the tests
@pytest.mark.parametrize("n,k,t", [(100, 95, 0.97), (50, 50, 0.97), (200, 180, 0.9), (30, 25, 0.95)])
def test_binomial_p_value_equals_scipy_binom_cdf_when_n_is_integer(n, k, t):
    assert binomial_p_value(k / n, n, t, True) == pytest.approx(sps.binom.cdf(k, n, t), rel=1e-9, abs=1e-12)


def test_clopper_pearson_upper_bound_crosses_threshold_when_p_value_crosses_level():
    n, k, level = 200, 185, 0.01
    ub = clopper_pearson_bound(k / n, n, level, True)
    # H0: p >= t rejected at `level` exactly when the upper bound lies below t
    assert (binomial_p_value(k / n, n, ub + 1e-6, True) < level) and (binomial_p_value(k / n, n, ub - 1e-3, True)
                                                                         > level)


def test_window_evicts_oldest_rows_when_full():
    w = SliceWindow(["x"], 10)
    for i in range(25):
        w.add(np.array([float(i)]), 1.0)
    assert w.n == 10 and w.total == 25
    assert w.mean(0) == pytest.approx(np.mean(np.arange(15, 25)))
    assert w.n_eff == pytest.approx(10)


def test_window_mean_is_weighted_and_inf_when_row_infinite():
    w = SliceWindow(["x", "y"], 10)
    w.add(np.array([1.0, 1.0]), 1.0)
    w.add(np.array([0.0, math.inf]), 3.0)
    assert w.mean(0) == pytest.approx(0.25)
    assert w.mean(1) == math.inf
    assert w.n_eff == pytest.approx(16 / 10)


def _feed(st, keys, agree_p, n, rng, start=0):
    fired = []
    for i in range(n):
        ev = st.update(keys, {"top1_agree": float(rng.random() < agree_p), "kl_divergence": 0.001}, 1.0,
                       request_index=start + i)
        fired += ev.fired
    return fired


def test_statistics_fire_alert_with_record_fields_when_slice_agreement_drops():
    st, rng = _stats(), np.random.default_rng(0)
    assert _feed(st, ["all", "dom=legal"], 0.995, 300, rng) == []
    fired = _feed(st, ["all", "dom=legal"], 0.85, 300, rng, start=300)
    assert fired, "a 15-point drop must alert"
    rec = fired[0]
    assert rec.slice in ("dom=legal", "all") and rec.metric == "top1_agree"
    assert rec.threshold == 0.97 and rec.direction == "min" and rec.value < 0.97
    assert rec.bound < 0.97 and rec.p_value < 0.01
    assert rec.samples_seen >= 50 and rec.method == "clopper_pearson+benjamini_hochberg"
    assert rec.request_index >= 300 and rec.fired_at
    assert st.pairs[("dom=legal", "top1_agree")].active


def test_statistics_never_alert_when_noise_floor_rows_agree_perfectly():
    st, rng = _stats(), np.random.default_rng(1)
    fired = _feed(st, ["all", "dom=a"], 1.0, 3000, rng)
    assert fired == [] and st.active_alerts() == []


def test_statistics_do_not_test_when_support_below_minimum():
    st, rng = _stats(min_support=100), np.random.default_rng(2)
    fired = _feed(st, ["all", "dom=x"], 0.0, 99, rng)  # every row disagrees, but 99 < min_support
    assert fired == []
    assert st.slice_summary()["dom=x"]["metrics"]["top1_agree"]["status"] == "insufficient_data"
    assert _feed(st, ["all", "dom=x"], 0.0, 1, rng)  # the 100th row makes it testable: alert


def test_statistics_clear_alert_when_slice_recovers():
    st, rng = _stats(window_size=200), np.random.default_rng(3)
    assert _feed(st, ["all"], 0.8, 200, rng)
    for i in range(400):
        ev = st.update(["all"], {"top1_agree": 1.0, "kl_divergence": 0.0}, 1.0, request_index=i)
        if ev.cleared:
            break
    assert ev.cleared and ev.cleared[0].cleared_at is not None
    assert not st.pairs[("all", "top1_agree")].active


def test_bonferroni_needs_stronger_evidence_than_single_test_when_many_slices():
    n, k = 150, 139  # 92.7% agreement vs 97% threshold
    p = binomial_p_value(k / n, n, 0.97, True)
    st = _stats(correction="bonferroni", max_slices=50)
    assert p < 0.01 and p > 0.01 / st.family_size  # single test rejects, corrected family does not


def test_false_alarm_rate_stays_below_alpha_when_many_slices_sit_at_threshold_margin():
    # 20 slices whose true agreement is 0.98 (above the 0.97 threshold): BH across them must stay quiet
    st, rng = _stats(window_size=300, min_support=100, max_slices=30), np.random.default_rng(4)
    fired = []
    for i in range(20 * 600):
        fired += st.update(["all", f"dom={i % 20}"], {"top1_agree": float(rng.random() < 0.98),
                                                      "kl_divergence": 0.0}, 1.0).fired
    assert len(fired) == 0


def test_sprt_expected_samples_match_wald_formula_when_computed():
    r = sprt_expected_samples(0.99, 0.94, 0.01, 0.05)
    a, b = math.log(0.95 / 0.01), math.log(0.05 / 0.99)
    kl = 0.94 * math.log(0.94 / 0.99) + 0.06 * math.log(0.06 / 0.01)
    assert r["asn_h1"] == pytest.approx((0.95 * a + 0.05 * b) / kl)
    assert r["asn_h1"] < r["fixed_n"]


# ------------------------------------------------------------------------------------------------ config
def test_registry_maps_new_slices_to_other_when_bound_reached():
    reg = SliceRegistry(2)
    assert reg.bound(["all", "d=a"]) == ["all", "d=a"]
    assert reg.bound(["all", "d=b"]) == ["all", "d=b"]
    assert reg.bound(["all", "d=c"]) == ["all", "d=other"]
    assert reg.bound(["d=a"]) == ["d=a"]


def test_config_bins_declared_slice_when_slice_has_bins():
    spec = parse_spec(T.spec_dict({"sample_rate": 0.1, "slice_columns": ["len", "domain"]},
                                  slices=[{"name": "len", "column": "n_tokens", "bins": [0, 16, 64]}]))
    cfg = resolve_config(spec)
    assert cfg.slice_keys({"n_tokens": 20, "domain": "x"}) == ["all", "len=[16,64)", "domain=x"]
    assert cfg.slice_keys({"n_tokens": 99}) == ["all", "len=out_of_range", "domain=missing"]


def test_spec_requires_sample_rate_when_monitoring_given():
    with pytest.raises(SpecError) as e:
        parse_spec(T.spec_dict({"window_size": 100}))
    assert any(err.loc == "monitoring.sample_rate" for err in e.value.errors)


def test_config_reports_every_error_when_metrics_do_not_suit_task():
    spec = parse_spec(T.spec_dict({"sample_rate": 0.1, "metrics": ["top1_agree", "cosine_similarity"],
                                   "thresholds": {"top1_agree": {"max": 0.5}}}))
    with pytest.raises(SpecError) as e:
        resolve_config(spec)
    locs = {err.loc for err in e.value.errors}
    assert locs == {"monitoring.metrics.1", "monitoring.thresholds.top1_agree.max"}


def test_config_relative_threshold_subtracts_drop_when_higher_is_better():
    spec = parse_spec(T.spec_dict({"sample_rate": 0.1, "thresholds": {
        "top1_agree": {"baseline": 0.99, "max_drop": 0.02}}}))
    b = resolve_config(spec).bounds["top1_agree"]
    assert b.value == pytest.approx(0.97) and b.higher_is_better and b.source == "baseline-max_drop"
