"""Serving targets in a local run (issue 23, item 3): `tailguard run` of a spec with two serving targets runs each
variant's validation once per target, here (kfp.local SubprocessRunner, real SQLite MLflow store), and the register
step moves one alias per target besides the default one.

A local run has one node, this one: every target's validate task runs here, records that (tailguard.target_placement
= this_node) and checks this node against the target's `expect`. The targets are written from this node's own facts
(/proc/cpuinfo), so the test holds on any machine: "here" expects an ISA flag this node has, "anywhere" expects
nothing, "elsewhere" expects one it lacks (or, on a CPU with every flag tailguard reads, the absence of one it has).

Model: tests/helpers/search_models.py's tiny MLP (16 -> 32 -> 32 -> 8), registered as an ONNX reference; variants
FP32 and INT8 dynamic, gated on cosine_similarity.mean >= 0 (both pass: the test is about where they were validated).
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
import yaml

from tailguard.core.hardware import KERNEL_ISA_FLAGS, node_facts
from tests.helpers.search_models import IN, OUT, planted_mlp

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "targets-mlp"
OPTIMIZED = f"{MODEL}-optimized"
VARIANTS = ("mlp-fp32", "mlp-int8")


def _expects() -> tuple[dict, dict]:
    """(an `expect` this node meets, one it does not), from this node's ISA flags."""
    isa = node_facts()["cpu"]["isa"]
    if isa is None:
        pytest.skip("this node's ISA flags cannot be read (no /proc/cpuinfo): a target expectation cannot be met")
    here = {"isa": [isa[0]]} if isa else {"absent_isa": [KERNEL_ISA_FLAGS[0]]}
    missing = [f for f in KERNEL_ISA_FLAGS if f not in isa]
    elsewhere = {"isa": [missing[-1]]} if missing else {"absent_isa": [isa[0]]}
    return here, elsewhere


def make_rows(n: int, seed: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    return pd.DataFrame({"x": [rng.normal(size=IN).astype(np.float32).tolist() for _ in range(n)],
                         "group": np.where(np.arange(n) % 2 == 0, "a", "b")})


def write_spec(root: Path, targets: list[dict], alias: str) -> Path:
    doc = {
        "apiVersion": "tailguard/v1", "kind": "OptimizationSpec", "metadata": {"name": "targets-local"},
        "model": {"registered_name": MODEL, "task": "embedding", "source": {"format": "onnx"},
                  "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", IN]}],
                  "outputs": [{"name": "y", "dtype": "float32", "shape": ["batch", OUT]}]},
        "data": {"calibration": {"uri": "calibration.parquet", "max_samples": 16, "batch_size": 8},
                 "validation": {"uri": "validation.parquet", "batch_size": 16}},
        "slices": [{"name": "group", "column": "group"}],
        "variants": [{"name": "mlp-fp32", "backend": "onnxruntime", "precision": "fp32"},
                     {"name": "mlp-int8", "backend": "onnxruntime", "precision": "int8",
                      "quantization": {"mode": "dynamic", "reduce_range": True}}],
        "gates": [{"metric": "cosine_similarity.mean", "min": 0.0}],
        "analysis": {"discovery": {"enabled": False}},
        "benchmark": {"batch_sizes": [4], "warmup": 1, "iterations": 3, "max_seconds": 1.0},
        # margin null: the default alias goes to the lowest p50 (the per-target rule this file tests), not to the
        # most exact of variants tied within a margin (that rule is tested in test_promotion.py)
        "promotion": {"alias": alias, "margin": None},
        "serving_targets": targets,
    }
    path = root / f"spec-{alias}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("targets-e2e")
    home = root / "home"
    make_rows(48, 0).to_parquet(root / "validation.parquet")
    make_rows(16, 1).to_parquet(root / "calibration.parquet")
    # configure() sets MLFLOW_TRACKING_URI / MLFLOW_REGISTRY_URI in os.environ: restored afterwards
    saved = {k: os.environ.get(k) for k in ("TAILGUARD_HOME", "MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")}
    os.environ["TAILGUARD_HOME"] = str(home)
    from tailguard.core.home import default_tracking_uri
    from tailguard.core.tracking import configure
    from tailguard.registration import register_reference

    uri = default_tracking_uri()
    configure(uri, "registration")
    register_reference(MODEL, onnx_path=planted_mlp(root / "mlp.onnx"))
    yield {"root": root, "env": {**os.environ, "TAILGUARD_HOME": str(home), "MLFLOW_TRACKING_URI": uri,
                                 "MLFLOW_REGISTRY_URI": uri}, "uri": uri}
    mlflow.set_tracking_uri(saved["MLFLOW_TRACKING_URI"])
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def run(env, spec: Path) -> tuple[subprocess.CompletedProcess, dict]:
    out = spec.with_suffix(".summary.json")
    r = subprocess.run([sys.executable, "-m", "tailguard.cli", "run", str(spec), "--summary-json", str(out)],
                       env=env["env"], capture_output=True, text=True, timeout=900, cwd=env["root"])
    assert out.exists(), r.stdout + r.stderr
    return r, json.loads(out.read_text())


def aliases(env) -> dict[str, str]:
    client = mlflow.MlflowClient(env["uri"], env["uri"])
    return {a: str(v) for a, v in client.get_registered_model(OPTIMIZED).aliases.items()}


def test_run_validates_each_variant_on_each_target_and_moves_per_target_aliases_when_both_targets_pass(env):
    here, _ = _expects()
    spec = write_spec(env["root"], [{"name": "here", "expect": here}, {"name": "anywhere"}], "production")
    r, summary = run(env, spec)
    assert r.returncode == 0, r.stdout + r.stderr
    assert summary["serving_targets"] == ["here", "anywhere"]
    rows = {v["variant"]: v for v in summary["variants"]}
    assert set(rows) == set(VARIANTS)
    for row in rows.values():  # one verdict per target, each validated here
        assert set(row["targets"]) == {"here", "anywhere"} and row["passed"], row
        for e in row["targets"].values():
            assert e["status"] == "ok" and e["passed"] and e["placement"] == "this_node" and e["p50_ms"] > 0
        assert row["targets"]["here"]["check"] == "matched" and row["targets"]["anywhere"]["check"] == "no_expect"
        # the default alias judges a variant by its slowest target
        assert row["p50_ms"] == max(e["p50_ms"] for e in row["targets"].values())

    client = mlflow.MlflowClient(env["uri"], env["uri"])
    children = client.search_runs([summary["experiment_id"]],
                                  f"tags.mlflow.parentRunId = '{summary['parent_run_id']}'")
    assert sorted((c.data.tags["tailguard.variant"], c.data.tags["tailguard.target"]) for c in children) == \
        sorted((v, t) for v in VARIANTS for t in ("here", "anywhere"))
    assert {c.data.tags["tailguard.target_placement"] for c in children} == {"this_node"}
    parent = client.get_run(summary["parent_run_id"])
    assert "tailguard.report_error" not in parent.data.tags  # the run report reads the per-target summary
    assert json.loads(parent.data.tags["tailguard.target_aliases"]) == {
        e["alias"]: e["alias_version"] for e in summary["target_aliases"]}

    # each target's alias: the fastest variant passing on that target (its p50 there); the default alias: the
    # fastest passing on every target (p50 of its slowest target); all three moved by this run
    have = aliases(env)
    by_alias = {e["alias"]: e for e in summary["target_aliases"]}
    assert set(by_alias) == {"production-here", "production-anywhere"}
    for t in ("here", "anywhere"):
        fastest = min(VARIANTS, key=lambda v: rows[v]["targets"][t]["p50_ms"])
        e = by_alias[f"production-{t}"]
        assert e["outcome"] == "promoted" and e["variant"] == fastest
        assert have[f"production-{t}"] == rows[fastest]["version"] == e["version"]
    default = min(VARIANTS, key=lambda v: rows[v]["p50_ms"])
    assert summary["promoted_variant"] == default and have["production"] == rows[default]["version"]
    assert "production-here" in r.stdout and "production-anywhere" in r.stdout

    # the registry records where each promoted version was validated: the monitor's node check reads it
    for version in {have["production"], have["production-here"], have["production-anywhere"]}:
        entries = json.loads(client.get_model_version(OPTIMIZED, version).tags["tailguard.validated_on"])
        assert [e["target"] for e in entries] == ["here", "anywhere"]
        assert all(e["passed"] and e["placement"] == "this_node" for e in entries)
        assert entries[0]["isa"] == (" ".join(node_facts()["cpu"]["isa"]) or "none")


def test_run_skips_a_target_this_node_does_not_match_and_moves_only_the_matching_targets_alias(env):
    here, elsewhere = _expects()
    spec = write_spec(env["root"], [{"name": "here", "expect": here}, {"name": "elsewhere", "expect": elsewhere}],
                      "staging")
    r, summary = run(env, spec)
    # nothing passed on every target (elsewhere validated nothing): exit 3, the default alias does not move
    assert r.returncode == 3, r.stdout + r.stderr
    assert "every serving target" in r.stderr
    rows = {v["variant"]: v for v in summary["variants"]}
    flag = (elsewhere.get("isa") or elsewhere.get("absent_isa"))[0]
    for row in rows.values():
        assert not row["passed"] and row["status"] == "ok"
        skipped = row["targets"]["elsewhere"]
        assert skipped["status"] == "skipped" and not skipped["passed"] and skipped["check"] == "mismatch"
        assert "does not match" in skipped["reason"] and flag in skipped["reason"]
        assert row["targets"]["here"]["passed"]
    have = aliases(env)
    assert "staging" not in have and "staging-elsewhere" not in have
    by_alias = {e["alias"]: e for e in summary["target_aliases"]}
    assert by_alias["staging-elsewhere"]["outcome"] == "not_promoted"
    assert by_alias["staging-elsewhere"]["variant"] is None
    assert by_alias["staging-here"]["outcome"] == "promoted"
    assert have["staging-here"] == by_alias["staging-here"]["version"]
    assert "staging-elsewhere stays at nowhere" in r.stdout
