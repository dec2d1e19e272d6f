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

Speed ratios that survive a noisy node (`interleaved_benchmark`, `speed_ratio`, `add_speed_ratios`): the
variant and its baselines (the FP32 ONNX Runtime reference) are timed in one process, in rounds on the same
batch, order alternating A B / B A; speedup = median(baseline) / median(variant) over the rounds, with
one-sided bounds from a paired percentile bootstrap over rounds (speedup_vs_<baseline>.lb95 / .ub95). A
speed gate with `confidence` is decided on the bound (components/validate/gates.py).

Measured to a precision (issue 25, `benchmark.precision`): timing a batch size may stop before the budget at
fixed looks (`tailguard.core.sequential_stats.looks`: rounds 10, 20, 40, ... and the budget), when the caller's `decide`
says so (the validate step: the speed ratio's interval is within the precision, or every speed gate with a
confidence at that batch size is decided). Every interval reported or decided on after such timing is
Bonferroni-corrected over the looks the batch size could take (`sequential_stats.look_confidence`): with L looks a
95% bound is computed at 1 - 0.05 / L, so it holds whichever look the timing stopped at. Rows then carry `n_looks`,
`looks` (taken) and `stopped_by` ("decided", "max_seconds", "iterations"). p50 and p99 get distribution-free
order-statistic bounds at the same level (`add_quantile_bounds`: latency_ms.p50.lb95 / .ub95, latency_ms.p99.ub95;
None where the rounds are too few for one, e.g. a p99 upper bound needs 299 rounds at 95%).

Runners in one interleaved call must not keep the cores busy between their runs: ONNX Runtime's intra-op workers
spin-wait after each Run by default, and torch eager timed right after them waited on them (2.7x its solo p50 for
MiniLM on a 2-core node, issue 26); two ORT sessions slow each other the same way. Build every timed ORT session
with `tailguard.core.runtime.timed_ort_runner` (spinning off), as the reference pass, the validate step, the
promotion's paired rounds and `tailguard bench` do (issue 37: the measurements are beside that function).
"""

from __future__ import annotations

import math
import resource
import sys
import time
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from tailguard.core.data import Dataset, make_batch
from tailguard.core.errors import InputError
from tailguard.core.runtime import Runner
from tailguard.core.sequential_stats import look_confidence, looks, order_statistic_bound
from tailguard.core.spec.benchmark import BenchmarkSpec
from tailguard.core.stats import median_ratio as _median_ratio
from tailguard.core.stats import paired_ratio_bootstrap

MIN_SAMPLES = 10  # timed samples kept even past max_seconds, so the percentiles mean something
POOL_SIZE = 32  # distinct pre-built batches cycled through per batch size
LOOK_GROWTH = 2.0  # rounds double between the looks of a timing that may stop early (10, 20, 40, ...)
# No interval of fewer rounds decides anything (a gate, the precision, a promotion): the percentile bootstrap of a
# median ratio under-covers badly on a handful of rounds (two identical ONNX models came out "1.9x apart, lower bound
# 1.035" on 10 rounds of ~50 us runs; Efron & Tibshirani 1993, ch. 13: the percentile interval's coverage is only
# asymptotic). A timing with nothing to decide may still stop at its first look.
DECISION_MIN_ROUNDS = 30
# decide(batch size, {runner: samples in ms so far}, look number (1-based), looks possible) -> stop now?
Decide = Callable[[int, Mapping[str, np.ndarray], int, int], bool]


def timing_looks(bench: BenchmarkSpec) -> list[int]:
    """The rounds at which a timing with `decide` looks: MIN_SAMPLES, doubling, then `bench.iterations`
    (`tailguard.core.sequential_stats.looks`); a `max_seconds` stop between two of them takes the later one's place,
    so a batch size never takes more looks than this list holds."""
    return looks(MIN_SAMPLES, bench.iterations, LOOK_GROWTH)


def add_quantile_bounds(row: dict[str, Any], confidence: float = 0.95) -> None:
    """Add, in place, distribution-free bounds of the p50 and p99 latency to a perf row from its `samples_ms`
    (`sequential_stats.order_statistic_bound`, at `look_confidence(confidence, row["n_looks"])` when the row was
    timed with looks): latency_ms.p50.lb95 / .ub95 and latency_ms.p99.ub95 (ms; None when the rounds are too few for
    a bound at that level), and `quantile_bound_confidence` (the per-look level used)."""
    ms = np.asarray(row.get("samples_ms") or [], dtype=np.float64)
    level = look_confidence(confidence, int(row.get("n_looks") or 1))
    tag = f"{confidence * 100:g}"

    def finite(v: float) -> float | None:
        return v if math.isfinite(v) else None

    if ms.size:
        row[f"latency_ms.p50.lb{tag}"] = finite(order_statistic_bound(ms, 0.5, level, "lower"))
        row[f"latency_ms.p50.ub{tag}"] = finite(order_statistic_bound(ms, 0.5, level, "upper"))
        row[f"latency_ms.p99.ub{tag}"] = finite(order_statistic_bound(ms, 0.99, level, "upper"))
        row["quantile_bound_confidence"] = level


def _draw_batches(ds: Dataset, input_specs: Sequence, batch_size: int, n: int, seed: int,
                  pad_values: dict[str, float] | None) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng([seed, batch_size])
    replace = batch_size > ds.n_rows
    return [make_batch(ds, rng.choice(ds.n_rows, size=batch_size, replace=replace), input_specs,
                       pad_values=pad_values) for _ in range(n)]


def benchmark(runner: Runner, ds: Dataset, input_specs: Sequence, bench: BenchmarkSpec, *,
              pad_values: dict[str, float] | None = None,
              decide: Decide | None = None) -> dict[int, dict[str, Any]]:
    """Time `runner` at every batch size of `bench` (method: module docstring).

    Args:
        runner: anything with run(feeds) -> outputs (`tailguard.core.runtime.Runner`).
        ds: the validation dataset the batches are drawn from (rows drawn with replacement only when
            batch_size > rows).
        input_specs: the spec's `model.inputs`.
        bench: the spec's `benchmark` section (batch_sizes, warmup, iterations, max_seconds, seed).
        pad_values: per-input pad value (spec `model.pad_values`).
        decide: as `interleaved_benchmark`'s (called with {"runner": ms so far}), or None: the full budget.

    Returns:
        {batch size: {"latency_ms.p50", "latency_ms.p95", "latency_ms.p99", "latency_ms.mean": float ms,
        "throughput_per_s": float rows/s, "n_iterations": int timed runs, "warmup": int untimed runs,
        "stopped_early": bool (max_seconds reached or decided), "samples_ms": list[float] every timed run in ms,
        "method": str, the quantile bounds of `add_quantile_bounds`; with `decide` n_looks, looks, stopped_by}}.

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
        grid = timing_looks(bench) if decide is not None else []
        taken, stopped_by = 0, "iterations"
        for i in range(bench.iterations):
            feeds = pool[i % len(pool)]
            t0 = time.perf_counter_ns()
            runner.run(feeds)
            dt = time.perf_counter_ns() - t0
            samples_ns.append(dt)
            spent += dt
            over = spent >= budget_ns and len(samples_ns) >= MIN_SAMPLES and i + 1 < bench.iterations
            if decide is not None and i + 1 < bench.iterations and (over or (taken < len(grid) and
                                                                              i + 1 == grid[taken])):
                taken += 1
                if decide(bs, {"runner": np.asarray(samples_ns, dtype=np.float64) / 1e6}, taken, len(grid)):
                    stopped_early, stopped_by = True, "decided"
                    break
            if over:
                stopped_early, stopped_by = True, "max_seconds"
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
        if decide is not None:
            taken += stopped_by == "iterations"
            out[bs].update(n_looks=len(grid), looks=taken, stopped_by=stopped_by)
            out[bs]["method"] += (f"; stopped by {stopped_by} at look {taken} of {len(grid)} (bounds "
                                  f"Bonferroni-corrected over {len(grid)} looks)")
        add_quantile_bounds(out[bs])
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


# ------------------------------------------------------------------- interleaved timing and speed ratios
# The variant and its baselines are timed in the same process, in rounds on the same batch, so a noisy
# neighbour, a CPU frequency change or a thermal swing hits every runner of a round alike and cancels in the
# per-round comparison (two separate benchmarks minutes apart measured 0.40x and 1.51x for one INT8 variant).
RATIO_DEFAULT_CONFIDENCE = 0.95  # the bounds logged as <ratio>.lb95 / <ratio>.ub95
# A percentile bootstrap bound at one-sided level c is read between the lowest (1 - c) * samples resamples: at
# least this many of them, so a corrected level (0.99 at 5 looks) still has a tail to read (20 / 0.01 = 2000).
RESAMPLES_PER_TAIL = 20


def round_order(names: Sequence[str], round_index: int) -> list[str]:
    """The order the runners are timed in within round `round_index` (0-based): the given order in even
    rounds, reversed in odd rounds (A B, B A, A B, ...: each runner is first as often as last, so a drift within
    a round, e.g. a cache warmed by the previous runner, does not favour one of them)."""
    return list(names) if round_index % 2 == 0 else list(reversed(names))


def _summary(ms: np.ndarray, bs: int, warmup: int, stopped_early: bool, method: str) -> dict[str, Any]:
    mean = float(ms.mean())
    return {
        "latency_ms.p50": float(np.percentile(ms, 50)),
        "latency_ms.p95": float(np.percentile(ms, 95)),
        "latency_ms.p99": float(np.percentile(ms, 99)),
        "latency_ms.mean": mean,
        "throughput_per_s": bs * 1000.0 / mean if mean > 0 else math.inf,
        "n_iterations": int(ms.size),
        "warmup": warmup,
        "stopped_early": stopped_early,
        "samples_ms": ms.tolist(),
        "method": method,
    }


def interleaved_benchmark(runners: Mapping[str, Runner], ds: Dataset, input_specs: Sequence,
                          bench: BenchmarkSpec, *, pad_values: dict[str, float] | None = None,
                          clock: Callable[[], int] = time.perf_counter_ns,
                          decide: Decide | None = None, min_rounds: int = MIN_SAMPLES
                          ) -> dict[str, dict[int, dict[str, Any]]]:
    """Time several runners in interleaved rounds on the same batches (the variant and its baselines).

    Method, per batch size: the same seeded pool of batches as `benchmark` (`_draw_batches`); `bench.warmup`
    untimed rounds; then up to `bench.iterations` timed rounds. Round i feeds batch pool[i % len(pool)] to
    every runner, one after the other in `round_order(names, i)` (A B, B A, ...), each run timed alone with
    `clock()` before and after. Timing stops after the round in which the timed runs of all runners together
    reach `bench.max_seconds`, but never before `min_rounds` rounds (default MIN_SAMPLES; the promotion's rounds
    pass DECISION_MIN_ROUNDS, so a slow baseline beside the variants, torch eager on a loaded node, cannot spend
    the budget before any interval may decide; `bench.iterations` still caps them). Sample j of every runner is from
    round j, so `samples_ms` lists are paired by position (`speed_ratio` resamples whole rounds).

    With `decide` (measured to a precision, module docstring) the rounds are looked at after each of
    `timing_looks(bench)` rounds and at a `max_seconds` stop; `decide(bs, {name: ms so far}, look, n_looks)`
    returning True stops the batch size there. Its rows then carry `n_looks` (the looks the batch size could
    take: every bound on them is corrected for that many), `looks` (taken) and `stopped_by`.

    Args:
        runners: {name: runner with run(feeds)}, e.g. {"variant": ..., "onnx_fp32": ...}; at least one.
        ds: the validation dataset the batches are drawn from.
        input_specs: the spec's `model.inputs`.
        bench: the spec's `benchmark` section.
        pad_values: per-input pad value (spec `model.pad_values`).
        clock: monotonic clock in integer nanoseconds (the seam tests replace; default time.perf_counter_ns).
        decide: the stopping rule of a timing measured to a precision (see above), or None: the full budget.

    Returns:
        {runner name: {batch size: the `benchmark` entry (latency_ms.*, throughput_per_s, n_iterations,
        warmup, stopped_early, samples_ms, method; with `decide` also n_looks, looks, stopped_by)}}, every runner
        with the same n_iterations per batch size.

    Raises:
        InputError: no runner, or the dataset has no rows.
    """
    names = list(runners)
    if not names:
        raise InputError("interleaved_benchmark: no runner given")
    if ds.n_rows == 0:
        raise InputError("benchmark: the validation set has no rows", hint="check data.validation")
    out: dict[str, dict[int, dict[str, Any]]] = {n: {} for n in names}
    for bs in bench.batch_sizes:
        pool = _draw_batches(ds, input_specs, bs, min(POOL_SIZE, bench.warmup + bench.iterations), bench.seed,
                             pad_values)
        for i in range(bench.warmup):
            for n in round_order(names, i):
                runners[n].run(pool[i % len(pool)])
        samples: dict[str, list[int]] = {n: [] for n in names}
        budget_ns = int(bench.max_seconds * 1e9)
        spent = 0
        stopped_early = False
        grid = timing_looks(bench) if decide is not None else []
        taken, stopped_by = 0, "iterations"
        for i in range(bench.iterations):
            feeds = pool[i % len(pool)]
            for n in round_order(names, i):
                t0 = clock()
                runners[n].run(feeds)
                dt = clock() - t0
                samples[n].append(dt)
                spent += dt
            over = spent >= budget_ns and i + 1 >= min_rounds and i + 1 < bench.iterations
            if decide is not None and i + 1 < bench.iterations and (over or (taken < len(grid) and
                                                                              i + 1 == grid[taken])):
                taken += 1
                if decide(bs, {n: np.asarray(v, dtype=np.float64) / 1e6 for n, v in samples.items()}, taken,
                          len(grid)):
                    stopped_early, stopped_by = True, "decided"
                    break
            if over:
                stopped_early, stopped_by = True, "max_seconds"
                break
        rows = _interleaved_rows({n: np.asarray(samples[n], dtype=np.float64) / 1e6 for n in names}, bs, bench,
                                 stopped_early, stopped_by if decide is not None else None,
                                 taken + (stopped_by == "iterations"), len(grid))
        for n in names:
            out[n][bs] = rows[n]
    return out


def _interleaved_rows(samples_ms: Mapping[str, np.ndarray], bs: int, bench: BenchmarkSpec, stopped_early: bool,
                      stopped_by: str | None, looks_taken: int, n_looks: int) -> dict[str, dict[str, Any]]:
    """The per-runner rows of one batch size of `interleaved_benchmark` from its rounds (ms per runner, paired by
    position); `stopped_by` None: timed without looks (no n_looks / looks / stopped_by keys)."""
    names = list(samples_ms)
    rounds = len(samples_ms[names[0]])
    method = (f"{bench.warmup} warm-up + {rounds} timed rounds of batch {bs} (seed {bench.seed}) interleaved "
              f"with {', '.join(n for n in names)} (order alternating A B / B A per round, same batch per "
              f"round), one clock per run, np.percentile linear")
    if stopped_by is not None:
        method += (f"; stopped by {stopped_by} at look {looks_taken} of {n_looks} (bounds Bonferroni-corrected "
                   f"over {n_looks} looks)")
    out = {}
    for n in names:
        row = _summary(np.asarray(samples_ms[n], dtype=np.float64), bs, bench.warmup, stopped_early, method)
        if stopped_by is not None:
            row.update(n_looks=n_looks, looks=looks_taken, stopped_by=stopped_by)
        add_quantile_bounds(row)
        out[n] = row
    return out


def replay_interleaved(rows: Mapping[str, dict[str, Any]], bs: int, bench: BenchmarkSpec,
                       decide: Decide | None) -> dict[str, dict[str, Any]] | None:
    """The rows `interleaved_benchmark` would have returned for batch size `bs` with the stopping rule `decide`,
    from rounds timed before (a cached timing, e.g. under other gates), or None when those rounds are too few for
    it (they stopped by another rule before this one would have).

    Replays the run round by round on the stored samples: the same looks (`timing_looks`), the same `max_seconds`
    budget (from the cumulative times of the stored rounds), the same calls of `decide` on the rounds so far. The
    result is exactly what a timing with `decide` would give on those rounds (a rule that stops earlier uses a
    prefix of them).

    Args:
        rows: {runner: the stored row of `bs`}, each with `samples_ms` (paired by position) and, when timed with
            looks, `stopped_by`.
        bs: the batch size.
        bench: the benchmark section now (its warmup, iterations, max_seconds, precision must be those of the
            stored timing; callers key the cache on it).
        decide: the stopping rule now, or None (the full budget).

    Returns:
        {runner: row} for `bs`, or None.
    """
    names = list(rows)
    samples = {n: np.asarray(rows[n].get("samples_ms") or [], dtype=np.float64) for n in names}
    total = len(samples[names[0]]) if names else 0
    if total == 0 or any(len(v) != total for v in samples.values()):
        return None
    stored = rows[names[0]].get("stopped_by")  # None: stored without looks (the full budget)
    spent = np.cumsum(np.sum([samples[n] for n in names], axis=0))
    grid = timing_looks(bench) if decide is not None else []
    taken = 0
    budget_ms = bench.max_seconds * 1e3
    for r in range(1, total + 1):
        over = bool(spent[r - 1] >= budget_ms) and r >= MIN_SAMPLES and r < bench.iterations
        if decide is not None and r < bench.iterations and (over or (taken < len(grid) and r == grid[taken])):
            taken += 1
            if decide(bs, {n: v[:r] for n, v in samples.items()}, taken, len(grid)):
                return _interleaved_rows({n: v[:r] for n, v in samples.items()}, bs, bench, True, "decided", taken,
                                         len(grid))
        if over:
            return _interleaved_rows({n: v[:r] for n, v in samples.items()}, bs, bench, True,
                                     "max_seconds" if decide is not None else None, taken, len(grid))
    if total < bench.iterations:  # stored stopped by another rule ("decided") before the budget: too few rounds
        return None
    if decide is None and stored is not None and stored != "iterations":
        return None
    return _interleaved_rows(samples, bs, bench, False, "iterations" if decide is not None else None, taken + 1
                             if decide is not None else 0, len(grid))


def precision_reached(samples: Mapping[str, np.ndarray], precision: float, look: int, n_looks: int, *,
                      baseline: str | None, target: str, boot_samples: int = 1000, seed: int = 0) -> bool:
    """Whether the timing of one batch size is within `precision` at this look: the interval of the speed ratio
    baseline / target (`speed_ratio`, one-sided 95% ends corrected for `n_looks` looks) has a relative half-width
    (upper - lower) / 2 / ratio <= precision; without a baseline among `samples`, the interval of the target's
    p50 (`sequential_stats.order_statistic_bound`, same level) relative to the p50. Never before DECISION_MIN_ROUNDS
    rounds.

    Args:
        samples: {runner: ms per round so far}, as `decide` receives them.
        precision: relative half-width, e.g. 0.03 (spec `benchmark.precision`).
        look, n_looks: this look and the looks possible (`timing_looks`).
        baseline: the runner the ratio is taken against (e.g. "onnx_fp32"), or None.
        target: the runner timed (e.g. "variant").
        boot_samples, seed: bootstrap resamples and seed (spec analysis.bootstrap).
    """
    level = look_confidence(RATIO_DEFAULT_CONFIDENCE, n_looks)
    v = np.asarray(samples[target], dtype=np.float64)
    if v.size < DECISION_MIN_ROUNDS:
        return False
    if baseline is not None and baseline in samples:
        try:
            r = speed_ratio(samples[baseline], v, level, samples=boot_samples, seed=seed)
        except InputError:
            return False
        return (r["upper"] - r["lower"]) / 2.0 <= precision * r["ratio"]
    p50 = float(np.median(v))
    lo, hi = order_statistic_bound(v, 0.5, level, "lower"), order_statistic_bound(v, 0.5, level, "upper")
    return math.isfinite(lo) and math.isfinite(hi) and p50 > 0 and (hi - lo) / 2.0 <= precision * p50


def speed_ratio(baseline_ms: Sequence[float], variant_ms: Sequence[float], confidence: float = 0.95, *,
                samples: int = 1000, seed: int = 0) -> dict[str, Any]:
    """How many times faster the variant is than a baseline, with one-sided confidence bounds.

    Estimate: ratio of medians, median(baseline_ms) / median(variant_ms) (> 1: the variant is faster; the
    same definition as the point `speedup_vs_*` metrics). Bounds: paired percentile bootstrap over rounds
    (Efron & Tibshirani 1993, "An Introduction to the Bootstrap", ch. 13; `tailguard.core.stats.
    paired_ratio_bootstrap`, i.e. `scipy.stats.bootstrap(..., paired=True, method="percentile")`): rounds are
    resampled with replacement, keeping each round's baseline and variant times together, so what hit both in
    one round (a noisy neighbour) stays paired. The one-sided `confidence` lower / upper bounds are the ends of
    the two-sided interval at level 2 * confidence - 1.

    Args:
        baseline_ms: baseline latency per round, ms, shape (rounds,), from `interleaved_benchmark`.
        variant_ms: the variant's latency in the same rounds, ms, shape (rounds,).
        confidence: one-sided level in (0.5, 1).
        samples: bootstrap resamples (at least RESAMPLES_PER_TAIL / (1 - confidence) are drawn).
        seed: seed of numpy.random.default_rng for the resampling (the same timings give the same bounds).

    Returns:
        {"ratio": float, "lower": float, "upper": float, "rounds": int, "confidence": float, "method": str};
        the bounds equal the ratio when every round is alike.

    Raises:
        InputError: lengths differ, fewer than 2 rounds, or a non-finite or non-positive time.
        ValueError: confidence outside (0.5, 1).
    """
    if not (0.5 < float(confidence) < 1.0):
        raise ValueError(f"confidence must be in (0.5, 1), got {confidence!r}")
    b = np.asarray(baseline_ms, dtype=np.float64).reshape(-1)
    v = np.asarray(variant_ms, dtype=np.float64).reshape(-1)
    if b.shape != v.shape:
        raise InputError(f"speed_ratio: {b.size} baseline rounds but {v.size} variant rounds",
                         hint="pass the paired samples_ms of one interleaved_benchmark call")
    if b.size < 2:
        raise InputError(f"speed_ratio: need at least 2 rounds, got {b.size}", hint="raise benchmark.iterations")
    if not (np.isfinite(b).all() and np.isfinite(v).all() and (b > 0).all() and (v > 0).all()):
        raise InputError("speed_ratio: every time must be finite and > 0 ms")
    samples = max(int(samples), math.ceil(RESAMPLES_PER_TAIL / (1.0 - float(confidence))))
    method = (f"ratio of medians over {b.size} interleaved rounds; one-sided {confidence * 100:g}% bounds by a "
              f"paired percentile bootstrap over rounds ({samples} resamples, seed {seed}; scipy.stats.bootstrap)")
    ratio, lo, hi = paired_ratio_bootstrap(b, v, confidence, samples=samples, seed=seed)
    return {"ratio": ratio, "lower": lo, "upper": hi, "rounds": int(b.size), "confidence": float(confidence),
            "method": method}


def ratio_key(metric: str, side: str, confidence: float) -> str:
    """Perf-row / MLflow key of a ratio bound: ('speedup_vs_onnx_fp32', 'lower', 0.95) ->
    'speedup_vs_onnx_fp32.lb95'."""
    return f"{metric}.{'lb' if side == 'lower' else 'ub'}{confidence * 100:g}"


def add_speed_ratios(perf: dict[int, dict[str, Any]], baselines: Mapping[str, dict[int, dict[str, Any]]], *,
                     samples: int = 1000, seed: int = 0) -> None:
    """Add, in place, each interleaved baseline's speed ratio and its bounds to the variant's perf rows.

    For every baseline name B (e.g. "onnx_fp32", "torch") and batch size: `speedup_vs_B` (ratio of medians,
    `speed_ratio`), `speedup_vs_B.lb95` / `.ub95` (one-sided 95% bounds), `speedup_vs_B.rounds`, and the
    baseline's paired per-round times under `baseline_samples_ms[B]` (ms), which a gate with another
    `confidence` bounds again (`speed_ratio`). Rows timed with looks (`n_looks`) get bounds at
    `look_confidence(0.95, n_looks)`: still named .lb95 / .ub95, valid for the stopping rule.

    Args:
        perf: the variant's `interleaved_benchmark` entry {batch size: row}; rows gain the keys above.
        baselines: {baseline name: its `interleaved_benchmark` entry} from the same call.
        samples, seed: bootstrap resamples and seed (spec analysis.bootstrap).
    """
    for name, rows in baselines.items():
        for bs, row in perf.items():
            base = rows.get(bs)
            if not base:
                continue
            metric = f"speedup_vs_{name}"
            b, v = np.asarray(base["samples_ms"], dtype=np.float64), np.asarray(row["samples_ms"], dtype=np.float64)
            row.setdefault("baseline_samples_ms", {})[name] = b.tolist()
            row[f"{metric}.rounds"] = int(b.size)
            if b.size < 2 or b.size != v.size or not (b > 0).all() or not (v > 0).all():
                # no bound from one round (or an unusable timing): the point ratio only
                row[metric] = float(_median_ratio(b, v)) if b.size and v.size and np.median(v) > 0 else None
                continue
            level = look_confidence(RATIO_DEFAULT_CONFIDENCE, int(row.get("n_looks") or 1))
            r = speed_ratio(b, v, level, samples=samples, seed=seed)
            if level != RATIO_DEFAULT_CONFIDENCE:
                r["method"] += (f" at {level * 100:g}% per look: the 95% bounds corrected for {row['n_looks']} "
                                "looks (Bonferroni), valid at whichever look the timing stopped")
            row[metric] = r["ratio"]
            row[ratio_key(metric, "lower", RATIO_DEFAULT_CONFIDENCE)] = r["lower"]
            row[ratio_key(metric, "upper", RATIO_DEFAULT_CONFIDENCE)] = r["upper"]
            row.setdefault("ratio_method", {})[metric] = r["method"]
