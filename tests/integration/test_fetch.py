"""`tailguard fetch MODEL@ALIAS|MODEL/VERSION -o DIR` against a real SQLite MLflow store: the registry resolves the
reference, the model file lands in DIR with its sha256, MLflow's packaging files do not; unknown models, aliases
and versions exit 2 naming what the store holds. (The promoted variant of a real local run is fetched in
tests/integration/test_run_temp_dirs.py.)"""

import hashlib

import mlflow
import pytest
from typer.testing import CliRunner

from tailguard.cli import app
from tailguard.fetch import parse_model_ref
from tailguard.monitoring import testing as T


@pytest.fixture()
def store(tmp_path, monkeypatch):
    monkeypatch.setenv("TAILGUARD_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    T.linear_classifier(tmp_path / "model.onnx")
    r = CliRunner().invoke(app, ["register", "clf", str(tmp_path / "model.onnx"), "--tracking-uri", uri])
    assert r.exit_code == 0, r.output
    mlflow.MlflowClient(uri, registry_uri=uri).set_registered_model_alias("clf", "production", "1")
    return {"uri": uri, "root": tmp_path, "sha256": hashlib.sha256((tmp_path / "model.onnx").read_bytes()).hexdigest()}


def _fetch(*args):
    return CliRunner().invoke(app, ["fetch", *map(str, args)])


@pytest.mark.parametrize("ref", ["clf@production", "clf/1", "models:/clf@production"])
def test_fetch_writes_only_the_model_file_with_its_sha256_when_the_alias_or_version_resolves(store, ref):
    out = store["root"] / "out"
    r = _fetch(ref, "-o", out, "--tracking-uri", store["uri"])
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in out.iterdir()) == ["model.onnx"]
    digest = hashlib.sha256((out / "model.onnx").read_bytes()).hexdigest()
    version = mlflow.MlflowClient(store["uri"], registry_uri=store["uri"]).get_model_version("clf", "1")
    assert digest == version.tags["tailguard.sha256"] and digest in r.output and "clf v1" in r.output


def test_fetch_uses_mlflow_tracking_uri_when_no_option_names_the_store(store, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store["uri"])
    r = _fetch("clf@production", "-o", store["root"] / "env-out")
    assert r.exit_code == 0, r.output
    assert (store["root"] / "env-out" / "model.onnx").is_file()


@pytest.mark.parametrize("ref, expected", [
    ("clf@staging", "has no alias @staging (aliases: @production -> v1)"),
    ("clf/9", "has no version 9 (versions: v1)"),
    ("nope@production", "no registered model 'nope'"),
    ("clf", "names neither an alias nor a version"),
])
def test_fetch_exits_2_naming_what_exists_when_the_model_alias_or_version_is_unknown(store, ref, expected):
    out = store["root"] / "bad"
    r = _fetch(ref, "-o", out, "--tracking-uri", store["uri"])
    assert r.exit_code == 2, r.output
    assert expected in " ".join(r.output.split()) and "Traceback" not in r.output
    assert not out.exists() or not any(out.iterdir())


def test_parse_model_ref_splits_alias_and_version_forms():
    assert parse_model_ref("team/clf-optimized@production") == ("team/clf-optimized", "production", None)
    assert parse_model_ref("clf-optimized/12") == ("clf-optimized", None, "12")


def test_fetch_reads_the_named_store_when_run_as_a_fresh_process_with_tracking_uri(store, tmp_path):
    """A real `tailguard fetch` process, no $MLFLOW_TRACKING_URI, the store named only by --tracking-uri: nothing
    global (mlflow.set_registry_uri from an earlier in-process command) can make it find the version."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")}
    cli = Path(sys.executable).with_name("tailguard")
    out, cwd = tmp_path / "proc-out", tmp_path / "elsewhere"  # not the store's folder: MLflow's default
    cwd.mkdir()                                                # registry (sqlite:///mlflow.db) is the cwd's
    r = subprocess.run([str(cli), "fetch", "clf@production", "-o", str(out), "--tracking-uri", store["uri"]],
                       cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (out / "model.onnx").is_file() and not (cwd / "mlflow.db").exists()


def _stored_folder(store):
    from pathlib import Path
    from urllib.parse import urlparse

    client = mlflow.MlflowClient(store["uri"], registry_uri=store["uri"])
    uri = client.get_model_version_download_uri("clf", "1")
    if uri.startswith("models:/"):  # a LoggedModel: its artifact location
        uri = client.get_logged_model(client.get_model_version("clf", "1").model_id).artifact_location
    folder = Path(urlparse(uri).path)
    assert (folder / "model.onnx").is_file(), folder
    return folder


@pytest.mark.parametrize("legacy", [False, True], ids=["files-digest", "model-digest-only"])
def test_fetch_exits_1_and_writes_nothing_when_a_file_beside_the_model_was_added_after_registration(store, legacy):
    """Issue 36 item 8: every file of the version is checked, not only the model file (a planted external-data
    file would otherwise be written unchecked beside a model file whose digest matches)."""
    client = mlflow.MlflowClient(store["uri"], registry_uri=store["uri"])
    assert client.get_model_version("clf", "1").tags["tailguard.files_sha256"]  # recorded at registration
    if legacy:  # a version registered before the all-files digest: only the model file's digest is known
        client.delete_model_version_tag("clf", "1", "tailguard.files_sha256")
    (_stored_folder(store) / "model.onnx.data").write_bytes(b"\0" * 64)
    out = store["root"] / "out"
    r = _fetch("clf@production", "-o", out, "--tracking-uri", store["uri"])
    assert r.exit_code == 1, r.output
    text = " ".join(r.output.split())
    assert "model.onnx.data" in text and "Traceback" not in text
    assert ("no recorded digest covers" if legacy else "do not match the digest recorded at registration") in text
    assert not out.exists() or not any(out.iterdir())  # nothing written


def test_fetch_exits_1_when_a_registered_references_descriptor_changed_after_registration(store):
    import json
    from pathlib import Path
    from urllib.parse import urlparse

    import torch

    model = torch.nn.Linear(4, 3).eval()
    pt2 = store["root"] / "ref.pt2"
    torch.export.save(torch.export.export(model, (torch.ones(2, 4),)), str(pt2))
    r = CliRunner().invoke(app, ["register", "ref", str(pt2), "--tracking-uri", store["uri"]])
    assert r.exit_code == 0, r.output
    client = mlflow.MlflowClient(store["uri"], registry_uri=store["uri"])
    folder = Path(urlparse(client.get_model_version_download_uri("ref", "1")).path)
    descriptor = folder / "tailguard-model.json"
    assert _fetch("ref/1", "-o", store["root"] / "ok", "--tracking-uri", store["uri"]).exit_code == 0
    descriptor.write_text(json.dumps({**json.loads(descriptor.read_text()), "class_path": "evil:Module"}))
    r = _fetch("ref/1", "-o", store["root"] / "bad", "--tracking-uri", store["uri"])
    assert r.exit_code == 1 and "tailguard.files_sha256" in " ".join(r.output.split()), r.output
