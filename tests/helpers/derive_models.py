"""Tiny real ONNX models for the derived-slice tests: a linear classifier with a bias that makes class 2 rare, and
candidates that disagree with it only on the rows of one derived slice group (a planted drift no request parameter
names).

reference: logits = x @ W + b, x (batch, 4) float32 -> logits (batch, 3) float32. W's first row is 0, so the class
does not depend on x[:, 0] (the `ink` slice below reads x[:, 0]): the two drifts do not leak into each other's slices.
candidate(kind): the reference's logits plus 100 on class (argmax + 1) mod 3 in the rows where
  kind "class": the reference predicts RARE_CLASS (rows of `predicted=2`);
  kind "bin": x[:, 0] >= INK_EDGE (rows of `ink=[1.8,10)` for the slice {derive: {input: x, select: [0, 1],
  reduce: sum}, bins: INK_BINS}),
so the candidate's top-1 differs from the reference's on exactly those rows.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

W = np.array([[0.0, 0.0, 0.0], [1.0, -1.0, 0.0], [0.0, 1.0, -1.0], [-1.0, 0.0, 1.0]], dtype=np.float32)
B = np.array([0.0, 0.0, -2.0], dtype=np.float32)
RARE_CLASS = 2
INK_EDGE = 1.8
INK_BINS = [-10.0, INK_EDGE, 10.0]
INK_SLICE = {"name": "ink", "derive": {"input": "x", "select": [0, 1], "reduce": "sum"}, "bins": INK_BINS}


def reference_logits(x: np.ndarray) -> np.ndarray:
    """The reference's logits in numpy: (batch, 3) float32."""
    return (np.asarray(x, np.float32) @ W + B).astype(np.float32)


def _save(nodes, inits, path):
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(nodes, "derived", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 3])],
                              [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return Path(path)


def reference_model(path) -> Path:
    """Save the reference (logits = x @ W + b) as ONNX."""
    from onnx import helper

    return _save([helper.make_node("MatMul", ["x", "W"], ["xw"]), helper.make_node("Add", ["xw", "B"], ["logits"])],
                 {"W": W, "B": B}, path)


def candidate_model(path, kind: str) -> Path:
    """Save a candidate that disagrees with the reference on the rows of one group (module docstring).

    Args:
        path: the .onnx file to write.
        kind: "class" (rows the reference predicts RARE_CLASS) or "bin" (rows with x[:, 0] >= INK_EDGE).
    """
    from onnx import helper

    nodes = [helper.make_node("MatMul", ["x", "W"], ["xw"]), helper.make_node("Add", ["xw", "B"], ["ref"]),
             helper.make_node("ArgMax", ["ref"], ["top"], axis=1, keepdims=1),           # (batch, 1) int64
             helper.make_node("Add", ["top", "one"], ["top1"]),
             helper.make_node("Mod", ["top1", "three"], ["shift"]),
             helper.make_node("Equal", ["shift", "classes"], ["hot"]),                   # (batch, 3) bool
             helper.make_node("Cast", ["hot"], ["hotf"], to=1)]
    inits = {"W": W, "B": B, "one": np.array([[1]], np.int64), "three": np.array([[3]], np.int64),
             "classes": np.array([[0, 1, 2]], np.int64), "big": np.array([[100.0]], np.float32)}
    if kind == "class":
        inits["rare"] = np.array([[RARE_CLASS]], np.int64)
        nodes.append(helper.make_node("Equal", ["top", "rare"], ["m"]))
    elif kind == "bin":
        inits["edge"] = np.array([[INK_EDGE]], np.float32)
        inits["starts"], inits["ends"], inits["axes"] = (np.array([0], np.int64), np.array([1], np.int64),
                                                         np.array([1], np.int64))
        nodes += [helper.make_node("Slice", ["x", "starts", "ends", "axes"], ["x0"]),
                  helper.make_node("Less", ["x0", "edge"], ["below"]),
                  helper.make_node("Not", ["below"], ["m"])]
    else:
        raise ValueError(f"kind must be class or bin, got {kind!r}")
    nodes += [helper.make_node("Cast", ["m"], ["mf"], to=1),
              helper.make_node("Mul", ["hotf", "mf"], ["mask"]),
              helper.make_node("Mul", ["mask", "big"], ["push"]),
              helper.make_node("Add", ["ref", "push"], ["logits"])]
    return _save(nodes, inits, path)


def features(i: int, batch: int = 16) -> np.ndarray:
    """Request i's rows: (batch, 4) float32, standard normal (seed i)."""
    return np.random.default_rng(i).normal(size=(batch, 4)).astype(np.float32)
