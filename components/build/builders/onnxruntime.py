"""The `onnxruntime` builder: graph optimization, FP16 conversion and INT8 dynamic / static
quantization of the FP32 ONNX reference, one variant per call.

It returns a `BuildResult`: ok with the artifact and the facts of the build, failed with the reason when ONNX
Runtime's tooling breaks for that variant (the run goes on with the other variants), or skipped with the reason
(the execution provider is missing). Static INT8's calibration is `calibration.py`; the warnings and the INT8
coverage it records are `diagnostics.py`; reading and writing the graph files is `onnx_files.py`.

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
import io
import json
import os
import shlex
import shutil
import tempfile
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tailguard.components.build.calibration import _quantize_static, _write_calibration
from tailguard.components.build.diagnostics import (
    FUSED_OP_TYPES,
    _coverage,
    attention_quantization_warnings,
    export_warnings,
    fusion_warnings,
)
from tailguard.components.build.onnx_files import (
    _check_inputs,
    _graph,
    _has_contrib_ops,
    _jsonable,
    _large,
    _load_check,
    _op_counts,
    _quant_type,
    _save_proto,
    _save_self_contained,
    _summary,
)
from tailguard.components.build.registry import register_builder
from tailguard.core.contract import ONNX_INLINE_LIMIT_BYTES as TWO_GB  # protobuf's 2 GiB limit
from tailguard.core.contract import QUANTIZATION_COVERAGE_KEY
from tailguard.core.errors import InputError
from tailguard.core.results import BuildResult

if TYPE_CHECKING:  # tailguard.core.data imports pandas: a build that reads no calibration rows never loads it
    from tailguard.core.data import Dataset
    from tailguard.core.spec.model import ModelSpec
    from tailguard.core.spec.variants import QuantizationSpec, VariantSpec


# ORT graph optimization levels by spec name, and the matching `opt_level` of onnxruntime.transformers.optimizer
# (0 disables ORT's own pass; 99 = ORT_ENABLE_ALL).
_OPT_LEVELS = {"disabled": 0, "basic": 1, "extended": 2, "all": 99}


# ----------------------------------------------------------------------------------------- ONNX Runtime
@register_builder("onnxruntime", source="onnx")
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
    from tailguard.components.build.profiles import ort_providers

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
                        f"{', quant_pre_process' if details.get('preprocess', {}).get('ran') else ''}); "
                        "use node names of that graph "
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
        "from tailguard.core.spec.model import ModelSpec\n"
        "from tailguard.core.spec.variants import VariantSpec\n"
        "from tailguard.core.data import load_dataset\n"
        "from tailguard.components.build.logic import build_variant\n"
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
