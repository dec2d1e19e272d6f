"""The torch backend end to end: `tailguard run` with torch variants beside an ONNX Runtime one (kfp.local, a real
SQLite MLflow store), then `tailguard fetch` of the registered torch variant and `tailguard monitor replay` with it
as the candidate; plus the spec's refusals of torch fields where they cannot apply.

The CUDA variant is skipped here with the reason (this machine has no GPU): that is the path a CPU node takes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest
import torch
import yaml

from tailguard.core.errors import SpecError
from tailguard.core.spec import parse_spec
from tests.integration.test_pipeline_local import make_rows, register_tiny_encoder, write_spec

pytestmark = [pytest.mark.integration, pytest.mark.slow]

VARIANTS = [
    {"name": "ort-fp32", "backend": "onnxruntime", "precision": "fp32"},
    {"name": "torch-eager-fp32", "backend": "torch", "precision": "fp32", "device": "cpu"},
    {"name": "torch-aoti-fp32", "backend": "torch", "precision": "fp32", "compile": "aot_inductor", "device": "cpu"},
    {"name": "torch-aoti-fp16", "backend": "torch", "precision": "fp16", "compile": "aot_inductor",
     "cuda_graphs": True},
]


def _write(root: Path) -> Path:
    return write_spec(root, variants=VARIANTS, slices=[{"name": "group", "column": "group"}],
                      gates=[{"metric": "nn_top1_agreement", "min": 0.5}],
                      promotion={"alias": "production", "register_variants": "all"},
                      # enough rounds for the promotion's paired comparison (DECISION_MIN_ROUNDS)
                      benchmark={"batch_sizes": [1], "warmup": 2, "iterations": 40, "max_seconds": 20},
                      monitoring={"slice_columns": ["group"], "sample_rate": 1.0})


def _spec_doc(tmp_path: Path) -> dict:
    return yaml.safe_load(_write(tmp_path).read_text())


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("torch-e2e")
    home = root / "home"
    make_rows(120, 0).to_parquet(root / "validation.parquet")
    make_rows(40, 1).to_parquet(root / "calibration.parquet")
    spec = _write(root)
    uri = register_tiny_encoder(home)
    env = {**os.environ, "TAILGUARD_HOME": str(home), "MLFLOW_DISABLE_TELEMETRY": "true"}

    def tailguard(*args: object) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "tailguard.cli", *map(str, args)], env=env, cwd=root,
                              capture_output=True, text=True, timeout=900)

    proc = tailguard("run", spec)
    return {"root": root, "uri": uri, "proc": proc, "tailguard": tailguard, "spec": spec}


def test_torch_variants_are_built_validated_and_registered_with_their_fingerprint_when_run_locally(run):
    proc = run["proc"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    client = mlflow.MlflowClient(run["uri"])
    versions = {v.tags["tailguard.variant"]: v for v in client.search_model_versions("name='tiny-encoder-optimized'")}
    # the CUDA variant was skipped, so not registered
    assert set(versions) == {"ort-fp32", "torch-eager-fp32", "torch-aoti-fp32"}
    eager = versions["torch-eager-fp32"]
    assert (eager.tags["tailguard.backend"], eager.tags["tailguard.compile"], eager.tags["tailguard.device"]) == \
        ("torch", "eager", "cpu")
    fingerprint = json.loads(eager.tags["tailguard.artifact_fingerprint"])
    assert fingerprint["torch_version"] == torch.__version__ and fingerprint["device"] == "cpu"
    assert "tailguard.execution_provider" not in eager.tags
    runs = {r.data.tags.get("tailguard.variant"): r for r in client.search_runs(
        [e.experiment_id for e in client.search_experiments()])}
    skipped = runs["torch-aoti-fp16"].data.tags
    assert skipped["tailguard.status"] == "skipped" and "no CUDA device on this node" in skipped["tailguard.reason"]
    assert runs["torch-eager-fp32"].data.metrics["nn_top1_agreement"] == 1.0


def test_promotion_times_an_aot_inductor_variant_this_run_built_when_it_passed_its_gates(run):
    """The promotion's paired rounds load every passing variant from this run's artefacts: an AOTInductor package
    (native code the build step compiled) is trusted as the validate step trusts it, not refused as untrusted code
    (issue 37: on a quiet machine the demo's CPU AOTInductor variant passed, was refused, and the promotion fell
    back to the most exact variant without timing any)."""
    proc = run["proc"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = max((run["root"] / "home" / "runs").glob("*/summary.json"), key=lambda p: p.stat().st_mtime)
    log = (summary.parent / "pipeline.log").read_text(errors="replace")
    assert "no paired promotion comparison" not in log, log[log.find("no paired promotion"):][:600]
    compared = json.loads(summary.read_text()).get("promotion_comparison") or {}
    assert "torch-aoti-fp32" in (compared.get("p50_ms") or {}), compared


def test_fetched_torch_variant_runs_as_the_monitors_candidate_when_replayed(run):
    out = run["root"] / "fetched"
    version = next(v.version for v in mlflow.MlflowClient(run["uri"]).search_model_versions(
        "name='tiny-encoder-optimized'") if v.tags["tailguard.variant"] == "torch-eager-fp32")
    fetched = run["tailguard"]("fetch", f"tiny-encoder-optimized/{version}", "-o", out)
    assert fetched.returncode == 0, fetched.stderr
    assert sorted(p.name for p in out.iterdir()) == ["program.pt2", "program.pt2.json"]
    requests = run["root"] / "validation.parquet"
    reference = next((run["root"] / "home").rglob("export/onnx_model/model.onnx"))
    replay = run["tailguard"]("monitor", "replay", "--spec", run["spec"], "--reference", reference,
                              "--candidate", out / "program.pt2", "--requests", requests, "--out", run["root"] / "r")
    assert replay.returncode == 0, replay.stdout[-2000:] + replay.stderr[-2000:]  # exact FP32: no alert
    slices = json.loads((run["root"] / "r" / "slices.json").read_text())
    assert slices, "the replay compared the torch candidate with the reference on the sampled rows"


@pytest.mark.parametrize("variant, message", [
    ({"backend": "torch", "precision": "int8"}, "precision int8 is not offered on backend torch"),
    ({"backend": "torch", "precision": "fp16", "device": "cpu"}, "fp16 on device cpu"),
    ({"backend": "torch", "precision": "fp32", "device": "cpu", "cuda_graphs": True}, "cuda_graphs needs device"),
    ({"backend": "onnxruntime", "precision": "bf16"}, "bf16 is offered on backend torch only"),
    ({"backend": "onnxruntime", "precision": "fp32", "compile": "inductor"}, "compile: it applies to backend torch"),
    ({"backend": "torch", "precision": "fp32", "execution_provider": "CUDAExecutionProvider"},
     "execution_provider: it applies to backend onnxruntime"),
])
def test_spec_refuses_torch_fields_naming_the_variant_when_they_cannot_apply(variant, message, tmp_path):
    doc = _spec_doc(tmp_path)
    doc["variants"] = [{"name": "v", **variant}]
    with pytest.raises(SpecError, match=message) as exc:
        parse_spec(doc)
    assert "variants" in str(exc.value)


def test_torch_variant_needs_the_gpu_pool_only_when_its_device_is_cuda(tmp_path):
    spec = parse_spec(_spec_doc(tmp_path))
    needs = {v.name: v.needs_gpu for v in spec.variants}
    assert needs == {"ort-fp32": False, "torch-eager-fp32": False, "torch-aoti-fp32": False, "torch-aoti-fp16": True}


def test_torch_builder_is_skipped_with_the_reason_when_the_reference_is_onnx(tmp_path):
    from tailguard.components.build.registry import get_builder

    spec = parse_spec(_spec_doc(tmp_path))
    variant = next(v for v in spec.variants if v.name == "torch-eager-fp32")
    result = get_builder("torch").build(variant, lambda: pytest.fail("nothing may be loaded"), tmp_path,
                                        calibration=None, model=spec.model, source_sha256="0" * 64,
                                        reference_format="onnx")
    assert result.status == "skipped" and "reference is an ONNX model" in result.reason


def test_torch_build_is_served_from_the_cache_when_rerun_with_a_gate_and_a_label_changed(run):
    doc = yaml.safe_load(run["spec"].read_text())
    doc["gates"] = [{"metric": "nn_top1_agreement", "min": 0.4}]
    # a label too: a change of gates alone is decided in one task (components/redecide), with no build task
    doc["metadata"]["labels"] = {"rerun": "whole-pipeline"}
    again = run["root"] / "spec-gate.yaml"
    again.write_text(yaml.safe_dump(doc, sort_keys=False))
    summary = run["root"] / "summary-gate.json"
    proc = run["tailguard"]("run", again, "--summary-json", summary)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    tasks = {t["task"]: t for t in json.loads(summary.read_text())["tasks"]["tasks"]}
    assert tasks["build-torch-eager-fp32"]["cached"] is True  # the exported program, not rebuilt
    assert tasks["build-torch-aoti-fp16"]["cached"] is False  # a skipped build is never cached
