"""The monitor's resolved configuration: the spec's `monitoring` section plus what it needs from the rest of
the spec (model.task, inputs, declared slices), with model-task-dependent defaults filled in and checked.

Slice rules turn one request into slice keys such as ``length=[16,32)`` or ``domain=legal``; every request also
belongs to the slice ``all``. A rule reads the request's metadata (OIP `parameters`, or a replay row's metadata
columns), a header (HTTP header, gRPC metadata, a logger event's forwarded header), or derives a per-row value
from the request's tensors or the reference's output (tailguard.core.derive, the same labels as validation's
slices.csv). Derived rules, and column rules given one value per row (monitoring.per_row_metadata), are per row:
the rows of one request may fall into several groups (`RowKeys`).
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import os
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from tailguard.core.derive import default_derived_slices, derive_values, row_labels
from tailguard.core.errors import FieldError, InputError, SpecError
from tailguard.core.metrics import MODEL_TASKS, ROW_METRICS, monitor_metrics
from tailguard.core.spec.data import SliceSpec
from tailguard.core.spec.model import TensorSpec
from tailguard.core.spec.monitor import MonitoringSpec, MonitorThreshold
from tailguard.core.spec.root import Spec

log = logging.getLogger("tailguard.monitoring")

ALL_SLICE = "all"
OTHER_VALUE = "other"
MISSING_VALUE = "missing"

# Metric direction (True = higher is better, bad when low) and range of each per-row metric the monitor can
# track, from the metric catalogue (tailguard.core.metrics.ROW_METRICS; formulas: tailguard.core.parity). The
# detector bets against the bound on the good side (monitoring/detector.py), so only that one must be finite.
HIGHER_IS_BETTER: dict[str, bool] = {r.key: r.higher_is_better for r in ROW_METRICS if r.monitored}
METRIC_RANGE: dict[str, tuple[float, float]] = {r.key: r.value_range for r in ROW_METRICS if r.monitored}
# Slice values longer than this (characters) are cut to it, with "~" appended, and counted
# (tailguard_monitor_slice_values_cut_total): a label value, a JSON key and a dict key per slice stay small.
MAX_LABEL_CHARS = 64
PAIR_SEPARATOR = "&"
ONE_ROW_MEMO = 4096  # `MonitorConfig.one_row_group`'s memo: at most this many distinct rows' labels
# A slice value past monitoring.max_new_values_per_minute new values of its column is grouped under this label
# (`<name>=__new__`) instead of getting its own key: a flood of unique values costs one key (issue 22).
NEW_VALUE = "__new__"
MIN_TOKEN_CHARS = 16  # a shorter bearer token is refused (exit 2): guessable
# Tracked per-row metrics by default: every one the model task's parity computes for a single pair (catalogue order).
DEFAULT_METRICS: dict[str, tuple[str, ...]] = {t: monitor_metrics(t) for t in MODEL_TASKS}
# Default alert thresholds. 0.97 top-1 agreement matches the per-slice gate of the example spec
# (the project's design brief); 0.98 cosine is the usual "near-lossless" bar for INT8 sentence embeddings.
# A candidate that fails on a sampled row (raises, times out, answers a wrong shape) scores 1 on this per-row
# metric; it is tracked for every model task and alerts at any failure (max 0) unless monitoring.thresholds sets it.
CANDIDATE_ERROR = "candidate_error_rate"
CANDIDATE_ERROR_THRESHOLD = MonitorThreshold(max=0.0)
DEFAULT_THRESHOLDS: dict[str, dict[str, MonitorThreshold]] = {
    "classification": {"top1_agree": MonitorThreshold(min=0.97)},
    "embedding": {"cosine_similarity": MonitorThreshold(min=0.98)},
    "regression": {},
    "generic": {},
    # CTC/token outputs: 0.97 of positions, as for classification's top-1; cer and exact match are spec thresholds
    "token_classification": {"token_top1_agree": MonitorThreshold(min=0.97)},
}


@dataclass(frozen=True)
class Bound:
    """A resolved alert threshold: the slice is bad when its mean is confidently on the wrong side of `value`.

    Attributes:
        metric: per-row metric name.
        value: threshold in the metric's units.
        higher_is_better: True: bad when mean < value; False: bad when mean > value.
        source: how it was given ("min", "max" or "baseline-max_drop"), for the alert record.
        truncate_at: lower-is-better metrics without an upper end: row values above it count as it, in the alarm
            and the recovery test alike (monitoring.thresholds.<m>.truncate_at); None: not truncated.
    """

    metric: str
    value: float
    higher_is_better: bool
    source: str
    truncate_at: float | None = None


@dataclass(frozen=True)
class SliceRule:
    """How one slice dimension groups requests.

    Attributes:
        name: slice name in keys (`<name>=<group>`).
        column: metadata column / request parameter read (source "column"), the header name (source "header",
            lower case), or the slice name (derived sources).
        bins: left-closed bin edges [a, b) (values outside go to `<name>=out_of_range`), or None.
        values: only these values get their own group (the rest: `<name>=other`), or None for every value.
        source: "column", "header", "input" (derived from a model input: known before sampling) or "output"
            (derived from the reference's output: known once the reference ran).
        slice: the declared slice of a derived rule (its labels: tailguard.core.derive.row_labels).
        groups: most groups this rule has (bins, values, classes, centroids), None when unbounded; with the
            rows of a request it bounds the keys one request can touch (`MonitorConfig.keys_per_request`).
    """

    name: str
    column: str
    bins: tuple[float, ...] | None = None
    values: frozenset[str] | None = None
    source: str = "column"
    slice: SliceSpec | None = None
    groups: int | None = None

    @property
    def derived(self) -> bool:
        """True for rules computed from the request's tensors or the reference's output."""
        return self.source in ("input", "output")

    def derived_labels(self, feeds: Mapping[str, np.ndarray], reference: np.ndarray | None,
                       centroids: np.ndarray | None) -> list[str]:
        """Per-row labels of a derived rule (the labels of validation's slices.csv; a row outside `values`:
        `other`).

        Raises:
            InputError: an input is missing or too short for `select` (the request's fault).
        """
        assert self.slice is not None
        x = derive_values(self.slice, feeds, [reference] if reference is not None else None, centroids=centroids)
        labels = row_labels(self.slice, x)
        if self.slice.values is None:  # only a `values` list leaves a row without a label
            return labels  # type: ignore[return-value]
        return [OTHER_VALUE if lab is None else lab for lab in labels]

    def group(self, value: Any) -> str:
        """The group label of one metadata value (a string; `missing` when absent or NaN)."""
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return MISSING_VALUE
        if self.bins is not None:
            try:
                x = float(value)
            except (TypeError, ValueError):
                return MISSING_VALUE
            edges = self.bins
            for lo, hi in zip(edges[:-1], edges[1:]):
                if lo <= x < hi:
                    return f"[{lo:g},{hi:g})"
            return "out_of_range"
        text = _label(value)
        if self.values is not None and text not in self.values:
            return OTHER_VALUE
        return text


def _label(value: Any) -> str:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if hasattr(value, "item"):  # numpy scalar
        value = value.item()
        if isinstance(value, float) and value.is_integer():
            value = int(value)
    return str(value)


def clean_label(text: str) -> tuple[str, bool]:
    """A slice value made safe for every exporter: valid UTF-8 (lone surrogates, which UTF-8 cannot encode, become
    "?") and at most MAX_LABEL_CHARS characters (longer ones are cut and end in "~").

    Args:
        text: the group label.

    Returns:
        (clean label, True when it had to be changed).
    """
    clean = text if text.isascii() else text.encode("utf-8", "replace").decode("utf-8")
    if len(clean) > MAX_LABEL_CHARS:
        clean = clean[: MAX_LABEL_CHARS - 1] + "~"
    return clean, clean != text


class NewValueLimiter:
    """Per slice column, a token bucket on values not tracked yet (monitoring.max_new_values_per_minute).

    A value is *new* when its column has not shown it recently: each column remembers its last `max_known`
    values (least recently seen forgotten first, like the statistics' own bound). A new value takes a token; a
    column's bucket holds at most `per_minute` tokens and refills at per_minute / 60 per second of `clock`. With
    no token left the value is lumped into NEW_VALUE and counted (`lumped`, and `on_lump(rule name)`); it is
    not remembered, so it gets its own key once the rate allows. Not thread-safe: the service calls it under its
    admission lock.

    Args:
        per_minute: new values per column and minute (burst: as many at once).
        max_known: values remembered per column (monitoring.max_tracked_slices).
        clock: monotonic time source in seconds (tests inject one; default time.monotonic).
        on_lump: called with the rule name for every lumped value (the service's Prometheus counter).

    Raises:
        ValueError: per_minute or max_known < 1.
    """

    def __init__(self, per_minute: int, *, max_known: int = 100_000, clock: Callable[[], float] = time.monotonic,
                 on_lump: Callable[[str], None] | None = None) -> None:
        if per_minute < 1 or max_known < 1:
            raise ValueError("per_minute and max_known must be >= 1")
        self.per_minute = float(per_minute)
        self.max_known = int(max_known)
        self.clock = clock
        self.on_lump = on_lump
        self.lumped = 0
        self._known: dict[str, OrderedDict[str, None]] = {}
        self._tokens: dict[str, tuple[float, float]] = {}  # rule name -> (tokens, at time)

    def admit(self, name: str, label: str) -> str:
        """`label` when the column `name` has seen it or may take one more new value now, else NEW_VALUE."""
        known = self._known.setdefault(name, OrderedDict())
        if label in known:
            known.move_to_end(label)
            return label
        now = self.clock()
        tokens, at = self._tokens.get(name, (self.per_minute, now))
        tokens = min(self.per_minute, tokens + max(now - at, 0.0) * self.per_minute / 60.0)
        if tokens < 1.0:
            self._tokens[name] = (tokens, now)
            self.lumped += 1
            if self.on_lump is not None:
                self.on_lump(name)
            return NEW_VALUE
        self._tokens[name] = (tokens - 1.0, now)
        known[label] = None
        if len(known) > self.max_known:
            known.popitem(last=False)
        return label


def load_auth_token(mon: MonitoringSpec, token_file: str | Path | None = None) -> str | None:
    """The monitor's bearer token: from `token_file` (`monitor serve --auth-token-file`), else the spec's
    monitoring.auth_token_file, else the environment variable monitoring.auth_token_env; None when none is set
    (no authentication). Surrounding whitespace (a trailing newline of a Secret file) is stripped.

    Raises:
        InputError: the file cannot be read, the variable is unset or empty, or the token is shorter than
            MIN_TOKEN_CHARS characters (exit 2, naming the source and the fix).
    """
    path = token_file if token_file is not None else mon.auth_token_file
    if path is not None:
        source = f"auth token file {str(path)!r}"
        try:
            token = Path(path).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise InputError(f"{source} cannot be read ({type(exc).__name__}: {str(exc)[:200]})",
                             hint="mount the Secret there, or fix --auth-token-file / "
                                  "monitoring.auth_token_file") from None
    elif mon.auth_token_env:
        source = f"environment variable {mon.auth_token_env} (monitoring.auth_token_env)"
        token = os.environ.get(mon.auth_token_env, "").strip()
        if not token:
            raise InputError(f"{source} is unset or empty", hint=f"set {mon.auth_token_env} (e.g. from a Secret: "
                                                                "env.valueFrom.secretKeyRef), or remove "
                                                                "monitoring.auth_token_env")
    else:
        return None
    if len(token) < MIN_TOKEN_CHARS:
        raise InputError(f"{source}: the token has {len(token)} characters, fewer than {MIN_TOKEN_CHARS}",
                         hint="use a random token, e.g. `openssl rand -hex 32`")
    return token


class BearerAuth:
    """Checks `Authorization: Bearer <token>` in constant time (hmac.compare_digest over UTF-8 bytes).

    Args:
        token: the expected token (load_auth_token).
    """

    def __init__(self, token: str) -> None:
        self._token = token.encode("utf-8")

    def check(self, authorization: str | bytes | None) -> bool:
        """True when `authorization` (the header's or gRPC metadata's value) is `Bearer <the token>` (the
        scheme case-insensitive)."""
        if authorization is None:
            return False
        raw = authorization.encode("utf-8", "replace") if isinstance(authorization, str) else authorization
        scheme, _, given = raw.strip().partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), self._token)

    @property
    def header(self) -> dict[str, str]:
        """The header that passes the check (for the combiner's peer fetch)."""
        return {"Authorization": "Bearer " + self._token.decode("utf-8")}


def route_needs_auth(path: str, mon: MonitoringSpec) -> bool:
    """Whether a route requires the bearer token: every one but /healthz and /v2/health/live; /readyz,
    /v2/health/ready and /metrics as configured (monitoring.auth_readyz, auth_metrics)."""
    if path in ("/healthz", "/v2/health/live"):
        return False
    if path in ("/readyz", "/v2/health/ready"):
        return bool(mon.auth_readyz)
    if path == "/metrics":
        return bool(mon.auth_metrics)
    return True


class RowKeys(list):
    """A request's slice keys (a list of str, as `MonitorConfig.slice_keys` gives: every key some row carries,
    the keys the sampler decides on) plus the per-row layout the monitor needs to group the rows.

    Attributes:
        labels: one entry per rule: a str (every row in that group), a list of one label per row, or None (an
            output-derived rule, labelled once the reference ran: `MonitorConfig.output_labels`).
        rows: the request's rows.
    """

    def __init__(self, keys: list[str], labels: list[str | list[str] | None], rows: int) -> None:
        super().__init__(keys)
        self.labels = labels
        self.rows = rows

    @property
    def per_row(self) -> bool:
        """True when some rule is labelled per row or after the reference (the monitor then groups the rows)."""
        return any(not isinstance(lab, str) for lab in self.labels)


def _row_values(value: Any, rows: int) -> list[Any] | None:
    """One value per row from a per-row parameter: a list, or a string holding a JSON list, of `rows` values;
    None when `value` is not such a list (then it applies to the whole request)."""
    if isinstance(value, str) and value[:1] == "[":
        try:
            value = json.loads(value)
        except ValueError:
            return None
    if isinstance(value, (list, tuple)) and len(value) == rows and rows > 0:
        return list(value)
    return None


@dataclass
class MonitorConfig:
    """Everything the sampler, statistics and exporters need, resolved from a Spec.

    Attributes:
        spec: the whole spec.
        mon: its monitoring section.
        model_task: model.task.
        inputs: model.inputs (name, dtype, shape).
        output: model.outputs[0] (the compared output).
        model_name: name in the OIP paths and the `model` metric label.
        rules: slice rules, in order.
        metrics: tracked per-row metrics.
        bounds: {metric: Bound} for metrics with a threshold.
        pairs: (i, j) indices into `rules` whose intersections are slices too (monitoring.slice_pairs).
        new_values: the per-column cap on new slice values (the service sets it from
            monitoring.max_new_values_per_minute); None: every value gets its own key (replay: deterministic).
        centroids: {slice name: (k, dim) centroids} of nearest_centroid rules (`--centroids`, the pipeline's
            centroids.npz).
        one_row_keys: `one_row_group`'s memo, {the row's labels: its slice keys} (not an argument: each config,
            `dataclasses.replace`'s too, starts empty).
    """

    spec: Spec
    mon: MonitoringSpec
    model_task: str
    inputs: list[TensorSpec]
    output: TensorSpec
    model_name: str
    rules: list[SliceRule]
    metrics: tuple[str, ...]
    bounds: dict[str, Bound] = field(default_factory=dict)
    pairs: list[tuple[int, int]] = field(default_factory=list)
    new_values: NewValueLimiter | None = None
    centroids: dict[str, np.ndarray] = field(default_factory=dict)
    one_row_keys: dict[tuple[str | tuple[str], ...], tuple[str, ...]] = field(
        default_factory=dict, init=False, repr=False, compare=False)

    def row_keys(self, meta: Mapping[str, Any], feeds: Mapping[str, np.ndarray] | None = None,
                 headers: Mapping[str, str] | None = None) -> tuple[RowKeys, int]:
        """Slice keys of one request, rule by rule, for its rows.

        Column rules read `meta` (one value for the request; with monitoring.per_row_metadata a list, or a string
        holding a JSON list, of one value per row), header rules `headers` (names lower case), input-derived
        rules the request's `feeds`; output-derived rules are left for `output_labels` (None in `labels`).

        Args:
            meta: the request's parameters (or a replay row's metadata columns).
            feeds: {input name: (batch, ...) array}; None: no derived input rule can be labelled (a request
                without tensors, e.g. the benchmark's metadata-only admission): they get `missing`.
            headers: {lower-case header name: value}; None: no header.

        Returns:
            (RowKeys: ``all``, then every key of some row per rule, then per pair; how many labels
            `clean_label` changed).

        Raises:
            InputError: a derived input is missing from `feeds` or too short (the request's fault: 4xx).
        """
        rows = 1
        if feeds:
            first = next(iter(feeds.values()))
            rows = int(np.shape(first)[0]) if np.ndim(first) else 1
        labels: list[str | list[str] | None] = []
        cut = 0
        for r in self.rules:
            if r.source == "output":
                labels.append(None)
                continue
            if r.source == "input":
                if feeds is None:
                    labels.append(MISSING_VALUE)
                    continue
                raw = r.derived_labels(feeds, None, None)
            else:
                value = (headers or {}).get(r.column) if r.source == "header" else meta.get(r.column)
                per_row = _row_values(value, rows) if self.mon.per_row_metadata and r.source == "column" else None
                if per_row is None:
                    raw = r.group(value)
                else:
                    raw = [r.group(v) for v in per_row]
            if isinstance(raw, str):
                label, changed = clean_label(raw)
                if self.new_values is not None:
                    label = self.new_values.admit(r.name, label)
                cut += changed
                labels.append(label)
            else:
                seen: dict[str, str] = {}
                for lab in raw:
                    if lab not in seen:
                        clean, changed = clean_label(lab)
                        cut += changed
                        seen[lab] = self.new_values.admit(r.name, clean) if self.new_values is not None else clean
                out = [seen[lab] for lab in raw]
                labels.append(out[0] if len(seen) == 1 else out)
        keys = [ALL_SLICE]
        parts: list[list[str]] = []
        for r, lab in zip(self.rules, labels):
            p = [] if lab is None else [f"{r.name}={lab}"] if isinstance(lab, str) else \
                [f"{r.name}={x}" for x in dict.fromkeys(lab)]
            parts.append(p)
            keys.extend(p)
        for i, j in self.pairs:
            li, lj = labels[i], labels[j]
            if li is None or lj is None:
                continue
            if isinstance(li, str) and isinstance(lj, str):
                keys.append(f"{self.rules[i].name}={li}{PAIR_SEPARATOR}{self.rules[j].name}={lj}")
            else:
                a = [li] * rows if isinstance(li, str) else li
                b = [lj] * rows if isinstance(lj, str) else lj
                keys.extend(dict.fromkeys(f"{self.rules[i].name}={x}{PAIR_SEPARATOR}{self.rules[j].name}={y}"
                                          for x, y in zip(a, b)))
        return RowKeys(keys, labels, rows), cut

    def output_labels(self, rule: SliceRule, reference: np.ndarray) -> list[str]:
        """Per-row labels of an output-derived rule from the reference's (rows, ...) output.

        Raises:
            InputError: the output does not fit the rule (e.g. fewer elements than `select`).
        """
        return rule.derived_labels({}, reference, self.centroids.get(rule.name))

    def row_groups(self, keys: RowKeys, reference: np.ndarray, keep: np.ndarray,
                   outputs: Sequence[list[str] | None] | None = None) -> list[tuple[list[str], list[int] | None]]:
        """The request's rows grouped by slice key: [(keys whose rows are the same, row indices into the kept
        rows, ascending, or None for all of them)], ``all`` first. Each (request, slice group) with at least one
        row is one unit of evidence for that group (docs/monitor.md, Per-row slices). `rule_labels` then
        `groups_of`.

        Args:
            keys: the request's RowKeys (`row_keys`).
            reference: (kept rows, ...) the reference's output of the rows kept (finite).
            keep: (rows,) bool, the rows kept.
            outputs: per rule, the output-derived rule's labels of the kept rows when already computed (the
                monitor labels a micro-batch at once), else None (computed here from `reference`).
        """
        return self.groups_of(self.rule_labels(keys, reference, keep, outputs), int(np.count_nonzero(keep)))

    def rule_labels(self, keys: RowKeys, reference: np.ndarray, keep: np.ndarray,
                    outputs: Sequence[list[str] | None] | None = None) -> list[str | list[str]]:
        """Per rule, the kept rows' label: a str when every row has it, else a list of one label per kept row
        (arguments as `row_groups`; an output-derived rule the output does not fit: `missing`)."""
        n = -1  # the kept rows, counted when a rule's labels cover every row of the request
        per_rule: list[str | list[str]] = []
        for n_rule, (r, lab) in enumerate(zip(self.rules, keys.labels)):
            if lab is None and outputs is not None and outputs[n_rule] is not None:
                lab = outputs[n_rule]
            elif lab is None:
                try:
                    lab = self.output_labels(r, reference)
                except InputError:
                    lab = MISSING_VALUE
            elif not isinstance(lab, str):
                if n < 0:
                    n = int(np.count_nonzero(keep))
                if n != len(lab):
                    lab = [lab[i] for i in np.flatnonzero(keep).tolist()]
            per_rule.append(lab)
        return per_rule

    def one_row_group(self, keys: RowKeys, outputs: Sequence[list[str] | None] | None
                      ) -> tuple[list[str | list[str]], tuple[str, ...]] | None:
        """`rule_labels` and the one group of `groups_of` for a request of one row, kept (a one-row request's row
        is one group of every key it carries), the keys memoized by the row's labels (`one_row_keys`, emptied past
        ONE_ROW_MEMO entries): the same labels and keys in the same order, without grouping each request again.

        Args:
            keys: the request's RowKeys (`row_keys`; one row).
            outputs: per rule, the output-derived rule's label of the row (a list of one) when computed already.

        Returns:
            (per_rule as `rule_labels` gives it, the group's keys), or None when an output-derived rule has no
            label in `outputs` (the caller takes `rule_labels` and `groups_of`).
        """
        per_rule: list[str | list[str]] = []
        sig: list[str | tuple[str]] = []
        for n_rule, lab in enumerate(keys.labels):
            if lab is None:
                lab = outputs[n_rule] if outputs is not None else None
                if lab is None:
                    return None
            per_rule.append(lab)
            sig.append(lab if isinstance(lab, str) else (lab[0],))
        memo = self.one_row_keys
        key = tuple(sig)
        got = memo.get(key)
        if got is None:
            got = tuple(self.groups_of(per_rule, 1)[0][0])  # one row: one group
            if len(memo) >= ONE_ROW_MEMO:
                memo.clear()
            memo[key] = got
        return per_rule, got

    def groups_of(self, per_rule: Sequence[str | list[str]], n: int) -> list[tuple[list[str], list[int] | None]]:
        """`row_groups` from the rules' labels of n kept rows (`rule_labels`)."""
        varying = [r for r, lab in enumerate(per_rule) if not isinstance(lab, str)]
        if len(varying) == 1:
            return self._groups_of_one(per_rule, varying[0], n)
        return self._groups_of_any(per_rule, n)

    def _groups_of_any(self, per_rule: Sequence[str | list[str]], n: int
                       ) -> list[tuple[list[str], list[int] | None]]:
        """`groups_of` for any labels: every key's rows (rule keys, then pair keys, each by first row), keys with
        the same rows one group."""
        rows_of: dict[str, list[int]] = {}
        whole: list[str] = [ALL_SLICE]
        names = [r.name for r in self.rules]
        for name, lab in zip(names, per_rule):
            if isinstance(lab, str):
                whole.append(f"{name}={lab}")
            else:
                by_label: dict[str, list[int]] = {}
                for i, x in enumerate(lab):
                    by_label.setdefault(x, []).append(i)
                for x, idx in by_label.items():
                    rows_of[f"{name}={x}"] = idx
        for i, j in self.pairs:
            li, lj = per_rule[i], per_rule[j]
            if isinstance(li, str) and isinstance(lj, str):
                whole.append(f"{names[i]}={li}{PAIR_SEPARATOR}{names[j]}={lj}")
                continue
            a = [li] * n if isinstance(li, str) else li
            b = [lj] * n if isinstance(lj, str) else lj
            for k, (x, y) in enumerate(zip(a, b)):
                rows_of.setdefault(f"{names[i]}={x}{PAIR_SEPARATOR}{names[j]}={y}", []).append(k)
        by_rows: dict[tuple[int, ...], list[str]] = {}
        for key, idx in rows_of.items():
            if len(idx) == n:
                whole.append(key)
            else:
                by_rows.setdefault(tuple(idx), []).append(key)
        return [(whole, None), *((ks, list(idx)) for idx, ks in by_rows.items())]

    def _groups_of_one(self, per_rule: Sequence[str | list[str]], v: int, n: int
                       ) -> list[tuple[list[str], list[int] | None]]:
        """`groups_of` when only rule v has labels that differ by row (the common case: `predicted` or `topic`
        beside request-level rules): its labels partition the rows, so each label is one group (or, when it is
        the only one, joins the group of every row), with the keys of the pairs that hold rule v beside it."""
        rules = self.rules
        whole: list[str] = [ALL_SLICE]
        for r, lab in enumerate(per_rule):
            if r != v:
                whole.append(f"{rules[r].name}={lab}")
        with_v: list[tuple[str, str]] = []  # (prefix, suffix) of the key of each pair holding rule v
        for i, j in self.pairs:
            if v not in (i, j):
                whole.append(f"{rules[i].name}={per_rule[i]}{PAIR_SEPARATOR}{rules[j].name}={per_rule[j]}")
            elif i == v:
                with_v.append((f"{rules[i].name}=", f"{PAIR_SEPARATOR}{rules[j].name}={per_rule[j]}"))
            else:
                with_v.append((f"{rules[i].name}={per_rule[i]}{PAIR_SEPARATOR}{rules[j].name}=", ""))
        labels = per_rule[v]
        prefix = f"{rules[v].name}="
        first = labels[0] if n else None
        if labels.count(first) == n:  # one label: every row (a one-row request, a request of one class)
            if n:
                whole += [prefix + first] + [a + first + b for a, b in with_v]  # type: ignore[operator]
            return [(whole, None)]
        by_label: dict[str, list[int]] = {}
        for i, x in enumerate(labels):
            rows = by_label.get(x)
            if rows is None:
                by_label[x] = [i]
            else:
                rows.append(i)
        if with_v:
            return [(whole, None)] + [([prefix + x] + [a + x + b for a, b in with_v], idx)
                                      for x, idx in by_label.items()]
        return [(whole, None)] + [([prefix + x], idx) for x, idx in by_label.items()]

    def keys_per_row(self, per_rule: Sequence[str | list[str]], n: int) -> list[list[str]]:
        """Each of n kept rows' own slice keys, laid out as `slice_keys` lays out a request's: ``all``, one per
        rule, one per pair (the sampled-pair record's `slices`; sink.redact_slices reads them by position)."""
        names = [r.name for r in self.rules]
        cols = [[f"{name}={lab}"] * n if isinstance(lab, str) else [f"{name}={x}" for x in lab]
                for name, lab in zip(names, per_rule)]
        labs = [[lab] * n if isinstance(lab, str) else lab for lab in per_rule]
        pair_cols = [[f"{names[i]}={x}{PAIR_SEPARATOR}{names[j]}={y}" for x, y in zip(labs[i], labs[j])]
                     for i, j in self.pairs]
        return [[ALL_SLICE, *row] for row in zip(*cols, *pair_cols)] if cols else [[ALL_SLICE] for _ in range(n)]

    def slice_keys(self, meta: Mapping[str, Any]) -> tuple[list[str], int]:
        """Slice keys of one request from its metadata alone: ``all``, ``<rule name>=<group>`` per rule, then
        ``<a>=<x>&<b>=<y>`` per pair (`row_keys` without tensors or headers: derived input rules and headers
        give `missing`, output rules no key).

        Args:
            meta: the request's slice metadata (OIP parameters or a replay row's metadata columns).

        Returns:
            (keys, how many group labels `clean_label` had to change). Every key is measured
            (monitoring/detector.py bounds the memory; monitoring/prometheus.py bounds the exported labels). With
            `new_values`, a value past its column's rate of new values is lumped into `<name>=__new__` (also in
            the pair keys).
        """
        keys, cut = self.row_keys(meta)
        return list(keys), cut

    def rule_keys(self, rule: SliceRule) -> int:
        """Most keys of `rule` one request can carry: 1 for a rule with one value per request (a column without
        per_row_metadata, a header); for a per-row rule min(monitoring.max_batch_rows, its groups), the groups
        unbounded (None) counting as max_batch_rows."""
        per_row = rule.derived or (rule.source == "column" and self.mon.per_row_metadata)
        if not per_row:
            return 1
        most = self.mon.max_batch_rows
        return most if rule.groups is None else min(most, rule.groups)

    @property
    def keys_per_request(self) -> int:
        """G: the most slice keys one request can carry (`all` + per rule `rule_keys` + per pair the product of
        its rules', capped at max_batch_rows): the family count of the false-alarm budget (docs/monitor.md)."""
        pairs = 0
        for i, j in self.pairs:
            a, b = self.rule_keys(self.rules[i]), self.rule_keys(self.rules[j])
            pairs += a * b if a == 1 or b == 1 else min(self.mon.max_batch_rows, a * b)
        return 1 + sum(self.rule_keys(r) for r in self.rules) + pairs

    @property
    def metadata_columns(self) -> list[str]:
        """Metadata columns / request parameters the column slice rules read."""
        return list(dict.fromkeys(r.column for r in self.rules if r.source == "column"))

    @property
    def header_names(self) -> list[str]:
        """Headers (lower case) the header slice rules read."""
        return list(dict.fromkeys(r.column for r in self.rules if r.source == "header"))


def _fixed_elements(t: TensorSpec) -> int | None:
    n = 1
    for a in t.shape[1:]:
        if not isinstance(a, int):
            return None
        n *= a
    return n


def _rule_from_slice(s: SliceSpec, output: TensorSpec) -> SliceRule:
    bins = tuple(float(b) for b in s.bins) if s.bins else None
    values = frozenset(_label(v) for v in s.values) if s.values else None
    groups = len(bins) + 2 if bins else len(values) + 2 if values else None
    if s.derive is not None:
        d = s.derive
        if groups is None and d.reduce == "nearest_centroid":
            groups = int(d.centroids or 0) + 1
        elif groups is None and d.reduce == "argmax" and d.output is not None:
            n = (d.select[1] - d.select[0]) if d.select else _fixed_elements(output)
            groups = n + 1 if n else None
        return SliceRule(s.name, s.name, bins, values, "input" if d.input is not None else "output", s, groups)
    if s.header is not None:
        return SliceRule(s.name, s.header.lower(), bins, values, "header", None, groups)
    return SliceRule(s.name, s.column or s.name, bins, values, "column", None, groups)


def resolve_config(spec: Spec, *, source: str = "spec", centroids: Mapping[str, np.ndarray] | None = None
                   ) -> MonitorConfig:
    """Resolve the spec's monitoring section.

    Slices: monitoring.slice_columns, else every declared slice plus, by model task, `predicted` (classification) or
    `topic` (embedding, when `centroids` has centroids for it) unless a slice of that name is declared.

    Args:
        spec: a validated Spec.
        source: file name for error messages.
        centroids: {slice name: (k, dim)} of the nearest_centroid slices (the pipeline's centroids.npz,
            `monitor serve --centroids`).

    Returns:
        The MonitorConfig.

    Raises:
        SpecError: no monitoring section; a metric or threshold the model task does not produce, a threshold on the
            wrong side of its metric or outside its range (`MonitoringSpec.model_task_problems`, which `spec check` runs
            too; here also for the model task's default thresholds); a quantile slice (its edges depend on data the
            monitor does not hold: give `bins`); every problem with its field path.
    """
    mon = spec.monitoring
    if mon is None:
        raise SpecError([FieldError("monitoring", "section missing")], source=source,
                        hint="add `monitoring: {sample_rate: 0.05}` (sample_rate is required)")
    model_task = spec.model.task
    errors: list[FieldError] = mon.model_task_problems(model_task)  # the checks `spec check` runs (tailguard.core.spec)
    metrics = tuple(mon.metrics) if mon.metrics else DEFAULT_METRICS[model_task]
    if CANDIDATE_ERROR not in metrics:  # failures always count (docs/monitor.md, Failures)
        metrics = (*metrics, CANDIDATE_ERROR)
    thresholds = dict(mon.thresholds if mon.thresholds is not None else DEFAULT_THRESHOLDS[model_task])
    thresholds.setdefault(CANDIDATE_ERROR, CANDIDATE_ERROR_THRESHOLD)
    bounds: dict[str, Bound] = {}
    for m, t in thresholds.items():
        path = f"monitoring.thresholds.{m}"
        if mon.thresholds is None or m not in mon.thresholds:  # defaults: not in the spec, so checked here
            if m not in metrics:
                errors.append(FieldError(path, f"the default threshold on {m!r} needs it tracked; tracked metrics: "
                                               f"{list(metrics)} (add {m!r} to monitoring.metrics, or set "
                                               "monitoring.thresholds: {})"))
                continue
            errors.extend(t.problems(m, path))
        if any(e.loc == path or e.loc.startswith(path + ".") for e in errors):
            continue
        hib = HIGHER_IS_BETTER[m]
        if t.baseline is not None:
            value = t.baseline - t.max_drop if hib else t.baseline + t.max_drop  # type: ignore[operator]
            bounds[m] = Bound(m, float(value), hib, "baseline-max_drop", t.truncate_at)
        elif t.min is not None:
            bounds[m] = Bound(m, float(t.min), True, "min")
        else:
            bounds[m] = Bound(m, float(t.max), False, "max", t.truncate_at)  # type: ignore[arg-type]
    declared = {s.name: s for s in spec.slices}
    centroids = dict(centroids or {})
    rules: list[SliceRule] = []
    names = mon.slice_columns if mon.slice_columns is not None else list(declared)
    for d in default_derived_slices(model_task):  # `predicted` / `topic` may be named in slice_columns, or added
        if d.name not in declared:
            declared[d.name] = d
            if mon.slice_columns is None and (d.derive.reduce != "nearest_centroid" or d.name in centroids):
                names.append(d.name)
            elif mon.slice_columns is None:
                log.info("default slice %r not tracked: no centroids (pass --centroids or --candidate-version)",
                         d.name)
    for i, name in enumerate(names):
        if name == ALL_SLICE:
            errors.append(FieldError(f"monitoring.slice_columns.{i}", f"{ALL_SLICE!r} is reserved"))
        elif name in declared:
            if declared[name].quantiles is not None:
                errors.append(FieldError(f"monitoring.slice_columns.{i}", (
                    f"slice {name!r} uses quantiles, whose edges depend on the validation data; declare "
                    "bins for it (or name its column) to monitor it")))
            elif (declared[name].derive is not None and declared[name].derive.reduce == "nearest_centroid"
                  and name not in centroids):
                errors.append(FieldError(f"monitoring.slice_columns.{i}" if mon.slice_columns is not None
                                         else f"slices.{list(declared).index(name)}.derive", (
                    f"slice {name!r} is the nearest of centroids fitted by the pipeline: pass them with "
                    "--centroids <the centroids.npz logged with the variant's validate run>")))
            else:
                rules.append(_rule_from_slice(declared[name], spec.model.outputs[0]))
        else:
            rules.append(SliceRule(name, name))
    pairs: list[tuple[int, int]] = []
    if mon.slice_pairs is True:
        pairs = [(i, j) for i in range(len(rules)) for j in range(i + 1, len(rules))]
    elif mon.slice_pairs:
        index = {r.name: i for i, r in enumerate(rules)}
        for n, pair in enumerate(mon.slice_pairs):
            missing = [c for c in pair if c not in index]
            if missing:
                errors.append(FieldError(f"monitoring.slice_pairs.{n}", (
                    f"{missing} not among the monitored slices {list(index)}; name two of slice_columns")))
            elif pair[0] == pair[1]:
                errors.append(FieldError(f"monitoring.slice_pairs.{n}", "a pair needs two different slices"))
            else:
                ij = tuple(sorted((index[pair[0]], index[pair[1]])))
                if ij not in pairs:
                    pairs.append(ij)  # type: ignore[arg-type]
    if errors:
        raise SpecError(errors, source=source, hint="see docs/monitor.md for the monitoring section")
    return MonitorConfig(spec=spec, mon=mon, model_task=model_task, inputs=list(spec.model.inputs),
                         output=spec.model.outputs[0], model_name=mon.model_name or spec.metadata.name, rules=rules,
                         metrics=metrics, bounds=bounds, pairs=pairs, centroids=centroids)
