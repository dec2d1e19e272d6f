"""Gate evaluation (components/validate/gates.py) on hand-made metrics."""

import math

import pandas as pd

from tailguard.components.validate.gates import GateResult, all_passed, evaluate_gates
from tailguard.spec import parse_spec


def _spec(gates, *, task="classification", batch_sizes=(1, 32), slices=None, cost=None):
    return parse_spec({
        "apiVersion": "tailguard/v1", "kind": "OptimizationSpec", "metadata": {"name": "gates-test"},
        "model": {"registered_name": "m", "task": task,
                  "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 4]}],
                  "outputs": [{"name": "y", "dtype": "float32", "shape": ["batch", 3]}]},
        "data": {"calibration": {"uri": "c.parquet"}, "validation": {"uri": "v.parquet"}},
        "slices": slices if slices is not None else [{"name": "length", "column": "n"},
                                                     {"name": "lang", "column": "l"}],
        "variants": [{"name": "ort-fp32", "backend": "onnxruntime", "precision": "fp32"},
                     {"name": "ort-fp16", "backend": "onnxruntime", "precision": "fp16"}],
        "gates": gates, "benchmark": {"batch_sizes": list(batch_sizes)}, "cost": cost})


TABLE = pd.DataFrame({
    "slice": ["length", "length", "length", "lang", "lang"],
    "value": ["[0,16)", "[16,32)", "[32,64)", "en", "<script>"],
    "support": [100, 50, 5, 140, 15],
    "top1_agreement": [0.99, 0.96, 0.2, 0.995, 0.5],
    "abs_error.max": [0.1, 0.3, 9.0, 0.05, 4.0],
})
PERF = {1: {"latency_ms.p50": 2.0, "latency_ms.p99": 4.0, "throughput_per_s": 500.0},
        32: {"latency_ms.p50": 20.0, "latency_ms.p99": 40.0, "throughput_per_s": 1600.0}}


def _one(gate, overall=None, table=TABLE, perf=PERF, variant="ort-fp32", **spec_kw) -> GateResult:
    (res,) = evaluate_gates(_spec([gate], **spec_kw), variant, overall or {}, table, perf)
    return res


def test_overall_gate_passes_or_fails_by_bound_when_min_or_max():
    assert _one({"metric": "top1_agreement", "min": 0.99}, {"top1_agreement": 0.995}).status == "passed"
    failed = _one({"metric": "top1_agreement", "min": 0.99}, {"top1_agreement": 0.98})
    assert (failed.status, failed.passed, failed.observed, failed.op, failed.threshold) == (
        "failed", False, 0.98, ">=", 0.99)
    assert _one({"metric": "abs_error.max", "max": 0.5}, {"abs_error.max": 0.5}).passed is True  # bound inclusive
    assert _one({"metric": "abs_error.max", "max": 0.5}, {"abs_error.max": math.inf}).passed is False


def test_per_slice_gate_observes_worst_sufficient_group_when_small_groups_exist():
    res = _one({"metric": "top1_agreement", "min": 0.95, "scope": "per_slice", "min_support": 30})
    assert res.status == "passed"
    assert res.observed == 0.96  # worst judged group; the 0.2 and 0.5 groups have support < 30
    assert {(i["slice"], i["value"]) for i in res.detail["insufficient"]} == {("length", "[32,64)"),
                                                                             ("lang", "<script>")}
    assert res.detail["judged"] == 3 and res.min_support == 30


def test_per_slice_gate_lists_failing_groups_when_one_group_is_below():
    res = _one({"metric": "top1_agreement", "min": 0.97, "scope": "per_slice", "slice": "length",
                "min_support": 10})
    assert res.status == "failed" and res.observed == 0.96
    assert res.detail["failing"] == [{"slice": "length", "value": "[16,32)", "support": 50, "observed": 0.96}]
    assert res.detail["insufficient"] == [{"slice": "length", "value": "[32,64)", "support": 5}]


def test_per_slice_max_gate_observes_highest_error_when_scope_is_per_slice():
    res = _one({"metric": "abs_error.max", "max": 1.0, "scope": "per_slice", "min_support": 10})
    assert res.status == "failed" and res.observed == 4.0
    assert [f["value"] for f in res.detail["failing"]] == ["<script>"]


def test_per_slice_gate_is_insufficient_not_passed_when_every_group_is_small():
    res = _one({"metric": "top1_agreement", "min": 0.99, "scope": "per_slice", "min_support": 1000})
    assert res.status == "insufficient_data" and res.passed is None and res.observed is None
    assert len(res.detail["insufficient"]) == 5
    assert all_passed([res]) is True
    assert all_passed([res], strict=True) is False


def test_perf_gate_reads_its_batch_size_when_batch_size_given_else_the_first():
    at32 = _one({"metric": "latency_ms.p99", "max": 30, "batch_size": 32})
    assert (at32.batch_size, at32.observed, at32.status) == (32, 40.0, "failed")
    default = _one({"metric": "latency_ms.p99", "max": 30})
    assert (default.batch_size, default.observed, default.status) == (1, 4.0, "passed")
    thr = _one({"metric": "throughput_per_s", "min": 1000, "batch_size": 32})
    assert thr.status == "passed"


def test_gate_fails_with_reason_when_metric_was_not_measured():
    res = _one({"metric": "usd_per_1m_inferences", "max": 1.0})
    assert res.status == "failed" and res.observed is None and "no cost section" in res.detail["reason"]
    acc = _one({"metric": "accuracy", "min": 0.5}, {"top1_agreement": 1.0})
    assert acc.status == "failed" and "label_column" in acc.detail["reason"]


def test_gate_not_applicable_when_variants_exclude_this_variant():
    gate = {"metric": "top1_agreement", "min": 0.99, "variants": ["ort-fp16"]}
    res = _one(gate, {"top1_agreement": 0.5}, variant="ort-fp32")
    assert res.status == "not_applicable" and res.passed is None
    assert _one(gate, {"top1_agreement": 0.5}, variant="ort-fp16").status == "failed"


def test_evaluate_gates_reports_every_gate_when_several_fail():
    spec = _spec([{"metric": "top1_agreement", "min": 0.99}, {"metric": "abs_error.max", "max": 0.1},
                  {"metric": "latency_ms.p50", "max": 1.0}])
    results = evaluate_gates(spec, "ort-fp32", {"top1_agreement": 0.5, "abs_error.max": 2.0}, TABLE, PERF)
    assert [r.status for r in results] == ["failed", "failed", "failed"]
    assert [r.gate for r in results] == ["top1_agreement>=0.99", "abs_error.max<=0.1", "latency_ms.p50<=1"]
    assert all_passed(results) is False
    assert GateResult.from_dict(results[0].to_dict()) == results[0]
