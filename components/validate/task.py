"""Task glue of the validate component: run the variant, compute parity/latency/gates, log the nested run."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from tailguard.core.taskio import task_entry, write_json

# Tag names and key formats: tailguard.core.contract (re-exported here for existing imports).
from tailguard.core.contract import (COVERAGE_TAG, DISCOVERED_TAG, GATE_NAME_PREFIX, GATES_TAG,  # noqa: F401
                                     MODEL_URI_TAG, STATUS_TAG, VARIANT_TAG, WORST_SLICE_TAG, gate_name_tag,
                                     gate_tag)


def discovered_summary(records: list[dict[str, Any]], top: int = 3) -> list[dict[str, Any]]:
    """The `top` worst significant discovered slices (discovery table records, worst first) as
    {slice, value, support, metric, value_in_slice, value_rest, q_value}: the `tailguard.discovered` tag."""
    keys = ("slice", "value", "support", "metric", "value_in_slice", "value_rest", "q_value")
    return [{k: r.get(k) for k in keys} for r in records if bool(r.get("significant"))][:top]


def flat_params(variant: Any) -> dict[str, str]:
    """The variant's spec as flat MLflow params (quantization.mode=static, ...)."""
    out: dict[str, str] = {}

    def walk(prefix: str, obj: Any) -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        else:
            out[prefix] = json.dumps(obj) if isinstance(obj, list) else str(obj)

    walk("", variant.model_dump(mode="json"))
    return {k: v[:6000] for k, v in out.items()}


def _sha256(path: Path) -> str:
    """sha256 of a file, hex (tailguard.core.cache.file_sha256)."""
    from tailguard.core.cache import file_sha256

    return file_sha256(path)


def parse_baselines(baselines_json: str) -> dict[str, Any]:
    """Baselines JSON with batch-size keys turned back into ints."""
    raw = json.loads(baselines_json) if baselines_json else {}
    fix = lambda d: {int(k): v for k, v in d.items()} if d else None  # noqa: E731
    return {"torch": fix(raw.get("torch")), "onnx_fp32": fix(raw.get("onnx_fp32")), "rows": raw.get("rows")}


@task_entry("validate")
def main(*, spec_yaml: str, variant_name: str, build_json: str, baselines_json: str, parent_run_id: str,
         tracking_uri: str, variant_dir: str, reference_dir: str, metrics: Any = None,
         report_path: str | None = None, reference_model_dir: str | None = None) -> str:
    """Validate one built variant and log its nested MLflow run (also for skipped/failed builds).

    With `reference_model_dir` (the export step's folder holding the FP32 reference model.onnx) the FP32
    ONNX Runtime reference is timed in this process, interleaved with the variant in rounds on the same
    batches (`latency.interleaved_benchmark`): speedup_vs_onnx_fp32 is then the ratio of medians of those
    paired rounds, with bounds speedup_vs_onnx_fp32.lb95 / .ub95 (paired bootstrap, `latency.speed_ratio`),
    and a speedup gate with `confidence` is decided on its bound. Without it the ratio compares the
    reference-pass timing (another process, another time) and has no bound. torch eager is timed in
    reference-pass only (speedup_vs_torch has no bound).

    Returns:
        JSON {variant, status, reason, passed, run_id, model_uri, overall, perf, gates, worst_slice}.
    """
    import mlflow

    from tailguard.core.contract import REFERENCE_FILE
    from tailguard.core.spec import spec_from_yaml
    from tailguard.core.tracking import closing_run, configure, experiment_name_for

    spec = spec_from_yaml(spec_yaml)
    variant = next(v for v in spec.variants if v.name == variant_name)
    build = json.loads(build_json)
    exp_id = configure(tracking_uri, experiment_name_for(spec))
    client = mlflow.MlflowClient()
    tags = {"mlflow.parentRunId": parent_run_id, VARIANT_TAG: variant.name,
            "tailguard.backend": variant.backend, "tailguard.precision": variant.precision,
            STATUS_TAG: build["status"], GATES_TAG: "not_evaluated"}
    run = client.create_run(exp_id, run_name=variant.name, tags=tags)
    run_id = run.info.run_id
    client.log_batch(run_id, params=[mlflow.entities.Param(k, v) for k, v in flat_params(variant).items()])
    summary: dict[str, Any] = {"variant": variant.name, "status": build["status"], "reason": build.get("reason", ""),
                               "passed": False, "run_id": run_id, "model_uri": None, "build": build}
    with closing_run(client, run_id):
        client.log_dict(run_id, build, "build.json")
        log_coverage(client, run_id, build)
        if build["status"] != "ok":
            client.set_tag(run_id, "tailguard.reason", build.get("reason", "")[:5000])
            return json.dumps(summary, default=str)
        summary.update(_validate(spec, variant, build, parse_baselines(baselines_json), Path(variant_dir),
                                 Path(reference_dir) / REFERENCE_FILE, run_id, client, metrics, report_path,
                                 reference_model_dir))
        return json.dumps(summary, default=str)


def reference_runners(spec: Any, reference_model_dir: str | Path | None) -> dict[str, Any] | None:
    """The baselines timed interleaved with a variant: {"onnx_fp32": OrtRunner of the FP32 reference ONNX}, on
    the CPU execution provider with the spec's threads as reference-pass times it; None without a folder.

    Raises:
        InputError: the folder has no model.onnx.
    """
    if not reference_model_dir:
        return None
    from tailguard.core.contract import ONNX_FILE
    from tailguard.core.runtime import OrtRunner

    return {"onnx_fp32": OrtRunner(Path(reference_model_dir) / ONNX_FILE,
                                   intra_op_num_threads=spec.benchmark.intra_op_num_threads)}


def _validate(spec: Any, variant: Any, build: dict, baselines: dict, variant_dir: Path, reference_file: Path,
              run_id: str, client: Any, metrics: Any, report_path: str | None,
              reference_model_dir: str | None = None) -> dict[str, Any]:
    from tailguard.components.validate.logic import validate_variant
    from tailguard.core.data import load_validation
    from tailguard.core.runtime import OrtRunner

    model_file = variant_dir / build["artifact"]
    runner = OrtRunner(model_file, providers=[variant.execution_provider],
                       intra_op_num_threads=spec.benchmark.intra_op_num_threads)
    baseline_runners = reference_runners(spec, reference_model_dir)
    ds = load_validation(spec)
    work = Path(tempfile.mkdtemp(prefix=f"tailguard-validate-{variant.name}-"))
    try:
        result = validate_variant(spec, variant.name, runner, load_reference_outputs(spec, reference_file), ds,
                                  work, reference_perf=baselines["onnx_fp32"], torch_perf=baselines["torch"],
                                  model_path=model_file, baseline_runners=baseline_runners)
        if (variant_dir / "sensitivity").is_dir():  # analysis.sensitivity, written by the build step
            shutil.copytree(variant_dir / "sensitivity", work / "sensitivity")
        return log_validated_model(client, run_id, result, work_dir=work, model_file=model_file,
                                   execution_provider=variant.execution_provider, metrics=metrics,
                                   report_path=report_path)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def log_coverage(client: Any, run_id: str, build: dict[str, Any]) -> None:
    """An INT8 build's quantization coverage on the variant's run, as tag COVERAGE_TAG (one line, or the reason
    it could not be counted). The metric quantized_mac_fraction comes with the validation's metrics (read from
    the model file: `gates.build_metrics`). Nothing for builds without coverage (fp32, fp16, skipped)."""
    from tailguard.core.macs import coverage_line

    cov = (build.get("details") or {}).get("quantization_coverage")
    if isinstance(cov, dict):
        client.set_tag(run_id, COVERAGE_TAG, (f"not counted: {cov['error']}" if cov.get("error")
                                              else coverage_line(cov))[:5000])


def load_reference_outputs(spec: Any, reference_file: Path) -> list[np.ndarray]:
    """The FP32 reference outputs saved by reference-pass, in model.outputs order (each (rows, ...))."""
    with np.load(reference_file) as npz:
        return [npz[o.name] for o in spec.model.outputs]


def verdict(result: Any) -> tuple[bool, str]:
    """(passed, reason) of a ValidationResult: non-finite outputs fail whatever the gates say; a failed gate or
    one with insufficient data holds the variant back (reason 'failed gates: ...' and/or 'not promoted: gate X
    had insufficient data')."""
    from tailguard.components.validate.gates import insufficient_reason

    if result.non_finite_rows:
        return False, f"non-finite outputs in {result.non_finite_rows} validation rows"
    failed = [g.gate for g in result.gates if g.status == "failed"]
    insufficient = [g.gate for g in result.gates if g.status == "insufficient_data"]
    if not result.passed or failed or insufficient:
        # an insufficient-data gate was not judged: it never counts as passed (gates.all_passed)
        parts = (["failed gates: " + ", ".join(failed)] if failed else []) + \
            ([insufficient_reason(insufficient)] if insufficient else [])
        return False, "; ".join(parts) or "failed gates"
    return True, ""


def log_validation(client: Any, run_id: str, result: Any, *, metrics: Any = None) -> tuple[bool, str]:
    """Log a ValidationResult's verdict to run `run_id`: metrics, gate tags, worst slice, reason.

    Args:
        client: an MlflowClient.
        run_id: the run to log to (it may be finished already).
        result: the ValidationResult.
        metrics: a KFP Output[Metrics] that also gets the metrics other than slice.* (None: MLflow only).

    Returns:
        (passed, reason) as `verdict` gives them; tags tailguard.gates and tailguard.reason say the same.
    """
    import mlflow

    flat = result.mlflow_metrics()
    client.log_batch(run_id, metrics=[mlflow.entities.Metric(k, float(v), 0, 0) for k, v in flat.items()
                                      if v is not None and np.isfinite(v)])
    if metrics is not None:
        for k, v in flat.items():
            if v is not None and not k.startswith("slice.") and np.isfinite(v):
                metrics.log_metric(k, float(v))
    passed, reason = verdict(result)
    client.set_tag(run_id, GATES_TAG, "passed" if passed else "failed")
    for g in result.gates:
        client.set_tag(run_id, gate_tag(g.gate), g.status)
        client.set_tag(run_id, gate_name_tag(g.gate), g.gate)  # the canonical spelling, in the value
    if result.worst_slice:
        client.set_tag(run_id, WORST_SLICE_TAG, json.dumps(result.worst_slice, default=str))
    if result.discovery is not None:
        client.set_tag(run_id, DISCOVERED_TAG, json.dumps(discovered_summary(result.discovered), default=str))
    if reason:
        client.set_tag(run_id, "tailguard.reason", reason[:5000])
    return passed, reason


def log_validated_model(client: Any, run_id: str, result: Any, *, work_dir: Path, model_file: Path,
                        execution_provider: str, metrics: Any = None, report_path: str | None = None
                        ) -> dict[str, Any]:
    """Log a validated model to its run the way the register step reads it.

    Logs `log_validation`'s metrics and tags, every file of `work_dir` as an artifact (slices.csv, report.html,
    result.json, ...), the model's sha256 (tag tailguard.sha256) and the model itself (mlflow.onnx.log_model
    under "model", its URI in tag tailguard.model_uri). Used by the validate step and by the search step for
    the chosen trial.

    Args:
        client: an MlflowClient.
        run_id: the run (tags tailguard.variant, tailguard.status already set by the caller).
        result: the model's ValidationResult.
        work_dir: the folder validate_variant wrote into.
        model_file: the validated .onnx file.
        execution_provider: the ONNX Runtime EP the model is meant for (saved with the MLflow model).
        metrics: optional KFP Output[Metrics].
        report_path: optional path the report.html is copied to (a KFP Output[HTML]).

    Returns:
        {passed, reason, model_uri, overall, perf, gates, worst_slice} for the task's output JSON.
    """
    import mlflow
    import onnx

    passed, reason = log_validation(client, run_id, result, metrics=metrics)
    for f in sorted(Path(work_dir).iterdir()):
        if f.is_dir():
            client.log_artifacts(run_id, str(f), artifact_path=f.name)
        else:
            client.log_artifact(run_id, str(f))
    if report_path and (Path(work_dir) / "report.html").exists():
        Path(report_path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(Path(work_dir) / "report.html", report_path)
    client.set_tag(run_id, "tailguard.sha256", _sha256(Path(model_file)))
    with mlflow.start_run(run_id=run_id):
        info = mlflow.onnx.log_model(onnx_model=onnx.load(str(model_file)), name="model",
                                     save_as_external_data=False, onnx_execution_providers=[execution_provider])
    client.set_tag(run_id, MODEL_URI_TAG, info.model_uri)
    d = result.to_dict()
    write_json(Path(work_dir) / "result.json", d)
    return {"passed": passed, "reason": reason, "model_uri": info.model_uri,
            "overall": d.get("overall"), "perf": d.get("perf"), "gates": d.get("gates"),
            "worst_slice": d.get("worst_slice")}
