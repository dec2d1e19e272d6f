"""Confidence bounds of parity metrics for gates: which bound a metric gets, over which rows.

Gates with `confidence` (spec `GateSpec.confidence`) compare a one-sided bound on the bad side instead of the
point estimate, so a small group neither passes vacuously nor fails on one unlucky row. `metric_bound` picks the
method per metric: Wilson's score bound for PROPORTION_METRICS (means of a 0/1 value per row), a seeded
percentile bootstrap of the metric's statistic ("mean", percentiles "p01"/"p99", "max", "min") otherwise; the
relative accuracy gate bounds the paired difference with Newcombe's method
(`tailguard.core.stats.newcombe_paired_bound`).

The formulas, their sources and the implementations live in `tailguard.core.stats` (one statistics module for
validation, discovery and latency); this module only picks the method per metric and names it.
"""

from __future__ import annotations

import numpy as np

from tailguard.core.errors import InputError
from tailguard.core.parity import row_source
from tailguard.core.spec.analysis import BootstrapSpec
from tailguard.core.spec.gates import MODEL_TASK_METRICS, PROPORTION_METRICS
from tailguard.core.stats import Side, bootstrap_bound, wilson_bound


def metric_bound(model_task: str, metric: str, per_sample: dict[str, np.ndarray], mask: np.ndarray | None,
                 confidence: float, side: Side, bootstrap: BootstrapSpec | None = None) -> float:
    """One-sided confidence bound of a parity metric over all rows or the rows under `mask`.

    Wilson score bound for PROPORTION_METRICS (successes = the sum of the 0/1 per-row values), the
    percentile bootstrap (`bootstrap.samples`, `bootstrap.seed`) of the metric's statistic otherwise.

    Args:
        model_task: spec `model.task`.
        metric: a parity metric of MODEL_TASK_METRICS[model_task], e.g. "top1_agreement", "cosine_similarity.p01".
        per_sample: `parity.per_sample_metrics` output, arrays of shape (rows,).
        mask: bool array of shape (rows,) selecting the rows (a slice group), or None for all rows.
        confidence: one-sided level in (0, 1).
        side: "lower" or "upper".
        bootstrap: resamples and seed (default: BootstrapSpec() = 1000 resamples, seed 0).

    Returns:
        The bound in the metric's units; NaN when no row is selected.

    Raises:
        InputError: a metric the model task does not produce, its per-row values missing, or a mask of another
            length.
        ValueError: a bad confidence or side.
    """
    if model_task not in MODEL_TASK_METRICS or metric not in MODEL_TASK_METRICS[model_task]:
        raise InputError(f"metric_bound: {metric!r} is not a parity metric of model.task {model_task!r}")
    key, how = row_source(metric)
    if key not in per_sample:
        raise InputError(f"metric_bound: per-row values {key!r} missing for metric {metric!r}",
                         hint="pass the output of per_sample_metrics for the same model task")
    x = np.asarray(per_sample[key]).reshape(-1)
    if mask is not None:
        m = np.asarray(mask, dtype=bool).reshape(-1)
        if m.shape[0] != x.shape[0]:
            raise InputError(f"metric_bound: mask has {m.shape[0]} rows, per-row values have {x.shape[0]}")
        x = x[m]
    if metric in PROPORTION_METRICS:
        return float(wilson_bound(int(np.count_nonzero(x)), int(x.size), confidence, side))
    bs = bootstrap or BootstrapSpec()
    return bootstrap_bound(x, how, confidence, side, samples=bs.samples, seed=bs.seed)


def method_words(metric: str, confidence: float, side: Side, bootstrap: BootstrapSpec | None = None) -> str:
    """How `metric_bound` bounds a metric, in words (recorded in GateResult.method)."""
    level = f"{confidence * 100:g}%"
    if metric in PROPORTION_METRICS:
        return f"one-sided {level} Wilson score {side} bound"
    bs = bootstrap or BootstrapSpec()
    return f"one-sided {level} percentile-bootstrap {side} bound ({bs.samples} resamples, seed {bs.seed})"
