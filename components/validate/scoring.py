"""Scoring a variant's outputs against the FP32 reference: running it over validation rows (its first output),
per-row parity values, the overall metrics and the per-slice table, the labels they need, the worst slice and
the worst rows (worst_samples.csv).

Every other part of the validate step (logic.py's steps, sequential.py's block loop, numerics.py's exact pass)
scores through these functions, so the passes compute the same numbers.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from tailguard.core.data import Dataset
from tailguard.core.errors import InputError
from tailguard.core.metrics import higher_is_better
from tailguard.core.parity import aggregate, per_sample_metrics
from tailguard.core.report import key_metric
from tailguard.core.runtime import Runner, run_dataset
from tailguard.core.slices import per_slice_table
from tailguard.core.spec.root import Spec
from tailguard.core.tokens import align, decode_settings, run_token_ids

# per model task: the per-row value that ranks worst_samples.csv, and whether low values are the bad ones
WORST_SAMPLE_KEY: dict[str, tuple[str, bool]] = {
    "classification": ("kl_divergence", False),
    "embedding": ("cosine_similarity", True),
    "regression": ("abs_error", False),
    "generic": ("abs_error", False),
    "token_classification": ("char_error", False),
}


def _labels(spec: Spec, validation: Dataset) -> np.ndarray | None:
    col = spec.data.validation.label_column
    if spec.model.task not in ("classification", "embedding") or col is None:
        return None
    if col not in validation.frame.columns:
        raise InputError(f"data.validation.label_column: no column {col!r} in the validation data; "
                         f"available: {list(map(str, validation.frame.columns))}",
                         hint="fix the column name or drop label_column")
    s = validation.frame[col]
    if s.isna().any():
        raise InputError(f"data.validation.label_column: column {col!r} has {int(s.isna().sum())} missing labels",
                         hint="fill or drop the rows without a label")
    if spec.model.task == "embedding":  # kNN label accuracy: any hashable label (parity.per_sample_metrics)
        return s.to_numpy()
    if not pd.api.types.is_integer_dtype(s) and not (
            pd.api.types.is_float_dtype(s) and np.all(np.mod(s.to_numpy(), 1) == 0)):
        raise InputError(f"data.validation.label_column: column {col!r} must hold integer class ids "
                         f"(index of the logit), got dtype {s.dtype}", hint="map class names to ids in the data")
    return s.to_numpy().astype(np.int64)


def worst_slice(spec: Spec, table: pd.DataFrame) -> dict[str, Any] | None:
    """The worst slice group for the report's key metric (see `ValidationResult.worst_slice`)."""
    metric = key_metric(table) if len(table) else None
    if metric is None:
        return None
    supports = [g.min_support for g in spec.gates if g.scope == "per_slice"]
    floor = min(supports) if supports else 30
    t = table[(table["support"] >= floor) & table[metric].notna()]
    if t.empty:
        return None
    row = t.sort_values(metric, ascending=higher_is_better(metric, default=True), kind="stable").iloc[0]
    return {"slice": str(row["slice"]), "value": str(row["value"]), "support": int(row["support"]),
            "metric": metric, "observed": float(row[metric])}


def worst_samples(model_task: str, per_sample: dict[str, np.ndarray], frame: pd.DataFrame, k: int) -> pd.DataFrame:
    """The k validation rows with the worst per-row parity, with their per-row metrics and metadata.

    Ranked by `WORST_SAMPLE_KEY[model_task]`: classification `kl_divergence` highest first, embedding
    `cosine_similarity` lowest first, regression/generic `abs_error` highest first; ties by row index.
    Non-finite rows (scored worst case by `parity.per_sample_metrics`) come first.

    Args:
        model_task: the spec's `model.task`.
        per_sample: `parity.per_sample_metrics` output, arrays of shape (rows,).
        frame: the validation metadata (`Dataset.frame`), `rows` rows in the same order.
        k: rows to keep (spec `analysis.worst_k`; 0 gives an empty table with the columns).

    Returns:
        DataFrame of min(k, rows) rows, worst first, with columns "row" (int, the 0-based position in the
        validation set), every per-row metric of `per_sample` (in its order), then every column of `frame`
        (a frame column named like one of those is renamed "meta.<name>").

    Raises:
        InputError: the per-row key is missing, or `frame` has another row count.
    """
    key, low_is_bad = WORST_SAMPLE_KEY[model_task]
    if key not in per_sample:
        raise InputError(f"worst_samples: per-row values {key!r} missing for model.task {model_task!r}")
    vals = np.asarray(per_sample[key], dtype=np.float64)
    rows = vals.shape[0]
    if len(frame) != rows:
        raise InputError(f"worst_samples: metadata has {len(frame)} rows, per-row values {rows}")
    order = np.lexsort((np.arange(rows), vals if low_is_bad else -vals))[:max(0, min(k, rows))]
    out = pd.DataFrame({"row": order.astype(np.int64)})
    for name, arr in per_sample.items():
        out[name] = np.asarray(arr)[order]
    meta = frame.iloc[order].reset_index(drop=True)
    for col in meta.columns:
        name = str(col)
        out[f"meta.{name}" if name in out.columns else name] = meta[col].to_numpy()
    return out


def _run_first_output(runner: Runner, validation: Dataset, spec: Spec, variant_name: str) -> np.ndarray:
    """The variant's first output over every validation row, original row order: (rows, ...).

    Raises:
        InputError: the runner produced no outputs.
    """
    if spec.model.task == "token_classification":  # reduced batch by batch to (rows, time) ids: tailguard.core.tokens
        return run_token_ids(runner, validation, spec.model.inputs, batch_size=spec.data.validation.batch_size,
                             pad_values=spec.model.pad_values, mask_input=decode_settings(spec.model)["mask_input"])
    outputs = run_dataset(runner, validation, spec.model.inputs, batch_size=spec.data.validation.batch_size,
                          pad_values=spec.model.pad_values)
    if not outputs:
        raise InputError(f"validate: variant {variant_name!r} produced no outputs")
    return outputs[0]


def _per_row(spec: Spec, ref: np.ndarray, cand: np.ndarray, labels: np.ndarray | None,
             rows: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Per-row parity values of candidate outputs `cand` against the reference. `rows` None: `cand` covers every
    row of `ref` (rows, ...). Otherwise `cand` holds the rows `rows` (global indices) only and each gets the values
    it gets among all rows (embedding neighbours searched in the full FP32 set, `per_sample_metrics(query_rows=)`)."""
    model_task = spec.model.task
    emb = spec.analysis.embedding
    kw: dict[str, Any] = ({"recall_k": emb.recall_k, "knn_k": emb.knn_k, "margin_tolerance": emb.margin_tolerance}
                          if model_task == "embedding" else {})
    if model_task == "classification":
        kw["probabilities"] = spec.model.outputs[0].kind == "probabilities"
    if model_task == "token_classification":  # outputs are tokens.token_ids (the mask is applied in them)
        d = decode_settings(spec.model)
        kw.update(decode=d["decode"], blank=d["blank"])
    if rows is None:
        return per_sample_metrics(model_task, ref, cand, labels=labels, **kw)
    if model_task == "embedding":
        kw.update(reference_index=ref, query_rows=rows, index_labels=labels)
    return per_sample_metrics(model_task, ref[rows], cand, labels=None if labels is None else labels[rows], **kw)


def _score(spec: Spec, ref: np.ndarray, cand: np.ndarray, labels: np.ndarray | None, groups: list,
           rows: np.ndarray | None = None) -> tuple[dict[str, np.ndarray], dict[str, float], pd.DataFrame]:
    """(per-row values (rows,), overall parity metrics, per-slice table) of candidate outputs `cand` against the
    reference `ref` (both (rows, ...), float); `rows`: as `_per_row`, with `groups` over those rows."""
    model_task = spec.model.task
    per_sample = _per_row(spec, ref, cand, labels, rows)
    return per_sample, aggregate(model_task, per_sample), per_slice_table(model_task, per_sample, groups)


def _concat(spec: Spec, parts: list[np.ndarray]) -> np.ndarray:
    """Outputs of several runs stacked on the rows axis; token_classification ids (rows, time) of runs padded to
    different lengths are first widened with `tokens.IGNORE` to the widest."""
    if spec.model.task == "token_classification" and parts:
        width = max(p.shape[1] for p in parts)
        parts = [align(p, np.zeros((p.shape[0], width), dtype=np.int32))[0] for p in parts]
    return np.concatenate(parts)


def _in_row_order(order: np.ndarray, outputs: np.ndarray, n_rows: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Outputs scored in `order` put back in validation-row order: (outputs (n_rows, ...), None) when every row
    was scored, else (outputs of the scored rows sorted by row, their sorted row indices)."""
    if order.size == n_rows:
        out = np.empty_like(outputs)
        out[order] = outputs
        return out, None
    o = np.argsort(order, kind="stable")
    return outputs[o], order[o]
