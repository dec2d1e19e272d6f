"""Token / sequence outputs (spec `model.task: token_classification`): per-position top-1 class ids, greedy CTC
decoding, and the per-row parity values of a candidate's sequence against the FP32 reference's.

A token_classification output has shape (rows, time, classes) (logits or probabilities: only the top-1 class per
position is compared, which is the same for both). It is reduced while it is run (`run_token_ids`: one batch at a
time) to int32 class ids of shape (rows, time), so validation holds (rows, time) ids, never (rows, time, classes)
floats: issue 38 saw 9.2 GB RSS validating 600 OCR lines of (80, 6625) scores as `generic`.

Ids (rows, time), int32:
    ids_it = argmax_c output_itc     for an unmasked position t of row i
    ids_it = IGNORE (-1)             where the mask input (`model.decode.mask_input`) is 0, and past the row's
                                     last position when batches of different padded lengths are stacked
    ids_i. = NON_FINITE (-2)         every position of a row whose output holds NaN/inf at an unmasked position

Sequences: with `model.decode.kind: none` a row's sequence is its unmasked ids in time order; with `ctc_greedy`
it is the greedy CTC decoding of them (Graves et al. 2006, "best path decoding"): consecutive repeats collapsed
into one, then `blank` dropped.

Per-row values (ref = FP32 reference ids, cand = the variant's; positions compared: ref_it != IGNORE):
    token_top1_agree_i = mean over compared positions t of [cand_it == ref_it]         (1 with no position)
    sequence_exact_i   = seq(cand_i) == seq(ref_i)
    char_error_i       = min(1, Levenshtein(seq(cand_i), seq(ref_i)) / len(seq(ref_i)))
                         (0 when both are empty; 1 when only the reference is empty)
A non-finite row (either side) scores 0, False, 1. The edit distance is rapidfuzz's
(`rapidfuzz.distance.Levenshtein.distance`, unit costs, on the label sequences as lists of ints).

Why cer is truncated at 1: the Levenshtein distance counts insertions, so an unbounded per-row CER of a garbage
line against a 2-label reference can be 15 and one such row would outweigh hundreds of good ones in the row mean
every parity metric is; truncated, a row counts at most as "every label wrong". It also keeps every per-row value in
[0, 1], the bounded range the shadow monitor's detector bets against (monitoring/detector.py) and the bootstrap
bound resamples. Aggregates are row means (`cer` = mean of char_error over rows), not the corpus-level
sum(edits) / sum(reference lengths) that ASR toolkits report; a per-row mean is what slices, the bootstrap and the
monitor's per-request evidence need.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from tailguard.core.errors import InputError

IGNORE = -1       # id of a masked or padded position: not compared
NON_FINITE = -2   # every id of a row whose output held NaN/inf: scored worst case


def token_ids(output: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    """Per-position top-1 class ids of a (rows, time, classes) output.

    Args:
        output: float (rows, time, classes) logits or probabilities.
        mask: (rows, time) of the mask input (any numeric/bool dtype; 0 = not compared), or None (all positions).

    Returns:
        int32 (rows, time): class ids, IGNORE where masked, NON_FINITE on every position of a row with NaN/inf at
        an unmasked position.

    Raises:
        InputError: output not 3-D, or a mask whose shape is not (rows, time) (names the fix).
    """
    out = np.asarray(output)
    if out.ndim != 3:
        raise InputError(f"token_classification: the compared output must be (batch, time, classes), got shape "
                         f"{out.shape}", hint="declare model.outputs[0] as [batch, time, C] or choose another task")
    rows, time = out.shape[:2]
    if out.shape[2] == 0:
        raise InputError("token_classification: the compared output has 0 classes")
    ids = out.argmax(axis=2).astype(np.int32) if out.size else np.zeros((rows, time), dtype=np.int32)
    keep = np.ones((rows, time), dtype=bool)
    if mask is not None:
        m = np.asarray(mask)
        if m.shape != (rows, time):
            raise InputError(f"token_classification: mask input has shape {m.shape} but the output has (batch, "
                             f"time) {(rows, time)}",
                             hint="model.decode.mask_input must name a (batch, time) input whose time axis is the "
                                  "output's (e.g. attention_mask of a token classifier); remove it otherwise")
        keep = m != 0
        ids[~keep] = IGNORE
    if np.issubdtype(out.dtype, np.floating):
        bad = (~np.isfinite(out).all(axis=2) & keep).any(axis=1)
        ids[bad] = NON_FINITE
    return ids


def align(ref: np.ndarray, cand: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Two id arrays (rows, time_a) and (rows, time_b) padded with IGNORE to the wider time axis.

    Raises:
        InputError: not 2-D, or different row counts.
    """
    a, b = np.asarray(ref), np.asarray(cand)
    if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[0]:
        raise InputError(f"token_classification: id arrays (rows, time) must have the same rows, got {a.shape} and "
                         f"{b.shape}")
    t = max(a.shape[1], b.shape[1])
    return _pad(a, t), _pad(b, t)


def _pad(a: np.ndarray, t: int) -> np.ndarray:
    if a.shape[1] == t:
        return a
    out = np.full((a.shape[0], t), IGNORE, dtype=np.int32)
    out[:, :a.shape[1]] = a
    return out


def sequences(ids: np.ndarray, *, decode: str = "none", blank: int = 0) -> list[list[int]]:
    """Each row's compared label sequence (module docstring): its non-IGNORE ids, greedy-CTC decoded with
    `decode="ctc_greedy"` (repeats collapsed, `blank` dropped).

    Args:
        ids: int (rows, time) from `token_ids`.
        decode: "none" or "ctc_greedy" (model.decode.kind).
        blank: the CTC blank class (model.decode.blank).

    Returns:
        One list of ints per row.
    """
    if decode not in ("none", "ctc_greedy"):
        raise InputError(f"unknown decode kind {decode!r}", hint="use none or ctc_greedy (model.decode.kind)")
    out: list[list[int]] = []
    for row in np.asarray(ids):
        seq = row[row != IGNORE]
        if decode == "ctc_greedy" and seq.size:
            seq = seq[np.concatenate([[True], seq[1:] != seq[:-1]])]
            seq = seq[seq != blank]
        out.append(seq.tolist())
    return out


def per_row(reference: np.ndarray, candidate: np.ndarray, *, mask: np.ndarray | None = None,
            decode: str = "none", blank: int = 0) -> dict[str, np.ndarray]:
    """Per-row parity values of a token_classification candidate against the reference (formulas: module
    docstring).

    Args:
        reference: the FP32 reference's output, float (rows, time, classes), or its `token_ids` int (rows, time).
        candidate: the variant's output for the same rows, in the same form (ids may differ in time width: they
            are aligned with IGNORE).
        mask: (rows, time) mask input for float outputs (None: every position); ids carry their mask already.
        decode: "none" or "ctc_greedy".
        blank: the CTC blank class.

    Returns:
        {"token_top1_agree": float64 (rows,), "sequence_exact": bool (rows,), "char_error": float64 (rows,) in
        [0, 1], "non_finite": bool (rows,)}.

    Raises:
        InputError: shapes that do not suit (3-D float or 2-D int, same rows), a mask of the wrong shape.
    """
    from rapidfuzz.distance import Levenshtein

    ref, cand = (np.asarray(reference), np.asarray(candidate))
    if ref.ndim == 3 and cand.ndim == 3 and ref.shape != cand.shape:
        raise InputError(f"parity: candidate output shape {cand.shape} differs from the reference {ref.shape}",
                         hint="the variant must produce model.outputs[0] with the reference's shape")
    r = token_ids(ref, mask) if ref.ndim == 3 else ref
    c = token_ids(cand, mask) if cand.ndim == 3 else cand
    if not (np.issubdtype(r.dtype, np.integer) and np.issubdtype(c.dtype, np.integer)):
        raise InputError(f"parity: task 'token_classification' needs (rows, time, classes) outputs, got shapes "
                         f"{ref.shape} and {cand.shape}", hint="declare model.outputs[0] as [batch, time, C]")
    r, c = align(r, c)
    bad = (r == NON_FINITE).any(axis=1) | (c == NON_FINITE).any(axis=1)
    compared = r != IGNORE
    n = compared.sum(axis=1)
    agree = np.where(n > 0, ((c == r) & compared).sum(axis=1) / np.maximum(n, 1), 1.0)
    # the candidate's ids at the reference's compared positions (the mask is the data's, alike on both sides)
    c_masked = np.where(compared, c, IGNORE)
    rs = sequences(r, decode=decode, blank=blank)
    cs = sequences(c_masked, decode=decode, blank=blank)
    exact = np.array([a == b for a, b in zip(rs, cs)], dtype=bool)
    cer = np.array([min(1.0, Levenshtein.distance(b, a) / len(a)) if a else (0.0 if not b else 1.0)
                    for a, b in zip(rs, cs)], dtype=np.float64)
    agree = agree.astype(np.float64)
    agree[bad], exact[bad], cer[bad] = 0.0, False, 1.0
    return {"token_top1_agree": agree, "sequence_exact": exact, "char_error": cer, "non_finite": bad}


def decode_settings(spec_model: Any) -> dict[str, Any]:
    """(decode kind, blank, mask input name) of a spec's model section as keyword arguments
    {"decode": str, "blank": int, "mask_input": str | None}."""
    return decode_of(getattr(spec_model, "decode", None))


def decode_of(d: Any) -> dict[str, Any]:
    """`decode_settings` of a model.decode section (DecodeSpec) or None (no mask, no decoding)."""
    if d is None:
        return {"decode": "none", "blank": 0, "mask_input": None}
    return {"decode": d.kind, "blank": int(d.blank), "mask_input": d.mask_input}


def run_token_ids(runner: Any, ds: Any, input_specs: Sequence, *, batch_size: int,
                  pad_values: dict[str, float] | None = None, mask_input: str | None = None,
                  output_index: int = 0) -> np.ndarray:
    """Run every row of `ds` (length-sorted batches, as `tailguard.core.runtime.run_dataset`) and keep only the
    first output's `token_ids`, in the original row order: memory is one batch's (batch, time, classes) floats plus
    the (rows, time) ids.

    Args:
        runner: a `tailguard.core.runtime.Runner`.
        ds: the Dataset.
        input_specs: model.inputs.
        batch_size: rows per batch.
        pad_values: model.pad_values.
        mask_input: model.decode.mask_input (its padded batch tensor is the mask), or None.
        output_index: which of the runner's outputs is the compared one (default the first).

    Returns:
        int32 (rows, max time over batches); a batch padded to a shorter time gets IGNORE beyond it.

    Raises:
        InputError: an output that is not (batch, time, classes), a mask input that is not fed or not (batch, time).
    """
    from tailguard.core.data import iter_batches  # lazy: pandas only where a dataset is run

    parts: list[tuple[np.ndarray, np.ndarray]] = []
    for idx, feeds in iter_batches(ds, input_specs, batch_size, pad_values=pad_values):
        res = runner.run(feeds)
        if len(res) <= output_index:
            raise InputError(f"token_classification: the model produced {len(res)} output(s), the compared one is "
                             f"output {output_index}")
        mask = None
        if mask_input is not None:
            if mask_input not in feeds:
                raise InputError(f"model.decode.mask_input: {mask_input!r} is not among the fed inputs "
                                 f"{sorted(feeds)}", hint="name a model input")
            mask = feeds[mask_input]
        parts.append((np.asarray(idx), token_ids(res[output_index], mask)))
    width = max((p.shape[1] for _, p in parts), default=0)
    out = np.full((ds.n_rows, width), IGNORE, dtype=np.int32)
    for idx, p in parts:
        out[idx, :p.shape[1]] = p
    return out
