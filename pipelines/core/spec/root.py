"""The root of the spec (`Spec`: apiVersion, kind, `metadata`, `mlflow` and every section) and its cross-section
checks. The sections are one module each: `model`, `data` (and slices), `variants`, `gates` (and promotion),
`analysis`, `benchmark` (and cost), `targets` (kubeflow and serving targets), `monitor` (monitoring); `base` holds
their common base, names and limits. Loading, validation with every error at once and dumping are in the package
(`tailguard.core.spec`).

Cross-field rules live in model validators so every problem is reported with its field path in one pass.
"""

from __future__ import annotations

import difflib
from typing import Literal

from pydantic import Field, ValidationInfo, model_validator

from tailguard.core.spec.analysis import AnalysisSpec
from tailguard.core.spec.base import MAX_GATES, MAX_SLICES, MAX_VARIANTS, NAME_RE, SpecModel
from tailguard.core.spec.benchmark import BenchmarkSpec, CostSpec
from tailguard.core.spec.data import DataSpec, SliceSpec, derive_errors
from tailguard.core.spec.gates import (
    BUILD_METRICS,
    MODEL_TASK_METRICS,
    NO_PARITY_GATE,
    PARITY_GATE_EXAMPLE,
    PERF_METRICS,
    RATIO_METRICS,
    GateSpec,
    PromotionSpec,
    build_gate_errors,
    gate_range_errors,
    is_parity_gate,
)
from tailguard.core.spec.model import ModelSpec
from tailguard.core.spec.monitor import MonitoringSpec
from tailguard.core.spec.targets import KubeflowSpec, ServingTarget, target_task_name
from tailguard.core.spec.variants import VariantSpec

API_VERSION = "tailguard/v1"
CROSS_FIELD_SEP = "\n"  # between the problems Spec._cross_field reports in one ValueError
SKIP_CROSS_FIELD = "tailguard.skip_cross_field"  # validation context key: build a spec whose errors are known


class Metadata(SpecModel):
    """Spec identity."""

    name: str = Field(description="Pipeline name (DNS-1123).", pattern=NAME_RE)
    labels: dict[str, str] = Field(default_factory=dict, description="Free-form labels, copied to MLflow tags.")


class MlflowSpec(SpecModel):
    """Where runs and models go. Defaults to the embedded store under $TAILGUARD_HOME."""

    tracking_uri: str | None = Field(None, description="Default sqlite:///$TAILGUARD_HOME/mlflow.db.")
    registry_uri: str | None = Field(None, description="Default: the tracking URI.")
    experiment: str | None = Field(None, description="Experiment name (default: tailguard/<metadata.name>).")


class Spec(SpecModel):
    """A tailguard OptimizationSpec."""

    apiVersion: Literal["tailguard/v1"] = Field(description="Spec API version.")
    kind: Literal["OptimizationSpec"] = Field(description="Spec kind.")
    metadata: Metadata = Field(description="Name and labels.")
    model: ModelSpec = Field(description="The FP32 reference in the MLflow registry.")
    data: DataSpec = Field(description="Calibration and validation data.")
    # The count limits are checked in _cross_field (a clear message, and the other checks still run on the
    # lists); maxItems tells editors.
    slices: list[SliceSpec] = Field(default_factory=list, json_schema_extra={"maxItems": MAX_SLICES}, description=(
        f"Declared slices (at most {MAX_SLICES})."))
    variants: list[VariantSpec] = Field(min_length=1, json_schema_extra={"maxItems": MAX_VARIANTS}, description=(
        f"Variants to build and validate (at most {MAX_VARIANTS})."))
    gates: list[GateSpec] = Field(default_factory=list, json_schema_extra={"maxItems": MAX_GATES}, description=(
        "Every gate must pass for promotion (a gate with insufficient data does not pass). While promotion is "
        f"enabled, every variant needs at least one parity gate (overall or per_slice). At most {MAX_GATES}."))
    analysis: AnalysisSpec = Field(default_factory=AnalysisSpec, description=(
        "Tail samples, worst-slice discovery and bootstrap settings."))
    benchmark: BenchmarkSpec = Field(default_factory=BenchmarkSpec, description="Latency measurement.")
    cost: CostSpec | None = Field(None, description="Node price for cost per 1M inferences.")
    promotion: PromotionSpec = Field(default_factory=PromotionSpec, description="Registry promotion.")
    mlflow: MlflowSpec = Field(default_factory=MlflowSpec, description="MLflow tracking/registry location.")
    kubeflow: KubeflowSpec = Field(default_factory=KubeflowSpec, description="Cluster settings.")
    monitoring: MonitoringSpec | None = Field(None, description="Shadow-traffic monitor settings.")
    serving_targets: list[ServingTarget] = Field(default_factory=list, description=(
        "Node pools the variants will serve on. Empty (default): each variant is validated once, on the node that "
        "builds it. Given: the validate step of each variant runs once per target that serves it, the gates hold "
        "per target, `<promotion.alias>-<target>` moves to the fastest variant passing on that target and "
        "`promotion.alias` to the fastest one passing on every target that serves it (docs/spec.md, Serving "
        "targets)."))

    @model_validator(mode="after")
    def _cross_field(self, info: ValidationInfo) -> "Spec":
        if info.context and info.context.get(SKIP_CROSS_FIELD):  # validate_spec's partial spec (errors known)
            return self
        errors: list[str] = []
        for fld, n, most in (("variants", len(self.variants), MAX_VARIANTS), ("slices", len(self.slices), MAX_SLICES),
                             ("gates", len(self.gates), MAX_GATES)):
            if n > most:
                errors.append(f"{fld}: {n} given, at most {most} are allowed (they bound one run's pods, MLflow "
                              f"metrics and report); split the spec into several specs")
        names = [v.name for v in self.variants]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            errors.append(f"variants: duplicate names {dup}")
        slice_names = [s.name for s in self.slices]
        if len(set(slice_names)) != len(slice_names):
            errors.append("slices: duplicate slice names")
        for i, s in enumerate(self.slices):
            errors.extend(derive_errors(i, s, self.model))
        allowed = set(MODEL_TASK_METRICS[self.model.task]) | set(PERF_METRICS) | set(BUILD_METRICS)
        for i, g in enumerate(self.gates):
            if g.metric not in allowed:
                close = difflib.get_close_matches(g.metric, sorted(allowed), n=1)
                errors.append(f"gates.{i}.metric: {g.metric!r} is not produced for task {self.model.task!r}"
                              + (f" (did you mean {close[0]!r}?)" if close else "")
                              + f", choose one of {sorted(allowed)}")
            if g.scope != "overall" and g.metric in PERF_METRICS:
                errors.append(f"gates.{i}.scope: performance metric {g.metric!r} is overall only")
            if g.metric in PERF_METRICS and g.max_drop is not None:
                errors.append(f"gates.{i}.max_drop: relative gates apply to parity metrics, not {g.metric!r}")
            if g.max_drop is not None and g.metric == "reference_accuracy":
                errors.append(f"gates.{i}.max_drop: reference_accuracy is the reference's own score; gate "
                              "accuracy with max_drop instead")
            if g.metric in PERF_METRICS and g.metric not in RATIO_METRICS and g.confidence is not None:
                errors.append(f"gates.{i}.confidence: confidence bounds apply to parity metrics and speed ratios "
                              f"({', '.join(sorted(RATIO_METRICS))}), not {g.metric!r}")
            if g.scope == "discovered" and not self.analysis.discovery.enabled:
                errors.append(f"gates.{i}.scope: a 'discovered' gate needs analysis.discovery.enabled: true")
            if g.scope == "per_slice" and not self.slices:
                errors.append(f"gates.{i}.scope: per_slice gate but no slices are declared")
            if g.slice is not None and g.slice not in slice_names:
                errors.append(f"gates.{i}.slice: unknown slice {g.slice!r}; declared: {slice_names}")
            if g.batch_size is not None and g.batch_size not in self.benchmark.batch_sizes:
                errors.append(f"gates.{i}.batch_size: {g.batch_size} is not in benchmark.batch_sizes "
                              f"{self.benchmark.batch_sizes}")
            for v in g.variants or []:
                if v not in names:
                    errors.append(f"gates.{i}.variants: unknown variant {v!r}")
            if g.metric == "speedup_vs_torch" and self.model.source.format == "onnx":
                errors.append(f"gates.{i}.metric: speedup_vs_torch needs a PyTorch reference (source is onnx)")
            if g.metric in BUILD_METRICS:
                errors.extend(build_gate_errors(i, g, self.variants))
            else:
                errors.extend(gate_range_errors(i, g))
        dm = self.analysis.discovery.metric
        if dm is not None and dm not in MODEL_TASK_METRICS[self.model.task]:
            errors.append(f"analysis.discovery.metric: {dm!r} is not a parity metric of task {self.model.task!r}; "
                          f"choose one of {sorted(MODEL_TASK_METRICS[self.model.task])}")
        if self.promotion.enabled:
            parity = [g for g in self.gates if is_parity_gate(g, self.model.task)]
            uncovered = [n for n in names if not any(g.variants is None or n in g.variants for g in parity)]
            example = PARITY_GATE_EXAMPLE[self.model.task]
            if not parity:
                errors.append(f"gates: {NO_PARITY_GATE}: {len(self.gates)} gate(s), none on a parity metric of "
                              f"task {self.model.task!r} with scope overall or per_slice, so a variant would be "
                              f"promoted on performance alone. Add one, e.g. {example}, or set "
                              "promotion: {enabled: false}")
            elif uncovered:
                errors.append(f"gates: {NO_PARITY_GATE} applies to variant(s) {uncovered} (every parity gate "
                              f"names other variants), so they would be promoted on performance alone. Add one "
                              f"for them, e.g. {example}, or set promotion: {{enabled: false}}")
        if self.monitoring is not None:
            errors.extend(f"{e.loc}: {e.message}" for e in self.monitoring.model_task_problems(self.model.task))
        errors.extend(self._target_errors())
        pb = self.promotion.batch_size
        if pb is not None and pb not in self.benchmark.batch_sizes:
            errors.append(f"promotion.batch_size: {pb} is not in benchmark.batch_sizes")
        if self.model.task == "classification" and self.data.validation.label_column is None:
            pass  # accuracy is then not computed; agreement metrics still are
        if errors:
            # one "<field path>: <problem>" per line; `spec.field_errors` splits them (a problem may hold "; ")
            raise ValueError(CROSS_FIELD_SEP.join(errors))
        return self

    def _target_errors(self) -> list[str]:
        """Cross-field problems of `serving_targets` ("<field path>: <problem>" lines)."""
        if not self.serving_targets:
            return []
        errors: list[str] = []
        names = [t.name for t in self.serving_targets]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            errors.append(f"serving_targets: duplicate target names {dup}")
        tasks: dict[str, tuple[str, str]] = {}
        for i, v in enumerate(self.variants):
            mine = self.targets_for(v)
            if not mine:
                kind = "GPU" if v.needs_gpu else "CPU"
                errors.append(f"variants.{i}: {kind} variant {v.name!r} serves on no target: a {kind} variant is "
                              f"validated on the serving_targets {'with' if v.needs_gpu else 'without'} an "
                              f"accelerator; add such a target or remove the variant")
            if v.search is not None:
                errors.append(f"variants.{i}.search: a search is not combined with serving_targets yet (its "
                              "trials would be timed and judged on one pool only); remove the search or the "
                              "targets")
            for t in mine:
                task = target_task_name(v.name, t.name)
                if len(task) > 63:
                    errors.append(f"serving_targets: the task name {task!r} is {len(task)} characters, over the "
                                  "63 of a DNS-1123 label; shorten the variant or target name")
                elif task in tasks:
                    errors.append(f"serving_targets: variant {v.name!r} on target {t.name!r} and variant "
                                  f"{tasks[task][0]!r} on target {tasks[task][1]!r} give the same task name "
                                  f"{task!r}; rename one")
                tasks[task] = (v.name, t.name)
        return errors

    def targets_for(self, variant: VariantSpec) -> list[ServingTarget]:
        """The serving targets `variant` is validated on, in spec order (`ServingTarget.serves`); [] without
        serving_targets."""
        return [t for t in self.serving_targets if t.serves(variant)]

    @property
    def optimized_model_name(self) -> str:
        """Registered model name that holds the variants."""
        return self.promotion.registered_name or f"{self.model.registered_name}-optimized"

    def gate_batch_size(self, gate: GateSpec) -> int:
        """Batch size a batched gate applies to (the gate's, else the first benchmark batch size)."""
        return gate.batch_size or self.benchmark.batch_sizes[0]
