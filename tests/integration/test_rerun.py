"""tailguard.rerun: which earlier local run a new run may be decided on again (only `gates` / `promotion` differ,
same data bytes, code and node), and the redecide component's refusals (components/redecide/logic.py).

Real files and specs; the registry is not reached: every case here is refused before the version is compared.
"""

import json
from pathlib import Path

import pytest

from tailguard import rerun
from tailguard.components.redecide.logic import NotDecidable, StoredOnly, spec_reasons
from tailguard.core.spec import parse_spec

URI = "sqlite:////nonexistent/tailguard-rerun-test/mlflow.db"  # never opened: each case is refused first


def spec_doc(root: Path, **overrides) -> dict:
    doc = {
        "apiVersion": "tailguard/v1", "kind": "OptimizationSpec", "metadata": {"name": "rerun"},
        "model": {"registered_name": "m", "task": "classification", "source": {"format": "onnx"},
                  "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 4]}],
                  "outputs": [{"name": "y", "dtype": "float32", "shape": ["batch", 3]}]},
        "data": {"calibration": {"uri": str(root / "calibration.parquet")},
                 "validation": {"uri": str(root / "validation.parquet")}},
        "variants": [{"name": "ort-fp32", "backend": "onnxruntime", "precision": "fp32"}],
        "gates": [{"metric": "top1_agreement", "min": 0.9}],
        "promotion": {"alias": "production"},
    }
    doc.update(overrides)
    return doc


@pytest.fixture
def root(tmp_path):
    (tmp_path / "calibration.parquet").write_bytes(b"calibration rows")
    (tmp_path / "validation.parquet").write_bytes(b"validation rows")
    return tmp_path


def recorded(root: Path, spec) -> Path:
    """A runs folder holding one finished run of `spec` (its rerun.json and a validation record)."""
    runs = root / "runs"
    (runs / "r1" / "validations").mkdir(parents=True)
    rerun.write_record(runs / "r1", spec, URI, pipeline_run="r1", version="1", sha256="ab" * 32)
    (runs / "r1" / "validations" / "ort-fp32.json").write_text(json.dumps({"variant": "ort-fp32"}))
    return runs


def test_spec_rest_sha256_is_equal_when_only_gates_and_promotion_differ(root):
    a = parse_spec(spec_doc(root))
    b = parse_spec(spec_doc(root, gates=[{"metric": "top1_agreement", "min": 0.5}],
                            promotion={"alias": "staging", "margin": 0.1}))
    c = parse_spec(spec_doc(root, benchmark={"batch_sizes": [4]}))
    assert rerun.spec_rest_sha256(a) == rerun.spec_rest_sha256(b) != rerun.spec_rest_sha256(c)


def test_earlier_run_finds_none_when_a_data_file_changed_bytes(root):
    spec = parse_spec(spec_doc(root))
    runs = recorded(root, spec)
    (root / "validation.parquet").write_bytes(b"validation rows, one more")
    found, why = rerun.earlier_run(spec, URI, None, runs)
    assert found is None and "only in gates or promotion" in why


def test_earlier_run_finds_none_when_the_code_changed(root, monkeypatch):
    spec = parse_spec(spec_doc(root))
    runs = recorded(root, spec)
    monkeypatch.setattr("tailguard.core.cache.code_sha256", lambda: "another tailguard")
    found, why = rerun.earlier_run(spec, URI, None, runs)
    assert found is None and "only in gates or promotion" in why


def test_earlier_run_finds_none_when_the_node_differs(root, monkeypatch):
    spec = parse_spec(spec_doc(root))
    runs = recorded(root, spec)
    monkeypatch.setattr("tailguard.core.hardware.node_facts", lambda: {"cpu": {"model": "another CPU"}})
    found, why = rerun.earlier_run(spec, URI, None, runs)
    assert found is None and "only in gates or promotion" in why


def test_earlier_run_finds_none_when_the_validation_data_is_remote(root):
    runs = recorded(root, parse_spec(spec_doc(root)))  # an earlier run with local data exists
    spec = parse_spec(spec_doc(root, data={"calibration": {"uri": str(root / "calibration.parquet")},
                                           "validation": {"uri": "s3://bucket/validation.parquet"}}))
    found, why = rerun.earlier_run(spec, URI, None, runs)
    assert found is None and "remote" in why


def test_spec_reasons_refuses_a_search_serving_targets_or_a_peak_rss_gate_and_accepts_plain_gates(root):
    assert spec_reasons(parse_spec(spec_doc(root))) is None
    searched = spec_doc(root)
    searched["variants"] = [{"name": "ort-int8", "backend": "onnxruntime", "precision": "int8",
                             "quantization": {"mode": "dynamic"}, "search": {"max_trials": 2}}]
    assert "search" in spec_reasons(parse_spec(searched))
    rss = spec_doc(root, gates=[{"metric": "top1_agreement", "min": 0.9}, {"metric": "peak_rss_mb", "max": 900}])
    assert "peak_rss_mb" in spec_reasons(parse_spec(rss))


def test_stored_only_runner_raises_not_decidable_when_asked_to_run_or_load():
    runner = StoredOnly("the variant")
    with pytest.raises(NotDecidable, match="did not measure"):
        runner.run({"x": None})
    with pytest.raises(NotDecidable):
        runner.input_names  # noqa: B018 - any use of the runner is a measurement


def test_earlier_run_finds_none_without_starting_a_task_when_a_variant_has_a_search(root):
    doc = spec_doc(root)
    doc["variants"] = [{"name": "ort-int8", "backend": "onnxruntime", "precision": "int8",
                        "quantization": {"mode": "dynamic"}, "search": {"max_trials": 2}}]
    spec = parse_spec(doc)
    found, why = rerun.earlier_run(spec, URI, None, recorded(root, spec))
    assert found is None and "search" in why


def test_earlier_run_finds_none_when_a_new_speed_gate_reads_the_reference_baselines(root):
    bench = {"batch_sizes": [1], "precision": 0.05}
    runs = recorded(root, parse_spec(spec_doc(root, benchmark=bench)))
    speed = parse_spec(spec_doc(root, benchmark=bench, gates=[
        {"metric": "top1_agreement", "min": 0.9}, {"metric": "speedup_vs_onnx_fp32", "min": 1.2}]))
    found, why = rerun.earlier_run(speed, URI, None, runs)  # baselines timed at their first look: time them again
    assert found is None and "only in gates or promotion" in why
    other = parse_spec(spec_doc(root, benchmark=bench, gates=[{"metric": "top1_agreement", "min": 0.5}]))
    found, why = rerun.earlier_run(other, URI, None, runs)  # matched: refused only at the (unreachable) registry
    assert found is None and "could not be resolved here" in why
