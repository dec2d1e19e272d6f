"""Compiled artefacts bound to a node: a manifest beside each file, checked before the file is loaded.

Some artefacts only run where they were built. A serialized TensorRT engine (a plan) is specific to the TensorRT
version and the GPU (TensorRT developer guide, "Serialized engines are not portable across platforms or TensorRT
versions"); an AOTInductor package (`torch._inductor.aoti_compile_and_package`) holds machine code compiled for one
device kind and one PyTorch build (PyTorch docs, "AOTInductor: Ahead-Of-Time Compilation for Torch.Export-ed
Models": the package must be loaded with the same PyTorch version on the same kind of device). Loading one built
elsewhere fails late, crashes, or runs slower than measured. So every such artefact tailguard builds gets a
manifest beside it, `<artefact>.json`, holding the file's sha256 and a fingerprint: a flat {field: string} of what
the artefact is bound to (library version, device, compute capability or CPU ISA flags, a hash of the build
settings). `verify_artifact` checks both before any load: a changed file, or a fingerprint that differs from the
loading node's, is refused with every field that differs.

The fingerprint's fields are the caller's (components/build/engine.py for TensorRT plans,
tailguard.core.torch_backend for torch packages); this module only writes, reads and compares them.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Mapping

from tailguard.core.digests import file_sha256
from tailguard.core.errors import TailguardError

MANIFEST_SUFFIX = ".json"


class ArtifactMismatchError(TailguardError):
    """A compiled artefact does not match its manifest (sha256) or was built for another node or build.
    Exit code 1 (runtime): rebuild it on this node (the build step does, when its cache key misses)."""


def config_sha256(config: Mapping[str, Any]) -> str:
    """sha256 (hex) of `config` as canonical JSON (sorted keys, no spaces): equal settings, equal hash."""
    return hashlib.sha256(json.dumps(config, sort_keys=True, separators=(",", ":"), default=str).encode()).hexdigest()


def manifest_path(artifact: str | Path) -> Path:
    """`<artefact>.json`, the manifest beside `artifact`."""
    artifact = Path(artifact)
    return artifact.with_name(artifact.name + MANIFEST_SUFFIX)


def differences(recorded: Mapping[str, Any], expected: Mapping[str, Any]) -> list[str]:
    """`field: recorded != expected` for every field of either mapping whose values differ (empty when equal);
    a field present on one side only differs from the other's `None`."""
    return [f"{k}: {recorded.get(k)!r} != {expected.get(k)!r}" for k in sorted(set(recorded) | set(expected))
            if recorded.get(k) != expected.get(k)]


def write_manifest(artifact: str | Path, fingerprint: Mapping[str, Any], *, kind: str,
                   extra: Mapping[str, Any] | None = None) -> Path:
    """Write `<artefact>.json` atomically (temp file + rename) once the artefact file is complete.

    Args:
        artifact: the artefact file.
        fingerprint: {field: value} the artefact is bound to (compared by `verify_artifact`).
        kind: what the artefact is, for messages ("TensorRT engine", "AOTInductor package", ...).
        extra: facts recorded but not compared (e.g. compile seconds).

    Returns:
        The manifest's path.
    """
    artifact = Path(artifact)
    out = manifest_path(artifact)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    doc = {"artifact": artifact.name, "kind": kind, "sha256": file_sha256(artifact),
           "fingerprint": dict(fingerprint), **({"facts": dict(extra)} if extra else {})}
    tmp.write_text(json.dumps(doc, indent=2, sort_keys=True, default=str))
    tmp.replace(out)
    return out


def read_manifest(artifact: str | Path, *, kind: str) -> dict[str, Any]:
    """The manifest of `artifact` as written by `write_manifest`.

    Raises:
        ArtifactMismatchError: the artefact or its manifest is missing, or the manifest is unreadable.
    """
    artifact = Path(artifact)
    path = manifest_path(artifact)
    rebuild = f"delete the {kind} and its manifest and rebuild it on this node (tailguard run rebuilds it)"
    if not artifact.is_file():
        raise ArtifactMismatchError(f"{kind} not found: {artifact}", hint=rebuild)
    try:
        manifest = json.loads(path.read_text())
        if not isinstance(manifest.get("fingerprint"), dict) or not isinstance(manifest.get("sha256"), str):
            raise KeyError("fingerprint/sha256")
    except FileNotFoundError:
        raise ArtifactMismatchError(f"{kind} {artifact} has no manifest {path.name}: where it was built is unknown",
                                    hint=rebuild) from None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ArtifactMismatchError(f"{kind} manifest {path} is unreadable: {type(exc).__name__}: {exc}",
                                    hint=rebuild) from None
    return manifest


def verify_artifact(artifact: str | Path, expected: Mapping[str, Any], *, kind: str) -> dict[str, Any]:
    """Check an artefact before it is loaded: its manifest exists, the file's sha256 matches it, and the recorded
    fingerprint equals `expected` (what this node, with the same settings, would build).

    Args:
        artifact: the artefact file.
        expected: this node's fingerprint for the same source and settings.
        kind: what the artefact is, for messages.

    Returns:
        The manifest (dict).

    Raises:
        ArtifactMismatchError: no manifest, unreadable manifest, sha256 mismatch (a truncated, replaced or tampered
            file), or fingerprint fields that differ (each one listed, recorded != here).
    """
    artifact = Path(artifact)
    manifest = read_manifest(artifact, kind=kind)
    rebuild = f"delete the {kind} and its manifest and rebuild it on this node (tailguard run rebuilds it)"
    actual_sha = file_sha256(artifact)
    if actual_sha != manifest["sha256"]:
        raise ArtifactMismatchError(f"{kind} {artifact} changed after it was built: sha256 {actual_sha} != "
                                    f"{manifest['sha256']} in {manifest_path(artifact).name}", hint=rebuild)
    diff = differences(manifest["fingerprint"], expected)
    if diff:
        raise ArtifactMismatchError(f"{kind} {artifact} was built for another node or build (recorded != here): "
                                    f"{'; '.join(diff)}", hint=rebuild)
    return manifest
