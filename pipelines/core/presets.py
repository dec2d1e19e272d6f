"""Named INT8 quantization presets: plain data, each with the hardware constraint behind its choices.

A spec selects one with `quantization: {preset: <name>}`; fields it also sets replace the preset's
(`QuantizationSpec`); `tailguard.core.spec.quantization_preset(name, **overrides)` builds the same from Python.
Sources: ONNX Runtime's `quantize_static` docstring ("Choosing parameters for CPU inference",
onnxruntime/quantization/quantize.py), `session.x64quantprecision` in ORT's onnxruntime_session_options_config_keys.h,
and the TensorRT developer guide (explicit quantization: QDQ,
symmetric INT8, per-channel weights).

The x86 CPU presets use 7-bit weights (`reduce_range: true`, weights in [-64, 64]) (issue 23). ORT's u8 x s8
GEMM on x86 CPUs without VNNI (SSE4.1/AVX2/AVX-512 without VNNI, `vpmaddubsw`) adds pairs of u8*s8 products in
int16 with saturation; 2 * 255 * 64 = 32640 <= 32767, so 7-bit weights never saturate and every x86 kernel
(AVX2, AVX-512, VNNI, AMX) computes the same integers. With 8-bit weights the same model gives other results on
a CPU without VNNI than on one with it (tiny encoder, issue 17: logits error 0.0545 on AVX2 vs 0.0070 exact; 7-bit:
0.0056), so a gate passed on the build node says little about a serving node of another kind. A spec that wants
8-bit weights sets `reduce_range: false`; the validate step's numerics check (`hardware_dependent`) then compares
the node's kernels with exact integer accumulation.
"""

from __future__ import annotations

from typing import Any

QUANTIZATION_PRESETS: dict[str, dict[str, Any]] = {
    # x86-64 with AVX512-VNNI / AVX-VNNI (Cascade Lake and later, Zen 4): u8 x s8 dot products accumulate in
    # int32 without saturation here, but the model may serve on an x86 node without VNNI: 7-bit weights keep the
    # results the same there. QDQ is what ORT's CPU kernels are tuned for.
    "cpu-vnni": {"mode": "static", "format": "qdq", "activation_type": "uint8", "weight_type": "int8",
                 "per_channel": False, "reduce_range": True, "calibration_method": "minmax"},
    # x86-64 without VNNI (AVX2 only): the u8 x s8 pair product (vpmaddubsw) saturates in int16; 7-bit weights
    # (reduce_range) avoid the overflow, most needed with per-channel scales.
    "cpu-avx2": {"mode": "static", "format": "qdq", "activation_type": "uint8", "weight_type": "int8",
                 "per_channel": True, "reduce_range": True, "calibration_method": "minmax"},
    # ARM (Neon dot product, SDOT): symmetric signed activations map onto the s8 x s8 instructions, which
    # accumulate in int32 exactly: full 8-bit weights (the numerics check flags them when validated on x86).
    "cpu-arm": {"mode": "static", "format": "qdq", "activation_type": "int8", "weight_type": "int8",
                "per_channel": False, "reduce_range": False, "calibration_method": "minmax"},
    # Transformer encoders (BERT/MiniLM), static: only MatMul/Gemm. Quantizing the additive attention mask
    # (-10000 or float-min on padded keys) stretches that activation's uint8 scale until the scores are noise:
    # all-op static QDQ gave cosine 0.25-0.4 to FP32 on MiniLM-L6, MatMul/Gemm only 0.90-0.93. x86 CPU: 7-bit
    # weights (module docstring).
    "transformer-static": {"mode": "static", "format": "qdq", "activation_type": "uint8", "weight_type": "int8",
                           "per_channel": True, "reduce_range": True, "calibration_method": "minmax",
                           "op_types": ["MatMul", "Gemm"]},
    # Weights-only, no calibration data: transformer encoders on any CPU (activations quantized at run time;
    # ORT's dynamic mode supports uint8 activations only, so x86 runs the u8 x s8 kernel: 7-bit weights).
    "cpu-dynamic": {"mode": "dynamic", "weight_type": "int8", "per_channel": True, "reduce_range": True},
    # TensorRT explicit quantization: QDQ nodes, symmetric int8 for both activations and weights (TensorRT
    # supports only zero-point 0), per-channel weights; percentile calibration resists activation outliers.
    # GPU INT8 tensor cores accumulate in int32: full 8-bit weights.
    "tensorrt-int8": {"mode": "static", "format": "qdq", "activation_type": "int8", "weight_type": "int8",
                      "per_channel": True, "reduce_range": False, "calibration_method": "percentile",
                      "percentile": 99.99},
}
