"""Task glue of the build-variant component.

A pure step: it writes the variant's files and returns a BuildResult, and writes nothing to MLflow (the validate
task logs what the build measured, from the BuildResult it receives). Under `tailguard run` its output is served
from the local cache (tailguard.core.cache) when the FP32 model, the variant's sections, the data it reads and the
versions are the same as in an earlier run.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tailguard.core.contract import ONNX_FILE  # export's output file
from tailguard.core.results import BuildStatus
from tailguard.core.taskio import task_entry, write_json

if TYPE_CHECKING:
    from tailguard.core.reference import ResolvedModel
    from tailguard.core.spec.root import Spec
    from tailguard.core.spec.variants import VariantSpec


def cache_parts(spec: Spec, variant: VariantSpec, onnx_dir: str | Path,
                profile: dict | None = None) -> dict[str, Any] | None:
    """What a build reads, for the cache key (tailguard.core.cache.cache_key): the FP32 model's bytes, the variant
    (all but its `search` section, which a build does not read), the model section (inputs, pad values), the
    TensorRT optimization profile (`profile`, when the variant has one), for a static INT8 build, a TensorRT
    INT8 build or a sensitivity ranking the calibration section and the calibration file's SHA-256, and the node
    facts the artefact depends on (`build_node_parts`). The library versions (onnxruntime, onnx, tensorrt, ...)
    are in every key (`cache.versions`).

    Returns:
        The parts, or None when an input cannot be hashed (a remote calibration file): then no caching.
    """
    from tailguard.core.cache import data_sha256
    from tailguard.core.digests import dir_sha256

    static = _needs_calibration(variant)
    sens = _wants_sensitivity(spec, variant)
    parts: dict[str, Any] = {
        "fp32_onnx": dir_sha256(onnx_dir, prefix=ONNX_FILE),
        "variant": variant.model_dump(mode="json", exclude={"search"}),
        "model": spec.model.model_dump(mode="json", exclude={"version", "registered_name", "description"}),
        "sensitivity": spec.analysis.sensitivity.model_dump(mode="json") if sens else None,
        "node": build_node_parts(variant),
    }
    if profile is not None:
        parts["tensorrt_profile"] = profile
    if static or sens:
        digest = data_sha256(spec.data.calibration.uri)
        if digest is None:
            return None
        parts["calibration"] = {**spec.data.calibration.model_dump(mode="json", exclude={"uri"}), "sha256": digest}
    return parts


# ORT levels whose saved graph may hold hardware-specific rewrites: "all" adds layout optimizations (NCHWc for the
# CPU's vector ISA), which ONNX Runtime's docs ("Graph optimizations", Layout optimizations / online vs offline
# mode) call hardware dependent and not portable; "extended" fusions are EP-specific. Kept conservative: both.
_NODE_BOUND_ORT_LEVELS = ("extended", "all")


def build_node_parts(variant: VariantSpec) -> dict[str, Any]:
    """The node facts a built artefact depends on, for the build cache key, so a build is never served from the
    cache to a node it was not made for (issue 36 item 12).

    - TensorRT (backend tensorrt, or ONNX Runtime on TensorrtExecutionProvider): a plan is compiled for one GPU
      architecture and one TensorRT build: the GPUs' names and compute capabilities (`hardware.gpu_facts`) and the
      TensorRT version.
    - Another GPU execution provider (CUDA): the GPUs' names and compute capabilities.
    - ONNX Runtime on CPU at graph optimization level extended or all (the optimized graph is saved offline): the
      CPU's kernel ISA flags (`hardware.cpu_facts`, e.g. avx2 avx512f avx512_vnni) and the architecture.
    - Otherwise (a plain quantized or converted graph): the architecture only.

    Returns:
        {"machine": str, and as above "gpus": [{"name", "compute_capability"}] | None, "tensorrt": str | None,
        "cpu_isa": list[str] | None}.
    """
    import platform

    from tailguard.core import hardware

    node: dict[str, Any] = {"machine": platform.machine()}
    if variant.uses_tensorrt or variant.execution_provider != "CPUExecutionProvider":
        gpus = hardware.gpu_facts()
        node["gpus"] = None if gpus is None else [{"name": g.get("name"), "compute_capability":
                                                   g.get("compute_capability")} for g in gpus]
        if variant.uses_tensorrt:
            node["tensorrt"] = hardware.library_versions(("tensorrt",))["tensorrt"]
    elif variant.backend == "onnxruntime" and variant.graph_optimization.level in _NODE_BOUND_ORT_LEVELS:
        node["cpu_isa"] = hardware.cpu_facts().get("isa")
    return node


def skip_torch_in_ort_tools() -> bool:
    """Keep ONNX Runtime's quantization tools from importing torch in this process.

    `onnxruntime.tools/__init__` imports `pytorch_export_helpers` (and so torch) whenever torch is installed, and
    `quant_pre_process` (symbolic shape inference) imports `onnxruntime.tools`: every INT8 build would pay for a
    torch import (1.5 s on an idle 2-core machine, up to 9 s on a busy one) for `infer_input_info`, which no build
    calls. This registers a placeholder module under that name whose `infer_input_info` raises ImportError.
    Nothing is done when torch or the real module is already imported (then there is nothing to save).

    Returns:
        True when the placeholder was registered.
    """
    name = "onnxruntime.tools.pytorch_export_helpers"
    if name in sys.modules or "torch" in sys.modules:
        return False
    placeholder = types.ModuleType(name, "tailguard placeholder: the build task does not load torch")

    def infer_input_info(*args: Any, **kwargs: Any) -> Any:
        raise ImportError(f"{name} is a placeholder in tailguard's build task (skip_torch_in_ort_tools): torch "
                          "is not loaded there; call it from a process that has not built a variant")

    placeholder.infer_input_info = infer_input_info  # type: ignore[attr-defined]
    sys.modules[name] = placeholder
    return True


def _needs_calibration(variant: VariantSpec) -> bool:
    """Static INT8 on ONNX Runtime, or INT8 on TensorRT (its entropy calibrator): the build reads calibration rows."""
    static = variant.quantization is not None and variant.quantization.mode == "static"
    return static or (variant.backend == "tensorrt" and variant.precision == "int8")


def tensorrt_profile(spec: Spec, variant: VariantSpec) -> dict | None:
    """The optimization profile of a variant on backend tensorrt or on TensorrtExecutionProvider
    (`profiles.spec_profile`, from the spec and the validation rows); None for every other variant (no rows
    are read then).

    Raises:
        InputError: the variant's tensorrt section contradicts the spec or the data (names the field).
    """
    if not variant.uses_tensorrt:
        return None
    from tailguard.components.build.profiles import spec_profile
    from tailguard.core.data import load_validation

    return spec_profile(spec, variant, load_validation(spec))


def _wants_sensitivity(spec: Spec, variant: VariantSpec) -> bool:
    return (spec.analysis.sensitivity.enabled and variant.precision == "int8" and variant.backend == "onnxruntime"
            and variant.search is None)


@task_entry("build-variant")
def main(*, spec_yaml: str, variant_name: str, onnx_dir: str, out_dir: str) -> str:
    """Build variant `variant_name` from `onnx_dir/model.onnx` into `out_dir`.

    A variant that cannot be built here (no GPU for TensorRT, a quantizer failure) is returned with status
    skipped/failed and its reason; the run goes on with the other variants. Only ok builds are cached.

    Returns:
        JSON BuildResult plus "variant" and "cached" (true: copied from the local cache, not built);
        `artifact` is the model file name relative to `out_dir`.
    """
    from tailguard.core.cache import cached_step
    from tailguard.core.spec import spec_from_yaml

    spec = spec_from_yaml(spec_yaml)
    variant = next(v for v in spec.variants if v.name == variant_name)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    profile = tensorrt_profile(spec, variant)

    def build() -> dict[str, Any]:
        return _build(spec, variant, Path(onnx_dir), out, profile)

    parts = cache_parts(spec, variant, onnx_dir, profile)
    d = cached_step("build", parts, out, build, label=f"build {variant_name}",
                    cacheable=lambda r: r.get("status") == BuildStatus.OK)
    write_json(out / "build.json", d)
    return json.dumps(d, default=str)


def torch_cache_parts(spec: Spec, variant: VariantSpec, resolved: ResolvedModel) -> dict[str, Any] | None:
    """What a torch build reads, for the cache key: the reference (`cache.reference_parts`: format, files, class
    source), the variant, the model section, the calibration rows it takes the export example from, and the node
    (machine, torch version, GPUs): the artefact is bound to them (its manifest), so a build is never served to
    another kind of node.

    Returns:
        The parts, or None when an input cannot be hashed: then no caching.
    """
    from tailguard.core.cache import dataset_parts, machine_parts, reference_parts
    from tailguard.core.hardware import gpu_facts, library_versions

    reference, calibration = reference_parts(resolved, spec), dataset_parts(spec.data.calibration)
    if reference is None or calibration is None:
        return None
    return {**reference, "variant": variant.model_dump(mode="json", exclude={"search"}),
            "model": spec.model.model_dump(mode="json", exclude={"version", "registered_name", "description"}),
            "calibration": calibration, "machine": machine_parts(), "torch": library_versions(("torch",)),
            "gpus": gpu_facts() if variant.torch_device == "cuda" else None}


@task_entry("build-variant")
def torch_main(*, spec_yaml: str, variant_name: str, resolved_json: str, reference_dir: str, out_dir: str) -> str:
    """Build torch variant `variant_name` from the registered torch reference into `out_dir` (the
    `torch` builder, components/build/builders/torch.py). Served from the local cache like `main`.

    Returns:
        JSON BuildResult plus "variant" and "cached"; `artifact` is the artefact's file name relative to `out_dir`.
    """
    from tailguard.core.cache import cached_step
    from tailguard.core.reference import load_resolved
    from tailguard.core.spec import spec_from_yaml

    spec = spec_from_yaml(spec_yaml)
    variant = next(v for v in spec.variants if v.name == variant_name)
    resolved = load_resolved(resolved_json, reference_dir)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    def build() -> dict[str, Any]:
        from tailguard.components.build.registry import get_builder
        from tailguard.core.data import load_calibration
        from tailguard.core.hardware import node_facts
        from tailguard.core.reference import load_torch_reference

        builder = get_builder(variant.backend)
        if builder.source != "torch":
            raise ValueError(f"variant {variant.name}: the {variant.backend} builder builds from the "
                             f"{builder.source} export, not from the torch reference; build it with `main`")
        result = builder.build(variant, lambda: load_torch_reference(resolved, spec.model), out,
                               calibration=load_calibration(spec), model=spec.model,
                               source_sha256=resolved.sha256 or "", reference_format=resolved.format)
        if result.artifact:
            result.artifact = str(Path(result.artifact).resolve().relative_to(out.resolve()))
        d = result.to_dict()
        d["variant"] = variant.name
        d["hardware"] = node_facts()
        write_json(out / "build.json", d)
        return d

    d = cached_step("build", torch_cache_parts(spec, variant, resolved), out, build, label=f"build {variant_name}",
                    cacheable=lambda r: r.get("status") == BuildStatus.OK)
    write_json(out / "build.json", d)
    return json.dumps(d, default=str)


def _build(spec: Spec, variant: VariantSpec, onnx_dir: Path, out: Path, profile: dict | None = None) -> dict[str, Any]:
    """Build the variant into `out` (build.json included); returns the BuildResult dict plus "variant" and
    "hardware" (`tailguard.core.hardware.node_facts()` of this node: CPU model, ISA flags, cores, GPUs, versions)."""
    skip_torch_in_ort_tools()
    from tailguard.components.build.logic import build_variant

    calibration = None
    if _needs_calibration(variant):  # tailguard.core.data imports pandas: only a build that reads rows loads it
        from tailguard.core.data import load_calibration

        calibration = load_calibration(spec)
    result = build_variant(variant, str(onnx_dir / ONNX_FILE), str(out), calibration=calibration,
                           model=spec.model, calibration_batch_size=spec.data.calibration.batch_size,
                           profile=profile)
    if result.artifact:
        result.artifact = str(Path(result.artifact).resolve().relative_to(out.resolve()))
    if result.status == BuildStatus.OK and _wants_sensitivity(spec, variant):
        _sensitivity(spec, variant, onnx_dir / ONNX_FILE, out, calibration)
    from tailguard.core.hardware import node_facts

    d = result.to_dict()
    d["variant"] = variant.name
    d["hardware"] = node_facts()  # the node that built it (a cached build keeps its builder's facts)
    write_json(out / "build.json", d)
    return d


def _sensitivity(spec, variant, fp32_onnx: Path, out: Path, calibration) -> None:
    """analysis.sensitivity: rank the variant's quantizable nodes (components/build/sensitivity.py) into
    out/sensitivity/ (sensitivity.csv, sensitivity.png); the validate task logs that folder to the variant's run.
    Variants with a search get the same ranking from the search task instead."""
    import tempfile

    from tailguard.components.build.sensitivity import node_sensitivity, write_sensitivity_artifacts
    from tailguard.core.data import load_calibration

    rows = calibration if calibration is not None else load_calibration(spec)
    with tempfile.TemporaryDirectory(prefix=f"sensitivity-{variant.name}-") as work:
        table = node_sensitivity(variant, fp32_onnx, rows, spec.model, samples=spec.analysis.sensitivity.samples,
                                 work_dir=Path(work), batch_size=spec.data.calibration.batch_size)
    write_sensitivity_artifacts(table, out / "sensitivity")
