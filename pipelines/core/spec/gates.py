"""The spec's `gates` (`GateSpec`: a threshold a variant must meet) and `promotion` (`PromotionSpec`) sections, the
metric tables a gate may name (computed from the metric catalogue, `tailguard.core.metrics`) and the gates' checks
across sections (`build_gate_errors`, `gate_range_errors`, `is_parity_gate`) that the root `Spec` runs.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from tailguard.core import metrics as _metrics
from tailguard.core.spec.base import SpecModel
from tailguard.core.spec.variants import VariantSpec

# The metric tables below are computed from the metric catalogue (tailguard.core.metrics, one row per metric with
# its direction, aggregate, kind, tasks and units); the names stay because code and users import them.
# Parity metrics each task produces (overall and per slice), in the order tailguard.core.parity.aggregate returns.
MODEL_TASK_METRICS: dict[str, tuple[str, ...]] = {t: _metrics.model_task_metrics(t) for t in _metrics.MODEL_TASKS}
# Performance metrics a gate may name (overall scope only); latency/throughput/cost/speedups are per batch size.
PERF_METRICS: tuple[str, ...] = _metrics.metrics_of("performance", gateable=True)
# Parity metrics that are the mean of a 0/1 value per row: their confidence bound is Wilson's score interval.
# Every other parity metric (means of continuous values, quantiles, maxima) gets a seeded percentile bootstrap.
PROPORTION_METRICS = frozenset(_metrics.metrics_of("proportion"))
# Performance metrics that compare the variant with a baseline timed interleaved with it in the validate step
# (pipelines/core/latency.py): a gate on one may set `confidence` and is then decided on the bound of the
# speed ratio (paired bootstrap over rounds); <metric>.lb95 / .ub95 are logged beside it. speedup_vs_torch is
# not among them: torch eager is timed in reference-pass, another process at another time.
RATIO_METRICS = frozenset(m.name for m in _metrics.METRICS if m.bound == "paired_bootstrap")
# Per-row keys of the lower-is-better parity metrics (errors, divergences), e.g. "abs_error" of abs_error.p99.
LOWER_IS_BETTER_PREFIXES: tuple[str, ...] = tuple(dict.fromkeys(
    m.row_key for m in _metrics.METRICS if m.is_parity and not m.higher_is_better and m.row_key))


# Build metrics: facts of how a variant was built, counted once on its graph (no sampling noise, so no confidence
# bound), overall scope only, INT8 onnxruntime variants only. quantized_mac_fraction = MACs computed in INT8 / all
# MACs of the graph, per sample (formulas: components/build/macs.py). The build stores them in the model file's
# metadata_props[tailguard.core.contract.QUANTIZATION_COVERAGE_KEY] (JSON) and in build.json; validate logs them as
# metrics of the variant.
BUILD_METRICS: tuple[str, ...] = _metrics.metrics_of("build")


def build_gate_errors(i: int, gate: "GateSpec", variants: list["VariantSpec"]) -> list[str]:
    """The problems of gate `i` on a build metric (BUILD_METRICS), as '<field path>: <problem>' strings: it must
    be an overall, absolute (min/max) gate in [0, 1] without confidence or batch_size, and apply to at least one
    INT8 onnxruntime variant (a `variants` list may name only such variants)."""
    m, errors = gate.metric, []
    example = f"{{metric: {m}, min: 0.9}}"
    if gate.scope != "overall":
        errors.append(f"gates.{i}.scope: {m} is a build metric (one value per variant, counted on its graph), so "
                      f"it is overall only, not {gate.scope!r}; remove scope")
    if gate.confidence is not None:
        errors.append(f"gates.{i}.confidence: {m} is a build metric counted on the graph, not estimated from "
                      f"validation rows: it has no confidence bound; remove confidence")
    if gate.max_drop is not None:
        errors.append(f"gates.{i}.max_drop: {m} has no FP32 reference score to drop from; give an absolute bound, "
                      f"e.g. {example}")
    if gate.batch_size is not None:
        errors.append(f"gates.{i}.batch_size: {m} does not depend on the batch size (MACs are counted per "
                      f"sample); remove batch_size")
    for key in ("min", "max"):
        bound = getattr(gate, key)
        if bound is not None and not 0 <= bound <= 1:
            errors.append(f"gates.{i}.{key}: {m} is a fraction in [0, 1] (not a percentage), got {bound:g}; "
                          f"e.g. {example}")
    int8 = {v.name for v in variants if v.precision == "int8" and v.backend == "onnxruntime"}
    if gate.variants is not None:
        others = [v.name for v in variants if v.name in gate.variants and v.name not in int8]
        if others:
            errors.append(f"gates.{i}.variants: {m} applies to INT8 onnxruntime variants only; {others} "
                          f"{'is' if len(others) == 1 else 'are'} not")
    elif not int8:
        errors.append(f"gates.{i}.metric: {m} applies to INT8 onnxruntime variants and the spec has none; remove "
                      "the gate or add an INT8 variant")
    return errors


def gate_range_errors(i: int, gate: "GateSpec") -> list[str]:
    """The problems of gate `i`'s bounds against its metric's range in the metric catalogue
    (`tailguard.core.metrics.Metric.value_range`), as '<field path>: <problem>' strings.

    `min` / `max` must lie in the closed range [lo, hi] (a bound outside it can never pass or always passes, e.g.
    `{metric: latency_ms.p99, max: -5}` or an agreement `min: 1.2`); `max_drop` must not exceed the range's width
    hi - lo where that is finite (a larger drop always passes). Unknown metrics are reported elsewhere (no
    error here).
    """
    m = _metrics.CATALOGUE.get(gate.metric)
    if m is None:
        return []
    lo, hi = m.value_range
    where = f"[{lo:g}, {hi:g}]" if hi != float("inf") else f"[{lo:g}, inf)"
    if lo == float("-inf"):
        where = f"(-inf, {hi:g}]" if hi != float("inf") else "(-inf, inf)"
    units = f" ({m.units}{', a fraction, not a percentage' if (lo, hi) == (0.0, 1.0) else ''})"
    errors = []
    for key in ("min", "max"):
        bound = getattr(gate, key)
        if bound is not None and not lo <= bound <= hi:
            errors.append(f"gates.{i}.{key}: {gate.metric} lies in {where}{units}, so {key} {bound:g} "
                          f"{'can never pass' if (key == 'min') == (bound > hi) else 'always passes'}; give a "
                          f"bound inside {where}")
    width = hi - lo
    if gate.max_drop is not None and width != float("inf") and gate.max_drop > width:
        errors.append(f"gates.{i}.max_drop: {gate.metric} lies in {where}{units}, so a drop of {gate.max_drop:g} "
                      f"(more than the range's width {width:g}) always passes; give at most {width:g}")
    return errors


# Gateable metrics measured per benchmark batch size (a gate's batch_size picks one).
BATCHED_METRICS = frozenset(m.name for m in _metrics.METRICS if m.batched and m.gateable)
# A parity gate each task's example in the "no parity gate" error (gates) and its fix hint.
PARITY_GATE_EXAMPLE: dict[str, str] = {
    "classification": "{metric: top1_agreement, min: 0.99}",
    "embedding": "{metric: nn_top1_agreement, min: 0.99}",
    "regression": "{metric: abs_error.p99, max: 0.01}",
    "generic": "{metric: abs_error.p99, max: 0.01}",
    "token_classification": "{metric: cer, max: 0.01}",
}
NO_PARITY_GATE = "no parity gate"  # start of the `gates` error message (parse_spec keys its fix hint on it)


def is_parity_gate(gate: "GateSpec", model_task: str) -> bool:
    """Whether `gate` judges the variant's outputs against the FP32 reference: a parity metric of the task
    (not latency/throughput/speedup/cost/memory, not `reference_accuracy`, the reference's own score) with
    scope overall or per_slice. A `discovered` gate does not count: it passes when discovery finds no slice."""
    return (gate.metric in MODEL_TASK_METRICS.get(model_task, ()) and gate.metric != "reference_accuracy"
            and gate.scope in ("overall", "per_slice"))


# --------------------------------------------------------------------------------------------- gates
class GateSpec(SpecModel):
    """A threshold a variant must meet: exactly one of `min`, `max` (absolute) or `max_drop` (relative to the
    FP32 reference's own score).

    Decision: with `confidence` unset the gate compares the point estimate; with `confidence` set it compares
    the one-sided confidence bound at that level on the bad side (the lower bound for higher-is-better
    metrics, the upper bound for errors): Wilson's score interval for 0/1 metrics (PROPORTION_METRICS), a
    seeded percentile bootstrap (analysis.bootstrap) for the others. A small group then neither passes
    vacuously (its bound is wide) nor fails on noise (the bound, not one unlucky row, decides).
    """

    metric: str = Field(description=(
        "A parity metric of the task, a performance metric, or the build metric quantized_mac_fraction (INT8 "
        "variants; see docs/spec.md)."))
    min: float | None = Field(None, description="Pass when observed (or its lower bound) >= min.")
    max: float | None = Field(None, description="Pass when observed (or its upper bound) <= max.")
    max_drop: float | None = Field(None, ge=0, description=(
        "Relative gate: pass when the metric is at most this much worse than the FP32 reference's own score on "
        "the same rows (accuracy: reference_accuracy; agreement and cosine metrics: 1; errors and KL: 0). "
        "Parity metrics only."))
    confidence: float | None = Field(None, gt=0.5, lt=1, description=(
        "Decide on the one-sided confidence bound at this level (e.g. 0.95) instead of the point estimate. "
        "Parity metrics, and the speed ratio speedup_vs_onnx_fp32 (bound of the ratio of medians over timing "
        "rounds interleaved with the FP32 reference, paired bootstrap)."))
    scope: Literal["overall", "per_slice", "discovered"] = Field("overall", description=(
        "overall: all validation rows; per_slice: every declared slice group with enough support must pass; "
        "discovered: every slice found by worst-slice discovery (analysis.discovery) must pass."))
    slice: str | None = Field(None, description="per_slice: only this declared slice (default: all slices).")
    min_support: int = Field(30, ge=1, description=(
        "per_slice / discovered: groups with fewer validation rows are reported 'insufficient data', never "
        "passed or failed."))
    batch_size: int | None = Field(None, ge=1, description="Latency/throughput/cost/speedup: the batch size "
                                                           "(default: the first benchmark batch size).")
    variants: list[str] | None = Field(None, description="Apply only to these variants (default: all).")

    @model_validator(mode="after")
    def _one_bound(self) -> "GateSpec":
        given = [k for k in ("min", "max", "max_drop") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of min, max or max_drop (got {given or 'none'})")
        if self.scope != "per_slice" and self.slice is not None:
            raise ValueError("slice applies to scope: per_slice only")
        return self

    @property
    def key(self) -> str:
        """Stable id of the gate, e.g. 'nn_top1_agreement>=0.95@per_slice:lexname',
        'accuracy>=ref-0.01@lb95', 'nn_top1_agreement>=0.97@lb95@discovered'."""
        # an unknown metric is a spec error reported elsewhere
        higher = _metrics.higher_is_better(self.metric, default=True)
        if self.max_drop is not None:
            sign = "-" if higher else "+"
            op = ">=" if higher else "<="
            cond = f"{op}ref{sign}{self.max_drop:g}"
        else:
            op, bound = (">=", self.min) if self.min is not None else ("<=", self.max)
            cond = f"{op}{bound:g}"
        conf = ""
        if self.confidence is not None:
            side = "lb" if (self.min is not None or (self.max_drop is not None and higher)) else "ub"
            conf = f"@{side}{self.confidence * 100:g}"
        if self.scope == "overall":
            where = ""
        elif self.scope == "discovered":
            where = "@discovered"
        else:
            where = f"@per_slice{':' + self.slice if self.slice else ''}"
        bs = f"@bs{self.batch_size}" if self.batch_size else ""
        return f"{self.metric}{cond}{bs}{conf}{where}"


# ----------------------------------------------------------------------------------------- promotion
class PromotionSpec(SpecModel):
    """Registration and promotion in the MLflow model registry."""

    enabled: bool = Field(True, description=(
        "False: register and report, move no alias. While true, every variant needs a parity gate (an overall "
        "or per_slice gate on a parity metric of the task): performance gates alone never promote."))
    alias: str = Field("production", pattern=r"^[A-Za-z][A-Za-z0-9_\-]*$",
                       description="Registry alias set on the selected version.")
    register_variants: Literal["promoted", "passing", "all"] = Field("promoted", description=(
        "Which variants get a registry version: promoted (default): only the one promotion chose (also with "
        "enabled: false, then without the alias); passing: every variant that passed every gate; all: every "
        "built variant, failing ones included. Every variant's MLflow run is logged whatever this says, and an "
        "artefact whose sha256 an existing version already holds reuses that version (docs/spec.md, promotion)."))
    batch_size: int | None = Field(None, ge=1, description="Batch size for 'fastest' (default: the first).")
    margin: float | None = Field(0.03, ge=0, lt=1, description=(
        "The fastest passing variant takes the alias only when, timed interleaved with every other passing "
        "variant at `batch_size`, the lower 95% bound of its speed ratio over each is above 1 + margin; "
        "otherwise the current alias holder keeps it if it is among the variants within that margin, else the "
        "most exact of them (fp32, then fp16, then int8). None: the lowest validation p50, no comparison."))
    max_cpu_pressure: float | None = Field(0.1, ge=0, le=1, description=(
        "The paired comparison ranks nothing when the node was short of CPU for more than this share of its wall "
        "time (Linux PSI cpu.pressure 'some': the time at least one runnable task waited for a CPU, of this "
        "process' cgroup v2, else the node): every passing variant is then within the margin (the holder keeps "
        "the alias, else the most exact). None: trust the timings whatever the load. Nodes without PSI are "
        "not checked."))
    registered_name: str | None = Field(None, description="Registered model for variants "
                                                          "(default: <model.registered_name>-optimized).")
