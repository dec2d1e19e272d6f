"""The monitor's resolved configuration: the spec's `monitoring` section plus what it needs from the rest of
the spec (task, inputs, declared slices), with task-dependent defaults filled in and checked.

Slice rules turn one request's metadata (OIP `parameters`, or a replay row's metadata columns) into slice
keys such as ``length=[16,32)`` or ``domain=legal``; every request also belongs to the slice ``all``.
"""

from __future__ import annotations

import hmac
import math
import os
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from tailguard.core.errors import FieldError, InputError, SpecError
from tailguard.core.metrics import ROW_METRICS, TASKS, monitor_metrics
from tailguard.core.spec.models import SliceSpec, Spec, TensorSpec
from tailguard.core.spec.monitor import MonitorThreshold, MonitoringSpec

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
# A slice value past monitoring.max_new_values_per_minute new values of its column is grouped under this label
# (`<name>=__new__`) instead of getting its own key: a flood of unique values costs one key (issue 22).
NEW_VALUE = "__new__"
MIN_TOKEN_CHARS = 16  # a shorter bearer token is refused (exit 2): guessable
# Tracked per-row metrics by default: every one the task's parity computes for a single pair (catalogue order).
DEFAULT_METRICS: dict[str, tuple[str, ...]] = {t: monitor_metrics(t) for t in TASKS}
# Default alert thresholds. 0.97 top-1 agreement matches the per-slice gate of the example spec
# (the project's design brief); 0.98 cosine is the usual "near-lossless" bar for INT8 sentence embeddings.
# A candidate that fails on a sampled row (raises, times out, answers a wrong shape) scores 1 on this per-row
# metric; it is tracked for every task and alerts at any failure (max 0) unless monitoring.thresholds sets it.
CANDIDATE_ERROR = "candidate_error_rate"
CANDIDATE_ERROR_THRESHOLD = MonitorThreshold(max=0.0)
DEFAULT_THRESHOLDS: dict[str, dict[str, MonitorThreshold]] = {
    "classification": {"top1_agree": MonitorThreshold(min=0.97)},
    "embedding": {"cosine_similarity": MonitorThreshold(min=0.98)},
    "regression": {},
    "generic": {},
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
        column: metadata column / request parameter read.
        bins: left-closed bin edges [a, b) (values outside go to `<name>=out_of_range`), or None.
        values: only these values get their own group (the rest: `<name>=other`), or None for every value.
    """

    name: str
    column: str
    bins: tuple[float, ...] | None = None
    values: frozenset[str] | None = None

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
    """A slice value made safe for every exporter: valid UTF-8 (lone surrogates, which UTF-8 cannot encode, become "?") and at most MAX_LABEL_CHARS characters (longer ones are cut and end in "~").

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


@dataclass
class MonitorConfig:
    """Everything the sampler, statistics and exporters need, resolved from a Spec.

    Attributes:
        spec: the whole spec.
        mon: its monitoring section.
        task: model.task.
        inputs: model.inputs (name, dtype, shape).
        output: model.outputs[0] (the compared output).
        model_name: name in the OIP paths and the `model` metric label.
        rules: slice rules, in order.
        metrics: tracked per-row metrics.
        bounds: {metric: Bound} for metrics with a threshold.
        pairs: (i, j) indices into `rules` whose intersections are slices too (monitoring.slice_pairs).
        new_values: the per-column cap on new slice values (the service sets it from
            monitoring.max_new_values_per_minute); None: every value gets its own key (replay: deterministic).
    """

    spec: Spec
    mon: MonitoringSpec
    task: str
    inputs: list[TensorSpec]
    output: TensorSpec
    model_name: str
    rules: list[SliceRule]
    metrics: tuple[str, ...]
    bounds: dict[str, Bound] = field(default_factory=dict)
    pairs: list[tuple[int, int]] = field(default_factory=list)
    new_values: NewValueLimiter | None = None

    def slice_keys(self, meta: Mapping[str, Any]) -> tuple[list[str], int]:
        """Slice keys of one request: ``all``, ``<rule name>=<group>`` per rule, then ``<a>=<x>&<b>=<y>`` per pair.

        Args:
            meta: the request's slice metadata (OIP parameters or a replay row's metadata columns).

        Returns:
            (keys, how many group labels `clean_label` had to change). Every key is measured
            (monitoring/detector.py bounds the memory; monitoring/prometheus.py bounds the exported labels). With
            `new_values`, a value past its column's rate of new values is lumped into `<name>=__new__` (also in
            the pair keys).
        """
        parts, cut = [], 0
        for r in self.rules:
            label, changed = clean_label(r.group(meta.get(r.column)))
            if self.new_values is not None:
                label = self.new_values.admit(r.name, label)
            cut += changed
            parts.append(f"{r.name}={label}")
        return [ALL_SLICE, *parts, *(parts[i] + PAIR_SEPARATOR + parts[j] for i, j in self.pairs)], cut

    @property
    def keys_per_request(self) -> int:
        """G: slice keys every request carries (`all` + one per rule + one per pair)."""
        return 1 + len(self.rules) + len(self.pairs)

    @property
    def metadata_columns(self) -> list[str]:
        """Metadata columns / request parameters the slice rules read."""
        return list(dict.fromkeys(r.column for r in self.rules))


def _rule_from_slice(s: SliceSpec) -> SliceRule:
    return SliceRule(s.name, s.column, tuple(float(b) for b in s.bins) if s.bins else None,
                     frozenset(_label(v) for v in s.values) if s.values else None)


def resolve_config(spec: Spec, *, source: str = "spec") -> MonitorConfig:
    """Resolve the spec's monitoring section.

    Args:
        spec: a validated Spec.
        source: file name for error messages.

    Returns:
        The MonitorConfig.

    Raises:
        SpecError: no monitoring section; a metric or threshold the task does not produce, a threshold on the
            wrong side of its metric or outside its range (`MonitoringSpec.task_problems`, which `spec check` runs
            too; here also for the task's default thresholds); a quantile slice (its edges depend on data the
            monitor does not hold: give `bins`); every problem with its field path.
    """
    mon = spec.monitoring
    if mon is None:
        raise SpecError([FieldError("monitoring", "section missing")], source=source,
                        hint="add `monitoring: {sample_rate: 0.05}` (sample_rate is required)")
    task = spec.model.task
    errors: list[FieldError] = mon.task_problems(task)  # the checks `spec check` runs (tailguard.core.spec)
    metrics = tuple(mon.metrics) if mon.metrics else DEFAULT_METRICS[task]
    if CANDIDATE_ERROR not in metrics:  # failures always count (docs/monitor.md, Failures)
        metrics = (*metrics, CANDIDATE_ERROR)
    thresholds = dict(mon.thresholds if mon.thresholds is not None else DEFAULT_THRESHOLDS[task])
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
    rules: list[SliceRule] = []
    names = mon.slice_columns if mon.slice_columns is not None else list(declared)
    for i, name in enumerate(names):
        if name == ALL_SLICE:
            errors.append(FieldError(f"monitoring.slice_columns.{i}", f"{ALL_SLICE!r} is reserved"))
        elif name in declared:
            if declared[name].quantiles is not None:
                errors.append(FieldError(f"monitoring.slice_columns.{i}", (
                    f"slice {name!r} uses quantiles, whose edges depend on the validation data; declare "
                    "bins for it (or name its column) to monitor it")))
            else:
                rules.append(_rule_from_slice(declared[name]))
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
    return MonitorConfig(spec=spec, mon=mon, task=task, inputs=list(spec.model.inputs), output=spec.model.outputs[0],
                         model_name=mon.model_name or spec.metadata.name, rules=rules, metrics=metrics, bounds=bounds,
                         pairs=pairs)
