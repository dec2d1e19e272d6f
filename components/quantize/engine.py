"""TensorRT engine files: what they were built for, checked before load; calibration-cache keys.

A serialized TensorRT engine (a plan file) is specific to the TensorRT version and the GPU it was built on
(TensorRT developer guide, "Serialized engines are not portable across platforms or TensorRT versions";
hardware compatibility is opt-in). Loading a plan built elsewhere fails late or, with hardware-compatible
plans, runs slower than measured. So every engine tailguard builds gets a manifest beside it,
`<engine>.json`, with the plan's sha256 and an `EngineFingerprint`. `verify_engine` checks both before any
`deserialize_cuda_engine`: a changed file, or a fingerprint that differs from the loading node's, is refused
with the fields that differ.

An INT8 calibration cache (`IInt8Calibrator.write_calibration_cache`) is only valid for the same network, the
same calibration rows, the same calibrator and TensorRT version: `calibration_cache_key` names the cache file
after all of them, so a changed input never reuses stale scales.

Nothing here imports TensorRT or CUDA. The node's facts come through one seam, `probe_device`, which imports
tensorrt and torch.cuda lazily and which tests replace with a plain dict (the GPU build itself belongs to the
TensorRT issue: `logic._build_tensorrt_engine`).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Callable

from tailguard.core.cache import file_sha256
from tailguard.core.errors import TailguardError

MANIFEST_SUFFIX = ".json"


class EngineMismatchError(TailguardError):
    """An engine file does not match its manifest (sha256) or was built for another TensorRT / GPU / config.
    Exit code 1 (runtime): rebuild the engine on this node (the build step does, when its cache key misses)."""


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

    def differences(self, other: "EngineFingerprint") -> list[str]:
        """`field: this != other` for every field that differs (empty when equal)."""
        return [f"{f.name}: {getattr(self, f.name)!r} != {getattr(other, f.name)!r}" for f in fields(self)
                if getattr(self, f.name) != getattr(other, f.name)]


def config_sha256(config: dict[str, Any]) -> str:
    """sha256 (hex) of `config` as canonical JSON (sorted keys, no spaces): equal settings, equal hash."""
    return hashlib.sha256(json.dumps(config, sort_keys=True, separators=(",", ":"), default=str).encode()).hexdigest()


def probe_device() -> dict[str, str]:
    """The seam: this node's TensorRT version, GPU name, compute capability and CUDA version.

    Raises:
        MissingDependencyError: TensorRT or a CUDA-enabled torch is not importable (a CPU node).
    """
    from tailguard.core.runtime import require_tensorrt

    trt = require_tensorrt()
    import torch

    major, minor = torch.cuda.get_device_capability(0)
    return {"tensorrt_version": trt.__version__, "device_name": torch.cuda.get_device_name(0),
            "compute_capability": f"{major}.{minor}", "cuda_version": str(torch.version.cuda)}


def fingerprint(onnx_path: str | Path, build_config: dict[str, Any], *,
                probe: Callable[[], dict[str, str]] = probe_device) -> EngineFingerprint:
    """The fingerprint an engine built here, now, from `onnx_path` with `build_config` would have."""
    return EngineFingerprint(**probe(), onnx_sha256=file_sha256(onnx_path),
                             build_config_sha256=config_sha256(build_config))


def write_manifest(engine_path: str | Path, fp: EngineFingerprint) -> Path:
    """Write `<engine>.json` (the plan's sha256 and `fp`) atomically (temp file + rename); returns its path.
    Call it after the plan file is complete."""
    engine_path = Path(engine_path)
    out = engine_path.with_name(engine_path.name + MANIFEST_SUFFIX)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"engine": engine_path.name, "sha256": file_sha256(engine_path),
                               "fingerprint": asdict(fp)}, indent=2, sort_keys=True))
    tmp.replace(out)
    return out


def verify_engine(engine_path: str | Path, expected: EngineFingerprint) -> dict[str, Any]:
    """Check an engine before it is deserialized: its manifest exists, the file's sha256 matches it, and the
    manifest's fingerprint equals `expected` (this node's `fingerprint` for the same ONNX file and settings).

    Returns:
        The manifest (dict).

    Raises:
        EngineMismatchError: no manifest, unreadable manifest, sha256 mismatch (a truncated, replaced or
            tampered plan), or fingerprint fields that differ (each one listed).
    """
    engine_path = Path(engine_path)
    manifest_path = engine_path.with_name(engine_path.name + MANIFEST_SUFFIX)
    rebuild = "delete the engine and its manifest and rebuild it on this node (tailguard run rebuilds it)"
    if not engine_path.is_file():
        raise EngineMismatchError(f"TensorRT engine not found: {engine_path}", hint=rebuild)
    try:
        manifest = json.loads(manifest_path.read_text())
        recorded = EngineFingerprint(**manifest["fingerprint"])
        recorded_sha = manifest["sha256"]
    except FileNotFoundError:
        raise EngineMismatchError(f"TensorRT engine {engine_path} has no manifest {manifest_path.name}: "
                                  "where it was built is unknown", hint=rebuild) from None
    except (ValueError, KeyError, TypeError) as exc:
        raise EngineMismatchError(f"TensorRT engine manifest {manifest_path} is unreadable: "
                                  f"{type(exc).__name__}: {exc}", hint=rebuild) from None
    actual_sha = file_sha256(engine_path)
    if actual_sha != recorded_sha:
        raise EngineMismatchError(f"TensorRT engine {engine_path} changed after it was built: sha256 {actual_sha} "
                                  f"!= {recorded_sha} in {manifest_path.name}", hint=rebuild)
    diff = recorded.differences(expected)
    if diff:
        raise EngineMismatchError(f"TensorRT engine {engine_path} was built for another node or build "
                                  f"(recorded != here): {'; '.join(diff)}", hint=rebuild)
    return manifest


def calibration_cache_key(*, onnx_sha256: str, calibration_sha256: str, calibrator: str, batch_size: int,
                          tensorrt_version: str, input_shapes: dict[str, list[int]] | None = None) -> str:
    """File-name-safe key of an INT8 calibration cache: sha256 (hex, first 32 chars) over the network, the
    calibration rows, the calibrator algorithm (e.g. "entropy2", "minmax"), the calibration batch size, the
    TensorRT version and the calibration input shapes. Any change gives a new key, so stale scales are never
    read back."""
    return config_sha256({"onnx": onnx_sha256, "calibration": calibration_sha256, "calibrator": calibrator,
                          "batch_size": batch_size, "tensorrt": tensorrt_version,
                          "input_shapes": input_shapes or {}})[:32]
