"""Long-tail sampling: a base rate plus oversampling of rare slices, with inverse-probability weights.

Each request is counted (sampled or not) for every slice key it carries, so `frequency(key)` is the share of
the traffic seen so far. A request is sampled with probability

    p = min(1, base_rate * min(max_oversample, rare_slice_frequency / f_min))   if f_min < rare_slice_frequency
    p = base_rate                                                                otherwise

where f_min is the smallest frequency among its slice keys (the rarest slice it belongs to). A new slice starts
at frequency 1/total, i.e. it is treated as rare. The sampled row carries weight w = 1/p, so a weighted mean
over sampled rows (the Hajek estimator; Horvitz & Thompson 1952, JASA 47:663) estimates the traffic mean
without the bias the oversampling would otherwise add. The statistics use Kish's effective sample size
n_eff = (sum w)^2 / sum w^2 for confidence bounds (Kish 1965, "Survey Sampling").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class Decision:
    """Whether one request goes to the shadow.

    Attributes:
        sampled: True to compare it with the reference.
        probability: the inclusion probability p used (0 < p <= 1).
        weight: 1/p (recorded with the sample so estimates stay unbiased).
        oversample: the rare-slice factor applied (1.0 = base rate).
    """

    sampled: bool
    probability: float
    weight: float
    oversample: float


class LongTailSampler:
    """Bernoulli sampler with rare-slice oversampling (formula: module docstring).

    Args:
        base_rate: base sampling probability in (0, 1] (spec monitoring.sample_rate; given explicitly).
        rare_slice_frequency: slices below this share of traffic are oversampled (0 turns it off).
        max_oversample: cap of the oversampling factor (>= 1).
        seed: numpy Generator seed; equal seeds and equal request sequences give equal decisions.
        ignore: slice keys that do not count for rarity (e.g. "all", which every request carries).

    Raises:
        ValueError: base_rate outside (0, 1] or max_oversample < 1 (the spec validates both first).
    """

    def __init__(self, base_rate: float, *, rare_slice_frequency: float = 0.05, max_oversample: float = 20.0,
                 seed: int | None = None, ignore: Sequence[str] = ("all",)) -> None:
        if not 0 < base_rate <= 1:
            raise ValueError(f"base_rate must be in (0, 1], got {base_rate}")
        if max_oversample < 1:
            raise ValueError(f"max_oversample must be >= 1, got {max_oversample}")
        self.base_rate = float(base_rate)
        self.rare_slice_frequency = float(rare_slice_frequency)
        self.max_oversample = float(max_oversample)
        self.rng = np.random.default_rng(seed)
        self.ignore = frozenset(ignore)
        self.total = 0
        self.counts: dict[str, int] = {}
        self.sampled_total = 0

    def frequency(self, key: str) -> float:
        """Share of requests seen so far that carried `key` (0.0 before any request)."""
        return self.counts.get(key, 0) / self.total if self.total else 0.0

    def probability(self, keys: Sequence[str]) -> tuple[float, float]:
        """(inclusion probability, oversampling factor) for a request with these slice keys (no counting)."""
        factor = 1.0
        if self.rare_slice_frequency > 0 and self.total:
            freqs = [self.counts.get(k, 0) / self.total for k in keys if k not in self.ignore]
            if freqs:
                f = max(min(freqs), 1.0 / self.total)
                if f < self.rare_slice_frequency:
                    factor = min(self.max_oversample, self.rare_slice_frequency / f)
        return min(1.0, self.base_rate * factor), factor

    def decide(self, keys: Sequence[str]) -> Decision:
        """Count the request under its slice keys, then draw whether it is sampled.

        Args:
            keys: the request's (bounded) slice keys.

        Returns:
            The Decision (one uniform draw from the seeded generator per call).
        """
        self.total += 1
        for k in keys:
            self.counts[k] = self.counts.get(k, 0) + 1
        p, factor = self.probability(keys)
        sampled = bool(self.rng.random() < p)
        self.sampled_total += sampled
        return Decision(sampled, p, 1.0 / p, factor)
