"""Parity between a candidate variant's outputs and the FP32 reference, per row and aggregated.

Two stages, kept apart so slices and the shadow-traffic monitor reuse them:

1. `per_sample_metrics` turns (reference, candidate) output arrays into one value per row and metric.
2. `aggregate` reduces those per-row values (optionally under a boolean row mask, e.g. one slice group)
   to the model task's metrics, named exactly as `tailguard.core.spec.gates.MODEL_TASK_METRICS[model_task]`.

Formulas (per row i; `ref` is the FP32 reference, `cand` the candidate variant):

classification (logits, shape (rows, classes)):
    top1_agree_i        = argmax(cand_i) == argmax(ref_i)
    kl_divergence_i     = KL(softmax(ref_i) || softmax(cand_i)) = sum_c p_c (log p_c - log q_c)   [nats],
                          computed in float64 from log-softmax (log-sum-exp), clipped at 0; for outputs declared
                          `kind: probabilities` p and q are the outputs themselves (clipped at 1e-12, renormalised)
    abs_error_i         = max_c |cand_ic - ref_ic|
    correct_i           = argmax(cand_i) == label_i           (labels given)
    reference_correct_i = argmax(ref_i) == label_i            (labels given)

embedding (vectors, shape (rows, dim)):
    cosine_similarity_i = <cand_i, ref_i> / (|cand_i| |ref_i|)   (norms floored at 1e-12)
    nn_top1_agree_i     = NN1(cand_i) == NN1(ref_i), nearest neighbours by cosine in the FP32 index
    nn_top5_overlap_i   = |top5(cand_i) ∩ top5(ref_i)| / 5     (/ k when the index has k < 5 entries)
    abs_error_i         = max_d |cand_id - ref_id|
    nn_recall_i         = |topK(cand_i) ∩ topK(ref_i)| / K    K = recall_k (spec analysis.embedding.recall_k,
                          default 10; smaller when the index is): recall@K of the FP32 query's K neighbours
    margin_i            = s(ref_i, NN1(ref_i)) - s(ref_i, NN2(ref_i))   the FP32 query's top-1/top-2 cosine gap
                          (+inf when the index holds one entry only)
    nn_top1_margin_agree_i = nn_top1_agree_i OR margin_i <= margin_tolerance
                          (analysis.embedding.margin_tolerance, default 0.01): a disagreement counts only where
                          the FP32 ranking itself is decisive, not on a near-tie any rounding could flip
    correct_i           = knn_label(cand_i) == label_i        (labels given)
    reference_correct_i = knn_label(ref_i) == label_i         (labels given)
                          knn_label(q) = the majority label of the knn_k (default 1) nearest FP32 index rows
                          of q (ties: the label of the nearer neighbour), i.e. kNN classification in the FP32
                          index; labels may be any hashable values (strings, ints)
    The FP32 index defaults to the reference outputs themselves; then row i is excluded from its own
    neighbours (`exclude_self`), otherwise every row would trivially find itself. This is the usual
    retrieval-consistency check for quantized embedding models (e.g. the "retrieval overlap@k" of
    sentence-transformers quantization studies): a variant may keep cosine 0.99 and still reorder neighbours.

token_classification (shape (rows, time, classes), or its per-position top-1 ids (rows, time)):
    token_top1_agree_i, sequence_exact_i, char_error_i (cer): formulas and the masking / CTC decoding in
    `tailguard.core.tokens`

regression / generic (any shape (rows, ...)):
    abs_error_i = max_j |cand_ij - ref_ij|
    rel_error_i = max_j |cand_ij - ref_ij| / max(|ref_ij|, REL_EPS)      REL_EPS = 1e-6

Non-finite rows: a row whose candidate (or reference) output holds NaN or +-inf is scored worst-case
(agreements False, overlap 0, cosine -1, errors and KL +inf) and flagged in the extra per-row key
"non_finite"; `aggregate` still returns numbers (means and maxima become +inf, so any error gate fails).

Aggregates (keys of MODEL_TASK_METRICS): `x.mean`, `x.max`, `x.min` as named; `x.p99` / `x.p01` are the
99th / 1st percentiles with numpy's default "linear" interpolation (an interpolation touching +-inf gives
+-inf, never NaN); `accuracy`, `reference_accuracy`, `top1_agreement`, `nn_top1_agreement`,
`nn_top1_margin_agreement` are means of the 0/1 indicators; `nn_top5_agreement` is the mean overlap,
`nn_recall_at_k` the mean recall. An empty selection gives NaN for every metric.

Which embedding metric to gate on (docs/spec.md "Embedding gates"): nn_top1_agreement punishes every flip
of a near-tie, so on data with many near-duplicates (WordNet lemmas of one synset) it fails a variant whose
retrieval is intact; nn_top1_margin_agreement keeps the check but skips FP32 near-ties; nn_recall_at_k asks
whether the neighbourhood survives (search/RAG); accuracy with max_drop (kNN label accuracy vs the
reference's, paired Newcombe bound) asks whether the task the embedding serves still works.
"""

from __future__ import annotations

import numpy as np

from tailguard.core.errors import InputError
from tailguard.core.spec.gates import MODEL_TASK_METRICS
from tailguard.core.stats import percentile

REL_EPS = 1e-6  # floor of |reference| in rel_error, so exact zeros in the reference do not divide by zero
NORM_EPS = 1e-12  # floor of vector norms in cosine similarity
NN_K = 5  # neighbours compared by nn_top5_overlap
RECALL_K = 10  # default K of nn_recall_at_k (spec analysis.embedding.recall_k)
KNN_K = 1  # default neighbours voting in kNN label accuracy (spec analysis.embedding.knn_k)
MARGIN_TOLERANCE = 0.01  # default FP32 top-1/top-2 cosine gap below which a top-1 flip is a near-tie
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


def _check_pair(model_task: str, reference: np.ndarray, candidate: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if model_task not in MODEL_TASK_METRICS:
        raise InputError(f"unknown model.task {model_task!r}",
                         hint=f"use one of {sorted(MODEL_TASK_METRICS)} (model.task)")
    ref, cand = np.asarray(reference), np.asarray(candidate)
    if ref.ndim == 0 or cand.ndim == 0:
        raise InputError("parity: outputs must have a leading rows axis, got a scalar")
    if ref.shape != cand.shape:
        raise InputError(f"parity: candidate output shape {cand.shape} differs from the reference {ref.shape}",
                         hint="the variant must produce the first model output (model.outputs[0]) with the "
                              "same shape as the FP32 reference")
    if model_task in ("classification", "embedding") and ref.ndim != 2:
        axis = "classes" if model_task == "classification" else "dim"
        raise InputError(f"parity: model.task {model_task!r} needs 2-D outputs (rows, {axis}), got shape {ref.shape}",
                         hint="use task: token_classification for (batch, time, classes) outputs (CTC, token "
                              "tagging)" if model_task == "classification" and ref.ndim == 3 else
                         "set model.task to 'generic' for other output shapes")
    return ref, cand


PROBABILITY_FLOOR = 1e-12  # log of a probability output: values clipped here first (a 0 would give -inf)


def _log_probabilities(x: np.ndarray) -> np.ndarray:
    """Natural log of probability rows (rows, classes): clipped at PROBABILITY_FLOOR and renormalised so each row
    sums to 1 (float16/INT8 outputs drift from it by rounding)."""
    x = np.clip(x.astype(np.float64, copy=False), PROBABILITY_FLOOR, None)
    return np.log(x / x.sum(axis=1, keepdims=True))


def looks_like_probabilities(x: np.ndarray, tol: float = 1e-3) -> bool:
    """Whether every row of a (rows, classes) output is in [0, 1] and sums to 1 within `tol`: an output declared
    (or left) as logits that is already softmaxed, so KL on its softmax would be wrong."""
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] == 0 or x.shape[1] < 2 or not np.isfinite(x).all():
        return False
    return bool((x >= -tol).all() and (x <= 1 + tol).all() and np.abs(x.sum(axis=1) - 1).max() <= tol)


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
    return _topk_scored(queries, index, k, exclude)[0]


def _topk_scored(queries: np.ndarray, index: np.ndarray, k: int, exclude: np.ndarray | None
                 ) -> tuple[np.ndarray, np.ndarray]:
    """`_topk` and the cosine similarities of those neighbours: (indices (rows, k) int64, scores (rows, k)
    float32), best first."""
    n = index.shape[0]
    rows = queries.shape[0]
    out = np.empty((rows, k), dtype=np.int64)
    out_scores = np.empty((rows, k), dtype=np.float32)
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
        out_scores[start:stop] = np.take_along_axis(part_scores, order, axis=1)[:, :k]
    return out, out_scores


def _knn_labels(neighbours: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """Majority label code of each row's neighbours (rows, k) -> (rows,); ties go to the nearer neighbour."""
    lab = codes[neighbours]  # (rows, k)
    k = lab.shape[1]
    votes = (lab[:, :, None] == lab[:, None, :]).sum(axis=2)  # (rows, k): votes for the label at position j
    score = votes * (k + 1) - np.arange(k)[None, :]  # more votes first, then the nearer position
    return lab[np.arange(lab.shape[0]), score.argmax(axis=1)]


def per_sample_metrics(model_task: str, reference: np.ndarray, candidate: np.ndarray, *,
                       labels: np.ndarray | None = None, reference_index: np.ndarray | None = None,
                       exclude_self: bool = True, index_labels: np.ndarray | None = None,
                       recall_k: int = RECALL_K, knn_k: int = KNN_K,
                       margin_tolerance: float = MARGIN_TOLERANCE,
                       query_rows: np.ndarray | None = None, probabilities: bool = False,
                       mask: np.ndarray | None = None, decode: str = "none", blank: int = 0
                       ) -> dict[str, np.ndarray]:
    """One parity value per validation row, for the model task's metrics (formulas: module docstring).

    Args:
        model_task: "classification", "embedding", "regression", "generic" or "token_classification" (spec
            `model.task`).
        reference: FP32 reference output, shape (rows, ...) — (rows, classes) logits for classification,
            (rows, dim) vectors for embedding; float (float16/32/64).
        candidate: the variant's output for the same rows, same shape as `reference`.
        labels: ground-truth labels, shape (rows,). Classification: int class ids. Embedding: any hashable
            values (str, int), the labels of the rows and, with the default index, of the index rows. Adds
            "correct" and "reference_correct".
        reference_index: embedding only: the FP32 index searched for neighbours, shape (n, dim) float
            (default: `reference` itself).
        exclude_self: embedding only: when the index is the reference set (`reference_index` None or the
            very same array), row i is not its own neighbour.
        index_labels: embedding only: labels of the `reference_index` rows, shape (n,) (default: `labels`,
            which then needs the default index).
        recall_k: embedding only: K of "nn_recall" (spec analysis.embedding.recall_k); capped at the index
            rows available.
        knn_k: embedding only: neighbours voting for the kNN label (analysis.embedding.knn_k); capped likewise.
        margin_tolerance: embedding only: cosine gap (>= 0) at or below which the FP32 top-1/top-2 is a
            near-tie (analysis.embedding.margin_tolerance).
        probabilities: classification only: the outputs are probabilities (model.outputs[0].kind), so KL
            divergence is computed on them (clipped at PROBABILITY_FLOOR, renormalised) instead of on their
            softmax; top-1 and abs_error are the same either way.
        query_rows: embedding only: the rows are these rows of `reference_index` (int array of shape (rows,)),
            e.g. a block of the validation set scored against the full FP32 reference set: with `exclude_self`
            each row is kept out of its own neighbours, so a row's values equal those it gets when every row is
            scored at once (sequential validation). Needs `reference_index` (and `index_labels` with labels).
        mask, decode, blank: token_classification only (`tailguard.core.tokens.per_row`): the (rows, time) mask
            input of float outputs, the decoding ("none" / "ctc_greedy", model.decode.kind) and the CTC blank.
            Its outputs may also be given as `tokens.token_ids` (int (rows, time)), as validation keeps them.

    Returns:
        {per-row metric: array of shape (rows,)}:
        classification: "top1_agree" (bool), "kl_divergence" (float64, nats), "abs_error" (float64),
        and with labels "correct", "reference_correct" (bool);
        embedding: "cosine_similarity", "abs_error" (float64), "nn_top1_agree" (bool),
        "nn_top5_overlap", "nn_recall" (float64 in [0, 1]), "nn_margin" (float64, cosine units, the FP32
        top-1/top-2 gap), "nn_top1_margin_agree" (bool), and with labels "correct", "reference_correct" (bool);
        regression/generic: "abs_error", "rel_error" (float64);
        token_classification: "token_top1_agree", "char_error" (float64 in [0, 1]), "sequence_exact" (bool).
        Every model task also has "non_finite" (bool): rows with NaN/inf in the candidate or reference, scored
        worst-case.

    Raises:
        InputError: unknown model.task, shapes that differ or do not suit the model task, labels of the wrong length,
            an index of another width, or an index too small to search (fewer than 2 rows with exclude_self),
            embedding labels with a custom index but no index_labels, k < 1 or a negative margin_tolerance.
    """
    if model_task == "token_classification":
        from tailguard.core.tokens import per_row

        return per_row(reference, candidate, mask=mask, decode=decode, blank=blank)
    ref, cand = _check_pair(model_task, reference, candidate)
    rows = ref.shape[0]
    bad = non_finite_rows(cand) | non_finite_rows(ref)
    ref2 = np.where(bad[:, None], 0.0, _rows2d(ref).astype(np.float64)) if rows else _rows2d(ref).astype(np.float64)
    cand2 = np.where(bad[:, None], 0.0, _rows2d(cand).astype(np.float64)) if rows else _rows2d(cand).astype(
        np.float64)
    diff = np.abs(cand2 - ref2)
    abs_error = diff.max(axis=1) if diff.shape[1] else np.zeros(rows)
    abs_error[bad] = np.inf
    out: dict[str, np.ndarray] = {"abs_error": abs_error}

    if model_task == "classification":
        if ref2.shape[1] < 1:
            raise InputError("parity: classification logits have 0 classes")
        ref_top, cand_top = ref2.argmax(axis=1), cand2.argmax(axis=1)
        log_p = _log_probabilities if probabilities else _log_softmax
        lp, lq = log_p(ref2), log_p(cand2)
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
    elif model_task == "embedding":
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
        if query_rows is not None:
            if self_index:
                raise InputError("parity: query_rows needs reference_index (the full FP32 set the rows belong to)")
            q_rows = np.asarray(query_rows, dtype=np.int64).reshape(-1)
            if q_rows.shape[0] != rows or (rows and (q_rows.min() < 0 or q_rows.max() >= index.shape[0])):
                raise InputError(f"parity: query_rows must give {rows} rows of the {index.shape[0]}-row index")
            exclude = q_rows if exclude_self else None
        else:
            exclude = np.arange(rows) if (self_index and exclude_self) else None
        available = index.shape[0] - (1 if exclude is not None else 0)
        if rows and available < 1:
            raise InputError(f"parity: nearest-neighbour metrics need an index of at least "
                             f"{2 if exclude is not None else 1} rows, got {index.shape[0]}",
                             hint="validate on more rows (data.validation)")
        if int(recall_k) < 1 or int(knn_k) < 1 or not (float(margin_tolerance) >= 0):
            raise InputError(f"parity: need recall_k >= 1, knn_k >= 1, margin_tolerance >= 0; got {recall_k!r}, "
                             f"{knn_k!r}, {margin_tolerance!r}", hint="check analysis.embedding")
        k = min(NN_K, available)
        kr, kk = min(int(recall_k), available), min(int(knn_k), available)
        depth = max(k, kr, kk, min(2, available))
        codes = None
        if labels is not None:
            lab = np.asarray(labels).reshape(-1)
            if lab.shape[0] != rows:
                raise InputError(f"parity: {lab.shape[0]} labels for {rows} rows",
                                 hint="check data.validation.label_column")
            if index_labels is None and not self_index:
                raise InputError("parity: embedding labels with a custom reference_index need index_labels")
            il = lab if index_labels is None else np.asarray(index_labels).reshape(-1)
            if il.shape[0] != index.shape[0]:
                raise InputError(f"parity: {il.shape[0]} index labels for an index of {index.shape[0]} rows")
            _, inv = np.unique(np.concatenate([lab, il]).astype(object).astype(str), return_inverse=True)
            q_codes, codes = inv[:rows], inv[rows:]
        if rows:
            tc, _ = _topk_scored(cn, index, depth, exclude)
            tr, sr = _topk_scored(rn, index, depth, exclude)
            top1 = tc[:, 0] == tr[:, 0]
            overlap = (tc[:, :k, None] == tr[:, None, :k]).any(axis=2).sum(axis=1) / float(k)
            recall = (tc[:, :kr, None] == tr[:, None, :kr]).any(axis=2).sum(axis=1) / float(kr)
            margin = (sr[:, 0].astype(np.float64) - sr[:, 1].astype(np.float64) if depth >= 2
                      else np.full(rows, np.inf))
        else:
            top1, overlap, recall, margin = np.zeros(0, dtype=bool), np.zeros(0), np.zeros(0), np.zeros(0)
        top1[bad] = False
        overlap[bad] = 0.0
        recall[bad] = 0.0
        margin_agree = top1 | (margin <= float(margin_tolerance))
        margin_agree[bad] = False
        out.update(cosine_similarity=cos, nn_top1_agree=top1, nn_top5_overlap=overlap, nn_recall=recall,
                   nn_margin=margin, nn_top1_margin_agree=margin_agree)
        if codes is not None:
            if rows:
                correct = _knn_labels(tc[:, :kk], codes) == q_codes
                reference_correct = _knn_labels(tr[:, :kk], codes) == q_codes
            else:
                correct, reference_correct = np.zeros(0, dtype=bool), np.zeros(0, dtype=bool)
            correct[bad] = False
            out.update(correct=correct, reference_correct=reference_correct)
    else:  # regression, generic
        rel = diff / np.maximum(np.abs(ref2), REL_EPS)
        rel_error = rel.max(axis=1) if rel.shape[1] else np.zeros(rows)
        rel_error[bad] = np.inf
        out["rel_error"] = rel_error
    out["non_finite"] = bad
    return out


_percentile = percentile  # numpy's "linear" percentile, +-inf at an infinite neighbour (core.stats)


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
    "nn_recall_at_k": ("nn_recall", "mean"),
    "nn_top1_margin_agreement": ("nn_top1_margin_agree", "mean"),
    "token_top1_agreement": ("token_top1_agree", "mean"),
    "sequence_exact_match": ("sequence_exact", "mean"),
    "cer": ("char_error", "mean"),
}


def row_source(metric: str) -> tuple[str, str]:
    """The per-row key of `per_sample_metrics` an aggregate metric is computed from, and how.

    Args:
        metric: an aggregate name as `aggregate` returns it ("top1_agreement", "cosine_similarity.p01", ...).

    Returns:
        (per-row key, statistic): ("top1_agree", "mean") for the agreement and accuracy metrics, else the name
        split at its last dot ("cosine_similarity", "p01"; "abs_error", "max").
    """
    if metric in _AGG:
        return _AGG[metric]
    key, _, how = metric.rpartition(".")
    return key, how


def metric_names(model_task: str, *, with_labels: bool) -> tuple[str, ...]:
    """The aggregate metric names `aggregate` returns for a model task (MODEL_TASK_METRICS minus label metrics if
    no labels)."""
    if model_task not in MODEL_TASK_METRICS:
        raise InputError(f"unknown model.task {model_task!r}",
                         hint=f"use one of {sorted(MODEL_TASK_METRICS)} (model.task)")
    return tuple(m for m in MODEL_TASK_METRICS[model_task] if with_labels or m not in _LABEL_METRICS)


def aggregate(model_task: str, per_sample: dict[str, np.ndarray], mask: np.ndarray | None = None) -> dict[str, float]:
    """Reduce per-row parity values to the model task's metrics, over all rows or the rows under `mask`.

    Args:
        model_task: the spec's `model.task`.
        per_sample: output of `per_sample_metrics` (arrays of shape (rows,)).
        mask: bool array of shape (rows,) selecting the rows (a slice group); None for all rows.

    Returns:
        {metric: float} with keys exactly `MODEL_TASK_METRICS[model_task]`, except "accuracy" and "reference_accuracy"
        which appear only when `per_sample` has labels ("correct"). NaN for every metric when no row is
        selected; +inf means/maxima when selected rows are non-finite.

    Raises:
        InputError: unknown model.task, a per-row array missing for the model task, or a mask of the wrong length.
    """
    names = metric_names(model_task, with_labels="correct" in per_sample)
    m = None
    if mask is not None:
        m = np.asarray(mask, dtype=bool).reshape(-1)
    out: dict[str, float] = {}
    for name in names:
        key, how = row_source(name)
        if key not in per_sample:
            raise InputError(f"aggregate: per-row values {key!r} missing for model.task {model_task!r} metric {name!r}",
                             hint="pass the output of per_sample_metrics for the same model task")
        x = np.asarray(per_sample[key])
        if m is not None:
            if m.shape[0] != x.shape[0]:
                raise InputError(f"aggregate: mask has {m.shape[0]} rows, per-row values have {x.shape[0]}")
            x = x[m]
        out[name] = _stat(x.astype(np.float64) if x.dtype == bool else x, how)
    return out
