"""Per-row comparison of candidate and reference outputs: a thin layer over the validate step's parity code
(`tailguard.components.validate.parity`), so the monitor and the validation gates compute the same numbers."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from tailguard.core import parity


def reference_non_finite(reference: np.ndarray) -> np.ndarray:
    """Rows whose reference output holds NaN/inf (the monitor drops those: the reference cannot judge them).

    Args:
        reference: (rows, ...) reference output.

    Returns:
        (rows,) bool.
    """
    return parity.non_finite_rows(reference)


def compare_rows(task: str, reference: np.ndarray, candidate: np.ndarray, metrics: Sequence[str]
                 ) -> dict[str, np.ndarray]:
    """Per-row parity values for the tracked metrics.

    Args:
        task: model.task.
        reference: (rows, ...) FP32 reference output (model.outputs[0]).
        candidate: same shape, the candidate's output.
        metrics: per-row metric names (keys of `parity.per_sample_metrics`).

    Returns:
        {metric: (rows,) float64} plus "non_finite": (rows,) bool (candidate rows scored worst-case by parity).

    Raises:
        InputError: shapes differ or do not suit the task (from parity).
    """
    ref = np.asarray(reference)
    kwargs = {}
    if task == "embedding":  # nearest-neighbour metrics are not monitored; give parity a trivial index
        kwargs = {"reference_index": ref, "exclude_self": False}
    per = parity.per_sample_metrics(task, ref, np.asarray(candidate), **kwargs)
    out = {m: np.asarray(per[m], dtype=np.float64) for m in metrics}
    out["non_finite"] = np.asarray(per["non_finite"], dtype=bool)
    return out
