"""TensorRT engine files: what they were built for, checked before load; calibration-cache keys.

A serialized TensorRT engine (a plan file) is specific to the TensorRT version and the GPU it was built on
(TensorRT developer guide, "Serialized engines are not portable across platforms or TensorRT versions";
hardware compatibility is opt-in). So every engine tailguard builds gets a manifest beside it, `<engine>.json`,
with the plan's sha256 and an `EngineFingerprint`, written and checked by the kernel's artefact seam
(`tailguard.core.artifacts`, shared with the torch backend's AOTInductor packages). `verify_engine` checks both
before any `deserialize_cuda_engine`: a changed file, or a fingerprint that differs from the loading node's, is
refused with the fields that differ.

An INT8 calibration cache (`IInt8Calibrator.write_calibration_cache`) is only valid for the same network, the
same calibration rows, the same calibrator and TensorRT version: `calibration_cache_key` names the cache file
after all of them, so a changed input never reuses stale scales.

Nothing here imports TensorRT or CUDA. The node's facts come through one seam, `probe_device`
(`tailguard.core.runtime.tensorrt_device_facts`, which imports tensorrt and torch.cuda lazily; the validate step's
`TensorRTRunner` uses the same facts) and which tests replace with a plain dict. The GPU build itself:
components/build/builders/tensorrt.py.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from tailguard.core.artifacts import config_sha256, verify_artifact
from tailguard.core.artifacts import write_manifest as write_artifact_manifest
from tailguard.core.digests import file_sha256
from tailguard.core.runtime import TENSORRT_ENGINE_KIND

KIND = TENSORRT_ENGINE_KIND


@dataclass(frozen=True)
class EngineFingerprint:
    """What a TensorRT plan is bound to.

    Attributes:
        tensorrt_version: `tensorrt.__version__` at build time, e.g. "10.13.0".
        device_name: the GPU's name, e.g. "NVIDIA H100 80GB HBM3".
        compute_capability: "major.minor", e.g. "9.0" (plans are not portable across compute capabilities).
        cuda_version: the CUDA runtime version, e.g. "12.8".
        onnx_sha256: sha256 (hex) of the FP32 ONNX file the engine was built from.
        build_config_sha256: sha256 (hex) of the canonical JSON of the build settings (precision, optimization
            profiles, workspace bytes, calibration cache key...), `config_sha256`.
    """

    tensorrt_version: str
    device_name: str
    compute_capability: str
    cuda_version: str
    onnx_sha256: str
    build_config_sha256: str


def probe_device() -> dict[str, str]:
    """The seam: this node's TensorRT version, GPU name, compute capability and CUDA version.

    Raises:
        MissingDependencyError: TensorRT or a CUDA-enabled torch is not importable (a CPU node).
    """
    from tailguard.core.runtime import tensorrt_device_facts

    return tensorrt_device_facts()


def fingerprint(onnx_path: str | Path, build_config: dict[str, Any], *,
                probe: Callable[[], dict[str, str]] = probe_device) -> EngineFingerprint:
    """The fingerprint an engine built here, now, from `onnx_path` with `build_config` would have."""
    return EngineFingerprint(**probe(), onnx_sha256=file_sha256(onnx_path),
                             build_config_sha256=config_sha256(build_config))


def write_manifest(engine_path: str | Path, fp: EngineFingerprint) -> Path:
    """Write `<engine>.json` (the plan's sha256 and `fp`) atomically; returns its path. Call it after the plan
    file is complete."""
    return write_artifact_manifest(engine_path, asdict(fp), kind=KIND)


def verify_engine(engine_path: str | Path, expected: EngineFingerprint) -> dict[str, Any]:
    """Check an engine before it is deserialized: its manifest exists, the file's sha256 matches it, and the
    manifest's fingerprint equals `expected` (this node's `fingerprint` for the same ONNX file and settings).

    Returns:
        The manifest (dict).

    Raises:
        ArtifactMismatchError: no manifest, unreadable manifest, sha256 mismatch (a truncated, replaced or
            tampered plan), or fingerprint fields that differ (each one listed).
    """
    return verify_artifact(engine_path, asdict(expected), kind=KIND)


def calibration_cache_key(*, onnx_sha256: str, calibration_sha256: str, calibrator: str, batch_size: int,
                          tensorrt_version: str, input_shapes: dict[str, list[int]] | None = None) -> str:
    """File-name-safe key of an INT8 calibration cache: sha256 (hex, first 32 chars) over the network, the
    calibration rows, the calibrator algorithm (e.g. "entropy2", "minmax"), the calibration batch size, the
    TensorRT version and the calibration input shapes. Any change gives a new key, so stale scales are never
    read back."""
    return config_sha256({"onnx": onnx_sha256, "calibration": calibration_sha256, "calibrator": calibrator,
                          "batch_size": batch_size, "tensorrt": tensorrt_version,
                          "input_shapes": input_shapes or {}})[:32]
