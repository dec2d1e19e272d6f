"""Typed results (tailguard.core.results) and the register step reading them instead of tags.

Real parts: a sqlite MLflow store under tmp_path, runs logged by the validate step's own `log_validated_model`
(a one-node ONNX model logged with mlflow.onnx). No mocks.
"""

from __future__ import annotations

import json
import math
import os

import pandas as pd
import pytest

from tailguard.core.contract import VARIANT_RESULT_FILE
from tailguard.core.results import (
    BUILD_RESULT_SCHEMA,
    VARIANT_RESULT_SCHEMA,
    BuildResult,
    ResultFormatError,
    VariantResult,
)
from tailguard.core.spec import parse_spec
from tests.components.test_gates import _tiny_onnx  # the identity ONNX model of the promotion tests


def _result(**kw) -> VariantResult:
    base = dict(variant="ort-int8", backend="onnxruntime", precision="int8", status="ok", passed=True,
                run_id="abc", model_uri="models:/m-1", sha256="0" * 64,
                perf={1: {"latency_ms.p50": 1.5, "speedup_vs_onnx_fp32": math.inf},
                      32: {"latency_ms.p50": 9.0, "n_iterations": 40.0}},
                overall={"top1_agreement": 0.99, "quantized_mac_fraction": 1.0},
                gates=[{"gate": "top1_agreement>=0.9@per_slice:lang", "status": "passed", "metric": "top1_agreement",
                        "observed": 0.95, "threshold": 0.9}],
                worst_slice={"slice": "lang", "value": "en", "support": 40, "metric": "top1_agreement",
                             "observed": 0.95},
                discovered=[{"slice": "n", "value": "[0,16)", "support": 30, "q_value": 0.01}],
                quantized_mac_fraction=1.0, search_of="ort-int8-base", trial_run_id="t1")
    return VariantResult(**{**base, **kw})


# ------------------------------------------------------------------------------------------------ unit
def test_variant_result_round_trips_through_json_when_perf_keys_are_ints_and_a_value_is_inf():
    r = _result()
    back = VariantResult.from_dict(json.loads(json.dumps(r.to_dict())))
    assert back == r
    assert back.perf_value(1, "speedup_vs_onnx_fp32") == math.inf and back.perf_value(32, "latency_ms.p50") == 9.0
    assert back.perf_value(8, "latency_ms.p50") is None  # a batch size not benchmarked
    assert back.gate_statuses() == {"top1_agreement>=0.9@per_slice:lang": "passed"}
    assert r.to_dict()["schema_version"] == VARIANT_RESULT_SCHEMA


def test_variant_result_read_refuses_the_file_naming_it_when_schema_version_is_missing_or_unknown(tmp_path):
    d = _result().to_dict()
    for version in (None, VARIANT_RESULT_SCHEMA + 1, "1"):
        p = tmp_path / f"v{version}.json"
        p.write_text(json.dumps({**{k: v for k, v in d.items() if k != "schema_version"},
                                 **({} if version is None else {"schema_version": version})}))
        with pytest.raises(ResultFormatError, match="schema_version") as err:
            VariantResult.read(p)
        assert str(p) in err.value.message and err.value.exit_code == 2 and "re-run" in err.value.hint


def test_variant_result_from_dict_raises_result_format_error_when_a_failed_result_claims_passed():
    with pytest.raises(ResultFormatError, match="only ok can pass"):
        VariantResult.from_dict({**_result().to_dict(), "status": "failed"}, source="run x")
    with pytest.raises(ResultFormatError, match="status"):
        VariantResult.from_dict({**_result().to_dict(), "status": "maybe"})
    with pytest.raises(ResultFormatError, match="variant"):
        VariantResult.from_dict({k: v for k, v in _result().to_dict().items() if k != "variant"})


def test_step_result_round_trips_and_reads_a_dict_without_version_when_it_predates_the_field():
    s = BuildResult("skipped", reason="no GPU", details={"n": 3})
    d = s.to_dict()
    assert d["schema_version"] == BUILD_RESULT_SCHEMA
    assert BuildResult.from_dict(json.loads(json.dumps(d))) == s
    # the build task's output: extra keys (variant, cached), no schema_version (a cache entry from before it)
    assert BuildResult.from_dict({"status": "ok", "reason": "", "artifact": "m.onnx", "details": {},
                                 "variant": "v", "cached": True}) == BuildResult("ok", artifact="m.onnx")
    with pytest.raises(ResultFormatError, match="schema_version"):
        BuildResult.from_dict({**d, "schema_version": BUILD_RESULT_SCHEMA + 1})
    with pytest.raises(ResultFormatError, match="status"):
        BuildResult.from_dict({"status": "done"})


# ------------------------------------------------------------------------------------------------ register
def _spec(**promotion):
    return parse_spec({
        "apiVersion": "tailguard/v1", "kind": "OptimizationSpec", "metadata": {"name": "results-test"},
        "model": {"registered_name": "m", "task": "classification",
                  "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 4]}],
                  "outputs": [{"name": "y", "dtype": "float32", "shape": ["batch", 3]}]},
        "data": {"calibration": {"uri": "c.parquet"}, "validation": {"uri": "v.parquet"}},
        "slices": [{"name": "lang", "column": "l"}],
        "variants": [{"name": "ort-fp32", "backend": "onnxruntime", "precision": "fp32"},
                     {"name": "ort-fp16", "backend": "onnxruntime", "precision": "fp16"},
                     {"name": "ort-int8", "backend": "onnxruntime", "precision": "int8",
                      "quantization": {"mode": "dynamic"}}],
        "gates": [{"metric": "top1_agreement", "min": 0.9}], "benchmark": {"batch_sizes": [1]},
        "promotion": {"enabled": True, **promotion}})


@pytest.fixture
def store(tmp_path):
    """A sqlite MLflow store (tracking + registry) under tmp_path with one experiment and a parent run."""
    import mlflow

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    before = os.environ.get("MLFLOW_TRACKING_URI"), os.environ.get("MLFLOW_REGISTRY_URI")
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    try:
        client = mlflow.MlflowClient()
        exp = client.create_experiment("results", artifact_location=(tmp_path / "artifacts").as_uri())
        # an earlier test's mlflow.set_experiment (e.g. `tailguard register` in test_register_cli) would otherwise
        # stay the active experiment, and mlflow.start_run(run_id=...) refuses a run of another experiment
        mlflow.set_experiment(experiment_id=exp)
        yield client, exp, client.create_run(exp).info.run_id
    finally:
        mlflow.set_tracking_uri(before[0])
        mlflow.set_registry_uri(before[1])


def _log_passing_variant(tmp_path, client, exp, parent, name, p50):
    """A variant run logged as the validate step logs one that passed its gates (tags say passed)."""
    from tailguard.components.validate.gates import all_passed, evaluate_gates
    from tailguard.components.validate.result import ValidationResult
    from tailguard.components.validate.run_log import log_validated_model
    from tailguard.core.contract import GATES_TAG, STATUS_TAG, VARIANT_TAG

    spec = _spec()
    table = pd.DataFrame({"slice": ["lang"], "value": ["en"], "support": [100], "top1_agreement": [0.99]})
    perf = {1: {"latency_ms.p50": p50, "latency_ms.p99": 2 * p50, "throughput_per_s": 1000 / p50}}
    gates = evaluate_gates(spec, name, {"top1_agreement": 0.99}, table, perf)
    result = ValidationResult(name, "classification", 300, {"top1_agreement": 0.99}, perf, [], gates,
                              all_passed(gates), 0, [1])
    v = next(x for x in spec.variants if x.name == name)
    run_id = client.create_run(exp, tags={"mlflow.parentRunId": parent, VARIANT_TAG: name,
                                          STATUS_TAG: "ok"}).info.run_id
    work = tmp_path / name
    work.mkdir()
    log_validated_model(client, run_id, result, work_dir=work, model_file=_tiny_onnx(tmp_path / f"{name}.onnx"),
                        execution_provider="CPUExecutionProvider",
                        identity=VariantResult(name, v.backend, v.precision, "ok", run_id=run_id))
    client.set_terminated(run_id)
    assert client.get_run(run_id).data.tags[GATES_TAG] == "passed"
    return run_id


def test_register_follows_variant_result_not_tags_when_tags_say_passed_but_the_file_says_failed(tmp_path, store):
    """ort-fp16 is the fastest and its tags say passed, but its variant_result.json says failed: the slower
    ort-fp32 gets the alias; ort-int8 logged its tags and model but died before its file: failed, unregistered."""
    import dataclasses

    from tailguard.components.register.logic import register_and_promote
    from tailguard.components.register.summary import read_variant_result

    client, exp, parent = store
    run_ids = {name: _log_passing_variant(tmp_path, client, exp, parent, name, p50)
               for name, p50 in (("ort-fp32", 5.0), ("ort-fp16", 1.0), ("ort-int8", 0.5))}
    logged = read_variant_result(client, run_ids["ort-fp16"])
    assert isinstance(logged, VariantResult) and logged.passed and logged.perf_value(1, "latency_ms.p50") == 1.0
    # the file is the decision: overwrite fp16's with a failed verdict (the tags still say passed)
    client.log_dict(run_ids["ort-fp16"], dataclasses.replace(logged, passed=False, reason="failed gates: x")
                    .to_dict(), VARIANT_RESULT_FILE)
    # a task that died after its tags and model but before the file: remove the file from the artifact store
    (tmp_path / "artifacts" / run_ids["ort-int8"] / "artifacts" / VARIANT_RESULT_FILE).unlink()

    summary = register_and_promote(_spec(), parent_run_id=parent, experiment_id=exp, source_version="1")

    rows = {v.variant: v for v in summary.variants}
    fp16, int8 = rows["ort-fp16"], rows["ort-int8"]
    assert client.get_run(run_ids["ort-fp16"]).data.tags["tailguard.gates"] == "passed"
    assert (fp16.status, fp16.passed, fp16.promoted, fp16.reason) == ("ok", False, False, "failed gates: x")
    # promotion.register_variants: promoted (default): the failing variant's run holds its model, the registry not
    assert (fp16.version, fp16.registration) == (None, "not_registered") and "failed its gates" in \
        fp16.registration_note
    assert (int8.status, int8.passed, int8.version) == ("failed", False, None)
    assert VARIANT_RESULT_FILE in int8.reason and "did not finish" in int8.reason
    assert summary.promoted_variant == "ort-fp32" and rows["ort-fp32"].p50_ms == 5.0
    alias = client.get_model_version_by_alias("m-optimized", "production")
    assert str(alias.version) == rows["ort-fp32"].version
    assert client.get_model_version("m-optimized", str(alias.version)).tags["tailguard.sha256"] == logged.sha256


def test_register_marks_the_row_failed_naming_the_schema_when_the_file_has_another_schema_version(tmp_path, store):
    from tailguard.components.register.logic import register_and_promote

    client, exp, parent = store
    run_id = _log_passing_variant(tmp_path, client, exp, parent, "ort-fp32", 5.0)
    client.log_dict(run_id, {**_result(variant="ort-fp32").to_dict(), "schema_version": 99}, VARIANT_RESULT_FILE)

    summary = register_and_promote(_spec(), parent_run_id=parent, experiment_id=exp, source_version="1")

    row = summary.variants[0]
    assert (row.variant, row.status, row.passed, row.version) == ("ort-fp32", "failed", False, None)
    assert "unreadable variant_result.json" in row.reason and "schema_version 99" in row.reason
    assert summary.promoted_variant is None and summary.alias_version is None


def test_validate_task_writes_a_variant_result_when_the_build_was_skipped_or_validation_raised(tmp_path,
                                                                                              monkeypatch):
    """The validate task itself (real MLflow sqlite store under a private TAILGUARD_HOME): a skipped build and a
    build whose model file is missing (validation raises) both leave variant_result.json, and register shows
    them as skipped / failed rows with the task's reasons."""
    import mlflow

    from tailguard.components.register.logic import register_and_promote
    from tailguard.components.register.summary import read_variant_result
    from tailguard.components.validate import task as validate_task
    from tailguard.core.errors import TailguardError
    from tailguard.core.spec import dump_spec

    monkeypatch.setenv("TAILGUARD_HOME", str(tmp_path / "home"))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    spec = _spec()
    before = os.environ.get("MLFLOW_TRACKING_URI"), os.environ.get("MLFLOW_REGISTRY_URI")
    try:
        from tailguard.core.tracking import configure, experiment_name_for

        exp = configure(uri, experiment_name_for(spec))
        client = mlflow.MlflowClient()
        parent = client.create_run(exp).info.run_id
        kw = dict(spec_yaml=dump_spec(spec), baselines_json="{}", parent_run_id=parent, tracking_uri=uri,
                  variant_dir=str(tmp_path / "built"), reference_dir=str(tmp_path / "ref"))
        out = json.loads(validate_task.main(variant_name="ort-fp16", build_json=json.dumps(
            BuildResult("skipped", reason="no CUDA execution provider here").to_dict()), **kw))
        with pytest.raises(TailguardError):
            validate_task.main(variant_name="ort-fp32", build_json=json.dumps(
                BuildResult("ok", artifact="missing.onnx").to_dict()), **kw)
        skipped, failed = (read_variant_result(client, r.info.run_id) for r in sorted(
            client.search_runs([exp], f"tags.mlflow.parentRunId = '{parent}'"),
            key=lambda r: r.data.tags["tailguard.variant"] != "ort-fp16"))
        summary = register_and_promote(spec, parent_run_id=parent, experiment_id=exp, source_version="1")
    finally:
        mlflow.set_tracking_uri(before[0])
        mlflow.set_registry_uri(before[1])
    assert out["status"] == "skipped"
    assert (skipped.variant, skipped.status, skipped.passed, skipped.reason, skipped.run_id) == (
        "ort-fp16", "skipped", False, "no CUDA execution provider here", out["run_id"])
    assert (failed.variant, failed.status, failed.passed) == ("ort-fp32", "failed", False)
    assert failed.reason.startswith("validation raised ") and "missing.onnx" in failed.reason
    rows = {v.variant: v for v in summary.variants}
    assert (rows["ort-fp16"].status, rows["ort-fp16"].reason) == ("skipped", "no CUDA execution provider here")
    assert (rows["ort-fp32"].status, rows["ort-fp32"].passed, rows["ort-fp32"].version) == ("failed", False, None)
    assert summary.promoted_variant is None


# ------------------------------------------------------------------------------------------- number_or_none
def test_number_or_none_drops_nan_and_keeps_infinities_when_given_metric_values():
    import numpy as np

    from tailguard.core.results import number_or_none

    assert number_or_none(float("nan")) is None and number_or_none(np.float32("nan")) is None
    assert number_or_none(None) is None and number_or_none("n/a") is None and number_or_none([1]) is None
    assert number_or_none(float("inf")) == math.inf and number_or_none(-np.inf) == -math.inf
    assert number_or_none(np.float64(0.25)) == 0.25 and type(number_or_none(np.int64(3))) is float


def test_status_enums_read_as_their_words_when_dumped_to_json_tags_and_csv():
    from tailguard.core.results import BuildStatus, GateStatus, GatesVerdict, PromotionStatus, RunOutcome

    doc = {"status": BuildStatus.SKIPPED, "gates": {"g": GateStatus.INSUFFICIENT_DATA},
           "verdict": GatesVerdict.NOT_EVALUATED, "promotion": PromotionStatus.NOT_PROMOTED,
           "outcome": RunOutcome.NO_PASSING_VARIANT}
    assert json.loads(json.dumps(doc)) == {"status": "skipped", "gates": {"g": "insufficient_data"},
                                           "verdict": "not_evaluated", "promotion": "not_promoted",
                                           "outcome": "no_passing_variant"}
    assert str(GateStatus.FAILED) == f"{GateStatus.FAILED}" == "failed"  # what MLflow's set_tag stores (str())
    assert pd.DataFrame({"s": [BuildStatus.OK]}).to_csv(index=False) == "s\nok\n"
    assert BuildResult.from_dict(BuildResult(BuildStatus.FAILED, reason="x").to_dict()).status == "failed"
    with pytest.raises(ValueError, match=r"one of \['ok', 'failed', 'skipped'\]"):
        BuildResult("done")

