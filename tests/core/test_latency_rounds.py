"""Interleaved timing rounds and speed-ratio bounds (pipelines/core/latency.py), and speed gates decided on
the bound (components/validate/gates.py).

No test here reads the wall clock to decide anything: the statistics are checked on synthetic timings, the
round order and pairing with a fake clock injected at `interleaved_benchmark(clock=...)` (the one seam), and
the real benchmark on a tiny ONNX model is checked for structure only.
"""

import numpy as np
import pandas as pd
import pytest

from tailguard.components.validate.gates import evaluate_gates
from tailguard.components.validate.logic import validate_variant
from tailguard.core.data import Dataset
from tailguard.core.errors import InputError, SpecError
from tailguard.core.latency import (
    MIN_SAMPLES,
    add_speed_ratios,
    interleaved_benchmark,
    ratio_key,
    round_order,
    speed_ratio,
)
from tailguard.core.runtime import OrtRunner, run_dataset
from tailguard.core.spec import parse_spec
from tailguard.core.spec.benchmark import BenchmarkSpec
from tailguard.core.spec.model import TensorSpec

SPECS = [TensorSpec(name="x", dtype="float32", shape=["batch", 4])]


def _dataset(n=40):
    rows = [np.full(4, float(i), dtype=np.float32) for i in range(n)]
    return Dataset({"x": rows}, pd.DataFrame({"i": range(n)}), np.full(n, 4, dtype=np.int64), "mem://rounds")


def _noisy_node(rounds=200, speedup=2.0, seed=0):
    """Paired synthetic timings on a node whose speed swings 0.4x-2.5x from round to round (a shared machine):
    each round's slowdown hits the baseline and the variant alike; the variant is `speedup` times faster."""
    rng = np.random.default_rng(seed)
    node = np.exp(rng.uniform(np.log(0.4), np.log(2.5), size=rounds))
    baseline = 10.0 * node * np.exp(rng.normal(0, 0.02, size=rounds))
    variant = 10.0 / speedup * node * np.exp(rng.normal(0, 0.02, size=rounds))
    return baseline, variant


# ------------------------------------------------------------------------------------------ statistics
def test_speed_ratio_bounds_tight_around_true_ratio_when_node_noise_is_shared_by_the_round():
    b, v = _noisy_node(speedup=2.0)
    r = speed_ratio(b, v, 0.95, samples=1000, seed=0)
    assert r["lower"] <= r["ratio"] <= r["upper"]
    assert 1.9 < r["lower"] and r["upper"] < 2.1  # the 0.4x-2.5x node swing cancels within each round
    assert r["rounds"] == 200 and "paired percentile bootstrap" in r["method"]


def test_speed_ratio_bound_wide_when_the_rounds_are_unpaired():
    b, v = _noisy_node(speedup=2.0)
    paired = speed_ratio(b, v, 0.95)
    shuffled = speed_ratio(b, np.random.default_rng(1).permutation(v), 0.95)  # pairing destroyed
    assert (shuffled["upper"] - shuffled["lower"]) > 3 * (paired["upper"] - paired["lower"])


def test_speed_ratio_lower_bound_falls_when_confidence_rises():
    b, v = _noisy_node(rounds=40, speedup=1.5, seed=3)
    lows = [speed_ratio(b, v, c)["lower"] for c in (0.8, 0.95, 0.99)]
    ups = [speed_ratio(b, v, c)["upper"] for c in (0.8, 0.95, 0.99)]
    assert lows[0] >= lows[1] >= lows[2] and ups[0] <= ups[1] <= ups[2]


def test_speed_ratio_same_bounds_when_seed_is_the_same_and_bounds_equal_ratio_when_rounds_are_constant():
    b, v = _noisy_node(rounds=30)
    assert speed_ratio(b, v, 0.9, seed=7) == speed_ratio(b, v, 0.9, seed=7)
    r = speed_ratio([4.0] * 12, [2.0] * 12, 0.95)
    assert r["ratio"] == r["lower"] == r["upper"] == 2.0


@pytest.mark.parametrize("b,v,conf,err", [([1.0, 2.0], [1.0], 0.95, InputError),
                                          ([1.0], [1.0], 0.95, InputError),
                                          ([1.0, 0.0], [1.0, 1.0], 0.95, InputError),
                                          ([1.0, 2.0], [1.0, 1.0], 0.4, ValueError)])
def test_speed_ratio_raises_when_input_is_unusable(b, v, conf, err):
    with pytest.raises(err):
        speed_ratio(b, v, conf)


def test_add_speed_ratios_logs_ratio_bounds_and_paired_samples_when_baseline_interleaved():
    b, v = _noisy_node(rounds=50, speedup=1.5)
    perf = {1: {"samples_ms": v.tolist(), "latency_ms.p50": float(np.median(v))}}
    add_speed_ratios(perf, {"onnx_fp32": {1: {"samples_ms": b.tolist()}}}, samples=500, seed=0)
    row = perf[1]
    assert row["speedup_vs_onnx_fp32"] == pytest.approx(np.median(b) / np.median(v))
    assert row["speedup_vs_onnx_fp32.lb95"] <= row["speedup_vs_onnx_fp32"] <= row["speedup_vs_onnx_fp32.ub95"]
    assert row["baseline_samples_ms"]["onnx_fp32"] == b.tolist() and row["speedup_vs_onnx_fp32.rounds"] == 50
    assert ratio_key("speedup_vs_onnx_fp32", "upper", 0.9) == "speedup_vs_onnx_fp32.ub90"


# ------------------------------------------------------------------------- interleaving, fake clock seam
class FakeClock:
    """Nanoseconds that move only when a fake runner runs (the seam: interleaved_benchmark(clock=...))."""

    def __init__(self) -> None:
        self.now = 0

    def __call__(self) -> int:
        return self.now


class FakeRunner:
    """Advances the fake clock by `cost_ms` per run and logs (name, row ids of the batch)."""

    def __init__(self, name, cost_ms, clock, log) -> None:
        self.name, self.cost_ns, self.clock, self.log = name, int(cost_ms * 1e6), clock, log

    def run(self, feeds):
        self.log.append((self.name, tuple(feeds["x"][:, 0].astype(int))))
        self.clock.now += self.cost_ns
        return [feeds["x"]]


def _fakes(costs):
    clock, log = FakeClock(), []
    return {n: FakeRunner(n, c, clock, log) for n, c in costs.items()}, clock, log


def test_interleaved_benchmark_alternates_order_on_the_same_batch_when_two_runners():
    runners, clock, log = _fakes({"variant": 1.0, "onnx_fp32": 3.0})
    out = interleaved_benchmark(runners, _dataset(), SPECS,
                                BenchmarkSpec(batch_sizes=[2], warmup=2, iterations=6, max_seconds=100),
                                clock=clock)
    timed = log[2 * 2:]  # after 2 warm-up rounds of 2 runs
    assert [n for n, _ in timed] == ["variant", "onnx_fp32", "onnx_fp32", "variant"] * 3
    for i in range(6):  # both runners of a round see the same rows
        assert timed[2 * i][1] == timed[2 * i + 1][1]
    assert out["variant"][2]["samples_ms"] == [1.0] * 6 and out["onnx_fp32"][2]["samples_ms"] == [3.0] * 6
    assert round_order(["a", "b", "c"], 1) == ["c", "b", "a"]


def test_interleaved_benchmark_stops_all_runners_after_the_same_round_when_budget_is_spent():
    runners, clock, log = _fakes({"variant": 1.0, "onnx_fp32": 2.0})  # 3 ms per round
    out = interleaved_benchmark(runners, _dataset(), SPECS,
                                BenchmarkSpec(batch_sizes=[1, 4], warmup=0, iterations=100, max_seconds=0.05),
                                clock=clock)
    for bs in (1, 4):
        assert out["variant"][bs]["n_iterations"] == out["onnx_fp32"][bs]["n_iterations"] == 17  # 17*3 >= 50
        assert out["variant"][bs]["stopped_early"] and "interleaved" in out["variant"][bs]["method"]
    runners, clock, _ = _fakes({"variant": 1.0, "onnx_fp32": 2.0})
    tiny = interleaved_benchmark(runners, _dataset(), SPECS,
                                 BenchmarkSpec(batch_sizes=[1], warmup=0, iterations=50, max_seconds=1e-6),
                                 clock=clock)
    assert tiny["variant"][1]["n_iterations"] == MIN_SAMPLES  # never fewer rounds than MIN_SAMPLES


def test_interleaved_benchmark_times_min_rounds_when_a_slow_baseline_spends_the_budget_in_the_first_round():
    # the promotion's rounds (issue 37): torch eager at 1.6 s a run on a loaded node spent a 10 s budget in 10
    # rounds, fewer than any interval may decide on; min_rounds keeps timing up to DECISION_MIN_ROUNDS
    from tailguard.core.latency import DECISION_MIN_ROUNDS

    runners, clock, _ = _fakes({"variant": 50.0, "torch": 1600.0})
    out = interleaved_benchmark(runners, _dataset(), SPECS,
                                BenchmarkSpec(batch_sizes=[1], warmup=0, iterations=100, max_seconds=10),
                                clock=clock, min_rounds=DECISION_MIN_ROUNDS)
    assert out["variant"][1]["n_iterations"] == DECISION_MIN_ROUNDS and out["torch"][1]["stopped_early"]


def test_interleaved_benchmark_raises_when_no_runner_or_no_rows():
    with pytest.raises(InputError):
        interleaved_benchmark({}, _dataset(), SPECS, BenchmarkSpec())
    empty = Dataset({"x": []}, pd.DataFrame({"i": []}), np.zeros(0, dtype=np.int64), "mem://empty")
    with pytest.raises(InputError):
        interleaved_benchmark(_fakes({"v": 1.0})[0], empty, SPECS, BenchmarkSpec())


# --------------------------------------------------------------------------------------- gates and spec
def _spec(gates, **bench):
    return parse_spec({
        "apiVersion": "tailguard/v1", "kind": "OptimizationSpec", "metadata": {"name": "rounds"},
        "model": {"registered_name": "lin", "task": "classification",
                  "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 4]}],
                  "outputs": [{"name": "y", "dtype": "float32", "shape": ["batch", 3]}]},
        "data": {"calibration": {"uri": "c.parquet"}, "validation": {"uri": "v.parquet", "batch_size": 16}},
        "variants": [{"name": "int8", "backend": "onnxruntime", "precision": "fp32"}],
        "gates": gates, "benchmark": {"batch_sizes": [1], "warmup": 1, "iterations": 12, **bench},
        "promotion": {"enabled": False}})


def _perf_from(b, v):
    perf = {1: {"samples_ms": list(v), "latency_ms.p50": float(np.median(v))}}
    add_speed_ratios(perf, {"onnx_fp32": {1: {"samples_ms": list(b)}}})
    return perf


def test_speed_gate_fails_on_bound_but_passes_on_point_when_few_noisy_rounds():
    rng = np.random.default_rng(5)
    v = 10.0 * np.exp(rng.normal(0, 0.5, size=12))  # no shared node noise: independent, heavy swings
    b = 16.0 * np.exp(rng.normal(0, 0.5, size=12))
    perf = _perf_from(b, v)
    point = perf[1]["speedup_vs_onnx_fp32"]
    thr = point * 0.9  # the point estimate clears it
    plain, bounded = evaluate_gates(_spec([{"metric": "speedup_vs_onnx_fp32", "min": thr},
                                           {"metric": "speedup_vs_onnx_fp32", "min": thr, "confidence": 0.95}]),
                                    "int8", {}, pd.DataFrame(), perf)
    assert plain.status == "passed" and plain.decided_on == "point"
    assert bounded.status == "failed" and bounded.decided_on == "bound"
    assert bounded.estimate == pytest.approx(point) and bounded.observed == bounded.bound < thr
    assert bounded.gate == f"speedup_vs_onnx_fp32>={thr:g}@lb95" and "paired percentile bootstrap" in bounded.method


def test_speed_gate_passes_on_bound_when_the_node_is_noisy_but_rounds_are_paired():
    b, v = _noisy_node(rounds=60, speedup=2.0)
    (g,) = evaluate_gates(_spec([{"metric": "speedup_vs_onnx_fp32", "min": 1.8, "confidence": 0.95}]),
                          "int8", {}, pd.DataFrame(), _perf_from(b, v))
    assert g.status == "passed" and 1.8 <= g.bound <= g.estimate and g.detail["rounds"] == 60


def test_speed_gate_with_confidence_fails_with_reason_when_baseline_was_not_interleaved():
    perf = {1: {"samples_ms": [1.0] * 12, "latency_ms.p50": 1.0, "speedup_vs_onnx_fp32": 3.0}}
    (g,) = evaluate_gates(_spec([{"metric": "speedup_vs_onnx_fp32", "min": 1.5, "confidence": 0.9}]),
                          "int8", {}, pd.DataFrame(), perf)
    assert g.status == "failed" and g.observed is None and "not timed interleaved" in g.detail["reason"]


@pytest.mark.parametrize("metric", ["latency_ms.p50", "speedup_vs_torch"])
def test_spec_rejects_confidence_when_metric_is_not_an_interleaved_ratio(metric):
    with pytest.raises(SpecError) as exc:
        _spec([{"metric": metric, "min": 1.0, "confidence": 0.95}])
    assert "speedup_vs_onnx_fp32" in str(exc.value)


# ------------------------------------------------------------------------- real benchmark, structure only
from tests.components.test_report import _linear_onnx  # noqa: E402  y = x @ w, (batch, 4) -> (batch, 3)


def test_validate_variant_logs_interleaved_ratio_and_bounds_when_given_the_reference_runner(tmp_path):
    rng = np.random.default_rng(0)
    n = 40
    x = rng.normal(size=(n, 4)).astype(np.float32)
    w = rng.normal(size=(4, 3))
    ds = Dataset({"x": list(x)}, pd.DataFrame({"g": ["a"] * n}), np.full(n, 4, dtype=np.int64),
                 str(tmp_path / "v.parquet"))
    ref = OrtRunner(_linear_onnx(tmp_path / "ref.onnx", w))
    spec = _spec([{"metric": "speedup_vs_onnx_fp32", "min": 0.001, "confidence": 0.95}])
    reference = run_dataset(ref, ds, spec.model.inputs, batch_size=16)
    res = validate_variant(spec, "int8", OrtRunner(_linear_onnx(tmp_path / "var.onnx", w)), reference, ds,
                           tmp_path / "out", reference_perf={1: {"latency_ms.p50": 1e6}},
                           baseline_runners={"onnx_fp32": ref})
    row = res.perf[1]
    assert row["speedup_vs_onnx_fp32.lb95"] <= row["speedup_vs_onnx_fp32"] <= row["speedup_vs_onnx_fp32.ub95"]
    assert row["speedup_vs_onnx_fp32"] < 1e3  # the interleaved timing, not the stale reference_perf p50
    assert len(row["baseline_samples_ms"]["onnx_fp32"]) == row["n_iterations"] == len(row["samples_ms"])
    flat = res.mlflow_metrics()
    assert {"speedup_vs_onnx_fp32", "speedup_vs_onnx_fp32.lb95", "bs1.speedup_vs_onnx_fp32.ub95"} <= set(flat)
    (g,) = res.gates
    assert g.decided_on == "bound" and g.bound is not None and g.detail["rounds"] == row["n_iterations"]


def test_reference_pass_times_torch_and_onnx_fp32_interleaved_when_the_reference_is_torch(tmp_path):
    import torch

    from tailguard.components.reference.logic import time_baselines
    from tailguard.core.runtime import TorchRunner

    class Linear(torch.nn.Module):  # TorchRunner calls forward with the input names as keywords
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 2)

        def forward(self, x):
            return self.fc(x)

    module = Linear().eval()
    path = tmp_path / "linear.onnx"
    torch.onnx.export(module, (torch.zeros(1, 4),), str(path), input_names=["x"], output_names=["y"],
                      dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}}, dynamo=False)
    spec = type("S", (), {})()
    spec.model = type("M", (), {"inputs": SPECS, "pad_values": None})()
    spec.benchmark = BenchmarkSpec(batch_sizes=[1, 4], warmup=1, iterations=7, max_seconds=60)
    out = time_baselines(path, TorchRunner(module, ["x"]), _dataset(), spec)
    assert out["rows"] == 40 and set(out["torch"]) == set(out["onnx_fp32"]) == {1, 4}
    for bs in (1, 4):
        torch_row, onnx_row = out["torch"][bs], out["onnx_fp32"][bs]
        # one loop of paired rounds: the same number of samples, and the method says so
        assert len(torch_row["samples_ms"]) == len(onnx_row["samples_ms"]) == 7
        assert "interleaved with onnx_fp32, torch" in onnx_row["method"] == torch_row["method"]
        assert "allow_spinning=0" in torch_row["method"]  # runtime.timed_ort_runner (issue 37)
    assert out["warnings"] == [] or all("unstable" in w for w in out["warnings"])
    alone = time_baselines(path, None, _dataset(), spec)
    assert alone["torch"] is None and "interleaved" not in alone["onnx_fp32"][1]["method"]
    assert alone["warnings"] == []
