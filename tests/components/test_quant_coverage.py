"""Quantization coverage as a fact and a gate (issue 13, item 3).

MAC counting (components/build/macs.py) on hand-made ONNX graphs whose MACs are known by hand; the build's
coverage on a real Linear-ReLU-Linear-ReLU-Linear MLP and a small CNN exported from torch, quantized by ONNX
Runtime (dynamic and static) with the DEFAULT spec (graph_optimization.level: extended); the gate
`quantized_mac_fraction` through spec check, gate evaluation, the validate step's metrics and a real MLflow file
store; the summary's per-variant fraction and its low-coverage flag. No mocks.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pandas as pd
import pytest
from onnx import TensorProto, helper, numpy_helper

from tailguard.components.build import calibration
from tailguard.components.build.builders import onnxruntime as ort_builder
from tailguard.components.build.logic import build_variant
from tailguard.components.build.macs import DEFAULT_SEQUENCE, count_macs, quantization_coverage
from tailguard.components.validate.gates import build_metrics, evaluate_gates
from tailguard.components.validate.run_log import coverage_line
from tailguard.core.contract import QUANTIZATION_COVERAGE_KEY
from tailguard.core.errors import SpecError
from tailguard.core.spec import parse_spec
from tailguard.core.spec.model import ModelSpec
from tailguard.core.spec.variants import VariantSpec

IN, H1, H2, OUT = 64, 32, 32, 10
MLP_MACS = IN * H1 + H1 * H2 + H2 * OUT  # 3392 per sample


# ------------------------------------------------------------------------------------------------ helpers
def _model(nodes, inputs, outputs, inits=(), opset=17, ms=False):
    imports = [helper.make_opsetid("", opset)] + ([helper.make_opsetid("com.microsoft", 1)] if ms else [])
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    return helper.make_model(graph, opset_imports=imports)


def _w(name, *shape, dtype=np.float32):
    return numpy_helper.from_array(np.ones(shape, dtype=dtype), name)


def _vi(name, shape, elem=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, elem, shape)


def _macs(model, **kw):
    return {n.name: n.macs for n in count_macs(model, **kw).nodes}


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    """(fp32 .onnx path of a seeded Linear-ReLU-Linear-ReLU-Linear MLP [batch, 64] -> [batch, 10], ModelSpec,
    calibration Dataset of 32 rows)."""
    import torch

    from tailguard.core.data import load_dataset

    d = tmp_path_factory.mktemp("mlp")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(IN, H1), torch.nn.ReLU(), torch.nn.Linear(H1, H2), torch.nn.ReLU(),
                              torch.nn.Linear(H2, OUT)).eval()
    path = d / "mlp.onnx"
    torch.onnx.export(net, (torch.randn(2, IN),), str(path), input_names=["x"], output_names=["logits"],
                      dynamic_axes={"x": {0: "batch"}, "logits": {0: "batch"}}, dynamo=False)
    spec = ModelSpec.model_validate({
        "registered_name": "mlp", "task": "classification",
        "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", IN]}],
        "outputs": [{"name": "logits", "dtype": "float32", "shape": ["batch", OUT]}]})
    rows = np.random.default_rng(0).standard_normal((32, IN)).astype(np.float32)
    pd.DataFrame({"x": [r.tolist() for r in rows], "label": np.arange(32) % OUT}).to_parquet(d / "calib.parquet")
    return path, spec, load_dataset(str(d / "calib.parquet"), spec.inputs)


def _int8(name, **quantization):
    return VariantSpec.model_validate({"name": name, "backend": "onnxruntime", "precision": "int8",
                                       "quantization": quantization})


# ---------------------------------------------------------------------------------------------- formulas
def _matmul_gemm_graph():
    return _model(
        [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm"),                       # (1,S,8)x(8,4)
         helper.make_node("Gemm", ["g_in", "w2"], ["g"], name="gemm", transB=1),          # (1,6)x(5,6)^T
         helper.make_node("MatMul", ["a", "b"], ["ab"], name="bmm")],                     # (2,S,3)x(2,3,S)
        [_vi("x", ["batch", "sequence", 8]), _vi("g_in", ["batch", 6]), _vi("a", ["batch", 2, "sequence", 3]),
         _vi("b", ["batch", 2, 3, "sequence"])],
        [_vi("h", None), _vi("g", None), _vi("ab", None)], [_w("w1", 8, 4), _w("w2", 5, 6)])


def _conv_graph():
    return _model(
        [helper.make_node("Conv", ["x", "w"], ["y"], name="same", pads=[1, 1, 1, 1]),
         helper.make_node("Conv", ["x", "w"], ["z"], name="strided", strides=[2, 2]),
         helper.make_node("Conv", ["x", "wg"], ["u"], name="grouped", group=3, auto_pad="SAME_UPPER")],
        [_vi("x", ["batch", 3, 8, 8])], [_vi("y", None), _vi("z", None), _vi("u", None)],
        [_w("w", 4, 3, 3, 3), _w("wg", 6, 1, 3, 3)])


def _attention_lstm_graph():
    attention = helper.make_node("Attention", ["x", "w", "bias"], ["y"], name="attn", domain="com.microsoft",
                                 num_heads=2)
    lstm = helper.make_node("LSTM", ["s", "lw", "lr"], ["ly"], name="lstm", hidden_size=3)
    return _model([attention, lstm], [_vi("x", ["batch", "sequence", 16]), _vi("s", ["sequence", "batch", 4])],
                  [_vi("y", None), _vi("ly", None)],
                  [_w("w", 16, 48), _w("bias", 48), _w("lw", 1, 12, 4), _w("lr", 1, 12, 3)], ms=True)


def _qdq_graph():
    zp, sc = numpy_helper.from_array(np.uint8(128), "zp"), numpy_helper.from_array(np.float32(0.1), "sc")
    w8 = numpy_helper.from_array(np.ones((8, 4), np.int8), "w8")
    w16 = numpy_helper.from_array(np.ones((8, 4), np.int16), "w16")
    nodes = [helper.make_node("QuantizeLinear", ["x", "sc", "zp"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "sc", "zp"], ["xd"]),
             helper.make_node("DequantizeLinear", ["w8", "sc"], ["wd"]),
             helper.make_node("DequantizeLinear", ["w16", "sc"], ["wd16"]),
             helper.make_node("MatMul", ["xd", "wd"], ["y1"], name="qdq"),            # both operands 8-bit
             helper.make_node("MatMul", ["x", "wd"], ["y2"], name="weight_only"),     # float activation
             helper.make_node("MatMul", ["xd", "wd16"], ["y3"], name="int16_weight"),
             helper.make_node("MatMulInteger", ["xq", "w8"], ["y4"], name="integer")]
    return _model(nodes, [_vi("x", ["batch", 8])], [_vi(f"y{i}", None) for i in range(1, 5)],
                  [zp, sc, w8, w16], opset=21)


def test_count_macs_gives_m_k_n_when_matmul_and_gemm_and_batched_matmul():
    model = _matmul_gemm_graph()
    assert _macs(model, sequence=7) == {"mm": 7 * 8 * 4, "gemm": 6 * 5, "bmm": 2 * 7 * 3 * 7}
    assert _macs(model)["mm"] == DEFAULT_SEQUENCE * 8 * 4  # no typical length given: the documented default
    assert count_macs(model, sequence=7).dims == {"batch": 1, "sequence": 7}


def test_count_macs_uses_output_size_times_kernel_when_conv_with_pads_or_strides():
    model = _conv_graph()
    # out channels * output positions * (in channels / group) * kernel positions
    assert _macs(model) == {"same": 4 * 8 * 8 * 3 * 9, "strided": 4 * 3 * 3 * 3 * 9, "grouped": 6 * 8 * 8 * 1 * 9}


def test_count_macs_counts_projections_and_score_products_when_attention_and_lstm():
    model = _attention_lstm_graph()
    s = 5
    assert _macs(model, sequence=s) == {"attn": s * 16 * 48 + s * s * (16 + 16),  # QKV projection, QK^T, AV
                                        "lstm": s * 1 * (12 * 4 + 12 * 3)}      # 4 gates x H x (I + H) per step


def test_count_macs_marks_int8_only_when_every_operand_is_dequantized_from_8_bits():
    count = count_macs(_qdq_graph())
    assert {n.name: n.int8 for n in count.nodes} == {"qdq": True, "weight_only": False, "int16_weight": False,
                                                     "integer": True}
    assert count.total == 4 * 32 and count.int8 == 2 * 32 and count.fraction == 0.5


# -------------------------------------------------------------------------------- builds: the default spec
@pytest.mark.parametrize("mode", ["dynamic", "static"])
def test_build_variant_quantizes_all_three_layers_when_mlp_uses_the_default_spec(mlp, tmp_path, mode):
    path, spec, calib = mlp
    v = _int8(f"int8-{mode}", mode=mode)
    assert v.graph_optimization.level == "extended" and v.graph_optimization.fusion == "none"  # the default
    res = build_variant(v, path, tmp_path / v.name, calibration=calib, model=spec)
    assert res.status == "ok", res.reason
    d = res.details
    assert (d["quantizable_nodes"], d["quantized_mac_nodes"]) == (3, 3)
    assert d["macs_total"] == d["macs_int8"] == MLP_MACS and d["quantized_mac_fraction"] == 1.0
    assert d["quantization_coverage"]["float_mac_nodes"] == []
    assert d["graph_optimization"]["before_quantization"] == "basic"
    assert d["graph_optimization"]["after_quantization"] == "extended"
    # the fact travels with the artifact: the validate step and search trials read it from the file
    assert build_metrics(res.artifact) == {"quantized_mac_fraction": 1.0}
    props = {p.key: p.value for p in onnx.load(res.artifact).metadata_props}
    assert json.loads(props[QUANTIZATION_COVERAGE_KEY])["macs_int8"] == MLP_MACS


def test_quantization_coverage_shows_one_layer_of_three_when_extended_fusions_run_before_quantizing(mlp, tmp_path):
    # The order this issue replaced: ORT's extended level fuses Gemm+Relu into FusedGemm, which no quantizer
    # knows; only the last Gemm (32 x 10 of 3392 MACs) was quantized while the build said ok.
    path, _, _ = mlp
    fused = tmp_path / "extended.onnx"
    ort_builder._ort_optimize(path, fused, "extended", "CPUExecutionProvider")
    quantized = tmp_path / "q.onnx"
    ort_builder._quantize_dynamic(_int8("old", mode="dynamic").quantization, fused, quantized, [], {})
    cov = quantization_coverage(fused, quantized)
    assert (cov["quantizable_nodes"], cov["quantized_mac_nodes"]) == (3, 1)
    assert cov["quantized_mac_fraction"] == pytest.approx(H2 * OUT / MLP_MACS, abs=1e-6)  # 0.094
    assert {n["op_type"] for n in cov["float_mac_nodes"]} == {"FusedGemm"}
    assert coverage_line(cov) == "1/3 MAC nodes INT8, 9.4% of 3.39 kMACs per sample"


def test_build_variant_reports_the_float_share_when_a_layer_is_excluded(mlp, tmp_path):
    path, spec, calib = mlp
    res = build_variant(_int8("excl", mode="dynamic", exclude_nodes=["/0/Gemm"]), path, tmp_path, calibration=None,
                        model=spec)
    assert res.status == "ok", res.reason
    assert res.details["quantized_mac_nodes"] == 2
    assert res.details["quantized_mac_fraction"] == pytest.approx((H1 * H2 + H2 * OUT) / MLP_MACS, abs=1e-6)
    assert [n["macs"] for n in res.details["quantization_coverage"]["float_mac_nodes"]] == [IN * H1]



def _export_cnn(path, *, channels: int):
    """A 2-conv CNN on 1x8x8 images (conv 1->channels, conv channels->8, linear to 10 logits), exported to `path`
    with a dynamic batch axis (the TorchScript exporter)."""
    import torch

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(1, channels, 3, padding=1), torch.nn.ReLU(),
                              torch.nn.Conv2d(channels, 8, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                              torch.nn.Linear(8 * 6 * 6, 10)).eval()
    torch.onnx.export(net, (torch.randn(2, 1, 8, 8),), str(path), input_names=["image"], output_names=["logits"],
                      dynamic_axes={"image": {0: "batch"}, "logits": {0: "batch"}}, dynamo=False)
    return path

def test_build_variant_quantizes_every_conv_when_cnn_uses_the_default_spec(tmp_path):
    from tailguard.core.data import load_dataset

    path = _export_cnn(tmp_path / "cnn.onnx", channels=4)
    spec = ModelSpec.model_validate({
        "registered_name": "cnn", "task": "classification",
        "inputs": [{"name": "image", "dtype": "float32", "shape": ["batch", 1, 8, 8]}],
        "outputs": [{"name": "logits", "dtype": "float32", "shape": ["batch", 10]}]})
    imgs = np.random.default_rng(0).standard_normal((16, 1, 8, 8)).astype(np.float32)
    pd.DataFrame({"image": [i.tolist() for i in imgs]}).to_parquet(tmp_path / "c.parquet")
    calib = load_dataset(str(tmp_path / "c.parquet"), spec.inputs)
    res = build_variant(_int8("cnn-static", mode="static"), path, tmp_path / "b", calibration=calib, model=spec)
    assert res.status == "ok", res.reason
    conv_macs = 4 * 64 * 1 * 9 + 8 * 36 * 4 * 9
    assert res.details["macs_total"] == conv_macs + 8 * 6 * 6 * 10
    assert (res.details["quantized_mac_nodes"], res.details["quantized_mac_fraction"]) == (3, 1.0)


# ------------------------------------------------------------------------------------------------- spec
def _spec(gates, variants=None, promotion=None):
    return parse_spec({
        "apiVersion": "tailguard/v1", "kind": "OptimizationSpec", "metadata": {"name": "cov"},
        "model": {"registered_name": "mlp", "task": "classification",
                  "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", IN]}],
                  "outputs": [{"name": "logits", "dtype": "float32", "shape": ["batch", OUT]}]},
        "data": {"calibration": {"uri": "c.parquet"}, "validation": {"uri": "v.parquet"}},
        "variants": variants or [{"name": "ort-fp32", "backend": "onnxruntime", "precision": "fp32"},
                                 {"name": "ort-int8", "backend": "onnxruntime", "precision": "int8",
                                  "quantization": {"mode": "dynamic"}}],
        "gates": [{"metric": "top1_agreement", "min": 0.9}] + gates,
        "benchmark": {"batch_sizes": [1], "warmup": 1, "iterations": 3},
        "promotion": promotion or {"enabled": True}})


def _errors(gates, **kw) -> dict[str, str]:
    with pytest.raises(SpecError) as info:
        _spec(gates, **kw)
    return {e.loc: e.message for e in info.value.errors}


def test_spec_accepts_a_quantized_mac_fraction_gate_when_overall_with_min():
    spec = _spec([{"metric": "quantized_mac_fraction", "min": 0.9}])
    assert spec.gates[1].key == "quantized_mac_fraction>=0.9"


def test_spec_check_rejects_confidence_per_slice_and_relative_bounds_when_gating_quantized_mac_fraction():
    errs = _errors([{"metric": "quantized_mac_fraction", "min": 0.9, "confidence": 0.95},
                    {"metric": "quantized_mac_fraction", "min": 0.9, "scope": "per_slice"},
                    {"metric": "quantized_mac_fraction", "max_drop": 0.1},
                    {"metric": "quantized_mac_fraction", "min": 90},
                    {"metric": "quantized_mac_fraction", "min": 0.9, "batch_size": 1}])
    assert "no confidence bound" in errs["gates.1.confidence"]
    assert "overall only" in errs["gates.2.scope"]
    assert "absolute bound" in errs["gates.3.max_drop"]
    assert "fraction in [0, 1]" in errs["gates.4.min"]
    assert "remove batch_size" in errs["gates.5.batch_size"]


def test_spec_check_rejects_a_quantized_mac_fraction_gate_when_no_int8_variant_is_judged():
    only_fp32 = [{"name": "ort-fp32", "backend": "onnxruntime", "precision": "fp32"}]
    assert "spec has none" in _errors([{"metric": "quantized_mac_fraction", "min": 0.9}],
                                      variants=only_fp32)["gates.1.metric"]
    named = _errors([{"metric": "quantized_mac_fraction", "min": 0.9, "variants": ["ort-fp32", "ort-int8"]}])
    assert "INT8 onnxruntime variants only; ['ort-fp32'] is not" in named["gates.1.variants"]


# ------------------------------------------------------------------------------------------------- gates
def test_gate_passes_int8_and_skips_fp32_when_quantized_mac_fraction_is_gated():
    spec = _spec([{"metric": "quantized_mac_fraction", "min": 0.9}])
    table = pd.DataFrame(columns=["slice", "value", "support"])
    ok = evaluate_gates(spec, "ort-int8", {"top1_agreement": 1.0, "quantized_mac_fraction": 0.95}, table, {})[1]
    low = evaluate_gates(spec, "ort-int8", {"top1_agreement": 1.0, "quantized_mac_fraction": 0.094}, table, {})[1]
    fp32 = evaluate_gates(spec, "ort-fp32", {"top1_agreement": 1.0}, table, {})[1]
    unmeasured = evaluate_gates(spec, "ort-int8", {"top1_agreement": 1.0}, table, {})[1]
    assert (ok.status, ok.observed, ok.decided_on) == ("passed", 0.95, "point")
    assert (low.status, low.observed) == ("failed", 0.094)
    assert fp32.status == "not_applicable" and "fp32" in fp32.method
    assert unmeasured.status == "failed" and QUANTIZATION_COVERAGE_KEY in unmeasured.detail["reason"]


def test_build_metrics_is_empty_when_the_model_has_no_coverage(mlp):
    assert build_metrics(mlp[0]) == {} and build_metrics(None) == {}


# ---------------------------------------------------------------------------- validate step and summary
def test_validation_logs_the_fraction_and_decides_its_gate_when_an_int8_mlp_is_validated(mlp, tmp_path):
    import mlflow

    from tailguard.components.validate.logic import validate_variant
    from tailguard.components.validate.run_log import log_coverage, log_validation
    from tailguard.core.runtime import OrtRunner, run_dataset

    path, model, calib = mlp
    spec = _spec([{"metric": "quantized_mac_fraction", "min": 0.9}], promotion={"enabled": False})
    built = build_variant(spec.variants[1], path, tmp_path / "b", calibration=None, model=model)
    reference = run_dataset(OrtRunner(path), calib, model.inputs, batch_size=8)
    result = validate_variant(spec, "ort-int8", OrtRunner(built.artifact), reference, calib, tmp_path / "v",
                              model_path=built.artifact)
    assert result.overall["quantized_mac_fraction"] == 1.0
    assert [g.status for g in result.gates] == ["passed", "passed"]
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")  # a real store of this test's own
    run_id = client.create_run(client.create_experiment("cov")).info.run_id
    log_coverage(client, run_id, built.to_dict())
    log_validation(client, run_id, result)
    run = client.get_run(run_id)
    assert run.data.metrics["quantized_mac_fraction"] == 1.0
    assert run.data.tags["tailguard.quantization_coverage"].startswith("3/3 MAC nodes INT8, 100.0%")


def test_summary_flags_an_int8_variant_when_it_quantized_under_half_its_macs():
    from tailguard.components.register.summary import RunSummary, VariantSummary, coverage_warnings
    from tailguard.terminal import console, int8_macs_cell, print_summary

    assert coverage_warnings("int8", "onnxruntime", "ok", 0.094)[0].startswith(
        "INT8 variant computes only 9% of its MACs in INT8")
    assert coverage_warnings("int8", "onnxruntime", "ok", 0.5) == []
    assert coverage_warnings("fp32", "onnxruntime", "ok", None) == []
    assert "not recorded" in coverage_warnings("int8", "onnxruntime", "ok", None)[0]
    low = VariantSummary("ort-int8", "onnxruntime", "int8", "ok", passed=True, quantized_mac_fraction=0.094,
                         warnings=coverage_warnings("int8", "onnxruntime", "ok", 0.094))
    full = VariantSummary("ort-int8-static", "onnxruntime", "int8", "ok", passed=True, quantized_mac_fraction=1.0)
    fp32 = VariantSummary("ort-fp32", "onnxruntime", "fp32", "ok", passed=True)
    assert (int8_macs_cell(full), int8_macs_cell(fp32)) == ("100%", "")
    assert int8_macs_cell(low) == "[bold red]9.4% ![/bold red]"
    summary = RunSummary("p", "e", "mlp", "1", "mlp-optimized", "production", True, 1, variants=[fp32, low, full])
    assert RunSummary.from_dict(summary.to_dict()).variants[1].quantized_mac_fraction == 0.094
    with console.capture() as cap:
        print_summary(summary)
    text = cap.get()
    assert "int8 MACs" in text and "9.4% !" in text and "100%" in text
    assert "! ort-int8: INT8 variant computes only 9%" in text


def test_infer_shapes_evaluates_every_symbolic_input_axis_that_concrete_dims_names_when_named_and_unnamed():
    # the symbolic-axis walk is one function for concrete_dims and the shape inference: both see the same axes
    from tailguard.components.build.macs import concrete_dims, infer_shapes

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 8])
    mask = helper.make_tensor_value_info("mask", TensorProto.FLOAT, [None, None])  # unnamed symbolic axes
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    m = helper.make_model(helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", [x, mask], [y]))
    dims = concrete_dims(m, batch=2, sequence=5)
    assert dims == {"batch": 2, "seq": 5, "mask[0]": 2, "mask[1]": 5}
    shapes = infer_shapes(m, {**dims, "seq": 7})
    assert shapes["x"] == (2, 7, 8) and shapes["mask"] == (2, 5) and shapes["y"] == (2, 7, 8)
    assert [d.dim_param for d in m.graph.input[0].type.tensor_type.shape.dim][:2] == ["batch", "seq"]  # not mutated


# ------------------------------------------------------------------- shape inference on a skeleton (no weights)
def _attention_reshape_graph():
    """A BERT-style self-attention written out: a Q projection, a Reshape to heads whose shape is an int64
    initializer (its values are needed: data propagation), Transpose, Q.Q^T; the weight is (16, 96)."""
    heads = numpy_helper.from_array(np.array([0, 0, 2, 48], np.int64), "heads")
    nodes = [helper.make_node("MatMul", ["x", "wq"], ["q"], name="proj"),
             helper.make_node("Reshape", ["q", "heads"], ["qh"]),
             helper.make_node("Transpose", ["qh"], ["qt"], perm=[0, 2, 1, 3]),
             helper.make_node("Transpose", ["qh"], ["kt"], perm=[0, 2, 3, 1]),
             helper.make_node("MatMul", ["qt", "kt"], ["scores"], name="scores")]
    return _model(nodes, [_vi("x", ["batch", "sequence", 16])], [_vi("scores", None)],
                  [_w("wq", 16, 96), heads])


def _initializers_as_inputs_graph():
    """IR 3 style: the weights are listed among the graph inputs too (with a symbolic axis in the input's type)."""
    model = _model([helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
                    helper.make_node("Gemm", ["h", "w2"], ["y"], name="gemm")],
                   [_vi("x", ["batch", 40]), _vi("w", ["rows", 40]), _vi("w2", [40, 30])], [_vi("y", None)],
                   [_w("w", 40, 40), _w("w2", 40, 30)])
    return model


SKELETON_GRAPHS = {"matmul_gemm": _matmul_gemm_graph, "conv": _conv_graph, "attention_lstm": _attention_lstm_graph,
                   "qdq": _qdq_graph, "attention_reshape": _attention_reshape_graph,
                   "initializers_as_inputs": _initializers_as_inputs_graph}


@pytest.mark.parametrize("keep_values_numel", [0, 1024])
@pytest.mark.parametrize("graph", sorted(SKELETON_GRAPHS))
def test_count_macs_gives_the_full_weights_result_when_inferring_on_the_skeleton(graph, keep_values_numel,
                                                                                 monkeypatch):
    # 0: every float/8-bit weight of rank >= 2 loses its data, so the skeleton path is exercised on each graph
    from tailguard.components.build import macs

    monkeypatch.setattr(macs, "KEEP_VALUES_NUMEL", keep_values_numel)
    model = SKELETON_GRAPHS[graph]()
    if keep_values_numel == 0:  # the skeleton is used, and it lacks weights
        assert not macs._value_read_risk(model) and any(macs._strippable(t) for t in model.graph.initializer)
    for sequence in (5, DEFAULT_SEQUENCE):
        fast, full = (count_macs(model, sequence=sequence, keep_weights=k) for k in (False, True))
        assert (fast.nodes, fast.dims, fast.shapes) == (full.nodes, full.dims, full.shapes)
        assert all(n.macs is not None for n in fast.nodes), fast.nodes


def test_quantization_coverage_gives_the_full_weights_result_when_mlp_and_cnn_are_quantized(mlp, tmp_path):
    path, spec, calib = mlp
    pairs = []
    for mode in ("dynamic", "static"):
        q = _int8(f"int8-{mode}", mode=mode).quantization
        out = tmp_path / f"{mode}.onnx"
        if mode == "dynamic":
            ort_builder._quantize_dynamic(q, path, out, [], {})
        else:
            calibration._quantize_static(q, path, out, [], calib, spec, 8, tmp_path, {})
        pairs.append((path, out))
    cnn = _export_cnn(tmp_path / "cnn.onnx", channels=16)
    ort_builder._quantize_dynamic(_int8("cnn", mode="dynamic").quantization, cnn, tmp_path / "cnn-q.onnx",
                                          [], {})
    pairs.append((cnn, tmp_path / "cnn-q.onnx"))
    for fp32, quantized in pairs:
        fast = quantization_coverage(fp32, quantized, sequence=7)
        assert fast == quantization_coverage(fp32, quantized, sequence=7, keep_weights=True)
        assert fast["macs_total"] and not fast["unknown_mac_nodes"]


def _big_weight_graph(use):
    """x [batch, 64] MatMul w [64, 64] (4,096 elements: stripped), plus one more use of w: `use`."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm")]
    outputs = [_vi("h", None)]
    if use == "reshape":  # a data input outside the shape-only uses
        nodes.append(helper.make_node("Reshape", ["w", "flat"], ["wf"]))
        outputs.append(_vi("wf", None))
    elif use == "if":  # a sub-graph sees every tensor of the outer graph
        branch = helper.make_graph([helper.make_node("Identity", ["h"], ["b"])], "branch", [], [_vi("b", None)])
        nodes.append(helper.make_node("If", ["cond"], ["o"], then_branch=branch, else_branch=branch))
        outputs.append(_vi("o", None))
    elif use == "output":
        outputs.append(_vi("w", [64, 64]))
    inits = [_w("w", 64, 64), numpy_helper.from_array(np.array([-1], np.int64), "flat"),
             numpy_helper.from_array(np.array(True), "cond")]
    return _model(nodes, [_vi("x", ["batch", 64])], outputs, inits)


@pytest.mark.parametrize("use,skeleton", [("matmul", True), ("reshape", False), ("if", False), ("output", False)])
def test_count_macs_infers_with_the_weights_data_only_when_a_large_weight_has_a_use_that_may_read_values(use,
                                                                                                        skeleton):
    from tailguard.components.build.macs import _with_concrete_inputs

    model = _big_weight_graph(use)
    concrete = _with_concrete_inputs(model, {"batch": 1})
    kept = {t.name: len(t.raw_data) for t in concrete.graph.initializer}
    if skeleton:  # typed graph input without data
        assert "w" not in kept and [i.type.tensor_type.shape for i in concrete.graph.input if i.name == "w"] == [
            helper.make_tensor_type_proto(TensorProto.FLOAT, [64, 64]).tensor_type.shape]
    else:
        assert kept["w"] == 64 * 64 * 4
    assert kept["flat"] == 8 and "w" in {t.name for t in model.graph.initializer}  # small ints kept; not mutated
    fast, full = count_macs(model), count_macs(model, keep_weights=True)
    assert (fast.nodes, fast.shapes) == (full.nodes, full.shapes) and fast.nodes[0].macs == 64 * 64
