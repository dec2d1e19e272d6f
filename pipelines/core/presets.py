"""Named INT8 quantization presets: plain data, each with the hardware constraint behind its choices.

A spec selects one with `quantization: {preset: <name>}`; fields it also sets replace the preset's
(`QuantizationSpec`). Sources: ONNX Runtime's `quantize_static` docstring ("Choosing parameters for CPU
inference", onnxruntime/quantization/quantize.py) and the TensorRT developer guide (explicit quantization: QDQ,
symmetric INT8, per-channel weights).
"""

from __future__ import annotations

from typing import Any

QUANTIZATION_PRESETS: dict[str, dict[str, Any]] = {
    # x86-64 with AVX512-VNNI / AVX-VNNI (Cascade Lake and later, Zen 4): u8 x s8 dot products accumulate in
    # int32 without saturation, so full 8-bit weights are safe. QDQ is what ORT's CPU kernels are tuned for.
    "cpu-vnni": {"mode": "static", "format": "qdq", "activation_type": "uint8", "weight_type": "int8",
                 "per_channel": False, "reduce_range": False, "calibration_method": "minmax"},
    # x86-64 without VNNI (AVX2 only): the u8 x s8 pair product (vpmaddubsw) saturates in int16; 7-bit weights
    # (reduce_range) avoid the overflow, most needed with per-channel scales.
    "cpu-avx2": {"mode": "static", "format": "qdq", "activation_type": "uint8", "weight_type": "int8",
                 "per_channel": True, "reduce_range": True, "calibration_method": "minmax"},
    # ARM (Neon dot product, SDOT): symmetric signed activations map onto the s8 x s8 instructions.
    "cpu-arm": {"mode": "static", "format": "qdq", "activation_type": "int8", "weight_type": "int8",
                "per_channel": False, "reduce_range": False, "calibration_method": "minmax"},
    # Transformer encoders (BERT/MiniLM), static: only MatMul/Gemm. Quantizing the additive attention mask
    # (-10000 or float-min on padded keys) stretches that activation's uint8 scale until the scores are noise:
    # all-op static QDQ gave cosine 0.25-0.4 to FP32 on MiniLM-L6, MatMul/Gemm only 0.90-0.93.
    "transformer-static": {"mode": "static", "format": "qdq", "activation_type": "uint8", "weight_type": "int8",
                           "per_channel": True, "reduce_range": False, "calibration_method": "minmax",
                           "op_types": ["MatMul", "Gemm"]},
    # Weights-only, no calibration data: transformer encoders on any CPU (activations quantized at run time;
    # ORT's dynamic mode supports uint8 activations only).
    "cpu-dynamic": {"mode": "dynamic", "weight_type": "int8", "per_channel": True, "reduce_range": False},
    # TensorRT explicit quantization: QDQ nodes, symmetric int8 for both activations and weights (TensorRT
    # supports only zero-point 0), per-channel weights; percentile calibration resists activation outliers.
    "tensorrt-int8": {"mode": "static", "format": "qdq", "activation_type": "int8", "weight_type": "int8",
                      "per_channel": True, "reduce_range": False, "calibration_method": "percentile",
                      "percentile": 99.99},
}
