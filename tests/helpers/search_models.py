"""A tiny MLP with one planted quantization-sensitive MatMul, its data and a spec, for the search tests.

Graph (float32, opset 17; every node named)::

    x (batch, 16) -> MatMul "mm1" (W1 16x32) -> Relu "relu" -> MatMul "mm2" (W2 32x32)
                  -> MatMul "mm3" (W3 32x8) -> y (batch, 8)

The planted node is "mm2": row `DEAD_ROW` of W2 is filled with OUTLIER while column `DEAD_ROW` of W1 is zero,
so that row never contributes to the FP32 output (its input activation is always 0) but it sets every INT8
weight scale of W2: per tensor and per output channel alike, scale = OUTLIER / 127 ~ 0.39, while the useful
weights are ~N(0, 0.18) and mostly round to 0. Quantizing mm2 alone moves the output by ~80% (relative L2);
quantizing mm1 or mm3 alone moves it by ~1% (mm1 with 8-bit per-channel weights on x86 without VNNI: ~6%, int16
pair saturation in ORT's u8s8 kernel). mm2 cannot saturate: the input of its outlier row is always 0.

Reuse::

    from tests.helpers.search_models import planted_mlp, mlp_dataset, mlp_spec, mlp_variant
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

IN, HID, OUT = 16, 32, 8
PLANTED = "mm2"
DEAD_ROW = 5
OUTLIER = 50.0


def planted_mlp(path: str | Path, *, seed: int = 0) -> Path:
    """Write the planted MLP (module docstring) to `path` and return it."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    w1 = rng.normal(0.0, 1.0 / np.sqrt(IN), size=(IN, HID)).astype(np.float32)
    w1[:, DEAD_ROW] = 0.0
    w2 = rng.normal(0.0, 1.0 / np.sqrt(HID), size=(HID, HID)).astype(np.float32)
    w2[DEAD_ROW, :] = OUTLIER
    w3 = rng.normal(0.0, 1.0 / np.sqrt(HID), size=(HID, OUT)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h1"], name="mm1"),
             helper.make_node("Relu", ["h1"], ["a1"], name="relu"),
             helper.make_node("MatMul", ["a1", "W2"], ["h2"], name="mm2"),
             helper.make_node("MatMul", ["h2", "W3"], ["y"], name="mm3")]
    graph = helper.make_graph(
        nodes, "planted_mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", IN])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", OUT])],
        [numpy_helper.from_array(w, n) for w, n in ((w1, "W1"), (w2, "W2"), (w3, "W3"))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    path = Path(path)
    onnx.save_model(model, str(path))
    return path


def mlp_dataset(n_rows: int = 64, *, seed: int = 1):
    """Rows for the MLP: `x` (16,) float32 ~ N(0, 1) per row; frame `group` ("a" | "b", alternating)."""
    from tailguard.core.data import Dataset

    rng = np.random.default_rng(seed)
    xs = [rng.normal(size=IN).astype(np.float32) for _ in range(n_rows)]
    frame = pd.DataFrame({"group": np.where(np.arange(n_rows) % 2 == 0, "a", "b")})
    return Dataset({"x": xs}, frame, np.full(n_rows, IN, dtype=np.int64), "memory://planted-mlp")


def mlp_rows(n: int, seed: int) -> pd.DataFrame:
    """Parquet-ready rows for the MLP: `x` (a list of 16 float32 ~ N(0, 1)) and `group` ("a" | "b", alternating),
    for the pipeline tests' validation and calibration files."""
    rng = np.random.default_rng(seed)
    return pd.DataFrame({"x": [rng.normal(size=IN).astype(np.float32).tolist() for _ in range(n)],
                         "group": np.where(np.arange(n) % 2 == 0, "a", "b")})


def mlp_model_spec():
    """The ModelSpec of the MLP (task embedding: output y is compared by cosine similarity)."""
    from tailguard.core.spec.model import ModelSpec

    return ModelSpec.model_validate({
        "registered_name": "planted-mlp", "task": "embedding",
        "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", IN]}],
        "outputs": [{"name": "y", "dtype": "float32", "shape": ["batch", OUT]}]})


def mlp_variant(name: str = "mlp-int8", *, search: dict[str, Any] | None = None, **quantization: Any):
    """An INT8 dynamic variant of the MLP (graph optimization disabled, so node names stay mm1..mm3)."""
    from tailguard.core.spec.variants import VariantSpec

    q = {"mode": "dynamic", **quantization}
    d: dict[str, Any] = {"name": name, "backend": "onnxruntime", "precision": "int8",
                         "graph_optimization": {"level": "disabled"}, "quantization": q}
    if search is not None:
        d["search"] = search
    return VariantSpec.model_validate(d)


def mlp_spec(variant: Any, *, min_cosine: float = 0.99):
    """A Spec around `variant`: one gate cosine_similarity.min >= `min_cosine` (overall), a slice on `group`,
    a 3-iteration benchmark at batch size 4 (no latency gate, so pass/fail never depends on timing)."""
    from tailguard.core.spec.root import Spec

    return Spec.model_validate({
        "apiVersion": "tailguard/v1", "kind": "OptimizationSpec", "metadata": {"name": "planted-mlp"},
        "model": mlp_model_spec().model_dump(mode="json"),
        "data": {"calibration": {"uri": "memory://calibration", "batch_size": 8},
                 "validation": {"uri": "memory://validation", "batch_size": 16}},
        "slices": [{"name": "group", "column": "group"}],
        "variants": [variant.model_dump(mode="json", exclude_unset=True)],
        "gates": [{"metric": "cosine_similarity.min", "min": min_cosine}],
        "analysis": {"discovery": {"enabled": False}},
        "benchmark": {"batch_sizes": [4], "warmup": 1, "iterations": 3, "max_seconds": 1.0},
    })
