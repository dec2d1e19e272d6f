"""The build step: every ONNX Runtime variant built for real on the tiny encoder, the TensorRT skip (the builder
registry itself: tests/components/test_builders.py).

Real ONNX Runtime quantization and sessions throughout. Mocked (narrow seams, said where): the onnxruntime
version probe `_calibration_cache_supported` (to exercise the fixed-length fallback for older ORT builds).

Dynamic INT8 accuracy is checked against a bound derived from the quantization steps
(`tests.helpers.tiny_models.int8_dynamic_error_bound`). That bound assumes exact int32 accumulation. ORT's u8s8
kernels on x86 CPUs without VNNI (SSE4.1/AVX2/AVX512BW, pmaddubsw) add adjacent u8*s8 products in int16 with saturation,
which 8-bit per-channel weights overflow (`session.x64quantprecision` in ORT's
onnxruntime_session_options_config_keys.h). The tests that check it are under "MatMulInteger arithmetic".
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from tailguard.components.build import calibration, onnx_files
from tailguard.components.build.builders import onnxruntime as ort_builder
from tailguard.components.build.calibration import DatasetCalibrationReader
from tailguard.components.build.logic import build_variant
from tailguard.core.errors import InputError, SpecError
from tailguard.core.presets import QUANTIZATION_PRESETS
from tailguard.core.spec import quantization_preset
from tailguard.core.spec.variants import VariantSpec
from tests.helpers.tiny_models import export_tiny, int8_dynamic_error_bound, tiny_dataset, tiny_feeds


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(torch module, ModelSpec, fp32 .onnx path, calibration Dataset with variable-length rows)."""
    module, spec, path = export_tiny(tmp_path_factory.mktemp("fp32"))
    return module, spec, path, tiny_dataset(24, min_len=3, max_len=12)


@pytest.fixture(scope="module")
def reference(tiny):
    """FP32 outputs [logits (3, 4), pooled (3, 16)] on a padded batch, and the batch itself."""
    feeds = tiny_feeds(3, 9, seed=5, pad_last=3)
    return ort.InferenceSession(str(tiny[2]), providers=["CPUExecutionProvider"]).run(None, feeds), feeds


def _variant(**kw) -> VariantSpec:
    return VariantSpec.model_validate({"backend": "onnxruntime", **kw})


def _build(tiny, tmp_path, **kw):
    _, spec, path, calib = tiny
    return build_variant(_variant(**kw), path, tmp_path / kw["name"], calibration=calib, model=spec)


def _session(model, *, exact_int32: bool = False) -> ort.InferenceSession:
    """A CPU session; `exact_int32` selects ORT's U8U8 kernels on x86 without VNNI (session.x64quantprecision),
    whose int32 accumulation is exact. Elsewhere (VNNI, ARM) the option changes nothing."""
    opts = ort.SessionOptions()
    if exact_int32:
        opts.add_session_config_entry("session.x64quantprecision", "1")
    return ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])


def _outputs(artifact, feeds, *, exact_int32: bool = False):
    return _session(artifact, exact_int32=exact_int32).run(None, feeds)


def _op_counts(path) -> dict[str, int]:
    counts: dict[str, int] = {}
    for n in onnx.load(str(path)).graph.node:
        counts[n.op_type] = counts.get(n.op_type, 0) + 1
    return counts


def _assert_close(outputs, reference, atol):
    for got, ref in zip(outputs, reference):
        assert np.all(np.isfinite(got))
        np.testing.assert_allclose(got, ref, atol=atol)


# ------------------------------------------------------------------------------------------------ dynamic
def _dynamic_per_channel(tiny, tmp_path, *, reduce_range: bool):
    return _build(tiny, tmp_path, name=f"dyn-rr{int(reduce_range)}", precision="int8",
                  quantization={"mode": "dynamic", "per_channel": True, "reduce_range": reduce_range,
                                "exclude_nodes": ["/l2/MatMul"]})


def _quantized_steps(artifact) -> dict[str, np.ndarray]:
    """Scales the artifact stores for the sites `int8_dynamic_error_bound` assumes, under the bound's names."""
    model = onnx.load(artifact)
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    sites = {"/emb/Gather": "emb.weight", "/l1/MatMul_quant": "l1.weight", "/head/Gemm_MatMul_quant": "head.weight"}
    steps = {}
    for n in model.graph.node:
        if n.name in sites:
            weight = n.input[0] if n.op_type == "Gather" else n.input[1]
            assert inits[weight].dtype == (np.uint8 if n.op_type == "Gather" else np.int8)
            steps[sites[n.name]] = inits[weight.removesuffix("_quantized") + "_scale"]
    return steps


@pytest.mark.parametrize("reduce_range", [False, True], ids=["8-bit-weights", "7-bit-weights"])
def test_build_variant_quantizes_matmuls_when_int8_dynamic_per_channel(tiny, reference, tmp_path, reduce_range):
    res = _dynamic_per_channel(tiny, tmp_path, reduce_range=reduce_range)
    assert res.status == "ok", res.reason
    ops = _op_counts(res.artifact)
    assert ops.get("MatMulInteger", 0) > 0 and ops.get("DynamicQuantizeLinear", 0) > 0
    assert res.details["quantized_by_op"] == {"Gather": 1, "MatMulInteger": 2}
    assert res.details["quantization"]["reduce_range"] is reduce_range
    # the excluded node is still a float MatMul reading a float weight
    node = next(n for n in onnx.load(res.artifact).graph.node if n.name == "/l2/MatMul")
    assert node.op_type == "MatMul" and res.details["excluded_kept_float"] == ["/l2/MatMul"]
    # one self-contained file, its size recorded
    assert not list(Path(res.artifact).parent.glob("*.data"))
    assert res.details["bytes"] == Path(res.artifact).stat().st_size and res.details["build_seconds"] > 0
    # outputs within the bound derived from the quantization steps, whose weight steps are the artifact's
    bounds, steps = int8_dynamic_error_bound(tiny[0], reference[1], reduce_range=reduce_range)
    stored = _quantized_steps(res.artifact)
    assert set(stored) == {"emb.weight", "l1.weight", "head.weight"}
    for name, step in stored.items():
        np.testing.assert_allclose(step, steps[name], rtol=1e-5)
    # 7-bit weights cannot overflow an int16 pair sum (2 * 255 * 64 <= 32767): the default session, on any CPU.
    # 8-bit weights can on x86 without VNNI (test_matmul_integer_saturates_...): exact int32 asked for.
    got = _outputs(res.artifact, reference[1], exact_int32=not reduce_range)
    for out, ref, bound in zip(got, reference[0], bounds):
        assert np.all(np.isfinite(out))
        assert np.all(np.abs(out - ref) <= bound), (np.abs(out - ref) / bound).max()


def test_build_variant_keeps_every_node_of_an_op_type_float_when_exclude_op_types_is_given(tiny, tmp_path):
    # dynamic quantization rewrites Gemm as "<name>_MatMul" before quantizing: that node must stay float too
    res = _build(tiny, tmp_path, name="dyn-nogemm", precision="int8",
                 quantization={"mode": "dynamic", "exclude_op_types": ["Gemm"]})
    assert res.status == "ok", res.reason
    assert res.details["excluded_kept_float"] == ["/head/Gemm_MatMul"]
    assert "/head/Gemm_MatMul" in res.details["float_matmul_nodes"]
    assert "/l1/MatMul_quant" in {n.name for n in onnx.load(res.artifact).graph.node}  # the others were quantized


def test_build_variant_fails_naming_the_node_when_an_excluded_node_is_not_in_the_graph(tiny, tmp_path):
    res = _build(tiny, tmp_path, name="dyn-typo", precision="int8",
                 quantization={"mode": "dynamic", "exclude_nodes": ["/l9/MatMul"]})
    assert res.status == "failed" and "/l9/MatMul" in res.reason and res.artifact is None


# --------------------------------------------------------------------------------- MatMulInteger arithmetic
def _x86_vnni() -> bool | None:
    """Whether this x86-64 CPU has VNNI (Linux /proc/cpuinfo flags); None when not x86-64 or unknown."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    flags = {f for line in lines if line.startswith("flags") for f in line.split(":", 1)[1].split()}
    return bool(flags & {"avx512_vnni", "avx_vnni", "amx_int8"}) if flags else None


def _matmul_integer_runs(artifact, feeds, *, exact_int32: bool = False) -> list[tuple]:
    """(A uint8, A zero point, B int8, Y int32) of every MatMulInteger, its inputs and output made graph outputs."""
    model = onnx.load(artifact)
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    nodes = [n for n in model.graph.node if n.op_type == "MatMulInteger"]
    for n in nodes:
        assert not np.any(inits[n.input[3]])  # symmetric weights: zero point 0
        model.graph.output.extend(onnx.helper.make_empty_tensor_value_info(t)
                                  for t in (n.input[0], n.input[2], n.output[0]))
    sess = _session(model.SerializeToString(), exact_int32=exact_int32)
    got = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    return [(got[n.input[0]], got[n.input[2]], inits[n.input[1]], got[n.output[0]]) for n in nodes]


def _int32_exact(a, a_zp, b) -> np.ndarray:
    return (a.astype(np.int64) - np.int64(a_zp)) @ b.astype(np.int64)


def _pair_sums(a, b) -> np.ndarray:
    """a_k * b_kj + a_k+1 * b_k+1,j for even k: (rows, K/2, N), as pmaddubsw forms them."""
    assert a.shape[-1] % 2 == 0
    a2 = a.astype(np.int64).reshape(-1, a.shape[-1])
    prod = a2[:, :, None] * b.astype(np.int64)[None]
    return prod[:, 0::2] + prod[:, 1::2]


def _int32_pair_saturated(a, a_zp, b) -> np.ndarray:
    """MLAS u8s8 without VNNI: pair sums of raw u8*s8 saturated to int16, summed in int32, minus a_zp * sum_k b."""
    raw = np.clip(_pair_sums(a, b), -32768, 32767).sum(axis=1).reshape(a.shape[:-1] + (b.shape[1],))
    return raw - np.int64(a_zp) * b.astype(np.int64).sum(axis=0)


def test_matmul_integer_matches_exact_int32_math_when_weights_use_7_bits(tiny, reference, tmp_path):
    res = _dynamic_per_channel(tiny, tmp_path, reduce_range=True)
    runs = _matmul_integer_runs(res.artifact, reference[1])
    assert len(runs) == 2
    for a, a_zp, b, y in runs:
        assert np.abs(b).max() <= 64 and np.abs(_pair_sums(a, b)).max() <= 32767  # 2 * 255 * 64 = 32640
        np.testing.assert_array_equal(y, _int32_exact(a, a_zp, b))


def test_matmul_integer_saturates_int16_pair_sums_only_without_vnni_when_per_channel_weights_use_8_bits(
        tiny, reference, tmp_path):
    # x86 without VNNI: pair-saturated (measured on AVX2 AMD EPYC, onnxruntime 1.31.1 and 1.32.0); VNNI
    # (vpdpbusd) accumulates in int32; other CPUs (ARM, unknown flags): either form is accepted.
    res = _dynamic_per_channel(tiny, tmp_path, reduce_range=False)
    vnni = _x86_vnni()
    overflowing = 0
    for a, a_zp, b, y in _matmul_integer_runs(res.artifact, reference[1]):
        exact, saturated = _int32_exact(a, a_zp, b), _int32_pair_saturated(a, a_zp, b)
        overflowing += int(np.sum(exact != saturated))
        if vnni is False:
            np.testing.assert_array_equal(y, saturated)
        elif vnni:
            np.testing.assert_array_equal(y, exact)
        else:
            assert np.array_equal(y, exact) or np.array_equal(y, saturated)
    assert overflowing > 0  # this batch overflows int16 pair sums with 8-bit per-channel weights, on any CPU
    for a, a_zp, b, y in _matmul_integer_runs(res.artifact, reference[1], exact_int32=True):
        np.testing.assert_array_equal(y, _int32_exact(a, a_zp, b))


# ------------------------------------------------------------------------------------------------- static
# Static variants quantize MatMul/Gemm only: quantizing the additive attention mask (-10000 on padded keys) too
# gives an activation scale of ~40 and outputs off by ~0.5 (the tiny model reproduces what MiniLM shows).
MATMULS = ["MatMul", "Gemm"]


def test_build_variant_inserts_qdq_pairs_when_int8_static_minmax(tiny, reference, tmp_path):
    res = _build(tiny, tmp_path, name="st-minmax", precision="int8",
                 quantization={"mode": "static", "calibration_method": "minmax", "per_channel": True,
                               "op_types": MATMULS})
    assert res.status == "ok", res.reason
    ops = _op_counts(res.artifact)
    assert ops.get("QuantizeLinear", 0) > 0 and ops.get("DequantizeLinear", 0) > 0
    assert res.details["quantized_by_op"].get("MatMul", 0) >= 2
    assert res.details["calibration"]["rows"] == 24 and res.details["calibration"]["batches"] == 3
    assert res.details["preprocess"]["ran"]
    assert (tmp_path / "st-minmax" / "calibration.parquet").is_file()
    _assert_close(_outputs(res.artifact, reference[1]), reference[0], atol=0.1)


@pytest.mark.parametrize("method", ["percentile", "entropy"])
def test_build_variant_calibrates_when_histogram_method_meets_variable_length_rows(tiny, reference, tmp_path,
                                                                                  method):
    assert len(set(tiny[3].lengths.tolist())) > 3  # the calibration rows really vary in length
    res = _build(tiny, tmp_path, name=f"st-{method}", precision="int8",
                 quantization={"mode": "static", "calibration_method": method, "num_bins": 256,
                               "op_types": MATMULS})
    assert res.status == "ok", res.reason
    assert _op_counts(res.artifact).get("QuantizeLinear", 0) > 0
    calib = res.details["calibration"]
    assert calib["method"] == method and calib["num_bins"] == 256 and calib["num_bins_applied"]
    _assert_close(_outputs(res.artifact, reference[1]), reference[0], atol=0.1)


def test_build_variant_pads_to_one_length_when_ort_cannot_take_precomputed_ranges(tiny, reference, tmp_path,
                                                                                 monkeypatch):
    # Mocked seam: the onnxruntime version probe. Older ORT builds lack quantize_static(calibration_cache_path);
    # then ORT's own percentile calibrator runs and needs every batch padded to one length and batch size.
    monkeypatch.setattr(calibration, "_calibration_cache_supported", lambda: False)
    res = _build(tiny, tmp_path, name="st-fallback", precision="int8",
                 quantization={"mode": "static", "calibration_method": "percentile", "op_types": MATMULS})
    assert res.status == "ok", res.reason
    assert res.details["calibration"]["padding"] == f"fixed length {int(tiny[3].lengths.max())}"
    assert res.details["calibration"]["num_bins_applied"] is False
    _assert_close(_outputs(res.artifact, reference[1]), reference[0], atol=0.1)


def _extended_graph(tiny, tmp_path):
    """The tiny encoder after ORT's extended level: its attention MatMul fused into FusedMatMul. INT8 builds
    quantize before these fusions now (ort_builder.optimization_levels), but graphs with contrib ops still reach
    quant_pre_process (fusion: bert, users' own exports), so `_preprocess` is tested on this graph directly."""
    dst = tmp_path / "extended.onnx"
    ort_builder._ort_optimize(tiny[2], dst, "extended", "CPUExecutionProvider")
    assert _op_counts(dst).get("FusedMatMul") == 1
    return dst


def test_preprocess_types_every_op_when_extended_fusions_defeat_plain_shape_inference(tiny, tmp_path):
    # Symbolic shape inference cannot type FusedMatMul: quant_pre_process fails, the Softmax after it stays
    # untyped and uncalibrated, and quantize_static raised "Only an existing tensor can be modified" (seen on
    # MiniLM). The retry guesses the output rank.
    _, spec, _, calib = tiny
    details: dict = {}
    pre = ort_builder._preprocess(_extended_graph(tiny, tmp_path), tmp_path / "pre.onnx", details)
    assert details["preprocess"]["ran"] and "first_try" in details["preprocess"]
    q = _variant(name="st-all", precision="int8", quantization={"mode": "static"}).quantization
    calibration._quantize_static(q, pre, tmp_path / "q.onnx", [], calib, spec, 8, tmp_path, details)
    assert onnx_files._summary(tmp_path / "q.onnx", [])["quantized_by_op"].get("Softmax") == 1


def test_preprocess_leaves_no_file_in_the_current_directory_when_shape_inference_fails_first(tiny, tmp_path,
                                                                                            monkeypatch):
    # the first quant_pre_process try fails on FusedMatMul: ORT then dumps sym_shape_infer_temp.onnx + <uuid>.data
    # into the current directory; the build must keep them out of the caller's folder
    ext = _extended_graph(tiny, tmp_path)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    details: dict = {}
    (tmp_path / "out").mkdir()
    ort_builder._preprocess(ext, tmp_path / "out" / "pre.onnx", details)
    assert "first_try" in details["preprocess"], details["preprocess"]
    assert list(cwd.iterdir()) == []
    assert not list((tmp_path / "out").glob("preprocess-*"))  # the scratch folder is removed


def test_build_variant_uses_qlinear_or_integer_ops_when_format_is_qoperator(tiny, tmp_path):
    res = _build(tiny, tmp_path, name="st-qop", precision="int8",
                 quantization={"mode": "static", "format": "qoperator"})
    assert res.status == "ok", res.reason
    assert any(op.startswith("QLinear") or op in onnx_files.INTEGER_OP_TYPES for op in res.details["quantized_by_op"])


def test_build_variant_raises_input_error_when_static_has_no_calibration_rows(tiny, tmp_path):
    _, spec, path, _ = tiny
    v = _variant(name="st", precision="int8", quantization={"mode": "static"})
    with pytest.raises(InputError, match="calibration"):
        build_variant(v, path, tmp_path, calibration=None, model=spec)


def test_calibration_reader_yields_equal_batches_when_fixed_length_is_asked(tiny):
    _, spec, _, calib = tiny
    reader = DatasetCalibrationReader(calib, spec.inputs, 5, fixed_length=12, equal_batches=True)
    shapes = [b["input_ids"].shape for b in iter(reader.get_next, None)]
    assert shapes == [(5, 12)] * 5  # 24 rows -> 5 batches of 5, the last filled with first rows
    reader.rewind()
    assert reader.get_next()["attention_mask"].shape == (5, 12)


# ------------------------------------------------------------------------------------------ fp32 / fp16
def test_build_variant_keeps_float32_io_and_float16_weights_when_fp16(tiny, reference, tmp_path):
    res = _build(tiny, tmp_path, name="fp16", precision="fp16")
    assert res.status == "ok", res.reason
    model = onnx.load(res.artifact)
    assert res.details["initializer_dtypes"].get("float16", 0) > 0
    assert [o.type.tensor_type.elem_type for o in model.graph.output] == [onnx.TensorProto.FLOAT] * 2
    assert "Cast" in res.details["fp16"]["op_block_list"]
    _assert_close(_outputs(res.artifact, reference[1]), reference[0], atol=0.01)


def test_build_variant_records_fused_ops_when_bert_fusion_is_asked(tiny, reference, tmp_path):
    res = _build(tiny, tmp_path, name="fp32-bert", precision="fp32", graph_optimization={"fusion": "bert"})
    assert res.status == "ok", res.reason
    go = res.details["graph_optimization"]
    assert go["fusion"] == "bert" and sum(go["fused_ops"].values()) > 0
    assert go["nodes"] < sum(res.details["op_types_before"].values())
    _assert_close(_outputs(res.artifact, reference[1]), reference[0], atol=1e-5)


def test_build_variant_fails_with_a_log_when_onnxruntime_cannot_handle_the_graph(tiny, tmp_path):
    # a valid ONNX file whose op ONNX Runtime has no kernel for: the tooling fails, the variant is "failed"
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Mystery", ["x"], ["y"], domain="example.custom")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])])
    path = tmp_path / "custom.onnx"
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("example.custom", 1)]
    onnx.save_model(helper.make_model(graph, opset_imports=opsets, ir_version=8), str(path))
    res = build_variant(_variant(name="fp32", precision="fp32"), path, tmp_path / "out", calibration=None,
                        model=tiny[1])
    assert res.status == "failed" and "graph optimization" in res.reason and "Mystery" in res.reason
    assert "Traceback" in (tmp_path / "out" / "build.log").read_text()


def test_build_variant_raises_input_error_naming_the_file_when_it_is_not_onnx(tiny, tmp_path):
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"not a model")
    with pytest.raises(InputError, match="junk.onnx"):
        build_variant(_variant(name="fp32", precision="fp32"), junk, tmp_path / "out", calibration=None,
                      model=tiny[1])


def test_build_variant_raises_input_error_when_the_fp32_file_is_missing(tiny, tmp_path):
    _, spec, _, _ = tiny
    with pytest.raises(InputError, match="missing.onnx"):
        build_variant(_variant(name="fp32", precision="fp32"), tmp_path / "missing.onnx", tmp_path,
                      calibration=None, model=spec)


# ------------------------------------------------------------------------------------------------ skipped
def test_build_variant_skips_with_reason_when_the_execution_provider_is_unavailable(tiny, tmp_path):
    res = _build(tiny, tmp_path, name="nope", precision="fp32", execution_provider="NoSuchExecutionProvider")
    assert res.status == "skipped" and "NoSuchExecutionProvider" in res.reason


def test_build_variant_skips_tensorrt_with_a_reason_naming_gpu_or_tensorrt(tiny, tmp_path):
    res = _build(tiny, tmp_path, name="trt-fp16", precision="fp16", backend="tensorrt")
    assert res.status == "skipped"
    assert "GPU" in res.reason or "TensorRT" in res.reason
    assert "tensorrt" not in sys.modules  # never imported at module level or for a skip


# ---------------------------------------------------------------------------------------- reproduce / presets
def test_reproduce_script_rebuilds_the_same_graph_when_run(tiny, tmp_path):
    res = _build(tiny, tmp_path, name="dyn-repro", precision="int8", quantization={"mode": "dynamic"})
    script = Path(res.details["reproduce"])
    assert script.name == "reproduce.sh" and "build_variant" in script.read_text()
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    done = subprocess.run(["sh", str(script), str(tiny[2]), str(tmp_path / "again")], capture_output=True,
                          text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout[done.stdout.index("{"):])
    assert result["status"] == "ok"
    assert _op_counts(result["artifact"]) == _op_counts(res.artifact)


def test_reproduce_script_runs_no_command_from_the_default_path_when_the_path_holds_shell_syntax(tiny, tmp_path):
    """Issue 36 item 9: a home path holding `$(...)` inside the script's double-quoted default ran the command."""
    _, spec, path, calib = tiny
    odd = tmp_path / 'home $(touch pwned) `touch pwned2` "q"'
    odd.mkdir()
    fp32 = odd / "model.onnx"
    shutil.copyfile(path, fp32)
    res = build_variant(_variant(name="dyn-odd", precision="int8", quantization={"mode": "dynamic"}), fp32,
                        odd / "dyn-odd", calibration=calib, model=spec)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    done = subprocess.run(["sh", str(res.details["reproduce"])], capture_output=True, text=True, env=env,
                          timeout=120, cwd=tmp_path)  # no arguments: the default FP32 path is used
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "pwned2").exists()
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout[done.stdout.index("{"):])["status"] == "ok"


def test_quantization_preset_builds_a_valid_spec_when_overridden():
    q = quantization_preset("tensorrt-int8", percentile=99.9)
    assert q.activation_type == "int8" and q.weight_type == "int8" and q.percentile == 99.9
    assert all(quantization_preset(name).mode in ("static", "dynamic") for name in QUANTIZATION_PRESETS)
    with pytest.raises(SpecError, match="cpu-vnni"):
        quantization_preset("no-such-preset")


def test_spec_fills_quantization_from_the_preset_when_quantization_names_one():
    from tailguard.core.spec.variants import QuantizationSpec

    q = QuantizationSpec.model_validate({"preset": "cpu-avx2", "per_channel": False})
    assert q.preset == "cpu-avx2" and q.mode == "static" and q.reduce_range is True  # from the preset
    assert q.per_channel is False  # the section's own field wins
    assert QuantizationSpec.model_validate({"preset": "cpu-dynamic"}).mode == "dynamic"
    with pytest.raises(Exception, match="unknown preset 'cpu-avx3'; known: cpu-arm, cpu-avx2"):
        QuantizationSpec.model_validate({"preset": "cpu-avx3"})
    with pytest.raises(Exception, match="mode"):  # no preset and no mode: still required
        QuantizationSpec.model_validate({"per_channel": True})


def test_build_variant_converts_an_opset_11_graph_to_13_and_records_it_when_int8_static_is_per_channel(
        tiny, reference, tmp_path):
    import torch

    from tests.helpers.tiny_models import make_tiny_encoder

    module, spec, _, calib = tiny
    old = tmp_path / "tiny11.onnx"  # as a user's opset-11 model (PP-OCR's classifier) is
    feeds = tiny_feeds(2, 7, 0)
    torch.onnx.export(make_tiny_encoder(0).eval(), tuple(torch.from_numpy(feeds[k]) for k in ("input_ids",
                                                                                             "attention_mask")),
                      str(old), input_names=["input_ids", "attention_mask"], output_names=["logits", "pooled"],
                      dynamic_axes={"input_ids": {0: "batch", 1: "sequence"},
                                    "attention_mask": {0: "batch", 1: "sequence"},
                                    "logits": {0: "batch"}, "pooled": {0: "batch"}}, opset_version=11, dynamo=False)
    assert onnx.load(str(old)).opset_import[0].version == 11
    v = _variant(name="st11", precision="int8", quantization={"mode": "static", "calibration_method": "minmax",
                                                              "per_channel": True, "format": "qdq",
                                                              "op_types": MATMULS})

    res = build_variant(v, old, tmp_path / "st11", calibration=calib, model=spec)

    assert res.status == "ok", res.reason  # was: "Unrecognized attribute: axis for operator DequantizeLinear"
    assert res.details["opset_conversion"] == {"from": 11, "to": 13, "by": "onnx.version_converter",
                                               "why": "per-channel quantization needs DequantizeLinear's axis "
                                                      "(opset 13)"}
    assert next(o.version for o in onnx.load(res.artifact).opset_import if o.domain == "") == 13
    assert _op_counts(res.artifact).get("DequantizeLinear", 0) > 0
    _assert_close(_outputs(res.artifact, reference[1]), reference[0], atol=0.1)
