"""Issue 22 items 1 and 3: what a registry version may make tailguard do (import a class, read a file, skip a
digest check), against a real SQLite MLflow store and real files (symlinks, a FIFO, /dev/zero). Nothing is mocked.

Versions "registered by another tool" are made the way such a tool does it: a run's artifacts plus
`MlflowClient.create_model_version`, without tailguard's tags.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from urllib.parse import urlparse
from urllib.request import url2pathname

import pytest
import torch

from tailguard.core.contract import FORMAT_TAG, SHA256_TAG
from tailguard.core.errors import InputError, UntrustedModelError
from tailguard.core.reference import (
    RegistryDigestWarning,
    ResolvedModel,
    confined_file,
    load_torch_reference,
    resolve_reference,
)
from tailguard.registration import register_reference
from tests.components.test_resolve import CLASS_PATH, X, make_spec
from tests.helpers.resolve_models import make_tiny

ONNX_BYTES = b"not parsed by resolve: only hashed"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A SQLite MLflow store with `tiny-sd` (a state dict whose descriptor names CLASS_PATH, hidden 8)."""
    import mlflow

    root = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    client = mlflow.MlflowClient()
    exp_id = client.create_experiment("hardening", artifact_location=(root / "artifacts").as_uri())
    mlflow.set_experiment(experiment_id=exp_id)
    register_reference("tiny-sd", state_dict=make_tiny(0).state_dict(), class_path=CLASS_PATH,
                       init_kwargs={"hidden": 8})
    yield {"uri": uri, "client": client, "root": root, "exp_id": exp_id}
    mlflow.set_tracking_uri(None)


def register_folder(store, name: str, folder: Path):
    """Register `folder`'s files as a new version of `name` the way another tool would: no tailguard tags."""
    client = store["client"]
    run = client.create_run(store["exp_id"])
    client.log_artifacts(run.info.run_id, str(folder), "model")
    try:
        client.create_registered_model(name)
    except Exception:  # noqa: BLE001 - already there from an earlier version
        pass
    return client.create_model_version(name, source=f"{run.info.artifact_uri}/model", run_id=run.info.run_id)


def stored_dir(mv) -> Path:
    return Path(url2pathname(urlparse(mv.source).path))


# ----------------------------------------------------------------------------------- item 1: class paths
def test_resolve_reference_exits_2_naming_class_and_trust_when_only_registry_names_the_class(store, tmp_path):
    with pytest.raises(UntrustedModelError) as exc:
        resolve_reference(make_spec("tiny-sd"), tracking_uri=store["uri"], out_dir=tmp_path)
    assert exc.value.exit_code == 2
    assert "model.source.class_path" in exc.value.message and CLASS_PATH in exc.value.message
    assert f"class_path: {CLASS_PATH}" in exc.value.hint and "model.source.trusted: true" in exc.value.hint


def test_resolve_reference_builds_registry_class_when_spec_says_trusted(store, tmp_path):
    spec = make_spec("tiny-sd", trusted=True)
    resolved = resolve_reference(spec, tracking_uri=store["uri"], out_dir=tmp_path)
    assert (resolved.class_path, resolved.init_kwargs) == (CLASS_PATH, {"hidden": 8})
    with torch.no_grad():
        assert torch.equal(load_torch_reference(resolved, spec.model)(X), make_tiny(0)(X))


def test_resolve_reference_uses_registry_kwargs_when_spec_names_the_same_class(store, tmp_path):
    spec = make_spec("tiny-sd", class_path=CLASS_PATH)
    resolved = resolve_reference(spec, tracking_uri=store["uri"], out_dir=tmp_path)
    assert (resolved.class_path, resolved.init_kwargs) == (CLASS_PATH, {"hidden": 8})
    with torch.no_grad():
        assert torch.equal(load_torch_reference(resolved, spec.model)(X), make_tiny(0)(X))


def test_load_torch_reference_refuses_registry_class_when_record_crafted_and_spec_names_none(store, tmp_path):
    resolved = resolve_reference(make_spec("tiny-sd", trusted=True), tracking_uri=store["uri"], out_dir=tmp_path)
    with pytest.raises(UntrustedModelError, match="model.source.class_path"):
        load_torch_reference(resolved, make_spec("tiny-sd").model)


# ---------------------------------------------------------------------------------- item 1: digest tags
def test_resolve_reference_records_digest_once_and_then_refuses_a_change_when_version_has_no_tags(store, tmp_path):
    folder = tmp_path / "other-tool"
    folder.mkdir()
    (folder / "model.onnx").write_bytes(ONNX_BYTES)
    mv = register_folder(store, "other-tool", folder)
    assert SHA256_TAG not in (mv.tags or {})

    with pytest.warns(RegistryDigestWarning, match="no tailguard.sha256 tag") as seen:
        first = resolve_reference(make_spec("other-tool"), tracking_uri=store["uri"], out_dir=tmp_path / "a")
    assert len(seen) == 1
    tags = store["client"].get_model_version("other-tool", mv.version).tags
    assert tags[SHA256_TAG] == first.sha256 and tags[FORMAT_TAG] == "onnx"

    with warnings.catch_warnings():
        warnings.simplefilter("error", RegistryDigestWarning)  # once: the tag is there now
        resolve_reference(make_spec("other-tool"), tracking_uri=store["uri"], out_dir=tmp_path / "b")

    (stored_dir(mv) / "model.onnx").write_bytes(ONNX_BYTES + b" rewritten")
    with pytest.raises(InputError, match="SHA-256") as exc:
        resolve_reference(make_spec("other-tool"), tracking_uri=store["uri"], out_dir=tmp_path / "c")
    assert exc.value.exit_code == 2 and "registry tag tailguard.sha256" in exc.value.message


# --------------------------------------------------------------------------------- item 3: confinement
def _descriptor_version(store, tmp_path, name: str, file: str):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "model.onnx").write_bytes(ONNX_BYTES)
    (folder / "tailguard-model.json").write_text(json.dumps({"schema": "tailguard/model-descriptor/v1",
                                                             "format": "onnx", "file": file}))
    return register_folder(store, name, folder)


@pytest.mark.parametrize("kind", ["absolute", "dotdot"])
def test_resolve_reference_exits_2_when_descriptor_names_a_file_outside_the_artifacts(store, tmp_path, kind):
    outside = tmp_path / "elsewhere" / "other.onnx"
    outside.parent.mkdir()
    outside.write_bytes(b"a readable local ONNX file the registry should not reach")
    file = str(outside) if kind == "absolute" else "../../../../../../../../../../.." + str(outside)
    _descriptor_version(store, tmp_path, f"escape-{kind}", file)
    with pytest.raises(InputError) as exc:
        resolve_reference(make_spec(f"escape-{kind}"), tracking_uri=store["uri"], out_dir=tmp_path / "out")
    assert exc.value.exit_code == 2
    assert "model.version" in exc.value.message and "not a relative path inside" in exc.value.message


def test_confined_file_refuses_symlink_leading_out_of_the_folder_when_target_is_outside(tmp_path):
    local = tmp_path / "download"
    local.mkdir()
    outside = tmp_path / "secret.onnx"
    outside.write_bytes(b"x")
    (local / "model.onnx").symlink_to(outside)
    (local / "inner.onnx").write_bytes(b"y")
    (local / "alias.onnx").symlink_to(local / "inner.onnx")
    with pytest.raises(InputError, match="leads outside the downloaded artifacts"):
        confined_file(local, "model.onnx")
    assert confined_file(local, "alias.onnx") == local / "alias.onnx"  # a link that stays inside is fine


@pytest.mark.parametrize("kind", ["dev-zero-link", "fifo", "folder"])
def test_confined_file_refuses_before_reading_when_model_file_is_not_a_regular_file(tmp_path, kind):
    local = tmp_path / "download"
    local.mkdir()
    if kind == "dev-zero-link":
        (local / "model.onnx").symlink_to("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(local / "model.onnx")  # opening it for reading would block until a writer comes
    else:
        (local / "model.onnx").mkdir()
    with pytest.raises(InputError) as exc:
        confined_file(local, "model.onnx")
    assert exc.value.exit_code == 2
    assert ("not a regular file" if kind != "dev-zero-link" else "leads outside") in exc.value.message


@pytest.mark.parametrize("rel", ["/dev/zero", "../x.onnx", "a/../../x.onnx"])
def test_resolved_model_from_dict_refuses_model_file_outside_folder_when_record_crafted(rel):
    record = {"registered_name": "m", "version": "1", "run_id": None, "format": "onnx", "local_dir": "/tmp/r",
              "source_uri": "models:/m/1", "model_file": rel}
    with pytest.raises(InputError, match="not a relative path inside"):
        ResolvedModel.from_dict(record)
