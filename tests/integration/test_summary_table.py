"""The end-of-run summary (tailguard.terminal.print_summary, tailguard.runner.summary_rows / summary_document):
gate keys never broken inside a token, overall agreement and accuracy, the worst slice only when it is not
perfect, and build and gate statuses as separate JSON fields. Rendered with real rich consoles of fixed widths."""

import io
import json

import pytest
from rich.console import Console

import tailguard.terminal as terminal
from tailguard.components.register.summary import RunSummary, VariantSummary
from tailguard.runner import GatesStatus, gate_ids, summary_document, summary_rows, worst_slice_cell

OVERALL = "top1_agreement>=0.99@lb95"
PER_CLASS = "top1_agreement>=0.97@lb95@per_slice:lexname"
LATENCY = "latency_ms.p99<=20"


def _ws(observed, metric="top1_agreement"):
    return {"slice": "lexname", "value": "noun.Tops", "support": 41, "metric": metric, "observed": observed}


def _summary():
    fp32 = VariantSummary("ort-fp32", "onnxruntime", "fp32", "ok", passed=True, version="4", promoted=True,
                          p50_ms=2.9, p99_ms=3.4, speedup_vs_torch=4.31, speedup_vs_onnx_fp32=1.0,
                          worst_slice=_ws(1.0), gates={OVERALL: "passed", PER_CLASS: "passed", LATENCY: "passed"},
                          overall={"top1_agreement": 1.0, "accuracy": 0.9121, "reference_accuracy": 0.9121})
    static = VariantSummary("ort-int8-static", "onnxruntime", "int8", "ok", passed=False, version="5",
                            reason=f"failed gates: {OVERALL}, {PER_CLASS}", p50_ms=1.2, p99_ms=1.9,
                            speedup_vs_torch=10.3, speedup_vs_onnx_fp32=2.4, worst_slice=_ws(0.3103),
                            gates={OVERALL: "failed", PER_CLASS: "failed", LATENCY: "passed"},
                            overall={"top1_agreement": 0.3103, "accuracy": 0.3010}, quantized_mac_fraction=1.0)
    trt = VariantSummary("trt-fp16", "tensorrt", "fp16", "skipped", reason="no GPU: nvidia-smi not found")
    return RunSummary("p", "0", "minilm-lexname", "3", "minilm-lexname-optimized", "production", True, 1,
                      variants=[fp32, static, trt])


def _render(monkeypatch, width):
    out = Console(file=io.StringIO(), width=width, highlight=False, color_system=None)
    monkeypatch.setattr(terminal, "console", out)
    terminal.print_summary(_summary())
    return out.file.getvalue()


@pytest.mark.parametrize("width", [80, 200])
def test_print_summary_keeps_every_gate_key_and_variant_name_whole_when_terminal_is_narrow_or_wide(monkeypatch,
                                                                                                   width):
    text = _render(monkeypatch, width)
    lines = text.splitlines()
    for gid, key in (("G1", OVERALL), ("G2", PER_CLASS), ("G3", LATENCY)):
        assert any(line.strip() == f"{gid} = {key}" for line in lines), (key, text)  # the legend, one key a line
    for name in ("ort-fp32", "ort-int8-static", "trt-fp16", "lexname=noun.Tops:", "@production"):
        assert name in text, (name, text)
    assert "failed: G1, G2" in " ".join(text.split())  # the table names failed gates by id
    legend = {f"  G{i} = {k}" for i, k in enumerate((OVERALL, PER_CLASS, LATENCY), 1)}
    assert all(len(line) <= width for line in lines if line not in legend)


def test_print_summary_uses_a_table_when_wide_and_one_block_per_variant_when_narrow(monkeypatch):
    wide, narrow = _render(monkeypatch, 200), _render(monkeypatch, 80)
    header = next(line for line in wide.splitlines() if "variant" in line)
    assert "agreement" in header and "accuracy" in header and "worst slice" in header
    assert "┃" not in narrow and "  agreement   0.3103" in narrow and "  accuracy    0.9121" in narrow


def test_summary_rows_show_overall_agreement_and_accuracy_when_the_result_has_them():
    rows = {r["variant"]: r for r in summary_rows(_summary())}
    assert (rows["ort-int8-static"]["agreement"], rows["ort-int8-static"]["accuracy"]) == (0.3103, 0.3010)
    assert rows["trt-fp16"]["agreement"] is None and rows["trt-fp16"]["accuracy"] is None
    emb = VariantSummary("e", "onnxruntime", "fp32", "ok", passed=True, overall={"nn_top1_agreement": 0.98})
    [row] = summary_rows(RunSummary("p", "0", "m", "1", "m-optimized", "production", True, 1, variants=[emb]))
    assert row["agreement"] == 0.98 and row["accuracy"] is None  # embedding task, no labels


def test_worst_slice_cell_is_a_dash_when_the_worst_slice_is_perfect_and_names_it_otherwise():
    perfect = VariantSummary("a", "onnxruntime", "fp32", "ok", passed=True, worst_slice=_ws(1.0))
    assert worst_slice_cell(perfect) == "-"
    kl = VariantSummary("a", "onnxruntime", "fp32", "ok", passed=True, worst_slice=_ws(0.0, "kl_divergence.p99"))
    assert worst_slice_cell(kl) == "-"  # lower is better, 0 is perfect
    below = VariantSummary("b", "onnxruntime", "int8", "ok", worst_slice=_ws(0.951))
    assert worst_slice_cell(below) == "lexname=noun.Tops: 0.951 (n=41)"
    accuracy = VariantSummary("c", "onnxruntime", "int8", "ok", worst_slice=_ws(1.0, "accuracy"))
    assert worst_slice_cell(accuracy) != "-"  # accuracy has no perfect score to compare with the reference
    failed = VariantSummary("d", "onnxruntime", "int8", "ok", worst_slice=_ws(1.0), gates={PER_CLASS: "failed"})
    assert worst_slice_cell(failed).startswith("lexname=noun.Tops")
    assert worst_slice_cell(VariantSummary("e", "tensorrt", "fp16", "skipped")) == ""


def test_summary_document_has_build_and_gates_statuses_apart_when_a_built_variant_failed_its_gates():
    doc = json.loads(json.dumps(summary_document(_summary())))
    rows = {v["variant"]: v for v in doc["variants"]}
    assert (rows["ort-int8-static"]["build_status"], rows["ort-int8-static"]["gates_status"]) == ("ok", "failed")
    assert (rows["ort-fp32"]["build_status"], rows["ort-fp32"]["gates_status"]) == ("ok", "passed")
    assert (rows["trt-fp16"]["build_status"], rows["trt-fp16"]["gates_status"]) == ("skipped", "not_run")
    assert rows["ort-int8-static"]["gates"][PER_CLASS] == "failed"  # the per-gate map stays
    assert rows["ort-fp32"]["overall"]["accuracy"] == 0.9121
    held = VariantSummary("h", "onnxruntime", "int8", "ok", gates={OVERALL: "passed", PER_CLASS: "insufficient_data"})
    s = RunSummary("p", "0", "m", "1", "m-optimized", "production", True, 1, variants=[held])
    assert summary_document(s)["variants"][0]["gates_status"] == GatesStatus.INSUFFICIENT_DATA == "insufficient_data"


def test_gate_ids_number_gates_in_spec_order_across_variants():
    assert gate_ids(_summary()) == {OVERALL: "G1", PER_CLASS: "G2", LATENCY: "G3"}
