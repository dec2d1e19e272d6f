"""TensorRT optimization profiles and ONNX Runtime's GPU execution-provider options: shared by two builders.

A TensorRT engine is built for a range of input shapes, its optimization profile (min / opt / max shape of every
input). Both ways onto TensorRT need one: the `tensorrt` builder (builders/tensorrt.py) sets it on the
`IBuilderConfig`, and the `onnxruntime` builder on TensorrtExecutionProvider passes it to ONNX Runtime's TensorRT
execution provider as strings (`ort_providers`). The build task computes it once per variant from the spec and the
validation rows (`spec_profile`) and keys the build cache on it. Plain Python over numpy: no TensorRT, no GPU.

Sources: TensorRT Python API (IOptimizationProfile); ONNX Runtime "TensorRT Execution Provider" and "CUDA
Execution Provider" docs and onnxruntime/core/providers/tensorrt/tensorrt_execution_provider_info.cc (the option
names).
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

import numpy as np

from tailguard.core.errors import InputError

if TYPE_CHECKING:  # tailguard.core.data imports pandas
    from tailguard.core.data import Dataset
    from tailguard.core.spec.root import Spec
    from tailguard.core.spec.variants import VariantSpec

TRT_CACHE_DIR = "trt_cache"  # ONNX Runtime TensorRT EP caches, relative to the variant's folder
MIB = 1 << 20

# A profile: {input name: {"min": [...], "opt": [...], "max": [...]}}, every list a full shape with batch first.
Profile = dict[str, dict[str, list[int]]]


# ------------------------------------------------------------------------------------------ shapes
def axis_sizes(ds: "Dataset", input_specs: Sequence[Any]) -> dict[str, list[int]]:
    """Size of every named (variable) axis in every row: {axis name: [size per row per input]}.

    A `[batch, sequence]` input with rows of shape (12,) and (40,) gives {"sequence": [12, 40]}; an axis name shared
    by several inputs (input_ids and attention_mask) collects the rows of all of them. Fixed (int) axes are left
    out: every row has the spec's size there.
    """
    out: dict[str, list[int]] = {}
    for s in input_specs:
        rows = ds.inputs.get(s.name, [])
        for pos, dim in enumerate(list(s.shape)[1:]):
            if isinstance(dim, str):
                out.setdefault(dim, []).extend(int(np.shape(r)[pos]) for r in rows if np.ndim(r) > pos)
    return out


def optimization_profile(input_specs: Sequence[Any], *, batch_sizes: Iterable[int], opt_batch: int,
                         validation: "Dataset", calibration: "Dataset | None" = None,
                         max_batch_size: int | None = None, max_lengths: Mapping[str, int] | None = None,
                         field: str = "tensorrt") -> Profile:
    """The optimization profile a TensorRT build gets: min / opt / max shape of every input.

    Batch axis: 1 .. max(`batch_sizes`) (or `max_batch_size`), optimized for `opt_batch` (the batch the promotion
    compares). Every other named axis: 1 .. the longest row of `validation` and `calibration` (or `max_lengths`),
    optimized for the median row of `validation` (rounded up). Fixed axes: the spec's size. TensorRT rejects an
    input outside [min, max] at run time (IOptimizationProfile docs), hence the checks.

    Args:
        input_specs: `model.inputs` (name, shape with named axes).
        batch_sizes: every batch size the pipeline runs (benchmark.batch_sizes, data.validation.batch_size,
            data.calibration.batch_size).
        opt_batch: the batch size to optimize for (promotion.batch_size or the first benchmark batch size).
        validation: the validation rows (their lengths set max and opt).
        calibration: the calibration rows (their lengths widen max), or None.
        max_batch_size: `tensorrt.max_batch_size` of the spec, or None.
        max_lengths: `tensorrt.max_lengths` of the spec ({axis name: size}), or None.
        field: the spec path of the variant's tensorrt section, for messages.

    Returns:
        {input name: {"min": shape, "opt": shape, "max": shape}} (lists of ints, batch first).

    Raises:
        InputError: `max_batch_size` below a batch the pipeline runs, a `max_lengths` name that is no named axis of
            model.inputs, or a `max_lengths` size below the longest data row.
    """
    sizes = axis_sizes(validation, input_specs)
    val_sizes = {k: list(v) for k, v in sizes.items()}
    if calibration is not None:
        for k, v in axis_sizes(calibration, input_specs).items():
            sizes.setdefault(k, []).extend(v)
    batch_sizes = sorted({int(b) for b in batch_sizes})
    top = max(batch_sizes)
    if max_batch_size is not None and max_batch_size < top:
        raise InputError(f"{field}.max_batch_size: {max_batch_size} is below batch size {top}, which the pipeline "
                         "runs (benchmark.batch_sizes, data.validation.batch_size, data.calibration.batch_size)",
                         hint=f"set max_batch_size >= {top} or remove it")
    max_b = max_batch_size or top
    named = sorted({d for s in input_specs for d in list(s.shape)[1:] if isinstance(d, str)})
    unknown = sorted(set(max_lengths or {}) - set(named))
    if unknown:
        raise InputError(f"{field}.max_lengths: {', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} not a "
                         f"named axis of model.inputs (named axes after batch: {', '.join(named) or 'none'})",
                         hint="use the axis names of model.inputs[].shape")
    ranges: dict[str, tuple[int, int, int]] = {}
    for axis in named:
        seen = sizes.get(axis) or [1]
        longest = max(seen)
        cap = (max_lengths or {}).get(axis)
        if cap is not None and cap < longest:
            raise InputError(f"{field}.max_lengths.{axis}: {cap} is below the longest data row ({longest}); TensorRT "
                             "would refuse those rows", hint=f"set max_lengths.{axis} >= {longest} or remove it")
        hi = cap or longest
        opt = int(np.ceil(statistics.median(val_sizes.get(axis) or seen)))
        ranges[axis] = (1, min(max(opt, 1), hi), hi)
    opt_b = min(max(int(opt_batch), 1), max_b)
    profile: Profile = {}
    for s in input_specs:
        lo, mid, hi = [1], [opt_b], [max_b]
        for dim in list(s.shape)[1:]:
            a, b, c = ranges[dim] if isinstance(dim, str) else (int(dim),) * 3
            lo.append(a)
            mid.append(b)
            hi.append(c)
        profile[s.name] = {"min": lo, "opt": mid, "max": hi}
    return profile


def spec_profile(spec: Spec, variant: VariantSpec, validation: "Dataset") -> Profile:
    """`optimization_profile` of `variant` from the whole spec: the batch sizes the validate step runs the variant at
    (benchmark.batch_sizes, data.validation.batch_size), the promotion's batch size to optimize for, the validation
    rows' lengths and the variant's `tensorrt` section. (INT8 calibration has its own fixed-shape profile,
    `builders.tensorrt.calibration_shapes`.)"""
    trt_spec = variant.tensorrt
    idx = next(i for i, v in enumerate(spec.variants) if v.name == variant.name)
    return optimization_profile(
        spec.model.inputs, batch_sizes=[*spec.benchmark.batch_sizes, spec.data.validation.batch_size],
        opt_batch=spec.promotion.batch_size or spec.benchmark.batch_sizes[0], validation=validation,
        max_batch_size=trt_spec.max_batch_size if trt_spec else None,
        max_lengths=trt_spec.max_lengths if trt_spec else None, field=f"variants.{idx}.tensorrt")


def profile_strings(profile: Profile) -> dict[str, str]:
    """ONNX Runtime's TensorRT EP form of a profile: {"trt_profile_min_shapes": "input_ids:1x1,attention_mask:1x1",
    ...} ("input_tensor_1:dim_1xdim_2x...,input_tensor_2:..." in the TensorRT EP docs; all three must be given)."""
    return {f"trt_profile_{k}_shapes": ",".join(f"{name}:{'x'.join(str(d) for d in r[k])}"
                                                for name, r in profile.items()) for k in ("min", "opt", "max")}


# --------------------------------------------------------------------------- ONNX Runtime GPU providers
def ort_providers(variant: VariantSpec, profile: Profile | None) -> list[list[Any]]:
    """The providers (with options) an ONNX Runtime variant's sessions are opened with, in preference order, as
    JSON-ready `[[name, {option: value}], ...]`; paths are relative to the variant's folder
    (`tailguard.core.runtime.resolve_provider_paths` makes them absolute where the folder is).

    - TensorrtExecutionProvider: device 0; precision fp16 -> trt_fp16_enable (the graph stays FP32: TensorRT picks
      FP16 kernels), int8 -> trt_int8_enable (a QDQ graph: explicit quantization, no calibration table, which
      TensorRT refuses beside Q/DQ nodes); engine cache (trt_engine_cache_enable/_path) and timing cache
      (trt_timing_cache_enable/_path) under `trt_cache/` in the variant's folder, so the validate step reuses the
      engines the build made on the same kind of node; the optimization profile as trt_profile_{min,opt,max}_shapes
      (explicit shapes: one engine for every batch and length, no rebuild when a new shape arrives); the spec's
      workspace (trt_max_workspace_size, bytes) and builder optimization level. Then CUDAExecutionProvider for the
      nodes TensorRT does not take (as the TensorRT EP docs recommend).
    - CUDAExecutionProvider: device 0 (FP16 is the FP16 graph of the build).
    - any other provider: no options.

    Option names: onnxruntime/core/providers/tensorrt/tensorrt_execution_provider_info.cc (provider_option_names);
    booleans as Python bools (the docs' Python example).
    """
    ep = variant.execution_provider
    if ep == "TensorrtExecutionProvider":
        opts: dict[str, Any] = {
            "device_id": 0,
            "trt_fp16_enable": variant.precision == "fp16",
            "trt_int8_enable": variant.precision == "int8",
            "trt_engine_cache_enable": True,
            "trt_engine_cache_path": f"{TRT_CACHE_DIR}/engines",
            "trt_timing_cache_enable": True,
            "trt_timing_cache_path": f"{TRT_CACHE_DIR}/timing",
        }
        settings = variant.tensorrt
        if settings is not None and settings.workspace_mib:
            opts["trt_max_workspace_size"] = settings.workspace_mib * MIB
        if settings is not None and settings.builder_optimization_level is not None:
            opts["trt_builder_optimization_level"] = settings.builder_optimization_level
        if profile:
            opts.update(profile_strings(profile))
        return [[ep, opts], ["CUDAExecutionProvider", {"device_id": 0}]]
    if ep == "CUDAExecutionProvider":
        return [[ep, {"device_id": 0}]]
    return [[ep, {}]]
