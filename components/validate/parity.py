"""Parity between a candidate variant's outputs and the FP32 reference, per row and aggregated.

Two stages, kept apart so slices and the shadow-traffic monitor reuse them:

1. `per_sample_metrics` turns (reference, candidate) output arrays into one value per row and metric.
2. `aggregate` reduces those per-row values (optionally under a boolean row mask, e.g. one slice group)
   to the task's metrics, named exactly as `tailguard.spec.TASK_METRICS[task]`.

Formulas (per row i; `ref` is the FP32 reference, `cand` the candidate variant):

classification (logits, shape (rows, classes)):
    top1_agree_i        = argmax(cand_i) == argmax(ref_i)
    kl_divergence_i     = KL(softmax(ref_i) || softmax(cand_i)) = sum_c p_c (log p_c - log q_c)   [nats],
                          computed in float64 from log-softmax (log-sum-exp), clipped at 0.
    abs_error_i         = max_c |cand_ic - ref_ic|
    correct_i           = argmax(cand_i) == label_i           (labels given)
    reference_correct_i = argmax(ref_i) == label_i            (labels given)

embedding (vectors, shape (rows, dim)):
    cosine_similarity_i = <cand_i, ref_i> / (|cand_i| |ref_i|)   (norms floored at 1e-12)
    nn_top1_agree_i     = NN1(cand_i) == NN1(ref_i), nearest neighbours by cosine in the FP32 index
    nn_top5_overlap_i   = |top5(cand_i) ∩ top5(ref_i)| / 5     (/ k when the index has k < 5 candidates)
    abs_error_i         = max_d |cand_id - ref_id|
    The FP32 index defaults to the reference outputs themselves; then row i is excluded from its own
    neighbours (`exclude_self`), otherwise every row would trivially find itself. This is the usual
    retrieval-consistency check for quantized embedding models (e.g. the "retrieval overlap@k" of
    sentence-transformers quantization studies): a variant may keep cosine 0.99 and still reorder neighbours.

regression / generic (any shape (rows, ...)):
    abs_error_i = max_j |cand_ij - ref_ij|
    rel_error_i = max_j |cand_ij - ref_ij| / max(|ref_ij|, REL_EPS)      REL_EPS = 1e-6

Non-finite rows: a row whose candidate (or reference) output holds NaN or +-inf is scored worst-case
(agreements False, overlap 0, cosine -1, errors and KL +inf) and flagged in the extra per-row key
"non_finite"; `aggregate` still returns numbers (means and maxima become +inf, so any error gate fails).

Aggregates (keys of TASK_METRICS): `x.mean`, `x.max`, `x.min` as named; `x.p99` / `x.p01` are the
99th / 1st percentiles with numpy's default "linear" interpolation (an interpolation touching +-inf gives
+-inf, never NaN); `accuracy`, `reference_accuracy`, `top1_agreement`, `nn_top1_agreement` are means of the
0/1 indicators; `nn_top5_agreement` is the mean overlap. An empty selection gives NaN for every metric.
"""

from __future__ import annotations

import math

import numpy as np

from tailguard.errors import InputError
from tailguard.spec import TASK_METRICS

REL_EPS = 1e-6  # floor of |reference| in rel_error, so exact zeros in the reference do not divide by zero
NORM_EPS = 1e-12  # floor of vector norms in cosine similarity
NN_K = 5  # neighbours compared by nn_top5_overlap
SEARCH_BLOCK_BYTES = 64 * 2**20  # score matrix block size for nearest-neighbour search (float32)

# per-row metric -> how the aggregate metrics are computed from it
_LABEL_METRICS = ("accuracy", "reference_accuracy")


def non_finite_rows(arr: np.ndarray) -> np.ndarray:
    """Rows holding any NaN or +-inf.

    Args:
        arr: array of shape (rows, ...), any numeric dtype.

    Returns:
        bool array of shape (rows,): True where the row has a non-finite element.
    """
    a = np.asarray(arr)
    if a.ndim == 0:
        raise InputError("non_finite_rows: expected an array with a leading rows axis, got a scalar")
    if a.shape[0] == 0:
        return np.zeros(0, dtype=bool)
    if not np.issubdtype(a.dtype, np.floating) and not np.issubdtype(a.dtype, np.complexfloating):
        return np.zeros(a.shape[0], dtype=bool)
    return ~np.isfinite(a.reshape(a.shape[0], -1)).all(axis=1)


def _rows2d(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a)
    return a.reshape(a.shape[0], -1) if a.ndim != 2 else a


def _check_pair(task: str, reference: np.ndarray, candidate: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if task not in TASK_METRICS:
        raise InputError(f"unknown task {task!r}", hint=f"use one of {sorted(TASK_METRICS)} (model.task)")
    ref, cand = np.asarray(reference), np.asarray(candidate)
    if ref.ndim == 0 or cand.ndim == 0:
        raise InputError("parity: outputs must have a leading rows axis, got a scalar")
    if ref.shape != cand.shape:
        raise InputError(f"parity: candidate output shape {cand.shape} differs from the reference {ref.shape}",
                         hint="the variant must produce the first model output (model.outputs[0]) with the "
                              "same shape as the FP32 reference")
    if task in ("classification", "embedding") and ref.ndim != 2:
        axis = "classes" if task == "classification" else "dim"
        raise InputError(f"parity: task {task!r} needs 2-D outputs (rows, {axis}), got shape {ref.shape}",
                         hint="set model.task to 'generic' for other output shapes")
    return ref, cand


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64, copy=False)
    m = x.max(axis=1, keepdims=True)
    z = x - m
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


def _normalize(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64, copy=False)
    n = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.maximum(n, NORM_EPS)


def _topk(queries: np.ndarray, index: np.ndarray, k: int, exclude: np.ndarray | None) -> np.ndarray:
    """Indices (rows, k) of the k most cosine-similar index rows per query, best first.

    queries, index: L2-normalised float32 (rows, dim), (n, dim). exclude: (rows,) index row to skip per query
    (or None). Ties are broken by the lower index row, so equal inputs give equal neighbours.
    """
    n = index.shape[0]
    rows = queries.shape[0]
    out = np.empty((rows, k), dtype=np.int64)
    block = max(1, SEARCH_BLOCK_BYTES // (4 * max(n, 1)))
    for start in range(0, rows, block):
        stop = min(rows, start + block)
        scores = queries[start:stop] @ index.T  # (b, n) float32
        if exclude is not None:
            scores[np.arange(stop - start), exclude[start:stop]] = -np.inf
        if k < n:
            part = np.argpartition(-scores, k - 1, axis=1)[:, :k]
        else:
            part = np.broadcast_to(np.arange(n), (stop - start, n)).copy()
        part_scores = np.take_along_axis(scores, part, axis=1)
        # sort by score descending, then index ascending (lexsort: last key is primary)
        order = np.lexsort((part, -part_scores), axis=1)
        out[start:stop] = np.take_along_axis(part, order, axis=1)[:, :k]
    return out


def per_sample_metrics(task: str, reference: np.ndarray, candidate: np.ndarray, *,
                       labels: np.ndarray | None = None, reference_index: np.ndarray | None = None,
                       exclude_self: bool = True) -> dict[str, np.ndarray]:
    """One parity value per validation row, for the task's metrics (formulas: module docstring).

    Args:
        task: "classification", "embedding", "regression" or "generic" (spec `model.task`).
        reference: FP32 reference output, shape (rows, ...) — (rows, classes) logits for classification,
            (rows, dim) vectors for embedding; float (float16/32/64).
        candidate: the variant's output for the same rows, same shape as `reference`.
        labels: classification only: ground-truth class ids, shape (rows,), int. Adds "correct" and
            "reference_correct".
        reference_index: embedding only: the FP32 index searched for neighbours, shape (n, dim) float
            (default: `reference` itself).
        exclude_self: embedding only: when the index is the reference set (`reference_index` None or the
            very same array), row i is not its own neighbour.

    Returns:
        {per-row metric: array of shape (rows,)}:
        classification: "top1_agree" (bool), "kl_divergence" (float64, nats), "abs_error" (float64),
        and with labels "correct", "reference_correct" (bool);
        embedding: "cosine_similarity", "abs_error" (float64), "nn_top1_agree" (bool),
        "nn_top5_overlap" (float64 in [0, 1]);
        regression/generic: "abs_error", "rel_error" (float64).
        Every task also has "non_finite" (bool): rows with NaN/inf in the candidate or reference, scored
        worst-case.

    Raises:
        InputError: unknown task, shapes that differ or do not suit the task, labels of the wrong length,
            an index of another width, or an index too small to search (fewer than 2 rows with exclude_self).
    """
    ref, cand = _check_pair(task, reference, candidate)
    rows = ref.shape[0]
    bad = non_finite_rows(cand) | non_finite_rows(ref)
    ref2 = np.where(bad[:, None], 0.0, _rows2d(ref).astype(np.float64)) if rows else _rows2d(ref).astype(np.float64)
    cand2 = np.where(bad[:, None], 0.0, _rows2d(cand).astype(np.float64)) if rows else _rows2d(cand).astype(
        np.float64)
    diff = np.abs(cand2 - ref2)
    abs_error = diff.max(axis=1) if diff.shape[1] else np.zeros(rows)
    abs_error[bad] = np.inf
    out: dict[str, np.ndarray] = {"abs_error": abs_error}

    if task == "classification":
        if ref2.shape[1] < 1:
            raise InputError("parity: classification logits have 0 classes")
        ref_top, cand_top = ref2.argmax(axis=1), cand2.argmax(axis=1)
        lp, lq = _log_softmax(ref2), _log_softmax(cand2)
        kl = np.maximum((np.exp(lp) * (lp - lq)).sum(axis=1), 0.0)
        kl[bad] = np.inf
        agree = ref_top == cand_top
        agree[bad] = False
        out.update(top1_agree=agree, kl_divergence=kl)
        if labels is not None:
            lab = np.asarray(labels).reshape(-1)
            if lab.shape[0] != rows:
                raise InputError(f"parity: {lab.shape[0]} labels for {rows} rows",
                                 hint="check data.validation.label_column")
            correct = cand_top == lab
            correct[bad] = False
            out.update(correct=correct, reference_correct=ref_top == lab)
    elif task == "embedding":
        rn64, cn64 = _normalize(ref2), _normalize(cand2)
        cos = (rn64 * cn64).sum(axis=1)
        rn, cn = rn64.astype(np.float32), cn64.astype(np.float32)
        cos = np.clip(cos, -1.0, 1.0)
        cos[bad] = -1.0
        self_index = reference_index is None or reference_index is reference
        if self_index:
            index = rn
        else:
            idx = _rows2d(np.asarray(reference_index))
            if idx.shape[1] != ref2.shape[1]:
                raise InputError(f"parity: reference_index has dim {idx.shape[1]}, outputs have {ref2.shape[1]}")
            index = _normalize(np.nan_to_num(idx.astype(np.float64), nan=0.0, posinf=0.0,
                                             neginf=0.0)).astype(np.float32)
        exclude = np.arange(rows) if (self_index and exclude_self) else None
        available = index.shape[0] - (1 if exclude is not None else 0)
        if rows and available < 1:
            raise InputError(f"parity: nearest-neighbour metrics need an index of at least "
                             f"{2 if exclude is not None else 1} rows, got {index.shape[0]}",
                             hint="validate on more rows (data.validation)")
        k = min(NN_K, available)
        if rows:
            tc, tr = _topk(cn, index, k, exclude), _topk(rn, index, k, exclude)
            top1 = tc[:, 0] == tr[:, 0]
            overlap = (tc[:, :, None] == tr[:, None, :]).any(axis=2).sum(axis=1) / float(k)
        else:
            top1, overlap = np.zeros(0, dtype=bool), np.zeros(0)
        top1[bad] = False
        overlap[bad] = 0.0
        out.update(cosine_similarity=cos, nn_top1_agree=top1, nn_top5_overlap=overlap)
    else:  # regression, generic
        rel = diff / np.maximum(np.abs(ref2), REL_EPS)
        rel_error = rel.max(axis=1) if rel.shape[1] else np.zeros(rows)
        rel_error[bad] = np.inf
        out["rel_error"] = rel_error
    out["non_finite"] = bad
    return out


def _percentile(x: np.ndarray, q: float) -> float:
    """numpy's default ("linear") percentile, but an interpolation touching +-inf yields +-inf (not NaN)."""
    s = np.sort(x.astype(np.float64))
    pos = (q / 100.0) * (s.size - 1)
    lo, hi = int(math.floor(pos)), int(math.ceil(pos))
    frac = pos - lo
    a, b = float(s[lo]), float(s[hi])
    if frac == 0 or a == b:
        return a
    if b == math.inf:
        return math.inf
    if a == -math.inf:
        return -math.inf
    return a + (b - a) * frac


def _stat(x: np.ndarray, how: str) -> float:
    if x.size == 0:
        return float("nan")
    if how == "mean":
        return float(np.mean(x.astype(np.float64)))
    if how == "max":
        return float(np.max(x))
    if how == "min":
        return float(np.min(x))
    if how.startswith("p"):
        return _percentile(x, float(how[1:]))
    raise ValueError(how)  # internal: only the statistics of _AGG below


# aggregate metric -> (per-row key, statistic)
_AGG: dict[str, tuple[str, str]] = {
    "accuracy": ("correct", "mean"),
    "reference_accuracy": ("reference_correct", "mean"),
    "top1_agreement": ("top1_agree", "mean"),
    "nn_top1_agreement": ("nn_top1_agree", "mean"),
    "nn_top5_agreement": ("nn_top5_overlap", "mean"),
}


def _source(metric: str) -> tuple[str, str]:
    if metric in _AGG:
        return _AGG[metric]
    key, _, how = metric.rpartition(".")
    return key, how


def metric_names(task: str, *, with_labels: bool) -> tuple[str, ...]:
    """The aggregate metric names `aggregate` returns for a task (TASK_METRICS minus label metrics if no labels)."""
    if task not in TASK_METRICS:
        raise InputError(f"unknown task {task!r}", hint=f"use one of {sorted(TASK_METRICS)} (model.task)")
    return tuple(m for m in TASK_METRICS[task] if with_labels or m not in _LABEL_METRICS)


def aggregate(task: str, per_sample: dict[str, np.ndarray], mask: np.ndarray | None = None) -> dict[str, float]:
    """Reduce per-row parity values to the task's metrics, over all rows or the rows under `mask`.

    Args:
        task: the spec's `model.task`.
        per_sample: output of `per_sample_metrics` (arrays of shape (rows,)).
        mask: bool array of shape (rows,) selecting the rows (a slice group); None for all rows.

    Returns:
        {metric: float} with keys exactly `TASK_METRICS[task]`, except "accuracy" and "reference_accuracy"
        which appear only when `per_sample` has labels ("correct"). NaN for every metric when no row is
        selected; +inf means/maxima when selected rows are non-finite.

    Raises:
        InputError: unknown task, a per-row array missing for the task, or a mask of the wrong length.
    """
    names = metric_names(task, with_labels="correct" in per_sample)
    m = None
    if mask is not None:
        m = np.asarray(mask, dtype=bool).reshape(-1)
    out: dict[str, float] = {}
    for name in names:
        key, how = _source(name)
        if key not in per_sample:
            raise InputError(f"aggregate: per-row values {key!r} missing for task {task!r} metric {name!r}",
                             hint="pass the output of per_sample_metrics for the same task")
        x = np.asarray(per_sample[key])
        if m is not None:
            if m.shape[0] != x.shape[0]:
                raise InputError(f"aggregate: mask has {m.shape[0]} rows, per-row values have {x.shape[0]}")
            x = x[m]
        out[name] = _stat(x.astype(np.float64) if x.dtype == bool else x, how)
    return out
