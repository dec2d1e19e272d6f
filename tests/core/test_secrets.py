"""Issue 22 item 8: credentials planted in a spec's URIs never reach the compiled KFP IR (`tailguard compile`), the
spec artifact or the params of the parent MLflow run.

Real parts: the typer CLI in-process, the KFP compiler, a real `mlflow server` (SQLite store, proxied artifacts)
reached with `http://alice:<secret>@127.0.0.1:<port>` (MLflow's REST client sends the userinfo as basic auth; the
server has no auth and ignores it), the resolve task's `main` and its MLflow writes. Nothing is mocked.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from tailguard.cli import app
from tailguard.core.redact import MASK, redact_spec_yaml, redact_text, redact_uri
from tests.components.test_resolve import N_IN, X
from tests.helpers.mlflow_server import mlflow_server
from tests.helpers.resolve_models import make_tiny

runner = CliRunner()
PLANTED = "PLANTEDs3cr3t"  # every secret below contains it: grep for this one string


def spec_doc(tracking_uri: str) -> dict:
    """A valid spec whose URIs carry PLANTED in userinfo and in credential-like query parameters."""
    return {
        "apiVersion": "tailguard/v1", "kind": "OptimizationSpec", "metadata": {"name": "secrets"},
        "model": {"registered_name": "secret-onnx", "task": "classification", "source": {"format": "onnx"},
                  "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", N_IN]}],
                  "outputs": [{"name": "logits", "dtype": "float32", "shape": ["batch", 3]}]},
        "data": {"calibration": {"uri": f"s3://bucket/calib.parquet?X-Amz-Signature={PLANTED}1&versionId=3"},
                 "validation": {"uri": f"https://data.example/valid.parquet?token={PLANTED}2"}},
        "variants": [{"name": "ort-fp32", "backend": "onnxruntime", "precision": "fp32"}],
        "gates": [{"metric": "top1_agreement", "min": 0.9}],
        "mlflow": {"tracking_uri": tracking_uri, "registry_uri": tracking_uri},
    }


# ------------------------------------------------------------------------------------------------- unit
@pytest.mark.parametrize("uri, expected", [
    ("http://alice:pw@mlflow:5000/x", f"http://alice:{MASK}@mlflow:5000/x"),
    ("https://ghp_TOKEN@host/repo", f"https://{MASK}@host/repo"),
    ("s3://b/k.parquet?X-Amz-Signature=abc&X-Amz-Date=1&versionId=3",
     f"s3://b/k.parquet?X-Amz-Signature={MASK}&X-Amz-Date=1&versionId=3"),
    ("https://acct.blob.core.windows.net/c/f?sv=1&sig=abc", f"https://acct.blob.core.windows.net/c/f?sv=1&sig={MASK}"),
    ("sqlite:////tmp/mlflow.db", "sqlite:////tmp/mlflow.db"),
    ("relative/file.parquet", "relative/file.parquet"),
])
def test_redact_uri_masks_credentials_and_keeps_the_rest_when_given_a_uri(uri, expected):
    assert redact_uri(uri) == expected


def test_redact_text_masks_every_uri_when_embedded_in_a_message():
    msg = "cannot reach http://u:pw@a:1/x (then https://b/?api_key=k2): refused"
    assert redact_text(msg) == f"cannot reach http://u:{MASK}@a:1/x (then https://b/?api_key={MASK}): refused"


def test_redact_spec_yaml_returns_the_same_text_when_nothing_is_secret():
    text = yaml.safe_dump(spec_doc("http://mlflow:5000"))
    clean = yaml.safe_dump({**spec_doc("http://mlflow:5000"), "data": {"calibration": {"uri": "c.parquet"},
                                                                        "validation": {"uri": "v.parquet"}}})
    assert redact_spec_yaml(clean) is clean and PLANTED not in redact_spec_yaml(text)


# ---------------------------------------------------------------------------------------------- compile
def test_compile_writes_no_planted_secret_into_the_ir_when_spec_uris_carry_credentials(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(spec_doc(f"http://alice:{PLANTED}0@mlflow.example:5000")))
    ir = tmp_path / "pipeline.yaml"
    result = runner.invoke(app, ["compile", str(spec), "-o", str(ir)])
    assert result.exit_code == 0, result.output
    text = ir.read_text()
    assert PLANTED not in text and PLANTED not in result.output
    assert f"http://alice:{MASK}@mlflow.example:5000" in text  # where, without the password
    assert "s3://bucket/calib.parquet" in text


# ---------------------------------------------------------------------------------- logged spec, params
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with mlflow_server(tmp_path_factory.mktemp("secrets-server")) as url:
        yield url


def test_resolve_logs_no_planted_secret_in_spec_artifact_params_or_tags_when_uris_carry_credentials(
        server, tmp_path, monkeypatch):
    import mlflow
    from mlflow import MlflowClient

    from tailguard.components.resolve import task as resolve_task
    from tailguard.core.tracking import configure
    from tailguard.registration import register_reference

    monkeypatch.setenv("TAILGUARD_HOME", str(tmp_path / "home"))
    secret_uri = server.replace("http://", f"http://alice:{PLANTED}0@")
    onnx_file = tmp_path / "tiny.onnx"
    torch.onnx.export(make_tiny(0), (X,), str(onnx_file), input_names=["x"], output_names=["logits"],
                      dynamic_axes={"x": {0: "batch"}, "logits": {0: "batch"}}, dynamo=False)
    configure(secret_uri, "registration")
    register_reference("secret-onnx", onnx_path=onnx_file)

    spec_yaml = yaml.safe_dump(spec_doc(secret_uri), sort_keys=False)
    _, parent = resolve_task.main(spec_yaml=spec_yaml, tracking_uri=secret_uri, model_version="",
                                  pipeline_run="secrets-1", out_dir=str(tmp_path / "ref"))

    client = MlflowClient(tracking_uri=server)
    run = client.get_run(parent)
    logged_spec = Path(mlflow.artifacts.download_artifacts(run_id=parent, artifact_path="spec.yaml",
                                                           dst_path=str(tmp_path / "dl"), tracking_uri=server))
    text = logged_spec.read_text()
    assert PLANTED not in text
    assert yaml.safe_load(text)["mlflow"]["tracking_uri"] == server.replace("http://", f"http://alice:{MASK}@")
    everything = json.dumps({"params": run.data.params, "tags": run.data.tags})
    assert PLANTED not in everything
    assert run.data.params["model.registered_name"] == "secret-onnx"
    assert copy.deepcopy(spec_doc(secret_uri)) == yaml.safe_load(spec_yaml)  # the run itself got the real URIs
