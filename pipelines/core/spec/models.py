"""The spec's pydantic v2 models (extra="forbid"): the root `Spec` and its sections (model, data, slices, variants,
gates, analysis, benchmark, cost, promotion, mlflow, kubeflow, serving targets), the limits and the metric tables
computed from the metric catalogue. The monitoring section is in `monitor.py`; loading, validation with every error
at once and dumping are in the package (`tailguard.core.spec`).

Cross-field rules live in model validators so every problem is reported with its field path in one pass.
"""

from __future__ import annotations

import difflib
import re
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from tailguard.core import metrics as _metrics
from tailguard.core.hardware import KERNEL_ISA_FLAGS
from tailguard.core.spec.base import SpecModel
from tailguard.core.spec.monitor import MonitoringSpec

API_VERSION = "tailguard/v1"
NAME_RE = r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"  # DNS-1123 label: usable as a KFP task name and a K8s name
# Size limits (issue 22): each variant is a chain of KFP tasks (pods, and nodes in one Argo Workflow object, which
# etcd caps at ~1.5 MB), each slice group x parity metric an MLflow metric and a report row, each gate a check per
# variant. These bound one run's pods, metrics and report; a spec past one is refused (exit 2, naming the field).
MAX_VARIANTS = 32
MAX_SLICES = 32
MAX_SLICE_GROUPS = 1000  # slices[].max_groups
MAX_SLICE_NAME = 64  # characters; with it every slice metric key fits MLflow's 250 (validate.result.slice_key_prefix)
MAX_GATES = 128

Task = Literal["classification", "embedding", "regression", "generic", "token_classification"]
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


def is_parity_gate(gate: "GateSpec", task: str) -> bool:
    """Whether `gate` judges the variant's outputs against the FP32 reference: a parity metric of the task
    (not latency/throughput/speedup/cost/memory, not `reference_accuracy`, the reference's own score) with
    scope overall or per_slice. A `discovered` gate does not count: it passes when discovery finds no slice."""
    return (gate.metric in TASK_METRICS.get(task, ()) and gate.metric != "reference_accuracy"
            and gate.scope in ("overall", "per_slice"))




# --------------------------------------------------------------------------------------------- model
_AXIS_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class TensorSpec(SpecModel):
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
    kind: Literal["logits", "probabilities"] | None = Field(None, description=(
        "Outputs only, classification: what the compared output holds: 'logits' (default; KL divergence and "
        "margins on its softmax) or 'probabilities' (rows already sum to 1, e.g. a model ending in Softmax: KL on "
        "the values themselves). Validation warns when logits rows already sum to 1. Also accepted for "
        "token_classification, where only each position's top-1 class is compared, so it changes nothing."))

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


class ExportTolerance(SpecModel):
    """Allowed difference between the torch model and its ONNX export for one output: |a-b| <= atol + rtol*|b|."""

    atol: float = Field(1e-4, ge=0, description="Absolute tolerance.")
    rtol: float = Field(1e-3, ge=0, description="Relative tolerance.")


class ExportSpec(SpecModel):
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


class ModelSource(SpecModel):
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
        "Allow a pickled PyTorch model (mlflow.pytorch default flavor), and a .pt2 (the reference, a registered torch "
        "variant) whose archive holds code: pickled weights or constants, custom or opaque objects, evaluated "
        "expressions, an AOTInductor package's native code. Unpickling runs arbitrary code: set only for sources "
        "you control."))

    @model_validator(mode="after")
    def _class_for_state_dict(self) -> "ModelSource":
        if self.format == "state_dict" and not self.class_path:
            raise ValueError("format 'state_dict' needs class_path ('module:Class') to load the weights into")
        return self


class DecodeSpec(SpecModel):
    """How a token_classification output (batch, time, classes) becomes the sequence that is compared
    (formulas: tailguard.core.tokens)."""

    kind: Literal["none", "ctc_greedy"] = Field("none", description=(
        "'none': the sequence is the top-1 class of every unmasked position; 'ctc_greedy': greedy CTC decoding "
        "(top-1 class per position, repeats collapsed, `blank` dropped), so sequence_exact_match and cer compare "
        "the decoded label sequences (OCR, ASR)."))
    blank: int = Field(0, ge=0, description="ctc_greedy: the class index of the CTC blank.")
    mask_input: str | None = Field(None, description=(
        "A model input (e.g. attention_mask) of shape (batch, time) whose 0 entries mark positions that are not "
        "compared (padding, special tokens); its time axis must be the output's. None: every position counts "
        "(declare one when inputs are padded per batch, or padded positions are compared too)."))


class ModelSpec(SpecModel):
    """The FP32 reference: an MLflow registered model version."""

    registered_name: str = Field(description="MLflow registered model holding the FP32 reference.")
    version: str | int = Field("latest", description=(
        "'latest', a version number (2 or '2', as `tailguard register` prints it), or '@alias'. The trigger "
        "overrides it."))
    task: Task = Field(description="Decides the parity metrics (see components/validate/README.md).")
    inputs: list[TensorSpec] = Field(min_length=1, description="Model inputs, in forward() order.")
    outputs: list[TensorSpec] = Field(min_length=1, description="Model outputs; the first is compared for parity.")
    source: ModelSource = Field(default_factory=ModelSource, description="Storage format and trust.")
    export: ExportSpec = Field(default_factory=ExportSpec, description="torch -> ONNX export settings.")
    pad_values: dict[str, float] = Field(default_factory=dict, description=(
        "Value used to pad each variable-length input per batch (default 0; attention masks pad with 0)."))
    decode: DecodeSpec | None = Field(None, description=(
        "task token_classification only: the mask input and the decoding (greedy CTC) of the compared output "
        "(default: no mask, no decoding)."))

    @model_validator(mode="after")
    def _token_outputs(self) -> "ModelSpec":
        rank = len(self.outputs[0].shape)
        name = self.outputs[0].name
        if self.task == "classification" and rank == 3:
            raise ValueError(f"outputs.0.shape: {name} has 3 axes {self.outputs[0].shape} (batch, time, classes), "
                             "but task classification compares one class per row; use task: token_classification "
                             "(per-position agreement, sequence exact match, cer with decode kind ctc_greedy)")
        if self.task == "token_classification" and rank != 3:
            raise ValueError(f"outputs.0.shape: task token_classification compares (batch, time, classes) "
                             f"outputs; {name} has {rank} axes {self.outputs[0].shape}: declare [batch, time, C] "
                             "or choose another task")
        if self.decode is not None:
            if self.task != "token_classification":
                raise ValueError(f"decode: applies to task token_classification, not {self.task!r}; remove it")
            names = [t.name for t in self.inputs]
            if self.decode.mask_input is not None and self.decode.mask_input not in names:
                raise ValueError(f"decode.mask_input: {self.decode.mask_input!r} is not a model input "
                                 f"({names}); name one of them or remove mask_input")
            c = self.outputs[0].shape[-1]
            if self.decode.kind == "ctc_greedy" and isinstance(c, int) and self.decode.blank >= c:
                raise ValueError(f"decode.blank: {self.decode.blank} is not a class of {name} ({c} classes)")
        return self

    @model_validator(mode="after")
    def _output_kinds(self) -> "ModelSpec":
        for i, t in enumerate(self.inputs):
            if t.kind is not None:
                raise ValueError(f"inputs.{i}.kind: kind applies to outputs only (logits or probabilities); "
                                 "remove it from the input")
        for i, t in enumerate(self.outputs):
            if t.kind is not None and self.task not in ("classification", "token_classification"):
                raise ValueError(f"outputs.{i}.kind: {t.kind!r} applies to task classification (and "
                                 f"token_classification), not "
                                 f"{self.task!r}; remove it")
        return self

    @field_validator("version")
    @classmethod
    def _version(cls, v: str | int) -> str:
        v = str(v)  # an integer version (YAML `version: 2`) is the same version as the string "2"
        if v == "latest" or re.fullmatch(r"[1-9]\d*", v) or re.fullmatch(r"@[A-Za-z0-9_\-]+", v):
            return v
        raise ValueError("must be 'latest', a positive version number, or '@alias'")


# ---------------------------------------------------------------------------------------------- data
class Expectation(SpecModel):
    """A Great Expectations expectation, by its snake_case type and keyword arguments."""

    type: str = Field(description="e.g. expect_column_values_to_be_between", pattern=r"^expect_[a-z0-9_]+$")
    kwargs: dict[str, Any] = Field(default_factory=dict,
                                   description="Arguments, e.g. {column: n_tokens, min_value: 1}.")
    datasets: list[Literal["calibration", "validation"]] = Field(
        default_factory=lambda: ["calibration", "validation"], description="Datasets the expectation applies to.")


class DatasetSpec(SpecModel):
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


class DataSpec(SpecModel):
    """Calibration and validation data, and the expectations the data check enforces."""

    calibration: CalibrationSpec = Field(description="Calibration set (static INT8).")
    validation: DatasetSpec = Field(description="Validation set: parity, slices and latency inputs.")
    expectations: list[Expectation] = Field(default_factory=list, description=(
        "Extra Great Expectations run on top of the built-in ones (input columns present, non-null, finite)."))


# -------------------------------------------------------------------------------------------- slices
# Reductions a derived slice may apply per row over the non-batch axes (tailguard.core.derive.REDUCERS has the
# formulas). A declared vocabulary: no eval, no user code.
DeriveReduce = Literal["sum", "mean", "max", "min", "count_nonzero", "argmax", "norm", "length", "nearest_centroid"]
# Reductions unchanged by zero padding at the end of a variable-length axis (the rows of a batched request are
# padded by its sender; validation rows are not): the only ones allowed on an input with a variable axis.
PAD_INVARIANT_REDUCES = frozenset({"sum", "count_nonzero", "length", "norm"})
MAX_CENTROIDS = 256


class DeriveSpec(SpecModel):
    """How a derived slice's per-row value is computed from a model input or the reference's first output
    (tailguard.core.derive.derive_values; docs/spec.md, Derived slices)."""

    input: str | None = Field(None, description="A model input by name (model.inputs[].name).")
    output: Literal["reference"] | None = Field(None, description=(
        "'reference': the FP32 reference model's first output (never the candidate's: slicing on the candidate "
        "would bias the comparison)."))
    select: tuple[int, int] | None = Field(None, description=(
        "[start, stop): a range of the row's flattened (row-major) non-batch elements, before reducing."))
    reduce: DeriveReduce = Field(description=(
        "Per row over the non-batch axes: sum, mean, max, min, count_nonzero, argmax (index of the largest "
        "element: the reference's top-1 class), norm (L2), length (positions of the last axis up to the last "
        "non-zero element: the tokens of an attention mask), nearest_centroid (index of the nearest of `centroids` "
        "k-means centroids "
        "fitted on the validation set's reference outputs)."))
    centroids: int | None = Field(None, ge=2, le=MAX_CENTROIDS, description=(
        "nearest_centroid only: number of k-means centroids (seeded; fitted by the pipeline)."))

    @model_validator(mode="after")
    def _one_source(self) -> "DeriveSpec":
        if (self.input is None) == (self.output is None):
            raise ValueError("give exactly one of input (a model input name) or output: reference")
        if self.select is not None and not 0 <= self.select[0] < self.select[1]:
            raise ValueError("select must be [start, stop) with 0 <= start < stop")
        if (self.reduce == "nearest_centroid") != (self.centroids is not None):
            raise ValueError("centroids (the number of k-means centroids) goes with reduce: nearest_centroid, "
                             "and only with it")
        if self.reduce == "nearest_centroid" and self.output is None:
            raise ValueError("nearest_centroid applies to output: reference (centroids of the reference outputs)")
        return self


class SliceSpec(SpecModel):
    """A declared slice: rows grouped by the value of a metadata column, of a value derived from the request's
    tensors or the reference's output (`derive`), or of a request header (`header`); by value, bins or quantiles.
    Exactly one of column, derive, header."""

    name: str = Field(description="Slice name used in metric keys: slice.<name>.<value>.<metric>.",
                      pattern=r"^[A-Za-z0-9_\-]+$", max_length=MAX_SLICE_NAME)
    column: str | None = Field(None, description="Metadata column in the validation data.")
    derive: DeriveSpec | None = Field(None, description=(
        "Compute the per-row value from a model input or the reference's output: needs nothing from the client "
        "and no column in the validation data."))
    header: str | None = Field(None, pattern=r"^[A-Za-z0-9!#$%&'*+.^_`|~\-]+$", description=(
        "HTTP header / gRPC metadata key / logger-forwarded header whose value is the slice value in the monitor "
        "(case-insensitive); in the validation data, the column of that name."))
    values: list[str | int] | None = Field(None, description="Only these values (default: every value seen).")
    bins: list[float] | None = Field(None, min_length=2, description="Bin edges, left-closed [a, b).")
    quantiles: int | None = Field(None, ge=2, le=100, description="Number of equal-frequency bins.")
    max_groups: int = Field(100, ge=1, le=MAX_SLICE_GROUPS, description=(
        "At most this many groups; the rest go to 'other'."))

    @model_validator(mode="after")
    def _one_kind(self) -> "SliceSpec":
        sources = [k for k in ("column", "derive", "header") if getattr(self, k) is not None]
        if len(sources) != 1:
            raise ValueError("give exactly one of column, derive, header"
                             + (f" (got {', '.join(sources)})" if sources else ""))
        kinds = [k for k in ("values", "bins", "quantiles") if getattr(self, k) is not None]
        if len(kinds) > 1:
            raise ValueError(f"give at most one of values, bins, quantiles (got {', '.join(kinds)})")
        if self.bins is not None and sorted(self.bins) != self.bins:
            raise ValueError("bins must be increasing")
        return self

    @property
    def data_column(self) -> str | None:
        """The validation data column this slice reads (column, or the header's name); None when derived."""
        return self.column if self.column is not None else self.header


def derive_errors(i: int, s: SliceSpec, model: ModelSpec) -> list[str]:
    """Problems of a derived slice against the model's declared tensors ("<field path>: <problem>" lines).

    Rules: the input exists; `select` lies within the row's element count when every non-batch axis is fixed,
    and needs the variable axis first otherwise (positions of a padded row stay put); on an input with a
    variable-length axis only the reductions unchanged by zero padding (PAD_INVARIANT_REDUCES) with pad value 0;
    argmax on the reference output of a classification model; nearest_centroid on an embedding model; length
    needs at least one non-batch axis.
    """
    d = s.derive
    if d is None:
        return []
    at = f"slices.{i}.derive"
    errors: list[str] = []
    if d.input is not None:
        by_name = {t.name: t for t in model.inputs}
        t = by_name.get(d.input)
        if t is None:
            return [f"{at}.input: unknown input {d.input!r}; model.inputs: {list(by_name)}"]
        dims = t.shape[1:]
        variable = [a for a in dims if isinstance(a, str)]
        if d.reduce in ("argmax", "nearest_centroid"):
            errors.append(f"{at}.reduce: {d.reduce} applies to output: reference, not to an input")
        if variable and d.reduce not in PAD_INVARIANT_REDUCES:
            errors.append(f"{at}.reduce: input {d.input!r} has the variable-length axis {variable[0]!r}, which a "
                          f"batched request pads: {d.reduce} would depend on the padding; use one of "
                          f"{sorted(PAD_INVARIANT_REDUCES)}")
        if variable and float(model.pad_values.get(d.input, 0)) != 0.0:
            errors.append(f"{at}.input: input {d.input!r} is padded with {model.pad_values[d.input]:g} "
                          "(model.pad_values), which a derived value would count; derive from an input padded with 0")
        if d.select is not None:
            if not variable:
                n = 1
                for a in dims:
                    n *= int(a)
                if d.select[1] > n:
                    errors.append(f"{at}.select: [{d.select[0]}, {d.select[1]}) is past the {n} elements of a row "
                                  f"of {d.input!r} (shape {t.shape})")
            elif not isinstance(dims[0], str) or len(variable) > 1:
                errors.append(f"{at}.select: input {d.input!r} (shape {t.shape}) has a variable axis after a "
                              "fixed one, so padding moves the flattened positions; select needs the variable "
                              "axis first")
        if d.reduce == "length" and not dims:
            errors.append(f"{at}.reduce: length needs an axis after batch; input {d.input!r} has shape {t.shape}")
    else:
        if d.reduce == "argmax" and model.task != "classification":
            errors.append(f"{at}.reduce: argmax of the reference output is the predicted class of a "
                          f"classification model; model.task is {model.task!r}")
        if d.reduce == "nearest_centroid" and model.task != "embedding":
            errors.append(f"{at}.reduce: nearest_centroid clusters the reference embeddings of an embedding "
                          f"model; model.task is {model.task!r}")
        out = model.outputs[0]
        if d.select is not None and all(isinstance(a, int) for a in out.shape[1:]):
            n = 1
            for a in out.shape[1:]:
                n *= int(a)
            if d.select[1] > n:
                errors.append(f"{at}.select: [{d.select[0]}, {d.select[1]}) is past the {n} elements of a row of "
                              f"the reference output {out.name!r} (shape {out.shape})")
    if d.reduce in ("argmax", "nearest_centroid") and (s.bins is not None or s.quantiles is not None):
        errors.append(f"slices.{i}.{'bins' if s.bins is not None else 'quantiles'}: {d.reduce} gives a class "
                      "index: group it by value (drop bins/quantiles)")
    return errors


# ------------------------------------------------------------------------------------------ variants
class GraphOptimizationSpec(SpecModel):
    """ONNX Runtime graph optimization applied before (or instead of) quantization."""

    level: Literal["disabled", "basic", "extended", "all"] = Field(
        "extended", description="ORT GraphOptimizationLevel used when saving the optimized model.")
    fusion: Literal["none", "bert"] = Field("none", description=(
        "Transformer fusion (onnxruntime.transformers.optimizer): 'bert' fuses attention/LayerNorm/GELU."))
    num_heads: int = Field(0, ge=0, description="Attention heads for fusion (0: detect).")
    hidden_size: int = Field(0, ge=0, description="Hidden size for fusion (0: detect).")


class QuantizationSpec(SpecModel):
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


class SearchSpace(SpecModel):
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


class SearchSpec(SpecModel):
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


class TensorRTSpec(SpecModel):
    """TensorRT build settings of a variant on backend tensorrt or on ONNX Runtime's TensorrtExecutionProvider
    (components/build/builders/tensorrt.py). The optimization profile's shapes come from the spec and the data
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


# What each build backend's artefact is, which decides how the steps after the build log and register it
# (docs/builders.md). "onnx": a portable ONNX file, logged and registered as an MLflow ONNX model; "pt2" (an
# AOTInductor package or exported program with its manifest) and "engine" (a TensorRT plan): node-bound folders,
# registered by source. A new backend adds its literal to `VariantSpec.backend` and its entry here
# (tests/components/test_builders.py checks both).
BACKEND_ARTIFACTS: dict[str, str] = {"onnxruntime": "onnx", "tensorrt": "engine", "torch": "pt2"}


class VariantSpec(SpecModel):
    """One inference variant to build and validate: backend x precision x calibration."""

    name: str = Field(description="Unique, DNS-1123 (a KFP task and MLflow run name).", pattern=NAME_RE)
    backend: Literal["onnxruntime", "tensorrt", "torch"] = Field(description=(
        "Builder and runtime: onnxruntime (from the exported FP32 ONNX), tensorrt (GPU node pools), or torch "
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
    def artifact(self) -> str:
        """What the build step makes (BACKEND_ARTIFACTS): "onnx" (a portable ONNX file, an MLflow ONNX model),
        "pt2" or "engine" (a node-bound artefact folder, registered by source)."""
        return BACKEND_ARTIFACTS[self.backend]

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


# ------------------------------------------------------------------------------------------ analysis
class DiscoverySpec(SpecModel):
    """Automatic worst-slice discovery over metadata columns (components/validate/discovery.py)."""

    enabled: bool = Field(True, description="Search metadata columns for the worst slices.")
    columns: list[str] | None = Field(None, description=(
        "Metadata columns searched (default: every validation column that is not a model input or the label)."))
    pairs: bool = Field(True, description="Also search pairs of columns (conjunctions of two values).")
    metric: str | None = Field(None, description=(
        "Parity metric compared (default: classification top1_agreement, embedding nn_top1_agreement, "
        "regression/generic abs_error.mean)."))
    min_support: int = Field(30, ge=5, description=(
        "A tested slice needs at least this many validation rows (and so does the rest)."))
    max_bins: int = Field(4, ge=2, le=20, description="Numeric columns are cut into this many quantile bins.")
    max_values: int = Field(100, ge=2, description="Categorical columns with more distinct values are skipped.")
    alpha: float = Field(0.05, gt=0, lt=0.5, description=(
        "False discovery rate (Benjamini-Hochberg) across every slice tested."))
    max_results: int = Field(20, ge=1, description="Report at most this many discovered slices (worst first).")


class BootstrapSpec(SpecModel):
    """Percentile bootstrap for confidence bounds of metrics that are not proportions."""

    samples: int = Field(1000, ge=100, description="Bootstrap resamples.")
    seed: int = Field(0, description="Seed: the same data give the same bounds.")


class SensitivitySpec(SpecModel):
    """Per-node quantization sensitivity of INT8 variants, also when no search runs (components/search/README.md)."""

    enabled: bool = Field(False, description=(
        "Rank the quantizable nodes of every INT8 onnxruntime variant by the output error of quantizing each one "
        "alone (calibration rows); sensitivity.csv and sensitivity.png go to the variant's run. A search always "
        "does this for the variant it searches."))
    samples: int = Field(64, ge=1, description="Calibration rows used.")


class EmbeddingAnalysisSpec(SpecModel):
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


class SequentialSpec(SpecModel):
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
        "failed: the others are then reported undecided; a variant a parity gate failed is not timed, its "
        "latency gates undecided); all_gates: stop only when every gate is decided, every variant timed."))


class AnalysisSpec(SpecModel):
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
class BenchmarkSpec(SpecModel):
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


class CostSpec(SpecModel):
    """Price of the serving node, for cost per 1M inferences = usd_per_hour / 3600 / throughput * 1e6."""

    usd_per_hour: float = Field(gt=0, description="On-demand price of the node (USD/hour).")
    instance: str | None = Field(None, description="Node type the price is for, for the report.")


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


class MlflowSpec(SpecModel):
    """Where runs and models go. Defaults to the embedded store under $TAILGUARD_HOME."""

    tracking_uri: str | None = Field(None, description="Default sqlite:///$TAILGUARD_HOME/mlflow.db.")
    registry_uri: str | None = Field(None, description="Default: the tracking URI.")
    experiment: str | None = Field(None, description="Experiment name (default: tailguard/<metadata.name>).")


# -------------------------------------------------------------------------- kubeflow and monitoring
class Toleration(SpecModel):
    """A Kubernetes toleration for GPU node pools."""

    key: str = Field(description="Taint key, e.g. nvidia.com/gpu.")
    operator: Literal["Exists", "Equal"] = Field("Exists", description="Toleration operator.")
    value: str | None = Field(None, description="Taint value (operator Equal).")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        "NoSchedule", description="Taint effect.")


class GpuPoolSpec(SpecModel):
    """Scheduling of GPU steps on a GPU node pool."""

    accelerator_type: str = Field("nvidia.com/gpu", description="dsl set_accelerator_type value.")
    count: int = Field(1, ge=1, description="GPUs per GPU step.")
    node_selector: dict[str, str] = Field(default_factory=dict, description="Node labels for GPU steps.")
    tolerations: list[Toleration] = Field(default_factory=list, description="Tolerations for GPU steps.")


class SecretRef(SpecModel):
    """A Kubernetes secret mounted as environment variables: {ENV_VAR: secret key}."""

    name: str = Field(description="Secret name.")
    env: dict[str, str] = Field(description="Environment variable -> key in the secret.")


class KubeflowSpec(SpecModel):
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


class AcceleratorSpec(SpecModel):
    """The accelerator a serving target's nodes carry (KFP `set_accelerator_type` / `set_accelerator_limit`)."""

    type: str = Field(description="Accelerator resource, e.g. nvidia.com/gpu (dsl set_accelerator_type value).")
    count: int = Field(1, ge=1, description="Accelerators per validate task on this target.")


class TargetExpect(SpecModel):
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


class ServingTarget(SpecModel):
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


# ---------------------------------------------------------------------------------------------- root
CROSS_FIELD_SEP = "\n"  # between the problems Spec._cross_field reports in one ValueError
SKIP_CROSS_FIELD = "tailguard.skip_cross_field"  # validation context key: build a spec whose errors are known


class Metadata(SpecModel):
    """Spec identity."""

    name: str = Field(description="Pipeline name (DNS-1123).", pattern=NAME_RE)
    labels: dict[str, str] = Field(default_factory=dict, description="Free-form labels, copied to MLflow tags.")


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
