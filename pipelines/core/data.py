"""Datasets: Parquet files with one row per sample, a column per model input (array-valued,
variable length allowed), plus label and metadata columns used for slicing.

A model input of spec shape `[batch, d1, ..., dk]` has, per row, a rank-k array: `dj` an int is a fixed size
that every row must have, `dj` a name (e.g. `sequence`) is a variable length. A cell is stored either as
(nested) Parquet lists (`list<float>`, `list<list<float>>`, ...) or as an Arrow fixed-shape tensor
(`pa.fixed_shape_tensor(value_type, (d1, ..., dk))`, row-major); both load to one numpy array per row.

Batches are padded per batch: every variable axis to the longest row in the batch (or the first variable axis to a
fixed length where a calibration method needs one); fixed axes are never padded. Length-sorted batching runs ~3x
faster than random order on transformer models; outputs are always returned in the original row order.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import pandas as pd

from tailguard.core.errors import InputError

NP_DTYPES = {"int64": np.int64, "int32": np.int32, "float32": np.float32, "float16": np.float16, "bool": np.bool_}
_SHOWN_ROWS = 5  # offending rows named in a shape error


# ------------------------------------------------------------------------------------------- row shapes
def row_shape(spec: Any) -> tuple[int | None, ...] | None:
    """The per-row shape an input spec asks for: its shape without the batch axis, an int for a fixed size and
    None for a named (variable) axis; e.g. `[batch, sequence, 80]` -> (None, 80), `[batch, 1, 8, 8]` ->
    (1, 8, 8), `[batch]` -> (). None when `spec` has no shape (duck-typed specs of older callers)."""
    shape = getattr(spec, "shape", None)
    if not shape:
        return None
    return tuple(d if isinstance(d, int) and not isinstance(d, bool) else None for d in list(shape)[1:])


def describe_row_shape(spec: Any) -> str:
    """The expected per-row shape in words, e.g. "(1, 8, 8)" or "(sequence, 80)" (named axes: any length)."""
    shape = list(getattr(spec, "shape", None) or [])[1:]
    return "(" + ", ".join(str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


def shape_text(shape: Sequence) -> str:
    """A spec shape as written in YAML, e.g. "[batch, 1, 8, 8]"."""
    return "[" + ", ".join(str(d) for d in shape) + "]"


def cell_array(value: Any, dtype: Any = None) -> np.ndarray:
    """One Parquet cell as one numpy array: a scalar, a list, nested lists (pandas gives arrays of arrays), or a
    fixed-shape tensor row (already an ndarray, see `read_parquet`).

    Args:
        value: the cell.
        dtype: numpy dtype to cast to (None: keep).

    Returns:
        The array, rank = nesting depth (nested lists must be rectangular).

    Raises:
        ValueError: nested lists of unequal lengths (ragged), message "ragged nested lists".
        TypeError: a non-numeric element or a null inside the cell.
    """
    arr = np.asarray(value)
    if arr.dtype == object:
        if arr.ndim == 0:
            raise TypeError(f"non-numeric element {value!r}")
        if arr.size == 0:
            arr = np.zeros(arr.shape, dtype=np.float64)
        else:
            parts = list(arr.ravel())
            if not all(type(p) is np.ndarray and p.dtype != object for p in parts):  # deeper nesting
                parts = [cell_array(v) for v in parts]
            if len({p.shape for p in parts}) > 1:
                raise ValueError("ragged nested lists")
            arr = np.stack(parts).reshape(arr.shape + parts[0].shape)
    return arr if dtype is None else arr.astype(dtype)


def shape_problem(arr: np.ndarray, spec: Any) -> str | None:
    """Why a row's array does not fit the input spec's per-row shape, e.g. "shape (1, 8, 7)", or None when it
    fits (right rank, every fixed axis equal; named axes any length) or the spec has no shape."""
    want = row_shape(spec)
    if want is None:
        return None
    if arr.ndim != len(want) or any(w is not None and w != d for w, d in zip(want, arr.shape)):
        return f"shape {tuple(arr.shape)}"
    return None


@dataclass
class Dataset:
    """Rows of model inputs plus a frame of the other columns.

    Attributes:
        inputs: {input name: list of n_rows arrays}; each array has the input's shape without the batch axis
            (e.g. (sequence,) int64 for token ids, (1, 8, 8) float32 for `[batch, 1, 8, 8]` images,
            (sequence, 80) for `[batch, sequence, 80]` frames); sizes along named axes may differ between rows.
        frame: pandas DataFrame (n_rows rows) of every non-input column (labels, metadata).
        lengths: (n_rows,) int64 batching sort key: each row's size along the first named (variable) axis of the
            first input that has one; with none, along the first axis of the first input (1 for scalars).
        uri: where the rows came from (for error messages).
    """

    inputs: dict[str, list[np.ndarray]]
    frame: pd.DataFrame
    lengths: np.ndarray
    uri: str

    @property
    def n_rows(self) -> int:
        """Number of rows."""
        return len(self.lengths)

    def subset(self, idx: np.ndarray) -> "Dataset":
        """Rows `idx` (int array), in that order."""
        idx = np.asarray(idx, dtype=np.int64)
        return Dataset({k: [v[i] for i in idx] for k, v in self.inputs.items()},
                       self.frame.iloc[idx].reset_index(drop=True), self.lengths[idx], self.uri)


def read_parquet(uri: str, *, field: str = "data") -> pd.DataFrame:
    """Read a Parquet file (local path or s3:// through pyarrow's filesystem).

    Columns of the Arrow fixed-shape tensor type (`pa.fixed_shape_tensor(type, shape)`) come back as one numpy
    array of that shape per row (pandas alone would flatten them); a null tensor cell comes back as None.

    Raises:
        InputError: missing or unreadable file, or a fixed-shape tensor column with a non-row-major permutation,
            naming the uri and the spec field.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    if "://" not in uri and not Path(uri).is_file():
        raise InputError(f"{field}: file not found: {uri}", hint="fix the path in the spec (relative paths are "
                                                                 "resolved against the spec file's folder)")
    try:
        # what pd.read_parquet does with the pyarrow engine, keeping the Arrow table for tensor columns
        table = pq.read_table(uri, use_pandas_metadata=True)
        df = table.to_pandas()
    except Exception as exc:  # pyarrow raises several unrelated types for a corrupt file
        raise InputError(f"{field}: cannot read Parquet file {uri}: {exc}",
                         hint="the file must be a Parquet table with one row per sample") from None
    for f in table.schema:
        if isinstance(f.type, pa.FixedShapeTensorType):
            df[f.name] = pd.Series(_tensor_rows(table.column(f.name), f, uri, field), index=df.index,
                                   dtype=object)
    return df


def _tensor_rows(column: Any, f: Any, uri: str, field: str) -> list[np.ndarray | None]:
    """One (shape) array per row of a fixed-shape tensor column (chunked array); None for null cells."""
    perm = f.type.permutation
    if perm is not None and list(perm) != list(range(len(perm))):
        raise InputError(f"{field}: column {f.name!r} in {uri} is a fixed-shape tensor with permutation "
                         f"{list(perm)}; only row-major tensors (no permutation) are read",
                         hint="write the column with pa.fixed_shape_tensor(type, shape) and C-ordered arrays")
    rows: list[np.ndarray | None] = []
    for chunk in column.chunks:
        if chunk.null_count == 0:
            rows.extend(chunk.to_numpy_ndarray())  # views into one (rows, *shape) array
        else:  # to_numpy_ndarray fills null cells with garbage: convert cell by cell
            rows.extend(chunk[i].to_numpy() if chunk[i].is_valid else None for i in range(len(chunk)))
    return rows


def load_dataset(uri: str, input_specs: Sequence, *, field: str = "data", max_samples: int | None = None,
                 seed: int = 0, stratify_by: str | None = None) -> Dataset:
    """Load a Parquet dataset and split model-input columns from metadata columns.

    Every cell of an input column becomes one array of the input's dtype (nested lists and fixed-shape tensors
    alike, see the module docstring); with a spec shape, each row must have its rank and every fixed size.

    Args:
        uri: Parquet file.
        input_specs: the spec's `model.inputs` (objects with .name, .dtype and .shape; without .shape no row
            shape is checked).
        field: spec field path used in error messages (e.g. "data.validation").
        max_samples: keep at most this many rows: a seeded uniform sample, or, with `stratify_by`, a sample
            spread evenly over that column's values (rare values keep all their rows).
        seed: sample seed.
        stratify_by: metadata column to stratify the sample over.

    Raises:
        InputError: missing file, missing input column, a row that is not numeric or is ragged nested lists, or
            rows whose shape does not fit the spec (names the column, the first rows, the expected and found
            shapes).
    """
    df = read_parquet(uri, field=f"{field}.uri")
    missing = [s.name for s in input_specs if s.name not in df.columns]
    if missing:
        raise InputError(f"{field}: {uri} has no column(s) {missing} for model inputs; columns: {list(df.columns)}",
                         hint="each model input needs a column of the same name")
    if max_samples is not None and len(df) > max_samples:
        df = _sample(df, max_samples, seed, stratify_by, field)
    df = df.reset_index(drop=True)
    inputs = {s.name: _input_rows(df[s.name].tolist(), s, uri, field) for s in input_specs}
    lengths = _lengths(inputs, input_specs)
    frame = df.drop(columns=[s.name for s in input_specs])
    return Dataset(inputs, frame, lengths, uri)


def _input_rows(cells: list[Any], s: Any, uri: str, field: str) -> list[np.ndarray]:
    dtype = NP_DTYPES[s.dtype]
    want = row_shape(s)
    rows: list[np.ndarray] = []
    bad: list[tuple[int, str]] = []
    for i, v in enumerate(cells):
        try:
            a = cell_array(v, dtype)
        except (TypeError, ValueError) as exc:
            raise InputError(f"{field}: column {s.name!r} in {uri}, row {i}: not convertible to a {s.dtype} array "
                             f"of shape {describe_row_shape(s)}: {exc}",
                             hint="store each row as (nested) numeric lists or a fixed-shape tensor") from None
        if a.size == 0 and a.ndim == 1 and want and want[0] is None and len(want) > 1:
            a = a.reshape((0, *(w or 0 for w in want[1:])))  # an empty sequence, e.g. of (80,) frames
        if want is not None and (a.ndim != len(want) or any(w is not None and w != d
                                                            for w, d in zip(want, a.shape))):
            bad.append((i, f"shape {tuple(a.shape)}"))  # as shape_problem words it
        rows.append(a)
    if bad:
        found: dict[str, list[int]] = {}
        for i, p in bad:
            found.setdefault(p, []).append(i)
        shown = "; ".join(f"{p} in row(s) {r[:_SHOWN_ROWS]}" + (f" and {len(r) - _SHOWN_ROWS} more"
                                                               if len(r) > _SHOWN_ROWS else "")
                          for p, r in list(found.items())[:_SHOWN_ROWS])
        raise InputError(f"{field}: column {s.name!r} in {uri}: {len(bad)} of {len(cells)} rows do not have the "
                         f"per-row shape {describe_row_shape(s)} of model.inputs {s.name!r} (shape "
                         f"{shape_text(s.shape)}; named axes may have any length): found {shown}",
                         hint="fix the rows, or model.inputs[].shape (one entry per axis, batch first)")
    return rows


def _lengths(inputs: dict[str, list[np.ndarray]], input_specs: Sequence) -> np.ndarray:
    """(n_rows,) int64 sort key: each row's size along the first variable axis of the first input that has one;
    else (no variable axis anywhere, or specs without shape) along the first axis of the first input, 1 for
    scalars."""
    for s in input_specs:
        want = row_shape(s)
        if want and None in want:
            axis = want.index(None)
            return np.array([a.shape[axis] if a.ndim > axis else 1 for a in inputs[s.name]], dtype=np.int64)
    first = inputs[input_specs[0].name]
    return np.array([a.shape[0] if a.ndim else 1 for a in first], dtype=np.int64)


def _sample(df: pd.DataFrame, n: int, seed: int, stratify_by: str | None, field: str) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    if stratify_by is None:
        return df.iloc[np.sort(rng.choice(len(df), size=n, replace=False))]
    if stratify_by not in df.columns:
        raise InputError(f"{field}.stratify_by: no column {stratify_by!r} in the data")
    groups = {k: np.asarray(v) for k, v in df.groupby(stratify_by, sort=True).indices.items()}
    # Water-filling: every group gets an equal share; groups smaller than the share give their slack to others.
    quota = {k: 0 for k in groups}
    remaining, open_groups = n, sorted(groups, key=lambda k: len(groups[k]))
    while open_groups and remaining > 0:
        share = max(remaining // len(open_groups), 1)
        k = open_groups.pop(0)
        take = min(len(groups[k]) - quota[k], share)
        quota[k] += take
        remaining -= take
    chosen = np.concatenate([rng.choice(groups[k], size=q, replace=False) for k, q in quota.items() if q > 0])
    return df.iloc[np.sort(chosen)]


def make_batch(ds: Dataset, idx: np.ndarray, input_specs: Sequence, *, pad_values: dict[str, float] | None = None,
               fixed_length: int | None = None) -> dict[str, np.ndarray]:
    """Stack rows `idx` into one feed per input, padding variable-length axes per batch.

    Every axis is padded (at the end, with the input's pad value) to the longest row of the batch; fixed axes of
    the spec shape have one size in every row, so they are never padded. With `fixed_length`, the first variable
    axis (a named axis of the spec shape after batch; the first row axis for specs without shape) is padded or
    truncated to that length instead; inputs with no variable axis ignore it. For `[batch, sequence]` inputs this
    is the sequence axis, as always.

    Args:
        ds: the dataset.
        idx: (batch,) row indices.
        input_specs: `model.inputs` (name, dtype, shape).
        pad_values: pad value per input name (default 0).
        fixed_length: length of the first variable axis instead of the batch maximum.

    Returns:
        {input name: array of shape (batch, *padded row shape)} with the input's dtype, e.g. (batch, 1, 8, 8)
        float32 for `[batch, 1, 8, 8]`, (batch, longest sequence, 80) for `[batch, sequence, 80]`.
    """
    pad_values = pad_values or {}
    feeds: dict[str, np.ndarray] = {}
    for s in input_specs:
        rows = [ds.inputs[s.name][i] for i in idx]
        dtype = NP_DTYPES[s.dtype]
        if rows[0].ndim == 0:
            feeds[s.name] = np.asarray(rows, dtype=dtype)
            continue
        target = [max(r.shape[ax] for r in rows) for ax in range(rows[0].ndim)]
        if fixed_length:
            want = row_shape(s)
            if want is None or len(want) != rows[0].ndim:
                target[0] = fixed_length
            elif None in want:
                target[want.index(None)] = fixed_length
        if all(r.shape == tuple(target) for r in rows):
            feeds[s.name] = np.stack(rows).astype(dtype, copy=False)
            continue
        out = np.full((len(rows), *target), pad_values.get(s.name, 0), dtype=dtype)
        for j, r in enumerate(rows):
            cut = tuple(slice(0, min(n, t)) for n, t in zip(r.shape, target))
            out[(j, *cut)] = r[cut]
        feeds[s.name] = out
    return feeds


def batch_indices(ds: Dataset, batch_size: int, *, sort_by_length: bool = True) -> list[np.ndarray]:
    """Split rows into batches of at most `batch_size`, length-sorted by default (stable sort)."""
    order = np.argsort(ds.lengths, kind="stable") if sort_by_length else np.arange(ds.n_rows)
    return [order[i:i + batch_size] for i in range(0, ds.n_rows, batch_size)]


def iter_batches(ds: Dataset, input_specs: Sequence, batch_size: int, *, pad_values: dict[str, float] | None = None,
                 fixed_length: int | None = None, sort_by_length: bool = True
                 ) -> Iterator[tuple[np.ndarray, dict[str, np.ndarray]]]:
    """Yield (row indices, feeds) batches over the whole dataset; see `make_batch`."""
    for idx in batch_indices(ds, batch_size, sort_by_length=sort_by_length):
        yield idx, make_batch(ds, idx, input_specs, pad_values=pad_values, fixed_length=fixed_length)


def load_validation(spec) -> Dataset:
    """The spec's validation set (`data.validation`), subsampled to max_samples if set."""
    v = spec.data.validation
    return load_dataset(v.uri, spec.model.inputs, field="data.validation", max_samples=v.max_samples, seed=v.seed)


def load_calibration(spec) -> Dataset:
    """The spec's calibration set (`data.calibration`): max_samples rows, stratified by `stratify_by` if set."""
    c = spec.data.calibration
    return load_dataset(c.uri, spec.model.inputs, field="data.calibration", max_samples=c.max_samples,
                        seed=c.seed, stratify_by=c.stratify_by)
