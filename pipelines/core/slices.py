"""Slice groups: the validation rows split by a metadata column's value, bins or quantiles.

A declared slice (`spec.slices[i]`, a `SliceSpec`) becomes a list of `SliceGroup`s, each a boolean row mask
over the validation frame with its support (rows). `per_slice_table` then aggregates per-row parity values
(`parity.per_sample_metrics`) per group.

Grouping rules (the contract of the labels that end up in `slice.<slice>.<value>.<metric>`):

- by value (no `values`/`bins`/`quantiles`): one group per distinct value, labelled `str(value)` (integral
  floats print without ".0"; missing values form the group "null"); ordered by value.
- `values`: only those values, in the spec's order, even when a value has no rows (support 0, so a gate
  reports it as insufficient data). Rows with other values belong to no group of this slice.
- `bins` [e0, ..., en]: left-closed groups [e_i, e_i+1) labelled like "[16,32)". Rows below e0 or at/above en
  go to "(-inf,e0)" / "[en,inf)", created only when they have rows; missing values to "null".
- `quantiles` q: equal-frequency bins with edges at the column's k/q quantiles (numpy "linear"), labelled with
  their edges "[a,b)" (the last one closed, "[a,b]"); equal edges (heavily tied data) merge, so there may be
  fewer than q groups.
- `max_groups` m: when a slice has more than m groups, the m-1 largest (by support, ties by order) are kept
  and every other row goes to the group "other"; a slice never has more than m groups.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
import pandas as pd

from tailguard.core.errors import InputError
from tailguard.core.spec.data import SliceSpec

from .parity import aggregate, metric_names

OTHER = "other"
NULL = "null"


@dataclass
class SliceGroup:
    """One group of one declared slice.

    Attributes:
        slice: the slice's name (spec `slices[i].name`).
        value: the group's label (a value, "[a,b)" bin, "other" or "null").
        mask: bool array of shape (rows,) over the validation rows.
        support: number of rows in the group (mask.sum()).
    """

    slice: str
    value: str
    mask: np.ndarray
    support: int


def _fmt(x: float) -> str:
    if isinstance(x, float) and math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return f"{x:.6g}"


def value_label(v: object) -> str:
    """Label of one slice value: integral floats without ".0", NaN/None as "null", else str(v)."""
    if v is None:
        return NULL
    if isinstance(v, (float, np.floating)):
        if math.isnan(v):
            return NULL
        if float(v).is_integer():
            return str(int(v))
    if isinstance(v, (np.integer, np.bool_)):
        return str(v.item())
    return str(v)


def _by_value(col: pd.Series, spec: SliceSpec) -> list[tuple[str, np.ndarray]]:
    labels = np.array([value_label(v) for v in col.tolist()], dtype=object)
    if spec.values is not None:
        wanted = list(dict.fromkeys(value_label(v) for v in spec.values))
        return [(w, labels == w) for w in wanted]
    non_null = col.dropna()
    try:
        uniq = sorted(pd.unique(non_null))
    except TypeError:  # mixed types: order by label
        uniq = sorted(pd.unique(non_null), key=value_label)
    out = [(value_label(u), labels == value_label(u)) for u in uniq]
    merged: dict[str, np.ndarray] = {}
    for lab, m in out:  # 1 and 1.0 share a label
        merged[lab] = merged[lab] | m if lab in merged else m
    groups = list(merged.items())
    null = labels == NULL
    if null.any() and NULL not in merged:
        groups.append((NULL, null))
    return groups


def _numeric(col: pd.Series, field: str) -> np.ndarray:
    try:
        return pd.to_numeric(col, errors="raise").to_numpy(dtype=np.float64, na_value=np.nan)
    except (TypeError, ValueError):
        raise InputError(f"{field}: column {col.name!r} is not numeric (dtype {col.dtype}); bins and quantiles "
                         f"need numbers", hint="group it by value instead (drop bins/quantiles)") from None


def _by_edges(x: np.ndarray, edges: Sequence[float], *, last_closed: bool) -> list[tuple[str, np.ndarray]]:
    e = [float(v) for v in edges]
    finite = ~np.isnan(x)
    groups: list[tuple[str, np.ndarray]] = []
    below = finite & (x < e[0])
    if below.any():
        groups.append((f"(-inf,{_fmt(e[0])})", below))
    n = len(e) - 1
    for i in range(n):
        closed = last_closed and i == n - 1
        m = finite & (x >= e[i]) & ((x <= e[i + 1]) if closed else (x < e[i + 1]))
        groups.append((f"[{_fmt(e[i])},{_fmt(e[i + 1])}{']' if closed else ')'}", m))
    above = finite & ((x > e[-1]) if last_closed else (x >= e[-1]))
    if above.any():
        groups.append((f"[{_fmt(e[-1])},inf)", above))
    if (~finite).any():
        groups.append((NULL, ~finite))
    return groups


def _cap(groups: list[tuple[str, np.ndarray]], max_groups: int, rows: int) -> list[tuple[str, np.ndarray]]:
    if len(groups) <= max_groups:
        return groups
    sizes = [int(m.sum()) for _, m in groups]
    keep = sorted(sorted(range(len(groups)), key=lambda i: -sizes[i])[:max_groups - 1])
    kept = [groups[i] for i in keep]
    rest = np.zeros(rows, dtype=bool)
    for i, (_, m) in enumerate(groups):
        if i not in keep:
            rest |= m
    label = OTHER if OTHER not in {g for g, _ in kept} else f"__{OTHER}__"
    return kept + [(label, rest)]


def slice_groups(frame: pd.DataFrame, slices: list[SliceSpec],
                 derived: Mapping[str, np.ndarray] | None = None) -> list[SliceGroup]:
    """Split the validation rows into the groups of every declared slice (rules: module docstring).

    Args:
        frame: the validation metadata, one row per validation row (`Dataset.frame`).
        slices: the spec's `slices`.
        derived: {slice name: (rows,) values} of the derived slices (`slices[i].derive`), computed from the
            rows' inputs and reference outputs by `tailguard.core.derive.derive_rows`; a header slice reads the
            frame's column named like the header.

    Returns:
        SliceGroups, slice by slice in spec order, groups in the order of the module docstring rules.

    Raises:
        InputError: a slice's column (or header column) is missing from the frame (names `slices.<i>.column`
            and the available columns), a derived slice has no values in `derived`, or bins/quantiles on a
            non-numeric column.
    """
    rows = len(frame)
    out: list[SliceGroup] = []
    for i, s in enumerate(slices):
        if s.derive is not None:
            if derived is None or s.name not in derived:
                raise InputError(f"slices.{i}.derive: the values of derived slice {s.name!r} were not computed",
                                 hint="compute them with tailguard.core.derive.derive_rows")
            col = pd.Series(np.asarray(derived[s.name]), name=s.name)
        else:
            name, fld = (s.column, "column") if s.column is not None else (s.header, "header")
            if name not in frame.columns:
                raise InputError(f"slices.{i}.{fld}: no column {name!r} in the validation data "
                                 f"(slice {s.name!r}); available columns: {list(map(str, frame.columns))}",
                                 hint="add the column to the validation Parquet file or fix the column name")
            col = frame[name]
        groups = _groups(col, s, i, rows)
        for label, mask in _cap(groups, s.max_groups, rows):
            m = np.asarray(mask, dtype=bool)
            out.append(SliceGroup(s.name, label, m, int(m.sum())))
    return out


def _groups(col: pd.Series, s: SliceSpec, i: int, rows: int) -> list[tuple[str, np.ndarray]]:
    if s.bins is not None:
        return _by_edges(_numeric(col, f"slices.{i}.bins"), s.bins, last_closed=False)
    if s.quantiles is not None:
        x = _numeric(col, f"slices.{i}.quantiles")
        finite = x[~np.isnan(x)]
        if finite.size == 0:
            return [(NULL, np.isnan(x))] if rows else []
        edges = np.unique(np.quantile(finite, np.linspace(0.0, 1.0, s.quantiles + 1)))
        if edges.size == 1:  # a constant column: one closed group
            edges = np.array([edges[0], edges[0]])
        return _by_edges(x, edges.tolist(), last_closed=True)
    return _by_value(col, s)


def per_slice_table(model_task: str, per_sample: dict[str, np.ndarray], groups: list[SliceGroup]) -> pd.DataFrame:
    """Parity metrics per slice group.

    Args:
        model_task: the spec's `model.task`.
        per_sample: `parity.per_sample_metrics` output, arrays of shape (rows,).
        groups: `slice_groups` output over the same rows.

    Returns:
        DataFrame with columns slice (str), value (str), support (int), then one float column per metric of
        `parity.aggregate` (NaN where support is 0), one row per group in `groups` order.
    """
    names = metric_names(model_task, with_labels="correct" in per_sample)
    records = []
    for g in groups:
        rec: dict[str, object] = {"slice": g.slice, "value": g.value, "support": g.support}
        rec.update(aggregate(model_task, per_sample, g.mask))
        records.append(rec)
    return pd.DataFrame.from_records(records, columns=["slice", "value", "support", *names]).astype(
        {"support": "int64"})
