"""Tiny real ONNX models, specs and request files for the monitor's tests, benchmark and docs examples.

Every model is a real ONNX graph run by ONNX Runtime: a linear classifier (input x: (batch, 4) float32 ->
logits: (batch, 3) float32), and references that misbehave for fault tests: one that returns NaN, one that
fails at run time (out-of-range Gather), one that is slow (input-dependent 1024x1024 MatMul chain).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

N_FEATURES = 4
N_CLASSES = 3


def _save(graph: Any, path: str | Path) -> Path:
    import onnx
    from onnx import helper

    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def _io() -> tuple[Any, Any]:
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", N_FEATURES])
    y = helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", N_CLASSES])
    return x, y


def weights(seed: int = 0, noise: float = 0.0, base_seed: int = 0) -> np.ndarray:
    """Classifier weights (4, 3) float32: the seed-`base_seed` matrix plus Gaussian noise of std `noise`."""
    w = np.random.default_rng(base_seed).normal(size=(N_FEATURES, N_CLASSES)).astype(np.float32)
    if noise:
        w = w + np.random.default_rng(seed + 1000).normal(scale=noise, size=w.shape).astype(np.float32)
    return w


def linear_classifier(path: str | Path, w: np.ndarray | None = None) -> Path:
    """Save logits = x @ w as ONNX (w: (4, 3) float32, default `weights()`)."""
    from onnx import helper, numpy_helper

    w = weights() if w is None else np.asarray(w, dtype=np.float32)
    x, y = _io()
    g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["logits"])], "linear", [x], [y],
                          initializer=[numpy_helper.from_array(w, "W")])
    return _save(g, path)


def nan_classifier(path: str | Path) -> Path:
    """A reference that always returns NaN logits: x @ W + sqrt(-1)."""
    from onnx import helper, numpy_helper

    x, y = _io()
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Sqrt", ["neg"], ["nan"]),
             helper.make_node("Add", ["h", "nan"], ["logits"])]
    g = helper.make_graph(nodes, "nan", [x], [y], initializer=[
        numpy_helper.from_array(weights(), "W"), numpy_helper.from_array(np.array([-1.0], np.float32), "neg")])
    return _save(g, path)


def crashing_classifier(path: str | Path) -> Path:
    """A reference that fails on every run: Gather with an out-of-range index (ORT raises at run time)."""
    from onnx import helper, numpy_helper

    x, y = _io()
    nodes = [helper.make_node("Gather", ["x", "idx"], ["logits"], axis=1)]
    g = helper.make_graph(nodes, "crash", [x], [y], initializer=[
        numpy_helper.from_array(np.array([0, 1, 40], np.int64), "idx")])
    return _save(g, path)


def slow_classifier(path: str | Path, matmuls: int = 4, size: int = 1024) -> Path:
    """A correct but slow reference: logits = x @ W + 0 * mean(chain of `matmuls` (size x size) MatMuls that
    depend on the input), so ORT cannot fold the chain into a constant. ~0.1-0.5 s per call on 2 cores."""
    from onnx import helper, numpy_helper

    x, y = _io()
    c = (np.random.default_rng(1).normal(size=(size, size)) / np.sqrt(size)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]),
             helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
             helper.make_node("Add", ["C", "s"], ["m0"])]
    for i in range(matmuls):
        nodes.append(helper.make_node("MatMul", [f"m{i}", "C"], [f"m{i + 1}"]))
    nodes += [helper.make_node("ReduceMean", [f"m{matmuls}"], ["r"], keepdims=0),
              helper.make_node("Mul", ["r", "zero"], ["z"]),
              helper.make_node("Add", ["h", "z"], ["logits"])]
    g = helper.make_graph(nodes, "slow", [x], [y], initializer=[
        numpy_helper.from_array(weights(), "W"), numpy_helper.from_array(c, "C"),
        numpy_helper.from_array(np.array(0.0, np.float32), "zero")])
    return _save(g, path)


def spec_dict(monitoring: dict[str, Any] | None = None, *, data_uri: str = "data.parquet",
              slices: list[dict[str, Any]] | None = None, name: str = "tiny-clf") -> dict[str, Any]:
    """A valid spec (as a dict) for the tiny classifier, with a `domain` slice and the given monitoring section."""
    return {
        "apiVersion": "tailguard/v1", "kind": "OptimizationSpec", "metadata": {"name": name},
        "model": {"registered_name": name, "task": "classification",
                  "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", N_FEATURES]}],
                  "outputs": [{"name": "logits", "dtype": "float32", "shape": ["batch", N_CLASSES]}],
                  "source": {"format": "onnx"}},
        "data": {"calibration": {"uri": data_uri}, "validation": {"uri": data_uri, "batch_size": 256}},
        "slices": slices if slices is not None else [{"name": "domain", "column": "domain"}],
        "variants": [{"name": "ort-fp32", "backend": "onnxruntime", "precision": "fp32"}],
        "gates": [{"metric": "top1_agreement", "min": 0.99}],
        "monitoring": monitoring if monitoring is not None else {"sample_rate": 0.1},
    }


def requests_frame(n: int, *, seed: int = 0, rare_share: float = 0.01, rare: str = "legal",
                   common: tuple[str, ...] = ("news", "web")) -> pd.DataFrame:
    """Logged requests: column x (4 float32 per row), `domain` (rare value with share `rare_share`), `n_tokens`.

    Args:
        n: rows.
        seed: RNG seed.
        rare_share: fraction of rows in the rare domain.
        rare: rare domain value.
        common: the other domain values (equal shares).
    """
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, N_FEATURES)).astype(np.float32)
    dom = np.where(rng.random(n) < rare_share, rare, rng.choice(list(common), size=n))
    return pd.DataFrame({"x": list(x), "domain": dom, "n_tokens": rng.integers(1, 128, size=n)})


def flip_top1(outputs: np.ndarray, mask: np.ndarray, rate: float, seed: int = 0) -> np.ndarray:
    """Planted disagreement: in rows under `mask`, with probability `rate`, swap the top-1 and top-2 logits
    (the candidate's top-1 then differs from the reference's, all else equal).

    Args:
        outputs: (rows, classes) logits (modified copy returned).
        mask: (rows,) bool.
        rate: flip probability per masked row.
        seed: RNG seed.
    """
    out = np.array(outputs, copy=True)
    rng = np.random.default_rng(seed)
    rows = np.nonzero(mask & (rng.random(out.shape[0]) < rate))[0]
    if rows.size:
        order = np.argsort(-out[rows], axis=1)
        top1, top2 = order[:, 0], order[:, 1]
        a, b = out[rows, top1].copy(), out[rows, top2].copy()
        out[rows, top1], out[rows, top2] = b, a
    return out
