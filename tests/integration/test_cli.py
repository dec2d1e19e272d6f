"""The CLI contract: exit codes and messages without tracebacks (README.md: 0 ok, 1 runtime, 2 bad input, 3 no
passing variant)."""

import json

import yaml
from typer.testing import CliRunner

from tailguard.cli import app
from tests.core.test_spec import TINY

runner = CliRunner()


def test_spec_check_exits_0_when_the_spec_is_valid():
    r = runner.invoke(app, ["spec", "check", "--no-data", str(TINY)])  # TINY names no real files
    assert r.exit_code == 0, r.output
    assert "valid" in r.output


def test_spec_check_exits_2_listing_every_field_path_when_the_spec_is_invalid(tmp_path):
    doc = yaml.safe_load(TINY.read_text())
    doc["model"]["task"] = "embeding"
    doc["variants"][0]["precison"] = "fp32"
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump(doc))
    r = runner.invoke(app, ["spec", "check", str(p)])
    assert r.exit_code == 2
    assert "model.task" in r.output and "variants.0.precison" in r.output
    assert "Traceback" not in r.output


def test_spec_schema_prints_the_json_schema_when_asked():
    r = runner.invoke(app, ["spec", "schema"])
    assert r.exit_code == 0
    assert json.loads(r.output)["title"] == "Spec"


def test_run_exits_2_without_traceback_when_the_spec_file_is_missing(tmp_path):
    r = runner.invoke(app, ["run", str(tmp_path / "none.yaml")])
    assert r.exit_code == 2
    assert "file not found" in r.output and "Traceback" not in r.output


def test_compile_writes_kfp_ir_when_the_spec_is_valid(tmp_path):
    out = tmp_path / "pipeline.yaml"
    r = runner.invoke(app, ["compile", str(TINY), "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert next(yaml.safe_load_all(out.read_text()))["pipelineInfo"]["name"] == "tiny"


def test_monitor_replay_exits_2_naming_the_option_when_a_model_file_is_missing(tmp_path):
    r = runner.invoke(app, ["monitor", "replay", "--spec", str(TINY), "--reference", str(tmp_path / "r.onnx"),
                            "--candidate", str(tmp_path / "c.onnx"), "--requests", str(tmp_path / "q.parquet"),
                            "--out", str(tmp_path / "out")])
    assert r.exit_code == 2
    assert "--reference" in r.output and "Traceback" not in r.output


def test_print_summary_lists_discovered_slices_when_discovery_found_some(capsys):
    from tailguard.components.register.summary import RunSummary, VariantSummary
    from tailguard.components.validate.run_log import discovered_summary
    from tailguard.runner import summary_rows
    from tailguard.terminal import print_summary

    table = [{"slice": "pos&n_tokens", "value": "verb&[2,8)", "support": 40, "metric": "nn_top1_agreement",
              "value_in_slice": 0.8, "value_rest": 0.95, "q_value": 0.004, "significant": True, "drop": 0.15},
             {"slice": "pos", "value": "adj", "support": 300, "metric": "nn_top1_agreement",
              "value_in_slice": 0.94, "value_rest": 0.95, "q_value": 0.6, "significant": False, "drop": 0.01}]
    v = VariantSummary("ort-int8", "onnxruntime", "int8", "ok", discovered=discovered_summary(table))
    summary = RunSummary("p", "0", "m", "1", "m-optimized", "production", True, 1, variants=[v])
    assert summary_rows(summary)[0]["discovered"] == "pos&n_tokens=verb&[2,8): 0.800 vs 0.950 (n=40, q=0.004)"
    assert RunSummary.from_dict(summary.to_dict()).variants[0].discovered == v.discovered
    print_summary(summary)
    out = capsys.readouterr().out
    assert "discovered slices" in out and "verb&[2,8)" in out and "pos=adj" not in out


def test_summary_rows_count_only_passed_gates_as_passed_when_some_are_undecided_or_insufficient():
    from tailguard.components.register.summary import RunSummary, VariantSummary
    from tailguard.core.results import GateStatus
    from tailguard.runner import summary_rows

    gates = {"a>=1": GateStatus.PASSED, "b>=1": GateStatus.FAILED, "c>=1": GateStatus.UNDECIDED,
             "d>=1": GateStatus.UNDECIDED, "e>=1@per_slice:x": GateStatus.INSUFFICIENT_DATA,
             "f>=1": GateStatus.UNDECIDED}
    v = VariantSummary("ort-int8", "onnxruntime", "int8", "ok", gates=gates)
    cell = summary_rows(RunSummary("p", "0", "m", "1", "m-optimized", "production", True, 1, variants=[v]))[0]["gates"]
    assert cell.startswith("1/6 passed; failed: G2; undecided: G3, G4, G6")  # was "5/6 passed; failed: G2"
    assert "G5" in cell  # the insufficient gate is named too


def test_spec_check_warns_naming_the_fix_when_a_per_slice_gate_cannot_pass_at_its_min_support(tmp_path):
    doc = yaml.safe_load(TINY.read_text())
    metric = next(g["metric"] for g in doc["gates"] if g["metric"].endswith("agreement"))
    doc["gates"].append({"metric": metric, "scope": "per_slice", "min": 0.95, "confidence": 0.95,
                         "min_support": 30})
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(doc))

    r = runner.invoke(app, ["spec", "check", "--no-data", str(path)])
    quiet = runner.invoke(app, ["spec", "check", "--no-data", str(TINY)])

    out = " ".join(r.output.split())
    assert r.exit_code == 0, r.output
    # 30/30 has a one-sided 95% Wilson lower bound of 30 / (30 + 1.645^2) = 0.917 < 0.95; 52/52 reaches 0.951
    assert f"gates.{len(doc['gates']) - 1} ({metric} >= 0.95 at 0.95 confidence, min_support 30)" in out
    assert "a group of 30-51 rows fails it even when every row agrees (30/30 has a lower bound of 0.917)" in out
    assert "raise min_support to 52 or lower min" in out
    assert "warning" not in quiet.output
