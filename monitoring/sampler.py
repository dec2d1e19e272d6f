"""Long-tail sampling: a base rate plus oversampling of rare slices, with inverse-probability weights.

Each request is counted (sampled or not) for every slice key it carries, so `frequency(key)` is the share of
the traffic seen so far. A request is sampled with probability

    p = min(1, base_rate * min(max_oversample, rare_slice_frequency / f_min))   if f_min < rare_slice_frequency
    p = base_rate                                                                otherwise

where f_min is the smallest frequency among its slice keys (the rarest slice it belongs to). A new slice starts
at frequency 1/total, i.e. it is treated as rare. The sampled row carries weight w = 1/p, so a weighted mean
over sampled rows (the Hajek estimator; Horvitz & Thompson 1952, JASA 47:663) estimates the traffic mean
without the bias the oversampling would otherwise add (Kish 1965, "Survey Sampling", for n_eff).

Frequencies are true ones: every slice key is counted, in a table bounded by `max_keys` (least recently seen
keys are evicted past it and counted in `evicted`; an evicted key that comes back starts again as new, i.e.
rare). For each key k the decision also reports pi_k, the probability the key's own frequency would give, and
the ratio pi_k / p <= 1 (p uses the rarest key, so p >= pi_k): the change detector weights its bets by it so
that it tests each slice's traffic mean (monitoring/detector.py).
"""

from __future__ import annotations

from collections import OrderedDict
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
        ratios: per slice key (same order as the keys decided on), pi_k / p in (0, 1].
    """

    sampled: bool
    probability: float
    weight: float
    oversample: float
    ratios: tuple[float, ...] = ()


class LongTailSampler:
    """Bernoulli sampler with rare-slice oversampling (formula: module docstring).

    Args:
        base_rate: base sampling probability in (0, 1] (spec monitoring.sample_rate; given explicitly).
        rare_slice_frequency: slices below this share of traffic are oversampled (0 turns it off).
        max_oversample: cap of the oversampling factor (>= 1).
        seed: numpy Generator seed; equal seeds and equal request sequences give equal decisions.
        ignore: slice keys that do not count for rarity (e.g. "all", which every request carries).
        max_keys: bound on the counted keys (least recently seen evicted past it).

    Raises:
        ValueError: base_rate outside (0, 1] or max_oversample < 1 (the spec validates both first).
    """

    def __init__(self, base_rate: float, *, rare_slice_frequency: float = 0.05, max_oversample: float = 20.0,
                 seed: int | None = None, ignore: Sequence[str] = ("all",), max_keys: int = 100_000) -> None:
        if not 0 < base_rate <= 1:
            raise ValueError(f"base_rate must be in (0, 1], got {base_rate}")
        if max_oversample < 1:
            raise ValueError(f"max_oversample must be >= 1, got {max_oversample}")
        self.base_rate = float(base_rate)
        self.rare_slice_frequency = float(rare_slice_frequency)
        self.max_oversample = float(max_oversample)
        self.rng = np.random.default_rng(seed)
        self._block: list[float] = []
        self._pos = 0
        self.ignore = frozenset(ignore)
        self.total = 0
        self.counts: OrderedDict[str, list[int]] = OrderedDict()  # key -> [requests, sampled]
        self.max_keys = max_keys
        self.evicted = 0
        self.sampled_total = 0

    def frequency(self, key: str) -> float:
        """Share of requests seen so far that carried `key` (0.0 before any request)."""
        return self.seen(key) / self.total if self.total else 0.0

    def seen(self, key: str) -> int:
        """Requests counted under `key` (since it last entered the table)."""
        c = self.counts.get(key)
        return c[0] if c is not None else 0

    def sampled(self, key: str) -> int:
        """Sampled requests counted under `key` (since it last entered the table)."""
        c = self.counts.get(key)
        return c[1] if c is not None else 0

    def _rate(self, f: float) -> tuple[float, float]:
        """(probability, factor) for a request whose rarest key has frequency f."""
        factor = 1.0
        if self.rare_slice_frequency > 0 and f < self.rare_slice_frequency:
            factor = min(self.max_oversample, self.rare_slice_frequency / max(f, 1e-300))
        return min(1.0, self.base_rate * factor), factor

    def probability(self, keys: Sequence[str]) -> tuple[float, float]:
        """(inclusion probability, oversampling factor) for a request with these slice keys (no counting)."""
        if not self.total:
            return self.base_rate, 1.0
        floor = 1.0 / self.total  # a key not counted yet is as rare as one request
        freqs = [max(self.seen(k) / self.total, floor) for k in keys if k not in self.ignore]
        return self._rate(min(freqs)) if freqs else (self.base_rate, 1.0)

    def decide(self, keys: Sequence[str]) -> Decision:
        """Count the request under its slice keys, then draw whether it is sampled.

        Args:
            keys: the request's slice keys.

        Returns:
            The Decision (one uniform draw from the seeded generator per call), with per-key ratios pi_k / p.
        """
        self.total += 1
        total, ignore = self.total, self.ignore
        counts = self.counts
        rows = []
        n_min = 0  # requests seen under the rarest non-ignored key (0: none)
        for k in keys:
            c = counts.get(k)
            if c is None:
                if len(counts) >= self.max_keys:
                    counts.popitem(last=False)
                    self.evicted += 1
                c = counts[k] = [1, 0]
            else:
                c[0] += 1
                counts.move_to_end(k)
            rows.append(c)
            if k not in ignore and (n_min == 0 or c[0] < n_min):
                n_min = c[0]
        p, factor = self._rate(n_min / total) if n_min else (self.base_rate, 1.0)
        sampled = self._draw() < p
        if not sampled:
            return Decision(False, p, 1.0 / p, factor)
        self.sampled_total += 1
        # pi_k / p per key: pi_k from the key's own frequency; ignored keys (e.g. "all", frequency 1) take the base
        ratios = []
        for k, c in zip(keys, rows):
            c[1] += 1
            pi = self.base_rate if k in ignore else self._rate(c[0] / total)[0]
            ratios.append(min(1.0, pi / p))
        return Decision(True, p, 1.0 / p, factor, tuple(ratios))

    def _draw(self) -> float:
        """Next uniform draw of the seeded generator (drawn in blocks: the same sequence as one call each)."""
        if self._pos >= len(self._block):
            self._block = self.rng.random(4096).tolist()
            self._pos = 0
        u = self._block[self._pos]
        self._pos += 1
        return u
