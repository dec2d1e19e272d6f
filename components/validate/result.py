"""The validate step's result for one variant (`ValidationResult`, result.json) and its MLflow metric names.

MLflow metric names (`ValidationResult.mlflow_metrics`, docs/architecture.md "MLflow names"):

    <parity metric>                   overall, e.g. top1_agreement, cosine_similarity.p01, abs_error.max
    peak_rss_mb, model_size_mb        overall resources (MiB), when measured
    quantized_mac_fraction            INT8 builds: MACs in INT8 / all MACs (gates.build_metrics)
    non_finite_rows                   validation rows whose candidate output had NaN/inf
    rows_used                         validation rows scored (fewer than all when sequential validation
                                      decided every gate first, `analysis.sequential`)
    gates_passed                      1.0 when the variant passed its gates, else 0.0
    <perf metric>                     at the FIRST benchmark batch size (the gates' default):
                                      latency_ms.p50/.p95/.p99/.mean, throughput_per_s,
                                      usd_per_1m_inferences, speedup_vs_torch, speedup_vs_onnx_fp32,
                                      speedup_vs_onnx_fp32.lb95/.ub95 (when timed interleaved),
                                      latency_ms.p50.lb95/.ub95, latency_ms.p99.ub95 (order statistics)
    bs<N>.<perf metric>               the same at every batch size N (first one included), plus
                                      bs<N>.n_iterations and, timed to benchmark.precision, bs<N>.looks
    slice.<slice>.<value>.<metric>    per slice group, and slice.<slice>.<value>.support; <value> is
                                      sanitised to [A-Za-z0-9_.- ] (every other character, '/' included,
                                      becomes '_'; a key clash after that gets a suffix _2, _3, ...); a value
                                      that would make "slice.<slice>.<value>" longer than 160 characters is
                                      cut and ends with -h<16 hex of its sha256> (`slice_key_prefix`), so no
                                      key passes MLflow's 250-character limit
    discovered.count                  slices worst-slice discovery marked significant (only when it ran)
    discovered.<i>.drop               for the i-th worst significant discovered slice, i = 1..5: its drop
    discovered.<i>.support            (metric units, > 0 = worse than the rest), support (rows) and
    discovered.<i>.q_value            Benjamini-Hochberg q-value
    hardware_dependent                the numerics check (only when it ran, `numerics_check`): 1.0 when the
                                      gates or the worst slice differ between the node's INT8 kernels and exact
                                      integer accumulation beyond NUMERICS_TOLERANCE, else 0.0
    exact.<parity metric>             overall parity metrics of the exact-accumulation pass
    exact.slice.<slice>.<value>.<m>   per slice group, the exact pass's value of the key metric m (the one the
                                      worst slice is ranked by); every metric is in slices_exact.csv
    numerics.worst_slice_delta        |native - exact| of the worst slice's key metric (metric units)
    numerics.max_slice_delta          the largest |native - exact| over judged slice groups (metric units)
    numerics.gate_differences         gates whose status differs between the two passes
    numerics.native_seconds           seconds of the native pass (run + scoring + gates)
    numerics.exact_seconds            seconds of the exact pass (session + run + scoring + gates)

Values that are None or NaN (a metric not measured, a group with no rows) are left out; +inf is kept
(MLflow's SQL store clamps it to the largest float).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tailguard.core.errors import InputError

from .gates import GateResult

PERF_KEYS = ("latency_ms.p50", "latency_ms.p95", "latency_ms.p99", "latency_ms.mean", "throughput_per_s",
             "usd_per_1m_inferences", "speedup_vs_torch", "speedup_vs_onnx_fp32",
             # bounds of the speed ratios when the baselines were timed interleaved (latency.add_speed_ratios)
             "speedup_vs_torch.lb95", "speedup_vs_torch.ub95", "speedup_vs_onnx_fp32.lb95",
             "speedup_vs_onnx_fp32.ub95",
             # distribution-free bounds of the p50 / p99 (latency.add_quantile_bounds)
             "latency_ms.p50.lb95", "latency_ms.p50.ub95", "latency_ms.p99.ub95")


_KEY_BAD = re.compile(r"[^A-Za-z0-9_.\- ]")


DISCOVERED_METRICS_TOP = 5  # discovered.<i>.* MLflow metrics for the i = 1..5 worst significant slices


def sanitize_key_part(value: str) -> str:
    """A slice value made safe inside an MLflow metric key: characters outside [A-Za-z0-9_.- ] become '_'.

    '/' is replaced too although MLflow allows it: MLflow rejects keys that change under path normalisation.
    """
    return _KEY_BAD.sub("_", str(value)) or "_"


# MLflow refuses metric keys longer than 250 characters (mlflow/utils/validation.py MAX_ENTITY_KEY_LENGTH). The
# longest key made from a slice group is "exact." + prefix + a clash suffix "_NN" + "." + metric; with the prefix
# "slice.<slice>.<value>" at most SLICE_KEY_PREFIX_MAX characters, every metric name up to 80 characters fits
# (the longest per-slice metric today: nn_top1_margin_agreement, 24).
SLICE_KEY_PREFIX_MAX = 160


SLICE_KEY_HASH_HEX = 16  # hex digits of sha256 kept in a shortened value (64 bits)


def slice_key_prefix(slice_name: str, value: Any) -> str:
    """The MLflow key prefix of one slice group, "slice.<slice>.<value>", at most SLICE_KEY_PREFIX_MAX characters.

    The value is sanitised (`sanitize_key_part`). When the prefix would be longer, the value is shortened, stably:
    its sanitised text cut to fit, then "-h" and the first SLICE_KEY_HASH_HEX hex digits of the sha256 of the raw
    value's UTF-8 bytes (so two long values with the same beginning get different keys, and a value always gets
    the same key). slices.csv, result.json and the report keep the full value.

    Example: a 300-character value "aaa...a" of slice "topic" gives
    "slice.topic.aaa...a-h<16 hex>" (160 characters).
    """
    head = f"slice.{slice_name}."
    part = sanitize_key_part(value)
    if len(head) + len(part) <= SLICE_KEY_PREFIX_MAX:
        return head + part
    digest = hashlib.sha256(str(value).encode("utf-8", "surrogatepass")).hexdigest()[:SLICE_KEY_HASH_HEX]
    keep = max(SLICE_KEY_PREFIX_MAX - len(head) - len(digest) - 2, 0)
    return f"{head}{part[:keep]}-h{digest}"


@dataclass
class ValidationResult:
    """Everything the validate step measured and decided for one variant.

    Attributes:
        variant: variant name.
        model_task: the spec's model.task.
        rows: rows of the validation set.
        overall: overall-scope metrics: the parity metrics (`parity.aggregate`), plus "peak_rss_mb" (MiB)
            and "model_size_mb" (MiB) when measured.
        perf: {batch size: `latency.benchmark` entry + "usd_per_1m_inferences" (USD, when the spec has a cost
            section), "speedup_vs_torch" / "speedup_vs_onnx_fp32" (baseline p50 / variant p50, when the
            baseline was given)}; "samples_ms" (raw timings, ms) is kept.
        slices: per-slice table records ({slice, value, support, <metric>: float}).
        gates: one GateResult per spec gate.
        passed: the variant passed its gates (`gates.all_passed`: none failed, none had insufficient data).
        non_finite_rows: validation rows whose candidate output held NaN/inf.
        batch_sizes: benchmark batch sizes, in spec order (the first is the default for gates and metrics).
        files: {"report": path, "slices_csv": path, "result_json": path, "worst_samples_csv": path,
            "discovered_csv": path (only when discovery ran)}.
        worst_slice: the slice group with the worst value of the report's key metric among groups with
            support >= the smallest per-slice gate min_support (30 without per-slice gates):
            {slice, value, support, metric, observed}; None when no group qualifies.
        discovered: the worst-slice discovery table as records ({slice, value, support, metric,
            value_in_slice, value_rest, drop, p_value, q_value, significant}), worst first; [] when discovery
            did not run or tested no slice.
        discovery: {"tested": slices tested, "significant": slices marked significant, "method":
            test and correction in words, "metric": the metric tested} when discovery ran, else None.
        numerics: the numerics check: `compare_numerics` output when the exact-accumulation pass ran, else
            `not_checked(reason, ...)` ({"status": "not_checked", "hardware_dependent": None, "reason": why});
            None in results written before it existed.
        exact_slices: the exact pass's per-slice table records (same columns as `slices`); [] when it did not
            run.
        rows_used: validation rows scored: `rows` unless sequential validation (`analysis.sequential`) stopped
            earlier, when every metric, table and gate is over the rows scored (the parity gates decided on the
            confidence sequence, `sequential.py`); None in results written before it existed.
        sequential: `sequential.describe` (settings, rows used, each gate's mode and the rows at which it was
            decided) when sequential validation ran, else None.
    """

    variant: str
    model_task: str
    rows: int
    overall: dict[str, float]
    perf: dict[int, dict[str, Any]]
    slices: list[dict[str, Any]]
    gates: list[GateResult]
    passed: bool
    non_finite_rows: int
    batch_sizes: list[int]
    files: dict[str, str] = field(default_factory=dict)
    worst_slice: dict[str, Any] | None = None
    discovered: list[dict[str, Any]] = field(default_factory=list)
    discovery: dict[str, Any] | None = None
    numerics: dict[str, Any] | None = None
    exact_slices: list[dict[str, Any]] = field(default_factory=list)
    rows_used: int | None = None
    sequential: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-serializable form (perf keys become strings in JSON; `from_dict` turns them back)."""
        return {"variant": self.variant, "task": self.model_task, "rows": self.rows, "overall": dict(self.overall),
                "perf": {str(k): v for k, v in self.perf.items()}, "slices": list(self.slices),
                "gates": [g.to_dict() for g in self.gates], "passed": self.passed,
                "non_finite_rows": self.non_finite_rows, "batch_sizes": list(self.batch_sizes),
                "files": dict(self.files), "worst_slice": self.worst_slice,
                "discovered": list(self.discovered), "discovery": self.discovery, "numerics": self.numerics,
                "exact_slices": list(self.exact_slices), "rows_used": self.rows_used,
                "sequential": self.sequential}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ValidationResult":
        """Inverse of `to_dict` (also accepts the parsed result.json)."""
        return cls(variant=d["variant"], model_task=d["task"], rows=int(d["rows"]), overall=dict(d["overall"]),
                   perf={int(k): v for k, v in d["perf"].items()}, slices=list(d["slices"]),
                   gates=[GateResult.from_dict(g) for g in d["gates"]], passed=bool(d["passed"]),
                   non_finite_rows=int(d["non_finite_rows"]), batch_sizes=[int(b) for b in d["batch_sizes"]],
                   files=dict(d.get("files", {})), worst_slice=d.get("worst_slice"),
                   discovered=list(d.get("discovered") or []), discovery=d.get("discovery"),
                   numerics=d.get("numerics"), exact_slices=list(d.get("exact_slices") or []),
                   rows_used=d.get("rows_used"), sequential=d.get("sequential"))

    @classmethod
    def load(cls, path: str | Path) -> "ValidationResult":
        """Read a result.json written by `validate_variant`.

        Raises:
            InputError: missing or unreadable file.
        """
        p = Path(path)
        try:
            return cls.from_dict(json.loads(p.read_text()))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise InputError(f"cannot read validation result {p}: {exc}",
                             hint="re-run the validate step for this variant") from None

    def mlflow_metrics(self) -> dict[str, float]:
        """Flat {MLflow metric key: value} (naming scheme: module docstring)."""
        out: dict[str, float] = {}

        def put(key: str, value: Any) -> None:
            if value is None or isinstance(value, (str, bool, list, dict)):
                return
            f = float(value)
            if not math.isnan(f):
                out[key] = f

        for k, v in self.overall.items():
            put(k, v)
        put("non_finite_rows", self.non_finite_rows)
        put("rows_used", self.rows_used)
        put("gates_passed", 1.0 if self.passed else 0.0)
        first = self.batch_sizes[0] if self.batch_sizes else None
        for bs in self.batch_sizes:
            row = self.perf.get(bs) or {}
            for k in PERF_KEYS:
                put(f"bs{bs}.{k}", row.get(k))
                if bs == first:
                    put(k, row.get(k))
            put(f"bs{bs}.n_iterations", row.get("n_iterations"))
            put(f"bs{bs}.looks", row.get("looks"))
        for key, rec in _slice_keys(self.slices):
            for k, v in rec.items():
                if k not in ("slice", "value"):
                    put(f"{key}.{k}", v)
        num = self.numerics or {}
        if num.get("hardware_dependent") is not None:  # the numerics check ran (module docstring)
            put("hardware_dependent", 1.0 if num["hardware_dependent"] else 0.0)
            for k, v in (num.get("exact_overall") or {}).items():
                put(f"exact.{k}", v)
            metric = num.get("metric")
            for key, rec in _slice_keys(self.exact_slices):
                if metric:
                    put(f"exact.{key}.{metric}", rec.get(metric))
            for k in ("worst_slice_delta", "max_slice_delta", "native_seconds", "exact_seconds"):
                put(f"numerics.{k}", num.get(k))
            put("numerics.gate_differences", len(num.get("gate_differences") or []))
        if self.discovery is not None:
            significant = [r for r in self.discovered if bool(r.get("significant"))]
            put("discovered.count", len(significant))
            for i, rec in enumerate(significant[:DISCOVERED_METRICS_TOP], start=1):
                for k in ("drop", "support", "q_value"):
                    put(f"discovered.{i}.{k}", rec.get(k))
        return out


def _slice_keys(records: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """(MLflow key prefix "slice.<slice>.<sanitized value>", record) per slice record; a clash after sanitizing
    gets a suffix _2, _3, ... in record order."""
    used: set[str] = set()
    out = []
    for rec in records:
        base = slice_key_prefix(rec["slice"], rec["value"])
        key, n = base, 1
        while key in used:
            n += 1
            key = f"{base}_{n}"
        used.add(key)
        out.append((key, rec))
    return out
