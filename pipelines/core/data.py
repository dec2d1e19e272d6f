"""Datasets: Parquet files with one row per sample, a column per model input (array-valued,
variable length allowed), plus label and metadata columns used for slicing.

A model input of spec shape `[batch, d1, ..., dk]` has, per row, a rank-k array: `dj` an int is a fixed size
that every row must have, `dj` a name (e.g. `sequence`) is a variable length. A cell is stored either as
(nested) Parquet lists (`list<float>`, `list<list<float>>`, ...) or as an Arrow fixed-shape tensor
(`pa.fixed_shape_tensor(value_type, (d1, ..., dk))`, row-major); both load to one numpy array per row.

Batches are padded per batch: every variable axis to the longest row in the batch (or the first variable axis to a
fixed length where a calibration method needs one); fixed axes are never padded. Length-sorted batching runs ~3x
faster than random order on transformer models; outputs are always returned in the original row order. Where the
order does not matter (a pass over every row, calibration) batches are length-sorted, so each row is padded only to
its neighbours in length; where it does (random latency batches, the export check), and for the longest rows of a
sorted pass, one row far longer than the rest is refused with an error naming it (`make_batch`: PAD_MAX_FACTOR,
PAD_FLOOR_BYTES) rather than padding a whole batch to it. Batches are never split or reshuffled to get around it:
a latency figure at batch size N stays a figure at N, and calibration sees the padding it always saw.

Sampled reads (`max_samples`) stream the file (`read_parquet_rows`): the rows are chosen from the row count (and
the stratify column) first, then only those rows are decoded, one bounded batch at a time.
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
# Streaming reads (`read_parquet_rows`): decoded row data per batch, and the reader's page buffer. A sampled read
# holds the rows it keeps plus about 3x one batch (Arrow's pool peaked at 7 / 16 / 50 MiB for 1 / 4 / 16 MiB
# batches reading 100 of 40,000 rows of 256 floats: the batch, its list offsets, the taken copy).
STREAM_BATCH_BYTES = 8 * 2**20
_READ_BUFFER_BYTES = 2**20
# Padding bound (`make_batch`): a padded feed may hold at most PAD_MAX_FACTOR x the values of its rows once it is
# larger than PAD_FLOOR_BYTES; past both, one long row would multiply the batch's memory (and the model's work) by
# up to the batch size, so the batch is refused with the row named instead. Length-sorted batches of real text
# pad by well under 2x; 16x leaves room for random-order batches (latency pools) of a long-tailed length mix.
PAD_MAX_FACTOR = 16
PAD_FLOOR_BYTES = 64 * 2**20


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
        source_rows: (n_rows,) int64 each row's 0-based position in the file (a sample keeps file order), or
            None for rows made in memory; error messages name rows by it.
    """

    inputs: dict[str, list[np.ndarray]]
    frame: pd.DataFrame
    lengths: np.ndarray
    uri: str
    source_rows: np.ndarray | None = None

    @property
    def n_rows(self) -> int:
        """Number of rows."""
        return len(self.lengths)

    def subset(self, idx: np.ndarray) -> "Dataset":
        """Rows `idx` (int array), in that order."""
        idx = np.asarray(idx, dtype=np.int64)
        return Dataset({k: [v[i] for i in idx] for k, v in self.inputs.items()},
                       self.frame.iloc[idx].reset_index(drop=True), self.lengths[idx], self.uri,
                       None if self.source_rows is None else self.source_rows[idx])

    def file_row(self, i: int) -> int:
        """Row `i`'s position in the file it came from (`i` itself for rows made in memory)."""
        return int(i if self.source_rows is None else self.source_rows[i])


def read_parquet(uri: str, *, field: str = "data") -> pd.DataFrame:
    """Read a whole Parquet file (local path or s3:// through pyarrow's filesystem).

    Columns of the Arrow fixed-shape tensor type (`pa.fixed_shape_tensor(type, shape)`) come back as one numpy
    array of that shape per row (pandas alone would flatten them); a null tensor cell comes back as None.

    Raises:
        InputError: missing or unreadable file, or a fixed-shape tensor column with a non-row-major permutation,
            naming the uri and the spec field.
    """
    import pyarrow.parquet as pq

    _check_exists(uri, field)
    try:
        # what pd.read_parquet does with the pyarrow engine, keeping the Arrow table for tensor columns
        table = pq.read_table(uri, use_pandas_metadata=True)
    except Exception as exc:  # pyarrow raises several unrelated types for a corrupt file
        raise _unreadable(uri, field, exc) from None
    return _frame(table, uri, field)


def _check_exists(uri: str, field: str) -> None:
    if "://" not in uri and not Path(uri).is_file():
        raise InputError(f"{field}: file not found: {uri}", hint="fix the path in the spec (relative paths are "
                                                                 "resolved against the spec file's folder)")


def _unreadable(uri: str, field: str, exc: BaseException) -> InputError:
    return InputError(f"{field}: cannot read Parquet file {uri}: {exc}",
                      hint="the file must be a Parquet table with one row per sample")


def _frame(table: Any, uri: str, field: str) -> pd.DataFrame:
    """An Arrow table as pandas (its pandas metadata applied), fixed-shape tensor columns as arrays per row."""
    import pyarrow as pa

    try:
        df = table.to_pandas()
    except Exception as exc:  # e.g. pandas metadata that does not fit the columns
        raise _unreadable(uri, field, exc) from None
    for f in table.schema:
        if isinstance(f.type, pa.FixedShapeTensorType):
            df[f.name] = pd.Series(_tensor_rows(table.column(f.name), f, uri, field), index=df.index,
                                   dtype=object)
    return df


def _open_parquet(uri: str, field: str) -> Any:
    """A `pyarrow.parquet.ParquetFile` on a local path or a filesystem URI (s3://...), reading pages as they are
    decoded (buffered, not whole column chunks at once)."""
    import pyarrow.parquet as pq
    from pyarrow import fs as pafs

    _check_exists(uri, field)
    try:
        if "://" in uri:
            filesystem, path = pafs.FileSystem.from_uri(uri)
            source = filesystem.open_input_file(path)
        else:
            source = uri
        return pq.ParquetFile(source, buffer_size=_READ_BUFFER_BYTES, pre_buffer=False)
    except Exception as exc:
        raise _unreadable(uri, field, exc) from None


def _pandas_columns(schema: Any) -> list[str]:
    """The DataFrame columns a Parquet schema gives (its stored pandas index columns left out)."""
    meta = schema.pandas_metadata or {}
    index = {c for c in meta.get("index_columns", []) if isinstance(c, str)}
    return [n for n in schema.names if n not in index]


def read_parquet_rows(uri: str, rows: np.ndarray, *, field: str = "data", batch_bytes: int | None = None,
                      parquet_file: Any = None) -> pd.DataFrame:
    """Read only some rows of a Parquet file, streaming it batch by batch.

    Memory is bounded by the rows kept plus one decoded batch (about `batch_bytes` of row data, sized from the row
    groups' uncompressed sizes) and the reader's page buffer, never the whole file: each batch is decoded, the
    wanted rows are taken (`RecordBatch.take`) and the rest is released. Row groups holding no wanted row are not
    read at all.

    Args:
        uri: Parquet file (local path or a pyarrow filesystem URI).
        rows: (k,) int64 wanted row positions, 0-based in the file, increasing, no repeats.
        field: spec field path used in error messages.
        batch_bytes: decoded bytes per batch (default `STREAM_BATCH_BYTES`).
        parquet_file: the file already opened (`pyarrow.parquet.ParquetFile`), else it is opened here.

    Returns:
        DataFrame of the wanted rows in file order, as `read_parquet` gives them (pandas metadata applied,
        fixed-shape tensor cells as arrays).

    Raises:
        InputError: missing or unreadable file, naming the uri and the field.
    """
    import pyarrow as pa

    pf = parquet_file if parquet_file is not None else _open_parquet(uri, field)
    meta = pf.metadata
    wanted = np.asarray(rows, dtype=np.int64)
    starts = np.cumsum([0] + [meta.row_group(i).num_rows for i in range(meta.num_row_groups)])
    groups = [i for i in range(meta.num_row_groups)
              if np.searchsorted(wanted, starts[i]) < np.searchsorted(wanted, starts[i + 1])]
    row_bytes = max((meta.row_group(i).total_byte_size / max(meta.row_group(i).num_rows, 1) for i in groups),
                    default=1.0)
    batch_rows = int(min(max((batch_bytes or STREAM_BATCH_BYTES) // max(row_bytes, 1.0), 1), 1 << 16))
    # each wanted row's position in the stream of the selected row groups
    shift = np.zeros(len(wanted), dtype=np.int64)
    stream_start = 0
    for i in groups:
        lo, hi = np.searchsorted(wanted, [starts[i], starts[i + 1]])
        shift[lo:hi] = starts[i] - stream_start
        stream_start += starts[i + 1] - starts[i]
    local = wanted - shift
    kept: list[Any] = []
    try:
        offset = 0
        if groups:
            for batch in pf.iter_batches(batch_size=batch_rows, row_groups=groups, use_pandas_metadata=True):
                lo, hi = np.searchsorted(local, [offset, offset + batch.num_rows])
                if hi > lo:
                    kept.append(batch.take(pa.array(local[lo:hi] - offset)))
                offset += batch.num_rows
        table = pa.Table.from_batches(kept, schema=kept[0].schema) if kept else pf.schema_arrow.empty_table()
    except Exception as exc:  # a corrupt page, a truncated file
        raise _unreadable(uri, field, exc) from None
    return _frame(table, uri, field)


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
            spread evenly over that column's values (rare values keep all their rows); `sample_positions`
            chooses the rows from the file's row count (and the stratify column alone), then the file is
            streamed and only those rows are decoded and kept (`read_parquet_rows`), so memory follows
            max_samples, not the file. None: the whole file is read.
        seed: sample seed.
        stratify_by: metadata column to stratify the sample over.

    Raises:
        InputError: missing file, missing input column, a row that is not numeric or is ragged nested lists, or
            rows whose shape does not fit the spec (names the column, the first rows, the expected and found
            shapes).
    """
    if max_samples is None:
        df = read_parquet(uri, field=f"{field}.uri")
        _require_inputs(list(df.columns), input_specs, uri, field)
        source_rows = np.arange(len(df), dtype=np.int64)
    else:
        pf = _open_parquet(uri, f"{field}.uri")
        _require_inputs(_pandas_columns(pf.schema_arrow), input_specs, uri, field)
        n = pf.metadata.num_rows
        if n <= max_samples:  # every row: the whole-file read
            df = read_parquet(uri, field=f"{field}.uri")
            source_rows = np.arange(len(df), dtype=np.int64)
        else:
            strata = _strata(pf, stratify_by, uri, field) if stratify_by is not None else None
            source_rows = sample_positions(n, max_samples, seed, strata)
            df = read_parquet_rows(uri, source_rows, field=f"{field}.uri", parquet_file=pf)
    df = df.reset_index(drop=True)
    inputs = {s.name: _input_rows(df[s.name].tolist(), s, uri, field, source_rows) for s in input_specs}
    lengths = _lengths(inputs, input_specs)
    frame = df.drop(columns=[s.name for s in input_specs])
    return Dataset(inputs, frame, lengths, uri, source_rows)


def _require_inputs(columns: list[str], input_specs: Sequence, uri: str, field: str) -> None:
    missing = [s.name for s in input_specs if s.name not in columns]
    if missing:
        raise InputError(f"{field}: {uri} has no column(s) {missing} for model inputs; columns: {columns}",
                         hint="each model input needs a column of the same name")


def _strata(pf: Any, column: str, uri: str, field: str) -> pd.Series:
    """The stratify column alone, for every row of the file (one column read, not the inputs)."""
    import pyarrow as pa

    if column not in _pandas_columns(pf.schema_arrow):
        raise InputError(f"{field}.stratify_by: no column {column!r} in the data")
    try:  # iter_batches: ParquetFile.read holds far more than the column (74 MiB for a 0.2 MiB column, measured)
        batches = list(pf.iter_batches(batch_size=1 << 16, columns=[column], use_pandas_metadata=True))
        table = pa.Table.from_batches(batches, schema=batches[0].schema) if batches else \
            pf.schema_arrow.empty_table().select([column])
    except Exception as exc:
        raise _unreadable(uri, f"{field}.uri", exc) from None
    return _frame(table, uri, f"{field}.uri")[column].reset_index(drop=True)


def _input_rows(cells: list[Any], s: Any, uri: str, field: str, file_rows: np.ndarray) -> list[np.ndarray]:
    """Each cell as an array of the input's dtype; errors name rows by their position in the file."""
    dtype = NP_DTYPES[s.dtype]
    want = row_shape(s)
    rows: list[np.ndarray] = []
    bad: list[tuple[int, str]] = []
    for i, v in enumerate(cells):
        try:
            a = cell_array(v, dtype)
        except (TypeError, ValueError) as exc:
            raise InputError(f"{field}: column {s.name!r} in {uri}, row {int(file_rows[i])}: not convertible to "
                             f"a {s.dtype} array of shape {describe_row_shape(s)}: {exc}",
                             hint="store each row as (nested) numeric lists or a fixed-shape tensor") from None
        if a.size == 0 and a.ndim == 1 and want and want[0] is None and len(want) > 1:
            a = a.reshape((0, *(w or 0 for w in want[1:])))  # an empty sequence, e.g. of (80,) frames
        if want is not None and (a.ndim != len(want) or any(w is not None and w != d
                                                            for w, d in zip(want, a.shape))):
            bad.append((int(file_rows[i]), f"shape {tuple(a.shape)}"))  # as shape_problem words it
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


def sample_positions(n: int, k: int, seed: int, strata: pd.Series | None = None) -> np.ndarray:
    """Which k of n rows a seeded sample keeps.

    Without `strata`, a uniform sample without replacement (`numpy.random.default_rng(seed).choice`). With it,
    every stratum (value of the column; rows where it is missing belong to none) gets an equal share of k
    ("water-filling": strata smaller than the share keep all their rows and give their slack to the others, in
    order of size), then each stratum's rows are drawn uniformly, strata in sorted value order, from the same
    generator.

    Args:
        n: rows in the file.
        k: rows to keep (k < n).
        seed: sample seed.
        strata: (n,) the stratify column, or None.

    Returns:
        (k,) int64 increasing row positions (fewer than k only when missing strata values leave fewer rows).
    """
    rng = np.random.default_rng(seed)
    if strata is None:
        return np.sort(rng.choice(n, size=k, replace=False)).astype(np.int64)
    groups = {key: np.asarray(v) for key, v in strata.to_frame("s").groupby("s", sort=True).indices.items()}
    # Water-filling: every group gets an equal share; groups smaller than the share give their slack to others.
    quota = {key: 0 for key in groups}
    remaining, open_groups = k, sorted(groups, key=lambda key: len(groups[key]))
    while open_groups and remaining > 0:
        share = max(remaining // len(open_groups), 1)
        key = open_groups.pop(0)
        take = min(len(groups[key]) - quota[key], share)
        quota[key] += take
        remaining -= take
    parts = [rng.choice(groups[key], size=q, replace=False) for key, q in quota.items() if q > 0]
    return np.sort(np.concatenate(parts)).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)


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

    Raises:
        InputError: padding would make a feed larger than PAD_FLOOR_BYTES and more than PAD_MAX_FACTOR times the
            values of its rows (one row far longer than its batch); names the column, the row (its position in
            the file) and its shape.
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
        _check_padding(ds, idx, s.name, rows, target, np.dtype(dtype).itemsize)
        out = np.full((len(rows), *target), pad_values.get(s.name, 0), dtype=dtype)
        for j, r in enumerate(rows):
            cut = tuple(slice(0, min(n, t)) for n, t in zip(r.shape, target))
            out[(j, *cut)] = r[cut]
        feeds[s.name] = out
    return feeds


def _check_padding(ds: Dataset, idx: np.ndarray, name: str, rows: list[np.ndarray], target: list[int],
                   itemsize: int) -> None:
    """Refuse a padded feed past both PAD_FLOOR_BYTES and PAD_MAX_FACTOR x its rows' own values (`make_batch`)."""
    padded = len(rows) * int(np.prod(target, dtype=np.int64))
    if padded * itemsize <= PAD_FLOOR_BYTES:
        return
    own = [int(np.prod([min(n, t) for n, t in zip(r.shape, target)], dtype=np.int64)) for r in rows]
    if padded <= PAD_MAX_FACTOR * max(sum(own), 1):
        return
    j = int(np.argmax(own))
    raise InputError(f"column {name!r} in {ds.uri}, row {ds.file_row(int(idx[j]))}: its shape "
                     f"{tuple(rows[j].shape)} pads a batch of {len(rows)} rows to {tuple(target)} per row "
                     f"({padded * itemsize / 2**20:.0f} MiB, {padded / max(sum(own), 1):.0f}x the rows' own values; "
                     f"the bound is {PAD_MAX_FACTOR}x past {PAD_FLOOR_BYTES // 2**20} MiB)",
                     hint="drop, truncate or split that row (model inputs this long are outliers in the data), or "
                          "use smaller batches (benchmark.batch_sizes, the calibration batch size)")


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
