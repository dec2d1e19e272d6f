"""Spec checks that need the data files' column names (read from the Parquet schema, no rows).

`load_spec` validates the spec on its own; the column names a spec refers to (`slices[].column`,
`data.calibration.stratify_by`, `data.*.label_column`, `analysis.discovery.columns`) can only be checked against the
files. `check_columns` does that before a run starts, so a misspelled column is a spec error with its field path
(exit 2) instead of a failed data check or a failed task minutes later.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tailguard.core.errors import FieldError, SpecError
from tailguard.core.spec.root import Spec


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

    Checked: `slices.<i>.column` / `slices.<i>.header` and `analysis.discovery.columns` (but the names of derived
    slices, which validation computes) against the validation file;
    `data.calibration.stratify_by` against the calibration file; `data.<set>.label_column` against its file.
    Files that are remote (s3://) or missing are skipped here (the data check reports a missing file).

    Raises:
        SpecError: one FieldError per unknown column, naming the field, the file and the columns it has.
    """
    errors = column_errors(spec, parquet_columns(spec.data.validation.uri),
                           parquet_columns(spec.data.calibration.uri))
    if errors:
        raise SpecError(errors, source=source, hint="fix the column names (they are case-sensitive)")


def column_errors(spec: Spec, val: list[str] | None, cal: list[str] | None) -> list[FieldError]:
    """One FieldError per column the spec names (slices, discovery, stratify_by, label columns) that is not among
    the validation file's columns `val` / the calibration file's `cal` (None: that file is not checked)."""
    errors: list[FieldError] = []

    def need(cols: list[str] | None, column: str, field: str, uri: str) -> None:
        if cols is not None and column not in cols:
            errors.append(FieldError(field, f"no column {column!r} in {uri}; columns: {cols}", column))

    for i, s in enumerate(spec.slices):
        if s.data_column is not None:  # a derived slice reads no column
            need(val, s.data_column, f"slices.{i}.{'column' if s.column is not None else 'header'}",
                 spec.data.validation.uri)
    derived = {s.name for s in spec.slices if s.derive is not None}  # computed by validation: no column needed
    for j, c in enumerate(spec.analysis.discovery.columns or []):
        if c not in derived:
            need(val, c, f"analysis.discovery.columns.{j}", spec.data.validation.uri)
    if spec.data.calibration.stratify_by:
        need(cal, spec.data.calibration.stratify_by, "data.calibration.stratify_by", spec.data.calibration.uri)
    for name, ds, cols in (("validation", spec.data.validation, val), ("calibration", spec.data.calibration, cal)):
        if ds.label_column:
            need(cols, ds.label_column, f"data.{name}.label_column", ds.uri)
    return errors


# ------------------------------------------------------------------------------- spec check --data
_SHOWN_ROWS = 5  # offending rows named per input column


@dataclass
class DataCheck:
    """What `check_spec_file` looked at in the data files: {"validation"/"calibration": rows read} for local files
    it read, and the URIs it could not check here (remote)."""

    rows: dict[str, int] = field(default_factory=dict)
    remote: list[str] = field(default_factory=list)
    model: str = ""  # what model.outputs were checked against, or why they were not (`model_output_errors`)


def _input_errors(df: Any, spec: Spec, name: str, uri: str) -> list[FieldError]:
    """Input columns of one data file against model.inputs: each present, each row a numeric array of the input's
    rank and fixed sizes (tailguard.core.data's `cell_array` / `shape_problem`, as the data check and loading use)."""
    import numpy as np

    from tailguard.core.data import cell_array, describe_row_shape, row_shape, shape_problem, shape_text

    errors: list[FieldError] = []
    for i, s in enumerate(spec.model.inputs):
        if s.name not in df.columns:
            errors.append(FieldError(f"model.inputs.{i}.name", f"no column {s.name!r} in {uri} (data.{name}.uri); "
                                     f"columns: {list(df.columns)}", s.name))
            continue
        found: dict[str, list[int]] = {}
        want = row_shape(s)
        for r, v in enumerate(df[s.name].tolist()):
            if v is None:
                problem: str | None = "null"
            else:
                try:
                    arr = cell_array(v, np.float64)
                    problem = shape_problem(arr, s)
                    if problem and arr.size == 0 and arr.ndim == 1 and want and want[0] is None:
                        problem = None  # an empty sequence fits a variable first axis
                except ValueError as exc:
                    problem = "ragged nested lists" if "ragged" in str(exc) else "not numeric"
                except TypeError:
                    problem = "not numeric"
            if problem:
                found.setdefault(problem, []).append(r)
        if found:
            n_bad = sum(len(rows) for rows in found.values())
            shown = "; ".join(f"{p} in row(s) {rows[:_SHOWN_ROWS]}" + (f" and {len(rows) - _SHOWN_ROWS} more"
                                                                       if len(rows) > _SHOWN_ROWS else "")
                              for p, rows in list(found.items())[:_SHOWN_ROWS])
            errors.append(FieldError(f"model.inputs.{i}.shape", f"column {s.name!r} in {uri} (data.{name}.uri): "
                                     f"{n_bad} of {len(df)} rows are not numeric arrays of the per-row shape "
                                     f"{describe_row_shape(s)} (shape {shape_text(s.shape)}; named axes may have "
                                     f"any length): found {shown}", s.name))
    return errors


def data_errors(spec: Spec) -> tuple[list[FieldError], DataCheck]:
    """Check a spec against its local data files: every error at once.

    Checked per local file (remote s3:// files are listed in DataCheck.remote, not read): that it exists and is a
    readable Parquet file (`data.<set>.uri`); that every model input has a column whose rows are numeric arrays of
    the input's rank and fixed sizes (`model.inputs.<i>.name` / `.shape`); and every column the spec names
    (`column_errors`).

    Args:
        spec: a Spec with data URIs already resolved (absolute or remote).

    Returns:
        (the FieldErrors, what was checked).
    """
    from tailguard.core.data import read_parquet
    from tailguard.core.errors import InputError

    errors: list[FieldError] = []
    check = DataCheck()
    columns: dict[str, list[str] | None] = {}
    for name, ds in (("validation", spec.data.validation), ("calibration", spec.data.calibration)):
        columns[name] = None
        if "://" in ds.uri:
            check.remote.append(ds.uri)
            continue
        if not Path(ds.uri).is_file():
            errors.append(FieldError(f"data.{name}.uri", f"file not found: {ds.uri} (relative paths are resolved "
                                     "against the spec file's folder)", ds.uri))
            continue
        try:
            df = read_parquet(ds.uri, field=f"data.{name}.uri")
        except InputError as err:
            errors.append(FieldError(f"data.{name}.uri", err.message.removeprefix(f"data.{name}.uri: "), ds.uri))
            continue
        columns[name] = list(df.columns)
        check.rows[name] = len(df)
        errors.extend(_input_errors(df, spec, name, ds.uri))
    errors.extend(column_errors(spec, columns["validation"], columns["calibration"]))
    return errors, check


def _local_store_exists(uri: str) -> bool:
    """Whether `uri` is an MLflow store on this machine's disk that already exists (opening a missing one would
    create it)."""
    from tailguard.core.tracking import is_local_store

    if not is_local_store(uri):
        return False
    path = uri.removeprefix("sqlite:///") if uri.startswith("sqlite:") else uri.removeprefix("file://")
    path = path.removeprefix("file:")
    return Path(path).exists()


def model_output_errors(spec: Spec) -> tuple[list[FieldError], str]:
    """`model.outputs` against the output signature recorded on the model version the spec names, where the
    registry is reachable from here: a local MLflow store (sqlite: / file:) that exists. `tailguard register`
    records the signature (version tag `tailguard.core.contract.OUTPUTS_TAG`) for ONNX files and torch.export
    programs; a state dict has none (its outputs are known only by running it: the export step checks them).

    A remote registry, a local one not created yet or a version without a recorded signature only give the note;
    a local registry that exists but lacks the model, the version or the alias the spec names is an error at
    `model.registered_name` / `model.version` naming the store (the run would stop at its first step).

    Returns:
        (one FieldError per mismatch, as `components.export.signature.output_signature_errors` words them, or the
        one naming a model/version/alias the existing local registry lacks; a one-line note of what was compared,
        or why nothing was).
    """
    import json

    from tailguard.components.export.signature import OutputSig, output_signature_errors
    from tailguard.core.contract import OUTPUTS_TAG
    from tailguard.core.errors import InputError
    from tailguard.core.tracking import is_local_store, tracking_uri_for

    uri = spec.mlflow.registry_uri or tracking_uri_for(spec)
    later = "the run's export step compares them with the model"
    if not is_local_store(uri):
        return [], f"model.outputs: the registry {uri} is remote; {later}"
    if not _local_store_exists(uri):
        return [], f"model.outputs: no registry at {uri} yet; {later}"
    from tailguard.core.home import quiet_environment

    quiet_environment()
    from mlflow import MlflowClient

    from tailguard.core.reference import resolve_version

    name = spec.model.registered_name
    try:
        mv = resolve_version(MlflowClient(tracking_uri=uri, registry_uri=uri), name, str(spec.model.version))
    except InputError as err:  # the run would stop at its first step: an error here, with the store it looked in
        field, _, message = err.message.partition(": ")
        if field not in ("model.registered_name", "model.version"):
            field, message = "model.registered_name", err.message
        fix = (f"; {err.hint}" if err.hint else "") + f"; or register it: tailguard register {name} MODEL_FILE"
        return [FieldError(field, f"{message} (registry {uri}){fix}", getattr(spec.model, field.split('.')[1]))], \
            f"model: not found in the registry {uri}"
    where = f"{name} v{mv.version}"
    try:
        recorded = json.loads((mv.tags or {})[OUTPUTS_TAG])
        found = [OutputSig.from_dict(o) for o in recorded["outputs"]]
    except (KeyError, TypeError, ValueError):
        return [], (f"model.outputs: {where} records no output signature (a state dict, or registered without "
                    f"`tailguard register`); {later}")
    errors, fixes = output_signature_errors(spec.model.outputs, found, what=f"the model ({where})",
                                            positional=bool(recorded.get("positional")), model_task=spec.model.task)
    errors = [FieldError(e.loc, f"{e.message}; fix: {fix}", e.value) for e, fix in zip(errors, fixes)]
    return errors, f"model.outputs checked against {where} ({len(found)} output(s) recorded at registration)"


def unpassable_gate_warnings(spec: Spec, *, largest: int = 100_000) -> list[str]:
    """Per-slice and discovered gates on a 0/1 metric (`PROPORTION_METRICS`) decided on a Wilson lower bound that a
    group of `min_support` rows cannot pass even when every row agrees (n/n has a one-sided Wilson bound of
    n / (n + z^2), `core.stats.wilson_bound`): such a gate fails the FP32 reference against itself on every group
    between `min_support` rows and the smallest size that can pass.

    Returns:
        One warning per such gate, naming it (`gates.<i>`), the sizes that cannot pass and the two fixes.
    """
    from tailguard.core.spec.gates import PROPORTION_METRICS
    from tailguard.core.stats import wilson_bound

    out = []
    for i, g in enumerate(spec.gates):
        if (g.scope == "overall" or g.confidence is None or g.min is None or g.metric not in PROPORTION_METRICS
                or g.min <= 0):
            continue
        n = g.min_support
        if wilson_bound(n, n, g.confidence, "lower") >= g.min:
            continue
        lo, hi = n, largest  # the smallest n whose n/n bound reaches min (the bound grows with n)
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if wilson_bound(mid, mid, g.confidence, "lower") >= g.min else (mid + 1, hi)
        bound = float(wilson_bound(n, n, g.confidence, "lower"))
        sizes = f"{n}-{lo - 1} rows" if lo < largest else f"any size up to {largest} rows"
        out.append(f"gates.{i} ({g.metric} >= {g.min:g} at {g.confidence:g} confidence, min_support {n}): a group of "
                   f"{sizes} fails it even when every row agrees ({n}/{n} has a lower bound of {bound:.3f}); "
                   f"raise min_support to {lo} or lower min" if lo < largest else "lower min")
    return out


def check_spec_file(path: str | Path, *, data: bool = True) -> tuple[Spec, DataCheck | None]:
    """`tailguard spec check`: validate a spec file and, with `data`, its local data files; every error at once.

    The spec's field errors, the cross-field errors they would hide (tailguard.core.spec.validate_spec) and, when the
    rest of the spec is usable, the data files' errors (`data_errors`) and, with `data`, model.outputs against the
    registered model's recorded output signature (`model_output_errors`) are reported in one SpecError.

    Args:
        path: the spec YAML.
        data: also check the data files (local paths only; remote ones are listed, not read) and the model's
            outputs where its registry is a local store.

    Returns:
        (the Spec with data URIs resolved, the DataCheck or None without `data`).

    Raises:
        SpecError: every problem, each with its field path (exit 2).
    """
    from tailguard.core.spec import read_spec_document, resolve_data_uris, spec_error, validate_spec

    doc = read_spec_document(path)
    spec, errors = validate_spec(doc)
    check = None
    if spec is not None:
        resolve_data_uris(spec, path)
        if data:
            found, check = data_errors(spec)
            outputs, check.model = model_output_errors(spec)
            errors = errors + found + outputs
    if errors or spec is None:
        raise spec_error(errors or [FieldError("", "not a valid spec")], doc, source=str(path))
    return spec, check
