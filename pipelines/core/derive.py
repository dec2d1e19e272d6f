"""Derived slices: one definition of a slice computed from the request's tensors or the reference's output, shared
by validation (components/validate) and the shadow monitor (monitoring/), so both give the same group labels.

A derived slice (`slices[i].derive`, a `DeriveSpec`) turns each row into one number:

- source: a model input by name (`input`), or the FP32 reference's first output (`output: reference`);
- `select: [start, stop)`: elements start..stop-1 of the row flattened row-major (numpy C order);
- `reduce`, per row over every non-batch axis:
  sum, mean, max, min; count_nonzero (elements != 0); norm (L2, sqrt of the sum of squares);
  argmax (flat index of the largest element: the reference's top-1 class for (batch, classes) logits);
  length (positions along the last axis up to and including the last element != 0, so trailing zeros, the
  padding, do not count: the tokens of a (batch, sequence) attention mask or of token ids; with more non-batch
  axes, the longest over them);
  nearest_centroid (index of the nearest centroid, by Euclidean distance between L2-normalised vectors, i.e. the
  largest cosine similarity, of k centroids fitted with `fit_centroids` on the validation set's reference outputs).

Padding: a batched request's rows are padded with 0 to the longest row by its sender; validation rows are not
padded. sum, count_nonzero, length and norm do not change under zero padding, and `spec check` allows only those on
inputs with a variable-length axis (tailguard.core.spec.data.derive_errors), so a row gives the same value alone,
padded in a validation batch or padded in a live request.

`row_labels` maps the values to the group labels of `tailguard.core.slices` (bins "[16,32)", "(-inf,0)",
"[129,inf)", values by `value_label`, NaN "null"), so the labels in slices.csv and in the monitor's /v1/slices are
the same strings.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from tailguard.core.errors import InputError
from tailguard.core.slices import NULL, _fmt, value_label
from tailguard.core.spec.data import SliceSpec

# Slices the monitor adds by model task when monitoring.slice_columns is not set (issue 35): the reference's top-1 class
# (classification) and the nearest of DEFAULT_TOPIC_CENTROIDS topic centroids (embedding), which validation fits and
# logs even when the spec declares no such slice, so a monitor of bare tensors gets per-topic alerts.
DEFAULT_PREDICTED = "predicted"
DEFAULT_TOPIC = "topic"
DEFAULT_TOPIC_CENTROIDS = 16
CENTROID_SEED = 0  # k-means seed: the same validation outputs give the same centroids in every run
CENTROIDS_FILE = "centroids.npz"  # {slice name: (k, dim) float32}, logged with the run and the registered version


def _reduce(x: np.ndarray, how: str, centroids: np.ndarray | None) -> np.ndarray:
    """x: (batch, elements) float64 (or (batch, ..., last) for length); returns (batch,) float64."""
    if how == "sum":
        return x.sum(axis=1)
    if how == "mean":
        return x.mean(axis=1) if x.shape[1] else np.full(x.shape[0], np.nan)
    if how == "max":
        return x.max(axis=1) if x.shape[1] else np.full(x.shape[0], np.nan)
    if how == "min":
        return x.min(axis=1) if x.shape[1] else np.full(x.shape[0], np.nan)
    if how == "count_nonzero":
        return np.count_nonzero(x, axis=1).astype(np.float64)
    if how == "length":  # x: (batch, others, last)
        nz = x != 0
        if not x.shape[-1]:
            return np.zeros(x.shape[0])
        last = np.where(nz.any(axis=-1), x.shape[-1] - np.argmax(nz[..., ::-1], axis=-1), 0)
        return last.max(axis=1).astype(np.float64) if last.shape[1] else np.zeros(x.shape[0])
    if how == "norm":
        return np.sqrt(np.einsum("ij,ij->i", x, x))
    if how == "argmax":
        return x.argmax(axis=1).astype(np.float64) if x.shape[1] else np.full(x.shape[0], np.nan)
    if how == "nearest_centroid":
        if centroids is None:
            raise InputError("nearest_centroid: no centroids given", hint="fit them with fit_centroids (the "
                             "pipeline logs them as centroids.npz) and pass them to the monitor (--centroids)")
        return nearest_centroid(x, centroids).astype(np.float64)
    raise InputError(f"unknown reduce {how!r}")


def derive_values(spec: SliceSpec, feeds: Mapping[str, np.ndarray],
                  reference_outputs: Sequence[np.ndarray] | None = None, *,
                  centroids: np.ndarray | None = None) -> np.ndarray:
    """Per-row raw value of a derived slice over one batch.

    Args:
        spec: a slice with `derive` set (validated: `derive_errors` found nothing).
        feeds: {input name: (batch, ...) array} (the request's tensors, padded with 0 along variable axes).
        reference_outputs: the reference model's outputs for the same rows, each (batch, ...); the first is used
            by `output: reference`. None when not run yet.
        centroids: (k, dim) float array for nearest_centroid (`fit_centroids`), else ignored.

    Returns:
        (batch,) float64: the value of each row (class / centroid indices as integral floats); NaN where the
        row's source values are non-finite for argmax / nearest_centroid.

    Raises:
        InputError: the slice is not derived, the input or output is missing, or the row has fewer elements
            than `select` needs (names the slice and the fix).
    """
    d = spec.derive
    if d is None:
        raise InputError(f"slice {spec.name!r} is not derived")
    if d.input is not None:
        if d.input not in feeds:
            raise InputError(f"slice {spec.name!r}: no input {d.input!r} in the request (inputs: {sorted(feeds)})",
                             hint="send the input, or fix slices[].derive.input")
        arr = np.asarray(feeds[d.input])
    else:
        if not reference_outputs:
            raise InputError(f"slice {spec.name!r}: the reference output is needed",
                             hint="run the reference before deriving output slices")
        arr = np.asarray(reference_outputs[0])
    if arr.ndim == 0:
        arr = arr.reshape(1)
    batch = arr.shape[0]
    if d.reduce == "length" and d.select is None:
        last = arr.shape[-1] if arr.ndim >= 2 else 1
        x = arr.reshape(batch, -1, last).astype(np.float64, copy=False)
    else:
        x = arr.reshape(batch, -1)
        if d.select is not None:
            start, stop = d.select
            if x.shape[1] < stop:
                raise InputError(f"slice {spec.name!r}: select [{start}, {stop}) but a row of "
                                 f"{d.input or 'the reference output'!r} has {x.shape[1]} elements",
                                 hint="fix slices[].derive.select")
            x = x[:, start:stop]
        x = x.astype(np.float64, copy=False)
        if d.reduce == "length":
            x = x.reshape(batch, 1, -1)
    if d.reduce in ("argmax", "nearest_centroid"):
        bad = ~np.isfinite(x).all(axis=1)
        out = _reduce(np.where(np.isfinite(x), x, 0.0), d.reduce, centroids)
        out[bad] = np.nan
        return out
    return _reduce(x, d.reduce, centroids)


def derive_rows(spec: SliceSpec, inputs: Mapping[str, list[np.ndarray]], reference_outputs: Sequence[np.ndarray]
                | None = None, *, centroids: np.ndarray | None = None) -> np.ndarray:
    """`derive_values` over unpadded validation rows (`Dataset.inputs`: lists of per-row arrays that may differ
    in length): rows of one shape are stacked and derived together.

    Args:
        spec: a derived slice.
        inputs: {input name: list of n arrays, each a row without the batch axis}.
        reference_outputs: (n, ...) reference outputs of the same rows (first one used), or None.
        centroids: for nearest_centroid.

    Returns:
        (n,) float64 values, in row order.
    """
    d = spec.derive
    assert d is not None
    if d.input is None:
        return derive_values(spec, {}, reference_outputs, centroids=centroids)
    rows = inputs.get(d.input)
    if rows is None:
        raise InputError(f"slice {spec.name!r}: no input {d.input!r} in the data (inputs: {sorted(inputs)})",
                         hint="fix slices[].derive.input")
    out = np.empty(len(rows), dtype=np.float64)
    by_shape: dict[tuple, list[int]] = {}
    for i, r in enumerate(rows):
        by_shape.setdefault(np.shape(r), []).append(i)
    for idx in by_shape.values():
        out[idx] = derive_values(spec, {d.input: np.stack([np.asarray(rows[i]) for i in idx])}, None)
    return out


def _unit(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64).reshape(x.shape[0], -1)
    n = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.where(n > 0, n, 1.0)


def fit_centroids(outputs: np.ndarray, k: int, *, seed: int = CENTROID_SEED) -> np.ndarray:
    """Seeded k-means (scikit-learn KMeans, k-means++ init, n_init=4) on L2-normalised reference outputs.

    Args:
        outputs: (rows, ...) reference outputs (flattened per row); non-finite rows are left out.
        k: number of centroids; fewer distinct rows than k give min(k, distinct rows) centroids.
        seed: random_state of KMeans (the same rows and seed give the same centroids).

    Returns:
        (k', dim) float32 unit-norm centroids, k' <= k, ordered by their first coordinate then the next ones
        (an order independent of the k-means run).

    Raises:
        InputError: no finite row.
    """
    from sklearn.cluster import KMeans

    x = _unit(np.asarray(outputs))
    x = x[np.isfinite(x).all(axis=1)]
    if not len(x):
        raise InputError("fit_centroids: no finite reference output to cluster")
    k = int(min(k, len(np.unique(x.round(6), axis=0))))
    km = KMeans(n_clusters=k, n_init=4, random_state=seed).fit(x)
    c = _unit(km.cluster_centers_)
    order = np.lexsort(c.T[::-1])
    return c[order].astype(np.float32)


def nearest_centroid(x: np.ndarray, centroids: np.ndarray) -> np.ndarray:
    """(batch,) int64: index of the nearest centroid of each L2-normalised row of `x` ((batch, dim)).

    Raises:
        InputError: the rows and centroids differ in dimension.
    """
    u = _unit(np.asarray(x))
    c = np.asarray(centroids, dtype=np.float64)
    if c.ndim != 2 or c.shape[1] != u.shape[1]:
        raise InputError(f"nearest_centroid: rows have {u.shape[1]} elements, the centroids shape "
                         f"{tuple(c.shape)}", hint="use the centroids fitted on this model's reference outputs")
    return (u @ c.T).argmax(axis=1).astype(np.int64)


def row_labels(spec: SliceSpec, x: np.ndarray) -> list[str | None]:
    """The group label of each row's value, as `tailguard.core.slices.slice_groups` labels it.

    bins [e0..en]: "[a,b)" for e_i <= x < e_i+1, "(-inf,e0)" below, "[en,inf)" at or above en; values: the
    `value_label` when among `values`, else None (the row is in no group of the slice; validation drops it, the
    monitor counts it as "other"); otherwise `value_label`. NaN: "null". (quantiles depend on the whole data set:
    only validation groups them; max_groups caps by support, also validation only.)

    Args:
        spec: the slice.
        x: (rows,) values (float, or object for column values).

    Returns:
        A list of rows labels (str, or None).
    """
    vals = np.asarray(x)
    if spec.bins is not None:
        e = [float(b) for b in spec.bins]
        xf = vals.astype(np.float64)
        names = [f"(-inf,{_fmt(e[0])})"] + [f"[{_fmt(a)},{_fmt(b)})" for a, b in zip(e[:-1], e[1:])] + \
            [f"[{_fmt(e[-1])},inf)", NULL]
        pos = np.searchsorted(np.asarray(e), xf, side="right")
        pos[np.isnan(xf)] = len(names) - 1
        return [names[p] for p in pos.tolist()]
    if vals.dtype.kind in "fiub" and vals.size > 1:  # numeric: label each distinct value once
        uniq, inverse = _distinct(vals.ravel())
        labels = np.asarray([value_label(v) for v in uniq.tolist()], dtype=object)[inverse].tolist()
    else:
        labels = [value_label(v) for v in vals.tolist()]
    if spec.values is not None:
        wanted = {value_label(v) for v in spec.values}
        return [lab if lab in wanted else None for lab in labels]
    return labels


def _distinct(vals: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sorted distinct values, each value's index among them) of a (rows,) numeric array: `np.unique` with
    return_inverse, by counting for integral values of a small range (an argmax's classes and a nearest
    centroid's indices, integral floats: no sort); the distinct values keep `vals`' dtype."""
    kind = vals.dtype.kind
    iv = None
    if kind in "iu":
        iv = vals
    elif kind == "f" and vals.size and bool(np.isfinite(vals).all()) and float(np.abs(vals).max()) < 2.0 ** 52:
        iv = vals.astype(np.int64)
        if not bool((iv == vals).all()):  # fractions take np.unique (as NaN and infinities do)
            iv = None
    if iv is not None and iv.size:
        lo, hi = int(iv.min()), int(iv.max())
        if hi - lo < 4096:
            off = (iv - lo).astype(np.intp)
            present = np.bincount(off, minlength=hi - lo + 1) > 0
            return (np.flatnonzero(present) + lo).astype(vals.dtype, copy=False), (np.cumsum(present) - 1)[off]
    uniq, inverse = np.unique(vals, return_inverse=True)
    return uniq, inverse.ravel()


def derive_dataset(slices: Sequence[SliceSpec], inputs: Mapping[str, list[np.ndarray]],
                   reference_outputs: Sequence[np.ndarray] | None, *,
                   centroids: Mapping[str, np.ndarray] | None = None
                   ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Values of every derived slice over the validation rows, fitting the nearest_centroid centroids.

    Args:
        slices: the spec's `slices` (column and header slices are skipped).
        inputs: `Dataset.inputs` of the validation rows.
        reference_outputs: the reference outputs over the same rows (first one used), each (rows, ...).
        centroids: centroids already fitted, by slice name (used instead of fitting).

    Returns:
        ({slice name: (rows,) float64 values}, {slice name: (k, dim) float32 centroids} for the nearest_centroid
        slices): the values go to `slices.slice_groups(derived=)`, the centroids to CENTROIDS_FILE.
    """
    values: dict[str, np.ndarray] = {}
    fitted: dict[str, np.ndarray] = {}
    for s in slices:
        d = s.derive
        if d is None:
            continue
        c = None
        if d.reduce == "nearest_centroid":
            c = (centroids or {}).get(s.name)
            if c is None:
                c = fit_centroids(np.asarray(reference_outputs[0]), int(d.centroids or 2))  # type: ignore[index]
            fitted[s.name] = np.asarray(c, dtype=np.float32)
        values[s.name] = derive_rows(s, inputs, reference_outputs, centroids=c)
    return values, fitted


def save_centroids(path: str, centroids: Mapping[str, np.ndarray]) -> None:
    """Write {slice name: (k, dim) centroids} as an .npz file (CENTROIDS_FILE)."""
    np.savez(path, **{k: np.asarray(v, dtype=np.float32) for k, v in centroids.items()})


def load_centroids(path: str) -> dict[str, np.ndarray]:
    """Read a CENTROIDS_FILE: {slice name: (k, dim) float32}.

    Raises:
        InputError: unreadable, not an .npz of 2-D arrays (names the file and the fix).
    """
    try:
        with np.load(path, allow_pickle=False) as z:
            out = {k: np.asarray(z[k], dtype=np.float32) for k in z.files}
    except (OSError, ValueError) as exc:
        raise InputError(f"centroids file {path!r} cannot be read ({type(exc).__name__}: {str(exc)[:200]})",
                         hint=f"give the {CENTROIDS_FILE} the pipeline logged with the validate run") from None
    bad = [k for k, v in out.items() if v.ndim != 2 or not len(v)]
    if bad:
        raise InputError(f"centroids file {path!r}: {bad} are not (k, dim) arrays",
                         hint=f"give the {CENTROIDS_FILE} the pipeline logged with the validate run")
    return out


def default_derived_slices(model_task: str) -> list[SliceSpec]:
    """The derived slices the monitor tracks by default for `task`: `predicted` (classification: argmax of the
    reference output) or `topic` (embedding: nearest of DEFAULT_TOPIC_CENTROIDS centroids of the reference
    embeddings); [] for other tasks."""
    if model_task == "classification":
        return [SliceSpec(name=DEFAULT_PREDICTED, derive={"output": "reference", "reduce": "argmax"})]
    if model_task == "embedding":
        return [SliceSpec(name=DEFAULT_TOPIC, derive={"output": "reference", "reduce": "nearest_centroid",
                                                      "centroids": DEFAULT_TOPIC_CENTROIDS})]
    return []


def monitored_default_slices(spec: Any) -> list[SliceSpec]:
    """The default derived slices (`default_derived_slices`) the spec's monitor tracks and the spec does not
    declare: all of them when monitoring.slice_columns is unset, else those it names; [] without monitoring."""
    mon = spec.monitoring
    if mon is None:
        return []
    declared = {s.name for s in spec.slices}
    return [d for d in default_derived_slices(spec.model.task)
            if d.name not in declared and (mon.slice_columns is None or d.name in mon.slice_columns)]
