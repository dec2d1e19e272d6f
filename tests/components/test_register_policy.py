"""Registration policy of register-and-promote (components/register/logic.py, issue 26 item 5): which variants
get a registry version (`promotion.register_variants`), and an artefact already registered (same sha256) is
reused, never registered again; and what `log_validated_model` leaves for it on the LoggedModel (the run's
metrics, linked without MLflow's per-metric copy).

Real parts: a sqlite MLflow store (tracking + registry) under tmp_path (MLflow 3 refuses its file-system store,
`./mlruns`, without an opt-out); variant runs logged by the validate step's own `log_validated_model` with real
one-node ONNX files and real gate verdicts. No mocks.
"""

from __future__ import annotations

import pandas as pd

from tailguard.core.results import VariantResult
from tests.core.test_results import _spec, store  # noqa: F401 (store: fixture: sqlite store, experiment, parent run)

MODEL = "m-optimized"


def _onnx(path, op="Identity"):
    """A one-node ONNX file; the op type makes the bytes (so the sha256) differ between variants."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node(op, ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def _log_variant(tmp_path, client, exp, parent, spec, name, *, p50, agreement, op):
    """One variant run as the validate step logs it: top1_agreement `agreement` against the spec's gate
    (min 0.9), latency `p50` ms at batch 1, model = the one-node `op` ONNX file."""
    from tailguard.components.validate.gates import all_passed, evaluate_gates
    from tailguard.components.validate.result import ValidationResult
    from tailguard.components.validate.run_log import log_validated_model
    from tailguard.core.contract import STATUS_TAG, VARIANT_TAG

    overall = {"top1_agreement": agreement}
    table = pd.DataFrame({"slice": ["lang"], "value": ["en"], "support": [100], "top1_agreement": [agreement]})
    perf = {1: {"latency_ms.p50": p50, "latency_ms.p99": 2 * p50, "throughput_per_s": 1000 / p50}}
    gates = evaluate_gates(spec, name, overall, table, perf)
    result = ValidationResult(name, "classification", 300, overall, perf, [], gates, all_passed(gates), 0, [1])
    v = next(x for x in spec.variants if x.name == name)
    run_id = client.create_run(exp, tags={"mlflow.parentRunId": parent, VARIANT_TAG: name,
                                          STATUS_TAG: "ok"}).info.run_id
    work = tmp_path / f"{parent}-{name}"
    work.mkdir()
    log_validated_model(client, run_id, result, work_dir=work, model_file=_onnx(work / f"{name}.onnx", op),
                        execution_provider="CPUExecutionProvider",
                        identity=VariantResult(name, v.backend, v.precision, "ok", run_id=run_id))
    client.set_terminated(run_id)
    return run_id


# (variant, p50 ms, top1_agreement, op): fp32 and fp16 pass, int8 is the fastest but fails its gate
VARIANTS = (("ort-fp32", 5.0, 0.99, "Identity"), ("ort-fp16", 3.0, 0.99, "Relu"), ("ort-int8", 1.0, 0.5, "Neg"))


def _run(tmp_path, client, exp, spec, variants=VARIANTS):
    """One pipeline run: a parent run, the variant runs, then register-and-promote. Returns the summary."""
    from tailguard.components.register.logic import register_and_promote

    parent = client.create_run(exp).info.run_id
    for name, p50, agreement, op in variants:
        _log_variant(tmp_path, client, exp, parent, spec, name, p50=p50, agreement=agreement, op=op)
    return register_and_promote(spec, parent_run_id=parent, experiment_id=exp, source_version="1")


def _policy_spec(**promotion):
    """The spec these tests register under: the selection by lowest validation p50 (`promotion.margin: null`),
    since the variants' latencies here are numbers written into their results, not models that can be timed
    (the confident selection is tested in tests/components/test_promotion.py)."""
    return _spec(margin=None, **promotion)


def _versions(client):
    return sorted((int(v.version), v.tags["tailguard.variant"])
                  for v in client.search_model_versions(f"name = '{MODEL}'"))


def test_register_and_promote_registers_the_artefact_once_and_reuses_it_when_the_same_spec_runs_three_times(
        tmp_path, store):
    from tailguard.runner import summary_rows

    client, exp, _ = store
    spec = _policy_spec()
    summaries = [_run(tmp_path, client, exp, spec) for _ in range(3)]

    # promoted (default): only the selected variant, fp16 (fastest passing), and its bytes only once
    assert _versions(client) == [(1, "ort-fp16")]
    first, *later = summaries
    rows = {v.variant: v for v in first.variants}
    assert (rows["ort-fp16"].version, rows["ort-fp16"].registration, rows["ort-fp16"].promoted) == ("1", "registered",
                                                                                                    True)
    for s in later:
        row = next(v for v in s.variants if v.variant == "ort-fp16")
        assert (row.version, row.registration, row.promoted) == ("1", "reused", True)
        assert row.registration_note == "reused v1 (same sha256)"
        assert (s.promoted_version, s.alias_version, s.promotion) == ("1", "1", "promoted")
        cells = {r["variant"]: r["registered"] for r in summary_rows(s)}
        assert cells["ort-fp16"] == "reused v1 (same sha256)" and cells["ort-fp32"] == cells["ort-int8"] == ""
    assert str(client.get_model_version_by_alias(MODEL, "production").version) == "1"
    # every run still logs every variant's run: the runs are the record
    assert len(client.search_runs([exp], "tags.`tailguard.variant` = 'ort-fp32'")) == 3


def test_register_and_promote_leaves_failing_and_unselected_variants_out_when_the_policy_is_the_default(
        tmp_path, store):
    client, exp, _ = store
    rows = {v.variant: v for v in _run(tmp_path, client, exp, _policy_spec()).variants}
    fp32, int8 = rows["ort-fp32"], rows["ort-int8"]
    assert (int8.passed, int8.version, int8.registration) == (False, None, "not_registered")
    assert int8.registration_note == "not registered: failed its gates (promotion.register_variants: promoted)"
    assert (fp32.passed, fp32.version, fp32.registration) == (True, None, "not_registered")
    assert "passed, not selected" in fp32.registration_note
    assert _versions(client) == [(1, "ort-fp16")]


def test_register_and_promote_registers_the_failing_variant_when_register_variants_is_all(tmp_path, store):
    client, exp, _ = store
    summary = _run(tmp_path, client, exp, _policy_spec(register_variants="all"))
    rows = {v.variant: v for v in summary.variants}
    assert _versions(client) == [(1, "ort-fp32"), (2, "ort-fp16"), (3, "ort-int8")]
    assert client.get_model_version(MODEL, rows["ort-int8"].version).tags["tailguard.gates"] == "failed"
    assert rows["ort-int8"].registration == "registered" and summary.promoted_version == rows["ort-fp16"].version


def test_register_and_promote_registers_only_passing_variants_when_register_variants_is_passing(tmp_path, store):
    client, exp, _ = store
    rows = {v.variant: v for v in _run(tmp_path, client, exp, _policy_spec(register_variants="passing")).variants}
    assert _versions(client) == [(1, "ort-fp32"), (2, "ort-fp16")]
    assert (rows["ort-int8"].version, rows["ort-int8"].registration) == (None, "not_registered")


def test_register_and_promote_reuses_the_version_within_a_run_when_two_variants_have_the_same_artefact(
        tmp_path, store):
    """fp32 and fp16 logged the same bytes: under `all` the second one reuses the first one's version, and the
    promoted one (fp16, faster) gets the alias on that shared version."""
    client, exp, _ = store
    same = (("ort-fp32", 5.0, 0.99, "Identity"), ("ort-fp16", 3.0, 0.99, "Identity"), ("ort-int8", 1.0, 0.5, "Neg"))
    summary = _run(tmp_path, client, exp, _policy_spec(register_variants="all"), same)
    rows = {v.variant: v for v in summary.variants}
    assert _versions(client) == [(1, "ort-fp32"), (2, "ort-int8")]
    assert (rows["ort-fp16"].version, rows["ort-fp16"].registration) == ("1", "reused")
    assert summary.promoted_variant == "ort-fp16" and summary.alias_version == "1"


def test_log_validated_model_links_the_metrics_to_the_logged_model_without_a_history_query_each_when_it_logs_onnx(
        tmp_path, store, monkeypatch):
    """The LoggedModel that log_validated_model logs carries every metric of its run (keys and values), as MLflow
    3's log_model links them; the validation's own metrics are linked in its log_batch, not by MLflow's copy
    (one get_metric_history query per metric: what made this slow), while a metric logged on the run before
    (here a stand-in for one from the build) is still copied by MLflow. The counting wrapper around the sqlite
    store's get_metric_history only counts: the real method runs."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    from tailguard.components.validate.result import ValidationResult
    from tailguard.components.validate.run_log import log_validated_model

    client, exp, _ = store
    queried = []
    real = SqlAlchemyStore.get_metric_history

    def counting(self, run_id, metric_key, *args, **kwargs):
        queried.append(metric_key)
        return real(self, run_id, metric_key, *args, **kwargs)

    monkeypatch.setattr(SqlAlchemyStore, "get_metric_history", counting)
    slices = [{"slice": "lang", "value": f"l{i}", "support": 100 + i, "top1_agreement": 0.9 + i / 1000,
               "abs_error.max": 0.01 * i} for i in range(40)]
    perf = {bs: {"latency_ms.p50": 1.0 * bs, "latency_ms.p99": 2.0 * bs, "throughput_per_s": 1000.0 / bs}
            for bs in (1, 8)}
    result = ValidationResult("ort-fp32", "classification", 300, {"top1_agreement": 0.95}, perf, slices, [], True,
                              0, [1, 8])
    run_id = client.create_run(exp).info.run_id
    client.log_metric(run_id, "build.seconds", 12.5, step=0)
    work = tmp_path / "work"
    work.mkdir()
    queried.clear()
    log_validated_model(client, run_id, result, work_dir=work, model_file=_onnx(tmp_path / "m.onnx"),
                        execution_provider="CPUExecutionProvider")
    during = list(queried)

    run = client.get_run(run_id)
    model = client.get_logged_model(run.outputs.model_outputs[0].model_id)
    validation = set(result.mlflow_metrics())
    assert len(validation) > 100 and validation <= set(run.data.metrics)
    assert {m.key: m.value for m in model.metrics} == run.data.metrics  # build.seconds included
    assert len(model.metrics) == len(run.data.metrics) and {(m.step, m.run_id) for m in model.metrics} == {(0, run_id)}
    assert validation.isdisjoint(during) and during == ["build.seconds"]
