"""Gate evaluation (components/validate/gates.py) on hand-made metrics."""

import math
import os

import pandas as pd

from tailguard.components.validate.gates import GateResult, all_passed, evaluate_gates
from tailguard.core.spec import parse_spec


def _spec(gates, *, task="classification", batch_sizes=(1, 32), slices=None, cost=None, promotion=None):
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
        # promotion off: these tests evaluate single gates (perf-only, discovered-only); a promoting spec needs a
        # parity gate (Spec._cross_field), which is not what they are about
        "gates": gates, "benchmark": {"batch_sizes": list(batch_sizes)}, "cost": cost,
        "promotion": promotion if promotion is not None else {"enabled": False}})


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


def test_all_passed_is_false_when_a_gate_had_insufficient_data():
    ok = _one({"metric": "top1_agreement", "min": 0.9}, {"top1_agreement": 0.95})
    small = _one({"metric": "top1_agreement", "min": 0.99, "scope": "per_slice", "min_support": 1000})
    assert (ok.status, small.status) == ("passed", "insufficient_data")
    assert all_passed([ok]) is True
    assert all_passed([ok, small]) is False  # not judged is not passed: never promotable


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


# ------------------------------------------------------------------ confidence, relative and discovered gates
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from tailguard.components.validate.discovery import DiscoveryResult  # noqa: E402
from tailguard.core.parity import aggregate  # noqa: E402
from tailguard.core.slices import SliceGroup, per_slice_table  # noqa: E402
from tailguard.core.stats import newcombe_paired_bound as paired_difference_bound  # noqa: E402
from tailguard.core.stats import wilson_bound  # noqa: E402


def _rows(small_agree=30, big_agree=396, ref_correct=None, correct=None):
    """430 classification rows: group "small" = rows 0..29, group "big" = rows 30..429."""
    n = 430
    agree = np.zeros(n, bool)
    agree[:small_agree] = True
    agree[30:30 + big_agree] = True
    ps = {"top1_agree": agree, "kl_divergence": np.where(agree, 0.001, 0.5), "abs_error": np.where(agree, 0.01, 1.0),
          "non_finite": np.zeros(n, bool)}
    if correct is not None:
        ps.update(correct=correct, reference_correct=ref_correct)
    groups = [SliceGroup("grp", "small", np.arange(n) < 30, 30), SliceGroup("grp", "big", np.arange(n) >= 30, 400)]
    return ps, groups, per_slice_table("classification", ps, groups)


def _eval(gates, ps, groups, table, *, discovered=None, analysis=None, pass_rows=True):
    spec = _spec(gates, slices=[{"name": "grp", "column": "g"}])
    if analysis is not None:
        spec = spec.model_copy(update={"analysis": spec.analysis.model_validate(analysis)})
    kw = dict(per_sample=ps, groups=groups, discovered=discovered) if pass_rows else dict(discovered=discovered)
    return evaluate_gates(spec, "ort-fp32", aggregate("classification", ps), table, PERF, **kw)


def test_per_slice_confidence_gate_fails_on_bound_when_small_group_is_perfect():
    ps, groups, table = _rows()
    gate = {"metric": "top1_agreement", "min": 0.97, "scope": "per_slice", "confidence": 0.95}
    (res,) = _eval([gate], ps, groups, table)
    (point,) = _eval([{k: v for k, v in gate.items() if k != "confidence"}], ps, groups, table)
    assert point.status == "passed" and point.decided_on == "point"  # 1.0 and 0.99 both >= 0.97
    assert res.status == "failed" and res.decided_on == "bound" and res.confidence == 0.95
    assert res.gate == "top1_agreement>=0.97@lb95@per_slice"
    (small,) = res.detail["failing"]
    assert (small["value"], small["support"], small["estimate"]) == ("small", 30, 1.0)
    assert small["bound"] == pytest.approx(0.9173, abs=1e-4) == res.observed == res.bound
    assert res.estimate == 1.0 and "Wilson" in res.method


def test_per_slice_confidence_gate_passes_when_400_rows_are_at_099():
    ps, groups, table = _rows()
    gate = {"metric": "top1_agreement", "min": 0.97, "scope": "per_slice", "confidence": 0.95, "min_support": 31}
    (res,) = _eval([gate], ps, groups, table)
    assert res.status == "passed" and res.detail["judged"] == 1
    assert res.observed == pytest.approx(wilson_bound(396, 400, 0.95, "lower")) == res.bound
    assert 0.97 < res.observed < res.estimate == 0.99
    assert [i["value"] for i in res.detail["insufficient"]] == ["small"]


def test_confidence_gate_fails_with_reason_when_per_row_values_are_not_given():
    ps, groups, table = _rows()
    gates = [{"metric": "top1_agreement", "min": 0.5, "confidence": 0.95},
             {"metric": "top1_agreement", "min": 0.5, "scope": "per_slice", "confidence": 0.95}]
    overall, per_slice = _eval(gates, ps, groups, table, pass_rows=False)
    assert overall.status == "failed" and "per-row" in overall.detail["reason"] and overall.observed is None
    assert per_slice.status == "failed" and all("per-row" in f["reason"] for f in per_slice.detail["failing"])


def test_overall_confidence_gate_uses_upper_bootstrap_bound_when_metric_is_an_error():
    ps, groups, table = _rows(big_agree=392)
    gate = {"metric": "kl_divergence.mean", "max": 0.012, "confidence": 0.9}
    (res,) = _eval([gate], ps, groups, table, analysis={"bootstrap": {"samples": 400, "seed": 1}})
    assert res.gate == "kl_divergence.mean<=0.012@ub90"
    assert res.estimate == pytest.approx(aggregate("classification", ps)["kl_divergence.mean"])
    assert res.estimate < 0.012 < res.bound == res.observed  # passes on the point, fails on the bound
    assert res.status == "failed" and "bootstrap upper bound (400 resamples, seed 1)" in res.method


def test_relative_accuracy_gate_derives_threshold_from_reference_accuracy_when_max_drop_given():
    ref = np.zeros(430, bool)
    ref[:400] = True  # reference accuracy 400/430
    cand = ref.copy()
    cand[30:50] = False  # 20 rows lost, all in group "big"
    ps, groups, table = _rows(ref_correct=ref, correct=cand)
    tight, loose = _eval([{"metric": "accuracy", "max_drop": 0.04}, {"metric": "accuracy", "max_drop": 0.05}],
                         ps, groups, table)
    assert tight.gate == "accuracy>=ref-0.04"
    assert tight.threshold == pytest.approx(400 / 430 - 0.04) and tight.observed == pytest.approx(380 / 430)
    assert tight.detail == {"reference_score": pytest.approx(400 / 430), "max_drop": 0.04}
    assert tight.status == "failed" and loose.status == "passed"  # drop 20/430 = 0.0465
    (slice_res,) = _eval([{"metric": "accuracy", "max_drop": 0.04, "scope": "per_slice"}], ps, groups, table)
    # group thresholds differ: small 30/30 - 0.04, big 370/400 - 0.04; only big (0.875 < 0.885) fails
    assert slice_res.status == "failed" and [f["value"] for f in slice_res.detail["failing"]] == ["big"]
    assert slice_res.threshold == pytest.approx(370 / 400 - 0.04) and slice_res.observed == pytest.approx(350 / 400)
    assert slice_res.detail["failing"][0]["reference_score"] == pytest.approx(370 / 400)


def test_relative_accuracy_gate_decides_on_paired_difference_bound_when_confidence_given():
    ref = np.zeros(430, bool)
    ref[30:402] = True  # big group: 372/400 reference-correct
    cand = ref.copy()
    cand[30:34] = False  # point drop 0.01 in big
    ps, groups, table = _rows(ref_correct=ref, correct=cand)
    gates = [{"metric": "accuracy", "max_drop": 0.02, "scope": "per_slice", "min_support": 31, "confidence": 0.95},
             {"metric": "accuracy", "max_drop": 0.03, "scope": "per_slice", "min_support": 31, "confidence": 0.95},
             {"metric": "accuracy", "max_drop": 0.02, "scope": "per_slice", "min_support": 31}]
    tight, loose, point = _eval(gates, ps, groups, table)
    lb = paired_difference_bound(cand[30:], ref[30:], 0.95, "lower")
    assert -0.03 < lb < -0.02
    assert tight.gate == "accuracy>=ref-0.02@lb95@per_slice"
    assert tight.observed == pytest.approx(0.93 + lb) and tight.estimate == pytest.approx(0.92)
    assert tight.detail["failing"][0]["bound"] == pytest.approx(0.93 + lb)
    assert (tight.status, loose.status, point.status) == ("failed", "passed", "passed")
    assert "Newcombe" in tight.method


def test_relative_gate_uses_reference_score_one_when_metric_is_agreement():
    ps, groups, table = _rows()
    (res,) = _eval([{"metric": "top1_agreement", "max_drop": 0.005}], ps, groups, table)
    assert res.threshold == pytest.approx(0.995) and res.detail["reference_score"] == 1.0
    assert res.status == "failed" and res.observed == pytest.approx(426 / 430)


def _discovery(ps, significant=(True, False), support=(30, 400)):
    rows = 430
    masks = {("grp", "small"): np.arange(rows) < 30, ("grp", "big"): np.arange(rows) >= 30}
    table = pd.DataFrame({"slice": ["grp", "grp"], "value": ["small", "big"], "support": list(support),
                          "metric": "top1_agreement", "value_in_slice": [0.5, 0.99], "value_rest": [0.99, 0.5],
                          "drop": [0.49, 0.01], "p_value": [1e-6, 0.3], "q_value": [2e-6, 0.3],
                          "significant": list(significant)})
    return DiscoveryResult(table=table, masks=masks, tested=7, method="synthetic")


def test_discovered_gate_judges_only_significant_slices_when_discovery_found_some():
    ps, groups, table = _rows(small_agree=15)  # small: 0.5 agreement, big: 0.99
    gate = {"metric": "top1_agreement", "min": 0.95, "scope": "discovered"}
    (res,) = _eval([gate], ps, groups, table, discovered=_discovery(ps))
    assert res.gate == "top1_agreement>=0.95@discovered" and res.status == "failed"
    assert res.detail["judged"] == 1 and res.observed == 0.5 and res.min_support == 30
    (f,) = res.detail["failing"]
    assert (f["slice"], f["value"], f["support"], f["q_value"]) == ("grp", "small", 30, 2e-6)
    # the big group is not significant, so the gate passes when only it would be judged
    (ok,) = _eval([gate], ps, groups, table, discovered=_discovery(ps, significant=(False, True)))
    assert ok.status == "passed" and ok.observed == 0.99


def test_discovered_gate_passes_with_reason_when_no_slice_is_significant():
    ps, groups, table = _rows(small_agree=15)
    gate = {"metric": "top1_agreement", "min": 0.95, "scope": "discovered"}
    (res,) = _eval([gate], ps, groups, table, discovered=_discovery(ps, significant=(False, False)))
    assert res.status == "passed" and res.detail["reason"].startswith("no slice discovered")
    (small,) = _eval([gate | {"min_support": 50}], ps, groups, table, discovered=_discovery(ps))
    assert small.status == "insufficient_data" and small.detail["insufficient"][0]["value"] == "small"


def test_discovered_gate_fails_when_discovery_did_not_run():
    ps, groups, table = _rows()
    (res,) = _eval([{"metric": "top1_agreement", "min": 0.95, "scope": "discovered"}], ps, groups, table)
    assert res.status == "failed" and res.detail["reason"].startswith("discovery did not run")


def test_discovered_confidence_gate_bounds_each_slice_when_confidence_given():
    ps, groups, table = _rows(small_agree=29)
    gate = {"metric": "top1_agreement", "min": 0.9, "scope": "discovered", "confidence": 0.95}
    (res,) = _eval([gate], ps, groups, table, discovered=_discovery(ps))
    assert res.status == "failed" and res.estimate == pytest.approx(29 / 30)
    assert res.bound == pytest.approx(wilson_bound(29, 30, 0.95, "lower")) == res.detail["failing"][0]["bound"]


def test_gate_result_from_dict_loads_old_dict_when_new_fields_are_absent():
    old = {"gate": "top1_agreement>=0.99", "metric": "top1_agreement", "scope": "overall", "threshold": 0.99,
           "op": ">=", "observed": 0.995, "passed": True, "status": "passed", "method": "overall, all validation rows",
           "batch_size": None, "slice": None, "min_support": None, "detail": {}}
    res = GateResult.from_dict(old)
    assert (res.estimate, res.bound, res.confidence, res.decided_on) == (None, None, None, "point")
    assert GateResult.from_dict(res.to_dict()) == res


def test_plain_gate_records_point_estimate_when_no_new_fields_are_set():
    res = _one({"metric": "top1_agreement", "min": 0.99}, {"top1_agreement": 0.995})
    assert (res.estimate, res.bound, res.confidence, res.decided_on) == (0.995, None, None, "point")


# ------------------------------------------------------------------------ promotion: insufficient data never passes
def _tiny_onnx(path):
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def test_verdict_is_not_promoted_naming_the_gate_when_a_gate_had_insufficient_data():
    from tailguard.components.validate.gates import verdict
    from tailguard.components.validate.result import ValidationResult

    spec = _spec([{"metric": "top1_agreement", "min": 0.9},
                  {"metric": "top1_agreement", "min": 0.9, "scope": "per_slice", "min_support": 1000}])
    gates = evaluate_gates(spec, "ort-fp32", {"top1_agreement": 0.95}, TABLE, PERF)
    result = ValidationResult("ort-fp32", "classification", 300, {}, PERF, [], gates, all_passed(gates), 0, [1, 32])
    assert verdict(result) == (False, "not promoted: gate top1_agreement>=0.9@per_slice had insufficient data")


def test_register_and_promote_skips_the_variant_when_a_gate_had_insufficient_data(tmp_path):
    """Real sqlite MLflow store: two variants logged as the validate step logs them; the faster one has a per-slice
    gate no group could judge, so the slower, fully judged one gets the alias."""
    import mlflow

    from tailguard.components.register.logic import register_and_promote
    from tailguard.components.validate.result import ValidationResult
    from tailguard.components.validate.run_log import log_validated_model
    from tailguard.core.contract import GATES_TAG, STATUS_TAG, VARIANT_TAG, gate_tag

    spec = _spec([{"metric": "top1_agreement", "min": 0.9},
                  {"metric": "top1_agreement", "min": 0.9, "scope": "per_slice", "min_support": 30}],
                 promotion={"enabled": True})
    big = TABLE.assign(support=100, **{"top1_agreement": 0.99})      # every group judged, all pass
    small = TABLE.assign(support=5)                                  # every group under min_support
    model = _tiny_onnx(tmp_path / "m.onnx")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    # what was *set* (None: MLflow's default), not the resolved default, which set_*_uri would pin
    before = os.environ.get("MLFLOW_TRACKING_URI"), os.environ.get("MLFLOW_REGISTRY_URI")
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    try:
        client = mlflow.MlflowClient()
        exp = client.create_experiment("promo", artifact_location=(tmp_path / "artifacts").as_uri())
        parent = client.create_run(exp).info.run_id
        run_ids = {}
        for name, table, p50 in (("ort-fp32", big, 5.0), ("ort-fp16", small, 1.0)):
            perf = {1: {"latency_ms.p50": p50, "latency_ms.p99": 2 * p50, "throughput_per_s": 1000 / p50}}
            gates = evaluate_gates(spec, name, {"top1_agreement": 0.99}, table, perf)
            result = ValidationResult(name, "classification", 300, {"top1_agreement": 0.99}, perf, [], gates,
                                      all_passed(gates), 0, [1])
            run_id = client.create_run(exp, tags={"mlflow.parentRunId": parent, VARIANT_TAG: name,
                                                  STATUS_TAG: "ok"}).info.run_id
            work = tmp_path / name
            work.mkdir()
            log_validated_model(client, run_id, result, work_dir=work, model_file=model,
                                execution_provider="CPUExecutionProvider")
            client.set_terminated(run_id)
            run_ids[name] = run_id
        summary = register_and_promote(spec, parent_run_id=parent, experiment_id=exp, source_version="1")
        tags = client.get_run(run_ids["ort-fp16"]).data.tags
        alias = client.get_model_version_by_alias("m-optimized", "production")
    finally:
        mlflow.set_tracking_uri(before[0])
        mlflow.set_registry_uri(before[1])
    rows = {v.variant: v for v in summary.variants}
    assert summary.promoted_variant == "ort-fp32" and str(alias.version) == rows["ort-fp32"].version
    fp16 = rows["ort-fp16"]
    assert (fp16.status, fp16.passed, fp16.promoted) == ("ok", False, False)
    assert fp16.version is None  # a failing variant is not registered (promotion.register_variants: promoted)
    assert fp16.reason == "not promoted: gate top1_agreement>=0.9@per_slice had insufficient data"
    assert tags[GATES_TAG] == "failed" and tags[gate_tag("top1_agreement>=0.9@per_slice")] == "insufficient_data"
