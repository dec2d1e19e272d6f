"""Latency measured to a precision (issue 25 item 1, pipelines/core/latency.py): timing stops at fixed looks once
the speed ratio's interval is within `benchmark.precision` or every confident speed gate is decided; the bounds
are Bonferroni-corrected over the looks; stored rounds are replayed under another stopping rule.

No wall clock decides anything: the runners advance a fake clock (`interleaved_benchmark(clock=...)`, the seam)
by seeded noisy durations, so every timing here is deterministic.
"""

import numpy as np
import pandas as pd
import pytest

from tailguard.components.validate.timing import timing_rule
from tailguard.core.data import Dataset
from tailguard.core.latency import (
    DECISION_MIN_ROUNDS,
    add_speed_ratios,
    interleaved_benchmark,
    precision_reached,
    replay_interleaved,
    speed_ratio,
    timing_looks,
)
from tailguard.core.sequential_stats import look_confidence
from tailguard.core.spec import parse_spec
from tailguard.core.spec.benchmark import BenchmarkSpec
from tailguard.core.spec.model import TensorSpec

SPECS = [TensorSpec(name="x", dtype="float32", shape=["batch", 4])]


def _dataset(n=40):
    rows = [np.full(4, float(i), dtype=np.float32) for i in range(n)]
    return Dataset({"x": rows}, pd.DataFrame({"i": range(n)}), np.full(n, 4, dtype=np.int64), "mem://prec")


class Clock:
    def __init__(self):
        self.now = 0

    def __call__(self):
        return self.now


class NoisyRunner:
    """Advances the fake clock by mean_ms * exp(N(0, sigma)) per run (seeded): a node with per-run noise."""

    def __init__(self, clock, mean_ms, sigma, seed):
        self.clock, self.mean, self.sigma = clock, mean_ms, sigma
        self.rng = np.random.default_rng(seed)

    def run(self, feeds):
        self.clock.now += int(self.mean * np.exp(self.rng.normal(0, self.sigma)) * 1e6)
        return [feeds["x"]]


def _time(sigma, bench, decide, seed=0):
    clock = Clock()
    runners = {"variant": NoisyRunner(clock, 5.0, sigma, seed), "onnx_fp32": NoisyRunner(clock, 10.0, sigma, seed + 1)}
    return interleaved_benchmark(runners, _dataset(), SPECS, bench, clock=clock, decide=decide)


def _rule(precision):
    return lambda bs, s, look, n: precision_reached(s, precision, look, n, baseline="onnx_fp32", target="variant")


BENCH = BenchmarkSpec(batch_sizes=[1], warmup=0, iterations=400, max_seconds=1000)


def test_timing_stops_at_a_look_when_the_ratio_is_within_the_precision():
    out = _time(0.02, BENCH, _rule(0.03))
    row = out["variant"][1]
    assert timing_looks(BENCH) == [10, 20, 40, 80, 160, 320, 400]
    # precise after 10 rounds already, but no interval of fewer than DECISION_MIN_ROUNDS (30) rounds decides: the
    # first look past it (40)
    assert DECISION_MIN_ROUNDS == 30
    assert row["stopped_by"] == "decided" and row["n_iterations"] == 40 and row["n_looks"] == 7
    assert row["n_iterations"] == out["onnx_fp32"][1]["n_iterations"] and "at look" in row["method"]


def test_timing_runs_the_whole_budget_when_the_rounds_are_too_noisy_for_the_precision():
    out = _time(0.5, BENCH, _rule(0.01))
    row = out["variant"][1]
    assert row["stopped_by"] == "iterations" and row["n_iterations"] == 400 and row["looks"] == 7


def test_timing_without_a_rule_keeps_the_budget_and_its_fixed_bounds():
    out = _time(0.02, BENCH, None)
    row = out["variant"][1]
    assert row["n_iterations"] == 400 and "n_looks" not in row and "stopped_by" not in row


def test_ratio_bounds_after_looks_are_corrected_so_they_are_wider_than_one_fixed_look():
    out = _time(0.3, BENCH, _rule(0.001))  # never precise enough: the budget, 7 looks possible
    perf, base = out.pop("variant"), out
    add_speed_ratios(perf, base)
    row = perf[1]
    fixed = speed_ratio(base["onnx_fp32"][1]["samples_ms"], row["samples_ms"], 0.95)
    assert row["speedup_vs_onnx_fp32.lb95"] < fixed["lower"] and row["speedup_vs_onnx_fp32.ub95"] > fixed["upper"]
    assert "corrected for 7 looks" in row["ratio_method"]["speedup_vs_onnx_fp32"]
    assert row["quantile_bound_confidence"] == pytest.approx(look_confidence(0.95, 7))
    assert row["latency_ms.p50.lb95"] <= row["latency_ms.p50"] <= row["latency_ms.p50.ub95"]
    assert row["latency_ms.p99.ub95"] is None  # 400 rounds are too few for a p99 upper bound at 99.3%


def test_replayed_rounds_give_what_timing_with_that_rule_gives_on_the_same_rounds():
    stored = _time(0.1, BENCH, None)  # the full budget, as a first run without a rule stores it
    for precision in (0.2, 0.05, 0.02):
        fresh = _time(0.1, BENCH, _rule(precision))  # the same seeded durations: the same rounds, a prefix
        replayed = replay_interleaved({n: stored[n][1] for n in stored}, 1, BENCH, _rule(precision))
        for n in fresh:
            assert replayed[n]["samples_ms"] == fresh[n][1]["samples_ms"]
            assert replayed[n]["stopped_by"] == fresh[n][1]["stopped_by"]
    # stored rounds that stopped early under a loose rule are too few for a stricter one: measure again
    loose = _time(0.1, BENCH, _rule(0.2))
    assert loose["variant"][1]["stopped_by"] == "decided"
    assert replay_interleaved({n: loose[n][1] for n in loose}, 1, BENCH, _rule(0.02)) is None


def test_replay_reproduces_a_max_seconds_stop_from_the_stored_durations():
    bench = BenchmarkSpec(batch_sizes=[1], warmup=0, iterations=400, max_seconds=0.5)  # ~15 ms a round
    fresh = _time(0.1, bench, _rule(0.0001))
    assert fresh["variant"][1]["stopped_by"] == "max_seconds"
    replayed = replay_interleaved({n: fresh[n][1] for n in fresh}, 1, bench, _rule(0.0001))
    assert replayed["variant"]["samples_ms"] == fresh["variant"][1]["samples_ms"]
    assert replayed["variant"]["stopped_by"] == "max_seconds"


def _spec(gates, precision):
    return parse_spec({
        "apiVersion": "tailguard/v1", "kind": "OptimizationSpec", "metadata": {"name": "p"},
        "model": {"registered_name": "m", "task": "classification",
                  "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 4]}],
                  "outputs": [{"name": "y", "dtype": "float32", "shape": ["batch", 3]}]},
        "data": {"calibration": {"uri": "c.parquet"}, "validation": {"uri": "v.parquet"}},
        "variants": [{"name": "v", "backend": "onnxruntime", "precision": "fp32"}],
        "gates": [{"metric": "top1_agreement", "min": 0.9}, *gates],
        "benchmark": {"batch_sizes": [1], "warmup": 0, "iterations": 400, "max_seconds": 1000,
                      "precision": precision}})


def test_timing_rule_stops_when_every_confident_speed_gate_at_the_batch_size_is_decided():
    # a 2x speed-up against a gate at 1.5: decided long before a 0.1% precision would be reached
    gate = {"metric": "speedup_vs_onnx_fp32", "min": 1.5, "confidence": 0.95, "batch_size": 1}
    out = _time(0.1, BENCH, timing_rule(_spec([gate], 0.001), "v", baseline="onnx_fp32", target="variant"))
    assert out["variant"][1]["stopped_by"] == "decided" and out["variant"][1]["n_iterations"] == 40
    # without the gate this batch size decides nothing: it stops at its first look (10 rounds), bounds and all
    out = _time(0.1, BENCH, timing_rule(_spec([], 0.001), "v", baseline="onnx_fp32", target="variant"))
    assert out["variant"][1]["stopped_by"] == "decided" and out["variant"][1]["n_iterations"] == 10
    assert timing_rule(_spec([], None), "v", baseline="onnx_fp32", target="variant") is None


def test_timing_rule_keeps_timing_what_no_interval_of_the_rounds_can_decide_yet():
    # a p99 point gate: its order-statistic upper bound needs over 400 rounds at the corrected level, so the
    # budget (400) decides it as before; the p50 that picks a search's trial is timed to the precision or budget
    p99 = {"metric": "latency_ms.p99", "max": 1000.0, "batch_size": 1}
    out = _time(0.1, BENCH, timing_rule(_spec([p99], 0.001), "v", baseline="onnx_fp32", target="variant"))
    assert out["variant"][1]["stopped_by"] == "iterations"
    out = _time(0.1, BENCH, timing_rule(_spec([], 0.001), "v", baseline="onnx_fp32", target="variant",
                                        p50_decides=True))
    assert out["variant"][1]["stopped_by"] == "iterations"
    # a p50 gate far from the variant's 5 ms is decided within the first looks
    p50 = {"metric": "latency_ms.p50", "max": 50.0, "batch_size": 1}
    out = _time(0.1, BENCH, timing_rule(_spec([p50], 0.001), "v", baseline="onnx_fp32", target="variant"))
    assert out["variant"][1]["stopped_by"] == "decided" and out["variant"][1]["n_iterations"] == 40


def test_corrected_intervals_cover_the_true_ratio_at_their_level_when_timing_stops_at_the_precision():
    # Known answer: the variant is exactly 2x faster (log-normal per-run noise, sigma 0.15). 200 seeded timings
    # stopped at the first look within 5%: the corrected 90% two-sided interval (95% one-sided ends) must cover 2.0
    # in at least the 0.1% binomial quantile of Binomial(200, 0.9) of them (it is conservative: Bonferroni).
    from scipy import stats as st

    hits = 0
    reps = 200
    for seed in range(reps):
        out = _time(0.15, BenchmarkSpec(batch_sizes=[1], warmup=0, iterations=160, max_seconds=1000),
                    _rule(0.05), seed=2 * seed)
        perf, base = out.pop("variant"), out
        add_speed_ratios(perf, base, samples=400)
        hits += perf[1]["speedup_vs_onnx_fp32.lb95"] <= 2.0 <= perf[1]["speedup_vs_onnx_fp32.ub95"]
    assert hits >= st.binom.ppf(0.001, reps, 0.9)
