"""Opening what the validate step runs: the built variant's runner (ONNX Runtime, TensorRT, torch), the FP32
baselines timed beside it, the reference outputs it is compared with and the baselines JSON of the reference pass.

Used by the validate task, the search step's trials and the gate-only re-run (components/redecide).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from tailguard.core.data import Dataset
    from tailguard.core.spec.root import Spec
    from tailguard.core.spec.variants import VariantSpec


def parse_baselines(baselines_json: str) -> dict[str, Any]:
    """Baselines JSON with batch-size keys turned back into ints."""
    raw = json.loads(baselines_json) if baselines_json else {}
    def fix(d):
        return {int(k): v for k, v in d.items()} if d else None
    return {"torch": fix(raw.get("torch")), "onnx_fp32": fix(raw.get("onnx_fp32")), "rows": raw.get("rows")}


def load_reference_outputs(spec: Spec, reference_file: Path) -> list[np.ndarray]:
    """The FP32 reference outputs saved by reference-pass, in model.outputs order (each (rows, ...))."""
    with np.load(reference_file) as npz:
        # token_classification keeps only its first output (as ids: components/reference/logic.py)
        return [npz[o.name] for o in spec.model.outputs if o.name in npz.files]


def reference_runners(spec: Spec, reference_model_dir: str | Path | None) -> dict[str, Any] | None:
    """The baselines timed interleaved with a variant: {"onnx_fp32": the FP32 reference ONNX}, on the CPU
    execution provider with the spec's threads, built as every timed ORT session is
    (`tailguard.core.runtime.timed_ort_runner`: no spin-waiting, so the ratio is the one the reference pass and the
    promotion's paired rounds measure); None without a folder.

    Raises:
        InputError: the folder has no model.onnx.
    """
    if not reference_model_dir:
        return None
    from tailguard.core.contract import ONNX_FILE
    from tailguard.core.runtime import timed_ort_runner

    return {"onnx_fp32": timed_ort_runner(Path(reference_model_dir) / ONNX_FILE,
                                          intra_op_num_threads=spec.benchmark.intra_op_num_threads)}


class VariantUnusable(Exception):
    """The built variant cannot be loaded on this node (a torch artefact or TensorRT plan built for another node or
    library version, or a torch package whose native loader crashed a probe process): the variant fails with the
    reason, the run goes on."""


def torch_runner(spec: Spec, variant: VariantSpec, model_file: Path, build: dict[str, Any], ds: Dataset) -> Any:
    """The torch variant's runner: its manifest checked against this node (and, for an AOTInductor package, a
    load-and-run probe in a child process first, `torch_backend.probe_load`), a program.pt2 read for code
    (`tailguard.core.pt2_archive`, unless model.source.trusted), then loaded here.

    Raises:
        VariantUnusable: the manifest check failed, the program.pt2 holds code (a pickled weight, e.g. of a tensor
            subclass, without model.source.trusted) or the probe process crashed (the reason names which).
    """
    from tailguard.core.artifacts import ArtifactMismatchError
    from tailguard.core.data import make_batch
    from tailguard.core.errors import UntrustedModelError
    from tailguard.core.torch_backend import TorchVariantRunner, config_of, loads_trusted, probe_load

    config = config_of(variant)
    source = (build.get("details") or {}).get("source_sha256", "")
    trusted = loads_trusted(variant, spec.model.source.trusted)
    try:
        if config.compile == "aot_inductor":
            feeds = make_batch(ds, np.arange(min(2, ds.n_rows)), spec.model.inputs, pad_values=spec.model.pad_values)
            crash = probe_load(model_file, config, spec.model.inputs, source_sha256=source, feeds=feeds,
                               trusted=trusted)
            if crash:
                raise VariantUnusable(crash)
        return TorchVariantRunner(model_file, config, spec.model.inputs, source_sha256=source,
                                  intra_op_num_threads=spec.benchmark.intra_op_num_threads, trusted=trusted)
    except (ArtifactMismatchError, UntrustedModelError) as exc:  # the variant fails with the reason; the run goes on
        raise VariantUnusable(str(exc)) from None


def ort_session_providers(variant: VariantSpec, build: dict[str, Any], variant_dir: Path) -> list[Any]:
    """The providers (with options) an ONNX Runtime variant was built and load-checked with (build.json
    `details.providers`, `tensorrt_build.ort_providers`), cache folders resolved under `variant_dir`; a build.json
    without them (an older build) gives the bare execution provider."""
    from tailguard.core.runtime import resolve_provider_paths

    recorded = (build.get("details") or {}).get("providers")
    return resolve_provider_paths(recorded or [variant.execution_provider], variant_dir)


def tensorrt_expected_fingerprint(build: dict[str, Any], reference_model_dir: str | Path | None, *,
                                  facts: Any = None) -> dict[str, Any]:
    """The fingerprint a TensorRT plan must carry to run here (`TensorRTRunner`'s `expected`): this node's
    TensorRT version, GPU, compute capability and CUDA version (`tensorrt_device_facts`, or `facts()`), the sha256
    of the FP32 ONNX in `reference_model_dir` (else the recorded one) and the sha256 of the build config recorded
    in build.json.

    Raises:
        InputError: build.json has no build_config (not a TensorRT build of this tailguard).
        MissingDependencyError: no TensorRT / CUDA here.
    """
    from tailguard.core.artifacts import config_sha256
    from tailguard.core.contract import ONNX_FILE
    from tailguard.core.digests import file_sha256
    from tailguard.core.errors import InputError
    from tailguard.core.runtime import tensorrt_device_facts

    details = build.get("details") or {}
    if not isinstance(details.get("build_config"), dict):
        raise InputError("build.json of a TensorRT variant has no details.build_config",
                         hint="rebuild the variant with this tailguard version")
    onnx = Path(reference_model_dir) / ONNX_FILE if reference_model_dir else None
    onnx_sha = file_sha256(onnx) if onnx is not None and onnx.is_file() else (
        (details.get("fingerprint") or {}).get("onnx_sha256"))
    return {**(facts or tensorrt_device_facts)(), "onnx_sha256": onnx_sha,
            "build_config_sha256": config_sha256(details["build_config"])}


def variant_runner(spec: Spec, variant: VariantSpec, build: dict[str, Any], variant_dir: Path,
                   reference_model_dir: str | Path | None) -> Any:
    """The runner of a built variant: a `TensorRTRunner` for backend tensorrt (the plan checked against its manifest
    and this node before TensorRT deserializes it), else an ONNX Runtime session on the providers and options it was
    built with (`ort_session_providers`), built as every timed session is (`runtime.timed_ort_runner`)."""
    from tailguard.core.runtime import TensorRTRunner, timed_ort_runner

    model_file = variant_dir / build["artifact"]
    if variant.backend == "tensorrt":
        return TensorRTRunner(model_file, tensorrt_expected_fingerprint(build, reference_model_dir),
                              output_names=[o.name for o in spec.model.outputs])
    return timed_ort_runner(model_file, providers=ort_session_providers(variant, build, variant_dir),
                            intra_op_num_threads=spec.benchmark.intra_op_num_threads)
