"""A tiny local run (`tailguard run`, kfp.local SubprocessRunner, real SQLite MLflow store, ONNX Runtime) leaves no
temporary folder behind; its --summary-json keeps build and gate statuses apart; `tailguard fetch` gets the
promoted variant's ONNX file out of the registry. TMPDIR is the test's own folder, so other processes on the
machine cannot change the count."""

import hashlib
import json
import os
import subprocess
import sys

import mlflow
import pytest

from tests.integration.test_pipeline_local import make_rows, register_tiny_encoder, write_spec

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("tmpdirs")
    home, tmp = root / "home", root / "tmp"
    tmp.mkdir()
    make_rows(80, 0).to_parquet(root / "validation.parquet")
    make_rows(24, 1).to_parquet(root / "calibration.parquet")
    uri = register_tiny_encoder(home)
    spec = write_spec(root, variants=[
        {"name": "ort-fp32", "backend": "onnxruntime", "precision": "fp32"},
        {"name": "ort-int8-dynamic", "backend": "onnxruntime", "precision": "int8",
         "quantization": {"mode": "dynamic", "per_channel": True}}],
        # a gate only the INT8 variant must meet, and cannot: it builds ("ok") and fails its gates
        gates=[{"metric": "nn_top1_agreement", "min": 0.5},
               {"metric": "cosine_similarity.min", "min": 0.999999, "variants": ["ort-int8-dynamic"]}],
        benchmark={"batch_sizes": [1], "warmup": 1, "iterations": 5, "max_seconds": 1})
    env = {**os.environ, "TAILGUARD_HOME": str(home), "TMPDIR": str(tmp)}
    env.pop("MLFLOW_TRACKING_URI", None)
    before = sorted(p.name for p in tmp.iterdir())
    r = subprocess.run([sys.executable, "-m", "tailguard.cli", "run", str(spec), "--summary-json",
                        str(root / "summary.json")], env=env, capture_output=True, text=True, timeout=900, cwd=root)
    after = sorted(p.name for p in tmp.iterdir())
    return {"root": root, "home": home, "env": env, "uri": uri, "result": r, "before": before, "after": after}


def test_local_run_leaves_no_temporary_folder_when_it_finishes(run):
    r = run["result"]
    assert r.returncode == 0, r.stdout + r.stderr
    assert run["before"] == [] and run["after"] == [], run["after"]  # was: one tmp.XXXX per task + kfp-workspace-*
    assert not any((d / "tmp").exists() for d in (run["home"] / "runs").iterdir())


def test_summary_json_keeps_build_and_gates_statuses_apart_when_a_variant_fails_its_gates(run):
    assert run["result"].returncode == 0, run["result"].stdout + run["result"].stderr
    rows = {v["variant"]: v for v in json.loads((run["root"] / "summary.json").read_text())["variants"]}
    int8, fp32 = rows["ort-int8-dynamic"], rows["ort-fp32"]
    assert (int8["build_status"], int8["gates_status"], int8["passed"]) == ("ok", "failed", False)
    assert (fp32["build_status"], fp32["gates_status"], fp32["promoted"]) == ("ok", "passed", True)
    assert 0.0 <= int8["overall"]["nn_top1_agreement"] <= 1.0
    assert "agreement" in run["result"].stdout


def test_fetch_writes_the_promoted_variants_onnx_file_with_the_registered_sha256_when_given_the_alias(run):
    assert run["result"].returncode == 0, run["result"].stdout + run["result"].stderr
    out = run["root"] / "served" / "tiny" / "1"
    r = subprocess.run([sys.executable, "-m", "tailguard.cli", "fetch", "tiny-encoder-optimized@production", "-o",
                        str(out)], env=run["env"], capture_output=True, text=True, timeout=300, cwd=run["root"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["model.onnx"]  # no MLmodel / conda.yaml, no download folder
    digest = hashlib.sha256((out / "model.onnx").read_bytes()).hexdigest()
    mv = mlflow.MlflowClient(run["uri"]).get_model_version_by_alias("tiny-encoder-optimized", "production")
    assert mv.tags["tailguard.sha256"] == digest and mv.tags["tailguard.variant"] == "ort-fp32"
    assert digest in r.stdout and "variant ort-fp32" in r.stdout
    assert sorted(p.name for p in (run["root"] / "tmp").iterdir()) == []
