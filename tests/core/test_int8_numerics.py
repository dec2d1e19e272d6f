"""INT8 numerics that depend on the CPU (issue 23, item 2): the validate step's second parity pass with exact
integer accumulation (`session.x64quantprecision`), the `hardware_dependent` flag, and the 7-bit CPU presets.

Real ONNX Runtime throughout: the tiny encoder (tests/helpers/tiny_models.py) is exported, quantized and validated with
real sessions. This machine's CPU has avx512_vnni, whose u8 x s8 kernel accumulates in int32 exactly, so the
native and exact passes give the same numbers here for real; on an x86 CPU without VNNI the 8-bit per-channel
variant's native pass saturates int16 pair sums (tests/components/test_quantize.py, "MatMulInteger arithmetic"). The
flag decision is therefore one function (`compare_numerics`) that takes the two passes: it is tested on the real
passes (no flag) and on a pair constructed from a real pass whose exact side moved (flag). Nothing is mocked.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path

import pandas as pd
import pytest

from tailguard.components.build.logic import build_variant
from tailguard.components.validate.gates import GateResult
from tailguard.components.validate.logic import validate_variant
from tailguard.components.validate.numerics import (
    NUMERICS_TOLERANCE,
    NumericsStatus,
    ParityPass,
    compare_numerics,
    integer_kernel_nodes,
)
from tailguard.core.presets import QUANTIZATION_PRESETS
from tailguard.core.results import VariantResult
from tailguard.core.runtime import OrtRunner, run_dataset
from tailguard.core.spec import parse_spec
from tests.helpers.tiny_models import INPUT_NAMES, N_CLASSES, export_tiny, tiny_dataset

GATES = [{"metric": "top1_agreement", "min": 0.9},
         {"metric": "top1_agreement", "scope": "per_slice", "min": 0.8, "min_support": 20}]


def _spec(variants: list[dict]):
    return parse_spec({
        "apiVersion": "tailguard/v1", "kind": "OptimizationSpec", "metadata": {"name": "numerics"},
        "model": {"registered_name": "tiny-encoder", "task": "classification",
                  "inputs": [{"name": n, "dtype": "int64", "shape": ["batch", "sequence"]} for n in INPUT_NAMES],
                  "outputs": [{"name": "logits", "dtype": "float32", "shape": ["batch", N_CLASSES]}]},
        "data": {"calibration": {"uri": "c.parquet"}, "validation": {"uri": "v.parquet", "batch_size": 16}},
        "slices": [{"name": "length", "column": "n_tokens", "bins": [0, 8, 13]}],
        "variants": variants, "gates": GATES,
        "benchmark": {"batch_sizes": [1], "warmup": 1, "iterations": 3},
        "promotion": {"enabled": False}})


VARIANTS = {
    "int8-8bit": {"name": "int8-8bit", "backend": "onnxruntime", "precision": "int8",
                  "quantization": {"mode": "dynamic", "per_channel": True, "reduce_range": False}},
    "int8-7bit": {"name": "int8-7bit", "backend": "onnxruntime", "precision": "int8",
                  "quantization": {"mode": "dynamic", "per_channel": True, "reduce_range": True}},
    "int8-qdq": {"name": "int8-qdq", "backend": "onnxruntime", "precision": "int8",
                 "quantization": {"mode": "static", "per_channel": True, "op_types": ["MatMul", "Gemm"]}},
    "fp32": {"name": "fp32", "backend": "onnxruntime", "precision": "fp32"},
}


def _x86_vnni() -> bool | None:
    """Whether this x86-64 CPU has VNNI (Linux /proc/cpuinfo flags); None when not x86-64 or unknown."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    try:
        flags = {f for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")
                 for f in line.split(":", 1)[1].split()}
    except OSError:
        return None
    return bool(flags & {"avx512_vnni", "avx_vnni", "amx_int8"}) if flags else None


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(spec, fp32 .onnx, validation Dataset of 120 rows, FP32 reference outputs, {variant: built artifact})."""
    root = tmp_path_factory.mktemp("numerics")
    _, model, path = export_tiny(root)
    spec = _spec(list(VARIANTS.values()))
    calib, val = tiny_dataset(24, seed=1), tiny_dataset(120, min_len=3, max_len=12, seed=2)
    ref = run_dataset(OrtRunner(path), val, model.inputs, batch_size=16)
    built = {}
    for v in spec.variants:
        res = build_variant(v, path, root / v.name, calibration=calib, model=model)
        assert res.status == "ok", res.reason
        built[v.name] = res.artifact
    return spec, path, val, ref, built


def _validate(tiny, name, tmp_path, *, factory="exact"):
    spec, _, val, ref, built = tiny
    runner = OrtRunner(built[name])
    make = {"exact": lambda: OrtRunner(built[name], exact_int8_accumulation=True), "none": None}.get(factory, factory)
    return validate_variant(spec, name, runner, ref, val, tmp_path / name, model_path=built[name],
                            exact_runner_factory=make)


# ------------------------------------------------------------------------------------------------ the session
def test_ort_runner_sets_x64quantprecision_when_exact_int8_accumulation_is_asked(tiny):
    artifact = tiny[4]["int8-8bit"]
    exact = OrtRunner(artifact, exact_int8_accumulation=True).session.get_session_options()
    native = OrtRunner(artifact).session.get_session_options()
    assert exact.get_session_config_entry("session.x64quantprecision") == "1"
    with pytest.raises(RuntimeError, match="does not have configuration with key"):  # unset: ORT's default
        native.get_session_config_entry("session.x64quantprecision")


def test_integer_kernel_nodes_finds_integer_gemms_when_dynamic_or_qdq_and_none_when_fp32(tiny):
    built = tiny[4]
    # dynamic: the Linear layers become MatMulInteger; the scores MatMul reads two dequantized uint8 tensors
    # (ORT may fuse it into MatMulIntegerToFloat: counted); softmax @ dequantized embeddings stays float
    assert integer_kernel_nodes(built["int8-8bit"]) == ["/MatMul", "/l1/MatMul_quant", "/l2/MatMul_quant",
                                                        "/head/Gemm_MatMul_quant"]
    qdq = integer_kernel_nodes(built["int8-qdq"])
    assert len(qdq) >= 3 and all("MatMul" in n or "Gemm" in n for n in qdq)  # DequantizeLinear -> MatMul/Gemm
    assert integer_kernel_nodes(built["fp32"]) == []
    assert integer_kernel_nodes(None) is None  # unknown: the exact pass is run


# ------------------------------------------------------------------------------------------- validate_variant
def test_validate_variant_reports_native_and_exact_parity_per_slice_when_int8_with_8_bit_per_channel_weights(
        tiny, tmp_path):
    result = _validate(tiny, "int8-8bit", tmp_path)
    num = result.numerics
    assert num["status"] in (NumericsStatus.CONSISTENT.value, NumericsStatus.HARDWARE_DEPENDENT.value)
    assert num["metric"] == "top1_agreement" and num["tolerance"] == NUMERICS_TOLERANCE
    assert num["native_seconds"] > 0 and num["exact_seconds"] > 0 and num["integer_kernel_nodes"] == 4
    # both passes per slice: slices.csv and slices_exact.csv have the same groups and columns
    native = pd.read_csv(result.files["slices_csv"])
    exact = pd.read_csv(result.files["slices_exact_csv"])
    assert list(exact.columns) == list(native.columns) and len(exact) == len(native) == 2
    assert [(r["slice"], r["value"]) for r in result.exact_slices] == [(r["slice"], r["value"]) for r in
                                                                        result.slices]
    metrics = result.mlflow_metrics()
    assert {"hardware_dependent", "exact.top1_agreement", "numerics.worst_slice_delta", "numerics.exact_seconds",
            "numerics.native_seconds", "numerics.gate_differences"} <= set(metrics)
    assert {k for k in metrics if k.startswith("exact.slice.length.")} == {
        "exact.slice.length._0_8_.top1_agreement", "exact.slice.length._8_13_.top1_agreement"}
    assert [g["gate"] for g in num["exact_gates"]] == [g.gate for g in result.gates]
    if _x86_vnni():  # VNNI accumulates u8 x s8 in int32: the two passes are the same numbers here
        assert num["hardware_dependent"] is False and metrics["hardware_dependent"] == 0.0
        assert num["worst_slice_delta"] == 0.0 and num["max_slice_delta"] == 0.0
        assert num["exact_overall"]["top1_agreement"] == result.overall["top1_agreement"]
    # result.json and the report carry it
    loaded = json.loads(Path(result.files["result_json"]).read_text())
    assert loaded["numerics"]["status"] == num["status"] and len(loaded["exact_slices"]) == 2
    assert f"Numerics ({num['status']})" in Path(result.files["report"]).read_text()


def test_validate_variant_does_not_flag_when_int8_weights_use_7_bits(tiny, tmp_path):
    # 7-bit weights cannot saturate an int16 pair sum (2 * 255 * 64 = 32640): every x86 kernel is exact
    result = _validate(tiny, "int8-7bit", tmp_path)
    num = result.numerics
    assert num["status"] == "consistent" and num["hardware_dependent"] is False
    assert num["worst_slice_delta"] == 0.0 and num["gate_differences"] == []
    assert num["exact_overall"] == {k: result.overall[k] for k in num["exact_overall"]}


def test_validate_variant_skips_the_exact_pass_with_the_reason_when_the_graph_has_no_integer_kernel(tiny, tmp_path):
    def never():
        raise AssertionError("the exact pass must not run for a float graph")

    result = _validate(tiny, "fp32", tmp_path, factory=never)
    assert result.numerics["status"] == "not_checked" and result.numerics["hardware_dependent"] is None
    assert result.numerics["reason"].startswith("cannot differ: the graph has no integer MatMul/Gemm/Conv")
    assert result.exact_slices == [] and "slices_exact_csv" not in result.files
    assert not any(k.startswith(("exact.", "numerics.", "hardware_dependent")) for k in result.mlflow_metrics())
    asked = _validate(tiny, "int8-7bit", tmp_path / "none", factory="none")
    assert asked.numerics["status"] == "not_checked" and "asked for" in asked.numerics["reason"]


# ---------------------------------------------------------------------------------------- the flag decision
def _pass_of(result) -> ParityPass:
    return ParityPass(dict(result.overall), pd.DataFrame(result.slices), list(result.gates), 1.0)


def test_compare_numerics_flags_hardware_dependent_when_the_worst_slice_moves_beyond_the_tolerance(tiny, tmp_path):
    """A real native pass and an exact pass constructed from it (this VNNI CPU cannot make them differ for real):
    one top-1 decision changed in the worst slice group, as the two kernels give on an AVX2 CPU."""
    result = _validate(tiny, "int8-8bit", tmp_path)
    native = _pass_of(result)
    real_exact = ParityPass(result.numerics["exact_overall"], pd.DataFrame(result.exact_slices), list(result.gates))
    same = compare_numerics(tiny[0], native, real_exact)
    assert same["hardware_dependent"] is (result.numerics["hardware_dependent"])
    table = native.slices.copy()
    worst = table["top1_agreement"].idxmin()
    n = int(table.loc[worst, "support"])
    moved = table.copy()
    moved.loc[worst, "top1_agreement"] = table.loc[worst, "top1_agreement"] - 1.0 / n
    flagged = compare_numerics(tiny[0], native, ParityPass(native.overall, moved, native.gates))
    assert flagged["hardware_dependent"] is True and flagged["status"] == "hardware_dependent"
    assert flagged["worst_slice_delta"] == pytest.approx(1.0 / n)
    assert "beyond tolerance 0.005" in flagged["reason"]
    within = table.copy()
    within.loc[worst, "top1_agreement"] = table.loc[worst, "top1_agreement"] - 0.004
    kept = compare_numerics(tiny[0], native, ParityPass(native.overall, within, native.gates))
    assert kept["hardware_dependent"] is False and "within tolerance" in kept["reason"]


def test_compare_numerics_flags_hardware_dependent_when_a_gate_outcome_differs():
    spec = _spec([VARIANTS["int8-8bit"]])
    table = pd.DataFrame([{"slice": "length", "value": "[0,8)", "support": 40, "top1_agreement": 0.9}])
    gate = dict(gate="top1_agreement>=0.9", metric="top1_agreement", scope="overall", threshold=0.9, op=">=",
                method="overall")
    native = ParityPass({"top1_agreement": 0.9}, table, [GateResult(**gate, observed=0.9, passed=True,
                                                                    status="passed")])
    exact = ParityPass({"top1_agreement": 0.899}, table, [GateResult(**gate, observed=0.899, passed=False,
                                                                     status="failed")])
    out = compare_numerics(spec, native, exact)
    assert out["hardware_dependent"] is True
    assert out["gate_differences"] == [{"gate": "top1_agreement>=0.9", "native": "passed", "exact": "failed"}]
    assert "gate outcomes differ: top1_agreement>=0.9 passed (native) vs failed (exact)" in out["reason"]


# ----------------------------------------------------------------------------------- results, summary, presets
def test_variant_result_carries_the_flag_when_validated_and_reads_older_results_without_it(tiny, tmp_path):
    from tailguard.components.validate.run_log import variant_result

    result = _validate(tiny, "int8-7bit", tmp_path)
    identity = VariantResult(variant="int8-7bit", backend="onnxruntime", precision="int8", status="ok")
    r = variant_result(identity, result, passed=True, reason="", run_id="r", model_uri=None, sha256=None)
    assert r.hardware_dependent is False and r.numerics["status"] == "consistent"
    assert "exact_overall" not in r.numerics and "exact_gates" not in r.numerics  # they stay in result.json
    back = VariantResult.from_dict(json.loads(json.dumps(r.to_dict())))
    assert back.hardware_dependent is False and back.numerics == r.numerics
    old = {k: v for k, v in r.to_dict().items() if k not in ("hardware_dependent", "numerics")}
    assert VariantResult.from_dict(old).hardware_dependent is None
    with pytest.raises(ValueError, match="hardware_dependent must be true, false or null"):
        VariantResult(variant="v", backend="onnxruntime", precision="int8", status="ok", hardware_dependent="yes")


def test_summary_notes_8_bit_weights_and_warns_when_a_variant_is_hardware_dependent():
    from tailguard.components.register.summary import (
        EIGHT_BIT_WEIGHTS_NOTE,
        RunSummary,
        VariantSummary,
        numerics_warnings,
    )
    from tailguard.terminal import console, print_summary

    spec = _spec([VARIANTS["int8-8bit"], VARIANTS["int8-7bit"], VARIANTS["fp32"],
                  {"name": "preset", "backend": "onnxruntime", "precision": "int8",
                   "quantization": {"preset": "cpu-dynamic"}}])
    eight, seven, fp32, preset = spec.variants
    num = {"status": "hardware_dependent", "reason": "worst slice top1_agreement: 0.9 native vs 0.95 exact"}
    assert numerics_warnings(eight, False, None) == [EIGHT_BIT_WEIGHTS_NOTE]
    assert numerics_warnings(seven, False, None) == [] == numerics_warnings(preset, None, None)
    assert numerics_warnings(fp32, None, None) == []
    flagged = numerics_warnings(eight, True, num)
    assert flagged[0] == EIGHT_BIT_WEIGHTS_NOTE and flagged[1].startswith("hardware_dependent: the gates judged")
    assert "0.9 native vs 0.95 exact" in flagged[1]
    row = VariantSummary("int8-8bit", "onnxruntime", "int8", "ok", passed=True, hardware_dependent=True,
                         numerics=num, warnings=flagged)
    summary = RunSummary("p", "e", "tiny", "1", "tiny-optimized", "production", True, 1, variants=[row])
    assert RunSummary.from_dict(summary.to_dict()).variants[0].hardware_dependent is True
    with console.capture() as cap:
        print_summary(summary)
    text = " ".join(cap.get().split())
    assert "! int8-8bit: 8-bit weights: results depend on the CPU's INT8 kernel (VNNI vs AVX2)" in text
    assert "! int8-8bit: hardware_dependent:" in text
    assert "numerics int8-8bit: hardware_dependent: worst slice top1_agreement: 0.9 native vs 0.95 exact" in text


def test_cpu_presets_use_7_bit_weights_when_int8_on_x86():
    x86 = ("cpu-vnni", "cpu-avx2", "transformer-static", "cpu-dynamic")
    assert all(QUANTIZATION_PRESETS[p]["reduce_range"] is True for p in x86)
    # exact int32 accumulation on their hardware: ARM sdot, GPU INT8
    assert QUANTIZATION_PRESETS["cpu-arm"]["reduce_range"] is False
    assert QUANTIZATION_PRESETS["tensorrt-int8"]["reduce_range"] is False


def test_log_validation_sets_the_numerics_tag_and_metrics_when_the_check_ran(tiny, tmp_path):
    import mlflow

    from tailguard.components.validate.run_log import log_validation
    from tailguard.core.contract import NUMERICS_TAG

    result = _validate(tiny, "int8-7bit", tmp_path)
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")  # a real store of this test's own
    run_id = client.create_run(client.create_experiment("numerics")).info.run_id
    log_validation(client, run_id, result)
    run = client.get_run(run_id)
    assert run.data.tags[NUMERICS_TAG] == "consistent"
    assert run.data.metrics["hardware_dependent"] == 0.0
    assert run.data.metrics["exact.top1_agreement"] == result.overall["top1_agreement"]
