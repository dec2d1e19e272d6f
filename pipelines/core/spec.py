"""The tailguard spec: one YAML file -> one tree of pydantic v2 models (extra="forbid").

The models are the truth; `tailguard spec schema` prints their JSON Schema and docs/spec.schema.json
holds a copy (a test keeps it in step). Cross-field rules live in model validators so every problem
is reported with its field path in one pass (`load_spec` raises `SpecError` with all of them).
"""

from __future__ import annotations

import copy
import difflib
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator,
                      model_validator)

from tailguard.core import metrics as _metrics
from tailguard.core.errors import FieldError, SpecError
from tailguard.core.hardware import KERNEL_ISA_FLAGS

API_VERSION = "tailguard/v1"
NAME_RE = r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"  # DNS-1123 label: usable as a KFP task name and a K8s name
# Size limits (issue 22): each variant is a chain of KFP tasks (pods, and nodes in one Argo Workflow object, which
# etcd caps at ~1.5 MB), each slice group x parity metric an MLflow metric and a report row, each gate a check per
# variant. These bound one run's pods, metrics and report; a spec past one is refused (exit 2, naming the field).
MAX_VARIANTS = 32
MAX_SLICES = 32
MAX_SLICE_GROUPS = 1000  # slices[].max_groups
MAX_SLICE_NAME = 64  # characters; with it every slice metric key fits MLflow's 250 (validate.logic.slice_key_prefix)
MAX_GATES = 128

Task = Literal["classification", "embedding", "regression", "generic"]
Precision = Literal["fp32", "fp16", "bf16", "int8"]

# The metric tables below are computed from the metric catalogue (tailguard.core.metrics, one row per metric with
# its direction, aggregate, kind, tasks and units); the names stay because code and users import them.
# Parity metrics each task produces (overall and per slice), in the order tailguard.core.parity.aggregate returns.
TASK_METRICS: dict[str, tuple[str, ...]] = {t: _metrics.task_metrics(t) for t in _metrics.TASKS}
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
# MACs of the graph, per sample (formulas: components/quantize/macs.py). The build stores them in the model file's
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
}
NO_PARITY_GATE = "no parity gate"  # start of the `gates` error message (parse_spec keys its fix hint on it)


def is_parity_gate(gate: "GateSpec", task: str) -> bool:
    """Whether `gate` judges the variant's outputs against the FP32 reference: a parity metric of the task
    (not latency/throughput/speedup/cost/memory, not `reference_accuracy`, the reference's own score) with
    scope overall or per_slice. A `discovered` gate does not count: it passes when discovery finds no slice."""
    return (gate.metric in TASK_METRICS.get(task, ()) and gate.metric != "reference_accuracy"
            and gate.scope in ("overall", "per_slice"))



class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)


# --------------------------------------------------------------------------------------------- model
_AXIS_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class TensorSpec(_Model):
    """One model input or output."""

    name: str = Field(description="Tensor name in the ONNX graph / the torch forward() argument name.")
    dtype: Literal["int64", "int32", "float32", "float16", "bool"] = Field(description="Element type.")
    shape: list[str | int] = Field(min_length=1, description=(
        "Axes, batch first: a name is a dynamic axis (e.g. batch, sequence), a positive int a fixed size, "
        "e.g. [batch, sequence] for token ids, [batch, 1, 8, 8] for images, [batch, sequence, 80] for audio "
        "frames. The first axis must be a name (tailguard runs several batch sizes). For inputs, every named "
        "axis after batch is a variable length padded per batch (model.pad_values); every int axis must match "
        "in every data row."))
    value_range: tuple[float, float] | None = Field(None, description=(
        "Inputs only: inclusive [min, max] of every element, e.g. [0, 30521] for token ids of a 30522-word "
        "vocabulary. The data check fails rows with an element outside it."))

    @field_validator("shape", mode="before")
    @classmethod
    def _shape_dims(cls, v: Any) -> Any:
        if not isinstance(v, list):
            return v  # pydantic reports the type error
        problems = []
        for i, d in enumerate(v):
            if isinstance(d, bool) or not isinstance(d, (int, str)):
                problems.append(f"axis {i} is {d!r}: give a positive int (fixed size) or a name (dynamic axis)")
            elif isinstance(d, int) and d < 1:
                problems.append(f"axis {i} is {d}: a fixed size must be a positive int")
            elif isinstance(d, str) and not _AXIS_NAME.fullmatch(d):
                problems.append(f"axis {i} is {d!r}: a dynamic axis name is letters, digits, '_' (e.g. "
                                f"'sequence'), not starting with a digit")
        if v and not problems and not isinstance(v[0], str):
            dims = [str(d) for d in v]
            problems.append(f"axis 0 is {v[0]!r}: the first axis is the batch axis and must be a name "
                            f"(tailguard runs several batch sizes): [{', '.join(['batch', *dims[1:]])}] if "
                            f"{v[0]!r} is a fixed batch size, [{', '.join(['batch', *dims])}] if the batch axis "
                            "is missing")
        if problems:
            raise ValueError("; ".join(problems))
        return v

    @model_validator(mode="after")
    def _range_order(self) -> "TensorSpec":
        if self.value_range is not None and self.value_range[0] > self.value_range[1]:
            raise ValueError("value_range must be [min, max] with min <= max")
        return self


class ExportTolerance(_Model):
    """Allowed difference between the torch model and its ONNX export for one output: |a-b| <= atol + rtol*|b|."""

    atol: float = Field(1e-4, ge=0, description="Absolute tolerance.")
    rtol: float = Field(1e-3, ge=0, description="Relative tolerance.")


class ExportSpec(_Model):
    """torch -> ONNX export settings (ignored when the reference is already ONNX)."""

    opset: int = Field(17, ge=13, le=23, description="ONNX opset version.")
    dynamo: bool = Field(False, description=(
        "Use torch.export-based exporter (torch.onnx.export(dynamo=True)). The legacy TorchScript exporter "
        "(False) produces graphs that ONNX Runtime's transformer fusions recognise."))
    check_samples: int = Field(8, ge=1, description="Validation rows used to compare ONNX and torch outputs.")
    tolerances: dict[str, ExportTolerance] = Field(
        default_factory=dict, description="Per-output tolerance by output name; missing outputs use `default`.")
    default: ExportTolerance = Field(default_factory=ExportTolerance,
                                     description="Tolerance for outputs not named in `tolerances`.")


class ModelSource(_Model):
    """How the FP32 reference is stored in the registry version, and how far it may be trusted."""

    format: Literal["auto", "onnx", "torch_export", "state_dict", "pickle"] = Field(
        "auto", description=("auto: read the MLmodel flavor (onnx, pytorch exported program, pytorch pickle) or "
                             "find a state dict; state_dict needs class_path."))
    class_path: str | None = Field(None, description=(
        "'module:Class' of a torch.nn.Module built with init_kwargs, into which a state dict is loaded with "
        "torch.load(weights_only=True) or safetensors."), pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
    init_kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments for class_path.")
    weights_file: str | None = Field(None, description=(
        "State-dict file inside the registry version's artifacts (default: the single *.safetensors/*.pt file)."))
    trusted: bool = Field(False, description=(
        "Allow a pickled PyTorch model (mlflow.pytorch default flavor). Unpickling runs arbitrary code: set only "
        "for sources you control."))

    @model_validator(mode="after")
    def _class_for_state_dict(self) -> "ModelSource":
        if self.format == "state_dict" and not self.class_path:
            raise ValueError("format 'state_dict' needs class_path ('module:Class') to load the weights into")
        return self


class ModelSpec(_Model):
    """The FP32 reference: an MLflow registered model version."""

    registered_name: str = Field(description="MLflow registered model holding the FP32 reference.")
    version: str = Field("latest", description="'latest', a version number, or '@alias'. The trigger overrides it.")
    task: Task = Field(description="Decides the parity metrics (see components/validate/README.md).")
    inputs: list[TensorSpec] = Field(min_length=1, description="Model inputs, in forward() order.")
    outputs: list[TensorSpec] = Field(min_length=1, description="Model outputs; the first is compared for parity.")
    source: ModelSource = Field(default_factory=ModelSource, description="Storage format and trust.")
    export: ExportSpec = Field(default_factory=ExportSpec, description="torch -> ONNX export settings.")
    pad_values: dict[str, float] = Field(default_factory=dict, description=(
        "Value used to pad each variable-length input per batch (default 0; attention masks pad with 0)."))

    @field_validator("version")
    @classmethod
    def _version(cls, v: str) -> str:
        v = str(v)
        if v == "latest" or re.fullmatch(r"[1-9]\d*", v) or re.fullmatch(r"@[A-Za-z0-9_\-]+", v):
            return v
        raise ValueError("must be 'latest', a positive version number, or '@alias'")


# ---------------------------------------------------------------------------------------------- data
class Expectation(_Model):
    """A Great Expectations expectation, by its snake_case type and keyword arguments."""

    type: str = Field(description="e.g. expect_column_values_to_be_between", pattern=r"^expect_[a-z0-9_]+$")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Arguments, e.g. {column: n_tokens, min_value: 1}.")
    datasets: list[Literal["calibration", "validation"]] = Field(
        default_factory=lambda: ["calibration", "validation"], description="Datasets the expectation applies to.")


class DatasetSpec(_Model):
    """One Parquet dataset: a column per model input (array-valued), plus label and metadata columns."""

    uri: str = Field(description="Parquet file path (relative to the spec file) or s3:// URI.")
    max_samples: int | None = Field(None, ge=1, description="Use at most this many rows (seeded sample).")
    min_rows: int = Field(1, ge=1, description="Fewer rows fails the data check.")
    batch_size: int = Field(32, ge=1, description="Rows per inference batch (padded per batch).")
    label_column: str | None = Field(None, description=(
        "Ground-truth label column: classification accuracy (integer class ids), or embedding kNN label "
        "accuracy (any hashable labels)."))
    seed: int = Field(0, description="Seed for the max_samples subsample.")


class CalibrationSpec(DatasetSpec):
    """The calibration set for static quantization."""

    max_samples: int | None = Field(256, ge=1, description="Calibration rows (seeded sample).")
    batch_size: int = Field(8, ge=1, description="Rows per calibration batch.")
    stratify_by: str | None = Field(None, description=(
        "Metadata column to stratify the calibration sample over, so rare slices are represented."))


class DataSpec(_Model):
    """Calibration and validation data, and the expectations the data check enforces."""

    calibration: CalibrationSpec = Field(description="Calibration set (static INT8).")
    validation: DatasetSpec = Field(description="Validation set: parity, slices and latency inputs.")
    expectations: list[Expectation] = Field(default_factory=list, description=(
        "Extra Great Expectations run on top of the built-in ones (input columns present, non-null, finite)."))


# -------------------------------------------------------------------------------------------- slices
class SliceSpec(_Model):
    """A declared slice: rows grouped by a metadata column's value, bins or quantiles."""

    name: str = Field(description="Slice name used in metric keys: slice.<name>.<value>.<metric>.",
                      pattern=r"^[A-Za-z0-9_\-]+$", max_length=MAX_SLICE_NAME)
    column: str = Field(description="Metadata column in the validation data.")
    values: list[str | int] | None = Field(None, description="Only these values (default: every value seen).")
    bins: list[float] | None = Field(None, min_length=2, description="Bin edges, left-closed [a, b).")
    quantiles: int | None = Field(None, ge=2, le=100, description="Number of equal-frequency bins.")
    max_groups: int = Field(100, ge=1, le=MAX_SLICE_GROUPS, description=(
        "At most this many groups; the rest go to 'other'."))

    @model_validator(mode="after")
    def _one_kind(self) -> "SliceSpec":
        kinds = [k for k in ("values", "bins", "quantiles") if getattr(self, k) is not None]
        if len(kinds) > 1:
            raise ValueError(f"give at most one of values, bins, quantiles (got {', '.join(kinds)})")
        if self.bins is not None and sorted(self.bins) != self.bins:
            raise ValueError("bins must be increasing")
        return self


# ------------------------------------------------------------------------------------------ variants
class GraphOptimizationSpec(_Model):
    """ONNX Runtime graph optimization applied before (or instead of) quantization."""

    level: Literal["disabled", "basic", "extended", "all"] = Field(
        "extended", description="ORT GraphOptimizationLevel used when saving the optimized model.")
    fusion: Literal["none", "bert"] = Field("none", description=(
        "Transformer fusion (onnxruntime.transformers.optimizer): 'bert' fuses attention/LayerNorm/GELU."))
    num_heads: int = Field(0, ge=0, description="Attention heads for fusion (0: detect).")
    hidden_size: int = Field(0, ge=0, description="Hidden size for fusion (0: detect).")


class QuantizationSpec(_Model):
    """INT8 quantization with ONNX Runtime (onnxruntime.quantization)."""

    mode: Literal["dynamic", "static"] = Field(description="dynamic: weights only, activations at run time; "
                                                           "static: activations calibrated on the calibration set.")
    format: Literal["qdq", "qoperator"] = Field("qdq", description=(
        "Static quantization format (QDQ recommended). Dynamic quantization always writes QOperator "
        "(MatMulInteger/DynamicQuantizeLinear) and ignores this field."))
    per_channel: bool = Field(False, description="Per-channel weight scales (per output channel).")
    reduce_range: bool = Field(False, description="7-bit weights (for CPUs without VNNI).")
    weight_type: Literal["int8", "uint8"] = Field("int8", description="Weight integer type.")
    activation_type: Literal["int8", "uint8"] = Field("uint8", description="Activation type (static only).")
    calibration_method: Literal["minmax", "entropy", "percentile"] = Field(
        "minmax", description="Static only. Entropy/percentile calibrate on fixed-length padded batches.")
    percentile: float = Field(99.999, gt=90, le=100, description="Percentile for calibration_method=percentile.")
    num_bins: int = Field(2048, ge=128, description="Histogram bins for entropy/percentile calibration.")
    op_types: list[str] = Field(default_factory=list, description="Quantize only these op types (default: all).")
    exclude_nodes: list[str] = Field(default_factory=list, description="Node names kept in float.")
    exclude_op_types: list[str] = Field(default_factory=list, description="Op types kept in float (every node).")
    preprocess: bool = Field(True, description="Run quant_pre_process (shape inference, auto_merge) first.")
    preset: str | None = Field(None, description=(
        "A named preset whose fields fill in what this section does not set: cpu-vnni, cpu-avx2 (7-bit weights for "
        "CPUs without VNNI), cpu-arm, transformer-static (MatMul/Gemm only), cpu-dynamic, tensorrt-int8 "
        "(symmetric int8, per-channel, percentile). Each preset's reasons: pipelines/core/presets.py."))

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("preset") is None:
            return data
        from tailguard.core.presets import QUANTIZATION_PRESETS

        name = data["preset"]
        if name not in QUANTIZATION_PRESETS:
            raise ValueError(f"preset: unknown preset {name!r}; known: {', '.join(sorted(QUANTIZATION_PRESETS))}")
        return {**QUANTIZATION_PRESETS[name], **data}


class SearchSpace(_Model):
    """The mixed-precision configurations an accuracy-driven search may try (each list: the values tried)."""

    exclude_most_sensitive: list[int] = Field(default_factory=lambda: [0, 1, 2, 4, 8, 16], description=(
        "Numbers of the most sensitive nodes (sensitivity analysis on the calibration set) kept in float."))
    per_channel: list[bool] = Field(default_factory=lambda: [True, False], description="Per-channel weight scales.")
    calibration_methods: list[Literal["minmax", "entropy", "percentile"]] = Field(
        default_factory=lambda: ["minmax", "percentile"], description="Static variants only: calibration methods.")
    float_op_types: list[list[str]] = Field(default_factory=lambda: [[], ["LayerNormalization",
                                                                          "SkipLayerNormalization", "Softmax",
                                                                          "Gelu", "BiasGelu", "FastGelu"]],
                                            description=(
        "Sets of op types kept in float (added to exclude_op_types), e.g. LayerNorm/Softmax/GELU in higher "
        "precision. Default: [] and the layer-norm/softmax/GELU set. An op type the variant's quantization never "
        "quantizes (ONNX Runtime's registry for its mode: dynamic quantizes MatMul/Gemm/Attention/Gather/..., "
        "never LayerNormalization or GELU) or that the prepared graph lacks is dropped from its set; a set that "
        "then equals one already planned is skipped ('skipped: cannot differ' in search.json)."))

    @field_validator("exclude_most_sensitive", "per_channel", "calibration_methods", "float_op_types")
    @classmethod
    def _not_empty(cls, v: list) -> list:
        if not v:
            raise ValueError("needs at least one value")
        return v


class SearchSpec(_Model):
    """Accuracy-driven search: budget, seed and space (components/search/README.md)."""

    max_trials: int = Field(12, ge=1, description="At most this many configurations are built and validated.")
    max_minutes: float = Field(20.0, gt=0, description="Wall-clock budget of the search (minutes); the trial "
                                                       "running when it ends is finished, no new one starts.")
    seed: int = Field(0, description="Seed of the trial order: the same spec and data give the same trials.")
    sensitivity_samples: int = Field(64, ge=1, description=(
        "Calibration rows used to measure each node's sensitivity (single-node quantization vs FP32)."))
    when: Literal["on_failure", "always"] = Field("on_failure", description=(
        "on_failure: search only when the variant as specified fails its gates; always: search anyway."))
    space: SearchSpace = Field(default_factory=SearchSpace, description="Configurations tried.")


class TensorRTSpec(_Model):
    """TensorRT build settings of a variant on backend tensorrt or on ONNX Runtime's TensorrtExecutionProvider
    (components/quantize/tensorrt_build.py). The optimization profile's shapes come from the spec and the data
    unless set here: batch 1 .. the largest of benchmark.batch_sizes and data.validation.batch_size (optimized for
    promotion.batch_size, default the first benchmark batch size); every named axis after batch 1 .. the longest
    validation row (optimized for the median one). An input outside the profile fails at run time (TensorRT refuses
    it), so serving traffic longer than the validation data needs `max_lengths`."""

    max_batch_size: int | None = Field(None, ge=1, description=(
        "Largest batch of the optimization profile (default: the largest batch the validate step runs)."))
    max_lengths: dict[str, int] = Field(default_factory=dict, description=(
        "Largest size of each named axis of model.inputs (e.g. {sequence: 512}); default: the longest validation "
        "row."))
    workspace_mib: int | None = Field(None, ge=1, description=(
        "Builder workspace memory pool limit (MiB): IBuilderConfig.set_memory_pool_limit(WORKSPACE) / ONNX "
        "Runtime's trt_max_workspace_size; default: TensorRT's (the device's memory)."))
    builder_optimization_level: int | None = Field(None, ge=0, le=5, description=(
        "TensorRT builder optimization level 0-5 (default: TensorRT's, 3); higher builds longer and may run "
        "faster."))

    @field_validator("max_lengths")
    @classmethod
    def _positive(cls, v: dict[str, int]) -> dict[str, int]:
        bad = [k for k, n in v.items() if n < 1]
        if bad:
            raise ValueError(f"max_lengths must be positive ints; got {', '.join(f'{k}: {v[k]}' for k in bad)}")
        return v


class VariantSpec(_Model):
    """One inference variant to build and validate: backend x precision x calibration."""

    name: str = Field(description="Unique, DNS-1123 (a KFP task and MLflow run name).", pattern=NAME_RE)
    backend: Literal["onnxruntime", "tensorrt", "torch"] = Field(description=(
        "Inference engine: onnxruntime (from the exported FP32 ONNX), tensorrt (GPU node pools), or torch "
        "(PyTorch-native, from the registered torch reference: eager, inductor or an AOTInductor package)."))
    precision: Precision = Field(description=(
        "Numeric precision of weights/compute. bf16: torch only (CUDA, or a CPU with AVX512-BF16/AMX-BF16)."))
    execution_provider: str = Field("CPUExecutionProvider", description="ONNX Runtime execution provider.")
    graph_optimization: GraphOptimizationSpec = Field(default_factory=GraphOptimizationSpec,
                                                      description="Graph optimization before quantization.")
    quantization: QuantizationSpec | None = Field(None, description="Required for int8, forbidden otherwise.")
    fp16_op_block_list: list[str] = Field(default_factory=lambda: ["Cast"], description=(
        "fp16 only: op types kept in fp32 (Cast must stay: converting it breaks type inference)."))
    gpu: bool | None = Field(None, description="Runs on a GPU node pool (default: tensorrt or a CUDA/TensorRT EP).")
    compile: Literal["eager", "inductor", "aot_inductor"] | None = Field(None, description=(
        "torch only (default eager): eager runs the torch.export program op by op; inductor compiles it with "
        "torch.compile when loaded (build time measured, cache warmed); aot_inductor builds an AOTInductor package "
        "(.pt2: compiled kernels for one device kind and torch build, checked against its manifest before load)."))
    device: Literal["cpu", "cuda"] | None = Field(None, description=(
        "torch only (default cuda): where the variant is built, validated and served. cuda runs on the "
        "kubeflow.gpu node pool and is skipped, with the reason, on a node without a CUDA device."))
    cuda_graphs: bool = Field(False, description=(
        "torch with device cuda only: replay the model as CUDA graphs, one captured per input shape (at most 64, "
        "least recently used evicted), removing per-kernel launch overhead."))
    search: "SearchSpec | None" = Field(None, description=(
        "INT8 on onnxruntime only: when this variant fails its gates, search mixed-precision configurations "
        "for the fastest one that passes every gate (components/search/README.md)."))
    tensorrt: TensorRTSpec | None = Field(None, description=(
        "backend tensorrt, or onnxruntime on TensorrtExecutionProvider: optimization profile bounds, workspace "
        "and builder optimization level (default: from the data and TensorRT's defaults)."))

    @model_validator(mode="after")
    def _tensorrt_section(self) -> "VariantSpec":
        if self.tensorrt is not None and not self.uses_tensorrt:
            raise ValueError("tensorrt applies to backend tensorrt or to execution_provider TensorrtExecutionProvider "
                             f"(this variant: backend {self.backend}, execution_provider {self.execution_provider})")
        return self

    @property
    def uses_tensorrt(self) -> bool:
        """True for backend tensorrt or an ONNX Runtime variant on TensorrtExecutionProvider."""
        return self.backend == "tensorrt" or (self.backend == "onnxruntime"
                                              and self.execution_provider == "TensorrtExecutionProvider")

    @model_validator(mode="after")
    def _precision_rules(self) -> "VariantSpec":
        torch_fields = [f for f in ("compile", "device") if getattr(self, f) is not None]
        if self.cuda_graphs:
            torch_fields.append("cuda_graphs")
        if self.backend == "torch":
            onnx_fields = [name for name, value, default in (
                ("execution_provider", self.execution_provider, "CPUExecutionProvider"),
                ("graph_optimization", self.graph_optimization, GraphOptimizationSpec()),
                ("fp16_op_block_list", self.fp16_op_block_list, ["Cast"])) if value != default]
            if onnx_fields:
                raise ValueError(f"{', '.join(onnx_fields)}: {'these apply' if len(onnx_fields) > 1 else 'it applies'}"
                                 " to backend onnxruntime, not torch")
            if self.precision == "int8":
                raise ValueError("precision int8 is not offered on backend torch: use onnxruntime (dynamic or "
                                 "static QDQ) or tensorrt")
            if self.precision == "fp16" and self.device == "cpu":
                raise ValueError("fp16 on device cpu: torch has no fast fp16 CPU kernels; use bf16 (a CPU with "
                                 "AVX512-BF16/AMX) or device: cuda")
            if self.cuda_graphs and self.device == "cpu":
                raise ValueError("cuda_graphs needs device: cuda")
        elif torch_fields:
            raise ValueError(f"{', '.join(torch_fields)}: {'these apply' if len(torch_fields) > 1 else 'it applies'} "
                             "to backend torch only")
        elif self.precision == "bf16":
            raise ValueError(f"precision bf16 is offered on backend torch only (not {self.backend})")
        if self.search is not None and (self.precision != "int8" or self.backend != "onnxruntime"):
            raise ValueError("search applies to precision int8 on backend onnxruntime only")
        if self.precision == "int8" and self.backend == "onnxruntime" and self.quantization is None:
            raise ValueError("precision int8 on onnxruntime needs a quantization section (mode: dynamic|static)")
        if self.precision != "int8" and self.quantization is not None:
            raise ValueError(f"quantization applies to int8 only (precision is {self.precision})")
        return self

    @property
    def torch_device(self) -> str:
        """The torch backend's device: `device`, default "cuda"."""
        return self.device or "cuda"

    @property
    def torch_compile(self) -> str:
        """The torch backend's compile mode: `compile`, default "eager"."""
        return self.compile or "eager"

    @property
    def needs_gpu(self) -> bool:
        """True for TensorRT, a CUDA/TensorRT execution provider or a torch variant on cuda, unless `gpu` says
        otherwise."""
        if self.gpu is not None:
            return self.gpu
        if self.backend == "torch":
            return self.torch_device == "cuda"
        return self.backend == "tensorrt" or self.execution_provider in (
            "CUDAExecutionProvider", "TensorrtExecutionProvider")


# --------------------------------------------------------------------------------------------- gates
class GateSpec(_Model):
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


# ------------------------------------------------------------------------------------------ analysis
class DiscoverySpec(_Model):
    """Automatic worst-slice discovery over metadata columns (components/validate/discovery.py)."""

    enabled: bool = Field(True, description="Search metadata columns for the worst slices.")
    columns: list[str] | None = Field(None, description=(
        "Metadata columns searched (default: every validation column that is not a model input or the label)."))
    pairs: bool = Field(True, description="Also search pairs of columns (conjunctions of two values).")
    metric: str | None = Field(None, description=(
        "Parity metric compared (default: classification top1_agreement, embedding nn_top1_agreement, "
        "regression/generic abs_error.mean)."))
    min_support: int = Field(30, ge=5, description="Candidate slices need at least this many validation rows.")
    max_bins: int = Field(4, ge=2, le=20, description="Numeric columns are cut into this many quantile bins.")
    max_values: int = Field(100, ge=2, description="Categorical columns with more distinct values are skipped.")
    alpha: float = Field(0.05, gt=0, lt=0.5, description=(
        "False discovery rate (Benjamini-Hochberg) across every candidate slice tested."))
    max_results: int = Field(20, ge=1, description="Report at most this many discovered slices (worst first).")


class BootstrapSpec(_Model):
    """Percentile bootstrap for confidence bounds of metrics that are not proportions."""

    samples: int = Field(1000, ge=100, description="Bootstrap resamples.")
    seed: int = Field(0, description="Seed: the same data give the same bounds.")


class SensitivitySpec(_Model):
    """Per-node quantization sensitivity of INT8 variants, also when no search runs (components/search/README.md)."""

    enabled: bool = Field(False, description=(
        "Rank the quantizable nodes of every INT8 onnxruntime variant by the output error of quantizing each one "
        "alone (calibration rows); sensitivity.csv and sensitivity.png go to the variant's run. A search always "
        "does this for the variant it searches."))
    samples: int = Field(64, ge=1, description="Calibration rows used.")


class EmbeddingAnalysisSpec(_Model):
    """Settings of the label- and retrieval-aware embedding metrics (pipelines/core/parity.py)."""

    knn_k: int = Field(1, ge=1, le=100, description=(
        "accuracy / reference_accuracy (task embedding, with data.validation.label_column): the label predicted "
        "for a row is the majority label of its knn_k nearest FP32 neighbours (ties: the nearer neighbour's)."))
    recall_k: int = Field(10, ge=1, le=1000, description=(
        "nn_recall_at_k: share of the FP32 query's k nearest neighbours that the variant's query also ranks in "
        "its k nearest."))
    margin_tolerance: float = Field(0.01, ge=0, le=2, description=(
        "nn_top1_margin_agreement: a top-1 disagreement counts only where the FP32 query's top-1 and top-2 "
        "cosine similarities differ by more than this (a near-tie may flip under any rounding)."))


class SequentialSpec(_Model):
    """Parity decided sequentially (issue 25): validation rows are scored in a seeded shuffled order, block by block,
    and each parity gate is decided as soon as a confidence sequence for its all-rows value says which side of its
    threshold that value falls (docs/spec.md, Sequential validation)."""

    enabled: bool = Field(True, description=(
        "Score the validation rows in shuffled blocks and stop when the gates are decided; false scores every row "
        "(the decisions on all rows are the same either way)."))
    alpha: float = Field(0.01, gt=0, lt=0.5, description=(
        "Per gate: the chance that a gate decided before the last row differs from its decision on every row "
        "(the prior-posterior-ratio confidence sequence of Waudby-Smith & Ramdas 2020, split evenly over the "
        "gate's slice groups)."))
    block_rows: int = Field(100, ge=1, description="Rows scored between two looks at the gates.")
    min_rows: int = Field(200, ge=1, description=(
        "No gate is decided on fewer rows than this (all rows when the validation set is smaller)."))
    seed: int = Field(0, description="Seed of the row order: the same data and seed score the same rows.")
    stop: Literal["verdict", "all_gates"] = Field("verdict", description=(
        "verdict: stop as soon as the variant's verdict is known (every gate decided passed, or one decided "
        "failed: the others are then reported undecided); all_gates: stop only when every gate is decided."))


class AnalysisSpec(_Model):
    """What validation computes beyond the gates: tail samples, worst-slice discovery, bootstrap settings."""

    worst_k: int = Field(50, ge=0, description=(
        "Keep the k validation rows with the worst per-row parity (worst_samples.csv, with their metadata)."))
    discovery: DiscoverySpec = Field(default_factory=DiscoverySpec, description="Worst-slice discovery.")
    bootstrap: BootstrapSpec = Field(default_factory=BootstrapSpec, description="Bootstrap for bounds.")
    sensitivity: SensitivitySpec = Field(default_factory=SensitivitySpec, description=(
        "Per-node sensitivity of INT8 variants without a search."))
    embedding: EmbeddingAnalysisSpec = Field(default_factory=EmbeddingAnalysisSpec, description=(
        "k and tolerance of the embedding metrics accuracy (kNN), nn_recall_at_k and nn_top1_margin_agreement."))
    sequential: SequentialSpec = Field(default_factory=SequentialSpec, description=(
        "Score validation rows in shuffled blocks until every gate is decided (anytime-valid decisions)."))


# ------------------------------------------------------------------------------- benchmark and cost
class BenchmarkSpec(_Model):
    """Latency measurement on this node: warm-up, then timed iterations per batch size."""

    batch_sizes: list[int] = Field(default_factory=lambda: [1, 32], min_length=1,
                                   description="Batch sizes to time.")
    warmup: int = Field(20, ge=0, description="Untimed iterations first.")
    iterations: int = Field(200, ge=1, description="Timed iterations per batch size.")
    max_seconds: float = Field(30.0, gt=0, description="Stop timing a batch size after this long (s).")
    precision: float | None = Field(None, gt=0, lt=1, description=(
        "Stop timing a batch size once the interval on the speed ratio against its interleaved baseline has at "
        "most this relative half-width (e.g. 0.03) and every speed gate with a confidence at that batch size is "
        "decided; bounds are Bonferroni-corrected over the looks (docs/spec.md, Latency measured to a precision). "
        "None: time every iteration up to max_seconds."))
    intra_op_num_threads: int = Field(0, ge=0, description="ORT/torch threads (0: all cores).")
    seed: int = Field(0, description="Seed for drawing the benchmark batches from the validation set.")


class CostSpec(_Model):
    """Price of the serving node, for cost per 1M inferences = usd_per_hour / 3600 / throughput * 1e6."""

    usd_per_hour: float = Field(gt=0, description="On-demand price of the node (USD/hour).")
    instance: str | None = Field(None, description="Node type the price is for, for the report.")


class PromotionSpec(_Model):
    """Registration and promotion in the MLflow model registry."""

    enabled: bool = Field(True, description=(
        "False: register and report, move no alias. While true, every variant needs a parity gate (an overall "
        "or per_slice gate on a parity metric of the task): performance gates alone never promote."))
    alias: str = Field("production", pattern=r"^[A-Za-z][A-Za-z0-9_\-]*$",
                       description="Registry alias set on the selected version.")
    select: Literal["fastest_passing"] = Field("fastest_passing", description=(
        "The selection rule; it has one value, fastest_passing (the only rule implemented; any other value is "
        "refused): the fastest variant passing every gate at `batch_size`, decided with confidence (`margin`)."))
    register_variants: Literal["promoted", "passing", "all"] = Field("promoted", description=(
        "Which variants get a registry version: promoted (default): only the one `select` chose (also with "
        "enabled: false, then without the alias); passing: every variant that passed every gate; all: every "
        "built variant, failing ones included. Every variant's MLflow run is logged whatever this says, and an "
        "artefact whose sha256 an existing version already holds reuses that version (docs/spec.md, promotion)."))
    batch_size: int | None = Field(None, ge=1, description="Batch size for 'fastest' (default: the first).")
    margin: float | None = Field(0.03, ge=0, lt=1, description=(
        "The fastest passing variant takes the alias only when, timed interleaved with every other passing "
        "variant at `batch_size`, the lower 95% bound of its speed ratio over each is above 1 + margin; "
        "otherwise the current alias holder keeps it if it is among the variants within that margin, else the "
        "most exact of them (fp32, then fp16, then int8). None: the lowest validation p50, no comparison."))
    registered_name: str | None = Field(None, description="Registered model for variants "
                                                          "(default: <model.registered_name>-optimized).")


class MlflowSpec(_Model):
    """Where runs and models go. Defaults to the embedded store under $TAILGUARD_HOME."""

    tracking_uri: str | None = Field(None, description="Default sqlite:///$TAILGUARD_HOME/mlflow.db.")
    registry_uri: str | None = Field(None, description="Default: the tracking URI.")
    experiment: str | None = Field(None, description="Experiment name (default: tailguard/<metadata.name>).")


# -------------------------------------------------------------------------- kubeflow and monitoring
class Toleration(_Model):
    """A Kubernetes toleration for GPU node pools."""

    key: str = Field(description="Taint key, e.g. nvidia.com/gpu.")
    operator: Literal["Exists", "Equal"] = Field("Exists", description="Toleration operator.")
    value: str | None = Field(None, description="Taint value (operator Equal).")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        "NoSchedule", description="Taint effect.")


class GpuPoolSpec(_Model):
    """Scheduling of GPU steps on a GPU node pool."""

    accelerator_type: str = Field("nvidia.com/gpu", description="dsl set_accelerator_type value.")
    count: int = Field(1, ge=1, description="GPUs per GPU step.")
    node_selector: dict[str, str] = Field(default_factory=dict, description="Node labels for GPU steps.")
    tolerations: list[Toleration] = Field(default_factory=list, description="Tolerations for GPU steps.")


class SecretRef(_Model):
    """A Kubernetes secret mounted as environment variables: {ENV_VAR: secret key}."""

    name: str = Field(description="Secret name.")
    env: dict[str, str] = Field(description="Environment variable -> key in the secret.")


class KubeflowSpec(_Model):
    """Cluster settings for `tailguard compile` / `submit` (images, GPU node pool, secrets)."""

    image: str | None = Field(None, description="Default component image (CPU steps).")
    gpu_image: str | None = Field(None, description="Image for GPU steps (TensorRT base).")
    gpu: GpuPoolSpec = Field(default_factory=GpuPoolSpec, description="GPU node pool for GPU steps.")
    secrets: list[SecretRef] = Field(default_factory=list, description="Secrets as env vars, never parameters.")
    experiment: str | None = Field(None, description="KFP experiment name.")


def target_task_name(variant: str, target: str) -> str:
    """The KFP task that validates `variant` on serving target `target`: 'validate-<variant>-on-<target>'."""
    return f"validate-{variant}-on-{target}"


def target_alias(alias: str, target: str) -> str:
    """The registry alias of serving target `target`: '<promotion.alias>-<target>', e.g. 'production-avx512'."""
    return f"{alias}-{target}"


class AcceleratorSpec(_Model):
    """The accelerator a serving target's nodes carry (KFP `set_accelerator_type` / `set_accelerator_limit`)."""

    type: str = Field(description="Accelerator resource, e.g. nvidia.com/gpu (dsl set_accelerator_type value).")
    count: int = Field(1, ge=1, description="Accelerators per validate task on this target.")


class TargetExpect(_Model):
    """What a serving target's nodes must be, checked against the facts of the node a validate task ran on
    (tailguard.core.hardware.node_facts): a task on a node that does not match validates nothing and is marked
    skipped with the differences as its reason, never passed (issue 23)."""

    isa: list[str] = Field(default_factory=list, description=(
        "ISA flags the node's CPU must have, as /proc/cpuinfo spells them (one of " + ", ".join(KERNEL_ISA_FLAGS)
        + "), e.g. [avx512_vnni] for a pool of VNNI CPUs."))
    absent_isa: list[str] = Field(default_factory=list, description=(
        "ISA flags the node's CPU must not have, e.g. [avx512_vnni, avx_vnni] for a pool of AVX2-only CPUs (whose "
        "u8 x s8 INT8 kernel differs from a VNNI CPU's)."))
    compute_capability: list[str] = Field(default_factory=list, description=(
        "GPU compute capabilities allowed, e.g. ['8.9'] (L4) or ['9.0'] (H100): the node needs a visible GPU and "
        "every visible GPU must have one of them."))

    @field_validator("isa", "absent_isa")
    @classmethod
    def _known_flags(cls, v: list[str]) -> list[str]:
        unknown = [f for f in v if f not in KERNEL_ISA_FLAGS]
        if unknown:
            raise ValueError(f"unknown ISA flag(s) {unknown}: name flags that change kernels, one of "
                             f"{list(KERNEL_ISA_FLAGS)}")
        return v

    @field_validator("compute_capability")
    @classmethod
    def _capability_form(cls, v: list[str]) -> list[str]:
        bad = [c for c in v if not re.fullmatch(r"\d+\.\d+", str(c))]
        if bad:
            raise ValueError(f"compute capabilities are written major.minor, e.g. '8.9'; got {bad}")
        return v


class ServingTarget(_Model):
    """A node pool a variant will serve on (issue 23). With `serving_targets`, the validate step of each variant
    runs once per target that serves it, on that pool (`tailguard compile`), the gates hold per target and
    promotion moves `<promotion.alias>-<name>` to the fastest variant passing there (docs/spec.md, Serving
    targets)."""

    name: str = Field(pattern=NAME_RE, description=(
        "DNS-1123 name: part of the validate task's name (validate-<variant>-on-<name>) and of the per-target "
        "alias (<promotion.alias>-<name>, e.g. production-avx512)."))
    node_selector: dict[str, str] = Field(default_factory=dict, description=(
        "Node labels of the pool (kfp-kubernetes add_node_selector), e.g. {node.kubernetes.io/instance-type: "
        "c7i.2xlarge}."))
    tolerations: list[Toleration] = Field(default_factory=list, description="Tolerations for the pool's taints.")
    accelerator: AcceleratorSpec | None = Field(None, description=(
        "The pool's accelerator. A target with one serves the GPU variants (TensorRT, a CUDA/TensorRT execution "
        "provider, `gpu: true`); a target without one serves the CPU variants."))
    expect: TargetExpect | None = Field(None, description=(
        "What the pool's nodes must be (ISA flags, compute capability), checked on the node each validate task "
        "ran on; a node that differs validates nothing (skipped, with the differences), never passes."))

    @property
    def gpu(self) -> bool:
        """True when the target carries an accelerator (it serves the GPU variants)."""
        return self.accelerator is not None

    def serves(self, variant: "VariantSpec") -> bool:
        """Whether `variant` serves on this target: GPU variants on targets with an accelerator, CPU variants on
        targets without one."""
        return variant.needs_gpu == self.gpu


# Per-row parity metrics (tailguard.core.parity) the shadow monitor can track and alert on (metric catalogue).
MONITOR_METRICS: tuple[str, ...] = tuple(r.key for r in _metrics.ROW_METRICS if r.monitored)


# Direction and range of a monitored metric come from the metric catalogue (tailguard.core.metrics.ROW_METRICS);
# `spec check` checks each threshold against them (MonitorThreshold.problems, via MonitoringSpec.task_problems).
class MonitorThreshold(_Model):
    """When a monitored per-row parity metric is bad in a slice: an absolute bound, or an allowed drop from a
    baseline (e.g. the variant's validation value). Give exactly one of `min`, `max`, or `baseline` + `max_drop`.

    The direction of `max_drop` follows the metric: agreement and cosine similarity are higher-is-better
    (bad when < baseline - max_drop); KL divergence and errors are lower-is-better (bad when > baseline + max_drop).
    """

    min: float | None = Field(None, description="Bad when the slice's mean is confidently below this value.")
    max: float | None = Field(None, description="Bad when the slice's mean is confidently above this value.")
    baseline: float | None = Field(None, description=(
        "Expected value of the metric (e.g. the promoted variant's validation value); needs max_drop."))
    max_drop: float | None = Field(None, ge=0, description=(
        "Allowed change from `baseline` in the metric's bad direction (absolute units of the metric)."))
    truncate_at: float | None = Field(None, gt=0, description=(
        "For a lower-is-better metric without an upper end (kl_divergence, abs_error, rel_error): row values "
        "above this count as this value in both the alarm and the recovery test, so the detector watches the "
        "truncated mean E[min(x, truncate_at)] on both sides and an alert can clear on evidence. Without it "
        "such an alert stays active until the monitor restarts (docs/monitor.md, Recovery)."))

    @model_validator(mode="after")
    def _one_kind(self) -> "MonitorThreshold":
        kinds = [k for k, v in (("min", self.min), ("max", self.max)) if v is not None]
        relative = self.baseline is not None or self.max_drop is not None
        if relative and (self.baseline is None or self.max_drop is None):
            raise ValueError("baseline and max_drop go together")
        if len(kinds) + int(relative) != 1:
            raise ValueError("give exactly one of min, max, or baseline + max_drop")
        return self

    def problems(self, metric: str, path: str) -> list[FieldError]:
        """What is wrong with this threshold for a per-row metric, from the metric catalogue's direction and range.

        Rules: `min` only for a higher-is-better metric, `max` only for a lower-is-better one (the bad side);
        every value (min, max, baseline) inside the metric's range; and the resolved threshold (min, max, or
        baseline -/+ max_drop) short of the range's bad end, where the slice mean could never be confidently
        beyond it, so the alert could never fire (e.g. top1_agree min 0, cosine_similarity min -1).

        Args:
            metric: a per-row key of the catalogue's ROW_METRICS, e.g. "top1_agree".
            path: field path of this threshold, e.g. "monitoring.thresholds.top1_agree".

        Returns:
            One FieldError per problem (path + ".min", ".max", ".baseline" or ".max_drop"); [] when sound.

        Raises:
            InputError: `metric` is not a per-row key.
        """
        row = _metrics.row_metric(metric)
        higher = row.higher_is_better
        lo, hi = row.value_range
        bad_end = lo if higher else hi  # the value the slice mean cannot be confidently beyond
        where = f"[{lo:g}, {hi:g}]" if hi != float("inf") else f"[{lo:g}, inf)"
        units = f" ({row.units}{', a fraction, not a percentage' if (lo, hi) == (0.0, 1.0) else ''})"
        never = "a slice mean is never confidently beyond it, so this threshold never alerts"
        errors: list[FieldError] = []
        for key in ("min", "max"):
            value = getattr(self, key)
            if value is None:
                continue
            if (key == "min") != higher:
                kind = "higher-is-better (bad when low)" if higher else "lower-is-better (bad when high)"
                errors.append(FieldError(f"{path}.{key}", f"{metric} is {kind}: give {'min' if higher else 'max'}, "
                                                          f"not {key}", value))
            elif not lo <= value <= hi:
                errors.append(FieldError(f"{path}.{key}", f"{metric} lies in {where}{units}, got {value:g}", value))
            elif value == bad_end:
                errors.append(FieldError(f"{path}.{key}", f"{metric} {key} {value:g} is the metric's "
                                                          f"{'lowest' if higher else 'highest'} value: {never}", value))
        if self.baseline is not None and self.max_drop is not None:
            threshold = self.baseline - self.max_drop if higher else self.baseline + self.max_drop
            if not lo <= self.baseline <= hi:
                errors.append(FieldError(f"{path}.baseline", f"{metric} lies in {where}{units}, got "
                                                             f"{self.baseline:g}", self.baseline))
            elif (threshold <= lo) if higher else (threshold >= hi):
                errors.append(FieldError(f"{path}.max_drop", (
                    f"baseline {'-' if higher else '+'} max_drop = {threshold:g} is at or beyond {metric}'s "
                    f"{'lowest' if higher else 'highest'} value {bad_end:g}: {never}; give a max_drop below "
                    f"{abs(self.baseline - bad_end):g}"), self.max_drop))
        if self.truncate_at is not None:
            threshold = (self.min if self.min is not None else self.max if self.max is not None
                         else (self.baseline or 0.0) + (self.max_drop or 0.0))
            if higher or hi != float("inf"):
                errors.append(FieldError(f"{path}.truncate_at", (
                    f"{metric} is bounded on its bad side ({where}): truncate_at is only for a lower-is-better "
                    "metric without an upper end (kl_divergence, abs_error, rel_error); remove it"),
                    self.truncate_at))
            elif self.truncate_at <= threshold:
                errors.append(FieldError(f"{path}.truncate_at", (
                    f"truncate_at {self.truncate_at:g} must lie above the threshold {threshold:g} (a truncated "
                    "value at or below the threshold could never look bad); e.g. 10x the threshold"),
                    self.truncate_at))
        return errors


class MonitorS3Spec(_Model):
    """Where sampled (request, reference, candidate) pairs go: Parquet batches in S3 (boto3)."""

    bucket: str = Field(description="S3 bucket.", min_length=3)
    prefix: str = Field("tailguard/monitor", description="Key prefix; objects are <prefix>/<model>/<date>/<id>.parquet.")
    endpoint_url: str | None = Field(None, description="S3-compatible endpoint (MinIO, moto); default AWS.")
    region: str | None = Field(None, description="AWS region (default: the boto3 configuration).")
    batch_rows: int = Field(500, ge=1, description="Sampled pairs per Parquet object.")
    flush_interval_s: float = Field(60.0, gt=0, description="Write a partial batch after this long (s).")
    retry_interval_s: float = Field(30.0, gt=0, description="Retry spooled batches this often (s).")


class MonitoringSpec(_Model):
    """Shadow-traffic monitor settings (used by `tailguard monitor serve` / `replay`; docs/monitor.md).

    Slices come from the request's OIP `parameters` (serve) or the metadata columns (replay). Every slice key is
    measured (up to `max_tracked_slices`); per (slice, metric) with a threshold, a betting CUSUM (sequential
    change detection) tests the slice's traffic mean against the threshold, with the probability of any false
    alarm within `horizon` sampled requests at most `alpha`, across every slice and metric. Only `all`, alerting
    slices and the `max_slices` slices with the most evidence are exported as Prometheus labels.
    """

    sample_rate: float = Field(gt=0, le=1, description=(
        "Base fraction of live requests compared with the reference (required: there is no safe default)."))
    seed: int | None = Field(None, description="Sampler seed (serve); None draws one. Replay takes --seed.")
    rare_slice_frequency: float = Field(0.05, ge=0, le=1, description=(
        "A slice seen in less than this fraction of the traffic so far is oversampled by "
        "rare_slice_frequency / frequency (capped by max_oversample); 0 turns oversampling off."))
    max_oversample: float = Field(20.0, ge=1, description="Cap of the rare-slice oversampling factor.")
    slice_columns: list[str] | None = Field(None, description=(
        "Slices to track: names of declared `slices` (their column, bins and values apply) or plain metadata "
        "columns / request parameters (grouped by value). Default: every declared slice."))
    slice_pairs: bool | list[list[str]] = Field(False, description=(
        "Intersections tracked as slices too (keys like 'locale=37&ink=low'): true for every pair of "
        "slice_columns, or a list of [name, name] pairs. Each pair adds one detector update per sampled request, "
        "which the false-alarm control counts."))
    max_tracked_slices: int = Field(100_000, ge=1, le=10_000_000, description=(
        "Memory bound on measured slice keys (about 1 KB each); past it the least recently updated slice "
        "without an active alert is evicted and counted (tailguard_monitor_slices_evicted_total)."))
    max_slices: int = Field(50, ge=1, le=1000, description=(
        "Prometheus label bound: besides 'all' and every slice with an active alert, at most this many slices "
        "(those with the most evidence) are exported; every slice is in /v1/slices and slices.json."))
    metrics: list[str] | None = Field(None, description=(
        "Per-row parity metrics to track (tailguard.core.parity); default by task: classification "
        "top1_agree, kl_divergence, abs_error; embedding cosine_similarity, abs_error; regression/generic "
        "abs_error, rel_error. candidate_error_rate (1 for a sampled row the candidate failed on) is always "
        "tracked."))
    thresholds: dict[str, MonitorThreshold] | None = Field(None, description=(
        "Alert thresholds by per-row metric; default: classification top1_agree min 0.97, embedding "
        "cosine_similarity min 0.98, none for regression/generic; candidate_error_rate max 0 always (a "
        "candidate that fails on sampled rows alerts) unless given here. Metrics without a threshold are "
        "exported, never alerted on."))
    alpha: float = Field(0.01, gt=0, lt=0.5, description=(
        "Probability of any false alarm (any slice, any metric) within `horizon` sampled requests while every "
        "slice sits at or on the good side of its threshold (requests independent of each other; the rows of "
        "one request need not be: the request is the unit of evidence, docs/monitor.md)."))
    horizon: int = Field(1_000_000, ge=1, description=(
        "Sampled requests (not rows: a 64-row request counts once) the alpha guarantee covers; the average run "
        "length to a false alarm is at least horizon / alpha sampled requests."))
    window_size: int = Field(1000, ge=10, description=(
        "Span (sampled rows) of each slice's exponentially weighted display estimate (the parity gauges); "
        "alerts do not depend on it."))
    min_support: int = Field(30, ge=1, description=(
        "A slice alerts only once it has this many sampled rows (a guard against alerts on a handful of rows; "
        "the false-alarm guarantee does not need it)."))
    shadow_batch_rows: int = Field(256, ge=1, le=65536, description=(
        "The shadow worker runs queued sampled requests that share an input signature (names, dtypes, "
        "non-batch dimensions) as one inference call per model, up to this many rows; each request keeps its "
        "own evidence. 1 turns micro-batching off."))
    shadow_batch_wait_ms: float = Field(2.0, ge=0, le=1000, description=(
        "Longest wait (ms) for more queued requests to fill a micro-batch once one is taken; 0 takes only "
        "what is already queued."))
    noise_floor: bool = Field(False, description=(
        "Compare the reference with itself (a second run) instead of the candidate: measures the "
        "comparison's own noise; must never alert."))
    queue_size: int = Field(1000, ge=1, description="Sampled requests waiting for the shadow; more are dropped.")
    reference_timeout_s: float = Field(2.0, gt=0, description="A reference call slower than this is dropped (s).")
    logger_join_max_entries: int = Field(10000, ge=1, description=(
        "KServe payload-logger endpoint (POST /v2/models/{name}/logger): at most this many CloudEvent halves "
        "(a request or a response whose other half has not arrived) wait to be joined by ce-id; when full, the "
        "oldest is dropped (dropped_total{reason=\"join_overflow\"}). Memory grows with it (one body each)."))
    logger_join_ttl_s: float = Field(30.0, gt=0, description=(
        "A payload-logger half whose other half has not arrived within this many seconds is dropped "
        "(dropped_total{reason=\"unmatched\"}); cover the serving latency plus the logger's queueing delay."))
    model_name: str | None = Field(None, description=(
        "Model name in the OIP paths /v2/models/{name}/... (default: metadata.name)."))
    redact_fields: list[str] = Field(default_factory=list, description=(
        "Input names or request parameters replaced by '<redacted>' before sampled pairs leave the process."))
    s3: MonitorS3Spec | None = Field(None, description="Sampled pairs to S3 as Parquet (off when absent).")
    spool_dir: str | None = Field(None, description=(
        "Local spool for batches S3 did not take (default $TAILGUARD_HOME/monitor/spool)."))
    spool_max_bytes: int = Field(256 * 2**20, ge=1024, description="Spool bound (bytes); beyond it batches are "
                                                                    "dropped and counted.")
    evidently_workspace: str | None = Field(None, description=(
        "Evidently workspace folder for drift snapshots (`evidently ui --workspace PATH`); off when absent."))
    evidently_project: str = Field("tailguard-monitor", description="Evidently project name.")
    snapshot_every: int = Field(1000, ge=10, description="Sampled rows per Evidently snapshot (one window).")
    drift_reference: str | None = Field(None, description=(
        "Parquet file of reference inputs for input drift (default: data.calibration.uri)."))
    max_body_bytes: int = Field(8 * 2**20, ge=1024, le=2**31, description=(
        "Largest body accepted by the ingest endpoints (infer, pairs, and each payload-logger CloudEvent), in "
        "bytes; larger ones are refused with 413 before they are parsed "
        "(invalid_requests_total{reason=\"body_too_large\"})."))
    max_batch_rows: int = Field(1024, ge=1, le=2**31, description=(
        "Most rows (the first dimension of the inputs) one request may carry; larger requests are refused with "
        "413 (invalid_requests_total{reason=\"batch_too_large\"}), so one request cannot flood the windows."))
    logger_join_max_bytes: int = Field(256 * 2**20, ge=1024, le=2**40, description=(
        "Payload-logger join buffer: most bytes of waiting halves held at once (each half is kept as the raw "
        "body it arrived as, parsed again when its partner comes); a half that does not fit evicts the oldest "
        "ones (dropped_total{reason=\"join_overflow\"})."))
    logger_join_max_entry_bytes: int | None = Field(None, ge=1024, le=2**31, description=(
        "Payload-logger join buffer: largest half that may wait for its partner, in bytes (default: "
        "max_body_bytes); a larger first half is refused with 413 "
        "(invalid_requests_total{reason=\"join_entry_too_large\"})."))
    max_concurrent_requests: int = Field(64, ge=1, le=100_000, description=(
        "HTTP ingest requests (POST /v2/...) handled at once; more are answered 503 at once, before their body "
        "is read (invalid_requests_total{reason=\"too_many_requests\"}). uvicorn's own limit_concurrency (open "
        "connections and tasks, a memory bound) is set to this plus 1024."))
    max_inflight_body_bytes: int = Field(256 * 2**20, ge=1024, le=2**40, description=(
        "Bytes of HTTP ingest bodies being read at once, over every request in flight (a declared "
        "Content-Length is reserved before reading); a body that does not fit is answered 503 "
        "(invalid_requests_total{reason=\"body_budget_exceeded\"}). At least max_body_bytes."))
    max_new_values_per_minute: int | None = Field(1000, ge=1, le=10_000_000, description=(
        "Per slice column, at most this many values the monitor does not track yet get their own slice key per "
        "minute (a token bucket); the excess is lumped into '<name>=__new__' and counted "
        "(tailguard_monitor_slice_values_lumped_total), so a flood of unique values cannot evict real slices. "
        "null: no limit."))
    auth_token_env: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", description=(
        "Name of the environment variable holding the bearer token every monitor endpoint requires "
        "(Authorization: Bearer <token>; gRPC metadata `authorization`), e.g. from a Kubernetes Secret. Never "
        "the token itself. Unset (and no auth_token_file / --auth-token-file): no authentication."))
    auth_token_file: str | None = Field(None, description=(
        "Path of a file holding the bearer token (a mounted Secret); `monitor serve --auth-token-file` "
        "overrides it. At most one of auth_token_env and auth_token_file."))
    auth_readyz: bool = Field(False, description=(
        "With a token: /readyz (and gRPC ServerReady/ModelReady) require it too. Default false: kubelet probes "
        "send no token. /healthz and gRPC ServerLive never require it."))
    auth_metrics: bool = Field(True, description=(
        "With a token: /metrics requires it (give Prometheus the token: ServiceMonitor "
        "`authorization.credentials`). false: /metrics is open."))

    @model_validator(mode="after")
    def _hardening_bounds(self) -> "MonitoringSpec":
        if self.max_inflight_body_bytes < self.max_body_bytes:
            raise ValueError(f"max_inflight_body_bytes ({self.max_inflight_body_bytes}) is below max_body_bytes "
                             f"({self.max_body_bytes}): a largest body could never be read; raise it")
        if self.auth_token_env and self.auth_token_file:
            raise ValueError("auth_token_env and auth_token_file both set: name one source of the token")
        return self

    @field_validator("thresholds")
    @classmethod
    def _known_threshold_metrics(cls, v: dict[str, MonitorThreshold] | None) -> dict[str, MonitorThreshold] | None:
        known = MONITOR_METRICS
        for k in v or {}:
            if k not in known:
                raise ValueError(f"unknown per-row metric {k!r}; choose from {sorted(known)}")
        return v

    @field_validator("metrics")
    @classmethod
    def _known_metrics(cls, v: list[str] | None) -> list[str] | None:
        known = MONITOR_METRICS
        for k in v or []:
            if k not in known:
                raise ValueError(f"unknown per-row metric {k!r}; choose from {sorted(known)}")
        return v

    def task_problems(self, task: str) -> list[FieldError]:
        """What is wrong with the tracked metrics and thresholds for the model's task (field paths under
        `monitoring.`); `Spec` reports them at `spec check`, `monitoring.config.resolve_config` again.

        Rules: every `metrics` entry is a per-row metric the monitor computes for the task (catalogue:
        classification top1_agree, kl_divergence, abs_error; embedding cosine_similarity, abs_error;
        regression/generic abs_error, rel_error); every `thresholds` key is tracked (`metrics`, default all of
        the task's); each threshold passes `MonitorThreshold.problems` (direction, range).

        Args:
            task: model.task.

        Returns:
            One FieldError per problem, [] when sound.
        """
        available = _metrics.monitor_metrics(task)
        tracked = tuple(self.metrics) if self.metrics else available
        errors = [FieldError(f"monitoring.metrics.{i}", f"{m!r} is not a per-row metric of task {task!r}; use "
                                                       f"{sorted(available)}", m)
                  for i, m in enumerate(self.metrics or []) if m not in available]
        for m, threshold in (self.thresholds or {}).items():
            path = f"monitoring.thresholds.{m}"
            if m not in tracked:
                why = (f"{m!r} is not a per-row metric of task {task!r} (use {sorted(available)})"
                       if m not in available else f"{m!r} is not tracked (add it to monitoring.metrics)")
                errors.append(FieldError(path, f"{why}; tracked metrics: {list(tracked)}"))
            elif m in _metrics.ROW_CATALOGUE and _metrics.ROW_CATALOGUE[m].direction is not None:
                errors.extend(threshold.problems(m, path))
        return errors


# ---------------------------------------------------------------------------------------------- root
class Metadata(_Model):
    """Spec identity."""

    name: str = Field(description="Pipeline name (DNS-1123).", pattern=NAME_RE)
    labels: dict[str, str] = Field(default_factory=dict, description="Free-form labels, copied to MLflow tags.")


class Spec(_Model):
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
        allowed = set(TASK_METRICS[self.model.task]) | set(PERF_METRICS) | set(BUILD_METRICS)
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
        if dm is not None and dm not in TASK_METRICS[self.model.task]:
            errors.append(f"analysis.discovery.metric: {dm!r} is not a parity metric of task {self.model.task!r}; "
                          f"choose one of {sorted(TASK_METRICS[self.model.task])}")
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
            errors.extend(f"{e.loc}: {e.message}" for e in self.monitoring.task_problems(self.model.task))
        errors.extend(self._target_errors())
        pb = self.promotion.batch_size
        if pb is not None and pb not in self.benchmark.batch_sizes:
            errors.append(f"promotion.batch_size: {pb} is not in benchmark.batch_sizes")
        if self.model.task == "classification" and self.data.validation.label_column is None:
            pass  # accuracy is then not computed; agreement metrics still are
        if errors:
            # one "<field path>: <problem>" per line; `_field_errors` splits them (a problem may hold "; ")
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


# --------------------------------------------------------------------------------------------- loading
def _loc(loc: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in loc if not (isinstance(p, str) and p.startswith("function-after")))


# Spec keys removed on purpose: `spec check` names them with what replaced them instead of "unknown field".
REMOVED_FIELDS: dict[str, str] = {
    "monitoring.correction": (
        "removed: the monitor's sequential detector controls false alarms over the stream and across slices by "
        "construction (monitoring.alpha over monitoring.horizon sampled requests, docs/monitor.md); delete this "
        "key"),
    "monitoring.clear_factor": (
        "removed: an alert clears when the recovery detector finds the slice back on the good side of its "
        "threshold (docs/monitor.md, Statistics and alerts); delete this key"),
}


def field_errors(exc: ValidationError, *,
                 unknown: str = "unknown field (check the spelling; see `tailguard spec schema`)") -> list[FieldError]:
    """One FieldError per pydantic error of `exc` (dotted field path, message, offending input); cross-field
    problems ("<path>: <problem>" lines) become one FieldError each. `unknown` is the message for an unknown
    field, REMOVED_FIELDS' for a removed one. Used by the spec and by the trigger's config."""
    out: list[FieldError] = []
    for e in exc.errors(include_url=False):
        msg = e["msg"].removeprefix("Value error, ")
        loc = _loc(e["loc"])
        if e["type"] == "extra_forbidden":
            msg = REMOVED_FIELDS.get(loc, unknown)
        if e["type"] == "value_error" and not loc and re.match(r"^[A-Za-z_][\w.]*: ", msg):
            # cross-field (Spec._cross_field): "<field path>: <problem>" lines, one FieldError each
            for part in msg.split(CROSS_FIELD_SEP):
                field_path, _, text = part.partition(": ")
                out.append(FieldError(field_path, text or part))
            continue
        out.append(FieldError(loc, msg, e.get("input")))
    return out


_field_errors = field_errors


CROSS_FIELD_SEP = "\n"  # between the problems Spec._cross_field reports in one ValueError
SKIP_CROSS_FIELD = "tailguard.skip_cross_field"  # validation context key: build a spec whose errors are known
_MAX_PRUNE_ROUNDS = 4


def _drop(doc: Any, loc: tuple[Any, ...]) -> bool:
    """Delete the mapping key at pydantic error location `loc` from `doc` (in place); parts that are not keys or
    indexes of the document (union tags, validator names) are skipped. False when the location ends at a list item
    or the root (deleting it would renumber the field paths of later errors) or is not found."""
    parts = [p for p in loc if not (isinstance(p, str) and ("[" in p or p.startswith("function-")))]
    if not parts:
        return False
    node = doc
    for part in parts[:-1]:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        else:
            return False
    if isinstance(node, dict) and parts[-1] in node:
        del node[parts[-1]]
        return True
    return False


def _hidden_errors(data: dict[str, Any], exc: ValidationError) -> tuple[dict[str, Any], list[FieldError]]:
    """The cross-field errors (unknown gate metric, unknown slice, ...) that field errors kept from running.

    Pydantic runs Spec's model validators only when every field is valid, so a type error elsewhere would hide
    them until the user fixed it and tried again. This drops every invalid field from a copy of the document
    (optional fields then take their defaults) and validates again, a few rounds, collecting what the model
    validators find. Errors at the dropped fields themselves are not repeated.

    Returns:
        (the pruned document, the extra FieldErrors).
    """
    doc = copy.deepcopy(data)
    dropped: set[str] = set()
    extra: list[FieldError] = []
    for _ in range(_MAX_PRUNE_ROUNDS):
        progress = False
        for e in exc.errors(include_url=False):
            if _drop(doc, tuple(e["loc"])):
                dropped.add(_loc(tuple(e["loc"])))
                progress = True
        if not progress:
            return doc, extra
        try:
            Spec.model_validate(doc)
            return doc, extra
        except ValidationError as again:
            exc = again
            for fe in _field_errors(again):
                if not any(fe.loc == d or fe.loc.startswith(d + ".") for d in dropped):
                    if not any(fe.loc == x.loc and fe.message == x.message for x in extra):
                        extra.append(fe)
    return doc, extra


def validate_spec(data: Any) -> tuple[Spec | None, list[FieldError]]:
    """Validate a parsed YAML/JSON document as a Spec and collect every problem at once.

    Field errors (types, unknown fields) and the cross-field errors they would otherwise hide (`_hidden_errors`)
    are returned together.

    Returns:
        (spec, errors): errors empty -> the Spec. Errors non-empty -> a partial Spec for further checks (e.g. of
        the data files): the document without its invalid optional fields, validated without the cross-field
        rules (whose errors are in `errors`); None when even that does not validate (a required field is wrong).
    """
    if not isinstance(data, dict):
        return None, [FieldError("", f"expected a mapping at the top level, got {type(data).__name__}")]
    try:
        return Spec.model_validate(data), []
    except ValidationError as exc:
        errors = _field_errors(exc)
        doc = data
        if all(e["loc"] for e in exc.errors(include_url=False)):  # field errors: Spec's validators did not run
            doc, extra = _hidden_errors(data, exc)
            known = {(e.loc, e.message) for e in errors}
            errors += [e for e in extra if (e.loc, e.message) not in known]
        try:  # the rest of the spec, for checks beyond the spec itself (data files)
            partial: Spec | None = Spec.model_validate(doc, context={SKIP_CROSS_FIELD: True})
        except ValidationError:
            partial = None
        return partial, errors


def spec_error(errors: list[FieldError], data: Any, *, source: str = "spec") -> SpecError:
    """The SpecError for `errors` (from `validate_spec`), with a fix hint (the parity-gate example when the spec
    has no parity gate)."""
    hint = "fix the fields above; `tailguard spec schema` prints every field"
    if any(e.loc == "gates" and e.message.startswith(NO_PARITY_GATE) for e in errors):
        task = (data.get("model") or {}).get("task") if isinstance(data, dict) and isinstance(data.get("model"),
                                                                                               dict) else None
        example = PARITY_GATE_EXAMPLE.get(str(task), PARITY_GATE_EXAMPLE["embedding"])
        hint = (f"add a gate on a parity metric (overall or per_slice) for every variant, e.g. "
                f"`- {example}` under gates, or set `promotion: {{enabled: false}}` to register and report "
                "without moving the alias; " + hint)
    return SpecError(errors, source=source, hint=hint)


def parse_spec(data: Any, *, source: str = "spec") -> Spec:
    """Validate a parsed YAML/JSON document as a Spec.

    Raises:
        SpecError: with every problem and its field path.
    """
    spec, errors = validate_spec(data)
    if errors or spec is None:
        raise spec_error(errors or [FieldError("", "not a valid spec")], data, source=source)
    return spec


def load_spec(path: str | Path, *, resolve_paths: bool = True) -> Spec:
    """Load and validate a spec file.

    Args:
        path: YAML file.
        resolve_paths: make relative data URIs absolute, relative to the spec file's folder.

    Raises:
        SpecError: the file is missing, is not YAML, or is not a valid spec (every error with its field path).
    """
    p = Path(path)
    spec = parse_spec(read_spec_document(p), source=str(p))
    if resolve_paths:
        resolve_data_uris(spec, p)
    return spec


def read_spec_document(path: str | Path) -> Any:
    """The parsed YAML of a spec file (not validated).

    Raises:
        SpecError: the file is missing or is not YAML (with the line and column).
    """
    p = Path(path)
    if not p.is_file():
        raise SpecError([FieldError("", f"file not found: {p}")], source=str(p),
                        hint="pass the path of a spec YAML file")
    try:
        return yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise SpecError([FieldError("", f"not valid YAML{where}: {getattr(exc, 'problem', exc)}")],
                        source=str(p)) from None


def resolve_data_uris(spec: Spec, spec_path: str | Path) -> None:
    """Make relative data URIs absolute, relative to the spec file's folder (in place)."""
    base = Path(spec_path).resolve().parent
    for ds in (spec.data.calibration, spec.data.validation):
        if "://" not in ds.uri and not Path(ds.uri).is_absolute():
            ds.uri = str((base / ds.uri).resolve())


# Top-level keys added after the first release that `dump_spec` leaves out while they hold their default: the text
# tasks receive, and so the compiled IR and KFP's cache keys, stay the same for specs that do not use them.
OMITTED_WHEN_DEFAULT: dict[str, Any] = {"serving_targets": []}


def dump_spec(spec: Spec) -> str:
    """YAML text of a spec (what KFP tasks receive as the `spec_yaml` parameter); the OMITTED_WHEN_DEFAULT keys
    only when they differ from their default."""
    doc = spec.model_dump(mode="json", exclude_none=False)
    for key, default in OMITTED_WHEN_DEFAULT.items():
        if doc.get(key) == default:
            doc.pop(key, None)
    return yaml.safe_dump(doc, sort_keys=False)


def spec_from_yaml(text: str) -> Spec:
    """Inverse of `dump_spec`. Raises SpecError."""
    return parse_spec(yaml.safe_load(text))


def json_schema() -> dict[str, Any]:
    """The JSON Schema of a spec (draft 2020-12, as pydantic generates it)."""
    schema = Spec.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["$id"] = "https://tailguard.dev/schemas/tailguard-v1.json"
    return schema
