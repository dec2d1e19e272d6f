"""Worst-slice discovery: find the metadata sub-populations where a variant's parity is worst, with an FDR control.

Declared slices (`slices.py`) check the groups the user thought of. Discovery searches every metadata column
(and, with `analysis.discovery.pairs`, every conjunction of two columns) for groups whose per-row parity is
worse than the rest of the validation rows, tests each slice one-sided, and corrects for the number of
slices tested with the Benjamini-Hochberg procedure.

Slices tested (rules of `discover_slices`):

- columns: `analysis.discovery.columns`, or every column of the frame except `exclude_columns` (model inputs,
  the label). Skipped, with the reason in `DiscoveryResult.skipped`: columns holding arrays/lists/dicts,
  non-numeric columns with more than `max_values` distinct values (ids, free text), constant columns.
- groups: a numeric (non-bool) column with more than `max_bins` distinct values is cut into `max_bins`
  equal-frequency bins exactly as a declared `quantiles` slice is (`slices.slice_groups`; labels "[a,b)",
  the last "[a,b]", tied edges merge); any other column is grouped by value (labels `slices.value_label`:
  integral floats without ".0", missing values "null").
- single slices: every group of every column; pair slices: every non-empty cell (group of column A
  and group of column B, A before B in column order), labelled slice "A&B", value "a&b". A pair whose rows
  are exactly one of its two groups' rows (B is a function of A there, e.g. "lexname&pos") repeats that
  single slice and is not tested again.
- support: a slice needs `min_support` rows and the rest (every other validation row) too.
- pair cap: at most `MAX_PAIRS_TESTED` pair slices are tested; when more are eligible, the ones with
  the largest support are kept (ties in column/group order). Choosing by support, never by outcome, keeps the
  FDR guarantee; with the default min_support 30, 10k rows allow at most ~333 cells per column pair, so 10
  columns x 50 values (45 column pairs) yield at most ~15k eligible pairs, capped to 5000.

Per-row values: the metric (`analysis.discovery.metric`, default per model task: classification `top1_agreement`,
embedding `nn_top1_agreement`, regression/generic `abs_error.mean`) names a per-row key (`parity.row_source`).
A one-row test compares per-row values, so a quantile or extreme metric (`cosine_similarity.p01`,
`abs_error.max`, `kl_divergence.p99`) is replaced by the mean of the same per-row key (`cosine_similarity.mean`
...); `DiscoveryResult.tested_metric` and `method` say so. Direction: `tailguard.core.metrics.higher_is_better`.

Tests (one-sided, H1: the slice is worse than the rest; computed by `tailguard.core.stats`: `fisher_exact_greater`,
`mann_whitney_u_greater`, `benjamini_hochberg`):

- 0/1 per-row values (bool arrays, or a PROPORTION_METRICS metric whose values are all 0/1): Fisher's exact
  test (Fisher 1935; Agresti, "Categorical Data Analysis", 3rd ed., 2013, sec. 3.5) on the 2x2 table
  (slice/rest x bad/good row). Its one-sided p-value is the hypergeometric upper tail
  P(X >= k), X ~ Hypergeometric(rows, bad rows, slice support), computed for all slices at once with
  `scipy.stats.hypergeom.sf` (equal to `scipy.stats.fisher_exact(..., alternative="greater")`). Chosen over
  the pooled two-proportion z test because parity failures are rare: at 2% disagreement a 30-row slice
  expects 0.6 bad rows, where the z test's normal approximation is anti-conservative exactly in the
  "slice worse" tail; Fisher is exact (conservative through discreteness) at any count.
- continuous per-row values: the Mann-Whitney U test (Mann & Whitney 1947), normal approximation with tie
  and continuity correction (as `scipy.stats.mannwhitneyu(method="asymptotic", alternative="greater")`;
  Hollander, Wolfe & Chicken, "Nonparametric Statistical Methods", 3rd ed., 2014, sec. 4.1). Chosen over
  Welch's t test because per-row parity errors are heavy-tailed (a few outlier rows dominate a mean and its
  variance, so t's normal approximation fails at 30-row slices) and because non-finite rows are scored
  +inf / worst-case by `parity.per_sample_metrics`, which a t test cannot take but ranks can: non-finite
  (and NaN) rows are ranked worst, tied with each other. Ranks are computed once over all rows and each
  slice's rank sum comes from one `np.bincount`, so thousands of slices cost one pass per column
  (pair).
- correction: Benjamini-Hochberg step-up over every slice tested (Benjamini & Hochberg 1995, JRSS B 57:
  289-300; `scipy.stats.false_discovery_control(method="bh")`), giving `q_value`. BH controls the FDR under
  independence and positive regression dependence (Benjamini & Yekutieli 2001); groups of one column are
  negatively dependent (they share the rest), which the simulation tests in tests/components/test_discovery.py check
  empirically. A slice is `significant` when q_value <= alpha and drop > 0.

Reported values (metric units): `value_in_slice` / `value_rest` are the means of the per-row values of the
slice and of the rest; a non-finite row makes the mean the worst value (+inf for errors, -inf for
higher-is-better metrics). `drop` = (rest - slice) for higher-is-better metrics, (slice - rest) for errors, so
drop > 0 means the slice is worse. With non-finite rows, drop is the limit of that difference when non-finite
rows score a worst value M -> inf: +inf when the slice holds a larger fraction of them than the rest, -inf
when a smaller one, and the difference of the finite parts' sums per row when the fractions are equal.

Ranking: significant first, then by p-value (the strongest evidence first; a sub-slice of a bad group has
the same drop but fewer rows, so the whole group ranks above its pieces), then by drop (largest first),
support (largest first) and column/group order. Only slices with drop > 0 are listed, at most
`max_results`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import pandas as pd

from tailguard.core.errors import InputError
from tailguard.core.metrics import higher_is_better
from tailguard.core.parity import row_source
from tailguard.core.slices import NULL, slice_groups, value_label
from tailguard.core.spec.analysis import DiscoverySpec
from tailguard.core.spec.data import SliceSpec
from tailguard.core.spec.gates import MODEL_TASK_METRICS, PROPORTION_METRICS
from tailguard.core.stats import benjamini_hochberg, fisher_exact_greater, mann_whitney_u_greater, rank_with_ties

MAX_PAIRS_TESTED = 5000  # pair slices tested at most (the largest by support); see the module docstring
PAIR_SEP = "&"  # joins the two columns (slice) and the two values (value) of a pair slice
DEFAULT_METRIC: dict[str, str] = {"classification": "top1_agreement", "embedding": "nn_top1_agreement",
                                  "regression": "abs_error.mean", "generic": "abs_error.mean",
                                  "token_classification": "cer"}
TABLE_COLUMNS = ("slice", "value", "support", "metric", "value_in_slice", "value_rest", "drop", "p_value",
                 "q_value", "significant")
_TABLE_DTYPES = {"slice": object, "value": object, "support": "int64", "metric": object,
                 "value_in_slice": "float64", "value_rest": "float64", "drop": "float64", "p_value": "float64",
                 "q_value": "float64", "significant": bool}


@dataclass
class DiscoveryResult:
    """The worst metadata slices found, with their tests.

    Attributes:
        table: one row per reported slice, columns `TABLE_COLUMNS`: slice (str, "lexname" or "lexname&pos"),
            value (str, "noun.body" or "noun.body&noun"), support (int, rows), metric (str, the mean-type
            metric compared, `tested_metric`), value_in_slice / value_rest (float, metric units: means over
            the slice's rows / every other row), drop (float, > 0: slice worse, metric units), p_value (float,
            one-sided), q_value (float, BH-adjusted), significant (bool). Sorted worst first (module docstring);
            at most `spec.max_results` rows, only rows with drop > 0.
        masks: (slice, value) -> bool array of shape (rows,) selecting the slice's validation rows, for every
            row of `table`.
        tested: number of slices tested (the BH family size m).
        method: the test, correction and counts of slices tested in words (for the report and result.json).
        metric: the requested metric (`spec.metric` or the model task's default).
        tested_metric: the metric compared per row (`metric`, or `<key>.mean` for a quantile/max metric).
        columns: the columns searched, in order.
        skipped: column -> why it was not searched (arrays, ids, constant).
    """

    table: pd.DataFrame
    masks: dict[tuple[str, str], np.ndarray]
    tested: int
    method: str
    metric: str = ""
    tested_metric: str = ""
    columns: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)


@dataclass
class _Column:
    name: str
    codes: np.ndarray  # int64 (rows,), group index in [0, len(labels))
    labels: list[str]


def _empty_table() -> pd.DataFrame:
    return pd.DataFrame({c: pd.Series(dtype=t) for c, t in _TABLE_DTYPES.items()})


def _holds_containers(col: pd.Series) -> bool:
    if col.dtype != object:
        return False
    return bool(col.map(lambda v: isinstance(v, (list, tuple, set, frozenset, dict, np.ndarray))).any())


def _codes_from_groups(rows: int, groups: list[tuple[str, np.ndarray]]) -> tuple[np.ndarray, list[str]]:
    codes = np.full(rows, -1, dtype=np.int64)
    labels: list[str] = []
    for label, mask in groups:
        if label in labels:  # a label repeated (1 and 1.0): same group
            codes[mask] = labels.index(label)
            continue
        codes[mask] = len(labels)
        labels.append(label)
    return codes, labels


def _by_value(col: pd.Series) -> tuple[np.ndarray, list[str]]:
    try:
        raw_codes, uniques = pd.factorize(col, sort=True, use_na_sentinel=True)
    except TypeError:  # mixed types cannot be sorted: first-appearance order
        raw_codes, uniques = pd.factorize(col, sort=False, use_na_sentinel=True)
    raw_labels = [value_label(u) for u in list(uniques)]
    if (raw_codes < 0).any():
        raw_labels.append(NULL)
        raw_codes = np.where(raw_codes < 0, len(raw_labels) - 1, raw_codes)
    labels = list(dict.fromkeys(raw_labels))  # merge values with equal labels, keep order
    remap = np.array([labels.index(lab) for lab in raw_labels], dtype=np.int64)
    return remap[np.asarray(raw_codes, dtype=np.int64)], labels


def _encode(col: pd.Series, name: str, spec: DiscoverySpec) -> _Column | str:
    """Integer group codes of one column, or the reason it is skipped."""
    rows = len(col)
    if _holds_containers(col):
        return "holds arrays/lists"
    numeric = pd.api.types.is_numeric_dtype(col) and not pd.api.types.is_bool_dtype(col)
    if numeric:
        x = pd.to_numeric(col).to_numpy(dtype=np.float64, na_value=np.nan)
        if np.isinf(x).any():
            x = np.where(np.isinf(x), np.nan, x)  # inf has no quantile bin: it goes to "null" with NaN
        distinct = np.unique(x[~np.isnan(x)]).size
        if distinct > spec.max_bins:
            groups = slice_groups(pd.DataFrame({"x": x}),
                                  [SliceSpec(name="discovery", column="x", quantiles=spec.max_bins)])
            codes, labels = _codes_from_groups(rows, [(g.value, g.mask) for g in groups])
        else:
            codes, labels = _by_value(pd.Series(x))
    else:
        distinct = col.nunique(dropna=True)
        if distinct > spec.max_values:
            return f"{distinct} distinct values > max_values {spec.max_values} (an id or free text)"
        codes, labels = _by_value(col)
    if len(np.unique(codes)) < 2:
        return "constant"
    return _Column(name, codes, labels)


def _select_columns(frame: pd.DataFrame, spec: DiscoverySpec, exclude: Sequence[str]) -> list[object]:
    available = list(frame.columns)
    if spec.columns is None:
        excluded = {str(c) for c in exclude}
        return [c for c in available if str(c) not in excluded]
    by_name = {str(c): c for c in available}
    missing = [c for c in spec.columns if c not in by_name]
    if missing:
        raise InputError(f"analysis.discovery.columns: no column {missing[0]!r} in the validation data "
                         f"(missing: {missing}); available columns: {[str(c) for c in available]}",
                         hint="fix the column name or add the column to the validation Parquet file")
    return [by_name[c] for c in dict.fromkeys(spec.columns)]


def _per_row(per_sample: dict[str, np.ndarray], model_task: str, metric: str, rows: int) -> tuple[np.ndarray, str, str]:
    """(per-row values (rows,), tested metric name, note for `method`)."""
    key, how = row_source(metric)
    if key not in per_sample:
        raise InputError(f"analysis.discovery.metric: per-row values {key!r} for {metric!r} are missing "
                         f"(per-row keys: {sorted(per_sample)})",
                         hint="pass parity.per_sample_metrics output for the same model task (accuracy needs labels: "
                              "data.validation.label_column)")
    x = np.asarray(per_sample[key])
    if x.ndim != 1 or x.shape[0] != rows:
        raise InputError(f"discovery: per-row values {key!r} have shape {x.shape}, the validation frame has "
                         f"{rows} rows", hint="pass per-row arrays of shape (rows,) for the same rows as the frame")
    if how == "mean":
        return x, metric, ""
    tested = f"{key}.mean"
    note = (f"{metric} is a {'quantile' if how.startswith('p') else how}, not a per-row mean: slices are compared "
            f"on the per-row {key} mean ({tested}); ")
    return x, tested, note


def tested_slices(frame: pd.DataFrame, spec: DiscoverySpec,
                     exclude_columns: Sequence[str] = ()) -> list[tuple[str, str, np.ndarray]]:
    """Every slice `discover_slices` tests on this metadata, before any per-row value is seen.

    The slices tested depend on the metadata only (columns, groups, support, the pair rules and cap of the module
    docstring), so sequential validation (`sequential.py`) can bound every one of them while rows are still being
    scored: a discovered gate whose threshold every slice tested clears passes whichever of them discovery marks
    significant on all rows.

    Args:
        frame: the validation metadata (all rows), shape (rows, columns).
        spec: `analysis.discovery`.
        exclude_columns: as `discover_slices`.

    Returns:
        [(slice, value, mask)] in `discover_slices`' order: slice "col" or "colA&colB", value its label,
        mask a bool array of shape (rows,); [] when discovery is disabled or nothing qualifies. Its length is
        `DiscoveryResult.tested`.

    Raises:
        InputError: as `discover_slices` for `spec.columns`.
    """
    if not spec.enabled:
        return []
    rows = len(frame)
    columns: list[_Column] = []
    for c in _select_columns(frame, spec, exclude_columns):
        enc = _encode(frame[c].reset_index(drop=True), str(c), spec)
        if isinstance(enc, str):
            if spec.columns is not None and enc != "constant":
                raise InputError(f"analysis.discovery.columns: column {str(c)!r} cannot be searched: {enc}",
                                 hint="drop it from analysis.discovery.columns")
            continue
        columns.append(enc)
    lo, hi = spec.min_support, rows - spec.min_support
    out: list[tuple[str, str, np.ndarray]] = []
    supports = []
    for col in columns:
        n = np.bincount(col.codes, minlength=len(col.labels))
        supports.append(n)
        for g in np.nonzero((n >= lo) & (n <= hi))[0]:
            out.append((col.name, col.labels[g], col.codes == g))
    if not spec.pairs:
        return out
    pairs: list[tuple[int, str, str, np.ndarray]] = []
    for ai in range(len(columns)):
        for bi in range(ai + 1, len(columns)):
            a, b = columns[ai], columns[bi]
            gb = len(b.labels)
            code = a.codes * gb + b.codes
            n = np.bincount(code, minlength=len(a.labels) * gb)
            ga, gbb = np.divmod(np.arange(n.size), gb)
            keep = np.nonzero((n >= lo) & (n <= hi) & (n != supports[ai][ga]) & (n != supports[bi][gbb]))[0]
            for cell in keep:
                pairs.append((int(n[cell]), f"{a.name}{PAIR_SEP}{b.name}",
                              f"{a.labels[ga[cell]]}{PAIR_SEP}{b.labels[gbb[cell]]}", code == cell))
    if len(pairs) > MAX_PAIRS_TESTED:
        order = np.sort(np.argsort(-np.array([p[0] for p in pairs]), kind="stable")[:MAX_PAIRS_TESTED])
        pairs = [pairs[i] for i in order]
    return out + [(sl, val, mask) for _, sl, val, mask in pairs]


def discover_slices(frame: pd.DataFrame, per_sample: dict[str, np.ndarray], *, model_task: str, spec: DiscoverySpec,
                    exclude_columns: Sequence[str] = ()) -> DiscoveryResult:
    """Find the metadata slices (and pairs of them) where per-row parity is significantly worse than the rest.

    Slices tested, tests, correction and ranking: module docstring.

    Args:
        frame: validation metadata, one row per validation row (`Dataset.frame`), shape (rows, columns).
        per_sample: `parity.per_sample_metrics` output for the same rows: {per-row key: array (rows,)}.
        model_task: the spec's `model.task`.
        spec: `analysis.discovery`.
        exclude_columns: columns never searched unless `spec.columns` names them (model inputs, the label).

    Returns:
        DiscoveryResult (table sorted worst first, masks of the table's rows, number tested, method words).
        An empty table (tested 0) when discovery is disabled, no column is usable or no slice has
        `min_support` rows on both sides.

    Raises:
        InputError: unknown model.task; a metric not produced for the model task or without per-row values
            (names analysis.discovery.metric); a `spec.columns` name missing from the frame (names
            analysis.discovery.columns and the available columns), or one that holds arrays/lists or has more
            than `max_values` distinct values; per-row arrays of another length.
    """
    if model_task not in MODEL_TASK_METRICS:
        raise InputError(f"unknown model.task {model_task!r}",
                         hint=f"use one of {sorted(MODEL_TASK_METRICS)} (model.task)")
    metric = spec.metric or DEFAULT_METRIC[model_task]
    if metric not in MODEL_TASK_METRICS[model_task]:
        raise InputError(f"analysis.discovery.metric: {metric!r} is not a parity metric of model.task {model_task!r}",
                         hint=f"choose one of {sorted(MODEL_TASK_METRICS[model_task])}")
    rows = len(frame)
    if not spec.enabled:
        return DiscoveryResult(_empty_table(), {}, 0, "disabled (analysis.discovery.enabled: false)", metric,
                               metric)
    names = _select_columns(frame, spec, exclude_columns)
    x, tested_metric, note = _per_row(per_sample, model_task, metric, rows)
    hib = higher_is_better(metric)

    columns: list[_Column] = []
    skipped: dict[str, str] = {}
    for c in names:
        enc = _encode(frame[c].reset_index(drop=True), str(c), spec)
        if isinstance(enc, str):
            if spec.columns is not None and enc != "constant":
                raise InputError(f"analysis.discovery.columns: column {str(c)!r} cannot be searched: {enc}",
                                 hint="drop it from analysis.discovery.columns"
                                      + (" or raise analysis.discovery.max_values" if "max_values" in enc else ""))
            skipped[str(c)] = enc
        else:
            columns.append(enc)

    # per-row "badness" s (larger = worse), and whether the 0/1 test applies
    binary = x.dtype == bool or (metric in PROPORTION_METRICS and bool(np.isin(x, (0, 1)).all()))
    xf = x.astype(np.float64)
    nonfinite = ~np.isfinite(xf)
    s = np.where(nonfinite, np.inf, xf if not hib else -xf)
    s_fin = np.where(nonfinite, 0.0, s)
    nf = nonfinite.astype(np.float64)
    if binary:
        weight = s + (1.0 if hib else 0.0)  # 1 for a bad row (0 agreement / 1 error indicator), else 0
        total_bad = int(round(weight.sum()))
        test_words = (f"one-sided Fisher's exact test (hypergeometric upper tail, Fisher 1935) of the share of "
                      f"rows {'without' if hib else 'with'} {row_source(tested_metric)[0]} in the slice vs the rest")
    else:
        weight, tie_term = rank_with_ties(s)  # average ranks; +inf (non-finite) rows tie as the worst
        test_words = (f"one-sided Mann-Whitney U test (normal approximation, tie and continuity corrected) of "
                      f"per-row {row_source(tested_metric)[0]} in the slice vs the rest, non-finite rows ranked "
                      f"worst")

    # each slice's statistics, column by column (single) and column pair by column pair (pairs)
    lo, hi = spec.min_support, rows - spec.min_support
    single: list[tuple[np.ndarray, ...]] = []  # (col, group, n, w, fin, nfc)
    col_support: list[np.ndarray] = []
    for ci, col in enumerate(columns):
        g = len(col.labels)
        n = np.bincount(col.codes, minlength=g)
        col_support.append(n)
        keep = np.nonzero((n >= lo) & (n <= hi))[0]
        single.append((np.full(keep.size, ci), keep, n[keep],
                       np.bincount(col.codes, weights=weight, minlength=g)[keep],
                       np.bincount(col.codes, weights=s_fin, minlength=g)[keep],
                       np.bincount(col.codes, weights=nf, minlength=g)[keep]))
    pair: list[tuple[np.ndarray, ...]] = []  # (col_a, group_a, col_b, group_b, n, w, fin, nfc)
    if spec.pairs:
        for ai in range(len(columns)):
            for bi in range(ai + 1, len(columns)):
                a, b = columns[ai], columns[bi]
                gb = len(b.labels)
                cells = len(a.labels) * gb
                code = a.codes * gb + b.codes
                n = np.bincount(code, minlength=cells)
                ga, gbb = np.divmod(np.arange(cells), gb)
                keep = np.nonzero((n >= lo) & (n <= hi) & (n != col_support[ai][ga])
                                  & (n != col_support[bi][gbb]))[0]
                if keep.size == 0:
                    continue
                pair.append((np.full(keep.size, ai), ga[keep], np.full(keep.size, bi), gbb[keep], n[keep],
                             np.bincount(code, weights=weight, minlength=cells)[keep],
                             np.bincount(code, weights=s_fin, minlength=cells)[keep],
                             np.bincount(code, weights=nf, minlength=cells)[keep]))

    def cat(parts: list[tuple[np.ndarray, ...]], i: int, dtype: object) -> np.ndarray:
        return np.concatenate([p[i] for p in parts]).astype(dtype) if parts else np.zeros(0, dtype=dtype)

    s_col, s_grp = cat(single, 0, np.int64), cat(single, 1, np.int64)
    s_n, s_w, s_fin_sum, s_nf = (cat(single, i, np.float64) for i in (2, 3, 4, 5))
    p_ca, p_ga, p_cb, p_gb = (cat(pair, i, np.int64) for i in range(4))
    p_n, p_w, p_fin_sum, p_nf = (cat(pair, i, np.float64) for i in (4, 5, 6, 7))
    eligible_pairs = p_n.size
    if eligible_pairs > MAX_PAIRS_TESTED:
        order = np.argsort(-p_n, kind="stable")[:MAX_PAIRS_TESTED]
        order.sort()
        p_ca, p_ga, p_cb, p_gb, p_n, p_w, p_fin_sum, p_nf = (
            v[order] for v in (p_ca, p_ga, p_cb, p_gb, p_n, p_w, p_fin_sum, p_nf))

    col_a = np.concatenate([s_col, p_ca])
    grp_a = np.concatenate([s_grp, p_ga])
    col_b = np.concatenate([np.full(s_col.size, -1, dtype=np.int64), p_cb])
    grp_b = np.concatenate([np.full(s_col.size, -1, dtype=np.int64), p_gb])
    n1 = np.concatenate([s_n, p_n])
    w1 = np.concatenate([s_w, p_w])
    fin1 = np.concatenate([s_fin_sum, p_fin_sum])
    nf1 = np.concatenate([s_nf, p_nf])
    m = n1.size

    tested_words = (f"{s_col.size} single-column groups"
                  + (f", {p_n.size} pairs of two columns" if spec.pairs else "")
                  + (f" (capped at the {MAX_PAIRS_TESTED} largest of {eligible_pairs} eligible pairs)"
                     if eligible_pairs > MAX_PAIRS_TESTED else ""))
    method = (f"{note}{test_words}; Benjamini-Hochberg step-up (BH 1995) at FDR alpha={spec.alpha:g} over "
              f"{m} slices tested ({tested_words}) with >= {spec.min_support} rows in the slice and in the rest; "
              f"significant: q <= alpha and worse than the rest")
    base = DiscoveryResult(_empty_table(), {}, int(m), method, metric, tested_metric, [c.name for c in columns],
                           skipped)
    if m == 0:
        return base

    # one-sided p-values (H1: slice worse)
    n2 = rows - n1
    if binary:
        p = fisher_exact_greater(w1, n1, total_bad, rows)
    else:
        p = mann_whitney_u_greater(w1, n1, rows, tie_term)
    p = np.clip(np.nan_to_num(p, nan=1.0), 0.0, 1.0)
    q = benjamini_hochberg(p)

    # reported means (metric units) and drop (> 0: slice worse), non-finite rows as the worst value
    fin_total, nf_total = float(s_fin.sum()), float(nf.sum())
    fin2, nf2 = fin_total - fin1, nf_total - nf1
    worst = -np.inf if hib else np.inf
    sign = -1.0 if hib else 1.0  # metric units = sign * s
    with np.errstate(divide="ignore", invalid="ignore"):
        mean_in = np.where(nf1 > 0, worst, sign * fin1 / n1)
        mean_rest = np.where(nf2 > 0, worst, sign * fin2 / n2)
        frac_cmp = np.sign(nf1 * n2 - nf2 * n1)
        drop = np.where(frac_cmp != 0, frac_cmp * np.inf, fin1 / n1 - fin2 / n2)
    significant = (q <= spec.alpha) & (drop > 0)

    listed = np.nonzero(drop > 0)[0]
    # lexsort: last key primary -> significant first, p asc, drop desc, support desc, then the testing order
    order = listed[np.lexsort((listed, -n1[listed], -drop[listed], p[listed], ~significant[listed]))]
    order = order[:spec.max_results]

    records, masks = [], {}
    for i in order:
        ca, ga, cb, gb = int(col_a[i]), int(grp_a[i]), int(col_b[i]), int(grp_b[i])
        a = columns[ca]
        mask = a.codes == ga
        if cb < 0:
            sl, val = a.name, a.labels[ga]
        else:
            b = columns[cb]
            mask &= b.codes == gb
            sl, val = f"{a.name}{PAIR_SEP}{b.name}", f"{a.labels[ga]}{PAIR_SEP}{b.labels[gb]}"
        masks[(sl, val)] = mask
        records.append((sl, val, int(n1[i]), tested_metric, float(mean_in[i]), float(mean_rest[i]),
                        float(drop[i]), float(p[i]), float(q[i]), bool(significant[i])))
    table = pd.DataFrame.from_records(records, columns=list(TABLE_COLUMNS)).astype(_TABLE_DTYPES) if records \
        else _empty_table()
    base.table, base.masks = table, masks
    return base
