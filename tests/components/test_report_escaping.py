"""Reports cannot be made to run script, inject Markdown or break a plot by the data they show (issue 22, item 6):
the variant report (components/validate/report.py) and the parent run's report (components/register/report.py),
the report rebuilt from a real MLflow store (pipelines/run_report.py, a SQLite store in a temporary folder), and the
MLflow description (`decision_note`, mlflow.note.content)."""

from __future__ import annotations

import base64
import re
from types import SimpleNamespace

import mlflow
import pandas as pd
import pytest

from tailguard.components.register.report import decision_note, run_report_html
from tailguard.components.validate.report import write_report
from tailguard.core.report import CellStatus, cell_status, markdown_text

SCRIPT = '"><script>alert(1)</script>'
GATE = "top1_agreement>=0.9@lb95@per_slice:digit"
MATH_VALUES = ["$x$", r"$\frac{$", "cost $5 and $", r"$\undefinedcommand$"]


def _images(text: str) -> list[bytes]:
    return [base64.b64decode(b) for b in re.findall(r'src="data:image/png;base64,([^"]+)"', text)]


def _summary(gate_status: str = "passed", slice_value: str = "3", reason: str = "") -> dict:
    v = dict(backend="onnxruntime", status="ok", p99_ms=None, speedup_vs_torch=None, discovered=[],
             speedup_vs_onnx_fp32=1.0)
    return {"parent_run_id": "p1", "experiment_id": "7", "source_model": "digits", "source_version": "3",
            "optimized_model": "digits-optimized", "alias": "production", "promotion_enabled": True,
            "batch_size": 1, "promoted_variant": None, "promoted_version": None, "promotion": "not_promoted",
            "searches": [],
            "variants": [{**v, "variant": "ort-int8", "precision": "int8", "passed": False, "run_id": "r2",
                          "version": None, "p50_ms": 0.5, "promoted": False, "reason": reason,
                          "gates": {GATE: gate_status},
                          "worst_slice": {"slice": "digit", "value": slice_value, "metric": "top1_agreement",
                                          "observed": 0.9, "support": 40}}]}


def _gate(status: str) -> SimpleNamespace:
    """A gate result as `gates.evaluate_gates` returns it (the fields the report reads)."""
    return SimpleNamespace(gate=GATE, metric="top1_agreement", scope="per_slice", slice="digit", batch_size=None,
                           op=">=", threshold=0.9, estimate=0.95, bound=0.93, confidence=0.95, observed=0.95,
                           status=status, method="wilson", detail={}, min_support=30)


def test_cell_status_maps_anything_outside_the_enum_to_unknown():
    assert cell_status("passed") is CellStatus.PASSED and cell_status("insufficient_data").value == "insufficient_data"
    assert cell_status(SCRIPT) is CellStatus.UNKNOWN and cell_status(None) is CellStatus.UNKNOWN


def test_run_report_html_escapes_a_crafted_gate_status_and_uses_no_class_outside_the_enum():
    text = run_report_html(_summary(gate_status=SCRIPT, slice_value="<img src=x onerror=alert(1)>"),
                           run={"run_id": "p1", "status": "FINISHED", "name": SCRIPT})
    assert "<script>" not in text and "<img src=x" not in text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text
    classes = set(re.findall(r'<td class="([^"]*)"', text))
    assert classes <= {s.value for s in CellStatus} and "unknown" in classes


def test_write_report_escapes_a_crafted_gate_status_and_renders_math_like_slice_values(tmp_path):
    table = pd.DataFrame({"slice": ["digit"] * 4, "value": MATH_VALUES, "support": [40] * 4,
                          "top1_agreement": [1.0, 0.98, 0.97, 0.99]})
    path = write_report(tmp_path / "report.html", variant="ort-int8", overall={"top1_agreement": 0.99},
                        slice_table=table, gates=[_gate(SCRIPT), _gate("passed")], perf={})
    text = path.read_text()
    assert "<script>" not in text and 'class="unknown"' in text and 'class="passed"' in text
    images = _images(text)
    assert len(images) == 1 and images[0].startswith(b"\x89PNG")  # the per-slice plot rendered
    assert "$\\frac{$" in text  # the table shows the value as written


def test_run_report_heat_map_renders_when_slice_values_look_like_mathtext():
    tables = {name: pd.DataFrame({"slice": ["digit"] * 4, "value": MATH_VALUES, "support": [40] * 4,
                                  "top1_agreement": [1.0, 0.98, 0.97, 0.99]})
              for name in ("ort-fp32", "$ort$")}
    text = run_report_html(_summary(slice_value="$x$"), run={"run_id": "p1", "status": "FINISHED"},
                           slice_tables=tables)
    images = _images(text)
    assert len(images) == 2 and all(i.startswith(b"\x89PNG") for i in images)  # Pareto plot + heat map


def test_plots_draw_data_labels_as_written_when_they_hold_dollar_signs():
    import matplotlib

    matplotlib.use("Agg")
    from tailguard.core.report import no_mathtext_context

    with no_mathtext_context():
        fig = matplotlib.figure.Figure()
        t = fig.add_subplot().set_title("$x$")
        assert t.get_parse_math() is False and t.get_usetex() is False


def test_decision_note_escapes_markdown_links_images_and_html_from_data():
    reason = "bad ![pixel](http://evil.example/p.png) [click](https://evil.example) <b>x</b> `code`\n# heading"
    note = decision_note(_summary(reason=reason))
    line1, line2 = note.split("\n")
    assert "![pixel](" not in note and "[click](" not in note and "\n#" not in note
    assert not re.search(r"(?<!\\)[<\[\]`]", note)  # every <, [, ], ` escaped: no tag, link, image or code
    assert "!\\[pixel\\](http:\\/\\/evil.example/p.png)" in line1 and "\\<b>" in line1 and "\\`code\\`" in line1
    assert "ort-int8 (bad" in line1  # the reason is kept, as literal text
    plain = decision_note(_summary(reason=reason), markdown=False)  # the HTML banner escapes it as HTML instead
    assert "![pixel](http://evil.example/p.png)" in plain


def test_markdown_text_keeps_gate_keys_readable_and_breaks_bare_links():
    assert markdown_text(GATE) == GATE  # `_`, `>`, `@`, `:` start nothing inside a line
    assert markdown_text("see www.evil.example") == "see www\\.evil.example"


@pytest.mark.integration
def test_tailguard_report_escapes_crafted_tags_when_rebuilt_from_the_store(tmp_path):
    from tailguard.run_report import build_run_report

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("crafted")
    parent = client.create_run(exp, tags={"tailguard.pipeline_run": "1", "tailguard.source_model": "digits"})
    client.create_run(exp, tags={"mlflow.parentRunId": parent.info.run_id, "tailguard.variant": "ort-int8",
                                 "tailguard.status": SCRIPT, "gate.top1_agreement ge 0.9": SCRIPT,
                                 "tailguard.worst_slice": "[not an object"})
    client.set_terminated(parent.info.run_id, "FAILED")
    text, run_id = build_run_report(parent.info.run_id, tracking_uri=uri)
    assert run_id == parent.info.run_id
    assert "<script>" not in text
    assert "unknown status tag" in text  # the crafted status is named (escaped), the variant counted as failed
    assert set(re.findall(r'<td class="([^"]*)"', text)) <= {s.value for s in CellStatus}
