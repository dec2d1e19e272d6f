"""The run report of a parent MLflow run (components/register/report.py `run_report_html` and
`log_run_report`, pipelines/run_report.py and `tailguard report`).

Unit tests build the HTML from a synthetic summary; the integration test runs one small local `tailguard run`
(the tiny encoder of tests/integration/test_pipeline_local.py, kfp.local, SQLite MLflow store) and reads the parent
run back.
"""

import base64
import json
import os
import re
import subprocess
import sys

import mlflow
import pandas as pd
import pytest
from typer.testing import CliRunner

from tailguard.cli import app
from tailguard.components.register.report import decision_note, gate_statuses, run_report_html
from tailguard.components.register.summary import RunSummary, VariantSummary
from tailguard.core.contract import gate_name_tag, gate_tag
from tailguard.core.report import TORCH_NOTE, zoom_limits
from tests.conftest import MLFLOW_URI_VARS

GATE = "top1_agreement>=0.9@lb95@per_slice:digit"


def _summary(**over) -> dict:
    v = dict(backend="onnxruntime", status="ok", reason="", p99_ms=None, speedup_vs_torch=None, discovered=[])
    d = {"parent_run_id": "p1", "experiment_id": "7", "source_model": "digits", "source_version": "3",
         "optimized_model": "digits-optimized", "alias": "production", "promotion_enabled": True, "batch_size": 1,
         "promoted_variant": "ort-int8", "promoted_version": "5", "promotion": "promoted", "alias_version": "5",
         "searches": [],
         "variants": [
             {**v, "variant": "ort-fp32", "precision": "fp32", "passed": True, "run_id": "r1", "version": "4",
              "p50_ms": 1.0, "speedup_vs_onnx_fp32": 1.0, "promoted": False, "gates": {GATE: "passed"},
              "worst_slice": {"slice": "digit", "value": "3", "metric": "top1_agreement", "observed": 1.0,
                              "support": 40}},
             {**v, "variant": "ort-int8", "precision": "int8", "passed": True, "run_id": "r2", "version": "5",
              "p50_ms": 0.5, "speedup_vs_onnx_fp32": 2.0, "promoted": True, "gates": {GATE: "passed"},
              "quantized_mac_fraction": 0.33, "warnings": ["INT8 variant computes only 33% of its MACs in INT8"],
              "worst_slice": {"slice": "digit", "value": "<8>", "metric": "top1_agreement", "observed": 0.984,
                              "support": 40}},
             {**v, "variant": "trt-fp16", "backend": "tensorrt", "precision": "fp16", "status": "skipped",
              "reason": "needs a GPU", "passed": False, "run_id": "r3", "version": None, "p50_ms": None,
              "speedup_vs_onnx_fp32": None, "promoted": False, "gates": {}, "worst_slice": None}]}
    d.update(over)
    return d


def _tables() -> dict:
    base = {"slice": ["digit"] * 3, "value": ["3", "<8>", "1"], "support": [40, 40, 30]}
    return {"ort-fp32": pd.DataFrame({**base, "top1_agreement": [1.0, 1.0, 1.0]}),
            "ort-int8": pd.DataFrame({**base, "top1_agreement": [1.0, 0.984, 0.99]})}


def _images(text: str) -> list[bytes]:
    return [base64.b64decode(b) for b in re.findall(r'src="data:image/png;base64,([^"]+)"', text)]


# ------------------------------------------------------------------------------------------------- units
def test_run_report_html_has_table_pareto_gate_matrix_heat_map_and_links_when_summary_is_complete():
    text = run_report_html(_summary(), run={"run_id": "p1", "status": "FINISHED", "name": "digits"},
                           slice_tables=_tables(), links={"ort-int8": "http://mlflow:5000/#/experiments/7/runs/r2"},
                           torch_baseline=False)
    assert '<table class="variants">' in text and '<table class="gate-matrix">' in text
    assert "top1_agreement&gt;=0.9@lb95@per_slice:digit" in text  # the canonical gate name, escaped
    assert len(_images(text)) == 2  # Pareto plot + heat map, PNGs
    assert all(img.startswith(b"\x89PNG") for img in _images(text))
    assert "<8>" not in text and "digit=&lt;8&gt;" in text
    assert "href='http://mlflow:5000/#/experiments/7/runs/r2'" in text
    assert TORCH_NOTE.split(":")[0] in text
    # promoted: only the version the alias moved to; registered: every registered version
    rows = re.findall(r"<tr><td>(ort-[\w-]+|trt-fp16)</td>(.*?)</tr>", text.split('class="gate-matrix"')[0])
    promoted = {name: "@production -&gt; v" in cells for name, cells in rows}
    assert promoted == {"ort-fp32": False, "ort-int8": True, "trt-fp16": False}
    assert "<td>v4</td>" in text and "<td>v5</td>" in text
    assert "<td>0.33</td>" in text and "only 33% of its MACs in INT8" in text  # coverage and its warning


def test_run_report_html_shows_the_error_when_the_run_failed_without_a_summary():
    text = run_report_html(None, run={"run_id": "p9", "status": "FAILED",
                                      "error": "Failed: DataCheckError: column 'image' is not numeric"})
    assert "FAILED: Failed: DataCheckError: column &#x27;image&#x27; is not numeric" in text
    assert "No variant was validated." in text and "<img" not in text


def test_decision_note_is_two_lines_naming_the_promoted_version_when_a_variant_was_promoted():
    note = decision_note(_summary())
    lines = note.split("\n")
    assert len(lines) == 2
    assert lines[0].startswith("Promoted ort-int8 as digits-optimized v5 @production: p50 0.5 ms at batch 1")
    assert "0.984" in lines[0]
    assert lines[1].startswith("3 variants: 2 passed, 1 skipped.")


def test_decision_note_names_each_variant_reason_when_no_variant_passed():
    s = _summary(promoted_variant=None, promoted_version=None, promotion="not_promoted")
    for v in s["variants"]:
        v["passed"], v["promoted"] = False, False
    s["variants"][1]["reason"] = f"failed gates: {GATE}"
    note = decision_note(s)
    assert note.startswith("No alias moved: no variant passed every gate.")
    assert f"ort-int8 (failed gates: {GATE})" in note and "trt-fp16 (needs a GPU)" in note


def test_zoom_limits_span_the_data_not_zero_to_one_when_values_are_near_one():
    lo, hi = zoom_limits([0.984, 1.0, float("nan")], "top1_agreement")
    assert 0.98 < lo < 0.984 and 1.0 < hi < 1.002
    assert zoom_limits([], "top1_agreement") == (0.0, 1.0)
    lo, hi = zoom_limits([0.5, 0.5])
    assert lo < 0.5 < hi


def test_summary_rows_lists_only_the_promoted_version_when_others_were_registered():
    from tailguard.runner import summary_rows

    vs = [VariantSummary("a", "onnxruntime", "fp32", "ok", passed=True, version="4"),
          VariantSummary("b", "onnxruntime", "int8", "ok", passed=True, version="5", promoted=True)]
    rows = summary_rows(RunSummary("p", "0", "m", "1", "m-optimized", "production", True, 1, variants=vs))
    assert [r["promoted"] for r in rows] == ["", "@production -> v5"]
    assert [r["registered"] for r in rows] == ["v4", "v5"]


def test_gate_statuses_uses_the_canonical_gate_name_when_the_name_tag_is_present():
    tags = {gate_tag(GATE): "passed", gate_name_tag(GATE): GATE, gate_tag("accuracy>=0.5"): "failed"}
    assert gate_statuses(tags) == {GATE: "passed", "accuracy ge 0.5": "failed"}  # old runs: the tag key's form
    assert gate_name_tag(GATE) == "gate_name.top1_agreement ge 0.9 lb95 per_slice digit"


def test_report_cli_exits_2_naming_the_run_when_the_run_id_is_unknown_or_the_store_is_empty(tmp_path):
    r = CliRunner().invoke(app, ["report", "0123456789abcdef", "--tracking-uri",
                                 f"sqlite:///{tmp_path / 'mlflow.db'}"])
    assert r.exit_code == 2, r.output
    assert "0123456789abcdef" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(app, ["report", "latest", "--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}"])
    assert r.exit_code == 2 and "no tailguard run in this MLflow store" in r.output, r.output


def test_report_cli_writes_the_error_when_the_latest_run_failed_before_registering(tmp_path, monkeypatch):
    monkeypatch.setenv("TAILGUARD_HOME", str(tmp_path / "home"))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.MlflowClient(uri)
    exp = client.create_experiment("tailguard/x", artifact_location=(tmp_path / "art").as_uri())
    run = client.create_run(exp, run_name="x", tags={"tailguard.pipeline_run": "abc",
                                                     "mlflow.note.content": "Failed: StepError: export broke"})
    client.set_terminated(run.info.run_id, "FAILED")
    out = tmp_path / "r.html"
    r = CliRunner().invoke(app, ["report", "latest", "-o", str(out), "--tracking-uri", uri])
    assert r.exit_code == 0, r.output
    assert run.info.run_id in r.output
    assert "FAILED: Failed: StepError: export broke" in out.read_text()


# ------------------------------------------------------------------------------------ a real local run
@pytest.mark.integration
@pytest.mark.slow
def test_run_logs_report_html_and_a_two_line_description_on_the_parent_run_when_it_finishes(tmp_path):
    from tests.integration.test_pipeline_local import TINY_KWARGS, make_rows, write_spec

    home = tmp_path / "home"
    make_rows(120, 0).to_parquet(tmp_path / "validation.parquet")
    make_rows(40, 1).to_parquet(tmp_path / "calibration.parquet")
    # the run must use the home store: drop a tracking URI another module's fixture left in os.environ
    env = {**{k: v for k, v in os.environ.items() if k not in MLFLOW_URI_VARS}, "TAILGUARD_HOME": str(home)}
    code = ("import torch; from tailguard.registration import register_reference; "
            "from tailguard.core.home import default_tracking_uri; from tailguard.models import MeanPooledEncoder; "
            "from tailguard.core.tracking import configure; configure(default_tracking_uri(), 'registration'); "
            f"torch.manual_seed(0); kw = {TINY_KWARGS!r}; "
            "register_reference('tiny-encoder', state_dict=MeanPooledEncoder(**kw).state_dict(), "
            "class_path='tailguard.models:MeanPooledEncoder', init_kwargs=kw)")
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=300, cwd=tmp_path)
    spec = write_spec(tmp_path, variants=[
        {"name": "ort-fp32", "backend": "onnxruntime", "precision": "fp32"},
        {"name": "ort-int8-dynamic", "backend": "onnxruntime", "precision": "int8",
         "quantization": {"mode": "dynamic", "per_channel": True}}],
        benchmark={"batch_sizes": [1], "warmup": 1, "iterations": 5, "max_seconds": 1})
    out = tmp_path / "summary.json"
    r = subprocess.run([sys.executable, "-m", "tailguard.cli", "run", str(spec), "--summary-json", str(out)],
                       env=env, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    summary = json.loads(out.read_text())

    uri = f"sqlite:///{home / 'mlflow.db'}"
    client = mlflow.MlflowClient(uri)
    parent = client.get_run(summary["parent_run_id"])
    note = parent.data.tags["mlflow.note.content"]
    assert len(note.split("\n")) == 2 and note.startswith(f"Promoted {summary['promoted_variant']} as ")
    assert "report.html" in {a.path for a in client.list_artifacts(parent.info.run_id)}
    logged = open(client.download_artifacts(parent.info.run_id, "report.html", str(tmp_path))).read()
    assert "ort-fp32" in logged and "ort-int8-dynamic" in logged and len(_images(logged)) == 2
    # gate names: the canonical key in the summary, in the report and in the gate_name.* tag values
    keys = {k for v in summary["variants"] for k in v["gates"]}
    assert keys == {"nn_top1_agreement>=0.5", "cosine_similarity.p01>=0.5@per_slice"}
    assert "cosine_similarity.p01&gt;=0.5@per_slice" in logged
    child = client.get_run(summary["variants"][0]["run_id"])
    assert child.data.tags[gate_name_tag("cosine_similarity.p01>=0.5@per_slice")] == \
        "cosine_similarity.p01>=0.5@per_slice"

    rebuilt = tmp_path / "rebuilt.html"
    r = subprocess.run([sys.executable, "-m", "tailguard.cli", "report", "latest", "-o", str(rebuilt)],
                       env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    text = rebuilt.read_text()
    assert parent.info.run_id in text and "Promoted" in text and len(_images(text)) == 2


def test_variant_report_wraps_every_table_in_a_scrolling_box_when_written(tmp_path):
    from tailguard.components.validate.gates import GateResult
    from tailguard.components.validate.report import write_report

    table = pd.DataFrame({"slice": ["digit"] * 2, "value": ["8", "1"], "support": [40, 40],
                          "top1_agreement": [0.984, 1.0]})
    gate = GateResult(gate=GATE, metric="top1_agreement", scope="per_slice", threshold=0.9, op=">=",
                      observed=0.984, passed=True, status="passed", min_support=30, detail={"reason": "x" * 2000})
    text = write_report(tmp_path / "report.html", variant="int8", overall={"top1_agreement": 0.99},
                        slice_table=table, gates=[gate], perf={}).read_text()
    assert '<div class="tw"><table class="gates">' in text
    assert ".tw{max-width:100%;overflow-x:auto" in text and "th{white-space:nowrap}" in text
    assert "anywhere" not in text  # would let the table squeeze its cells mid-word instead of scrolling
    assert text.count('<div class="tw">') == text.count("<table")


def test_run_report_html_lists_the_search_trials_when_a_variant_was_searched():
    trials = [{"name": "ort-int8-t00", "excluded_nodes": [], "per_channel": True, "p50_ms": 0.45,
               "worst_slice_value": 0.96, "passed": False, "status": "ok", "on_front": True, "chosen": False},
              {"name": "ort-int8-t01", "excluded_nodes": ["/l0/MatMul", "/l1/MatMul", "/l2/MatMul", "/l3/MatMul"],
               "per_channel": False, "p50_ms": 0.6, "worst_slice_value": 0.99, "passed": True, "status": "ok",
               "on_front": True, "chosen": True}]
    s = _summary(searches=[{"variant": "ort-int8", "stopped_by": "max_trials", "chosen_name": "ort-int8-t01",
                            "trials": trials}])
    text = run_report_html(s, run={"run_id": "p1", "status": "FINISHED"}, slice_tables=_tables())
    assert "<h2>Search ort-int8</h2>" in text and '<table class="trials">' in text
    assert "2 trials; chosen ort-int8-t01; stopped by max_trials" in text
    assert "/l0/MatMul, /l1/MatMul, /l2/MatMul, … (4)" in text and "<td>chosen</td>" in text
