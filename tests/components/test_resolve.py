"""Resolve step: registry versions -> local files -> torch modules, against a real SQLite MLflow store.

One store per module (creating it and logging models costs seconds); every test reads it, and tests that change
the registry use their own registered model names.
"""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import urlparse
from urllib.request import url2pathname

import numpy as np
import pytest
import torch

from tailguard.core.contract import FORMAT_TAG, SHA256_TAG
from tailguard.core.errors import InputError, UntrustedModelError
from tailguard.core.reference import (
    DESCRIPTOR_FILE,
    ResolvedModel,
    load_torch_reference,
    resolve_reference,
    resolve_version,
)
from tailguard.core.spec import parse_spec
from tailguard.registration import register_reference
from tests.helpers.resolve_models import N_IN, OtherClassifier, make_tiny

CLASS_PATH = "tests.helpers.resolve_models:TinyClassifier"
X = torch.linspace(-1.0, 1.0, 5 * N_IN).reshape(5, N_IN)  # (batch=5, features=4) float32


def make_spec(registered_name: str, version: str = "latest", **source):
    """A minimal valid spec for the tiny classifier; `source` goes to model.source."""
    return parse_spec({
        "apiVersion": "tailguard/v1", "kind": "OptimizationSpec", "metadata": {"name": "resolve-test"},
        "model": {"registered_name": registered_name, "version": version, "task": "classification",
                  "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", N_IN]}],
                  "outputs": [{"name": "logits", "dtype": "float32", "shape": ["batch", 3]}],
                  "source": source},
        "data": {"calibration": {"uri": "unused.parquet"}, "validation": {"uri": "unused.parquet"}},
        "variants": [{"name": "ort-fp32", "backend": "onnxruntime", "precision": "fp32"}],
        "gates": [{"metric": "top1_agreement", "min": 0.9}],  # a promoting spec needs a parity gate
    })


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A SQLite MLflow store with: tiny-sd v1..v3 (state dicts, seeds 0..2, alias champion -> 2), tiny-pickle v1,
    tiny-onnx v1 and tiny-export v1 (all seed 0)."""
    import mlflow

    root = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    client = mlflow.MlflowClient()
    exp_id = client.create_experiment("resolve-tests", artifact_location=(root / "artifacts").as_uri())
    mlflow.set_experiment(experiment_id=exp_id)
    for seed in range(3):
        register_reference("tiny-sd", state_dict=make_tiny(seed).state_dict(), class_path=CLASS_PATH,
                           init_kwargs={"hidden": 8}, tags={"seed": str(seed)}, description=f"seed {seed}")
    client.set_registered_model_alias("tiny-sd", "champion", "2")
    register_reference("tiny-pickle", pickled_module=make_tiny(0))
    onnx_file = root / "tiny.onnx"
    torch.onnx.export(make_tiny(0), (X,), str(onnx_file), input_names=["x"], output_names=["logits"],
                      dynamic_axes={"x": {0: "batch"}, "logits": {0: "batch"}}, dynamo=False)
    register_reference("tiny-onnx", onnx_path=onnx_file)
    register_reference("tiny-export", exported_program=torch.export.export(make_tiny(0), (X,)))
    yield {"uri": uri, "client": client, "root": root}
    mlflow.set_tracking_uri(None)


# ------------------------------------------------------------------------------------------- versions
def test_resolve_version_returns_highest_number_when_latest(store):
    assert str(resolve_version(store["client"], "tiny-sd", "latest").version) == "3"


def test_resolve_version_returns_that_version_when_number(store):
    mv = resolve_version(store["client"], "tiny-sd", "1")
    assert str(mv.version) == "1" and mv.tags["seed"] == "0"


def test_resolve_version_follows_alias_when_at_alias(store):
    assert str(resolve_version(store["client"], "tiny-sd", "@champion").version) == "2"


def test_resolve_version_raises_input_error_listing_versions_when_version_missing(store):
    with pytest.raises(InputError) as exc:
        resolve_version(store["client"], "tiny-sd", "9")
    assert "model.version" in exc.value.message and "9" in exc.value.message
    assert "['1', '2', '3']" in exc.value.hint


def test_resolve_version_raises_input_error_listing_aliases_when_alias_missing(store):
    with pytest.raises(InputError) as exc:
        resolve_version(store["client"], "tiny-sd", "@production")
    assert "model.version" in exc.value.message and "production" in exc.value.message
    assert "champion" in exc.value.hint


def test_resolve_version_raises_input_error_with_close_names_when_model_missing(store):
    with pytest.raises(InputError) as exc:
        resolve_version(store["client"], "tiny-sdd", "latest")
    assert "model.registered_name" in exc.value.message
    assert "tiny-sd" in exc.value.hint


def test_resolve_version_raises_input_error_when_version_malformed(store):
    with pytest.raises(InputError, match="model.version"):
        resolve_version(store["client"], "tiny-sd", "v2")


# ------------------------------------------------------------------------------------------ registering
def test_register_reference_tags_format_and_sha256_when_state_dict(store):
    mv = store["client"].get_model_version("tiny-sd", "2")
    assert mv.tags[FORMAT_TAG] == "state_dict" and len(mv.tags[SHA256_TAG]) == 64
    assert mv.description == "seed 1"


def test_register_reference_raises_input_error_when_two_models_given(store):
    with pytest.raises(InputError, match="exactly one"):
        register_reference("tiny-bad", state_dict=make_tiny(0).state_dict(), class_path=CLASS_PATH,
                           pickled_module=make_tiny(0))


# ------------------------------------------------------------------------------------------- resolving
def test_resolve_reference_round_trips_identical_outputs_when_state_dict(store, tmp_path):
    spec = make_spec("tiny-sd", "@champion", class_path=CLASS_PATH)  # the spec names the registered class
    resolved = resolve_reference(spec, tracking_uri=store["uri"], out_dir=tmp_path)
    assert (resolved.format, resolved.version, resolved.class_path) == ("state_dict", "2", CLASS_PATH)
    assert resolved.init_kwargs == {"hidden": 8}  # the registered kwargs of that same class
    assert resolved.model_path.is_file() and (Path(resolved.local_dir) / DESCRIPTOR_FILE).is_file()
    assert resolved.sha256 == store["client"].get_model_version("tiny-sd", "2").tags[SHA256_TAG]
    module = load_torch_reference(resolved, spec.model)
    with torch.no_grad():
        assert torch.equal(module(X), make_tiny(1)(X))
        assert not torch.equal(module(X), make_tiny(0)(X))


def test_resolve_reference_uses_override_when_version_given(store, tmp_path):
    resolved = resolve_reference(make_spec("tiny-sd", "latest", class_path=CLASS_PATH), tracking_uri=store["uri"],
                                 out_dir=tmp_path, version="1")
    assert resolved.version == "1"


def test_resolve_reference_refuses_pickle_when_not_trusted(store, tmp_path):
    with pytest.raises(UntrustedModelError) as exc:
        resolve_reference(make_spec("tiny-pickle"), tracking_uri=store["uri"], out_dir=tmp_path)
    assert "model.source.trusted" in exc.value.message and "arbitrary code" in exc.value.message
    assert exc.value.exit_code == 2


def test_load_torch_reference_refuses_pickle_when_record_crafted_untrusted(store, tmp_path):
    resolved = resolve_reference(make_spec("tiny-pickle", trusted=True), tracking_uri=store["uri"], out_dir=tmp_path)
    with pytest.raises(UntrustedModelError):
        load_torch_reference(resolved, make_spec("tiny-pickle").model)


def test_resolve_reference_loads_pickle_when_trusted(store, tmp_path):
    spec = make_spec("tiny-pickle", trusted=True)
    resolved = resolve_reference(spec, tracking_uri=store["uri"], out_dir=tmp_path)
    assert resolved.format == "pickle"
    module = load_torch_reference(resolved, spec.model)
    with torch.no_grad():
        assert torch.equal(module(X), make_tiny(0)(X))


def test_resolve_reference_gives_onnx_path_when_onnx(store, tmp_path):
    import onnxruntime as ort

    resolved = resolve_reference(make_spec("tiny-onnx"), tracking_uri=store["uri"], out_dir=tmp_path)
    assert resolved.format == "onnx" and resolved.onnx_path.endswith("model.onnx")
    sess = ort.InferenceSession(resolved.onnx_path, providers=["CPUExecutionProvider"])
    (out,) = sess.run(None, {"x": X.numpy()})
    with torch.no_grad():
        np.testing.assert_allclose(out, make_tiny(0)(X).numpy(), atol=1e-5)
    with pytest.raises(InputError, match="ONNX"):
        load_torch_reference(resolved, make_spec("tiny-onnx").model)


def test_resolve_reference_round_trips_exported_program_when_torch_export(store, tmp_path):
    resolved = resolve_reference(make_spec("tiny-export"), tracking_uri=store["uri"], out_dir=tmp_path)
    assert resolved.format == "torch_export" and resolved.model_file == "model.pt2"
    module = load_torch_reference(resolved, make_spec("tiny-export").model)
    with torch.no_grad():
        torch.testing.assert_close(module(X), make_tiny(0)(X))


def test_resolve_reference_raises_input_error_when_declared_format_differs(store, tmp_path):
    with pytest.raises(InputError, match="model.source.format") as exc:
        resolve_reference(make_spec("tiny-onnx", format="torch_export"), tracking_uri=store["uri"], out_dir=tmp_path)
    assert "onnx" in exc.value.message


def test_resolve_reference_raises_input_error_when_stored_file_changed(store, tmp_path):
    mv = register_reference("tiny-tampered", state_dict=make_tiny(0).state_dict(), class_path=CLASS_PATH)
    stored = Path(url2pathname(urlparse(mv.source).path)) / "model.safetensors"
    from safetensors.torch import save_file

    save_file(make_tiny(5).state_dict(), str(stored))
    with pytest.raises(InputError, match="SHA-256"):
        resolve_reference(make_spec("tiny-tampered", class_path=CLASS_PATH), tracking_uri=store["uri"],
                          out_dir=tmp_path)


# --------------------------------------------------------------------------------------------- loading
def test_load_torch_reference_raises_input_error_listing_keys_when_state_dict_does_not_fit(store, tmp_path):
    spec = make_spec("tiny-sd", class_path="tests.helpers.resolve_models:OtherClassifier")
    resolved = resolve_reference(spec, tracking_uri=store["uri"], out_dir=tmp_path)
    assert resolved.class_path == "tests.helpers.resolve_models:OtherClassifier"
    with pytest.raises(InputError) as exc:
        load_torch_reference(resolved, spec.model)
    msg = exc.value.message
    assert "missing keys" in msg and "encoder.weight" in msg and "head.bias" in msg
    assert "unexpected keys" in msg and "fc1.weight" in msg
    assert all(k in msg for k in OtherClassifier().state_dict())


def test_load_torch_reference_raises_input_error_when_layer_sizes_differ(store, tmp_path):
    spec = make_spec("tiny-sd", class_path=CLASS_PATH, init_kwargs={"hidden": 16})
    resolved = resolve_reference(spec, tracking_uri=store["uri"], out_dir=tmp_path)
    with pytest.raises(InputError, match="does not fit") as exc:
        load_torch_reference(resolved, spec.model)
    assert "fc1.weight" in exc.value.message


def test_load_torch_reference_raises_input_error_naming_field_when_class_unknown(store, tmp_path):
    spec = make_spec("tiny-sd", class_path="tests.helpers.resolve_models:TinyClasifier")
    resolved = resolve_reference(spec, tracking_uri=store["uri"], out_dir=tmp_path)
    with pytest.raises(InputError) as exc:
        load_torch_reference(resolved, spec.model)
    assert "model.source.class_path" in exc.value.message and "TinyClassifier" in exc.value.hint
    spec = make_spec("tiny-sd", class_path="tests.no_such_module:TinyClassifier")
    with pytest.raises(InputError, match="model.source.class_path"):
        load_torch_reference(resolved, spec.model)


# ---------------------------------------------------------------------------------------------- record
def test_resolved_model_round_trips_through_json_when_relocated(store, tmp_path):
    resolved = resolve_reference(make_spec("tiny-onnx"), tracking_uri=store["uri"], out_dir=tmp_path / "a")
    back = ResolvedModel.from_dict(json.loads(json.dumps(resolved.to_dict())))
    assert back == resolved
    moved = back.with_local_dir(tmp_path / "b")
    assert moved.onnx_path == str((tmp_path / "b").resolve() / "model.onnx") and moved.sha256 == resolved.sha256
    with pytest.raises(InputError, match="missing"):
        ResolvedModel.from_dict({"format": "onnx"})
