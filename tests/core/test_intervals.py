"""Confidence bounds (components/validate/intervals.py and the tailguard.core.stats functions it uses): known values,
coverage on seeded synthetic data."""

import math

import numpy as np
import pytest
from scipy.stats import binom
from statsmodels.stats.proportion import proportion_confint

from tailguard.components.validate.intervals import metric_bound
from tailguard.core.errors import InputError
from tailguard.core.spec.analysis import BootstrapSpec
from tailguard.core.stats import bootstrap_bound, bootstrap_distribution, wilson_bound, wilson_interval
from tailguard.core.stats import newcombe_paired_bound as paired_difference_bound


# ------------------------------------------------------------------------------------------------- Wilson
def test_wilson_bound_matches_hand_computed_value_when_30_of_30():
    # z = 1.6449; centre = (1 + z^2/60) / (1 + z^2/30); half = z / (1 + z^2/30) * sqrt(z^2 / 3600)
    z = 1.6448536269514722
    centre = (1 + z * z / 60) / (1 + z * z / 30)
    half = z / (1 + z * z / 30) * math.sqrt(z * z / 3600)
    assert wilson_bound(30, 30, 0.95, "lower") == pytest.approx(centre - half, abs=1e-12)
    assert wilson_bound(30, 30, 0.95, "lower") == pytest.approx(0.91728, abs=1e-5)
    assert wilson_bound(30, 30, 0.95, "upper") == 1.0


def test_wilson_interval_matches_statsmodels_when_two_sided_and_one_sided():
    for x, n in ((5, 10), (0, 20), (97, 100), (1, 1)):
        assert wilson_interval(x, n, 0.95) == pytest.approx(proportion_confint(x, n, 0.05, method="wilson"))
        # a one-sided 95% bound is a limit of the two-sided 90% interval
        lo, hi = proportion_confint(x, n, 0.10, method="wilson")
        assert wilson_bound(x, n, 0.95, "lower") == pytest.approx(lo)
        assert wilson_bound(x, n, 0.95, "upper") == pytest.approx(hi)
    assert wilson_interval(5, 10, 0.95) == pytest.approx((0.236593, 0.763407), abs=1e-6)


def test_wilson_bound_is_nan_when_n_is_zero_and_vectorises_when_given_arrays():
    assert math.isnan(wilson_bound(0, 0, 0.95, "lower"))
    both = wilson_bound(np.array([29, 30]), 30, 0.95, "lower")
    assert both.shape == (2,) and both[0] < both[1]


def test_wilson_bound_raises_when_arguments_are_invalid():
    with pytest.raises(ValueError, match="confidence"):
        wilson_bound(1, 2, 1.5, "lower")
    with pytest.raises(ValueError, match="side"):
        wilson_bound(1, 2, 0.95, "left")
    with pytest.raises(ValueError, match="successes"):
        wilson_bound(3, 2, 0.95, "lower")


@pytest.mark.parametrize("p", [0.9, 0.97])
@pytest.mark.parametrize("n", [30, 100])
def test_wilson_lower_bound_covers_p_when_bernoulli_data_has_known_p(p, n):
    """2000 seeded replications: the fraction of lower bounds <= p is at least confidence - 0.02.

    The Wilson bound's coverage oscillates around the nominal level (Brown, Cai & DasGupta 2001); the exact
    coverage here is 0.958 / 0.942 / 1.0 / 0.952 (p, n = 0.9/30, 0.9/100, 0.97/30, 0.97/100); the Monte Carlo
    standard error at 2000 replications is ~0.005.
    """
    rng = np.random.default_rng(1234 + n + int(p * 100))
    successes = rng.binomial(n, p, size=2000)
    lb = wilson_bound(successes, n, 0.95, "lower")
    assert np.mean(lb <= p) >= 0.95 - 0.02
    exact = binom.pmf(np.arange(n + 1), n, p)[wilson_bound(np.arange(n + 1), n, 0.95, "lower") <= p].sum()
    assert abs(np.mean(lb <= p) - exact) < 0.02  # the simulation agrees with the exact binomial coverage


def test_wilson_lower_bound_is_not_trivially_conservative_when_n_is_large():
    # a bound that always returned 0 would "cover"; at n = 1000 the bound is within 0.02 of p
    assert 0.88 < wilson_bound(900, 1000, 0.95, "lower") < 0.9


# --------------------------------------------------------------------------------------------- bootstrap
def test_bootstrap_lower_bound_covers_mean_when_data_is_normal():
    """400 seeded data sets of 100 normal rows, 500 resamples, one-sided 90% lower bound of the mean.

    Tolerance: 0.9 +- 0.05 (the Monte Carlo standard error at 400 data sets is 0.015; the percentile
    bootstrap's own small-sample undercoverage at n = 100 is < 0.01).
    """
    rng = np.random.default_rng(7)
    covered = [bootstrap_bound(rng.normal(1.0, 2.0, size=100), "mean", 0.9, "lower", samples=500, seed=r) <= 1.0
               for r in range(400)]
    assert 0.85 <= np.mean(covered) <= 0.95


def test_bootstrap_upper_bound_covers_p99_when_data_is_exponential():
    rng = np.random.default_rng(11)
    true_p99 = -math.log(0.01)  # quantile of Exp(1)
    covered = [bootstrap_bound(rng.exponential(size=400), "p99", 0.9, "upper", samples=300, seed=r) >= true_p99
               for r in range(200)]
    assert np.mean(covered) >= 0.8  # percentile bootstrap of a tail quantile undercovers somewhat


def test_bootstrap_bound_is_deterministic_when_seed_is_fixed():
    x = np.random.default_rng(0).normal(size=300)
    a = bootstrap_bound(x, "mean", 0.95, "lower", samples=200, seed=3)
    assert a == bootstrap_bound(x, "mean", 0.95, "lower", samples=200, seed=3)
    assert a != bootstrap_bound(x, "mean", 0.95, "lower", samples=200, seed=4)
    assert a < x.mean() < bootstrap_bound(x, "mean", 0.95, "upper", samples=200, seed=3)


def test_bootstrap_distribution_is_chunked_without_changing_shape_when_block_is_small():
    x = np.arange(50, dtype=float)
    d = bootstrap_distribution(x, "p01", 7, seed=0, block_elements=120)  # 2 resamples per block
    assert d.shape == (7,) and np.all((d >= 0) & (d <= 49))


def test_bootstrap_bound_gives_inf_not_nan_when_rows_are_non_finite():
    x = np.r_[np.zeros(90), np.full(10, np.inf)]
    assert bootstrap_bound(x, "p99", 0.95, "upper", samples=200, seed=0) == math.inf
    assert bootstrap_bound(x, "mean", 0.95, "upper", samples=200, seed=0) == math.inf
    assert bootstrap_bound(np.zeros(100), "p99", 0.95, "upper", samples=200, seed=0) == 0.0


def test_bootstrap_bound_of_max_equals_observed_max_when_side_is_upper():
    x = np.random.default_rng(2).normal(size=200)
    assert bootstrap_bound(x, "max", 0.95, "upper", samples=300, seed=0) == x.max()
    assert math.isnan(bootstrap_bound(np.zeros(0), "mean", 0.95, "lower"))


def test_bootstrap_bound_raises_when_statistic_is_unknown():
    with pytest.raises(ValueError, match="statistic"):
        bootstrap_bound(np.ones(3), "median", 0.95, "lower")


# ------------------------------------------------------------------------------------- paired difference
def test_paired_difference_bound_covers_true_drop_when_candidate_flips_rows():
    """2000 seeded replications of 200 paired rows: reference correct with p 0.85, the candidate flips 5%."""
    rng = np.random.default_rng(3)
    true_diff = 0.85 * 0.95 + 0.15 * 0.05 - 0.85  # E[cand] - E[ref] = -0.035
    hits = []
    for _ in range(2000):
        ref = rng.random(200) < 0.85
        cand = ref ^ (rng.random(200) < 0.05)
        hits.append(paired_difference_bound(cand, ref, 0.95, "lower") <= true_diff)
    assert np.mean(hits) >= 0.95 - 0.02


def test_paired_difference_bound_is_antisymmetric_and_brackets_estimate_when_pairs_differ():
    rng = np.random.default_rng(4)
    ref = rng.random(150) < 0.8
    cand = ref.copy()
    cand[:12] = ~cand[:12]
    diff = cand.mean() - ref.mean()
    lo, hi = paired_difference_bound(cand, ref, 0.95, "lower"), paired_difference_bound(cand, ref, 0.95, "upper")
    assert -1 <= lo < diff < hi <= 1
    assert paired_difference_bound(ref, cand, 0.95, "upper") == pytest.approx(-lo)


def test_paired_difference_bound_allows_an_unseen_drop_when_pairs_are_identical():
    same = np.r_[np.ones(24, bool), np.zeros(6, bool)]
    lo = paired_difference_bound(same, same, 0.95, "lower")
    assert -0.2 < lo < 0.0  # 30 identical rows do not prove a zero drop
    perfect = paired_difference_bound(np.ones(30, bool), np.ones(30, bool), 0.95, "lower")
    assert perfect == pytest.approx(wilson_bound(30, 30, 0.95, "lower") - 1.0)
    assert math.isnan(paired_difference_bound(np.zeros(0), np.zeros(0), 0.95, "lower"))


# ------------------------------------------------------------------------------------------ metric_bound
def _per_sample(n=200, seed=0):
    rng = np.random.default_rng(seed)
    return {"top1_agree": rng.random(n) < 0.95, "kl_divergence": rng.exponential(0.01, n),
            "abs_error": rng.exponential(0.1, n), "non_finite": np.zeros(n, bool)}


def test_metric_bound_uses_wilson_when_metric_is_a_proportion():
    ps = _per_sample()
    mask = np.arange(200) < 80
    got = metric_bound("classification", "top1_agreement", ps, mask, 0.95, "lower")
    assert got == wilson_bound(int(ps["top1_agree"][:80].sum()), 80, 0.95, "lower")


def test_metric_bound_uses_seeded_bootstrap_when_metric_is_continuous():
    ps = _per_sample()
    bs = BootstrapSpec(samples=300, seed=5)
    got = metric_bound("classification", "kl_divergence.p99", ps, None, 0.9, "upper", bs)
    assert got == bootstrap_bound(ps["kl_divergence"], "p99", 0.9, "upper", samples=300, seed=5)
    assert got >= np.percentile(ps["kl_divergence"], 99) * 0.9


def test_metric_bound_raises_input_error_when_metric_or_mask_is_wrong():
    ps = _per_sample()
    with pytest.raises(InputError, match="not a parity metric"):
        metric_bound("classification", "cosine_similarity.p01", ps, None, 0.95, "lower")
    with pytest.raises(InputError, match="missing"):
        metric_bound("classification", "accuracy", ps, None, 0.95, "lower")
    with pytest.raises(InputError, match="mask"):
        metric_bound("classification", "top1_agreement", ps, np.ones(3, bool), 0.95, "lower")
