"""tailguard.core.stats: each bound and test against a published worked example or scipy/statsmodels, and the
bootstrap against the hand-written resampler it replaced (same seed, same numbers)."""

import math

import numpy as np
import pytest
from scipy import stats as st
from statsmodels.stats.proportion import proportion_confint

from tailguard.core import stats as S
from tailguard.core.parity import _percentile


# ------------------------------------------------------------------------------------------------- Wilson
def test_wilson_interval_matches_hand_computed_formula_when_52_of_56():
    z = st.norm.ppf(0.975)
    p, n = 52 / 56, 56
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    lo, hi = S.wilson_interval(52, 56, 0.95)
    assert (lo, hi) == pytest.approx((centre - half, centre + half), abs=1e-12)
    assert (lo, hi) == pytest.approx((0.8302, 0.9719), abs=5e-5)


@pytest.mark.parametrize("x, n, expected", [(81, 263, (0.2553, 0.3662)), (15, 148, (0.0624, 0.1605)),
                                            (0, 20, (0.0, 0.1611)), (1, 29, (0.0061, 0.1718))])
def test_wilson_interval_matches_newcombe_1998_table_when_published_examples(x, n, expected):
    # Newcombe 1998, "Two-sided confidence intervals for the single proportion", Stat Med 17:857, Table II
    assert S.wilson_interval(x, n, 0.95) == pytest.approx(expected, abs=5e-5)


def test_wilson_bound_equals_statsmodels_when_counts_are_random():
    rng = np.random.default_rng(0)
    n = rng.integers(1, 500, size=200)
    x = rng.integers(0, n + 1)
    for conf in (0.8, 0.95, 0.99):
        lo, hi = proportion_confint(x, n, alpha=2 * (1 - conf), method="wilson")
        np.testing.assert_allclose(S.wilson_bound(x, n, conf, "lower"), lo, rtol=0, atol=1e-12)
        np.testing.assert_allclose(S.wilson_bound(x, n, conf, "upper"), hi, rtol=0, atol=1e-12)


# ---------------------------------------------------------------------------------------- Clopper-Pearson
@pytest.mark.parametrize("n", [1, 10, 30, 300])
def test_clopper_pearson_upper_bound_is_rule_of_three_closed_form_when_no_successes(n):
    assert S.clopper_pearson_bound(0, n, 0.95, "upper") == pytest.approx(1 - 0.05 ** (1 / n), rel=1e-12)
    assert S.clopper_pearson_bound(0, n, 0.95, "lower") == 0.0
    assert S.clopper_pearson_bound(n, n, 0.95, "lower") == pytest.approx(0.05 ** (1 / n), rel=1e-12)
    lo, hi = S.clopper_pearson_interval(0, n, 0.95)
    assert lo == 0.0 and hi == pytest.approx(1 - 0.025 ** (1 / n), rel=1e-12)


def test_clopper_pearson_matches_scipy_binomtest_and_statsmodels_when_counts_are_random():
    rng = np.random.default_rng(1)
    for _ in range(60):
        n = int(rng.integers(1, 400))
        x = int(rng.integers(0, n + 1))
        for conf in (0.9, 0.95):
            lo = st.binomtest(x, n, alternative="greater").proportion_ci(conf, method="exact").low
            hi = st.binomtest(x, n, alternative="less").proportion_ci(conf, method="exact").high
            assert S.clopper_pearson_bound(x, n, conf, "lower") == pytest.approx(lo, abs=1e-12)
            assert S.clopper_pearson_bound(x, n, conf, "upper") == pytest.approx(hi, abs=1e-12)
            assert S.clopper_pearson_interval(x, n, conf) == pytest.approx(
                proportion_confint(x, n, alpha=1 - conf, method="beta"), abs=1e-12)


def test_clopper_pearson_is_wider_than_wilson_and_nan_when_n_is_zero():
    assert S.clopper_pearson_bound(90, 100, 0.95, "lower") < S.wilson_bound(90, 100, 0.95, "lower")
    assert math.isnan(S.clopper_pearson_bound(0, 0, 0.95, "upper"))
    out = S.clopper_pearson_bound(np.array([0, 5, 10]), 10, 0.95, "upper")
    assert out.shape == (3,) and out.dtype == np.float64 and out[2] == 1.0


@pytest.mark.parametrize("fn", [S.wilson_bound, S.clopper_pearson_bound])
def test_proportion_bounds_raise_value_error_when_arguments_are_invalid(fn):
    with pytest.raises(ValueError, match="confidence"):
        fn(1, 2, 1.0, "lower")
    with pytest.raises(ValueError, match="side"):
        fn(1, 2, 0.95, "left")
    with pytest.raises(ValueError, match="successes"):
        fn(3, 2, 0.95, "lower")


# ------------------------------------------------------------------------------------------------ Newcombe
def test_newcombe_paired_interval_matches_fagerland_example_when_cavo_2012_table():
    # Fagerland, Lydersen & Laake 2017, ch. 8 (Cavo et al. 2012): estimate -0.0621 (95% CI -0.1186 to -0.0046)
    assert S.newcombe_paired_interval(59, 6, 16, 80, 0.95) == pytest.approx((-0.1186, -0.0046), abs=5e-5)


def _newcombe_reference(a, b, c, d, z):
    """Newcombe 1998 method 10 written from Fagerland et al. 2017, eq. 8.9-8.10, independently of the module."""
    n = a + b + c + d
    p1, p2 = (a + b) / n, (a + c) / n

    def wilson(x):
        p = x / n
        centre = (2 * x + z * z) / (2 * (n + z * z))
        half = z * math.sqrt(z * z + 4 * x * (1 - p)) / (2 * (n + z * z))
        return (0.0 if x == 0 else centre - half), (1.0 if x == n else centre + half)

    (l1, u1), (l2, u2) = wilson(a + b), wilson(a + c)
    if 0 in (a + b, c + d, a + c, b + d):
        psi = 0.0
    else:
        big_a, root = a * d - b * c, math.sqrt((a + b) * (c + d) * (a + c) * (b + d))
        psi = (big_a - n / 2) / root if big_a > n / 2 else (0.0 if big_a >= 0 else big_a / root)
    lo = p1 - p2 - math.sqrt(max((p1 - l1) ** 2 + (u2 - p2) ** 2 - 2 * psi * (p1 - l1) * (u2 - p2), 0))
    hi = p1 - p2 + math.sqrt(max((p2 - l2) ** 2 + (u1 - p1) ** 2 - 2 * psi * (p2 - l2) * (u1 - p1), 0))
    return max(-1.0, lo), min(1.0, hi)


def test_newcombe_paired_bound_equals_reference_formula_when_rows_are_random():
    rng = np.random.default_rng(2)
    for _ in range(200):
        rows = int(rng.integers(1, 300))
        first = rng.random(rows) < rng.random()
        second = first ^ (rng.random(rows) < rng.random() * 0.3)
        a, b, c, d = S.paired_counts(first, second)
        assert a + b + c + d == rows
        ref = _newcombe_reference(a, b, c, d, st.norm.ppf(0.95))
        got = (S.newcombe_paired_bound(first, second, 0.95, "lower"),
               S.newcombe_paired_bound(first, second, 0.95, "upper"))
        assert got == pytest.approx(ref, abs=1e-12)


def test_newcombe_paired_bound_raises_when_input_is_not_paired_0_1():
    with pytest.raises(ValueError, match="length"):
        S.newcombe_paired_bound(np.ones(3), np.ones(4), 0.95, "lower")
    with pytest.raises(ValueError, match="0/1"):
        S.newcombe_paired_bound(np.full(3, 2), np.ones(3), 0.95, "lower")
    assert math.isnan(S.newcombe_paired_bound(np.zeros(0), np.zeros(0), 0.95, "lower"))


# ----------------------------------------------------------------------------------------------- bootstrap
def _old_bootstrap_distribution(x, statistic, samples, seed, block_elements):
    """The hand-written resampler tailguard used before scipy.stats.bootstrap (components/validate/intervals.py
    at commit a16f846), the per-row statistic evaluated row by row with parity's percentile."""
    x = np.asarray(x, dtype=np.float64)
    n = x.size
    rng = np.random.default_rng(seed)
    out = np.empty(samples)
    block = max(1, block_elements // n)
    for start in range(0, samples, block):
        stop = min(samples, start + block)
        for j, row in enumerate(x[rng.integers(0, n, size=(stop - start, n))]):
            if statistic == "mean":
                out[start + j] = row.mean()
            elif statistic in ("max", "min"):
                out[start + j] = getattr(row, statistic)()
            else:
                out[start + j] = _percentile(row, float(statistic[1:]))
    return out


@pytest.mark.parametrize("statistic", ["mean", "max", "min", "p01", "p50", "p99"])
def test_bootstrap_bound_equals_old_resampler_when_seed_and_data_are_random(statistic):
    rng = np.random.default_rng(3)
    for trial in range(12):
        rows = int(rng.integers(2, 200))
        x = rng.standard_t(3, size=rows)
        if trial % 4 == 0:
            x[rng.integers(0, rows, size=max(1, rows // 10))] = np.inf
        samples, seed, block = int(rng.integers(1, 150)), int(rng.integers(0, 1000)), int(rng.integers(50, 5000))
        old = _old_bootstrap_distribution(x, statistic, samples, seed, block)
        new = S.bootstrap_distribution(x, statistic, samples, seed, block_elements=block)
        np.testing.assert_array_equal(new, old)
        for side, q in (("lower", 1 - 0.95), ("upper", 0.95)):  # the old code's arithmetic, bit for bit
            assert S.bootstrap_bound(x, statistic, 0.95, side, samples, seed, block_elements=block) == \
                _percentile(old, q * 100.0)


def test_bootstrap_bound_agrees_with_scipy_confidence_interval_when_values_are_finite():
    x = np.random.default_rng(4).exponential(size=300)
    res = st.bootstrap((x,), np.mean, n_resamples=500, confidence_level=0.9, alternative="greater",
                       method="percentile", rng=np.random.default_rng(9))
    assert S.bootstrap_bound(x, "mean", 0.9, "lower", samples=500, seed=9) == pytest.approx(
        res.confidence_interval.low, rel=1e-12)


def test_bootstrap_distribution_is_constant_when_one_row_and_empty_when_no_row():
    assert np.array_equal(S.bootstrap_distribution(np.array([2.5]), "p99", 5, 0), np.full(5, 2.5))
    assert S.bootstrap_distribution(np.zeros(0), "mean", 5, 0).shape == (0,)
    assert math.isnan(S.bootstrap_bound(np.zeros(0), "mean", 0.95, "lower"))


def test_bootstrap_distribution_raises_when_statistic_or_samples_are_invalid():
    with pytest.raises(ValueError, match="statistic"):
        S.bootstrap_distribution(np.ones(3), "median", 10, 0)
    with pytest.raises(ValueError, match="statistic"):
        S.bootstrap_distribution(np.ones(3), "p101", 10, 0)
    with pytest.raises(ValueError, match="samples"):
        S.bootstrap_distribution(np.ones(3), "mean", 0, 0)


def test_percentile_gives_inf_not_nan_when_interpolating_next_to_infinity():
    assert S.percentile(np.array([0.0, 1.0, np.inf]), 75) == math.inf
    assert S.percentile(np.array([-np.inf, 0.0, 1.0]), 25) == -math.inf
    x = np.random.default_rng(5).normal(size=101)
    assert S.percentile(x, 30) == pytest.approx(np.percentile(x, 30), rel=1e-14)
    assert S.percentile(x, 37.5) == _percentile(x, 37.5)  # the parity.aggregate rule


# ----------------------------------------------------------------------------------- paired ratio bootstrap
def test_paired_ratio_bootstrap_equals_scipy_paired_bootstrap_when_rounds_are_noisy():
    rng = np.random.default_rng(6)
    noise = rng.lognormal(0, 0.3, size=80)
    base, var = 10 * noise * rng.lognormal(0, 0.05, 80), 5 * noise * rng.lognormal(0, 0.05, 80)
    ratio, lo, hi = S.paired_ratio_bootstrap(base, var, 0.95, samples=400, seed=3)
    res = st.bootstrap((base, var), lambda b, v, axis=-1: np.median(b, axis=axis) / np.median(v, axis=axis),
                       paired=True, vectorized=True, n_resamples=400, confidence_level=2 * 0.95 - 1,
                       method="percentile", rng=np.random.default_rng(3))
    assert ratio == np.median(base) / np.median(var)
    assert (lo, hi) == (res.confidence_interval.low, res.confidence_interval.high)
    assert lo < ratio < hi and 1.7 < lo and hi < 2.3


def test_paired_ratio_bootstrap_bounds_equal_ratio_when_rounds_are_constant_and_raise_when_unpaired():
    assert S.paired_ratio_bootstrap([4.0] * 5, [2.0] * 5, 0.95) == (2.0, 2.0, 2.0)
    with pytest.raises(ValueError, match="length"):
        S.paired_ratio_bootstrap([1.0, 2.0], [1.0], 0.95)
    with pytest.raises(ValueError, match="2 pairs"):
        S.paired_ratio_bootstrap([1.0], [1.0], 0.95)
    with pytest.raises(ValueError, match="> 0"):
        S.paired_ratio_bootstrap([1.0, 0.0], [1.0, 1.0], 0.95)
    with pytest.raises(ValueError, match="confidence"):
        S.paired_ratio_bootstrap([1.0, 2.0], [1.0, 2.0], 0.4)


# ---------------------------------------------------------------------------------------- two-sample tests
def test_fisher_exact_greater_matches_lady_tasting_tea_when_three_of_four_right():
    # Fisher 1935: 8 cups, 4 milk-first; 3 of the 4 picked right: P(X >= 3) = (16 + 1) / 70
    assert S.fisher_exact_greater(np.array([3]), np.array([4]), 4, 8)[0] == pytest.approx(17 / 70, rel=1e-12)


def test_fisher_exact_greater_equals_scipy_fisher_exact_when_tables_are_random():
    rng = np.random.default_rng(7)
    rows = 300
    bad = rng.random(rows) < 0.05
    sizes = rng.integers(1, rows, size=40)
    k = np.array([bad[:s].sum() for s in sizes])
    got = S.fisher_exact_greater(k, sizes, int(bad.sum()), rows)
    for ki, ni, pi in zip(k, sizes, got):
        table = [[ki, ni - ki], [bad.sum() - ki, rows - ni - bad.sum() + ki]]
        assert pi == pytest.approx(st.fisher_exact(table, alternative="greater").pvalue, rel=1e-9, abs=1e-15)


def test_mann_whitney_u_greater_equals_scipy_mannwhitneyu_when_values_have_ties():
    rng = np.random.default_rng(8)
    values = np.round(rng.exponential(size=400), 1)  # many ties
    values[:5] = np.inf  # non-finite rows tie as the worst
    ranks, tie_term = S.rank_with_ties(values)
    order = rng.permutation(400)
    for size in (20, 57, 200):
        group = np.zeros(400, bool)
        group[order[:size]] = True
        p = S.mann_whitney_u_greater(np.array([ranks[group].sum()]), np.array([size]), 400, tie_term)[0]
        finite = np.where(np.isinf(values), 1e9, values)  # scipy ranks inf the same way, but keep it plain
        ref = st.mannwhitneyu(finite[group], finite[~group], alternative="greater", method="asymptotic").pvalue
        assert p == pytest.approx(ref, rel=1e-9)


def test_mann_whitney_u_greater_is_one_when_every_row_is_tied():
    ranks, tie_term = S.rank_with_ties(np.ones(50))
    assert S.mann_whitney_u_greater(np.array([ranks[:10].sum()]), np.array([10]), 50, tie_term)[0] == 1.0


# ------------------------------------------------------------------------------------ false discovery rate
BH_1995 = [0.0001, 0.0004, 0.0019, 0.0095, 0.0201, 0.0278, 0.0298, 0.0344, 0.0459, 0.3240, 0.4262, 0.5719,
           0.6528, 0.7590, 1.0000]


def test_benjamini_hochberg_matches_worked_example_when_bh_1995_p_values():
    # Benjamini & Hochberg 1995, sec. 4: at q* = 0.05 the four smallest p-values are rejected
    q = S.benjamini_hochberg(np.array(BH_1995))
    assert q[:5] == pytest.approx([0.0015, 0.003, 0.0095, 0.0095 * 15 / 4, 0.0201 * 15 / 5], rel=1e-12)
    assert q[5] == pytest.approx(0.0298 * 15 / 7, rel=1e-12)  # step-up: the minimum over later p_(j) m / j
    assert np.flatnonzero(q <= 0.05).tolist() == [0, 1, 2, 3]


def _bh_step_up(p):
    """Textbook step-up (BH 1995) written out: q_(i) = min_{j >= i} p_(j) m / j, capped at 1, input order."""
    m = p.size
    order = np.argsort(p)
    q_sorted = np.minimum.accumulate((p[order] * m / np.arange(1, m + 1))[::-1])[::-1]
    q = np.empty(m)
    q[order] = np.minimum(q_sorted, 1.0)
    return q


def test_benjamini_hochberg_equals_hand_written_step_up_when_p_values_are_random():
    rng = np.random.default_rng(9)
    for m in (1, 2, 17, 500):
        p = np.r_[rng.random(m // 2) * 1e-3, rng.random(m - m // 2)]
        rng.shuffle(p)
        np.testing.assert_allclose(S.benjamini_hochberg(p), _bh_step_up(p), rtol=1e-12)


def test_benjamini_hochberg_is_empty_when_no_test_and_raises_when_p_outside_unit_interval():
    assert S.benjamini_hochberg(np.zeros(0)).shape == (0,)
    assert S.benjamini_hochberg(np.array([np.nan, 0.01])) == pytest.approx([1.0, 0.02], rel=1e-12)
    with pytest.raises(ValueError, match="p-values"):
        S.benjamini_hochberg(np.array([0.5, 1.5]))


def test_z_value_is_one_sided_or_two_sided_normal_quantile():
    assert S.z_value(0.95) == pytest.approx(1.6448536, abs=1e-7)
    assert S.z_value(0.95, two_sided=True) == pytest.approx(1.9599640, abs=1e-7)
