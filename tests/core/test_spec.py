"""The spec: every error with its field path, cross-field rules, and the published JSON Schema."""

import json
from pathlib import Path

import pytest
import yaml

from tailguard.core.errors import SpecError
from tailguard.core.spec import json_schema, load_spec, parse_spec

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "tests" / "data" / "tiny_spec.yaml"


def tiny() -> dict:
    return yaml.safe_load(TINY.read_text())


def locs(exc: SpecError) -> set[str]:
    return {e.loc for e in exc.errors}


def test_load_spec_resolves_data_uris_relative_to_the_spec_file_when_relative():
    spec = load_spec(TINY)
    assert spec.data.validation.uri == str(TINY.parent / "validation.parquet")


def test_parse_spec_reports_every_error_with_its_field_path_when_several_fields_are_wrong():
    doc = tiny()
    doc["model"]["task"] = "embeding"
    doc["model"]["bogus"] = 1
    doc["variants"][1].pop("quantization")
    doc["benchmark"] = {"batch_sizes": []}
    with pytest.raises(SpecError) as ei:
        parse_spec(doc)
    assert {"model.task", "model.bogus", "variants.1", "benchmark.batch_sizes"} <= locs(ei.value)
    assert ei.value.exit_code == 2


def test_parse_spec_rejects_unknown_field_when_misspelled():
    doc = tiny()
    doc["promotion"] = {"alais": "production"}
    with pytest.raises(SpecError) as ei:
        parse_spec(doc)
    assert "promotion.alais" in locs(ei.value)
    assert "unknown field" in str(ei.value)


def test_parse_spec_rejects_gate_metric_when_the_task_does_not_produce_it():
    doc = tiny()
    doc["gates"].append({"metric": "top1_agreement", "min": 0.9})  # a classification metric on an embedding task
    with pytest.raises(SpecError) as ei:
        parse_spec(doc)
    assert "gates.2.metric" in locs(ei.value)


def test_parse_spec_rejects_gate_slice_when_not_declared():
    doc = tiny()
    doc["gates"][1]["slice"] = "nope"
    with pytest.raises(SpecError) as ei:
        parse_spec(doc)
    assert "gates.1.slice" in locs(ei.value)


def test_parse_spec_rejects_duplicate_variant_names_when_repeated():
    doc = tiny()
    doc["variants"].append(dict(doc["variants"][0]))
    with pytest.raises(SpecError) as ei:
        parse_spec(doc)
    assert any("duplicate" in e.message for e in ei.value.errors)


@pytest.mark.parametrize("version,ok", [("latest", True), ("3", True), ("@production", True), ("0", False),
                                        ("v3", False), ("@", False)])
def test_model_version_accepts_latest_number_or_alias_only_when_well_formed(version, ok):
    doc = tiny()
    doc["model"]["version"] = version
    if ok:
        assert parse_spec(doc).model.version == version
    else:
        with pytest.raises(SpecError) as ei:
            parse_spec(doc)
        assert "model.version" in locs(ei.value)


def test_variant_needs_gpu_when_tensorrt_or_cuda_provider():
    spec = parse_spec(tiny())
    assert [v.needs_gpu for v in spec.variants] == [False, False, True]


def test_load_spec_raises_spec_error_with_line_when_yaml_is_malformed(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text("apiVersion: tailguard/v1\nkind: [unclosed\n")
    with pytest.raises(SpecError) as ei:
        load_spec(p)
    assert "line" in str(ei.value)


def test_every_field_of_every_model_has_a_description():
    schema = json_schema()
    missing = []
    for name, d in schema["$defs"].items():
        for field, prop in d.get("properties", {}).items():
            if "description" not in prop:
                missing.append(f"{name}.{field}")
    for field, prop in schema["properties"].items():
        if "description" not in prop:
            missing.append(f"Spec.{field}")
    assert not missing


def test_docs_schema_matches_the_models_when_generated():
    published = json.loads((ROOT / "docs" / "spec.schema.json").read_text())
    assert published == json_schema(), "run `make schema` to regenerate docs/spec.schema.json"
