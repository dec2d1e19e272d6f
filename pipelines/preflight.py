"""Spec checks that need the data files' column names (read from the Parquet schema, no rows).

`load_spec` validates the spec on its own; the column names a spec refers to (`slices[].column`,
`data.calibration.stratify_by`, `data.*.label_column`, `analysis.discovery.columns`) can only be checked against the
files. `check_columns` does that before a run starts, so a misspelled column is a spec error with its field path
(exit 2) instead of a failed data check or a failed task minutes later.
"""

from __future__ import annotations

from pathlib import Path

from tailguard.errors import FieldError, SpecError
from tailguard.spec import Spec


def parquet_columns(uri: str) -> list[str] | None:
    """Column names of a local Parquet file from its schema (no rows read); None when the file is not local or
    cannot be read (the data check reports those with their own error)."""
    if "://" in uri or not Path(uri).is_file():
        return None
    try:
        import pyarrow.parquet as pq

        return list(pq.read_schema(uri).names)
    except Exception:  # noqa: BLE001 - a corrupt file is the data check's error to report, with its own message
        return None


def check_columns(spec: Spec, *, source: str = "spec") -> None:
    """Check that every column the spec names exists in the data files it names.

    Checked: `slices.<i>.column` and `analysis.discovery.columns` against the validation file;
    `data.calibration.stratify_by` against the calibration file; `data.<set>.label_column` against its file.
    Files that are remote (s3://) or missing are skipped here (the data check reports a missing file).

    Raises:
        SpecError: one FieldError per unknown column, naming the field, the file and the columns it has.
    """
    errors: list[FieldError] = []
    val = parquet_columns(spec.data.validation.uri)
    cal = parquet_columns(spec.data.calibration.uri)

    def need(cols: list[str] | None, column: str, field: str, uri: str) -> None:
        if cols is not None and column not in cols:
            errors.append(FieldError(field, f"no column {column!r} in {uri}; columns: {cols}", column))

    for i, s in enumerate(spec.slices):
        need(val, s.column, f"slices.{i}.column", spec.data.validation.uri)
    for j, c in enumerate(spec.analysis.discovery.columns or []):
        need(val, c, f"analysis.discovery.columns.{j}", spec.data.validation.uri)
    if spec.data.calibration.stratify_by:
        need(cal, spec.data.calibration.stratify_by, "data.calibration.stratify_by", spec.data.calibration.uri)
    for name, ds, cols in (("validation", spec.data.validation, val), ("calibration", spec.data.calibration, cal)):
        if ds.label_column:
            need(cols, ds.label_column, f"data.{name}.label_column", ds.uri)
    if errors:
        raise SpecError(errors, source=source, hint="fix the column names (they are case-sensitive)")
