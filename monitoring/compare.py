"""Per-row comparison of candidate and reference outputs: a thin layer over the validate step's parity code
(`tailguard.core.parity`), so the monitor and the validation gates compute the same numbers."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from tailguard.core import parity, tokens
from tailguard.core.errors import InputError
from tailguard.monitoring.config import CANDIDATE_ERROR, HIGHER_IS_BETTER, METRIC_RANGE, Bound


def reference_non_finite(reference: np.ndarray) -> np.ndarray:
    """Rows whose reference output holds NaN/inf (the monitor drops those: the reference cannot judge them).

    Args:
        reference: (rows, ...) reference output.

    Returns:
        (rows,) bool.
    """
    return parity.non_finite_rows(reference)


def compare_rows(model_task: str, reference: np.ndarray, candidate: np.ndarray, metrics: Sequence[str], *,
                 probabilities: bool = False, decode: Any = None,
                 feeds: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Per-row parity values for the tracked metrics.

    Args:
        model_task: model.task.
        reference: (rows, ...) FP32 reference output (model.outputs[0]).
        candidate: same shape, the candidate's output.
        metrics: per-row metric names (keys of `parity.per_sample_metrics`).
        probabilities: the output holds probabilities, not logits (model.outputs[0].kind): KL on the values.
        decode: token_classification: the spec's model.decode (DecodeSpec: kind, blank, mask_input) or None (no
            mask, no decoding).
        feeds: token_classification with decode.mask_input: the request's input tensors {name: (rows, ...)}; the
            mask is feeds[decode.mask_input], (rows, time).

    Returns:
        {metric: (rows,) float64} plus "non_finite": (rows,) bool (candidate rows scored worst-case by parity);
        candidate_error_rate is 0 on every row (the candidate answered).

    Raises:
        InputError: shapes differ or do not suit the model task (from parity); a mask input the request lacks.
    """
    ref = np.asarray(reference)
    kwargs: dict = {"probabilities": True} if probabilities and model_task == "classification" else {}
    if model_task == "embedding":  # nearest-neighbour metrics are not monitored; give parity a trivial index
        kwargs = {"reference_index": ref, "exclude_self": False}
    if model_task == "token_classification":  # ids (rows, time) carry their mask already (tokens.run_token_ids)
        kwargs = token_kwargs(decode, feeds, need_mask=ref.ndim == 3)
    per = parity.per_sample_metrics(model_task, ref, np.asarray(candidate), **kwargs)
    per[CANDIDATE_ERROR] = np.zeros(ref.shape[0])  # the candidate answered every row compared here
    out = {m: np.asarray(per[m], dtype=np.float64) for m in metrics}
    out["non_finite"] = np.asarray(per["non_finite"], dtype=bool)
    return out


def token_kwargs(decode: Any, feeds: Mapping[str, np.ndarray] | None, *, need_mask: bool = True) -> dict[str, Any]:
    """`parity.per_sample_metrics` keyword arguments of a token_classification request: decode kind, blank, and
    the mask taken from the request's inputs (`feeds[decode.mask_input]`; only when `need_mask`: outputs given
    as scores, not as `tokens.token_ids`).

    Raises:
        InputError: decode names a mask input the request does not carry.
    """
    d = tokens.decode_of(decode)
    kw: dict[str, Any] = {"decode": d["decode"], "blank": d["blank"]}
    name = d["mask_input"]
    if name is not None and need_mask:
        if feeds is None or name not in feeds:
            raise InputError(f"model.decode.mask_input {name!r}: the request carries no such input",
                             hint="send the mask input with every request, or remove model.decode.mask_input")
        kw["mask"] = np.asarray(feeds[name])
    return kw


def failure_rows(rows: int, metrics: Sequence[str], bounds: dict[str, Bound]) -> dict[str, np.ndarray]:
    """Per-row values for `rows` sampled rows the candidate failed on (it raised, timed out, or answered a shape
    other than the reference's): a failure is the worst disagreement there is, so it counts as such.

    candidate_error_rate is 1; a higher-is-better metric (top1_agree, cosine_similarity) takes its range's bad end
    (0 agreement, cosine -1); a lower-is-better metric takes its truncate_at when the threshold declares one, else
    it has no value for these rows (NaN: excluded from that metric, whose scale has no worst value; the failure
    is still counted by candidate_error_rate and the agreement metrics).

    Args:
        rows: rows of the failed request.
        metrics: tracked per-row metrics.
        bounds: resolved thresholds (for truncate_at).

    Returns:
        {metric: (rows,) float64}.
    """
    out: dict[str, np.ndarray] = {}
    for m in metrics:
        if m == CANDIDATE_ERROR:
            value = 1.0
        elif HIGHER_IS_BETTER.get(m, False):
            value = METRIC_RANGE[m][0]
        elif m in bounds and bounds[m].truncate_at is not None:
            value = float(bounds[m].truncate_at)  # type: ignore[arg-type]
        else:
            value = np.nan
        out[m] = np.full(rows, value, dtype=np.float64)
    return out
