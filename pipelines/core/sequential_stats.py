"""tailguard's sequential statistics: decisions taken while the data still arrives, valid at whichever look they
stop (issue 25).

- `wor_*`: a confidence sequence for the number of successes in a finite population of 0/1 rows drawn without
  replacement (the validation rows scored in a shuffled order), so a gate can be decided before the last row with a
  stated chance of disagreeing with the decision on every row (components/validate/sequential.py).
- `looks`, `look_confidence`, `order_statistic_bound`: the looks of a latency timing that stops at a precision, the
  level each look's bounds are computed at (Bonferroni over the looks), and the distribution-free quantile bounds of
  its rounds (tailguard.core.latency, components/validate/timing.py, components/register/promotion.py).

The fixed-sample bounds and tests are in `tailguard.core.stats`; the monitor's betting CUSUM (monitoring/detector.py)
is change detection on an unbounded stream and stays beside the monitor. Conventions (`confidence`, `side`, ValueError
on bad arguments) are those of `tailguard.core.stats`. Formulas and sources are in each function's docstring.
"""

from __future__ import annotations

import math

import numpy as np

from tailguard.core.stats import Side, check_level

__all__ = ["WOR_PRIOR", "look_confidence", "looks", "order_statistic_bound", "wor_confidence_sequence",
           "wor_decide_at_least", "wor_log_evidence"]


# ------------------------------------------------------------------------- sequential: sampling without replacement
WOR_PRIOR = (1.0, 1.0)  # beta-binomial prior (a, b) of the prior-posterior-ratio sequence: uniform over 0..N


def _log_beta_binomial(x: np.ndarray, n: float, a: float, b: float) -> np.ndarray:
    """log P(X = x) for X ~ BetaBinomial(n, a, b), -inf outside 0..n (float64, shape of `x`)."""
    from scipy import special  # scipy.special only (scipy.stats costs a second to import)

    x = np.asarray(x, dtype=np.float64)
    inside = (x >= 0) & (x <= n)
    xc = np.clip(x, 0.0, n)
    out = (special.gammaln(n + 1.0) - special.gammaln(xc + 1.0) - special.gammaln(n - xc + 1.0)
           + special.betaln(xc + a, n - xc + b) - special.betaln(a, b))
    return np.where(inside, out, -np.inf)


def _wor_args(successes: int, draws: int, population: int) -> tuple[int, int, int]:
    s, t, n = int(successes), int(draws), int(population)
    if n < 0 or t < 0 or t > n or s < 0 or s > t:
        raise ValueError(f"need 0 <= successes <= draws <= population, got successes={successes!r}, "
                         f"draws={draws!r}, population={population!r}")
    return s, t, n


def wor_log_evidence(successes: int, draws: int, population: int, *,
                     prior: tuple[float, float] = WOR_PRIOR) -> np.ndarray:
    """Log evidence against each possible population total, after drawing rows without replacement.

    The prior-posterior-ratio (PPR) confidence sequence of Waudby-Smith & Ramdas 2020 ("Confidence sequences
    for sampling without replacement", NeurIPS 33, sec. 3, Theorem 1) for a population of N rows, each 0 or 1,
    with K ones, drawn in a uniformly random order. Put the prior K ~ BetaBinomial(N, a, b) (a = b = 1: uniform on
    0..N); after t draws with s ones the posterior is K - s ~ BetaBinomial(N - t, a + s, b + t - s). The ratio

        R_t(k) = pi_0(k) / pi_t(k)        (+inf where pi_t(k) = 0, i.e. k < s or k > s + N - t)

    is, under K = k, a nonnegative supermartingale in t with R_0 = 1 (it equals the marginal likelihood of the
    draws divided by their likelihood under K = k; its expectation is the marginal probability of the draws K = k
    allows, <= 1), so by Ville's inequality P(exists t: R_t(K) >= 1/alpha) <= alpha:
    {k : R_t(k) < 1/alpha} is a (1 - alpha) confidence sequence for K, valid at every t at once and so at any
    data-dependent stopping time. At t = N it is the single point {s}.

    Args:
        successes: ones among the draws (s).
        draws: rows drawn so far (t).
        population: rows in the population (N), drawn in a uniformly random order without replacement.
        prior: (a, b) > 0 of the beta-binomial prior (default uniform); any fixed prior gives a valid sequence.

    Returns:
        float64 array of shape (N + 1,): log R_t(k) for k = 0..N (natural log; +inf where k is impossible).

    Raises:
        ValueError: counts outside 0 <= successes <= draws <= population, or a prior parameter <= 0.
    """
    s, t, n = _wor_args(successes, draws, population)
    a, b = float(prior[0]), float(prior[1])
    if not (a > 0 and b > 0):
        raise ValueError(f"prior parameters must be > 0, got {prior!r}")
    k = np.arange(n + 1, dtype=np.float64)
    log_prior = _log_beta_binomial(k, n, a, b)
    log_post = _log_beta_binomial(k - s, n - t, a + s, b + t - s)
    with np.errstate(invalid="ignore"):
        out = log_prior - log_post
    return np.where(np.isfinite(log_post), out, np.inf)


def wor_confidence_sequence(successes: int, draws: int, population: int, alpha: float, *,
                            prior: tuple[float, float] = WOR_PRIOR) -> tuple[int, int]:
    """The (1 - alpha) confidence sequence for the population total K at this draw (`wor_log_evidence`).

    Args:
        successes, draws, population: as `wor_log_evidence`.
        alpha: error level in (0, 1): P(K ever leaves the sequence) <= alpha.
        prior: beta-binomial prior (a, b).

    Returns:
        (lowest, highest) total k not excluded (R_t(k) < 1/alpha), ints in [successes, successes + population -
        draws]; the set between them may have holes for a non-uniform prior, so decisions use
        `wor_decide_at_least`, which checks every k.

    Raises:
        ValueError: bad counts, alpha outside (0, 1) or a bad prior.
    """
    check_level(1.0 - alpha, None)
    logr = wor_log_evidence(successes, draws, population, prior=prior)
    keep = np.nonzero(logr < math.log(1.0 / alpha))[0]
    if keep.size == 0:  # cannot happen for the true K except with probability alpha; report the data's range
        s, t, n = _wor_args(successes, draws, population)
        return s, s + n - t
    return int(keep[0]), int(keep[-1])


def wor_decide_at_least(successes: int, draws: int, population: int, k_star: int, alpha: float, *,
                        prior: tuple[float, float] = WOR_PRIOR) -> bool | None:
    """Whether the population total K is at least `k_star`, decided on the confidence sequence, or None.

    True when every k < k_star is excluded (R_t(k) >= 1/alpha for all of them), False when every k >= k_star is,
    None while both sides hold a total still in the sequence. Whatever the population and whenever the caller
    stops (e.g. as soon as this is not None), P(the answer is wrong) <= alpha (Ville's inequality for the true
    K, `wor_log_evidence`). With every row drawn it is the exact answer K >= k_star.

    Args:
        successes, draws, population: as `wor_log_evidence`.
        k_star: the total the decision turns on (any int; <= 0 is always True, > population always False).
        alpha: error level in (0, 1).
        prior: beta-binomial prior (a, b).

    Returns:
        True, False or None.

    Raises:
        ValueError: bad counts, alpha outside (0, 1) or a bad prior.
    """
    check_level(1.0 - alpha, None)
    s, t, n = _wor_args(successes, draws, population)
    if k_star <= 0:
        return True
    if k_star > n:
        return False
    excluded = wor_log_evidence(s, t, n, prior=prior) >= math.log(1.0 / alpha)
    if excluded[:k_star].all():
        return True
    if excluded[k_star:].all():
        return False
    return None


# ------------------------------------------------------------------------------- sequential: corrected looks
def looks(first: int, last: int, growth: float = 2.0) -> list[int]:
    """The rounds at which a sequential measurement looks at its data: first, first * growth, ... (rounded up),
    then `last` (the budget), increasing; [last] when last <= first.

    Args:
        first: rounds at the first look (>= 1).
        last: the largest number of rounds (the budget's `iterations`).
        growth: factor between looks (> 1); 2 doubles the rounds, so at most log2(last / first) + 1 looks.

    Raises:
        ValueError: first < 1, last < 1 or growth <= 1.
    """
    if first < 1 or last < 1 or not growth > 1:
        raise ValueError(f"need first >= 1, last >= 1, growth > 1, got {first!r}, {last!r}, {growth!r}")
    out, n = [], float(first)
    while math.ceil(n) < last:
        if not out or math.ceil(n) > out[-1]:
            out.append(math.ceil(n))
        n *= growth
    return out + [int(last)]


def look_confidence(confidence: float, n_looks: int) -> float:
    """The confidence of each look's bound so that every look's bound holds at once (Bonferroni over looks).

    A measurement that may stop at any of `n_looks` looks and report (or decide on) the bound of the look where it
    stopped is valid at the stated `confidence` when each look uses 1 - (1 - confidence) / n_looks: the chance that
    any look's bound misses is at most the sum of theirs (Bonferroni; the simplest alpha-spending rule with equal
    shares, cf. Jennison & Turnbull 2000, "Group Sequential Methods with Applications to Clinical Trials",
    sec. 7.2). The looks must be fixed in advance (`looks`) or be the last one.

    Args:
        confidence: the stated level in (0, 1) (one-sided for a bound).
        n_looks: looks the measurement may take (>= 1).

    Returns:
        The per-look level, in [confidence, 1).

    Raises:
        ValueError: confidence outside (0, 1) or n_looks < 1.
    """
    check_level(confidence, None)
    if n_looks < 1:
        raise ValueError(f"n_looks must be >= 1, got {n_looks!r}")
    return 1.0 - (1.0 - confidence) / n_looks


def order_statistic_bound(samples: np.ndarray, q: float, confidence: float, side: Side) -> float:
    """Distribution-free one-sided bound of the q-quantile of i.i.d. samples: an order statistic.

    For n samples, the j-th smallest x_(j) satisfies P(x_(j) <= xi_q) = P(Bin(n, q) >= j) for the population
    q-quantile xi_q of a continuous distribution (Conover 1999, "Practical Nonparametric Statistics", 3rd ed.,
    sec. 3.2; Hahn & Meeker 1991, "Statistical Intervals", sec. 5.2). The lower bound is x_(l) with l the largest
    j such that P(Bin(n, q) >= j) >= confidence; the upper bound is x_(u) with u the smallest j such that
    P(Bin(n, q) <= j - 1) >= confidence. Example: n = 100, q = 0.5, confidence 0.975 gives x_(40) and x_(61), the
    classic 95% interval of the median. With too few samples there is no such order statistic: -inf / +inf
    (the p99 of fewer than 299 samples has no 95% upper bound).

    Args:
        samples: shape (n,), float (e.g. latency in ms), any order; at least one.
        q: quantile in (0, 1), e.g. 0.5, 0.99.
        confidence: one-sided level in (0, 1).
        side: "lower" or "upper".

    Returns:
        The bound in the samples' units (float); -inf / +inf when no order statistic reaches the level.

    Raises:
        ValueError: no samples, q outside (0, 1), a bad confidence or side.
    """
    check_level(confidence, side)
    x = np.sort(np.asarray(samples, dtype=np.float64).reshape(-1))
    n = x.size
    if n == 0:
        raise ValueError("order_statistic_bound needs at least one sample")
    if not 0.0 < q < 1.0:
        raise ValueError(f"q must be in (0, 1), got {q!r}")
    from scipy import special  # the binomial tails without importing scipy.stats (a second on a task's start)

    j = np.arange(1, n + 1, dtype=np.float64)
    if side == "lower":
        ok = np.nonzero(special.bdtrc(j - 1, n, q) >= confidence)[0]  # P(Bin >= j) = P(Bin > j - 1)
        return float(x[ok[-1]]) if ok.size else -math.inf
    ok = np.nonzero(special.bdtr(j - 1, n, q) >= confidence)[0]  # P(Bin <= j - 1)
    return float(x[ok[0]]) if ok.size else math.inf
