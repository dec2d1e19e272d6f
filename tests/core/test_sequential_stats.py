"""tailguard.core.sequential_stats: the without-replacement confidence sequence against a hand-computed posterior and
simulated coverage, the looks and their level, and the order-statistic bounds against the scipy binomial rule."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as st

from tailguard.core import sequential_stats as S


# ------------------------------------------------------------- sequential: rows drawn without replacement
def test_wor_log_evidence_matches_hand_computed_posterior_when_one_of_two_rows_is_drawn():
    # N = 2, uniform prior on K in {0, 1, 2}; the first row drawn is a 1: P(K | x1 = 1) = (0, 1/3, 2/3), so
    # R(k) = prior / posterior = (inf, 1, 1/2)
    logr = S.wor_log_evidence(1, 1, 2)
    assert logr[0] == math.inf
    assert np.exp(logr[1:]) == pytest.approx([1.0, 0.5], rel=1e-12)


@pytest.mark.parametrize("s, t, n", [(0, 0, 7), (3, 5, 12), (5, 5, 9), (0, 6, 6), (7, 20, 40)])
def test_wor_log_evidence_is_marginal_over_hypergeometric_likelihood_when_bayes_rule_is_applied(s, t, n):
    # R_t(k) = P(data) / P(data | K = k) with P(data | k) hypergeometric and P(data) its average over the prior
    k = np.arange(n + 1)
    like = st.hypergeom.pmf(s, n, k, t)
    marginal = like.mean()  # uniform prior
    with np.errstate(divide="ignore"):
        expected = np.log(marginal) - np.log(like)
    np.testing.assert_allclose(S.wor_log_evidence(s, t, n), expected, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("k_true", [0, 3, 8])
def test_wor_evidence_expectation_is_the_marginal_mass_of_possible_draws_when_k_is_the_true_total(k_true):
    # the supermartingale property behind the guarantee, exactly: under the true K, E[R_t(K)] = sum over the
    # counts K allows of their marginal probability (<= 1, = 1 when K allows every count), for every t
    n = 8
    for t in range(n + 1):
        s = np.arange(t + 1)
        probs = st.hypergeom.pmf(s, n, k_true, t)
        marginal = np.mean([st.hypergeom.pmf(s, n, k, t) for k in range(n + 1)], axis=0)
        r = np.array([np.exp(S.wor_log_evidence(int(x), t, n)[k_true]) if p > 0 else 0.0
                      for x, p in zip(s, probs)])
        assert float((probs * r).sum()) == pytest.approx(float(marginal[probs > 0].sum()), rel=1e-9)
        assert float((probs * r).sum()) <= 1.0 + 1e-12


def test_wor_confidence_sequence_is_the_exact_total_when_every_row_is_drawn_and_the_data_range_otherwise():
    assert S.wor_confidence_sequence(37, 50, 50, 0.01) == (37, 37)
    lo, hi = S.wor_confidence_sequence(20, 30, 50, 0.01)
    assert 20 <= lo < 30 < hi <= 40  # never below the ones seen nor above them plus the rows unseen
    assert S.wor_decide_at_least(37, 50, 50, 37, 0.01) is True
    assert S.wor_decide_at_least(37, 50, 50, 38, 0.01) is False
    assert S.wor_decide_at_least(0, 0, 50, 0, 0.01) is True and S.wor_decide_at_least(0, 0, 50, 51, 0.01) is False


def test_wor_decide_at_least_stays_undecided_when_few_rows_are_drawn_at_a_boundary():
    # 100 of 100 ones drawn so far proves nothing about a threshold at 9000 of 10000 rows until enough rows:
    # after 10 all-one draws, 10000 rows with a 90% threshold are not decided; a 50% threshold is not either
    assert S.wor_decide_at_least(10, 10, 10_000, 9_000, 0.01) is None
    assert S.wor_decide_at_least(10, 10, 10_000, 5_000, 0.01) is None
    assert S.wor_decide_at_least(0, 10, 10_000, 5_000, 0.01) is None


def _first_decisions(n: int, k: int, k_star: int, alpha: float, reps: int, every: int, seed: int):
    """(decision, rows drawn) of the rule 'stop at the first look where wor_decide_at_least decides' over `reps`
    shuffles of a population of n rows with k ones, looking after every `every` rows (and at the last row)."""
    ts = sorted(set(range(every, n + 1, every)) | {n})
    table = {t: [S.wor_decide_at_least(s, t, n, k_star, alpha) for s in range(t + 1)] for t in ts}
    rng = np.random.default_rng(seed)
    pop = np.zeros(n, dtype=np.int64)
    pop[:k] = 1
    out = []
    for _ in range(reps):
        csum = np.cumsum(pop[rng.permutation(n)])
        for t in ts:
            d = table[t][int(csum[t - 1])]
            if d is not None:
                out.append((d, t))
                break
    return out


@pytest.mark.parametrize("every", [1, 10])
def test_wor_sequential_decision_keeps_its_error_rate_when_the_total_is_one_row_either_side_of_the_boundary(every):
    # Known answer at the boundary: 120 rows, the decision turns on K >= 90. With K = 89 the all-rows answer is
    # False by one row, with K = 90 it is True by one row: these are the populations where stopping early is most
    # likely to be wrong. Stopping at the first decided look (after every row, or every 10 rows), the share of
    # wrong answers over 3000 seeded shuffles must stay within what alpha allows: at most the 99.9% quantile of
    # Binomial(3000, alpha) / 3000 (0.0153 at alpha 0.01), so the test fails only if the guarantee is broken
    # (or with probability < 0.001 by chance).
    n, k_star, alpha, reps = 120, 90, 0.01, 3000
    limit = st.binom.ppf(0.999, reps, alpha) / reps
    for k, truth in ((k_star - 1, False), (k_star, True)):
        got = _first_decisions(n, k, k_star, alpha, reps, every, seed=k)
        assert len(got) == reps  # every shuffle ends decided (at the last row at the latest)
        wrong = sum(d != truth for d, _ in got) / reps
        assert wrong <= limit, (k, wrong, limit)
    # an error rate of 0 could be a rule that never decides early: looking after every row, it does decide some
    # of these shuffles early (74% with K = 89, 26% with K = 90, when measured) and errs on 0.2% and 0.5%
    if every == 1:
        assert np.mean([t < n for _, t in got]) > 0.1


def test_wor_sequential_decision_stops_early_when_the_total_is_far_from_the_boundary():
    got = _first_decisions(400, 400, 360, 0.01, 200, 10, seed=0)  # every row agrees, threshold 90%
    assert all(d is True for d, _ in got)
    assert max(t for _, t in got) <= 120  # decided on at most 30% of the rows
    got = _first_decisions(400, 280, 360, 0.01, 200, 10, seed=1)  # 70% against 90%
    assert all(d is False for d, _ in got) and max(t for _, t in got) <= 120


# ------------------------------------------------------------------------- sequential: looks and quantiles
def test_looks_double_from_first_to_the_budget_and_look_confidence_splits_alpha_equally():
    assert S.looks(10, 100) == [10, 20, 40, 80, 100]
    assert S.looks(10, 10) == [10] and S.looks(10, 3) == [3] and S.looks(3, 40, 1.5) == [3, 5, 7, 11, 16, 23, 35, 40]
    assert S.look_confidence(0.95, 5) == pytest.approx(0.99)
    assert S.look_confidence(0.9, 1) == pytest.approx(0.9)
    with pytest.raises(ValueError):
        S.looks(0, 10)
    with pytest.raises(ValueError):
        S.look_confidence(0.95, 0)


def test_order_statistic_bound_gives_the_classic_median_interval_when_100_samples():
    # the 95% interval of the median from 100 samples is (x_(40), x_(61)) (Conover 1999, table A3; Hahn & Meeker)
    x = np.random.default_rng(0).permutation(np.arange(1.0, 101.0))
    assert S.order_statistic_bound(x, 0.5, 0.975, "lower") == 40.0
    assert S.order_statistic_bound(x, 0.5, 0.975, "upper") == 61.0


def test_order_statistic_bound_is_infinite_when_too_few_samples_for_a_tail_quantile():
    assert S.order_statistic_bound(np.arange(298.0), 0.99, 0.95, "upper") == math.inf
    assert S.order_statistic_bound(np.arange(299.0), 0.99, 0.95, "upper") == 298.0  # 1 - 0.99^299 >= 0.95
    assert S.order_statistic_bound(np.arange(5.0), 0.5, 0.99, "lower") == -math.inf


def test_order_statistic_bound_covers_the_quantile_at_its_level_when_sampling_a_known_distribution():
    # exponential(1): the median is ln 2; the one-sided 90% lower bound of 50 samples must cover it in >= 90%
    # of 2000 seeded samples (up to the binomial 99.9% tolerance); it is conservative (discrete), so also <= 100%
    rng = np.random.default_rng(3)
    hits = sum(S.order_statistic_bound(rng.exponential(size=50), 0.5, 0.9, "lower") <= math.log(2)
               for _ in range(2000))
    assert hits / 2000 >= st.binom.ppf(0.001, 2000, 0.9) / 2000


def test_order_statistic_bound_equals_the_scipy_stats_binomial_rule_when_samples_are_random():
    rng = np.random.default_rng(4)
    for n in (1, 9, 50, 333):
        x = rng.exponential(size=n)
        s = np.sort(x)
        for q in (0.1, 0.5, 0.99):
            for conf in (0.9, 0.99):
                j = np.arange(1, n + 1)
                lo = np.nonzero(st.binom.sf(j - 1, n, q) >= conf)[0]
                hi = np.nonzero(st.binom.cdf(j - 1, n, q) >= conf)[0]
                assert S.order_statistic_bound(x, q, conf, "lower") == (s[lo[-1]] if lo.size else -math.inf)
                assert S.order_statistic_bound(x, q, conf, "upper") == (s[hi[0]] if hi.size else math.inf)
