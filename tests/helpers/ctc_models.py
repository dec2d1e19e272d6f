"""A tiny real CTC "recognizer" as ONNX, and a candidate that corrupts one position of every row.

reference: scores = x @ W + b, x (batch, TIME, FEAT) float32 -> scores (batch, TIME, CLASSES) float32 (class 0 is the
CTC blank). Each position's top-1 class is fixed by the row's features, so rows decode to different label sequences.
candidate: the reference's scores plus BUMP on class CORRUPT_CLASS at time CORRUPT_T (every row): that position's
top-1 becomes CORRUPT_CLASS, so every row whose reference top-1 there is another class differs at exactly one
position. `expected` computes the per-row parity values with numpy and rapidfuzz, independently of tailguard.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

TIME, FEAT, CLASSES = 12, 4, 6
CORRUPT_T, CORRUPT_CLASS, BUMP = 5, 3, 100.0
_W = np.random.default_rng(7).normal(size=(FEAT, CLASSES)).astype(np.float32) * 3.0
_B = np.array([1.5, 0, 0, 0, 0, 0], dtype=np.float32)  # blanks are common, as in a real CTC head


def _save(path: Path, bump: bool, mask_input: bool = False) -> Path:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    nodes = [helper.make_node("MatMul", ["x", "W"], ["xw"]),
             helper.make_node("Add", ["xw", "B"], ["s0" if bump else "scores"])]
    inits = {"W": _W, "B": _B}
    if bump:
        p = np.zeros((1, TIME, CLASSES), dtype=np.float32)
        p[0, CORRUPT_T, CORRUPT_CLASS] = BUMP
        inits["P"] = p
        nodes.append(helper.make_node("Add", ["s0", "P"], ["scores"]))
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", TIME, FEAT])]
    if mask_input:  # fed, not read by the graph: tailguard takes the compared positions from it
        inputs.append(helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", TIME]))
    graph = helper.make_graph(nodes, "ctc", inputs,
                              [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["batch", TIME, CLASSES])],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return Path(path)


def reference_model(path, *, mask_input: bool = False) -> Path:
    """Save the reference recognizer (scores = x @ W + b) as ONNX; `mask_input` adds an `attention_mask` input
    (batch, TIME) int64 that the graph does not read."""
    return _save(Path(path), bump=False, mask_input=mask_input)


def candidate_model(path, *, mask_input: bool = False) -> Path:
    """Save the candidate that forces class CORRUPT_CLASS at position CORRUPT_T (`mask_input` as above)."""
    return _save(Path(path), bump=True, mask_input=mask_input)


def features(rows: int, seed: int = 0) -> np.ndarray:
    """(rows, TIME, FEAT) float32, standard normal."""
    return np.random.default_rng(seed).normal(size=(rows, TIME, FEAT)).astype(np.float32)


def scores(x: np.ndarray, *, corrupt: bool = False) -> np.ndarray:
    """The reference's (or the candidate's) scores in numpy: (rows, TIME, CLASSES) float32."""
    s = (np.asarray(x, np.float32) @ _W + _B).astype(np.float32)
    if corrupt:
        s[:, CORRUPT_T, CORRUPT_CLASS] += BUMP
    return s


def _ctc(ids: np.ndarray) -> list[int]:
    out, prev = [], None
    for i in ids.tolist():
        if i != prev and i != 0:
            out.append(i)
        prev = i
    return out


def expected(x: np.ndarray, mask: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Per-row token agreement, decoded exact match and CER of the candidate, computed here with numpy loops and
    rapidfuzz: {"token_top1_agree", "sequence_exact", "char_error"} (rows,)."""
    from rapidfuzz.distance import Levenshtein

    r, c = scores(x).argmax(2), scores(x, corrupt=True).argmax(2)
    m = np.ones(r.shape, dtype=bool) if mask is None else np.asarray(mask) != 0
    agree, exact, cer = [], [], []
    for i in range(r.shape[0]):
        a, b = _ctc(r[i][m[i]]), _ctc(c[i][m[i]])
        agree.append(float((r[i][m[i]] == c[i][m[i]]).mean()))
        exact.append(a == b)
        cer.append(min(1.0, Levenshtein.distance(a, b) / len(a)) if a else float(bool(b)))
    return {"token_top1_agree": np.array(agree), "sequence_exact": np.array(exact), "char_error": np.array(cer)}
