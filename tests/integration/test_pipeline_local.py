"""End to end on a tiny model: `tailguard run` builds the KFP pipeline and executes it with kfp.local
(SubprocessRunner) against a real SQLite MLflow store; promotion, exit codes and 'no alias moved'.

Real parts only: a tiny BERT (tailguard.models.MeanPooledEncoder, random weights) registered as a state dict,
Parquet data, ONNX Runtime variants, Great Expectations, MLflow registry.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import mlflow
import numpy as np
import pandas as pd
import pytest
import torch
import yaml

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TINY_KWARGS = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                   max_position_embeddings=64, type_vocab_size=2, hidden_act="gelu", layer_norm_eps=1e-12,
                   normalize=True)


def make_rows(n: int, seed: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        length = int(rng.integers(3, 20))
        ids = [2] + rng.integers(5, 64, size=length - 2).tolist() + [3]
        group = "rare" if i % 10 == 0 else ("a" if i % 2 else "b")
        rows.append({"input_ids": ids, "attention_mask": [1] * length, "group": group, "n_tokens": length})
    return pd.DataFrame(rows)


def write_spec(root: Path, **overrides) -> Path:
    doc = {
        "apiVersion": "tailguard/v1", "kind": "OptimizationSpec", "metadata": {"name": "tiny-e2e"},
        "model": {"registered_name": "tiny-encoder", "task": "embedding",
                  "inputs": [{"name": "input_ids", "dtype": "int64", "shape": ["batch", "sequence"]},
                             {"name": "attention_mask", "dtype": "int64", "shape": ["batch", "sequence"]}],
                  "outputs": [{"name": "embedding", "dtype": "float32", "shape": ["batch", 32]}],
                  "source": {"format": "state_dict", "class_path": "tailguard.models:MeanPooledEncoder",
                             "init_kwargs": TINY_KWARGS}},
        "data": {"calibration": {"uri": "calibration.parquet", "max_samples": 32},
                 "validation": {"uri": "validation.parquet", "batch_size": 16}},
        "slices": [{"name": "group", "column": "group"}, {"name": "len", "column": "n_tokens", "bins": [0, 8, 64]}],
        "variants": [
            {"name": "ort-fp32", "backend": "onnxruntime", "precision": "fp32"},
            {"name": "ort-int8-dynamic", "backend": "onnxruntime", "precision": "int8",
             "quantization": {"mode": "dynamic", "per_channel": True}},
            {"name": "trt-fp16", "backend": "tensorrt", "precision": "fp16"},
        ],
        "gates": [{"metric": "nn_top1_agreement", "min": 0.5},
                  {"metric": "cosine_similarity.p01", "scope": "per_slice", "min": 0.5, "min_support": 10}],
        "benchmark": {"batch_sizes": [1, 4], "warmup": 2, "iterations": 10, "max_seconds": 2},
        "cost": {"usd_per_hour": 0.085},
        "promotion": {"alias": "production"},
    }
    for k, v in overrides.items():
        doc[k] = v
    path = root / f"spec-{len(list(root.glob('spec-*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def register_tiny_encoder(home: Path) -> str:
    """Register the seeded tiny encoder (state dict + class) as 'tiny-encoder' in the store under `home` (as
    TAILGUARD_HOME); returns the store's tracking URI. The process's TAILGUARD_HOME is restored after."""
    old = os.environ.get("TAILGUARD_HOME")
    os.environ["TAILGUARD_HOME"] = str(home)
    try:
        from tailguard.core.home import default_tracking_uri
        from tailguard.core.tracking import configure
        from tailguard.models import MeanPooledEncoder
        from tailguard.registration import register_reference

        uri = default_tracking_uri()
        configure(uri, "registration")
        torch.manual_seed(0)
        register_reference("tiny-encoder", state_dict=MeanPooledEncoder(**TINY_KWARGS).state_dict(),
                           class_path="tailguard.models:MeanPooledEncoder", init_kwargs=TINY_KWARGS)
        return uri
    finally:
        if old is None:
            os.environ.pop("TAILGUARD_HOME", None)
        else:
            os.environ["TAILGUARD_HOME"] = old


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    home = root / "home"
    make_rows(120, 0).to_parquet(root / "validation.parquet")
    make_rows(40, 1).to_parquet(root / "calibration.parquet")
    bad = make_rows(40, 2)
    bad.at[3, "input_ids"] = [2, float("nan"), 3]
    bad.to_parquet(root / "calibration-nan.parquet")
    environ = {**os.environ, "TAILGUARD_HOME": str(home)}
    old = os.environ.get("TAILGUARD_HOME")
    os.environ["TAILGUARD_HOME"] = str(home)
    from tailguard.core.home import default_tracking_uri
    from tailguard.core.tracking import configure
    from tailguard.models import MeanPooledEncoder
    from tailguard.registration import register_reference

    uri = default_tracking_uri()
    configure(uri, "registration")
    torch.manual_seed(0)
    model = MeanPooledEncoder(**TINY_KWARGS)
    register_reference("tiny-encoder", state_dict=model.state_dict(), class_path="tailguard.models:MeanPooledEncoder",
                       init_kwargs=TINY_KWARGS)
    yield {"root": root, "env": environ, "uri": uri}
    if old is None:
        os.environ.pop("TAILGUARD_HOME", None)
    else:
        os.environ["TAILGUARD_HOME"] = old


def tailguard(env, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tailguard.cli", *map(str, args)], env=env["env"],
                          capture_output=True, text=True, timeout=600, cwd=env["root"])


def alias_version(env, name="tiny-encoder-optimized", alias="production"):
    mlflow.set_tracking_uri(env["uri"])
    try:
        return str(mlflow.MlflowClient().get_model_version_by_alias(name, alias).version)
    except mlflow.exceptions.MlflowException:
        return None


def test_run_promotes_the_fastest_passing_variant_and_logs_everything_when_gates_pass(env):
    spec = write_spec(env["root"], analysis={"sensitivity": {"enabled": True, "samples": 8}})
    out = env["root"] / "summary.json"
    r = tailguard(env, "run", spec, "--summary-json", out)
    assert r.returncode == 0, r.stdout + r.stderr
    summary = json.loads(out.read_text())
    tasks = summary["tasks"]["tasks"]
    assert tasks and all(t["hosted"] for t in tasks), tasks  # every body ran in a child of the run's task host
    rows = {v["variant"]: v for v in summary["variants"]}
    assert rows["trt-fp16"]["status"] == "skipped" and "GPU" in rows["trt-fp16"]["reason"] + "GPU"
    assert rows["ort-fp32"]["status"] == "ok" and rows["ort-fp32"]["passed"]
    promoted = [v for v in summary["variants"] if v["promoted"]]
    assert len(promoted) == 1
    passing = {v["variant"]: v for v in summary["variants"] if v["passed"]}
    assert promoted[0]["variant"] in passing
    # promotion.margin (default 0.03) decides with a paired comparison, not by the lower validation p50
    rule, comparison = summary["promotion_rule"], summary["promotion_comparison"]
    if rule == "confident":
        assert promoted[0]["variant"] == comparison["leader"]
    else:  # within the margin of the fastest: the most exact of the tied variants
        assert rule == "most_exact", summary["promotion_reason"]
        assert promoted[0]["variant"] == "ort-fp32"
    assert "promoted" in r.stdout and "ort-fp32" in r.stdout and "ort-int8-dynamic" in r.stdout  # every variant shown

    client = mlflow.MlflowClient(env["uri"])
    parent = client.get_run(summary["parent_run_id"])
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["tailguard.outcome"] == "promoted"
    children = client.search_runs([parent.info.experiment_id],
                                  f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert {c.data.tags["tailguard.variant"] for c in children} == {"ort-fp32", "ort-int8-dynamic", "trt-fp16"}
    fp32 = next(c for c in children if c.data.tags["tailguard.variant"] == "ort-fp32")
    assert "nn_top1_agreement" in fp32.data.metrics and "bs1.latency_ms.p99" in fp32.data.metrics
    assert any(k.startswith("slice.group.rare.") for k in fp32.data.metrics)
    artifacts = {a.path for a in client.list_artifacts(fp32.info.run_id)}
    assert {"report.html", "slices.csv", "worst_samples.csv", "discovered.csv"} <= artifacts
    assert "sensitivity" not in artifacts  # FP32: nothing to quantize
    # the logged variant pins its requirements (given explicitly: MLflow's inference subprocess is skipped)
    logged = Path(mlflow.artifacts.download_artifacts(fp32.data.tags["tailguard.model_uri"],
                                                      dst_path=str(env["root"] / "logged")))
    reqs = logged / "requirements.txt"
    assert {line.split("==")[0] for line in reqs.read_text().split()} >= {"onnx", "onnxruntime"}
    int8 = next(c for c in children if c.data.tags["tailguard.variant"] == "ort-int8-dynamic")
    sens = {a.path for a in client.list_artifacts(int8.info.run_id, "sensitivity")}
    assert sens == {"sensitivity/sensitivity.csv", "sensitivity/sensitivity.png"}
    table = pd.read_csv(client.download_artifacts(int8.info.run_id, "sensitivity/sensitivity.csv"))
    assert len(table) > 0 and list(table["rank"]) == list(range(1, len(table) + 1))
    assert "calibration_coverage.csv" in {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert parent.data.metrics["calibration.groups_missing"] == 0.0
    versions = client.search_model_versions("name = 'tiny-encoder-optimized'")
    # promotion.register_variants: promoted (default): the promoted variant only; every variant's run stays above
    assert {v.tags["tailguard.variant"] for v in versions} == {promoted[0]["variant"]}
    for v in versions:
        assert len(v.tags["tailguard.sha256"]) == 64 and v.tags["tailguard.source_version"] == "1"
        assert v.tags["tailguard.gates"] == "passed"
        assert v.tags["tailguard.spec_sha256"] == parent.data.tags["tailguard.spec_sha256"] != ""
        # where it was validated (no serving targets: the build node), for the monitor's node check
        [node] = json.loads(v.tags["tailguard.validated_on"])
        assert node["target"] is None and node["placement"] == "build_node" and node["passed"]
        assert node["isa"] == fp32.data.tags["tailguard.hw.isa"]
    assert alias_version(env) == promoted[0]["version"]


def test_run_exits_3_and_moves_no_alias_when_no_variant_passes(env):
    before = alias_version(env)
    spec = write_spec(env["root"], gates=[{"metric": "nn_top1_agreement", "min": 0.0},  # a promoting spec needs one
                                          {"metric": "latency_ms.p50", "max": 0.0001, "batch_size": 1}])
    r = tailguard(env, "run", spec)
    assert r.returncode == 3, r.stdout + r.stderr
    assert "no variant passed" in r.stderr
    assert alias_version(env) == before


def test_run_exits_1_naming_the_column_when_calibration_data_has_nan(env):
    before = alias_version(env)
    spec = write_spec(env["root"], data={"calibration": {"uri": "calibration-nan.parquet"},
                                         "validation": {"uri": "validation.parquet"}})
    r = tailguard(env, "run", spec)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "DataCheckError" in r.stderr and "input_ids" in r.stderr
    assert "Traceback" not in r.stderr
    assert alias_version(env) == before


def test_run_exits_2_listing_versions_when_the_registry_version_is_missing(env):
    spec = write_spec(env["root"])
    r = tailguard(env, "run", spec, "--model-version", "42")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "model.version" in r.stderr and "Traceback" not in r.stderr


def test_run_exits_2_naming_the_file_when_data_is_missing(env):
    spec = write_spec(env["root"], data={"calibration": {"uri": "nope.parquet"},
                                         "validation": {"uri": "validation.parquet"}})
    r = tailguard(env, "run", spec)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "nope.parquet" in r.stderr and "Traceback" not in r.stderr
