"""The spec's `variants` section: one inference variant per entry (`VariantSpec`: backend x precision), its ONNX
Runtime graph optimization and INT8 quantization (`QuantizationSpec`, filled from a named preset of
`tailguard.core.presets`), its accuracy-driven search (`SearchSpec`) and TensorRT settings, and what each build
backend's artefact is (`BACKEND_ARTIFACTS`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from tailguard.core.spec.base import NAME_RE, SpecModel

Precision = Literal["fp32", "fp16", "bf16", "int8"]


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
