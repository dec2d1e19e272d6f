"""Latency, throughput, cost and memory of one variant on this node.

Method (recorded in every result):
- Batches are drawn from the validation rows with a generator seeded by (bench.seed, batch size), so every
  variant is timed on the same rows. A pool of at most POOL_SIZE batches is built and padded before timing
  (padding and stacking are never timed) and cycled through.
- `bench.warmup` untimed runs per batch size, then up to `bench.iterations` timed runs, each timed alone with
  time.perf_counter_ns around `runner.run(feeds)`. Timing of a batch size stops early once `bench.max_seconds`
  of timed runs have passed, but never before MIN_SAMPLES samples.
- Percentiles: np.percentile with its default linear interpolation, in ms.
- throughput_per_s = batch_size * 1000 / mean latency (ms): rows per second of one stream, sequential runs.
- cost per 1M inferences = usd_per_hour / 3600 / throughput_per_s * 1e6 (`cost_per_1m`).
"""

from __future__ import annotations

import math
import resource
import sys
import time
from typing import Any, Sequence

import numpy as np

from tailguard.data import Dataset, make_batch
from tailguard.errors import InputError
from tailguard.runtime import Runner
from tailguard.spec import BenchmarkSpec

MIN_SAMPLES = 10  # timed samples kept even past max_seconds, so the percentiles mean something
POOL_SIZE = 32  # distinct pre-built batches cycled through per batch size


def _draw_batches(ds: Dataset, input_specs: Sequence, batch_size: int, n: int, seed: int,
                  pad_values: dict[str, float] | None) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng([seed, batch_size])
    replace = batch_size > ds.n_rows
    return [make_batch(ds, rng.choice(ds.n_rows, size=batch_size, replace=replace), input_specs,
                       pad_values=pad_values) for _ in range(n)]


def benchmark(runner: Runner, ds: Dataset, input_specs: Sequence, bench: BenchmarkSpec, *,
              pad_values: dict[str, float] | None = None) -> dict[int, dict[str, Any]]:
    """Time `runner` at every batch size of `bench` (method: module docstring).

    Args:
        runner: anything with run(feeds) -> outputs (`tailguard.runtime.Runner`).
        ds: the validation dataset the batches are drawn from (rows drawn with replacement only when
            batch_size > rows).
        input_specs: the spec's `model.inputs`.
        bench: the spec's `benchmark` section (batch_sizes, warmup, iterations, max_seconds, seed).
        pad_values: per-input pad value (spec `model.pad_values`).

    Returns:
        {batch size: {"latency_ms.p50", "latency_ms.p95", "latency_ms.p99", "latency_ms.mean": float ms,
        "throughput_per_s": float rows/s, "n_iterations": int timed runs, "warmup": int untimed runs,
        "stopped_early": bool (max_seconds reached), "samples_ms": list[float] every timed run in ms,
        "method": str}}.

    Raises:
        InputError: the dataset has no rows.
    """
    if ds.n_rows == 0:
        raise InputError("benchmark: the validation set has no rows", hint="check data.validation")
    out: dict[int, dict[str, Any]] = {}
    for bs in bench.batch_sizes:
        pool = _draw_batches(ds, input_specs, bs, min(POOL_SIZE, bench.warmup + bench.iterations), bench.seed,
                             pad_values)
        for i in range(bench.warmup):
            runner.run(pool[i % len(pool)])
        samples_ns: list[int] = []
        budget_ns = int(bench.max_seconds * 1e9)
        spent = 0
        stopped_early = False
        for i in range(bench.iterations):
            feeds = pool[i % len(pool)]
            t0 = time.perf_counter_ns()
            runner.run(feeds)
            dt = time.perf_counter_ns() - t0
            samples_ns.append(dt)
            spent += dt
            if spent >= budget_ns and len(samples_ns) >= MIN_SAMPLES and i + 1 < bench.iterations:
                stopped_early = True
                break
        ms = np.asarray(samples_ns, dtype=np.float64) / 1e6
        mean = float(ms.mean())
        out[bs] = {
            "latency_ms.p50": float(np.percentile(ms, 50)),
            "latency_ms.p95": float(np.percentile(ms, 95)),
            "latency_ms.p99": float(np.percentile(ms, 99)),
            "latency_ms.mean": mean,
            "throughput_per_s": bs * 1000.0 / mean if mean > 0 else math.inf,
            "n_iterations": len(samples_ns),
            "warmup": bench.warmup,
            "stopped_early": stopped_early,
            "samples_ms": ms.tolist(),
            "method": (f"{bench.warmup} warm-up + {len(samples_ns)} timed runs of batch {bs} (seed {bench.seed}), "
                       f"perf_counter_ns per run, np.percentile linear"),
        }
    return out


def cost_per_1m(usd_per_hour: float, throughput_per_s: float) -> float:
    """Cost of one million inferences (rows) on a node running the variant at `throughput_per_s`.

    Formula: usd_per_hour / 3600 (USD per second) / throughput_per_s (rows per second) * 1e6 rows.
    Assumes the node is fully used by one sequential stream at the measured throughput.

    Args:
        usd_per_hour: node price in USD per hour (spec `cost.usd_per_hour`).
        throughput_per_s: rows per second (`benchmark()[bs]["throughput_per_s"]`).

    Returns:
        USD per 1,000,000 rows; +inf when throughput is 0.

    Raises:
        InputError: a negative or NaN price or throughput.
    """
    if not (usd_per_hour >= 0) or not (throughput_per_s >= 0):
        raise InputError(f"cost_per_1m: need usd_per_hour >= 0 and throughput_per_s >= 0, got {usd_per_hour!r} "
                         f"and {throughput_per_s!r}")
    if throughput_per_s == 0:
        return math.inf
    return usd_per_hour / 3600.0 / throughput_per_s * 1e6


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far, in MiB (resource.getrusage ru_maxrss).

    ru_maxrss is in KiB on Linux and bytes on macOS. It is the process-wide high-water mark: in a KFP task
    (one variant per container) it is the variant's; in a local run it is an upper bound that includes
    whatever the process loaded before.
    """
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 1024.0
