"""Benchmark structure (pipelines/core/latency.py). Structural checks with wide bands, not timed tests.

The runner here is a stand-in that sleeps: the benchmark's contract (warm-up not timed, seeded batches,
early stop, statistics) is independent of what the runner computes; real ONNX Runtime runners are timed in
tests/components/test_report.py's end-to-end validation.
"""

import time

import numpy as np
import pandas as pd
import pytest

from tailguard.core.data import Dataset
from tailguard.core.errors import InputError
from tailguard.core.latency import MIN_SAMPLES, benchmark, cost_per_1m, peak_rss_mb
from tailguard.core.spec.benchmark import BenchmarkSpec
from tailguard.core.spec.model import TensorSpec

SPECS = [TensorSpec(name="x", dtype="float32", shape=["batch", "sequence"])]


def _dataset(n=40):
    rows = [np.full(3 + i % 5, float(i), dtype=np.float32) for i in range(n)]
    return Dataset({"x": rows}, pd.DataFrame({"i": range(n)}), np.array([len(r) for r in rows]), "mem://test")


class SleepRunner:
    """Sleeps `ms` per run and records the row ids of every batch (first element of each row)."""

    def __init__(self, ms: float = 2.0) -> None:
        self.ms, self.calls = ms, []

    def run(self, feeds):
        self.calls.append(feeds["x"][:, 0].astype(int).tolist())
        time.sleep(self.ms / 1000)
        return [feeds["x"][:, :1]]


def test_benchmark_p50_near_sleep_when_runner_sleeps_2ms():
    runner = SleepRunner(2.0)
    perf = benchmark(runner, _dataset(), SPECS, BenchmarkSpec(batch_sizes=[1, 4], warmup=3, iterations=15))
    for bs in (1, 4):
        r = perf[bs]
        assert 1.9 <= r["latency_ms.p50"] <= 50.0
        assert r["latency_ms.p50"] <= r["latency_ms.p95"] <= r["latency_ms.p99"]
        assert r["n_iterations"] == 15 and len(r["samples_ms"]) == 15
        assert r["throughput_per_s"] == pytest.approx(bs * 1000 / r["latency_ms.mean"])
        assert r["latency_ms.p99"] == pytest.approx(np.percentile(r["samples_ms"], 99))
    assert len(runner.calls) == 2 * (3 + 15)  # warm-up runs happen but are not among the samples


def test_benchmark_excludes_warmup_when_warmup_runs_are_slow():
    class SlowStart(SleepRunner):
        def run(self, feeds):
            self.ms = 60.0 if len(self.calls) < 2 else 1.0
            return super().run(feeds)

    perf = benchmark(SlowStart(), _dataset(), SPECS, BenchmarkSpec(batch_sizes=[2], warmup=2, iterations=10))
    assert max(perf[2]["samples_ms"]) < 55.0


def test_benchmark_stops_early_but_keeps_min_samples_when_max_seconds_is_tiny():
    perf = benchmark(SleepRunner(1.0), _dataset(), SPECS,
                     BenchmarkSpec(batch_sizes=[1], warmup=0, iterations=200, max_seconds=0.001))
    assert perf[1]["n_iterations"] == MIN_SAMPLES and perf[1]["stopped_early"] is True


def test_benchmark_draws_same_rows_when_seed_is_same_and_other_rows_when_seed_differs():
    def rows(seed):
        runner = SleepRunner(0.0)
        benchmark(runner, _dataset(), SPECS, BenchmarkSpec(batch_sizes=[4], warmup=1, iterations=10, seed=seed))
        return runner.calls

    assert rows(7) == rows(7)
    assert rows(7) != rows(8)


def test_benchmark_raises_input_error_when_dataset_is_empty():
    empty = Dataset({"x": []}, pd.DataFrame(), np.zeros(0, dtype=np.int64), "mem://empty")
    with pytest.raises(InputError, match="no rows"):
        benchmark(SleepRunner(), empty, SPECS, BenchmarkSpec(batch_sizes=[1], iterations=1))


def test_cost_per_1m_follows_formula_when_throughput_known():
    assert cost_per_1m(3.6, 1000.0) == pytest.approx(1.0)  # 3.6 USD/h = 0.001 USD/s; 1000 rows/s -> 1 USD/1M
    assert cost_per_1m(2.5, 250.0) == pytest.approx(2.5 / 3600 / 250 * 1e6)
    assert cost_per_1m(1.0, 0.0) == float("inf")
    with pytest.raises(InputError):
        cost_per_1m(-1.0, 10.0)


def test_peak_rss_mb_is_at_least_current_rss_when_measured():
    import psutil

    current = psutil.Process().memory_info().rss / 2**20
    assert current * 0.95 <= peak_rss_mb() < 1e6
