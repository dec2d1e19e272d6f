"""Datasets: Parquet files with one row per sample, a column per model input (array-valued,
variable length allowed), plus label and metadata columns used for slicing.

Batches are padded per batch (to the longest row in the batch, or to a fixed length where a
calibration method needs one). Length-sorted batching runs ~3x faster than random order on
transformer models; outputs are always returned in the original row order.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import pandas as pd

from tailguard.errors import InputError

NP_DTYPES = {"int64": np.int64, "int32": np.int32, "float32": np.float32, "float16": np.float16, "bool": np.bool_}


@dataclass
class Dataset:
    """Rows of model inputs plus a frame of the other columns.

    Attributes:
        inputs: {input name: list of n_rows arrays}; each array has the input's shape without the batch axis
            (e.g. (sequence,) int64 for token ids), lengths may differ between rows.
        frame: pandas DataFrame (n_rows rows) of every non-input column (labels, metadata).
        lengths: (n_rows,) int64, the length of each row's first input along its first axis (1 for scalars).
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

    Raises:
        InputError: missing or unreadable file, naming the uri and the spec field.
    """
    if "://" not in uri and not Path(uri).is_file():
        raise InputError(f"{field}: file not found: {uri}", hint="fix the path in the spec (relative paths are "
                                                                 "resolved against the spec file's folder)")
    try:
        return pd.read_parquet(uri)
    except Exception as exc:  # pyarrow raises several unrelated types for a corrupt file
        raise InputError(f"{field}: cannot read Parquet file {uri}: {exc}",
                         hint="the file must be a Parquet table with one row per sample") from None


def load_dataset(uri: str, input_specs: Sequence, *, field: str = "data", max_samples: int | None = None,
                 seed: int = 0, stratify_by: str | None = None) -> Dataset:
    """Load a Parquet dataset and split model-input columns from metadata columns.

    Args:
        uri: Parquet file.
        input_specs: the spec's `model.inputs` (objects with .name and .dtype).
        field: spec field path used in error messages (e.g. "data.validation").
        max_samples: keep at most this many rows: a seeded uniform sample, or, with `stratify_by`, a sample
            spread evenly over that column's values (rare values keep all their rows).
        seed: sample seed.
        stratify_by: metadata column to stratify the sample over.

    Raises:
        InputError: missing file, missing input column, or a row that is not numeric.
    """
    df = read_parquet(uri, field=f"{field}.uri")
    missing = [s.name for s in input_specs if s.name not in df.columns]
    if missing:
        raise InputError(f"{field}: {uri} has no column(s) {missing} for model inputs; columns: {list(df.columns)}",
                         hint="each model input needs a column of the same name")
    if max_samples is not None and len(df) > max_samples:
        df = _sample(df, max_samples, seed, stratify_by, field)
    df = df.reset_index(drop=True)
    inputs: dict[str, list[np.ndarray]] = {}
    for s in input_specs:
        dtype = NP_DTYPES[s.dtype]
        try:
            inputs[s.name] = [np.asarray(v, dtype=dtype) for v in df[s.name].tolist()]
        except (TypeError, ValueError) as exc:
            raise InputError(f"{field}: column {s.name!r} in {uri} is not convertible to {s.dtype}: {exc}") from None
    first = inputs[input_specs[0].name]
    lengths = np.array([a.shape[0] if a.ndim else 1 for a in first], dtype=np.int64)
    frame = df.drop(columns=[s.name for s in input_specs])
    return Dataset(inputs, frame, lengths, uri)


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

    Args:
        ds: the dataset.
        idx: (batch,) row indices.
        input_specs: `model.inputs` (name, dtype).
        pad_values: pad value per input name (default 0).
        fixed_length: pad (or truncate) the first non-batch axis to this length instead of the batch maximum.

    Returns:
        {input name: array of shape (batch, *padded row shape)} with the input's dtype.
    """
    pad_values = pad_values or {}
    feeds: dict[str, np.ndarray] = {}
    for s in input_specs:
        rows = [ds.inputs[s.name][i] for i in idx]
        dtype = NP_DTYPES[s.dtype]
        if rows[0].ndim == 0:
            feeds[s.name] = np.asarray(rows, dtype=dtype)
            continue
        length = fixed_length or max(r.shape[0] for r in rows)
        out = np.full((len(rows), length, *rows[0].shape[1:]), pad_values.get(s.name, 0), dtype=dtype)
        for j, r in enumerate(rows):
            n = min(r.shape[0], length)
            out[j, :n] = r[:n]
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
