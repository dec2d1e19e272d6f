"""Gates: the spec's thresholds (`spec.gates`, declarative `GateSpec`s) evaluated on one variant's metrics.

Config and computation are apart: a `GateSpec` says what must hold; `evaluate_gates` computes a
`GateResult` for every gate (all of them, never stopping at the first failure) that records the threshold,
the operator, the batch size and the method actually used, the observed value and the evidence.

Statuses (`tailguard.core.results.GateStatus`):
    passed / failed      the gate was evaluated.
    insufficient_data    per-slice / discovered gate where no group reaches `min_support` rows: nothing could
                         be judged.
    not_applicable       the gate's `variants` list does not name this variant.
    undecided            sequential validation (`sequential.py`) stopped scoring rows because another gate had
                         failed the variant before this one was decided (never set by `evaluate_gates`).

Rules:
    overall parity gate   observed = overall[metric].
    per-slice gate        every group (of `gate.slice`, or of every slice) with support >= min_support must
                          pass; groups under min_support are listed as insufficient data (never passed, never
                          failed); observed = the worst judged group's value (lowest for `min`, highest for
                          `max`; with `max_drop`, the group with the smallest margin to its own threshold);
                          detail lists the failing and the insufficient groups with value and support.
    discovered gate       (scope "discovered") the same rule over the slices that worst-slice discovery
                          (`discovery.discover_slices`) marked significant, point values computed from the
                          per-row values under each slice's mask. No significant slice: passed, with detail
                          reason "no slice discovered"; discovery not run: failed.
    performance gate      latency/throughput/cost/speedup (BATCHED_METRICS) from perf[spec.gate_batch_size(gate)];
                          peak_rss_mb / model_size_mb from `overall`.
    speed-ratio gate with confidence (RATIO_METRICS, e.g. speedup_vs_onnx_fp32): decided on the one-sided bound
                          at the gate's level (lower for `min`, upper for `max`) of the ratio of medians over
                          the rounds in which the baseline was timed interleaved with the variant
                          (`latency.speed_ratio`: paired percentile bootstrap over rounds, seeded by
                          analysis.bootstrap); observed = the bound, estimate = the ratio. Without interleaved
                          timings of that baseline (perf row key "baseline_samples_ms") the gate fails with the
                          reason.
    build gate            (BUILD_METRICS: quantized_mac_fraction) observed = overall[metric], the fact the INT8
                          build stored in the model file (`build_metrics`); not_applicable to a variant that is not
                          INT8 on onnxruntime (a gate without `variants` judges the INT8 variants only).
    a metric that was not measured (no cost section, no torch baseline, no labels for accuracy, NaN) fails
    its gate, with the reason in detail: a threshold the user asked for is never silently skipped.

Relative gates (`max_drop`): threshold = reference score - max_drop (higher-is-better metrics, op ">=") or
+ max_drop (errors, op "<="). The reference score is the FP32 reference's own score on the same rows:
accuracy -> reference_accuracy of those rows (overall, or that group); agreement, overlap and cosine
metrics -> 1.0; abs_error, rel_error, kl_divergence -> 0.0. `threshold` holds the derived value and detail
{"reference_score", "max_drop"} its origin. `max_drop` on reference_accuracy compares the reference with
itself and fails with that reason.

Confidence gates (`confidence`): the decision uses the one-sided bound at that level on the bad side (lower
for higher-is-better metrics, upper for errors) from `intervals.metric_bound` (Wilson score bound for
PROPORTION_METRICS, seeded percentile bootstrap `spec.analysis.bootstrap` otherwise); `observed` is that
bound, `estimate` the point value, `bound` the bound, `decided_on` "bound". A relative accuracy gate with
confidence bounds the PAIRED difference accuracy - reference_accuracy over the same rows (Newcombe 1998
hybrid score, `tailguard.core.stats.newcombe_paired_bound`): observed = reference_accuracy + that lower bound, so
it passes when the lower bound of the difference is >= -max_drop. Confidence gates need the per-row values
(`per_sample`, and `groups` for per-slice gates); without them they fail with the reason.

`all_passed` decides a variant: it passes when every applicable gate passed. A gate with status
insufficient_data was not judged, so it never counts as passed: the variant is not promoted ("not promoted:
gate X had insufficient data", `insufficient_reason`); the report flags the gate, and its status stays
insufficient_data (not failed).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, Sequence

import numpy as np
import pandas as pd

from tailguard.core.contract import QUANTIZATION_COVERAGE_KEY
from tailguard.core.errors import InputError
from tailguard.core.metrics import higher_is_better
from tailguard.core.metrics import metric as catalogue_metric
from tailguard.core.parity import aggregate
from tailguard.core.results import GateStatus, number_or_none
from tailguard.core.spec.gates import BATCHED_METRICS, BUILD_METRICS, PERF_METRICS, RATIO_METRICS, GateSpec
from tailguard.core.spec.root import Spec
from tailguard.core.stats import Side, newcombe_paired_bound

from .intervals import method_words, metric_bound

if TYPE_CHECKING:  # pragma: no cover
    from tailguard.core.slices import SliceGroup

    from .discovery import DiscoveryResult

@dataclass
class GateResult:
    """The outcome of one gate for one variant.

    Attributes:
        gate: the gate's stable key (`GateSpec.key`, e.g. "top1_agreement>=0.97@per_slice:length").
        metric: metric name (MODEL_TASK_METRICS / PERF_METRICS).
        scope: "overall", "per_slice" or "discovered".
        threshold: the threshold compared against: spec `min`/`max`, or for `max_drop` the derived
            reference score -/+ max_drop (per slice: that of the worst judged group); None when a relative
            gate's reference score could not be computed.
        op: ">=" (spec `min`, or `max_drop` on a higher-is-better metric) or "<=".
        observed: the value compared (the bound when decided on the bound; per slice: the worst judged
            group's), or None when nothing was measured.
        passed: True / False, None when insufficient_data or not_applicable.
        status: passed | failed | insufficient_data | not_applicable.
        method: how `observed` was obtained, in words (recorded so the result explains itself).
        batch_size: the batch size of a batched performance metric, else None.
        slice: per-slice gate restricted to one slice, else None.
        min_support: per-slice / discovered gates: the support threshold used, else None.
        detail: evidence: per slice, "failing" and "insufficient" lists of {slice, value, observed, support}
            (with "estimate", "bound" for confidence gates, "threshold", "reference_score" for relative
            gates), "judged" (groups evaluated); "reference_score", "max_drop" for relative gates; or
            "reason" when the metric was not measured.
        estimate: the point value of the metric (per slice: of the worst judged group), or None.
        bound: the one-sided confidence bound used (confidence gates), else None.
        confidence: the gate's confidence level, else None.
        decided_on: "point" (the point estimate was compared), "bound", or "sequential" (decided before the last
            validation row on the confidence sequence of its all-rows value, `sequential.early_result`).
    """

    gate: str
    metric: str
    scope: str
    threshold: float | None
    op: str
    observed: float | None
    passed: bool | None
    status: GateStatus
    method: str = ""
    batch_size: int | None = None
    slice: str | None = None
    min_support: int | None = None
    detail: dict[str, Any] = field(default_factory=dict)
    estimate: float | None = None
    bound: float | None = None
    confidence: float | None = None
    decided_on: str = "point"

    def to_dict(self) -> dict[str, Any]:
        """JSON-serializable form (inf/NaN stay floats; write with allow_nan)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "GateResult":
        """Inverse of `to_dict`; dicts written before estimate/bound/confidence/decided_on existed load with
        their defaults."""
        return cls(**d)


@dataclass
class _Context:
    model_task: str
    per_sample: dict[str, np.ndarray] | None
    masks: dict[tuple[str, str], np.ndarray] | None
    discovered: Any
    spec: Spec


def gate_op(gate: GateSpec) -> str:
    """The comparison a gate makes: ">=" (value must be at least the threshold) or "<=" (at most): `min` gives
    ">=", `max` gives "<=", `max_drop` follows the metric catalogue's `higher_is_better`."""
    if gate.min is not None:
        return ">="
    if gate.max is not None:
        return "<="
    return ">=" if higher_is_better(gate.metric) else "<="


def static_threshold(gate: GateSpec) -> float | None:
    """The threshold known before looking at data (None: relative accuracy gates, whose reference varies)."""
    if gate.min is not None:
        return float(gate.min)
    if gate.max is not None:
        return float(gate.max)
    if gate.metric in ("accuracy", "reference_accuracy"):
        return None
    ref = _self_score(gate.metric)
    return ref - gate.max_drop if higher_is_better(gate.metric) else ref + gate.max_drop  # type: ignore[operator]


def _self_score(metric: str) -> float:
    """The FP32 reference's score against itself, what `max_drop` counts from (metric catalogue `self_score`:
    1 for agreement, overlap and cosine metrics, 0 for errors and KL)."""
    score = catalogue_metric(metric).self_score
    if score is None:  # the spec allows max_drop on parity metrics only, and accuracy is handled apart
        raise InputError(f"max_drop on {metric!r}: the metric has no FP32 reference score to drop from",
                         hint="give an absolute bound (min or max) for this metric")
    return score


def _ok(value: float | None, op: str, threshold: float | None) -> bool:
    if value is None or threshold is None or (isinstance(value, float) and math.isnan(value)):
        return False
    return value >= threshold if op == ">=" else value <= threshold


def _point_gate(gate: GateSpec) -> bool:
    """A gate on the point estimate: no confidence bound and no max_drop (its threshold is fixed, its value exact)."""
    return gate.confidence is None and gate.max_drop is None


def _single(gate: GateSpec, base: dict[str, Any], value: Any, method: str, missing_reason: str) -> GateResult:
    op, thr = base["op"], base["threshold"]
    v = number_or_none(value)
    if v is None:
        return GateResult(**base, observed=None, passed=False, status=GateStatus.FAILED, method=method,
                          detail={"reason": missing_reason})
    ok = _ok(v, op, thr)
    return GateResult(**base, observed=v, passed=ok, status=GateStatus.PASSED if ok else GateStatus.FAILED,
                      method=method, estimate=v)


def _side(op: str) -> Side:
    return "lower" if op == ">=" else "upper"


def _assess(gate: GateSpec, ctx: _Context, op: str, point: Any, ref_point: Any,
            mask: np.ndarray | None, mask_known: bool, missing_reason: str) -> dict[str, Any]:
    """Judge one set of rows (overall, one slice group, one discovered slice) for a parity gate.

    Returns {"estimate", "bound", "observed", "threshold", "ok"} plus "reference_score" (relative gates),
    "difference_bound" (relative accuracy gates with confidence) and "reason" (when it cannot be judged).
    """
    out: dict[str, Any] = {"estimate": number_or_none(point), "bound": None, "observed": None,
                           "threshold": static_threshold(gate), "ok": False}
    if out["estimate"] is None:
        out["reason"] = missing_reason
        return out
    if gate.max_drop is not None:
        if gate.metric == "reference_accuracy":
            out["reason"] = ("max_drop on reference_accuracy compares the FP32 reference with itself; gate "
                             "accuracy instead")
            return out
        if gate.metric == "accuracy":
            ref = number_or_none(ref_point)
            if ref is None:
                out["reason"] = "reference_accuracy of these rows was not computed (needs labels)"
                return out
        else:
            ref = _self_score(gate.metric)
        out["reference_score"] = ref
        out["threshold"] = ref - gate.max_drop if op == ">=" else ref + gate.max_drop
    if gate.confidence is None:
        out["observed"] = out["estimate"]
    else:
        if ctx.per_sample is None or not mask_known:
            out["reason"] = ("a confidence gate needs the per-row parity values"
                             + ("" if ctx.per_sample is None else " and this group's row mask")
                             + " (evaluate_gates(per_sample=..., groups=...)); not given")
            return out
        if gate.max_drop is not None and gate.metric == "accuracy":
            cand, refc = np.asarray(ctx.per_sample["correct"]), np.asarray(ctx.per_sample["reference_correct"])
            if mask is not None:
                cand, refc = cand[mask], refc[mask]
            diff = newcombe_paired_bound(cand, refc, gate.confidence, "lower")
            out["difference_bound"] = diff
            b = number_or_none(out["reference_score"] + diff)
        else:
            bs = ctx.spec.analysis.bootstrap
            b = number_or_none(metric_bound(ctx.model_task, gate.metric, ctx.per_sample, mask, gate.confidence,
                                            _side(op), bs))
        out["bound"] = b
        out["observed"] = b
        if b is None:
            out["reason"] = "no rows to bound"
            return out
    out["ok"] = _ok(out["observed"], op, out["threshold"])
    return out


def _method_suffix(gate: GateSpec, op: str, ctx: _Context) -> str:
    parts = []
    if gate.max_drop is not None:
        ref = ("reference_accuracy of the same rows" if gate.metric == "accuracy"
               else f"{_self_score(gate.metric):g}")
        parts.append(f"threshold = reference score ({ref}) {'-' if op == '>=' else '+'} max_drop {gate.max_drop:g}")
    if gate.confidence is not None:
        if gate.max_drop is not None and gate.metric == "accuracy":
            parts.append(f"decided on reference_accuracy + the one-sided {gate.confidence * 100:g}% lower bound "
                         f"of the paired difference accuracy - reference_accuracy (Newcombe 1998 hybrid score)")
        else:
            parts.append("decided on the " + method_words(gate.metric, gate.confidence, _side(op),
                                                          ctx.spec.analysis.bootstrap))
    return "; ".join(parts)


def _finish(base: dict[str, Any], gate: GateSpec, a: dict[str, Any], method: str,
            detail: dict[str, Any]) -> dict[str, Any]:
    """GateResult keyword arguments shared by overall and group gates, from the chosen assessment `a`."""
    kw = dict(base)
    kw["threshold"] = a.get("threshold") if gate.max_drop is not None else base["threshold"]
    if gate.max_drop is not None:
        detail.setdefault("reference_score", a.get("reference_score"))
        detail.setdefault("max_drop", float(gate.max_drop))
        if "difference_bound" in a:
            detail.setdefault("difference_bound", a["difference_bound"])
    kw.update(method=method, detail=detail, estimate=a.get("estimate"), bound=a.get("bound"),
              confidence=gate.confidence, decided_on="point" if gate.confidence is None else "bound")
    return kw


def _overall(gate: GateSpec, base: dict[str, Any], ctx: _Context, overall: dict[str, float],
             missing_reason: str) -> GateResult:
    op = base["op"]
    a = _assess(gate, ctx, op, overall.get(gate.metric), overall.get("reference_accuracy"), None, True,
                missing_reason)
    method = "; ".join(p for p in ("overall, all validation rows", _method_suffix(gate, op, ctx)) if p)
    detail: dict[str, Any] = {"reason": a["reason"]} if "reason" in a else {}
    kw = _finish(base, gate, a, method, detail)
    if "reason" in a:
        return GateResult(**kw, observed=None, passed=False, status=GateStatus.FAILED)
    return GateResult(**kw, observed=a["observed"], passed=a["ok"],
                      status=GateStatus.PASSED if a["ok"] else GateStatus.FAILED)


def _groups(gate: GateSpec, base: dict[str, Any], ctx: _Context, tested: Sequence[dict[str, Any]],
            method: str, where: str) -> GateResult:
    """Judge every group tested (dicts: slice, value, support, point, ref_point, mask, mask_known[, extra])."""
    op = base["op"]
    plain = _point_gate(gate)
    judged, failing, insufficient = [], [], []
    assessed: list[dict[str, Any]] = []
    for c in tested:
        item: dict[str, Any] = {"slice": c["slice"], "value": c["value"], "support": int(c["support"])}
        item.update(c.get("extra", {}))
        if item["support"] < gate.min_support:
            insufficient.append(item)
            continue
        a = _assess(gate, ctx, op, c["point"], c.get("ref_point"), c.get("mask"), c.get("mask_known", False),
                    f"{gate.metric} was not computed for this group")
        item["observed"] = a["observed"]
        if not plain:
            item["estimate"] = a["estimate"]
            if gate.confidence is not None:
                item["bound"] = a["bound"]
            if gate.max_drop is not None:
                item["threshold"] = a["threshold"]
                item["reference_score"] = a.get("reference_score")
            if "reason" in a:
                item["reason"] = a["reason"]
        judged.append(item)
        assessed.append(a)
        if item["observed"] is None or not a["ok"]:
            failing.append(item)
    detail: dict[str, Any] = {"judged": len(judged), "failing": failing, "insufficient": insufficient}
    if not judged:
        detail["reason"] = (f"no group of {where} has >= {gate.min_support} rows "
                            f"({len(insufficient)} group(s) insufficient)")
        kw = _finish(base, gate, {"threshold": base["threshold"]}, method, detail)
        return GateResult(**kw, observed=None, passed=None, status=GateStatus.INSUFFICIENT_DATA)
    if any(j["observed"] is None for j in judged):
        worst = next(a for a, j in zip(assessed, judged) if j["observed"] is None)
        observed = None
    else:
        def margin(a: dict[str, Any]) -> float:
            thr = a["threshold"] if a["threshold"] is not None else 0.0
            return a["observed"] - thr if op == ">=" else thr - a["observed"]
        worst = min(assessed, key=margin)  # plain gates: same threshold, so the lowest (">=") / highest value
        observed = worst["observed"]
    ok = not failing
    kw = _finish(base, gate, worst, method, detail)
    return GateResult(**kw, observed=observed, passed=ok, status=GateStatus.PASSED if ok else GateStatus.FAILED)


def _per_slice(gate: GateSpec, base: dict[str, Any], ctx: _Context, slice_table: pd.DataFrame) -> GateResult:
    rows = slice_table
    if gate.slice is not None and len(rows):
        rows = rows[rows["slice"] == gate.slice]
    where = f"slice {gate.slice!r}" if gate.slice else "every slice"
    method = f"worst group of {where} with support >= {gate.min_support}; smaller groups: insufficient data"
    suffix = _method_suffix(gate, base["op"], ctx)
    if suffix:
        method += "; " + suffix
    if len(rows) and gate.metric not in rows.columns:
        kw = _finish(base, gate, {"threshold": base["threshold"]}, method,
                     {"reason": f"metric {gate.metric!r} is not in the per-slice table "
                                f"(columns: {list(rows.columns)})"})
        return GateResult(**kw, observed=None, passed=False, status=GateStatus.FAILED)
    tested = []
    for rec in rows.to_dict("records"):
        key = (str(rec["slice"]), str(rec["value"]))
        mask = ctx.masks.get(key) if ctx.masks is not None else None
        tested.append({"slice": key[0], "value": key[1], "support": rec["support"], "point": rec[gate.metric],
                           "ref_point": rec.get("reference_accuracy"), "mask": mask,
                           "mask_known": mask is not None})
    return _groups(gate, base, ctx, tested, method, where)


def _discovered(gate: GateSpec, base: dict[str, Any], ctx: _Context) -> GateResult:
    disc = ctx.discovered
    where = "the significant discovered slices"
    method = (f"worst of the slices that worst-slice discovery marked significant "
              f"({getattr(disc, 'method', 'discovery')}) with support >= {gate.min_support}; smaller slices: "
              f"insufficient data")
    suffix = _method_suffix(gate, base["op"], ctx)
    if suffix:
        method += "; " + suffix
    if disc is None:
        kw = _finish(base, gate, {"threshold": base["threshold"]}, method,
                     {"reason": "discovery did not run (analysis.discovery; evaluate_gates(discovered=...))"})
        return GateResult(**kw, observed=None, passed=False, status=GateStatus.FAILED)
    table = disc.table
    sig = table[table["significant"].astype(bool)] if len(table) else table
    if not len(sig):
        alpha = ctx.spec.analysis.discovery.alpha
        kw = _finish(base, gate, {"threshold": base["threshold"]}, method,
                     {"reason": f"no slice discovered (discovery found no slice significantly worse than the "
                                f"rest at false discovery rate {alpha:g}; {getattr(disc, 'tested', '?')} "
                                f"tested)", "judged": 0, "failing": [], "insufficient": []})
        return GateResult(**kw, observed=None, passed=True, status=GateStatus.PASSED)
    if ctx.per_sample is None:
        kw = _finish(base, gate, {"threshold": base["threshold"]}, method,
                     {"reason": "a discovered gate needs the per-row parity values "
                                "(evaluate_gates(per_sample=...)); not given"})
        return GateResult(**kw, observed=None, passed=False, status=GateStatus.FAILED)
    tested = []
    for rec in sig.to_dict("records"):
        key = (str(rec["slice"]), str(rec["value"]))
        mask = disc.masks.get(key)
        point = ref_point = None
        if mask is not None:
            agg = aggregate(ctx.model_task, ctx.per_sample, mask)
            point, ref_point = agg.get(gate.metric), agg.get("reference_accuracy")
        extra = {k: rec[k] for k in ("q_value", "drop") if k in rec}
        tested.append({"slice": key[0], "value": key[1], "support": rec["support"], "point": point,
                           "ref_point": ref_point, "mask": mask, "mask_known": mask is not None,
                           "extra": extra})
    return _groups(gate, base, ctx, tested, method, where)


def _ratio_bound_gate(gate: GateSpec, base: dict[str, Any], ctx: _Context, row: dict[str, Any] | None,
                      missing_reason: str) -> GateResult:
    """A speed-ratio gate with `confidence`, decided on the bound of the interleaved ratio (module docstring)."""
    from tailguard.core.latency import speed_ratio

    op, thr, bs = base["op"], base["threshold"], base["batch_size"]
    name = gate.metric.removeprefix("speedup_vs_")
    side = _side(op)
    level = gate.confidence
    paired = ((row or {}).get("baseline_samples_ms") or {}).get(name)
    method = f"benchmark at batch size {bs}"
    kw = dict(base, confidence=level, decided_on="bound")
    if row is None or paired is None:
        reason = missing_reason if row is None or row.get(gate.metric) is None else (
            f"the {name} baseline was not timed interleaved with the variant (no paired rounds), so "
            f"{gate.metric} has no confidence bound; the validate step times it when given the reference model")
        return GateResult(**kw, observed=None, passed=False, status=GateStatus.FAILED, method=method,
                          detail={"reason": reason})
    bsp = ctx.spec.analysis.bootstrap
    n_looks = int(row.get("n_looks") or 1)
    if n_looks > 1:  # timed to a precision: the bound at the level corrected for the looks (core/latency.py)
        from tailguard.core.sequential_stats import look_confidence

        level = look_confidence(level, n_looks)
    try:
        r = speed_ratio(paired, row["samples_ms"], level, samples=bsp.samples, seed=bsp.seed)
    except InputError as exc:
        return GateResult(**kw, observed=None, passed=False, status=GateStatus.FAILED, method=method,
                          detail={"reason": f"no confidence bound: {exc.message}"})
    b = r["lower"] if side == "lower" else r["upper"]
    ok = _ok(b, op, thr)
    method += f"; decided on the one-sided {level * 100:g}% {side} bound of the " + r["method"]
    if n_looks > 1:
        method += (f" ({gate.confidence * 100:g}% corrected for the {n_looks} looks of a timing measured to "
                   f"benchmark.precision)")
    return GateResult(**kw, observed=b, passed=ok, status=GateStatus.PASSED if ok else GateStatus.FAILED,
                      method=method, estimate=r["ratio"], bound=b,
                      detail={"rounds": r["rounds"], "lower": r["lower"], "upper": r["upper"]})


def build_metrics(model_path: Any) -> dict[str, float]:
    """The build metrics (BUILD_METRICS) an INT8 build stored in its model file.

    Args:
        model_path: the variant's .onnx file (or None / a folder / another format: nothing is read).

    Returns:
        {"quantized_mac_fraction": float in [0, 1]} from the model's metadata_props[QUANTIZATION_COVERAGE_KEY]
        (written by components/build/builders/onnxruntime.py; MACs per sample, formulas in
        components/build/macs.py);
        {} when the file has no such entry (fp32/fp16 variants, models built before it existed) or the value is
        not a number.

    Raises:
        InputError: the file exists but is not a readable ONNX model.
    """
    import json
    from pathlib import Path

    if model_path is None or Path(model_path).suffix != ".onnx" or not Path(model_path).is_file():
        return {}
    import onnx

    try:
        props = {p.key: p.value for p in onnx.load(str(model_path), load_external_data=False).metadata_props}
    except Exception as exc:  # DecodeError and friends
        raise InputError(f"cannot read the model file {model_path}: {type(exc).__name__}: {str(exc)[:200]}",
                         hint="validate the .onnx file the build step wrote") from None
    try:
        facts = json.loads(props.get(QUANTIZATION_COVERAGE_KEY, "{}"))
    except ValueError:
        return {}
    out = {}
    for m in BUILD_METRICS:
        v = number_or_none(facts.get(m)) if isinstance(facts, dict) else None
        if v is not None:
            out[m] = v
    return out


def _build_gate(gate: GateSpec, base: dict[str, Any], spec: Spec, variant_name: str,
                overall: dict[str, float]) -> GateResult:
    """A gate on a build metric: not_applicable unless the variant is INT8 on onnxruntime."""
    v = next((x for x in spec.variants if x.name == variant_name), None)
    if v is not None and not (v.precision == "int8" and v.backend == "onnxruntime"):
        return GateResult(**base, observed=None, passed=None, status=GateStatus.NOT_APPLICABLE,
                          method=f"{gate.metric} is a fact of INT8 onnxruntime builds; variant {variant_name} is "
                                 f"{v.precision} on {v.backend}")
    return _single(gate, base, overall.get(gate.metric),
                   "counted on the built graph: MACs per sample in INT8 / all MACs (components/build/macs.py)",
                   f"{gate.metric} was not measured: the model file holds no quantization coverage "
                   f"(metadata {QUANTIZATION_COVERAGE_KEY!r}); rebuild the variant with this tailguard version")


def evaluate_gates(spec: Spec, variant_name: str, overall: dict[str, float], slice_table: pd.DataFrame,
                   perf: dict[int, dict[str, float]], *, per_sample: dict[str, np.ndarray] | None = None,
                   groups: "list[SliceGroup] | None" = None,
                   discovered: "DiscoveryResult | None" = None) -> list[GateResult]:
    """Evaluate every gate of the spec for one variant (all of them; rules: module docstring).

    Args:
        spec: the validated spec (gates, benchmark batch sizes, analysis.bootstrap / discovery).
        variant_name: the variant's name, matched against `gate.variants`.
        overall: overall-scope metrics: the parity metrics of `parity.aggregate` plus, when measured,
            "peak_rss_mb" (MiB) and "model_size_mb" (MiB), and for INT8 builds "quantized_mac_fraction"
            (`build_metrics`).
        slice_table: `slices.per_slice_table` output (columns slice, value, support, <metrics>).
        perf: {batch size: {"latency_ms.p50": ms, "latency_ms.p99": ms, "throughput_per_s": rows/s,
            "usd_per_1m_inferences": USD, "speedup_vs_torch": x, ...}} (`latency.benchmark` plus the derived
            metrics of `logic.validate_variant`).
        per_sample: `parity.per_sample_metrics` output over the validation rows (arrays of shape (rows,));
            needed by confidence gates and discovered gates (without it they fail, with the reason).
        groups: `slices.slice_groups` output (row masks of the per-slice table's groups); needed by per-slice
            confidence gates.
        discovered: `discovery.discover_slices` output (DiscoveryResult), or None when discovery did not run
            (then every discovered gate fails).

    Returns:
        One GateResult per `spec.gates` entry, in spec order.
    """
    masks = None if groups is None else {(str(g.slice), str(g.value)): np.asarray(g.mask, dtype=bool)
                                         for g in groups}
    ctx = _Context(model_task=spec.model.task, per_sample=per_sample, masks=masks, discovered=discovered, spec=spec)
    results: list[GateResult] = []
    for gate in spec.gates:
        op, thr = gate_op(gate), static_threshold(gate)
        batched = gate.metric in BATCHED_METRICS
        bs = spec.gate_batch_size(gate) if batched else None
        base = dict(gate=gate.key, metric=gate.metric, scope=gate.scope, threshold=thr, op=op, batch_size=bs,
                    slice=gate.slice, min_support=gate.min_support if gate.scope != "overall" else None)
        if gate.variants is not None and variant_name not in gate.variants:
            results.append(GateResult(**base, observed=None, passed=None, status=GateStatus.NOT_APPLICABLE,
                                      method=f"gate applies to variants {gate.variants} only",
                                      confidence=gate.confidence,
                                      decided_on="point" if gate.confidence is None else "bound"))
            continue
        if gate.metric in BUILD_METRICS:
            results.append(_build_gate(gate, base, spec, variant_name, overall))
        elif gate.scope == "per_slice":
            results.append(_per_slice(gate, base, ctx, slice_table))
        elif gate.scope == "discovered":
            results.append(_discovered(gate, base, ctx))
        elif batched:
            row = perf.get(bs) if bs is not None else None
            reason = (f"no benchmark at batch size {bs}" if row is None else
                      f"{gate.metric} was not measured at batch size {bs}"
                      + (" (no cost section in the spec)" if gate.metric == "usd_per_1m_inferences" else "")
                      + (" (no baseline benchmark given)" if gate.metric.startswith("speedup") else ""))
            if gate.confidence is not None and gate.metric in RATIO_METRICS:
                results.append(_ratio_bound_gate(gate, base, ctx, row, reason))
            else:
                results.append(_single(gate, base, (row or {}).get(gate.metric),
                                       f"benchmark at batch size {bs}", reason))
        elif gate.metric in PERF_METRICS:
            results.append(_single(gate, base, overall.get(gate.metric), "measured on this node",
                                   f"{gate.metric} was not measured"))
        else:
            reason = f"{gate.metric} was not computed"
            if gate.metric in ("accuracy", "reference_accuracy"):
                reason += " (needs data.validation.label_column)"
            if _point_gate(gate):
                results.append(_single(gate, base, overall.get(gate.metric), "overall, all validation rows",
                                       reason))
            else:
                results.append(_overall(gate, base, ctx, overall, reason))
    return results


def all_passed(results: list[GateResult]) -> bool:
    """Whether a variant passes its gates (and may be promoted).

    Args:
        results: `evaluate_gates` output.

    Returns:
        True when no gate failed and none was insufficient_data or undecided: a gate the validation set could not
        judge is not a passed gate. not_applicable gates are ignored.
    """
    held_back = (GateStatus.FAILED, GateStatus.INSUFFICIENT_DATA, GateStatus.UNDECIDED)
    return not any(r.status in held_back for r in results)


class Judged(Protocol):
    """What `verdict` reads of a validated variant: `result.ValidationResult` has these fields. A protocol, not an
    import of result.py, so gates.py stays below the module that evaluates the gates (no import cycle)."""

    non_finite_rows: int
    gates: list[GateResult]
    passed: bool


def verdict(result: Judged) -> tuple[bool, str]:
    """Whether a validated variant passed, and why not: the one decision of `passed` (the validate task logs it
    and stores it in variant_result.json; the search task judges its trials with it; nothing recomputes it).

    Non-finite outputs fail whatever the gates say; a failed gate or one with insufficient data holds the variant
    back (an insufficient-data gate was not judged, so it never counts as passed: `all_passed`).

    Args:
        result: the variant's ValidationResult (components/validate/result.py), or anything with its `Judged`
            fields.

    Returns:
        (passed, reason): reason is "" when passed, else "non-finite outputs in N validation rows", or
        "failed gates: A, B" and/or "not promoted: gate X had insufficient data" (`contract.insufficient_reason`)
        joined by "; ", or "failed gates" when the result says it did not pass without naming a gate.
    """
    from tailguard.core.contract import insufficient_reason

    if result.non_finite_rows:
        return False, f"non-finite outputs in {result.non_finite_rows} validation rows"
    failed = [g.gate for g in result.gates if g.status == GateStatus.FAILED]
    insufficient = [g.gate for g in result.gates if g.status == GateStatus.INSUFFICIENT_DATA]
    if not result.passed or failed or insufficient:
        parts = (["failed gates: " + ", ".join(failed)] if failed else []) + \
            ([insufficient_reason(insufficient)] if insufficient else [])
        return False, "; ".join(parts) or "failed gates"
    return True, ""

