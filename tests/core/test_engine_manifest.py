"""TensorRT engine manifests and calibration-cache keys (components/build/engine.py), on CPU.

The node's facts (TensorRT version, GPU, CUDA) come through one seam, `probe`, replaced here by a plain function:
this machine has no GPU. The plan file is arbitrary bytes: nothing here deserializes it.
"""

import json

import pytest

from tailguard.components.build.engine import (
    calibration_cache_key,
    fingerprint,
    probe_device,
    verify_engine,
    write_manifest,
)
from tailguard.core.artifacts import ArtifactMismatchError
from tailguard.core.errors import MissingDependencyError
from tailguard.core.runtime import tensorrt_unavailable_reason

H100 = {"tensorrt_version": "10.13.0", "device_name": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0",
        "cuda_version": "12.8"}
CONFIG = {"precision": "fp16", "profiles": {"input_ids": [[1, 8], [8, 128], [32, 256]]}, "workspace_bytes": 1 << 30}


@pytest.fixture
def built(tmp_path):
    onnx = tmp_path / "model.onnx"
    onnx.write_bytes(b"onnx-bytes")
    engine = tmp_path / "model.plan"
    engine.write_bytes(b"plan-bytes" * 100)
    fp = fingerprint(onnx, CONFIG, probe=lambda: H100)
    write_manifest(engine, fp)
    return onnx, engine, fp


def test_verify_engine_returns_the_manifest_when_file_and_node_match(built):
    onnx, engine, fp = built
    manifest = verify_engine(engine, fingerprint(onnx, dict(CONFIG), probe=lambda: dict(H100)))
    assert manifest["fingerprint"]["compute_capability"] == "9.0" and len(manifest["sha256"]) == 64


def test_verify_engine_refuses_with_the_sha256s_when_the_plan_changed_after_the_build(built):
    onnx, engine, fp = built
    engine.write_bytes(engine.read_bytes()[:-1])  # truncated copy
    with pytest.raises(ArtifactMismatchError, match="changed after it was built: sha256"):
        verify_engine(engine, fp)


@pytest.mark.parametrize("field,value", [("compute_capability", "8.0"), ("tensorrt_version", "10.14.1"),
                                         ("device_name", "NVIDIA A10G"), ("cuda_version", "13.0")])
def test_verify_engine_names_the_field_when_the_node_differs(built, field, value):
    onnx, engine, _ = built
    here = fingerprint(onnx, CONFIG, probe=lambda: {**H100, field: value})
    with pytest.raises(ArtifactMismatchError, match=f"{field}: .* != '{value}'"):
        verify_engine(engine, here)


def test_verify_engine_refuses_when_the_onnx_or_the_build_settings_changed(built, tmp_path):
    onnx, engine, _ = built
    with pytest.raises(ArtifactMismatchError, match="build_config_sha256"):
        verify_engine(engine, fingerprint(onnx, {**CONFIG, "precision": "int8"}, probe=lambda: H100))
    onnx.write_bytes(b"another model")
    with pytest.raises(ArtifactMismatchError, match="onnx_sha256"):
        verify_engine(engine, fingerprint(onnx, CONFIG, probe=lambda: H100))


def test_verify_engine_refuses_when_the_manifest_is_missing_or_unreadable(built):
    onnx, engine, fp = built
    manifest = engine.with_name(engine.name + ".json")
    manifest.write_text("{not json")
    with pytest.raises(ArtifactMismatchError, match="unreadable"):
        verify_engine(engine, fp)
    manifest.write_text(json.dumps({"sha256": "x"}))
    with pytest.raises(ArtifactMismatchError, match="unreadable"):
        verify_engine(engine, fp)
    manifest.unlink()
    with pytest.raises(ArtifactMismatchError, match="has no manifest"):
        verify_engine(engine, fp)


def test_calibration_cache_key_changes_when_any_input_changes():
    base = dict(onnx_sha256="a" * 64, calibration_sha256="b" * 64, calibrator="entropy2", batch_size=8,
                tensorrt_version="10.13.0", input_shapes={"x": [8, 128]})
    key = calibration_cache_key(**base)
    assert key == calibration_cache_key(**dict(base)) and len(key) == 32 and key.isalnum()
    changes = {"onnx_sha256": "c" * 64, "calibration_sha256": "d" * 64, "calibrator": "minmax", "batch_size": 16,
               "tensorrt_version": "10.14.1", "input_shapes": {"x": [8, 256]}}
    keys = {calibration_cache_key(**{**base, k: v}) for k, v in changes.items()}
    assert key not in keys and len(keys) == len(changes)


def test_probe_device_raises_missing_dependency_when_tensorrt_is_absent():
    if tensorrt_unavailable_reason() is None:
        pytest.skip("TensorRT and a GPU are present: the probe succeeds here")
    with pytest.raises((MissingDependencyError, RuntimeError, AssertionError)):
        probe_device()
