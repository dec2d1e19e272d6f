"""Gates: the spec's thresholds (`spec.gates`, declarative `GateSpec`s) evaluated on one variant's metrics.

Config and computation are apart: a `GateSpec` says what must hold; `evaluate_gates` computes a
`GateResult` for every gate (all of them, never stopping at the first failure) that records the threshold,
the operator, the batch size and the method actually used, the observed value and the evidence.

Statuses:
    passed / failed      the gate was evaluated.
    insufficient_data    per-slice gate where no group reaches `min_support` rows: nothing could be judged.
    not_applicable       the gate's `variants` list does not name this variant.

Rules:
    overall parity gate   observed = overall[metric].
    per-slice gate        every group (of `gate.slice`, or of every slice) with support >= min_support must
                          pass; groups under min_support are listed as insufficient data (never passed, never
                          failed); observed = the worst judged group's value (lowest for `min`, highest for
                          `max`); detail lists the failing and the insufficient groups with value and support.
    performance gate      latency/throughput/cost/speedup (BATCHED_METRICS) from perf[spec.gate_batch_size(gate)];
                          peak_rss_mb / model_size_mb from `overall`.
    a metric that was not measured (no cost section, no torch baseline, no labels for accuracy, NaN) fails
    its gate, with the reason in detail: a threshold the user asked for is never silently skipped.

`all_passed` decides a variant: it passes when no gate failed. Insufficient-data gates do not fail it (the
validation set cannot judge them; they are reported, and the report flags a gate where every group was
insufficient); `strict=True` counts them as failures instead.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import pandas as pd

from tailguard.spec import BATCHED_METRICS, PERF_METRICS, GateSpec, Spec

GateStatus = Literal["passed", "failed", "insufficient_data", "not_applicable"]


@dataclass
class GateResult:
    """The outcome of one gate for one variant.

    Attributes:
        gate: the gate's stable key (`GateSpec.key`, e.g. "top1_agreement>=0.97@per_slice:length").
        metric: metric name (TASK_METRICS / PERF_METRICS).
        scope: "overall" or "per_slice".
        threshold: the bound used.
        op: ">=" (spec `min`) or "<=" (spec `max`).
        observed: the value compared (per slice: the worst judged group), or None when nothing was measured.
        passed: True / False, None when insufficient_data or not_applicable.
        status: passed | failed | insufficient_data | not_applicable.
        method: how `observed` was obtained, in words (recorded so the result explains itself).
        batch_size: the batch size of a batched performance metric, else None.
        slice: per-slice gate restricted to one slice, else None.
        min_support: per-slice gates: the support threshold used, else None.
        detail: evidence: per slice, "failing" and "insufficient" lists of {slice, value, observed, support},
            "judged" (groups evaluated); or "reason" when the metric was not measured.
    """

    gate: str
    metric: str
    scope: str
    threshold: float
    op: str
    observed: float | None
    passed: bool | None
    status: GateStatus
    method: str = ""
    batch_size: int | None = None
    slice: str | None = None
    min_support: int | None = None
    detail: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serializable form (inf/NaN stay floats; write with allow_nan)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "GateResult":
        """Inverse of `to_dict`."""
        return cls(**d)


def _bound(gate: GateSpec) -> tuple[str, float]:
    return (">=", float(gate.min)) if gate.min is not None else ("<=", float(gate.max))  # type: ignore[arg-type]


def _ok(value: float, op: str, threshold: float) -> bool:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return False
    return value >= threshold if op == ">=" else value <= threshold


def _num(v: Any) -> float | None:
    if v is None:
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(f) else f


def _single(gate: GateSpec, base: dict[str, Any], value: Any, method: str, missing_reason: str) -> GateResult:
    op, thr = base["op"], base["threshold"]
    v = _num(value)
    if v is None:
        return GateResult(**base, observed=None, passed=False, status="failed", method=method,
                          detail={"reason": missing_reason})
    ok = _ok(v, op, thr)
    return GateResult(**base, observed=v, passed=ok, status="passed" if ok else "failed", method=method)


def _per_slice(gate: GateSpec, base: dict[str, Any], slice_table: pd.DataFrame) -> GateResult:
    op, thr = base["op"], base["threshold"]
    rows = slice_table
    if gate.slice is not None and len(rows):
        rows = rows[rows["slice"] == gate.slice]
    where = f"slice {gate.slice!r}" if gate.slice else "every slice"
    method = f"worst group of {where} with support >= {gate.min_support}; smaller groups: insufficient data"
    if len(rows) and gate.metric not in rows.columns:
        return GateResult(**base, observed=None, passed=False, status="failed", method=method,
                          detail={"reason": f"metric {gate.metric!r} is not in the per-slice table "
                                            f"(columns: {list(rows.columns)})"})
    judged, failing, insufficient = [], [], []
    for rec in rows.to_dict("records"):
        support = int(rec["support"])
        item = {"slice": str(rec["slice"]), "value": str(rec["value"]), "support": support}
        if support < gate.min_support:
            insufficient.append(item)
            continue
        v = _num(rec[gate.metric])
        item["observed"] = v
        judged.append(item)
        if v is None or not _ok(v, op, thr):
            failing.append(item)
    detail: dict[str, Any] = {"judged": len(judged), "failing": failing, "insufficient": insufficient}
    if not judged:
        detail["reason"] = (f"no group of {where} has >= {gate.min_support} rows "
                            f"({len(insufficient)} group(s) insufficient)")
        return GateResult(**base, observed=None, passed=None, status="insufficient_data", method=method,
                          detail=detail)
    vals = [j["observed"] for j in judged]
    if any(v is None for v in vals):
        worst = None
    else:
        worst = min(vals) if op == ">=" else max(vals)
    ok = not failing
    return GateResult(**base, observed=worst, passed=ok, status="passed" if ok else "failed", method=method,
                      detail=detail)


def evaluate_gates(spec: Spec, variant_name: str, overall: dict[str, float], slice_table: pd.DataFrame,
                   perf: dict[int, dict[str, float]]) -> list[GateResult]:
    """Evaluate every gate of the spec for one variant (all of them; rules: module docstring).

    Args:
        spec: the validated spec (gates, benchmark batch sizes).
        variant_name: the variant's name, matched against `gate.variants`.
        overall: overall-scope metrics: the parity metrics of `parity.aggregate` plus, when measured,
            "peak_rss_mb" (MiB) and "model_size_mb" (MiB).
        slice_table: `slices.per_slice_table` output (columns slice, value, support, <metrics>).
        perf: {batch size: {"latency_ms.p50": ms, "latency_ms.p99": ms, "throughput_per_s": rows/s,
            "usd_per_1m_inferences": USD, "speedup_vs_torch": x, ...}} (`latency.benchmark` plus the derived
            metrics of `logic.validate_variant`).

    Returns:
        One GateResult per `spec.gates` entry, in spec order.
    """
    results: list[GateResult] = []
    for gate in spec.gates:
        op, thr = _bound(gate)
        batched = gate.metric in BATCHED_METRICS
        bs = spec.gate_batch_size(gate) if batched else None
        base = dict(gate=gate.key, metric=gate.metric, scope=gate.scope, threshold=thr, op=op, batch_size=bs,
                    slice=gate.slice, min_support=gate.min_support if gate.scope == "per_slice" else None)
        if gate.variants is not None and variant_name not in gate.variants:
            results.append(GateResult(**base, observed=None, passed=None, status="not_applicable",
                                      method=f"gate applies to variants {gate.variants} only"))
            continue
        if gate.scope == "per_slice":
            results.append(_per_slice(gate, base, slice_table))
        elif batched:
            row = perf.get(bs) if bs is not None else None
            reason = (f"no benchmark at batch size {bs}" if row is None else
                      f"{gate.metric} was not measured at batch size {bs}"
                      + (" (no cost section in the spec)" if gate.metric == "usd_per_1m_inferences" else "")
                      + (" (no baseline benchmark given)" if gate.metric.startswith("speedup") else ""))
            results.append(_single(gate, base, (row or {}).get(gate.metric),
                                   f"benchmark at batch size {bs}", reason))
        elif gate.metric in PERF_METRICS:
            results.append(_single(gate, base, overall.get(gate.metric), "measured on this node",
                                   f"{gate.metric} was not measured"))
        else:
            reason = f"{gate.metric} was not computed"
            if gate.metric in ("accuracy", "reference_accuracy"):
                reason += " (needs data.validation.label_column)"
            results.append(_single(gate, base, overall.get(gate.metric), "overall, all validation rows", reason))
    return results


def all_passed(results: list[GateResult], *, strict: bool = False) -> bool:
    """Whether a variant passes its gates.

    Args:
        results: `evaluate_gates` output.
        strict: also fail on gates with status insufficient_data.

    Returns:
        True when no gate failed (and, with strict, none was insufficient_data). not_applicable gates are ignored.
    """
    bad = {"failed", "insufficient_data"} if strict else {"failed"}
    return not any(r.status in bad for r in results)


def insufficient_gates(results: list[GateResult]) -> list[GateResult]:
    """Gates where no group had enough support to be judged (reported prominently, not failed)."""
    return [r for r in results if r.status == "insufficient_data"]
