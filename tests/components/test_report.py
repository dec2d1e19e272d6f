"""The variant's HTML report (components/validate/report.py) and the whole validate step (logic.py) on a real tiny
ONNX Runtime model."""

import json
import re

import numpy as np
import onnx
import pandas as pd
import pytest
from onnx import TensorProto, helper, numpy_helper

from tailguard.components.validate.gates import GateResult
from tailguard.components.validate.logic import validate_variant
from tailguard.components.validate.report import write_report
from tailguard.components.validate.result import ValidationResult, sanitize_key_part
from tailguard.core.data import Dataset
from tailguard.core.errors import InputError
from tailguard.core.runtime import OrtRunner, run_dataset
from tailguard.core.spec import parse_spec


def _perf(ms):
    return {1: {"latency_ms.p50": ms, "latency_ms.p99": 2 * ms, "throughput_per_s": 1000 / ms, "n_iterations": 3,
                "samples_ms": [ms, ms * 1.5, ms * 2]}}


def test_write_report_has_gate_table_two_plots_and_escaped_values_when_slice_value_is_malicious(tmp_path):
    table = pd.DataFrame({"slice": ["lang", "lang"], "value": ["<script>alert(1)</script>", "en"],
                          "support": [40, 60], "top1_agreement": [0.8, 1.0]})
    gates = [GateResult(gate="top1_agreement>=0.9@per_slice", metric="top1_agreement", scope="per_slice",
                        threshold=0.9, op=">=", observed=0.8, passed=False, status="failed", min_support=30,
                        detail={"failing": [{"slice": "lang", "value": "<script>alert(1)</script>",
                                             "support": 40, "observed": 0.8}], "insufficient": []})]
    path = write_report(tmp_path / "r" / "report.html", variant="ort-<b>int8</b>",
                        overall={"top1_agreement": 0.92}, slice_table=table, gates=gates, perf=_perf(2.0),
                        reference_perf=_perf(3.0))
    text = path.read_text()
    assert "<script>" not in text and "&lt;script&gt;alert(1)&lt;/script&gt;" in text
    assert "<b>int8</b>" not in text
    assert '<table class="gates">' in text and "top1_agreement&gt;=0.9@per_slice" in text
    assert len(re.findall(r'<img [^>]*src="data:image/png;base64,', text)) == 2
    assert "FAILED" in text


# ------------------------------------------------------------------------------------ end to end, real ORT
def _linear_onnx(path, w):
    """y = x @ w: x float32 (batch, 4), y float32 (batch, 3)."""
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])],
        [numpy_helper.from_array(w.astype(np.float32), "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def _e2e_spec(gates):
    return parse_spec({
        "apiVersion": "tailguard/v1", "kind": "OptimizationSpec", "metadata": {"name": "e2e"},
        "model": {"registered_name": "lin", "task": "classification",
                  "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 4]}],
                  "outputs": [{"name": "y", "dtype": "float32", "shape": ["batch", 3]}]},
        "data": {"calibration": {"uri": "c.parquet"},
                 "validation": {"uri": "v.parquet", "label_column": "label", "batch_size": 16}},
        "slices": [{"name": "grp", "column": "grp"}, {"name": "score", "column": "score", "bins": [0, 0.5, 1]}],
        "variants": [{"name": "ort-fp32", "backend": "onnxruntime", "precision": "fp32"}],
        "gates": gates, "benchmark": {"batch_sizes": [1, 8], "warmup": 1, "iterations": 10},
        "cost": {"usd_per_hour": 3.6},
        "promotion": {"enabled": False}})  # validation only: gate lists here need no parity gate


@pytest.fixture(scope="module")
def e2e(tmp_path_factory):
    d = tmp_path_factory.mktemp("e2e")
    rng = np.random.default_rng(0)
    n = 120
    x = rng.normal(size=(n, 4)).astype(np.float32)
    w = rng.normal(size=(4, 3))
    frame = pd.DataFrame({"label": (x @ w).argmax(1), "grp": np.where(np.arange(n) < 100, "a/b", "<rare>"),
                          "score": rng.uniform(size=n)})
    ds = Dataset({"x": list(x)}, frame, np.full(n, 4, dtype=np.int64), str(d / "v.parquet"))
    ref_runner = OrtRunner(_linear_onnx(d / "ref.onnx", w))
    spec = _e2e_spec([])
    reference = run_dataset(ref_runner, ds, spec.model.inputs, batch_size=16)
    return d, ds, w, ref_runner, reference


def test_validate_variant_passes_and_writes_files_when_variant_equals_reference(e2e):
    d, ds, w, ref_runner, reference = e2e
    spec = _e2e_spec([{"metric": "top1_agreement", "min": 0.99},
                      {"metric": "top1_agreement", "min": 0.99, "scope": "per_slice", "min_support": 30},
                      {"metric": "latency_ms.p99", "max": 10000, "batch_size": 8}])
    baseline = {str(k): v for k, v in _perf(1000.0).items()}  # JSON-style keys are accepted
    res = validate_variant(spec, "ort-fp32", OrtRunner(d / "ref.onnx"), reference, ds, d / "same",
                           reference_perf=baseline, model_path=d / "ref.onnx")
    assert res.passed and res.overall["top1_agreement"] == 1.0 and res.non_finite_rows == 0
    assert [g.status for g in res.gates] == ["passed", "passed", "passed"]
    assert set(res.perf) == {1, 8} and res.perf[8]["n_iterations"] == 10
    assert res.perf[1]["usd_per_1m_inferences"] == pytest.approx(3.6 / 3600 / res.perf[1]["throughput_per_s"] * 1e6)
    assert res.perf[1]["speedup_vs_onnx_fp32"] == pytest.approx(1000.0 / res.perf[1]["latency_ms.p50"])
    assert "speedup_vs_torch" not in res.perf[1]
    assert res.overall["model_size_mb"] > 0 and res.overall["peak_rss_mb"] > 0
    for f in ("slices.csv", "report.html", "result.json"):
        assert (d / "same" / f).is_file()
    csv = pd.read_csv(d / "same" / "slices.csv")
    assert set(csv["value"]) == {"a/b", "<rare>", "[0,0.5)", "[0.5,1)"}
    loaded = ValidationResult.load(d / "same" / "result.json")
    assert loaded.to_dict() == json.loads(json.dumps(res.to_dict(), default=str))


def test_validate_variant_fails_gates_and_names_slices_when_weights_are_perturbed(e2e):
    d, ds, w, ref_runner, reference = e2e
    bad_w = w.copy()
    bad_w[:, 0] *= -1  # class 0 logits flip sign: many predictions change
    spec = _e2e_spec([{"metric": "top1_agreement", "min": 0.99},
                      {"metric": "top1_agreement", "min": 0.99, "scope": "per_slice", "slice": "grp",
                       "min_support": 30}])
    res = validate_variant(spec, "ort-fp32", OrtRunner(_linear_onnx(d / "bad.onnx", bad_w)), reference, ds,
                           d / "bad")
    assert not res.passed
    overall_gate, slice_gate = res.gates
    assert overall_gate.status == "failed" and overall_gate.observed < 0.99
    assert slice_gate.status == "failed"
    assert [f["value"] for f in slice_gate.detail["failing"]] == ["a/b"]
    assert [i["value"] for i in slice_gate.detail["insufficient"]] == ["<rare>"]  # 20 rows < 30
    assert res.worst_slice is not None and res.worst_slice["support"] >= 30


def test_mlflow_metrics_are_valid_mlflow_keys_when_slice_values_have_odd_characters(e2e):
    from mlflow.utils.validation import _validate_metric_name

    d, ds, w, ref_runner, reference = e2e
    res = validate_variant(_e2e_spec([]), "ort-fp32", ref_runner, reference, ds, d / "keys")
    m = res.mlflow_metrics()
    for key in m:
        _validate_metric_name(key)  # raises MlflowException on a key MLflow would refuse
    assert m["latency_ms.p99"] == m["bs1.latency_ms.p99"] == res.perf[1]["latency_ms.p99"]
    assert "bs8.latency_ms.p99" in m and "bs8.n_iterations" in m
    assert m["top1_agreement"] == 1.0 and m["gates_passed"] == 1.0
    assert m["slice.grp.a_b.support"] == 100 and m["slice.grp._rare_.top1_agreement"] == 1.0
    assert m["slice.score._0_0.5_.support"] + m["slice.score._0.5_1_.support"] == 120
    assert sanitize_key_part("[16,32)") == "_16_32_"


def test_validate_variant_raises_input_error_when_reference_rows_differ(e2e):
    d, ds, w, ref_runner, reference = e2e
    with pytest.raises(InputError, match="reference output has 10 rows"):
        validate_variant(_e2e_spec([]), "ort-fp32", ref_runner, [reference[0][:10]], ds, d / "short")


# ------------------------------------------------------------------ tail samples, discovery, bounds in the report
def _e2e_spec_with(gates, analysis):
    spec = _e2e_spec(gates)
    return spec.model_copy(update={"analysis": spec.analysis.model_validate(analysis)})


def test_validate_variant_writes_worst_samples_and_discovered_csv_when_discovery_enabled(e2e):
    from tailguard.core.parity import per_sample_metrics

    d, ds, w, ref_runner, reference = e2e
    bad_w = w.copy()
    bad_w[:, 0] *= -1
    spec = _e2e_spec_with([{"metric": "top1_agreement", "min": 0.5, "confidence": 0.95},
                           {"metric": "top1_agreement", "min": 0.99, "scope": "discovered"}],
                          {"worst_k": 7, "discovery": {"min_support": 10}})
    runner = OrtRunner(_linear_onnx(d / "bad2.onnx", bad_w))
    # "cls" (a copy of the label, which discovery does not search) marks the rows whose class-0 logit flipped
    ds = Dataset(ds.inputs, ds.frame.assign(cls="c" + ds.frame["label"].astype(str)), ds.lengths, ds.uri)
    res = validate_variant(spec, "ort-fp32", runner, reference, ds, d / "tail")
    worst = pd.read_csv(res.files["worst_samples_csv"])
    assert len(worst) == 7 and list(worst.columns[:2]) == ["row", "abs_error"]
    assert {"kl_divergence", "top1_agree", "correct", "non_finite", "label", "grp", "score"} <= set(worst.columns)
    ps = per_sample_metrics("classification", reference[0], run_dataset(runner, ds, spec.model.inputs,
                                                                        batch_size=16)[0])
    assert list(worst["row"]) == list(np.argsort(-ps["kl_divergence"], kind="stable")[:7])
    assert worst["kl_divergence"].is_monotonic_decreasing
    assert (d / "tail" / "discovered.csv").is_file() and res.discovery is not None
    significant = [r for r in res.discovered if r["significant"]]
    assert res.discovery["significant"] == len(significant) >= 1
    assert any(r["slice"] == "cls" and r["value"] == "c0" for r in significant)
    overall_gate, disc_gate = res.gates
    assert overall_gate.decided_on == "bound" and overall_gate.bound < overall_gate.estimate
    assert disc_gate.scope == "discovered" and disc_gate.status == "failed"
    assert ("cls", "c0") in {(f["slice"], f["value"]) for f in disc_gate.detail["failing"]}
    from mlflow.utils.validation import _validate_metric_name

    m = res.mlflow_metrics()
    for key in m:
        _validate_metric_name(key)
    assert m["discovered.count"] == len(significant)
    assert m["discovered.1.support"] == significant[0]["support"]
    assert m["discovered.1.q_value"] == significant[0]["q_value"] and m["discovered.1.drop"] > 0
    loaded = ValidationResult.load(d / "tail" / "result.json")
    assert loaded.discovered == json.loads(json.dumps(res.discovered, default=str))
    assert loaded.gates[0].bound == overall_gate.bound
    text = (d / "tail" / "report.html").read_text()
    assert "<th>bound</th>" in text and "Worst validation rows" in text and "Discovered slices" in text


def test_validate_variant_skips_discovery_when_disabled(e2e):
    d, ds, w, ref_runner, reference = e2e
    spec = _e2e_spec_with([], {"worst_k": 0, "discovery": {"enabled": False}})
    res = validate_variant(spec, "ort-fp32", ref_runner, reference, ds, d / "nodisc")
    assert res.discovery is None and res.discovered == [] and "discovered_csv" not in res.files
    assert not (d / "nodisc" / "discovered.csv").exists()
    assert "discovered.count" not in res.mlflow_metrics()
    assert len(pd.read_csv(res.files["worst_samples_csv"])) == 0


def test_worst_samples_ranks_lowest_cosine_first_and_renames_clashing_metadata_when_task_is_embedding():
    from tailguard.components.validate.scoring import worst_samples

    ps = {"cosine_similarity": np.array([0.9, 0.5, 0.99, 0.5]), "abs_error": np.array([0.1, 0.4, 0.0, 0.3]),
          "non_finite": np.zeros(4, bool)}
    frame = pd.DataFrame({"abs_error": ["a", "b", "c", "d"], "lang": ["en", "de", "fr", "it"]})
    out = worst_samples("embedding", ps, frame, 3)
    assert list(out["row"]) == [1, 3, 0]  # ties by row index
    assert list(out.columns) == ["row", "cosine_similarity", "abs_error", "non_finite", "meta.abs_error", "lang"]
    assert list(out["lang"]) == ["de", "it", "en"]
    with pytest.raises(InputError, match="metadata has 2 rows"):
        worst_samples("embedding", ps, frame.head(2), 3)


def test_validation_result_from_dict_loads_old_result_when_discovery_keys_are_absent(e2e):
    d, ds, w, ref_runner, reference = e2e
    res = validate_variant(_e2e_spec_with([{"metric": "top1_agreement", "min": 0.9}],
                                          {"discovery": {"enabled": False}}), "ort-fp32", ref_runner,
                           reference, ds, d / "old")
    old = res.to_dict()
    del old["discovered"], old["discovery"]
    for g in old["gates"]:
        for k in ("estimate", "bound", "confidence", "decided_on"):
            g.pop(k, None)
    loaded = ValidationResult.from_dict(old)
    assert loaded.discovered == [] and loaded.discovery is None
    assert loaded.gates[0].decided_on == "point" and loaded.gates[0].status == "passed"
