"""Build one inference variant from the FP32 ONNX reference: ONNX Runtime graph optimization, FP16 conversion,
INT8 dynamic / static quantization, and the TensorRT seam.

One entry point, `build_variant`, dispatches through the builder registry (`registry.py`) on the variant's
backend: `quantize.onnxruntime` builds every ONNX Runtime variant, `compile.tensorrt` builds TensorRT engines
(skipped, with the reason, where no GPU / TensorRT is present). Each builder returns a `BuildResult`: ok with the
artifact and the facts of the build, failed with the reason when ONNX Runtime's tooling breaks for that variant
(the run goes on with the other variants), or skipped with the reason.

Pipeline of an ONNX Runtime variant (every stage recorded in `details`):

1. graph optimization (`variant.graph_optimization`): `fusion: bert` runs
   `onnxruntime.transformers.optimizer.optimize_model` (Attention, SkipLayerNormalization, Gelu fusions);
   otherwise an ORT session at `level` saves its optimized graph (`SessionOptions.optimized_model_filepath`).
   INT8 without `fusion: bert`: quantize first, then fuse (`optimization_levels`). Only the `basic` level
   (constant folding, Conv+BatchNorm/Add/Mul folding, MatMul+Add -> Gemm, eliminations: graphs ORT's quantizer
   still quantizes) runs before quantization; `extended` / `all` are left to the ONNX Runtime session that
   loads the quantized model (the validate step's and serving sessions run at `all`), where they fuse the
   quantized graph (DynamicQuantizeMatMul, QGemm, QLinearConv, ...). The artifact stays a plain QDQ /
   QOperator graph that other execution providers read. Run before quantization, those fusions (Gemm+Relu ->
   FusedGemm, Conv+Relu -> FusedConv, MatMul+Mul -> FusedMatMul) make ops no quantizer knows: they left 2 of
   the 3 layers of an MLP in float (9% of its MACs in INT8) while the build said ok. `fusion: bert` stays
   before quantization: its Attention is what ORT's quantizer handles.
2. precision: fp32 keeps the optimized graph; fp16 runs `onnxruntime.transformers.float16.
   convert_float_to_float16(keep_io_types=True)`; int8 runs `quant_pre_process` (optional) then
   `quantize_dynamic` or `quantize_static` with a calibration reader over the calibration set.
3. INT8 coverage (`macs.quantization_coverage`, formulas in macs.py): MAC nodes of the graph given to the
   quantizer (`quantizable_nodes`), those computing in INT8 (`quantized_mac_nodes`), MACs per sample
   (`macs_total`, `macs_int8`) and `quantized_mac_fraction`, in `details` (build.json) and in the model's
   metadata_props[`QUANTIZATION_COVERAGE_KEY`], so whoever validates the file (validate step, search trials)
   reads them from the artifact itself (`gates.build_metrics`).
4. the result is written as one self-contained .onnx file (external data only above 2 GB), loaded once in
   ONNX Runtime on the variant's execution provider, and a `reproduce.sh` is written beside it.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import json
import os
import shlex
import shutil
import tempfile
import time
import traceback
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np

if TYPE_CHECKING:  # tailguard.core.data imports pandas: a build that reads no calibration rows never loads it
    from tailguard.core.data import Dataset
    from tailguard.core.spec.models import GraphOptimizationSpec, ModelSpec, QuantizationSpec, TensorSpec, VariantSpec
from tailguard.core.errors import InputError
from tailguard.core.contract import QUANTIZATION_COVERAGE_KEY
from tailguard.core.results import BuildResult
from tailguard.components.quantize.registry import get_builder, register_builder

from tailguard.core.contract import ONNX_INLINE_LIMIT_BYTES as TWO_GB  # noqa: E402  protobuf's 2 GiB limit

BUILDER_FOR_BACKEND = {"onnxruntime": "quantize.onnxruntime", "tensorrt": "compile.tensorrt", "torch": "compile.torch"}

# ORT graph optimization levels by spec name, and the matching `opt_level` of onnxruntime.transformers.optimizer
# (0 disables ORT's own pass; 99 = ORT_ENABLE_ALL).
_OPT_LEVELS = {"disabled": 0, "basic": 1, "extended": 2, "all": 99}

# Fused operators reported after graph optimization (onnxruntime.transformers BertOnnxModel's statistics list,
# plus the contrib ops ORT's own extended-level fusions produce on CPU).
FUSED_OP_TYPES = ("EmbedLayerNormalization", "Attention", "MultiHeadAttention", "Gelu", "FastGelu", "BiasGelu",
                  "GemmFastGelu", "LayerNormalization", "SimplifiedLayerNormalization", "SkipLayerNormalization",
                  "SkipSimplifiedLayerNormalization", "RotaryEmbedding", "FusedMatMul", "FusedGemm",
                  "MatMulIntegerToFloat", "BiasSoftmax", "QuickGelu")

# Operators that compute in integer arithmetic (QOperator format and dynamic quantization).
INTEGER_OP_TYPES = frozenset({"MatMulInteger", "ConvInteger", "DynamicQuantizeMatMul", "MatMulIntegerToFloat",
                              "QAttention", "QGemm", "QEmbedLayerNormalization", "DynamicQuantizeLSTM"})
QDQ_OP_TYPES = frozenset({"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear"})
_MATMUL_OPS = ("MatMul", "Gemm", "FusedMatMul", "FusedGemm", "Conv", "FusedConv", "ConvTranspose", "Attention",
               "MultiHeadAttention")


# --------------------------------------------------------------------------------------------- dispatch
# ----------------------------------------------------------------------------- one parse per graph file per build
# A build reads the same .onnx files several times (op counts, excluded nodes, contrib-op check, graph inputs,
# attention check, coverage, summary); each parse of MiniLM's 90 MB graph takes 0.1-0.2 s (py-spy of the demo: about
# 1 s per INT8 build in parses). Inside `build_variant` (`_graph_scope`), `_graph` parses a file once: keyed on the
# file's resolved path, inode, size and mtime (a rewritten file is parsed again), at most _GRAPHS_MAX kept; the scope
# drops them when the build ends. Outside a build (the sensitivity analysis, checks) every call parses. Callers
# only read what it returns.
_GRAPHS: OrderedDict[tuple, Any] | None = None
_GRAPHS_MAX = 3


@contextlib.contextmanager
def _graph_scope() -> Iterator[None]:
    """Within it, `_graph` parses each file once; on leaving, the parsed graphs are dropped."""
    global _GRAPHS
    outer, _GRAPHS = _GRAPHS, OrderedDict() if _GRAPHS is None else _GRAPHS
    try:
        yield
    finally:
        _GRAPHS = outer


def _graph(path: str | Path) -> Any:
    """The onnx ModelProto of `path` (external data not loaded), parsed once per build (comment above); read only.

    Raises:
        OSError: the file cannot be read; onnx's DecodeError and friends: not an ONNX file.
    """
    import onnx

    if _GRAPHS is None:
        return onnx.load(str(path), load_external_data=False)
    st = os.stat(path)
    key = (os.path.realpath(path), st.st_ino, st.st_size, st.st_mtime_ns)
    if key in _GRAPHS:
        _GRAPHS.move_to_end(key)
        return _GRAPHS[key]
    proto = onnx.load(str(path), load_external_data=False)
    _GRAPHS[key] = proto
    while len(_GRAPHS) > _GRAPHS_MAX:
        _GRAPHS.popitem(last=False)
    return proto


def builder_name_for(variant: VariantSpec) -> str:
    """Registered builder name that builds `variant` (by its backend), e.g. "quantize.onnxruntime"."""
    return BUILDER_FOR_BACKEND[variant.backend]


def build_variant(variant: VariantSpec, fp32_onnx: str | Path, out_dir: str | Path, *, calibration: Dataset | None,
                  model: ModelSpec, calibration_batch_size: int = 8, profile: dict | None = None) -> BuildResult:
    """Build one variant from the FP32 ONNX reference, through the builder registered for its backend.

    Args:
        variant: `tailguard.core.spec.models.VariantSpec`.
        fp32_onnx: the FP32 reference .onnx file (the checked export).
        out_dir: folder for the variant's files (created): `<variant.name>.onnx`, `build.log` (the tools' output;
            the traceback on failure), `reproduce.sh` with `variant.json` and `model.json`, and
            `calibration.parquet` (the exact calibration rows) for static INT8.
        calibration: calibration rows (needed by static INT8 only; `tailguard.core.data.load_dataset`).
        model: `tailguard.core.spec.models.ModelSpec` (inputs, pad_values).
        calibration_batch_size: rows per calibration batch (`spec.data.calibration.batch_size`).
        profile: the TensorRT optimization profile (`tensorrt_build.spec_profile`) of a variant on backend tensorrt
            or on TensorrtExecutionProvider; None for the others.

    Returns:
        BuildResult: ok (artifact = the .onnx file, details = facts of the build), failed (ORT tooling broke for
        this variant; reason and log path), or skipped (execution provider / GPU / TensorRT missing; reason).

    Raises:
        InputError: `fp32_onnx` is missing or not an ONNX file, or a static INT8 variant gets no calibration rows.
        UnknownBuilderError: no builder is registered for the variant's backend.
    """
    with _graph_scope():  # each graph file parsed once by this build (`_graph`)
        return get_builder(builder_name_for(variant))(variant, fp32_onnx, out_dir, calibration=calibration,
                                                      model=model, calibration_batch_size=calibration_batch_size,
                                                      profile=profile)


def _check_inputs(variant: VariantSpec, fp32_onnx: str | Path, calibration: Dataset | None) -> Path:
    path = Path(fp32_onnx)
    if not path.is_file():
        raise InputError(f"variant {variant.name}: FP32 ONNX file not found: {path}",
                         hint="run the export step first, or pass the path of the exported .onnx file")
    try:
        _graph(path)
    except Exception as exc:  # DecodeError and friends: not an ONNX file
        raise InputError(f"variant {variant.name}: {path} is not a readable ONNX model: "
                         f"{type(exc).__name__}: {str(exc)[:200]}",
                         hint="pass the .onnx file written by the export step") from None
    q = variant.quantization
    if q is not None and q.mode == "static" and (calibration is None or calibration.n_rows == 0):
        raise InputError(f"variants.{variant.name}.quantization: static INT8 needs calibration rows but none "
                         "were given", hint="set data.calibration in the spec (a Parquet file with the model inputs)")
    return path


# --------------------------------------------------------------------------------------------- TensorRT
@register_builder("compile.tensorrt")
def compile_tensorrt(variant: VariantSpec, fp32_onnx: str | Path, out_dir: str | Path, *,
                     calibration: Dataset | None = None, model: ModelSpec | None = None,
                     calibration_batch_size: int = 8, profile: dict | None = None) -> BuildResult:
    """Build a TensorRT engine for `variant`: skipped with the reason where no GPU or TensorRT is present.

    TensorRT is never imported at module level; `tailguard.core.runtime.tensorrt_unavailable_reason` is the seam.
    Arguments and result as `build_variant`.

    Raises:
        InputError: `fp32_onnx` is missing.
    """
    _check_inputs(variant, fp32_onnx, None)
    from tailguard.core.runtime import tensorrt_unavailable_reason  # tailguard.core.runtime imports pandas

    reason = tensorrt_unavailable_reason()
    if reason:
        return BuildResult("skipped", reason=f"TensorRT variant {variant.name} needs a GPU with TensorRT: {reason}",
                          details={"backend": "tensorrt", "precision": variant.precision})
    return _build_tensorrt_engine(variant, Path(fp32_onnx), Path(out_dir), calibration, model,
                                  calibration_batch_size=calibration_batch_size, profile=profile)


def _build_tensorrt_engine(variant: VariantSpec, fp32_onnx: Path, out_dir: Path, calibration: Dataset | None,
                           model: ModelSpec, *, calibration_batch_size: int = 8,
                           profile: dict | None = None) -> BuildResult:
    """The engine build on a GPU node with TensorRT (`tensorrt_build.build_tensorrt_engine`; tensorrt imported
    there, lazily)."""
    from tailguard.components.quantize.tensorrt_build import build_tensorrt_engine

    return build_tensorrt_engine(variant, fp32_onnx, out_dir, calibration, model, profile=profile,
                                 calibration_batch_size=calibration_batch_size)


# ----------------------------------------------------------------------------------------- ONNX Runtime
@register_builder("quantize.onnxruntime")
def quantize_onnxruntime(variant: VariantSpec, fp32_onnx: str | Path, out_dir: str | Path, *,
                         calibration: Dataset | None = None, model: ModelSpec | None = None,
                         calibration_batch_size: int = 8, profile: dict | None = None) -> BuildResult:
    """Build an ONNX Runtime variant (fp32-optimized, fp16, int8 dynamic, int8 static). See `build_variant`.

    Raises:
        InputError: `fp32_onnx` is missing, or static INT8 without calibration rows.
    """
    fp32 = _check_inputs(variant, fp32_onnx, calibration)
    if model is None:
        raise InputError(f"variant {variant.name}: the model spec is required (model inputs and pad values)")
    from tailguard.core.runtime import ort_providers_unavailable_reason  # imports pandas: only when building

    reason = ort_providers_unavailable_reason(variant.execution_provider)
    if reason:
        return BuildResult("skipped", reason=f"variant {variant.name}: {reason}",
                          details={"backend": "onnxruntime", "execution_provider": variant.execution_provider})
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    target = out / f"{variant.name}.onnx"
    from tailguard.components.quantize.tensorrt_build import ort_providers

    details: dict[str, Any] = {"backend": "onnxruntime", "precision": variant.precision,
                               "execution_provider": variant.execution_provider,
                               "providers": ort_providers(variant, profile)}
    log = out / "build.log"
    progress = {"stage": "setup"}
    captured = io.StringIO()  # ORT's tools print progress and log warnings: kept in build.log, not on the console
    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stdout(captured), contextlib.redirect_stderr(captured):
            failure = _build_ort(variant, fp32, target, calibration, model, calibration_batch_size, details,
                                 progress)
    except InputError:
        raise
    except Exception as exc:  # ORT tooling raises anything (RuntimeError, ValueError, KeyError, Fail, ...)
        log.write_text(f"variant {variant.name}: {progress['stage']} failed\n\n{captured.getvalue()}\n"
                       f"{traceback.format_exc()}")
        first = (str(exc).splitlines() or [""])[0][:600]
        details["build_seconds"] = round(time.perf_counter() - t0, 3)
        return BuildResult("failed", reason=f"variant {variant.name}: {progress['stage']} failed: "
                                           f"{type(exc).__name__}: {first} (log: {log})", details=details)
    details["build_seconds"] = round(time.perf_counter() - t0, 3)
    log.write_text(captured.getvalue())
    details["warnings"] = details.get("warnings", []) + export_warnings(fp32)
    if failure:
        return BuildResult("failed", reason=failure, details=details)
    details["reproduce"] = str(_write_reproduce(variant, fp32, out, model, calibration_batch_size))
    return BuildResult("ok", artifact=str(target), details=details)


def _build_ort(variant: VariantSpec, fp32: Path, target: Path, calibration: Dataset | None, model: ModelSpec,
               calibration_batch_size: int, details: dict[str, Any], progress: dict[str, str]) -> str | None:
    """The stages of an ORT variant; returns a failure reason for a problem found (not raised), else None."""
    out = target.parent
    with tempfile.TemporaryDirectory(prefix=f"{variant.name}.", dir=out) as tmp_dir:
        tmp = Path(tmp_dir)
        details["op_types_before"] = _op_counts(fp32)
        progress["stage"] = "graph optimization"
        optimized = _optimize_graph(variant, fp32, tmp / "optimized.onnx", details)
        if variant.precision == "fp32":
            progress["stage"] = "save"
            _save_self_contained(optimized, target)
        elif variant.precision == "fp16" and variant.execution_provider == "TensorrtExecutionProvider":
            progress["stage"] = "save"  # TensorRT runs FP16 from the FP32 graph (trt_fp16_enable, `ort_providers`)
            _save_self_contained(optimized, target)
            details["fp16"] = {"mode": "TensorRT EP trt_fp16_enable on the FP32 graph"}
        elif variant.precision == "fp16":
            progress["stage"] = "fp16 conversion"
            _to_fp16(variant, optimized, target, details)
        else:
            q = variant.quantization
            source = optimized
            if q.per_channel and _default_opset(source) < PER_CHANNEL_MIN_OPSET:
                progress["stage"] = "opset conversion"
                failure = _upgrade_opset(variant, source, tmp / "opset.onnx", details)
                if failure:
                    return failure
                source = tmp / "opset.onnx"
            if q.preprocess:
                progress["stage"] = "quant_pre_process"
                source = _preprocess(source, tmp / "preprocessed.onnx", details)
            progress["stage"] = f"quantize_{q.mode}"
            excluded, bad = _excluded_nodes(source, q)
            details["excluded_nodes"] = excluded
            if bad:
                before = optimization_levels(variant)[0]
                return (f"variant {variant.name}: quantization.exclude_nodes {bad} are not nodes of the graph "
                        f"being quantized (after graph optimization level {before!r} before quantization"
                        f"{', quant_pre_process' if details.get('preprocess', {}).get('ran') else ''}); use node names of that graph "
                        "or set graph_optimization.level: disabled")
            quantized = tmp / "quantized.onnx"
            if q.mode == "dynamic":
                _quantize_dynamic(q, source, quantized, excluded, details)
            else:
                _quantize_static(q, source, quantized, excluded, calibration, model, calibration_batch_size,
                                 tmp, details)
                _write_calibration(calibration, model, out)
            progress["stage"] = "attention check"
            details["warnings"] = details.get("warnings", []) + attention_quantization_warnings(
                variant, source, quantized, details)
            progress["stage"] = "quantization coverage"
            coverage = _coverage(source, quantized, calibration, details)
            _save_self_contained(quantized, target, metadata={QUANTIZATION_COVERAGE_KEY: json.dumps(coverage)})
        progress["stage"] = "summary"
        details.update(_summary(target, details.get("excluded_nodes", [])))
        progress["stage"] = "load check"
        _load_check(target, details["providers"])
    return None


# ------------------------------------------------------------------------------------------ opset upgrade
# Per-channel quantization writes DequantizeLinear / QuantizeLinear with an `axis` attribute, which the ONNX
# operator set defines from opset 13 (onnx/docs/Changelog.md, DequantizeLinear-13); on an opset-11 graph ONNX
# Runtime refuses the quantized model ("Unrecognized attribute: axis for operator DequantizeLinear").
PER_CHANNEL_MIN_OPSET = 13


def _default_opset(path: Path) -> int:
    """The graph's opset of the default ONNX domain ("" or "ai.onnx"); 0 when it imports none."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def _upgrade_opset(variant: VariantSpec, src: Path, dst: Path, details: dict[str, Any]) -> str | None:
    """Convert `src` to opset PER_CHANNEL_MIN_OPSET with `onnx.version_converter` (the ONNX project's own converter)
    and check it, for a per-channel variant of an older graph; recorded in details["opset_conversion"]. Returns a
    failure reason naming the fix when the converter cannot convert the graph (the variant fails alone)."""
    import onnx
    from onnx import version_converter

    before = _default_opset(src)
    try:
        converted = version_converter.convert_version(onnx.load(str(src)), PER_CHANNEL_MIN_OPSET)
        onnx.checker.check_model(converted)
        onnx.save(converted, str(dst))
    except Exception as exc:  # the converter raises RuntimeError / ValidationError on ops it cannot convert
        first = (str(exc).splitlines() or [""])[0][:300]
        return (f"variant {variant.name}: per-channel INT8 needs opset >= {PER_CHANNEL_MIN_OPSET} (the `axis` of "
                f"DequantizeLinear) and the model's opset {before} could not be converted ({type(exc).__name__}: "
                f"{first}); re-export the model with opset >= {PER_CHANNEL_MIN_OPSET}, or set "
                "quantization.per_channel: false")
    details["opset_conversion"] = {"from": before, "to": PER_CHANNEL_MIN_OPSET, "by": "onnx.version_converter",
                                   "why": "per-channel quantization needs DequantizeLinear's axis (opset 13)"}
    return None


# ------------------------------------------------------------------------------------- graph optimization
def optimization_levels(variant: VariantSpec) -> tuple[str, str | None]:
    """(ORT graph optimization level applied before quantization / precision conversion, level left to the
    ONNX Runtime session that loads the quantized model, or None).

    INT8 without `fusion: bert` at level extended or all: ("basic", level): quantize first, then fuse (module
    docstring). Every other variant: (level, None).
    """
    go = variant.graph_optimization
    if variant.precision == "int8" and go.fusion == "none" and go.level in ("extended", "all"):
        return "basic", go.level
    return go.level, None


# ------------------------------------------------------------------------------- the prepared graph, memoized
# One run prepares the same graph many times: every ORT variant of the demo spec optimizes the FP32 model with the
# same `graph_optimization` (BERT fusion), and every INT8 build, the search's sensitivity analysis and each search
# trial then run quant_pre_process on that result. Under `tailguard run` (the local cache on) both steps go through
# the cache, keyed on their input file's SHA-256, the settings that shape their output and the machine (level
# `all` may write CPU-specific layouts: ONNX Runtime warns that such a model "should only be used in the same
# environment"): the first build of a run prepares the graph, the others copy it. Off the cache (a cluster task,
# `--no-cache`) each prepares its own, as before. Measured on the demo: issue 25's notes (docs/timings.md).
PREPARED_STEP = "prepared-graph"


def _prepared(stage: str, parts: dict[str, Any], src: Path, dst: Path, details: dict[str, Any],
              make: Any) -> Path:
    """`make(dst, details) -> Path` through the local cache (tailguard.core.cache, step PREPARED_STEP).

    Args:
        stage: "optimize" or "preprocess" (part of the key and of the entry's label).
        parts: what the output is a function of besides the input file (settings); the input's SHA-256, the
            machine (`cache.machine_parts`) and the library versions (`cache.versions`, in every key) are added
            by the caller / cache_key.
        src: the input graph file.
        dst: where the output file goes (its name is kept).
        details: the build's details dict; the keys `make` sets in it are stored and restored on a hit.
        make: the uncached step; returns the path of the graph to use next (dst, or `src` when it declined, e.g.
            quant_pre_process failing on the graph).

    Returns:
        The path `make` returned (on a hit: dst, or `src` when `make` had declined).
    """
    from tailguard.core import cache

    if not cache.enabled():
        return make(dst, details)
    with tempfile.TemporaryDirectory(prefix=f"tailguard-{stage}-", dir=dst.parent) as tmp:
        folder = Path(tmp)  # the step's own output folder: only what `make` wrote is stored

        def run() -> dict[str, Any]:
            own: dict[str, Any] = {}
            return {"wrote": Path(make(folder / dst.name, own)) == folder / dst.name, "details": own}

        result = cache.cached_step(PREPARED_STEP, {"stage": stage, **parts, "machine": cache.machine_parts()},
                                   folder, run, label=f"{stage} {dst.name}")
        for k, v in result["details"].items():
            details[k] = details.get(k, []) + v if k == "warnings" else v
        if not result["wrote"]:
            return Path(src)
        for f in folder.iterdir():  # the graph (and its external data file, if any) where the caller wants it
            os.replace(f, dst.parent / f.name)
    return dst


def _optimize_graph(variant: VariantSpec, src: Path, dst: Path, details: dict[str, Any]) -> Path:
    """Graph optimization before quantization / fp16 conversion, at `optimization_levels(variant)[0]` (the
    search's sensitivity analysis prepares its graph with this too, so node names match); memoized under
    `tailguard run` (`_prepared`)."""
    from tailguard.core.digests import file_sha256

    parts = {"input": file_sha256(src), "graph_optimization": variant.graph_optimization.model_dump(mode="json"),
             "levels": list(optimization_levels(variant)), "provider": variant.execution_provider}
    return _prepared("optimize", parts, Path(src), Path(dst), details,
                     lambda d, det: _optimize_graph_uncached(variant, src, d, det))


def _optimize_graph_uncached(variant: VariantSpec, src: Path, dst: Path, details: dict[str, Any]) -> Path:
    """`_optimize_graph` without the cache."""
    go = variant.graph_optimization
    level, after = optimization_levels(variant)
    info: dict[str, Any] = {"level": go.level, "fusion": go.fusion}
    provider = variant.execution_provider
    if provider == "TensorrtExecutionProvider":
        # ORT cannot save a graph partitioned to a compiling EP, and extended/all write EP-specific contrib ops
        # TensorRT does not parse: save the provider-independent basic level (ORT "Graph Optimizations": basic
        # runs before partitioning, for every EP); TensorRT fuses the rest itself.
        provider = "CPUExecutionProvider"
        if level in ("extended", "all"):
            info["saved_level"] = level = "basic"
    if after is not None:
        info.update(before_quantization=level, after_quantization=after,
                    note=(f"quantize first, then fuse: level {level!r} ran before quantization; the {after!r} "
                          "fusions run in the ONNX Runtime session that loads the quantized model"))
    if go.fusion == "bert":
        from onnxruntime.transformers.optimizer import optimize_model

        opt = optimize_model(str(src), model_type="bert", num_heads=go.num_heads, hidden_size=go.hidden_size,
                             opt_level=_OPT_LEVELS[go.level],
                             use_gpu=variant.execution_provider != "CPUExecutionProvider")
        info["fused_ops_reported"] = {k: v for k, v in opt.get_fused_operator_statistics().items() if v}
        opt.save_model_to_file(str(dst), use_external_data_format=opt.model.ByteSize() >= TWO_GB)
    elif level != "disabled":
        _ort_optimize(src, dst, level, provider)
    else:
        shutil.copyfile(src, dst)
    counts = _op_counts(dst)
    info["fused_ops"] = {k: counts[k] for k in FUSED_OP_TYPES if counts.get(k)}
    info["nodes"] = sum(counts.values())
    details["graph_optimization"] = info
    if go.fusion == "bert":
        details["warnings"] = details.get("warnings", []) + fusion_warnings(info["fused_ops"], go,
                                                                             int8=variant.precision == "int8")
    return dst


# What `fusion: bert` is expected to produce on a BERT-like encoder, by role: any one op of a group counts
# (onnxruntime.transformers' BertOnnxModel fusions: FusionAttention -> Attention / MultiHeadAttention,
# FusionSkipLayerNormalization, FusionBiasGelu / FusionFastGelu / FusionGelu).
EXPECTED_BERT_FUSIONS: dict[str, tuple[str, ...]] = {
    "attention": ("Attention", "MultiHeadAttention"),
    "skip layer normalization": ("SkipLayerNormalization", "SkipSimplifiedLayerNormalization"),
    "GELU": ("BiasGelu", "FastGelu", "Gelu", "GemmFastGelu", "QuickGelu"),
}
ATTENTION_OP_TYPES = frozenset(EXPECTED_BERT_FUSIONS["attention"])


def fusion_warnings(fused_ops: dict[str, int], go: GraphOptimizationSpec, *, int8: bool = False) -> list[str]:
    """Warnings for the roles `fusion: bert` fused nothing for (EXPECTED_BERT_FUSIONS).

    Args:
        fused_ops: {op type: count} of the optimized graph (build.json graph_optimization.fused_ops).
        go: the variant's `graph_optimization` (num_heads, hidden_size: 0 = detected by ORT).
        int8: the variant is INT8 (then unfused attention is quantized as plain MatMuls: said so).

    Returns:
        One warning naming the missing roles, what was found and the fix; [] when every role was fused.
    """
    missing = [role for role, ops in EXPECTED_BERT_FUSIONS.items() if not any(fused_ops.get(op) for op in ops)]
    if not missing:
        return []
    found = ", ".join(f"{k} {v}" for k, v in fused_ops.items()) or "nothing"
    expected = "; ".join(" or ".join(EXPECTED_BERT_FUSIONS[r]) for r in missing)
    effect = (" (INT8 then quantizes attention as plain MatMuls)" if int8 and "attention" in missing else "")
    return [f"fusion: bert fused no {', no '.join(missing)} (expected {expected}; found {found}): that part of "
            f"the model runs unfused{effect}; set graph_optimization.num_heads and hidden_size to the model's "
            "values (0: ONNX Runtime detects them), and export with model.export.dynamo: false (the graphs ONNX "
            "Runtime's BERT fusions recognise)"]


def attention_matmuls(path: str | Path) -> list[str]:
    """Names of the MatMul nodes whose two inputs are both activations (neither an initializer nor computed from
    constants only): in a transformer without fused attention these are the attention score (Q K^T) and context
    (softmax(scores) V) MatMuls; a weight MatMul always has one constant input.

    Args:
        path: an .onnx file (read without external data).

    Returns:
        Node names in graph order (unnamed nodes as "<op>#<index>").
    """
    graph = _graph(path).graph
    const = {t.name for t in graph.initializer} | {""}
    names = []
    for i, n in enumerate(graph.node):  # ONNX graphs are topologically sorted
        if n.op_type == "Constant" or (n.input and all(x in const for x in n.input)):
            const.update(n.output)
        elif n.op_type == "MatMul" and len(n.input) == 2 and not any(x in const for x in n.input):
            names.append(n.name or f"{n.op_type}#{i}")
    return names


def attention_quantization_warnings(variant: VariantSpec, source: Path, quantized: Path,
                                    details: dict[str, Any]) -> list[str]:
    """A warning when INT8 quantized attention MatMuls (`attention_matmuls` of the graph given to the quantizer)
    and the graph has no fused attention op (Attention / MultiHeadAttention, whose INT8 kernels keep the scores
    and softmax in float): scores and probabilities in 8 bits broke MiniLM's top-1 agreement (0.31, issue 26).

    Records `details["attention_matmuls"] = {"nodes", "quantized", "fused_attention"}` (build.json).

    Returns:
        [] or one warning with the nodes and the exclusion that keeps them in float.
    """
    nodes = attention_matmuls(source)
    fused = sum(_op_counts(source).get(op, 0) for op in ATTENTION_OP_TYPES)
    done = _quantized_node_names(quantized)
    hit = [n for n in nodes if n in done or any(d.startswith(n + "_") for d in done)]
    details["attention_matmuls"] = {"nodes": nodes, "quantized": hit, "fused_attention": fused}
    if not hit or fused:
        return []
    mode = variant.quantization.mode
    names = json.dumps(hit) if len(hit) <= 4 else f"<the {len(hit)} names in build.json attention_matmuls.quantized>"
    return [f"INT8 {mode} quantized {len(hit)} attention MatMul(s) (both inputs activations) and the graph has no "
            "fused Attention: attention scores and softmax probabilities in 8 bits can wreck accuracy; keep them "
            f"in float with quantization: {{preset: transformer-static, exclude_nodes: {names}}} (the preset "
            "quantizes MatMul/Gemm only, so the Softmax and reshapes feeding them stay float too), or get attention "
            "fused (graph_optimization: {fusion: bert, num_heads, hidden_size})"]


def export_warnings(fp32: Path) -> list[str]:
    """The torch exporter's warnings recorded beside the FP32 model (`export.json` `warnings`, written by the
    export step), one line each ("export: TracerWarning at model.py:12: ... (x3)"); [] when there is no such file
    (an ONNX reference, a model built outside the pipeline)."""
    from tailguard.core.contract import EXPORT_FACTS_FILE

    facts_file = Path(fp32).parent / EXPORT_FACTS_FILE
    try:
        recorded = json.loads(facts_file.read_text()).get("warnings") or []
    except (OSError, ValueError, AttributeError):
        return []
    out = []
    for w in recorded:
        if isinstance(w, dict) and {"category", "message", "where"} <= set(w):
            times = f" (x{w['count']})" if int(w.get("count", 1)) > 1 else ""
            out.append(f"export: {w['category']} at {w['where']}: {w['message']}{times}")
    return out


def _ort_optimize(src: Path, dst: Path, level: str, provider: str) -> None:
    """Save the graph an ORT session at `level` (basic | extended | all) makes of `src` on `provider`."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = {
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}[level]
    opts.optimized_model_filepath = str(dst)
    opts.log_severity_level = 3
    ort.InferenceSession(str(src), sess_options=opts, providers=[provider])


def _coverage(source: Path, quantized: Path, calibration: Dataset | None,
              details: dict[str, Any]) -> dict[str, Any]:
    """Quantization coverage of the quantizer's output vs its input (`macs.quantization_coverage`), with symbolic
    axes at the calibration rows' median length when there are rows; top-level facts copied into `details`."""
    from tailguard.components.quantize.macs import quantization_coverage

    sequence = None
    if calibration is not None and calibration.n_rows:
        sequence = max(1, int(np.median(np.asarray(calibration.lengths))))
    try:
        cov = quantization_coverage(_graph(source), _graph(quantized), sequence=sequence)
    except Exception as exc:  # a measurement, not the build: recorded; a gate on it then fails with this reason
        cov = {"error": f"{type(exc).__name__}: {str(exc)[:500]}", "quantizable_nodes": None,
               "quantized_mac_nodes": None, "macs_total": None, "macs_int8": None, "quantized_mac_fraction": None}
    details["quantization_coverage"] = cov
    for key in ("quantizable_nodes", "quantized_mac_nodes", "macs_total", "macs_int8", "quantized_mac_fraction"):
        details[key] = cov[key]
    return cov


# -------------------------------------------------------------------------------------------------- fp16
def _to_fp16(variant: VariantSpec, src: Path, dst: Path, details: dict[str, Any]) -> None:
    import onnx
    from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST, convert_float_to_float16

    # ORT's default block list holds ops without float16 kernels; the spec's list (default ["Cast"]) is added.
    block = sorted(set(DEFAULT_OP_BLOCK_LIST) | set(variant.fp16_op_block_list))
    proto = convert_float_to_float16(onnx.load(str(src)), keep_io_types=True, op_block_list=block)
    details["fp16"] = {"op_block_list": block, "keep_io_types": True}
    _save_proto(proto, dst)


# -------------------------------------------------------------------------------------------------- int8
def _preprocess(src: Path, dst: Path, details: dict[str, Any]) -> Path:
    """`_preprocess_uncached`, memoized under `tailguard run` (`_prepared`, keyed on the input's SHA-256)."""
    from tailguard.core.digests import file_sha256

    return _prepared("preprocess", {"input": file_sha256(src)}, Path(src), Path(dst), details,
                     lambda d, det: _preprocess_uncached(src, d, det))


def _preprocess_uncached(src: Path, dst: Path, details: dict[str, Any]) -> Path:
    """quant_pre_process: symbolic shape inference with auto_merge (MiniLM-like graphs need it), ORT basic
    optimization. Graphs with contrib ops that symbolic shape inference does not know (FusedMatMul after ORT's
    extended level) fail "Incomplete symbolic shape inference"; a second try guesses those ops' output rank
    (guess_output_rank=True), without which the Softmax after them stays untyped and uncalibrated. If both fail,
    the unprocessed graph is quantized and the reasons are recorded.

    ORT's symbolic shape inference dumps `sym_shape_infer_temp.onnx` and a `<uuid>.data` file into the *current
    directory* when it fails; it runs with a scratch folder beside `dst` as the current directory, removed after,
    so nothing lands in the caller's folder."""
    from onnxruntime.quantization import quant_pre_process

    src, dst = Path(src).resolve(), Path(dst).resolve()
    errors = []
    with tempfile.TemporaryDirectory(prefix="preprocess-", dir=dst.parent) as scratch, contextlib.chdir(scratch):
        for options in ({"auto_merge": True}, {"auto_merge": True, "guess_output_rank": True}):
            try:
                quant_pre_process(str(src), str(dst), **options)
            except Exception as exc:  # symbolic shape inference fails on some graphs; quantization still can run
                errors.append(f"{options}: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            details["preprocess"] = {"ran": True, **options, **({"first_try": errors[0]} if errors else {})}
            return dst
    details["preprocess"] = {"ran": False, "error": "; ".join(errors)}
    return src


def _excluded_nodes(src: Path, q: QuantizationSpec) -> tuple[list[str], list[str]]:
    """Node names to keep in float: `exclude_nodes` plus every node of an `exclude_op_types` type.

    Returns:
        (sorted names to exclude, names from exclude_nodes that the graph does not have).
    """
    graph = _graph(src).graph
    names = {n.name for n in graph.node}
    unknown = [n for n in q.exclude_nodes if n not in names]
    by_type = {n.name for n in graph.node if n.op_type in set(q.exclude_op_types) and n.name}
    chosen = (set(q.exclude_nodes) & names) | by_type
    # Dynamic quantization first rewrites Gemm as MatMul (+ Add) named "<gemm>_MatMul"
    # (onnxruntime/quantization/onnx_model.py replace_gemm_with_matmul): exclude that name too.
    chosen |= {f"{n.name}_MatMul" for n in graph.node if n.name in chosen and n.op_type == "Gemm"}
    return sorted(chosen), unknown


def _has_contrib_ops(src: Path) -> bool:

    graph = _graph(src).graph
    return any(n.domain not in ("", "ai.onnx") for n in graph.node)


def _quant_type(name: str):
    from onnxruntime.quantization import QuantType

    return {"int8": QuantType.QInt8, "uint8": QuantType.QUInt8}[name]


def _large(src: Path) -> bool:
    return src.stat().st_size >= TWO_GB


def _dynamic_options(q: QuantizationSpec, src: Path) -> dict[str, Any]:
    """quantize_dynamic's keyword arguments for `q` on the graph `src`, besides nodes_to_exclude and
    use_external_data_format (shared with the sensitivity analysis's in-memory single-node quantization)."""
    import onnx

    extra: dict[str, Any] = {}
    if _has_contrib_ops(src):
        # Shape inference does not type the outputs of fused contrib ops (SkipLayerNormalization, ...); without a
        # default the quantizer raises "Unable to find data type for weight_name=...".
        extra["DefaultTensorType"] = onnx.TensorProto.FLOAT
    return {"op_types_to_quantize": q.op_types or None, "per_channel": q.per_channel, "reduce_range": q.reduce_range,
            "weight_type": _quant_type(q.weight_type), "extra_options": extra}


def _quantize_dynamic(q: QuantizationSpec, src: Path, dst: Path, excluded: list[str], details: dict[str, Any]) -> None:
    from onnxruntime.quantization import quantize_dynamic

    options = _dynamic_options(q, src)
    extra = options["extra_options"]  # recorded after the call, with the defaults quantize_dynamic adds to it
    quantize_dynamic(str(src), str(dst), nodes_to_exclude=excluded, use_external_data_format=_large(src), **options)
    details["quantization"] = {"mode": "dynamic", "per_channel": q.per_channel, "reduce_range": q.reduce_range,
                               "weight_type": q.weight_type, "activation_type": "uint8 (dynamic)",
                               "op_types": q.op_types or "all supported",
                               "extra_options": _jsonable(extra)}


class DatasetCalibrationReader:
    """`onnxruntime.quantization.CalibrationDataReader` over a tailguard Dataset.

    Yields feeds {input name: array (batch, sequence, ...)} in length-sorted batches of `batch_size` rows,
    padded per batch with `model.pad_values`, or all to `fixed_length` and to exactly `batch_size` rows
    (`equal_batches`: the last batch is filled with the first rows again), which ORT's histogram calibrators
    need when they stack every batch into one array.

    Args:
        ds: calibration rows.
        input_specs: `model.inputs`.
        batch_size: rows per batch.
        pad_values: pad value per input (default 0).
        fixed_length: pad every row to this length (None: the longest row of each batch).
        equal_batches: make every batch exactly `batch_size` rows.
        input_names: only these inputs are fed (the graph's inputs).
    """

    def __init__(self, ds: Dataset, input_specs: list[TensorSpec], batch_size: int, *,
                 pad_values: dict[str, float] | None = None, fixed_length: int | None = None,
                 equal_batches: bool = False, input_names: list[str] | None = None) -> None:
        self.ds, self.specs = ds, [s for s in input_specs if input_names is None or s.name in input_names]
        from tailguard.core.data import batch_indices

        self.batch_size, self.pad_values, self.fixed_length = batch_size, pad_values or {}, fixed_length
        self.batches = batch_indices(ds, batch_size)
        if equal_batches and self.batches and len(self.batches[-1]) < batch_size:
            need = batch_size - len(self.batches[-1])
            fill = np.resize(np.concatenate(self.batches), need)
            self.batches[-1] = np.concatenate([self.batches[-1], fill])
        self._it: Iterator[np.ndarray] = iter(self.batches)

    def get_next(self) -> dict[str, np.ndarray] | None:
        """The next batch of feeds, or None at the end."""
        from tailguard.core.data import make_batch

        idx = next(self._it, None)
        if idx is None:
            return None
        return make_batch(self.ds, idx, self.specs, pad_values=self.pad_values, fixed_length=self.fixed_length)

    def rewind(self) -> None:
        """Start again from the first batch."""
        self._it = iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def _calibration_cache_supported() -> bool:
    """quantize_static takes precomputed ranges (calibration_cache_path) in onnxruntime >= 1.2x builds that have
    it; then tailguard runs the histogram calibrators itself, with the spec's num_bins."""
    from onnxruntime.quantization import quantize_static

    return "calibration_cache_path" in inspect.signature(quantize_static).parameters


def _quantize_static(q: QuantizationSpec, src: Path, dst: Path, excluded: list[str], calibration: Dataset,
                     model: ModelSpec, batch_size: int, tmp: Path, details: dict[str, Any]) -> None:
    import onnx
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, quantize_static

    method = {"minmax": CalibrationMethod.MinMax, "entropy": CalibrationMethod.Entropy,
              "percentile": CalibrationMethod.Percentile}[q.calibration_method]
    graph_inputs = [i.name for i in _graph(src).graph.input]
    extra: dict[str, Any] = {}
    if _has_contrib_ops(src):
        extra["DefaultTensorType"] = onnx.TensorProto.FLOAT  # see _quantize_dynamic
    calib_info: dict[str, Any] = {"method": q.calibration_method, "rows": calibration.n_rows,
                                  "batch_size": batch_size}
    kwargs: dict[str, Any] = {}
    if q.calibration_method == "percentile":
        extra["CalibPercentile"] = q.percentile
        calib_info["percentile"] = q.percentile
    if _calibration_cache_supported():
        # tailguard calibrates (calibrate_ranges) and hands the ranges over as a calibration cache: the ranges
        # are memoized per process (a search's static trials of one variant calibrate once), and quantize_static
        # does not forward num_bins to the histogram calibrators (onnxruntime/quantization/quantize.py passes only
        # CalibTensorRangeSymmetric/MovingAverage/MaxIntermediateOutputs/Percentile), which create_calibrator
        # (extra_options={"num_bins": ...}) gets here. One collect_data call per batch for the histogram methods:
        # they stack the batches of one call into one array, which fails on variable-length batches.
        cache = tmp / "calibration_cache.json"
        n_batches, reused = _memoized_calibration(src, q, method, calibration, model, batch_size, graph_inputs,
                                                  cache, tmp)
        kwargs["calibration_cache_path"] = str(cache)
        calib_info.update(batches=n_batches, padding="per batch", ranges_reused=reused)
        if q.calibration_method != "minmax":
            calib_info.update(num_bins=q.num_bins, num_bins_applied=True)
    elif q.calibration_method == "minmax":
        reader = DatasetCalibrationReader(calibration, model.inputs, batch_size, pad_values=model.pad_values,
                                          input_names=graph_inputs)
        kwargs["calibration_data_reader"] = reader
        calib_info.update(batches=len(reader), padding="per batch")
    else:
        fixed = int(calibration.lengths.max())
        reader = DatasetCalibrationReader(calibration, model.inputs, batch_size, pad_values=model.pad_values,
                                          fixed_length=fixed, equal_batches=True, input_names=graph_inputs)
        kwargs["calibration_data_reader"] = reader
        calib_info.update(batches=len(reader), padding=f"fixed length {fixed}", num_bins=q.num_bins,
                          num_bins_applied=False,
                          note="this onnxruntime's quantize_static cannot take num_bins; its default was used")
    quantize_static(str(src), str(dst), quant_format=QuantFormat.QDQ if q.format == "qdq" else QuantFormat.QOperator,
                    op_types_to_quantize=q.op_types or None, per_channel=q.per_channel, reduce_range=q.reduce_range,
                    activation_type=_quant_type(q.activation_type), weight_type=_quant_type(q.weight_type),
                    nodes_to_exclude=excluded, use_external_data_format=_large(src), calibrate_method=method,
                    calibration_providers=["CPUExecutionProvider"], extra_options=extra, **kwargs)
    details["calibration"] = calib_info
    details["quantization"] = {"mode": "static", "format": q.format, "per_channel": q.per_channel,
                               "reduce_range": q.reduce_range, "weight_type": q.weight_type,
                               "activation_type": q.activation_type, "op_types": q.op_types or "all supported",
                               "extra_options": _jsonable(extra)}


# Calibration ranges memoized per process: {key: (TensorsData, batches)}, least recently used first.
_RANGES: "OrderedDict[str, tuple[Any, int]]" = OrderedDict()
_RANGES_MAX = 8  # entries kept (a search's variants x calibration methods); histograms are num_bins per tensor


def calibration_key(src: Path, q: QuantizationSpec, calibration: "Dataset", model: ModelSpec, batch_size: int) -> str:
    """SHA-256 over what the calibration ranges of `src` depend on: the graph given to the quantizer (bytes of
    `src`, after graph optimization and quant_pre_process), the method, num_bins (histogram methods), percentile
    (percentile), op_types, the calibration rows (every input array's dtype, shape and bytes, in row order), the
    batch size and pad values (they shape the batches) and the model inputs' names and dtypes. Not in it:
    exclude_nodes, per_channel, reduce_range, weight/activation types and format, which ORT applies after
    calibration (create_calibrator sees only the graph, op_types and the method's options)."""
    import hashlib

    h = hashlib.sha256()
    with open(src, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    meta = {"method": q.calibration_method, "op_types": sorted(q.op_types or []), "batch_size": batch_size,
            "num_bins": q.num_bins if q.calibration_method != "minmax" else None,
            "percentile": q.percentile if q.calibration_method == "percentile" else None,
            "pad_values": dict(sorted((model.pad_values or {}).items())),
            "inputs": [(s.name, str(s.dtype)) for s in model.inputs]}
    h.update(json.dumps(meta, sort_keys=True, default=str).encode())
    for s in model.inputs:
        for arr in calibration.inputs.get(s.name, []):
            a = np.ascontiguousarray(arr)
            h.update(f"{s.name}|{a.dtype.str}|{a.shape}".encode())
            h.update(a.tobytes())
    return h.hexdigest()


def _memoized_calibration(src: Path, q: QuantizationSpec, method: Any, calibration: "Dataset", model: ModelSpec,
                          batch_size: int, graph_inputs: list[str], cache: Path, tmp: Path) -> tuple[int, bool]:
    """Write the calibration ranges of `src` to `cache` (an ORT calibration cache, `save_tensors_data`): from the
    process memo when `calibration_key` matches an earlier calibration, else from `calibrate_ranges`.
    Graphs with external data (> 2 GB) are not memoized. Returns (batches, reused)."""
    from onnxruntime.quantization.calibrate import save_tensors_data

    key = None if _large(src) else calibration_key(src, q, calibration, model, batch_size)
    if key is not None and key in _RANGES:
        _RANGES.move_to_end(key)
        ranges, n_batches = _RANGES[key]
        save_tensors_data(ranges, cache)
        return n_batches, True
    ranges, n_batches = calibrate_ranges(src, q, method, calibration, model, batch_size, graph_inputs, tmp)
    save_tensors_data(ranges, cache)
    if key is not None:
        _RANGES[key] = (ranges, n_batches)
        while len(_RANGES) > _RANGES_MAX:
            _RANGES.popitem(last=False)
    return n_batches, False


def calibrate_ranges(src: Path, q: QuantizationSpec, method: Any, calibration: "Dataset", model: ModelSpec,
                     batch_size: int, graph_inputs: list[str], tmp: Path) -> tuple[Any, int]:
    """Calibrate `src` on the calibration rows: ORT's `create_calibrator` (op_types, `method`, num_bins /
    percentile for the histogram methods) fed length-sorted batches of `batch_size` rows padded per batch.
    Min-max gets every batch in one collect_data call (as quantize_static does; the per-batch reductions are
    merged with nanmin / nanmax); the histogram methods one call per batch (their histograms merge across calls,
    while one call stacks its batches into one array, which fails on variable-length batches).

    Returns:
        (TensorsData: {tensor name: range}, batches). The seam that counts calibrations.
    """
    from onnxruntime.quantization.calibrate import create_calibrator

    from tailguard.core.data import make_batch

    extra: dict[str, Any] = {}
    if q.calibration_method != "minmax":
        extra["num_bins"] = q.num_bins
    if q.calibration_method == "percentile":
        extra["percentile"] = q.percentile
    calibrator = create_calibrator(src, q.op_types or None, augmented_model_path=str(tmp / "augmented.onnx"),
                                   calibrate_method=method, use_external_data_format=_large(src),
                                   providers=["CPUExecutionProvider"], extra_options=extra)
    reader = DatasetCalibrationReader(calibration, model.inputs, batch_size, pad_values=model.pad_values,
                                      input_names=graph_inputs)
    if q.calibration_method == "minmax":
        calibrator.collect_data(reader)
    else:
        for idx in reader.batches:
            calibrator.collect_data(_OneBatch(make_batch(calibration, idx, reader.specs,
                                                         pad_values=reader.pad_values)))
    return calibrator.compute_data(), len(reader.batches)


class _OneBatch:
    """A calibration data reader of exactly one batch."""

    def __init__(self, feeds: dict[str, np.ndarray]) -> None:
        self.feeds: dict[str, np.ndarray] | None = feeds

    def get_next(self) -> dict[str, np.ndarray] | None:
        feeds, self.feeds = self.feeds, None
        return feeds


# --------------------------------------------------------------------------------------- files and facts
def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return {k: (v if isinstance(v, (bool, int, float, str, type(None))) else str(v)) for k, v in d.items()}


def _save_proto(proto: Any, dst: Path) -> None:
    import onnx

    if proto.ByteSize() < TWO_GB:
        onnx.save_model(proto, str(dst))
    else:
        onnx.save_model(proto, str(dst), save_as_external_data=True, location=dst.name + ".data")


def _save_self_contained(src: Path, dst: Path, metadata: dict[str, str] | None = None) -> None:
    """Load `src` (with its external data) and save it as `dst`, with `metadata` set in metadata_props."""
    import onnx

    proto = onnx.load(str(src))
    if metadata:
        keep = [p for p in proto.metadata_props if p.key not in metadata]
        del proto.metadata_props[:]
        proto.metadata_props.extend(keep)
        for k, v in metadata.items():
            proto.metadata_props.add(key=k, value=v)
    _save_proto(proto, dst)


def _op_counts(path: Path) -> dict[str, int]:

    counts: dict[str, int] = {}
    for n in _graph(path).graph.node:
        counts[n.op_type] = counts.get(n.op_type, 0) + 1
    return counts


def _summary(path: Path, excluded: list[str]) -> dict[str, Any]:
    """Facts of the built model: op counts, quantized nodes, float MatMul-like nodes left, excluded nodes kept
    in float, initializer dtypes, file size (bytes, incl. external data).

    A node counts as quantized when it computes in integers (MatMulInteger, QLinear*, QAttention, ...), reads a
    tensor dequantized from an integer weight or from a QuantizeLinear (QDQ format), or reads an 8-bit
    initializer directly (a quantized Gather).
    """
    import onnx

    proto = _graph(path)
    nodes = list(proto.graph.node)
    is_quantized = _quantized_test(proto)
    counts: dict[str, int] = {}
    quantized: dict[str, int] = {}
    float_left: list[str] = []
    for n in nodes:
        counts[n.op_type] = counts.get(n.op_type, 0) + 1
        if n.op_type in QDQ_OP_TYPES:
            continue
        if is_quantized(n):
            quantized[n.op_type] = quantized.get(n.op_type, 0) + 1
        elif n.op_type in _MATMUL_OPS:
            float_left.append(n.name)
    by_name = {n.name: n for n in nodes}
    kept_float = [name for name in excluded if name in by_name and not is_quantized(by_name[name])]
    locations = {e.value for t in proto.graph.initializer for e in t.external_data if e.key == "location"}
    size = path.stat().st_size + sum((path.parent / loc).stat().st_size for loc in locations)
    init_types: dict[str, int] = {}
    for t in proto.graph.initializer:
        name = onnx.TensorProto.DataType.Name(t.data_type).lower()
        init_types[name] = init_types.get(name, 0) + 1
    return {"op_types": counts, "quantized_nodes": sum(quantized.values()), "quantized_by_op": quantized,
            "quantize_ops": {k: counts[k] for k in sorted(QDQ_OP_TYPES) if counts.get(k)},
            "float_matmul_nodes": float_left, "excluded_kept_float": kept_float,
            "initializer_dtypes": init_types, "bytes": int(size), "external_data": bool(locations),
            "nodes": len(nodes)}


def _quantized_test(proto: Any) -> Any:
    """A predicate node -> bool: the node computes in integers (MatMulInteger, QLinear*, QAttention, ...), reads a
    tensor dequantized from an integer weight or from a QuantizeLinear (QDQ format), or reads an 8-bit initializer
    directly (a quantized Gather)."""
    import onnx

    nodes = list(proto.graph.node)
    by_output = {o: n for n in nodes for o in n.output}
    int8_inits = {t.name for t in proto.graph.initializer
                  if t.data_type in (onnx.TensorProto.INT8, onnx.TensorProto.UINT8)}
    inits = {t.name for t in proto.graph.initializer}

    def from_quantized(tensor: str) -> bool:
        dq = by_output.get(tensor)
        if dq is None or dq.op_type != "DequantizeLinear":
            return False
        src = by_output.get(dq.input[0])
        return dq.input[0] in inits or (src is not None and src.op_type in ("QuantizeLinear", "DynamicQuantizeLinear"))

    def is_quantized(n: Any) -> bool:
        return (n.op_type in INTEGER_OP_TYPES or n.op_type.startswith("QLinear")
                or any(from_quantized(i) or i in int8_inits for i in n.input))

    return is_quantized


def _quantized_node_names(path: Path) -> set[str]:
    """Names of the nodes of `path` that compute in INT8 (`_quantized_test`; QDQ/integer ops themselves left out)."""
    proto = _graph(path)
    test = _quantized_test(proto)
    return {n.name for n in proto.graph.node if n.op_type not in QDQ_OP_TYPES and test(n)}


def _load_check(path: Path, providers: list) -> None:
    """Open the built model once on its execution provider, with the options it will run with (`ort_providers`,
    cache paths in the variant's folder): a variant that cannot load, or whose first provider ONNX Runtime drops,
    is a failed build. On the TensorRT EP this builds the engines into the engine cache the validate step reuses."""
    import onnxruntime as ort

    from tailguard.core.runtime import require_active_provider, resolve_provider_paths

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    resolved = resolve_provider_paths(providers, path.parent)
    require_active_provider(ort.InferenceSession(str(path), sess_options=opts, providers=resolved), resolved)


def _write_calibration(calibration: Dataset | None, model: ModelSpec, out: Path) -> None:
    """Keep the exact calibration rows beside the variant (reproduce.sh reads them)."""
    if calibration is None:
        return
    import pandas as pd

    frame = pd.DataFrame({s.name: [np.asarray(a).tolist() for a in calibration.inputs[s.name]]
                          for s in model.inputs if s.name in calibration.inputs})
    for c in calibration.frame.columns:
        if c not in frame.columns:
            frame[c] = calibration.frame[c].to_numpy()
    frame.to_parquet(out / "calibration.parquet")


def _write_reproduce(variant: VariantSpec, fp32: Path, out: Path, model: ModelSpec, batch_size: int) -> Path:
    """Write reproduce.sh: the same `build_variant` call, from the variant/model JSON written beside it.

    The default FP32 path is assigned to a shell variable quoted with `shlex.quote` and expanded inside double
    quotes, never written inside a double-quoted default: a path holding `$(...)`, backquotes or `"` is data.
    """
    # exclude_unset: re-validating every default can trip validators that look at the fields a user set
    # (QuantizationSpec rejects `format` on a dynamic variant)
    vdump = variant.model_dump(mode="json", exclude_unset=True)
    if variant.quantization is not None and variant.quantization.mode == "dynamic":
        vdump.get("quantization", {}).pop("format", None)
    (out / "variant.json").write_text(json.dumps(vdump, indent=2))
    (out / "model.json").write_text(json.dumps(model.model_dump(mode="json"), indent=2))
    static = variant.quantization is not None and variant.quantization.mode == "static"
    calib = ('load_dataset(d + "/calibration.parquet", m.inputs)' if static else "None")
    code = (
        "import json, sys\n"
        "from tailguard.core.spec.models import ModelSpec, VariantSpec\n"
        "from tailguard.core.data import load_dataset\n"
        "from tailguard.components.quantize.logic import build_variant\n"
        "d = sys.argv[3]\n"
        'v = VariantSpec.model_validate(json.load(open(d + "/variant.json")))\n'
        'm = ModelSpec.model_validate(json.load(open(d + "/model.json")))\n'
        f"r = build_variant(v, sys.argv[1], sys.argv[2], calibration={calib}, model=m, "
        f"calibration_batch_size={batch_size})\n"
        "print(json.dumps(r.to_dict(), indent=2, default=str))\n"
    )
    script = out / "reproduce.sh"
    script.write_text(
        "#!/bin/sh\n"
        f"# Rebuild variant {variant.name} exactly as the pipeline step did (tailguard build_variant).\n"
        "# Usage: sh reproduce.sh [FP32_ONNX] [OUT_DIR]\n"
        "set -e\n"
        f"HERE=$(cd \"$(dirname \"$0\")\" && pwd)\n"
        f"FP32_DEFAULT={shlex.quote(str(fp32))}\n"
        f"python -c {shlex.quote(code)} \"${{1:-$FP32_DEFAULT}}\" \"${{2:-$HERE/rebuild}}\" \"$HERE\"\n")
    script.chmod(0o755)
    return script
