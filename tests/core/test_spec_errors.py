"""Spec errors of the statistical gates, discovery and search sections, and column names checked against the data:
each is a SpecError with its field path (exit 2), never a traceback or a failure minutes into a run."""

import numpy as np
import pandas as pd
import pytest
import yaml
from typer.testing import CliRunner

from tailguard.cli import app
from tailguard.core.errors import SpecError
from tailguard.core.spec import load_spec, parse_spec
from tailguard.preflight import check_columns
from tests.core.test_spec import TINY

# `spec check` resolves model.registered_name in an existing local store: a private home per test (conftest)
pytestmark = pytest.mark.usefixtures("private_home")

runner = CliRunner()


def _doc() -> dict:
    return yaml.safe_load(TINY.read_text())


def _locs(doc: dict) -> list[str]:
    with pytest.raises(SpecError) as ei:
        parse_spec(doc)
    return [e.loc for e in ei.value.errors]


def test_spec_rejects_a_zero_search_budget_with_its_field_path():
    doc = _doc()
    doc["variants"][1]["search"] = {"max_trials": 0, "max_minutes": 0}
    locs = _locs(doc)
    assert "variants.1.search.max_trials" in locs and "variants.1.search.max_minutes" in locs


def test_spec_rejects_search_when_the_variant_is_not_int8_onnxruntime():
    doc = _doc()
    doc["variants"][0]["search"] = {"max_trials": 4}
    with pytest.raises(SpecError, match="search applies to precision int8"):
        parse_spec(doc)


def test_spec_rejects_a_gate_on_a_metric_the_task_does_not_produce():
    doc = _doc()
    doc["gates"].append({"metric": "top1_agreement", "min": 0.9})  # classification metric on an embedding task
    assert "gates.2.metric" in _locs(doc)


def test_spec_rejects_relative_and_confidence_gates_on_performance_metrics():
    doc = _doc()
    doc["gates"] += [{"metric": "latency_ms.p50", "max_drop": 1.0}, {"metric": "latency_ms.p50", "max": 5,
                                                                     "confidence": 0.95}]
    locs = _locs(doc)
    assert "gates.2.max_drop" in locs and "gates.3.confidence" in locs


def test_spec_rejects_a_gate_with_both_min_and_max_drop():
    doc = _doc()
    doc["gates"].append({"metric": "nn_top1_agreement", "min": 0.9, "max_drop": 0.01})
    with pytest.raises(SpecError, match="exactly one of min, max or max_drop"):
        parse_spec(doc)


def test_spec_rejects_a_relative_gate_on_the_reference_accuracy_itself():
    doc = _doc()
    doc["model"]["task"] = "classification"
    doc["gates"] = [{"metric": "reference_accuracy", "max_drop": 0.01}]
    assert "gates.0.max_drop" in _locs(doc)


def test_spec_rejects_a_discovered_gate_when_discovery_is_off():
    doc = _doc()
    doc["analysis"] = {"discovery": {"enabled": False}}
    doc["gates"].append({"metric": "nn_top1_agreement", "min": 0.9, "scope": "discovered"})
    assert "gates.2.scope" in _locs(doc)


def test_spec_rejects_an_unknown_discovery_metric():
    doc = _doc()
    doc["analysis"] = {"discovery": {"metric": "top1_agreement"}}
    assert "analysis.discovery.metric" in _locs(doc)


def test_gate_key_names_the_bound_and_the_relative_threshold():
    doc = _doc()
    doc["gates"] = [{"metric": "nn_top1_agreement", "min": 0.97, "confidence": 0.95, "scope": "per_slice",
                     "slice": "group"},
                    {"metric": "abs_error.p99", "max_drop": 0.05, "confidence": 0.9},
                    {"metric": "nn_top1_agreement", "min": 0.9, "scope": "discovered"}]
    keys = [g.key for g in parse_spec(doc).gates]
    assert keys == ["nn_top1_agreement>=0.97@lb95@per_slice:group", "abs_error.p99<=ref+0.05@ub90",
                    "nn_top1_agreement>=0.9@discovered"]


def _write_data(folder, columns: dict) -> None:
    frame = pd.DataFrame({"input_ids": [np.array([101, 7, 102])] * 4, "attention_mask": [np.array([1, 1, 1])] * 4,
                          **columns})
    for name in ("calibration", "validation"):
        frame.to_parquet(folder / f"{name}.parquet")


def test_check_columns_names_the_slice_field_when_its_column_is_missing(tmp_path):
    _write_data(tmp_path, {"grp": ["a", "b", "a", "b"]})
    doc = _doc()
    doc["analysis"] = {"discovery": {"columns": ["grp", "nope"]}}
    doc["data"]["calibration"]["stratify_by"] = "grop"
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(doc))
    with pytest.raises(SpecError) as ei:
        check_columns(load_spec(tmp_path / "spec.yaml"))
    locs = [e.loc for e in ei.value.errors]
    assert locs == ["slices.0.column", "analysis.discovery.columns.1", "data.calibration.stratify_by"]
    assert "grp" in str(ei.value)  # the columns the file does have


def test_check_columns_passes_when_every_named_column_exists(tmp_path):
    _write_data(tmp_path, {"group": ["a", "b", "a", "b"]})
    (tmp_path / "spec.yaml").write_text(TINY.read_text())
    check_columns(load_spec(tmp_path / "spec.yaml"))


def test_cli_spec_check_exits_2_naming_the_field_when_a_slice_column_is_missing(tmp_path):
    _write_data(tmp_path, {"grp": ["a", "b", "a", "b"]})
    (tmp_path / "spec.yaml").write_text(TINY.read_text())
    for argv in (["spec", "check"], ["run"]):
        r = runner.invoke(app, [*argv, str(tmp_path / "spec.yaml")])
        assert r.exit_code == 2, r.output
        assert "slices.0.column" in r.output and "Traceback" not in r.output


def test_cli_spec_check_exits_2_naming_the_search_budget_when_it_is_zero(tmp_path):
    doc = _doc()
    doc["variants"][1]["search"] = {"max_trials": 0, "max_minutes": 0}
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(doc))
    r = runner.invoke(app, ["spec", "check", str(tmp_path / "spec.yaml")])
    assert r.exit_code == 2, r.output
    assert "variants.1.search.max_trials" in r.output and "variants.1.search.max_minutes" in r.output
    assert "Traceback" not in r.output


# ------------------------------------------------------------------------------- a parity gate to promote
@pytest.mark.parametrize("gates", [
    [],
    [{"metric": "latency_ms.p50", "max": 10}, {"metric": "speedup_vs_onnx_fp32", "min": 1.5}],
    [{"metric": "nn_top1_agreement", "min": 0.9, "scope": "discovered"}],  # passes when nothing is discovered
], ids=["no-gates", "latency-only", "discovered-only"])
def test_spec_rejects_with_gates_path_and_fix_when_promotion_has_no_parity_gate(gates):
    doc = _doc()
    doc["gates"] = gates
    with pytest.raises(SpecError) as ei:
        parse_spec(doc)
    assert [e.loc for e in ei.value.errors] == ["gates"]
    assert "no parity gate" in ei.value.errors[0].message and ei.value.exit_code == 2
    assert "promotion: {enabled: false}" in ei.value.hint and "nn_top1_agreement" in ei.value.hint


def test_spec_rejects_naming_the_variant_when_its_only_parity_gate_is_for_another_variant():
    doc = _doc()
    first, second = doc["variants"][0]["name"], doc["variants"][1]["name"]
    doc["gates"] = [{"metric": "nn_top1_agreement", "min": 0.9, "variants": [first]},
                    {"metric": "latency_ms.p50", "max": 10}]
    with pytest.raises(SpecError) as ei:
        parse_spec(doc)
    (err,) = ei.value.errors
    assert err.loc == "gates" and second in err.message and first not in err.message.split("[")[1]


def test_spec_accepts_no_parity_gate_when_promotion_is_disabled():
    doc = _doc()
    doc["gates"] = [{"metric": "latency_ms.p50", "max": 10}]
    doc["promotion"] = {"enabled": False}
    assert parse_spec(doc).promotion.enabled is False
    doc["gates"] = [{"metric": "nn_top1_agreement", "min": 0.9, "scope": "per_slice", "min_support": 5}]
    doc["promotion"] = {}
    assert parse_spec(doc).promotion.enabled is True  # a per-slice parity gate counts


@pytest.mark.parametrize("command", [["spec", "check"], ["run"]])
def test_cli_exits_2_with_gates_path_when_spec_has_only_latency_gates(tmp_path, command):
    doc = _doc()
    doc["gates"] = [{"metric": "latency_ms.p50", "max": 10}]
    for ds in ("calibration", "validation"):  # the copy lives elsewhere: keep the data files reachable
        doc["data"][ds]["uri"] = str((TINY.parent / doc["data"][ds]["uri"]).resolve())
    p = tmp_path / "latency-only.yaml"
    p.write_text(yaml.safe_dump(doc))
    r = runner.invoke(app, [*command, str(p)])
    assert r.exit_code == 2, r.output
    assert "gates: no parity gate" in r.output and "enabled: false" in r.output
    assert "Traceback" not in r.output and "valid:" not in r.output


# ---------------------------------------------------------------------- gate bounds inside the metric's range
@pytest.mark.parametrize("gate, loc, words", [
    ({"metric": "latency_ms.p99", "max": -5}, "gates.2.max", "can never pass"),
    ({"metric": "nn_top1_agreement", "min": 1.2}, "gates.2.min", "can never pass"),
    ({"metric": "nn_top1_agreement", "min": 95}, "gates.2.min", "a fraction, not a percentage"),
    ({"metric": "nn_top1_agreement", "max_drop": 2}, "gates.2.max_drop", "always passes"),
], ids=["latency-below-0", "agreement-above-1", "agreement-percent", "drop-wider-than-range"])
def test_cli_spec_check_exits_2_naming_the_field_when_a_gate_bound_is_outside_the_metric_range(
        tmp_path, gate, loc, words):
    doc = _doc()
    doc["gates"].append(gate)
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(doc))
    r = runner.invoke(app, ["spec", "check", str(tmp_path / "spec.yaml")])
    assert r.exit_code == 2, r.output
    out = " ".join(r.output.split())
    assert loc in out and words in out and "Traceback" not in out


def test_spec_accepts_gate_bounds_on_the_ends_of_the_metric_range():
    doc = _doc()
    doc["gates"] += [{"metric": "nn_top1_agreement", "min": 1.0}, {"metric": "latency_ms.p99", "max": 0},
                     {"metric": "nn_top1_agreement", "max_drop": 1.0}]
    parse_spec(doc)


# ------------------------------------------------------------------------------------------- removed keys
@pytest.mark.parametrize("key,value,replaced_by", [
    ("correction", "bonferroni", "sequential detector"),
    ("clear_factor", 2.0, "recovery detector"),
])
def test_cli_spec_check_exits_2_naming_a_removed_monitoring_key_and_its_replacement_when_given(
        tmp_path, key, value, replaced_by):
    doc = _doc()
    doc["monitoring"] = {"sample_rate": 0.1, key: value}
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(doc))
    r = runner.invoke(app, ["spec", "check", str(tmp_path / "spec.yaml")])
    assert r.exit_code == 2, r.output
    text = " ".join(r.output.split())
    assert f"monitoring.{key}" in text and "removed" in text and replaced_by in text, r.output
    assert "unknown field" not in text and "Traceback" not in r.output


@pytest.mark.parametrize("value", ["fastest_passing", "cheapest_passing"])
def test_cli_spec_check_exits_2_naming_promotion_select_as_removed_when_given(tmp_path, value):
    doc = _doc()
    doc.setdefault("promotion", {})["select"] = value
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(doc))
    r = runner.invoke(app, ["spec", "check", str(tmp_path / "spec.yaml")])
    assert r.exit_code == 2, r.output
    text = " ".join(r.output.split())
    assert "promotion.select" in text and "removed" in text and "promotion.margin" in text, r.output
    assert "unknown field" not in text and "Traceback" not in r.output


# ------------------------------------------------------------------------------------------- size limits
def _grown(field: str, n: int) -> dict:
    doc = _doc()
    first = doc[field][0]
    doc[field] = [{**first, **({"name": f"{field[0]}{i}"} if field != "gates" else {})} for i in range(n)]
    return doc


@pytest.mark.parametrize("field, most", [("variants", 32), ("slices", 32), ("gates", 128)])
def test_spec_check_exits_2_naming_the_field_when_a_list_passes_its_limit(tmp_path, field, most):
    p = tmp_path / "big.yaml"
    p.write_text(yaml.safe_dump(_grown(field, most + 1)))
    r = runner.invoke(app, ["spec", "check", "--no-data", str(p)])
    assert r.exit_code == 2, r.output
    assert f"{field}: {most + 1} given, at most {most} are allowed" in r.output
    assert "Traceback" not in r.output
    parse_spec(_grown(field, most))  # the limit itself is allowed


def test_spec_rejects_a_long_slice_name_and_too_many_slice_groups_with_their_field_paths():
    doc = _doc()
    doc["slices"][0]["name"] = "s" * 65
    doc["slices"].append({"name": "other", "column": "other", "max_groups": 1001})
    locs = _locs(doc)
    assert "slices.0.name" in locs and "slices.1.max_groups" in locs
