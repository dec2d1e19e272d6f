"""A local re-run whose only change is in `gates` or `promotion` is decided in one task on the earlier run's
stored measurements (components/redecide, tailguard.rerun), gives what a full run of that spec gives, and falls
back to the whole pipeline whenever the stored measurements cannot decide it.

Real parts only: the planted MLP (tests/helpers/search_models.py) registered as ONNX in a SQLite MLflow store,
Parquet data, `tailguard run` in a subprocess (kfp.local, ONNX Runtime). The MLP's INT8 dynamic variant agrees
with FP32 on well under 90% of the rows (its planted MatMul), the FP32 variant on all of them, so with
`top1_agreement >= 0.9` (or >= 0.05) the sequential validation decides both after its first 200 of 400 rows.
The first run's gate passes both, so both are timed; a re-run that makes the INT8 variant fail needs nothing more.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest
import yaml

from tests.helpers.search_models import IN, OUT, mlp_rows, planted_mlp

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NAME = "planted-redecide"


def write_spec(root: Path, *, gates: list, iterations: int = 3) -> Path:
    doc = {
        "apiVersion": "tailguard/v1", "kind": "OptimizationSpec", "metadata": {"name": "planted-redecide"},
        "model": {"registered_name": NAME, "task": "classification", "source": {"format": "onnx"},
                  "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", IN]}],
                  "outputs": [{"name": "y", "dtype": "float32", "shape": ["batch", OUT]}]},
        "data": {"calibration": {"uri": str(root / "calibration.parquet"), "max_samples": 32, "batch_size": 8},
                 "validation": {"uri": str(root / "validation.parquet"), "batch_size": 50}},
        "slices": [{"name": "group", "column": "group"}],
        "variants": [{"name": "ort-fp32", "backend": "onnxruntime", "precision": "fp32",
                      "graph_optimization": {"level": "disabled"}},
                     {"name": "ort-int8", "backend": "onnxruntime", "precision": "int8",
                      "graph_optimization": {"level": "disabled"},
                      "quantization": {"mode": "dynamic", "per_channel": True}}],
        "gates": gates,
        "analysis": {"discovery": {"enabled": False}},
        "benchmark": {"batch_sizes": [4], "warmup": 1, "iterations": iterations, "max_seconds": 1.0},
        "promotion": {"alias": "production"},
    }
    path = root / f"spec-{len(list(root.glob('spec-*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


GATE_FIRST = [{"metric": "top1_agreement", "min": 0.05}]  # both pass (and are timed)


def new_home(root: Path, name: str) -> dict:
    """A fresh $TAILGUARD_HOME under `root` with the planted MLP registered (a subprocess, so this process's
    MLflow settings stay untouched)."""
    home = root / name
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("TAILGUARD_", "MLFLOW_TRACKING",
                                                                      "MLFLOW_REGISTRY"))},
           "TAILGUARD_HOME": str(home)}
    code = ("import sys\nfrom tailguard.core.home import default_tracking_uri\n"
            "from tailguard.core.tracking import configure\nfrom tailguard.registration import register_reference\n"
            "configure(default_tracking_uri(), 'registration')\n"
            "register_reference(sys.argv[1], onnx_path=sys.argv[2])\n")
    subprocess.run([sys.executable, "-c", code, NAME, str(root / "planted.onnx")], env=env, check=True,
                   capture_output=True, timeout=300)
    return {"root": root, "home": home, "env": env, "uri": f"sqlite:///{home / 'mlflow.db'}"}


def run(h: dict, spec: Path) -> tuple[subprocess.CompletedProcess, dict]:
    """`tailguard run spec` in home `h`: the process and the run's summary.json (the newest run folder)."""
    before = set((h["home"] / "runs").glob("*")) if (h["home"] / "runs").exists() else set()
    proc = subprocess.run([sys.executable, "-m", "tailguard.cli", "run", str(spec)], env=h["env"],
                          capture_output=True, text=True, timeout=900, cwd=h["root"])
    new = sorted(set((h["home"] / "runs").glob("*")) - before, key=lambda p: p.stat().st_mtime)
    summary = new[-1] / "summary.json" if new else None
    assert summary is not None and summary.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, {**json.loads(summary.read_text()), "pipeline_run": new[-1].name}


def outcome(summary: dict) -> dict:
    """What a run decided, per variant: status, gates, passed, rows used; and the promotion."""
    return {"variants": {v["variant"]: (v["status"], v["gates"], v["passed"], v["rows_used"])
                         for v in summary["variants"]},
            "promoted": summary["promoted_variant"], "promotion": summary["promotion"]}


def task_names(summary: dict) -> list[str]:
    return [t["task"] for t in summary["tasks"]["tasks"]]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A home whose first run (`top1_agreement >= 0.05`) ran the whole pipeline."""
    root = tmp_path_factory.mktemp("redecide")
    mlp_rows(400, 0).to_parquet(root / "validation.parquet")
    mlp_rows(32, 1).to_parquet(root / "calibration.parquet")
    planted_mlp(root / "planted.onnx")
    h = new_home(root, "home")
    proc, summary = run(h, write_spec(root, gates=GATE_FIRST))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {**h, "first": summary}


def test_run_redecides_in_one_task_with_a_full_runs_statuses_and_promotion_when_only_a_gate_changed(base):
    first = base["first"]
    assert first["tasks"]["redecide"]["used"] is False and "validate-ort-int8" in task_names(first)
    assert outcome(first)["variants"]["ort-int8"][2] is True
    gates = [{"metric": "top1_agreement", "min": 0.9}]  # the planted MatMul: INT8 fails now, a verdict changes
    spec = write_spec(base["root"], gates=gates)
    proc, again = run(base, spec)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert again["tasks"]["redecide"]["used"] is True, again["tasks"]["redecide"]
    assert task_names(again) == ["redecide"]
    assert again["tasks"]["tasks"][0]["hosted"] is False  # one task: no task host is started for it
    assert all(t["hosted"] for t in first["tasks"]["tasks"])  # the whole pipeline's bodies ran in the host
    client = mlflow.MlflowClient(base["uri"], base["uri"])
    parent = client.get_run(again["parent_run_id"])
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["tailguard.redecided_from"] == again["tasks"]["redecide"]["from_run"]
    kids = {r.data.tags["tailguard.variant"]: r for r in client.search_runs(
        [parent.info.experiment_id], f"tags.mlflow.parentRunId = '{again['parent_run_id']}'")}
    assert set(kids) == {"ort-fp32", "ort-int8"}
    for name, r in kids.items():  # logged as the validate step logs a variant: gate tags, metrics, the result
        verdict = "passed" if name == "ort-fp32" else "failed"
        assert r.data.tags["tailguard.gates"] == verdict, name
        assert [v for k, v in r.data.tags.items() if k.startswith("gate.")] == [verdict], r.data.tags
        assert "top1_agreement" in r.data.metrics and r.data.tags["tailguard.model_uri"]
        files = {a.path for a in client.list_artifacts(r.info.run_id)}
        assert {"variant_result.json", "result.json", "slices.csv", "build.json"} <= files
    fresh = new_home(base["root"], "home-fresh")
    proc, full = run(fresh, spec)
    assert proc.returncode == 0 and task_names(full)[0] == "check-data"
    assert outcome(again)["variants"] == outcome(full)["variants"]
    assert outcome(again)["promoted"] == outcome(full)["promoted"] == "ort-fp32"


def test_run_runs_the_whole_pipeline_when_the_benchmark_section_changed(base):
    spec = write_spec(base["root"], gates=[{"metric": "top1_agreement", "min": 0.8}], iterations=4)
    proc, summary = run(base, spec)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert summary["tasks"]["redecide"]["used"] is False
    assert "redecide" not in task_names(summary) and "validate-ort-fp32" in task_names(summary)
    assert "differs from this one only in gates or promotion" in summary["tasks"]["redecide"]["reason"]


def test_run_falls_back_to_the_whole_pipeline_and_scores_more_rows_when_a_new_gate_needs_rows_never_scored(base):
    # 200 agreeing rows bound top1_agreement below 0.995 only at 0.97 or so: undecided, while 200 rows remain
    spec = write_spec(base["root"], gates=[{"metric": "top1_agreement", "min": 0.995}])
    proc, summary = run(base, spec)
    assert proc.returncode in (0, 3), proc.stdout[-3000:] + proc.stderr[-3000:]
    decided = summary["tasks"]["redecide"]
    assert decided["used"] is False and "did not measure" in decided["reason"], decided
    assert "not decided on the stored measurements" in proc.stderr
    names = task_names(summary)
    assert names[0] == "redecide" and "validate-ort-fp32" in names  # tried, then the whole pipeline
    rows = {v["variant"]: v["rows_used"] for v in summary["variants"]}
    assert rows["ort-fp32"] > 200  # it scored the rows the earlier run never scored
    client = mlflow.MlflowClient(base["uri"], base["uri"])
    parents = client.search_runs([client.get_run(summary["parent_run_id"]).info.experiment_id],
                                 f"tags.`tailguard.pipeline_run` = '{summary['pipeline_run']}'")
    # the attempt logged nothing: one parent run, the whole pipeline's, finished
    assert [(p.info.run_id, p.info.status) for p in parents] == [(summary["parent_run_id"], "FINISHED")]


def test_run_never_decides_on_a_tampered_measurement_and_runs_the_whole_pipeline_when_its_digest_differs(base):
    """Issue 36 item 6: rolling ort-fp32's stored outputs made a gate-only re-run score it at agreement 0 and move
    the alias to the INT8 variant. Now the entry's digest no longer matches: the re-run says so, measures again and
    decides what an honest run decides."""
    import numpy as np

    tampered = 0
    for entry in (base["home"] / "cache" / "entries").glob("*/entry.json"):
        if json.loads(entry.read_text()).get("label") == "measurements ort-fp32":
            npz = entry.parent / "files" / "measurements.npz"
            with np.load(npz) as z:
                arrays = {k: z[k] for k in z.files}
            arrays["outputs"] = np.roll(arrays["outputs"], 1, axis=0)
            np.savez(npz, **arrays)
            tampered += 1
    assert tampered >= 1
    spec = write_spec(base["root"], gates=[{"metric": "top1_agreement", "min": 0.9}])  # a gate-only change
    proc, summary = run(base, spec)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    decided = summary["tasks"]["redecide"]
    assert decided["used"] is False and "do not match the digest" in decided["reason"], decided
    assert "validate-ort-fp32" in task_names(summary)  # the whole pipeline ran
    fp32 = next(v for v in summary["variants"] if v["variant"] == "ort-fp32")
    assert fp32["passed"] is True and summary["promoted_variant"] == "ort-fp32"
    client = mlflow.MlflowClient(base["uri"], base["uri"])
    assert client.get_model_version_by_alias(f"{NAME}-optimized", "production").tags["tailguard.variant"] == "ort-fp32"
