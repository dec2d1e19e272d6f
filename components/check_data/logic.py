"""Data check: one Great Expectations (GX Core 1.x) suite per dataset, run on the calibration and validation
Parquet files before anything is built. Datasets without `data.expectations` run the built-in checks in pandas
with GX's semantics (`_evaluate_builtin`), so a spec without expectations never imports great_expectations.

Built-in expectations (per dataset, see components/check_data/README.md):
    - the table has at least `min_rows` rows;
    - every model input column exists and is non-null;
    - every element of every model input row is numeric and finite (no NaN/Inf): GX has no expectation over array
      cells, so a derived boolean column `__<input>_finite` (one value per row) must be all True;
    - every model input row has the rank and every fixed size of `model.inputs[].shape` after the batch axis
      (named axes any length), e.g. (1, 8, 8) for `[batch, 1, 8, 8]`: a derived column `__<input>_shape` holds
      "ok" or what the row has instead ("shape (1, 8, 7)", "ragged nested lists"), so a failure names the rows
      and the shapes found;
    - with `model.inputs[].value_range: [lo, hi]`: the per-row minimum and maximum (derived columns
      `__<input>_min` / `__<input>_max`) lie in [lo, hi] (e.g. token ids inside the vocabulary);
    - the label column (if declared) exists and is non-null;
    - validation only: every declared slice column (`slices[].column`) exists;
    - calibration only: the `stratify_by` column (if declared) exists.
Then every `data.expectations` entry whose `datasets` names the dataset, by snake_case type
(`expect_column_values_to_be_between` -> `gx.expectations.ExpectColumnValuesToBeBetween(**kwargs)`).
"""

from __future__ import annotations

import difflib
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np
import pandas as pd

from tailguard.core.data import cell_array, describe_row_shape, read_parquet, row_shape, shape_problem, shape_text
from tailguard.core.errors import DataCheckError, FieldError, SpecError
from tailguard.core.home import quiet_environment

if TYPE_CHECKING:
    from tailguard.core.spec.data import DatasetSpec
    from tailguard.core.spec.root import Spec

from tailguard.core.contract import DATA_CHECK_FILE

DATASETS = ("calibration", "validation")
_PARTIAL = 10  # unexpected values kept per expectation in the report
_INDEX_KEY = "tailguard_index"


# -------------------------------------------------------------------------------------------- report
@dataclass
class ExpectationResult:
    """One evaluated expectation.

    Attributes:
        type: snake_case expectation type, e.g. "expect_column_values_to_not_be_null".
        kwargs: the arguments given to GX (a derived column name where the check runs on one).
        success: True when the expectation held.
        column: the user-facing column it checks (the input column for derived checks), or None for table checks.
        origin: "builtin" or "spec" (from `data.expectations`, index in `spec_index`).
        description: what the expectation means, in words.
        observed: what GX saw: observed_value, element_count, unexpected_count, unexpected_percent (0-100),
            partial_unexpected_list (at most 10 values, JSON-safe), unexpected_rows (at most 10 0-based row
            positions), exception (message) — whichever apply.
        spec_index: index in `data.expectations` for origin "spec", else None.
    """

    type: str
    kwargs: dict[str, Any]
    success: bool
    column: str | None
    origin: str
    description: str
    observed: dict[str, Any] = field(default_factory=dict)
    spec_index: int | None = None

    def summary(self) -> str:
        """One line saying what was observed, e.g. '3 of 40 rows (7.5%) fail, rows [2, 9, 31], values [70.0]'."""
        o = self.observed
        if o.get("exception"):
            return f"could not be evaluated: {o['exception']}"
        if self.type == "expect_column_to_exist":
            return "column missing"
        if "unexpected_count" in o and o.get("element_count") is not None:
            pct = o.get("unexpected_percent")
            pct_s = f" ({pct:.3g}%)" if isinstance(pct, (int, float)) else ""
            rows = f", rows {o['unexpected_rows'][:5]}" if o.get("unexpected_rows") else ""
            values = f", values {o['partial_unexpected_list'][:3]}" if o.get("partial_unexpected_list") else ""
            return f"{o['unexpected_count']} of {o['element_count']} rows{pct_s} fail{rows}{values}"
        if "observed_value" in o:
            return f"observed {o['observed_value']}"
        return "failed"


@dataclass
class DatasetReport:
    """The suite result of one dataset.

    Attributes:
        name: "calibration" or "validation".
        uri: the Parquet file checked.
        n_rows: rows in the file (before any max_samples subsampling).
        success: every expectation held.
        results: one per expectation, built-ins first.
    """

    name: str
    uri: str
    n_rows: int
    success: bool
    results: list[ExpectationResult]


@dataclass
class CheckReport:
    """Result of the data check over every dataset (JSON: `to_dict` / `from_dict`, written as data_check.json).

    Attributes:
        success: every expectation of every dataset held.
        datasets: one report per dataset, calibration first.
        gx_version: great_expectations version used ("" when every dataset ran the built-in checks only,
            without GX).
    """

    success: bool
    datasets: list[DatasetReport]
    gx_version: str = ""

    def failures(self) -> list[dict[str, Any]]:
        """One dict per failed expectation: dataset, file, expectation, column, observed, message."""
        out = []
        for ds in self.datasets:
            for r in ds.results:
                if not r.success:
                    out.append({"dataset": ds.name, "file": ds.uri, "expectation": r.type, "column": r.column,
                                "observed": r.observed,
                                "message": f"{ds.name} ({ds.uri}): {r.description} [{r.type}]: {r.summary()}"})
        return out

    def to_dict(self) -> dict[str, Any]:
        """JSON-serializable form."""
        d = asdict(self)
        d["failures"] = self.failures()
        d["counts"] = {"evaluated": sum(len(ds.results) for ds in self.datasets), "failed": len(d["failures"])}
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "CheckReport":
        """Inverse of `to_dict` (derived keys `failures` and `counts` are ignored)."""
        datasets = [DatasetReport(name=x["name"], uri=x["uri"], n_rows=int(x["n_rows"]), success=bool(x["success"]),
                                  results=[ExpectationResult(**r) for r in x["results"]]) for x in d["datasets"]]
        return cls(success=bool(d["success"]), datasets=datasets, gx_version=d.get("gx_version", ""))


# ------------------------------------------------------------------------------------- expectation types
def expectation_classes() -> dict[str, type]:
    """{snake_case type: GX expectation class} of every expectation `great_expectations.expectations` exports."""
    import great_expectations as gx

    base = gx.expectations.Expectation
    out: dict[str, type] = {}
    for name in dir(gx.expectations):
        obj = getattr(gx.expectations, name)
        if isinstance(obj, type) and issubclass(obj, base) and obj is not base:
            etype = getattr(obj, "expectation_type", "")
            if isinstance(etype, str) and etype:
                out[etype] = obj
    return out


def build_spec_expectations(spec: "Spec") -> list[Any]:
    """Build the GX expectation objects of `data.expectations` (one per entry, in order).

    Raises:
        SpecError: every unknown type (with close matches) and every kwargs GX rejects, each with its field path
            (data.expectations.<i>.type / .kwargs).
    """
    classes = expectation_classes()
    errors: list[FieldError] = []
    built: list[Any] = []
    for i, exp in enumerate(spec.data.expectations):
        cls = classes.get(exp.type)
        if cls is None:
            close = difflib.get_close_matches(exp.type, list(classes), n=3, cutoff=0.6)
            errors.append(FieldError(f"data.expectations.{i}.type",
                                     f"unknown expectation type {exp.type!r}"
                                     + (f"; did you mean {close}?" if close else
                                        "; see https://greatexpectations.io/expectations/"), exp.type))
            continue
        try:
            built.append(cls(**exp.kwargs))
        except Exception as exc:  # GX validates with pydantic (v1 API) and raises ValidationError / ValueError
            msg = " ".join(str(exc).split())
            errors.append(FieldError(f"data.expectations.{i}.kwargs", f"invalid arguments for {exp.type}: {msg}",
                                     exp.kwargs))
    if errors:
        raise SpecError(errors, source="data.expectations",
                        hint="use a Great Expectations Core 1.x expectation type with its arguments")
    return built


# ---------------------------------------------------------------------------------------- derived columns
SHAPE_OK = "ok"  # value of a derived `__<input>_shape` cell whose row fits the spec shape


def _row_stats(value: Any, spec_in: Any = None) -> tuple[bool | None, float | None, float | None, str | None]:
    """(finite, min, max, shape status) of one cell; all None for a null cell. The status is SHAPE_OK or what the
    row has (e.g. "shape (1, 8, 7)") against `spec_in`'s shape. Each problem fails one check only: ragged nested
    lists give (None, None, None, "ragged nested lists"), a non-numeric cell (False, None, None, None)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None, None, None, None
    try:  # Parquet list<list<...>> cells come back as arrays of arrays; tensor cells as ndarrays
        arr = cell_array(value, np.float64)
    except ValueError as exc:
        if "ragged" in str(exc):
            return None, None, None, "ragged nested lists"
        return False, None, None, None
    except TypeError:
        return False, None, None, None
    problem = shape_problem(arr, spec_in) if spec_in is not None else None
    if arr.size == 0 and problem and arr.ndim == 1:  # an empty list: any rank fits no elements
        want = row_shape(spec_in) or ()
        problem = None if want and want[0] is None else problem
    status = problem or SHAPE_OK
    finite = bool(np.isfinite(arr).all())
    if arr.size == 0 or not finite:
        return finite, None, None, status
    return finite, float(arr.min()), float(arr.max()), status


def finite_column(name: str) -> str:
    """Name of the derived per-row 'every element finite' column of input `name`."""
    return f"__{name}_finite"


def shape_column(name: str) -> str:
    """Name of the derived per-row shape status column of input `name` (SHAPE_OK or the shape found)."""
    return f"__{name}_shape"


def add_derived_columns(df: pd.DataFrame, inputs: list[Any]) -> pd.DataFrame:
    """Copy of `df` with, per model input column present: `__<name>_finite` (bool, None for null cells),
    `__<name>_shape` (str: SHAPE_OK or what the row has, None for null cells) and, with a value_range,
    `__<name>_min` / `__<name>_max` (float64, NaN for null/empty/non-finite cells)."""
    out = df.copy()
    for spec_in in inputs:
        if spec_in.name not in df.columns:
            continue
        stats = [_row_stats(v, spec_in) for v in df[spec_in.name].tolist()]
        out[finite_column(spec_in.name)] = pd.Series([s[0] for s in stats], index=df.index, dtype=object)
        out[shape_column(spec_in.name)] = pd.Series([s[3] for s in stats], index=df.index, dtype=object)
        if spec_in.value_range is not None:
            out[f"__{spec_in.name}_min"] = pd.Series([s[1] for s in stats], index=df.index, dtype="float64")
            out[f"__{spec_in.name}_max"] = pd.Series([s[2] for s in stats], index=df.index, dtype="float64")
    return out


# ------------------------------------------------------------------------------------------ suite building
@dataclass
class _Planned:
    expectation: Any  # the GX object; None for a built-in evaluated without GX (`_evaluate_builtin`)
    column: str | None
    origin: str
    description: str
    spec_index: int | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    etype: str = ""


# The expectation types the built-in checks use, with their GX class names. They are evaluated by
# `_evaluate_builtin` (pandas, the same results GX reports) unless the dataset also has `data.expectations`.
_ROW_COUNT, _EXISTS, _NOT_NULL = ("expect_table_row_count_to_be_between", "expect_column_to_exist",
                                  "expect_column_values_to_not_be_null")
_IN_SET, _BETWEEN = "expect_column_values_to_be_in_set", "expect_column_values_to_be_between"
BUILTIN_GX_CLASSES = {_ROW_COUNT: "ExpectTableRowCountToBeBetween", _EXISTS: "ExpectColumnToExist",
                      _NOT_NULL: "ExpectColumnValuesToNotBeNull", _IN_SET: "ExpectColumnValuesToBeInSet",
                      _BETWEEN: "ExpectColumnValuesToBeBetween"}


def _builtin_plan(spec: "Spec", name: str, ds: "DatasetSpec", columns: set[str]) -> list[_Planned]:
    """The built-in expectations of one dataset, as (type, kwargs) without GX objects (`_with_gx` adds them)."""
    plan: list[_Planned] = []

    def add(etype: str, shown: str | None, description: str, /, **kwargs: Any) -> None:
        plan.append(_Planned(None, shown, "builtin", description, kwargs=kwargs, etype=etype))

    add(_ROW_COUNT, None, f"at least data.{name}.min_rows = {ds.min_rows} rows",
        min_value=ds.min_rows)
    for s in spec.model.inputs:
        add(_EXISTS, s.name, f"model input column {s.name!r} exists", column=s.name)
        if s.name not in columns:
            continue
        add(_NOT_NULL, s.name, f"model input {s.name!r} has no null rows", column=s.name)
        add(_IN_SET, s.name,
            f"every element of model input {s.name!r} is numeric and finite (no NaN/Inf; derived column)",
            column=finite_column(s.name), value_set=[True])
        add(_IN_SET, s.name,
            f"every row of model input {s.name!r} has shape {describe_row_shape(s)} after the batch axis "
            f"(model.inputs shape {shape_text(s.shape)}; named axes any length; derived column)",
            column=shape_column(s.name), value_set=[SHAPE_OK])
        if s.value_range is not None:
            lo, hi = s.value_range
            for side in ("min", "max"):
                add(_BETWEEN, s.name,
                    f"per-row {side}imum of model input {s.name!r} within model.inputs value_range [{lo:g}, {hi:g}]",
                    column=f"__{s.name}_{side}", min_value=lo, max_value=hi)
    if ds.label_column:
        col = ds.label_column
        add(_EXISTS, col, f"label column data.{name}.label_column = {col!r} exists", column=col)
        if col in columns:
            add(_NOT_NULL, col, f"label column {col!r} has no null rows", column=col)
    if name == "validation":
        for sl in spec.slices:
            if sl.data_column is not None:  # a derived slice is computed from the inputs: no column
                add(_EXISTS, sl.data_column, f"column {sl.data_column!r} of slice {sl.name!r} exists",
                    column=sl.data_column)
    stratify = getattr(ds, "stratify_by", None)
    if stratify:
        add(_EXISTS, stratify, f"data.{name}.stratify_by column {stratify!r} exists", column=stratify)
    return plan


def _with_gx(plan: list[_Planned]) -> list[_Planned]:
    """Give every built-in of `plan` its GX expectation object (for a suite that GX runs)."""
    import great_expectations as gx

    for p in plan:
        if p.expectation is None:
            p.expectation = getattr(gx.expectations, BUILTIN_GX_CLASSES[p.etype])(**p.kwargs)
    return plan


def _spec_plan(spec: "Spec", name: str, built: list[Any]) -> list[_Planned]:
    plan = []
    for i, (exp, obj) in enumerate(zip(spec.data.expectations, built)):
        if name in exp.datasets:
            # a fresh object per suite: GX expectations carry suite-specific state (id, meta)
            plan.append(_Planned(type(obj)(**exp.kwargs), exp.kwargs.get("column"), "spec",
                                 f"data.expectations.{i} ({exp.type} {exp.kwargs})", spec_index=i,
                                 kwargs=dict(exp.kwargs), etype=exp.type))
    return plan


def uses_gx(spec: "Spec", name: str) -> bool:
    """Whether dataset `name`'s suite needs Great Expectations: some `data.expectations` entry names it. The
    built-in checks alone run in pandas (`_evaluate_builtin`), so a spec without expectations never imports GX
    (5-6 s of a task's start-up)."""
    return any(name in exp.datasets for exp in spec.data.expectations)


def _evaluate_builtin(p: _Planned, df: pd.DataFrame) -> tuple[bool, dict[str, Any]]:
    """Evaluate one built-in expectation on `df` (with its derived columns) as GX Core 1.x does with its default
    result format: (success, observed) with the keys `_observed` keeps from a GX result.

    Semantics (GX's): row count: min_value <= rows <= max_value, observed_value = rows; column_to_exist: the
    column is present; not_be_null: unexpected = null cells, unexpected_percent over all rows; in_set / between
    (inclusive bounds): null cells are skipped (missing_count) and unexpected_percent is over the non-null rows
    (None when there are none). partial_unexpected_list / unexpected_rows: the first 10 in row order (rows are
    index labels: positions for a file read from Parquet).
    """
    kw = p.kwargs
    if p.etype == _ROW_COUNT:
        n, lo, hi = len(df), kw.get("min_value"), kw.get("max_value")
        return (lo is None or n >= lo) and (hi is None or n <= hi), {"observed_value": n}
    col = kw["column"]
    if p.etype == _EXISTS:
        return col in df.columns, {}
    if col not in df.columns:
        return False, {"exception": f"column {col!r} not found"}
    values = df[col]
    null = values.isna().to_numpy(dtype=bool)
    if p.etype == _NOT_NULL:
        bad, denom, extra = null, len(values), {}
    else:
        present = values[~null]
        if p.etype == _IN_SET:
            ok = present.isin(list(kw["value_set"])).to_numpy(dtype=bool)
        elif p.etype == _BETWEEN:
            v = present.to_numpy(dtype=np.float64)
            lo, hi = kw.get("min_value"), kw.get("max_value")
            ok = np.ones(len(v), dtype=bool)
            if lo is not None:
                ok &= v >= lo
            if hi is not None:
                ok &= v <= hi
        else:  # pragma: no cover - BUILTIN_GX_CLASSES lists every type _builtin_plan uses
            raise ValueError(f"no built-in evaluation for {p.etype}")
        bad = np.zeros(len(values), dtype=bool)
        bad[np.flatnonzero(~null)[~ok]] = True
        denom, extra = int((~null).sum()), {"missing_count": int(null.sum())}
    count = int(bad.sum())
    observed: dict[str, Any] = {"element_count": int(len(values)), "unexpected_count": count,
                                "unexpected_percent": (count / denom * 100.0) if denom else None, **extra,
                                "partial_unexpected_list": _jsonable(values[bad].iloc[:_PARTIAL].tolist())}
    if count:
        observed["unexpected_rows"] = _jsonable(values.index[bad][:_PARTIAL].tolist())
    return count == 0, observed


def _check_native(spec: "Spec", name: str) -> DatasetReport:
    """The built-in suite of dataset `name` without Great Expectations (`_evaluate_builtin`)."""
    ds: DatasetSpec = getattr(spec.data, name)
    df = read_parquet(ds.uri, field=f"data.{name}.uri")
    derived = add_derived_columns(df, spec.model.inputs)
    results = []
    for p in _builtin_plan(spec, name, ds, set(df.columns)):
        success, observed = _evaluate_builtin(p, derived)
        results.append(ExpectationResult(p.etype, _jsonable(p.kwargs), bool(success), p.column, p.origin,
                                         p.description, observed, p.spec_index))
    return DatasetReport(name=name, uri=ds.uri, n_rows=int(len(df)), success=all(r.success for r in results),
                         results=results)


# ---------------------------------------------------------------------------------------------- running
def _jsonable(v: Any, depth: int = 0) -> Any:
    if isinstance(v, (str, bool, int)) or v is None:
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else str(v)
    if isinstance(v, np.generic):
        return _jsonable(v.item(), depth)
    if isinstance(v, np.ndarray):
        items = v.ravel()[:_PARTIAL].tolist()
        return [_jsonable(x, depth + 1) for x in items] + (["..."] if v.size > _PARTIAL else [])
    if isinstance(v, Mapping) and depth < 4:
        return {str(k): _jsonable(x, depth + 1) for k, x in v.items()}
    if isinstance(v, (list, tuple)) and depth < 4:
        return [_jsonable(x, depth + 1) for x in list(v)[:_PARTIAL]]
    return str(v)


def _exception_message(info: Any) -> str | None:
    if not isinstance(info, Mapping):
        return None
    if "raised_exception" in info:
        return str(info.get("exception_message")) if info.get("raised_exception") is True else None
    for sub in info.values():  # keyed by metric configuration id
        msg = _exception_message(sub)
        if msg:
            return msg
    return None


def _observed(result: Any) -> dict[str, Any]:
    r = dict(result.result or {})
    keep = ("observed_value", "element_count", "unexpected_count", "unexpected_percent", "missing_count")
    obs = {k: _jsonable(r[k]) for k in keep if k in r}
    if "partial_unexpected_list" in r:
        obs["partial_unexpected_list"] = _jsonable(list(r["partial_unexpected_list"])[:_PARTIAL])
    if r.get("partial_unexpected_index_list"):  # row positions in the file (0-based)
        obs["unexpected_rows"] = _jsonable(list(r["partial_unexpected_index_list"])[:_PARTIAL])
    msg = _exception_message(result.exception_info)
    if msg:
        obs["exception"] = msg.strip().splitlines()[-1][:500] if msg.strip() else msg
    return obs


def _new_context() -> Any:
    import great_expectations as gx
    from great_expectations.data_context.types.base import ProgressBarsConfig

    ctx = gx.get_context(mode="ephemeral")
    ctx.variables.progress_bars = ProgressBarsConfig(globally=False)
    return ctx


def _check_one(ctx: Any, spec: "Spec", name: str, built: list[Any]) -> DatasetReport:
    import great_expectations as gx

    ds: DatasetSpec = getattr(spec.data, name)
    df = read_parquet(ds.uri, field=f"data.{name}.uri")
    plan = _with_gx(_builtin_plan(spec, name, ds, set(df.columns))) + _spec_plan(spec, name, built)
    suite = gx.ExpectationSuite(name=f"tailguard-{spec.metadata.name}-{name}")
    for i, p in enumerate(plan):
        p.expectation.meta = {**(p.expectation.meta or {}), _INDEX_KEY: i}
        suite.add_expectation(p.expectation)
    source = ctx.data_sources.add_pandas(f"tailguard-{name}")
    batch_def = source.add_dataframe_asset(name).add_batch_definition_whole_dataframe("whole")
    batch = batch_def.get_batch(batch_parameters={"dataframe": add_derived_columns(df, spec.model.inputs)})
    validation = batch.validate(suite)
    by_index = {int((r.expectation_config.meta or {}).get(_INDEX_KEY, -1)): r for r in validation.results}
    results = []
    for i, p in enumerate(plan):
        r = by_index.get(i)
        etype = type(p.expectation).expectation_type
        if r is None:  # GX dropped it: report as failed rather than silently passing
            results.append(ExpectationResult(etype, _jsonable(p.kwargs), False, p.column, p.origin, p.description,
                                             {"exception": "no result returned by Great Expectations"},
                                             p.spec_index))
            continue
        results.append(ExpectationResult(etype, _jsonable(p.kwargs), bool(r.success), p.column, p.origin,
                                         p.description, _observed(r), p.spec_index))
    return DatasetReport(name=name, uri=ds.uri, n_rows=int(len(df)), success=all(r.success for r in results),
                         results=results)


def check_datasets(spec: "Spec", *, raise_on_failure: bool = True) -> CheckReport:
    """Run the built-in and declared expectations on `data.calibration` and `data.validation`.

    The files are checked whole (before `max_samples` subsampling). A dataset that some `data.expectations`
    entry names runs as one GX suite (one ephemeral GX context, one pandas data source and dataframe asset per
    dataset); a dataset with the built-in checks only is evaluated in pandas with GX's semantics
    (`_evaluate_builtin`), without importing great_expectations (`report.gx_version` is "" when no suite ran).

    Args:
        spec: the spec (model.inputs, data, slices).
        raise_on_failure: raise DataCheckError when an expectation fails (default); False returns the report.

    Returns:
        The CheckReport (success True when every expectation held).

    Raises:
        SpecError: an unknown expectation type or bad kwargs in data.expectations (checked before reading data).
        InputError: a data file is missing or unreadable (names data.<dataset>.uri).
        DataCheckError: an expectation failed; `failures` lists dataset, file, expectation, column, observed;
            the message has one line per failure; the report is attached as `err.report`.
    """
    quiet_environment()
    gx_version = ""
    if spec.data.expectations:  # GX validates the declared expectations before any data is read
        import great_expectations as gx

        gx_version = str(getattr(gx, "__version__", ""))
    built = build_spec_expectations(spec) if spec.data.expectations else []
    ctx = _new_context() if any(uses_gx(spec, name) for name in DATASETS) else None
    datasets = [_check_one(ctx, spec, name, built) if uses_gx(spec, name) else _check_native(spec, name)
                for name in DATASETS]
    report = CheckReport(success=all(d.success for d in datasets), datasets=datasets,
                         gx_version=gx_version if ctx is not None else "")
    if not report.success and raise_on_failure:
        failures = report.failures()
        lines = "\n".join(f"  - {f['message']}" for f in failures)
        err = DataCheckError(f"data check failed: {len(failures)} expectation(s)\n{lines}", failures,
                             hint="fix the data files, or the expectations in data.expectations / model.inputs")
        err.report = report  # type: ignore[attr-defined]
        raise err
    return report


def write_report(report: CheckReport, out_dir: Path) -> Path:
    """Write `out_dir/data_check.json` (the report's `to_dict`). GX HTML data docs are not written: an
    ephemeral context has no docs site, and the JSON holds every result.

    Returns:
        The path of data_check.json.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / DATA_CHECK_FILE
    path.write_text(json.dumps(report.to_dict(), indent=2, default=str))
    return path
