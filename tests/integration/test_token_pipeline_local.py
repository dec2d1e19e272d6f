"""`tailguard run` of a token_classification spec end to end (issue 38 item 1): the tiny real CTC model
(tests/helpers/ctc_models.py) registered as ONNX in a SQLite MLflow store, Parquet data with a `font` column,
`tailguard run` in a subprocess (kfp.local, ONNX Runtime), then `tailguard report`. The FP32 variant's cer is 0, its
gates pass and it is promoted; the variant's run holds cer, token_top1_agreement and sequence_exact_match overall and
per slice; the report shows the per-slice cer.

Real parts only; nothing is mocked."""

import os
import subprocess
import sys

import mlflow
import numpy as np
import pandas as pd
import pytest
import yaml

from tests.helpers import ctc_models as C

pytestmark = [pytest.mark.integration, pytest.mark.slow]
NAME = "tiny-ctc"


def _rows(n: int, seed: int) -> pd.DataFrame:
    x = C.features(n, seed)
    return pd.DataFrame({"x": [r.tolist() for r in x], "font": np.where(np.arange(n) % 2, "serif", "sans")})


def test_run_gates_promotes_and_reports_per_slice_cer_when_task_is_token_classification(tmp_path):
    _rows(120, 0).to_parquet(tmp_path / "validation.parquet")
    _rows(16, 1).to_parquet(tmp_path / "calibration.parquet")
    C.reference_model(tmp_path / "ctc.onnx")
    spec = {
        "apiVersion": "tailguard/v1", "kind": "OptimizationSpec", "metadata": {"name": NAME},
        "model": {"registered_name": NAME, "task": "token_classification", "source": {"format": "onnx"},
                  "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", C.TIME, C.FEAT]}],
                  "outputs": [{"name": "scores", "dtype": "float32", "shape": ["batch", "time", C.CLASSES]}],
                  "decode": {"kind": "ctc_greedy", "blank": 0}},
        "data": {"calibration": {"uri": str(tmp_path / "calibration.parquet"), "max_samples": 16, "batch_size": 8},
                 "validation": {"uri": str(tmp_path / "validation.parquet"), "batch_size": 32}},
        "slices": [{"name": "font", "column": "font"}],
        "variants": [{"name": "ort-fp32", "backend": "onnxruntime", "precision": "fp32",
                      "graph_optimization": {"level": "disabled"}}],
        "gates": [{"metric": "cer", "max": 0.0}, {"metric": "sequence_exact_match", "scope": "per_slice",
                                                  "min": 0.9, "min_support": 30}],
        "analysis": {"sequential": {"enabled": False}},
        "benchmark": {"batch_sizes": [1], "warmup": 1, "iterations": 3, "max_seconds": 1.0},
        "promotion": {"alias": "production"},
    }
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    home = tmp_path / "home"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("TAILGUARD_", "MLFLOW_TRACKING",
                                                                      "MLFLOW_REGISTRY"))},
           "TAILGUARD_HOME": str(home)}
    cli = [sys.executable, "-m", "tailguard.cli"]

    reg = subprocess.run([*cli, "register", NAME, str(tmp_path / "ctc.onnx"), "--spec", str(path)], env=env,
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert reg.returncode == 0, reg.stdout[-2000:] + reg.stderr[-2000:]
    run = subprocess.run([*cli, "run", str(path)], env=env, capture_output=True, text=True, timeout=900,
                         cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rep = subprocess.run([*cli, "report", "latest", "-o", str(tmp_path / "report.html")], env=env,
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert rep.returncode == 0, rep.stdout[-2000:] + rep.stderr[-2000:]

    uri = f"sqlite:///{home / 'mlflow.db'}"
    client = mlflow.MlflowClient(uri, registry_uri=uri)  # not the process-wide registry URI an earlier test set
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])
            if "cer" in r.data.metrics]
    assert len(runs) == 1
    m = runs[0].data.metrics
    assert m["cer"] == 0.0 and m["token_top1_agreement"] == 1.0 and m["sequence_exact_match"] == 1.0
    assert m["slice.font.serif.cer"] == 0.0 and m["slice.font.sans.sequence_exact_match"] == 1.0
    html = (tmp_path / "report.html").read_text()
    assert "cer" in html and "serif" in html
    assert client.get_model_version_by_alias(f"{NAME}-optimized", "production") is not None
