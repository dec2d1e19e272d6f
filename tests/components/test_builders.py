"""The builder registry (components/build/registry.py): one builder per spec backend literal, one module each.

Real modules and the real spec model throughout; nothing is mocked. The one synthetic thing is a stand-in function
whose `__module__` claims a builder module, to prove that a second registration of a backend is refused.
"""

from __future__ import annotations

import subprocess
import sys
import typing

import pytest

from tailguard.components.build.builders import onnxruntime as ort_builder
from tailguard.components.build.builders import tensorrt as trt_builder
from tailguard.components.build.builders import torch as torch_builder
from tailguard.components.build.logic import build_variant
from tailguard.components.build.registry import (
    BUILDERS_PACKAGE,
    SOURCES,
    UnknownBuilderError,
    builder_modules,
    get_builder,
    register_builder,
    registered_builders,
)
from tailguard.core.spec.model import ModelSpec
from tailguard.core.spec.variants import BACKEND_ARTIFACTS, VariantSpec


def spec_backends() -> list[str]:
    """The literals of `VariantSpec.backend` (the spec model is the truth)."""
    return sorted(typing.get_args(VariantSpec.model_fields["backend"].annotation))


def test_registry_has_one_builder_per_spec_backend_literal_when_every_module_is_loaded():
    literals = spec_backends()
    assert literals, "VariantSpec.backend is no Literal: the check below would be empty"
    registered = registered_builders()
    missing, orphans = sorted(set(literals) - set(registered)), sorted(set(registered) - set(literals))
    assert not missing, (f"spec backends without a builder: {missing}; add components/build/builders/<backend>.py "
                         "with @register_builder(\"<backend>\") (docs/builders.md)")
    assert not orphans, (f"builders without a spec backend literal: {orphans}; add the literal to "
                         "tailguard.core.spec.variants.VariantSpec.backend (docs/builders.md)")
    assert builder_modules() == literals  # one module per builder, named after its backend, nothing else there


def test_every_spec_backend_declares_its_artifact_when_the_steps_after_the_build_log_it():
    """Validate, redecide and register log and register a variant by what its artefact is (`VariantSpec.artifact`:
    an ONNX file is an MLflow ONNX model, a .pt2 or a TensorRT plan a folder), never by the backend's name, so a
    new backend needs its literal, its builder module and one BACKEND_ARTIFACTS entry."""
    assert sorted(BACKEND_ARTIFACTS) == spec_backends()
    assert set(BACKEND_ARTIFACTS.values()) <= {"onnx", "pt2", "engine"}
    assert VariantSpec(name="v", backend="onnxruntime", precision="fp32").artifact == "onnx"
    assert VariantSpec(name="t", backend="torch", precision="fp32", device="cpu").artifact == "pt2"


def test_registry_entry_lives_in_its_backends_module_when_looked_up():
    for backend in spec_backends():
        entry = get_builder(backend)
        assert entry.backend == backend and entry.source in SOURCES
        assert entry.module == f"{BUILDERS_PACKAGE}.{backend}"
    assert (get_builder("onnxruntime").build, get_builder("onnxruntime").source) == (ort_builder.quantize_onnxruntime,
                                                                                     "onnx")
    assert (get_builder("tensorrt").build, get_builder("tensorrt").source) == (trt_builder.compile_tensorrt, "onnx")
    assert (get_builder("torch").build, get_builder("torch").source) == (torch_builder.compile_torch, "torch")


def test_get_builder_raises_listing_known_backends_when_the_backend_is_unknown():
    with pytest.raises(UnknownBuilderError, match=r"'no-such-backend'; known: \[") as exc:
        get_builder("no-such-backend")
    assert all(f"'{backend}'" in str(exc.value) for backend in spec_backends())


def test_register_builder_raises_when_a_backend_is_registered_twice():
    def impostor(*args, **kwargs):  # pragma: no cover - never called
        raise AssertionError

    impostor.__module__ = f"{BUILDERS_PACKAGE}.onnxruntime"
    with pytest.raises(ValueError, match="'onnxruntime' is already registered by .*quantize_onnxruntime"):
        register_builder("onnxruntime")(impostor)
    assert get_builder("onnxruntime").build is ort_builder.quantize_onnxruntime


def test_register_builder_raises_when_the_builder_lives_outside_its_own_module():
    def elsewhere(*args, **kwargs):  # pragma: no cover - never called
        raise AssertionError

    with pytest.raises(ValueError, match=r"builders/newbackend\.py"):
        register_builder("newbackend")(elsewhere)
    with pytest.raises(ValueError, match="source 'tflite' is not one of"):
        register_builder("newbackend", source="tflite")  # type: ignore[arg-type]
    assert "newbackend" not in registered_builders()


def test_build_variant_raises_naming_torch_main_when_given_a_torch_variant(tmp_path):
    variant = VariantSpec(name="torch-eager", backend="torch", precision="fp32", device="cpu")
    model = ModelSpec.model_validate({"registered_name": "m", "task": "classification",
                                      "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 4]}],
                                      "outputs": [{"name": "y", "dtype": "float32", "shape": ["batch", 2]}]})
    with pytest.raises(ValueError, match="torch_main"):
        build_variant(variant, tmp_path / "model.onnx", tmp_path / "out", calibration=None, model=model)
    assert not (tmp_path / "out").exists()


def test_get_builder_imports_only_the_asked_backends_module_when_called_in_a_fresh_process():
    code = ("import sys\n"
            "from tailguard.components.build.registry import get_builder\n"
            "get_builder('tensorrt')\n"
            f"print(sorted(m for m in sys.modules if m.startswith('{BUILDERS_PACKAGE}.')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    assert out.stdout.strip() == f"['{BUILDERS_PACKAGE}.tensorrt']"
