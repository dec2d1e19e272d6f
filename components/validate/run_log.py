"""What a validated variant leaves on its MLflow run, the way the register step reads it: the run's tags and
params, the metrics and gate tags (`log_validation`), the model and the validation files (`log_validated_model`),
variant_result.json (`variant_result`), an INT8 build's coverage; and, in a local run, the record of what the
validation read (`write_validation_record`, for a gate-only re-run).

Used by the validate task, the search step (its chosen trial) and the gate-only re-run (components/redecide).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tailguard.core.contract import (
    ARTIFACT_FINGERPRINT_TAG,
    BACKEND_TAG,
    COVERAGE_TAG,
    DISCOVERED_TAG,
    FILES_SHA256_TAG,
    GATES_TAG,
    MODEL_URI_TAG,
    NUMERICS_TAG,
    PRECISION_TAG,
    REASON_TAG,
    SHA256_TAG,
    STATUS_TAG,
    VALIDATION_RESULT_FILE,
    VARIANT_RESULT_FILE,
    VARIANT_TAG,
    WORST_SLICE_TAG,
    gate_name_tag,
    gate_tag,
)
from tailguard.core.results import BuildStatus, GatesVerdict, VariantResult
from tailguard.core.taskio import write_json

if TYPE_CHECKING:
    from tailguard.core.spec.variants import VariantSpec

    from .result import ValidationResult


def discovered_summary(records: list[dict[str, Any]], top: int = 3) -> list[dict[str, Any]]:
    """The `top` worst significant discovered slices (discovery table records, worst first) as
    {slice, value, support, metric, value_in_slice, value_rest, q_value}: the `tailguard.discovered` tag."""
    keys = ("slice", "value", "support", "metric", "value_in_slice", "value_rest", "q_value")
    return [{k: r.get(k) for k in keys} for r in records if bool(r.get("significant"))][:top]


def flat_params(variant: VariantSpec) -> dict[str, str]:
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
    """sha256 of a file, hex (tailguard.core.digests.file_sha256)."""
    from tailguard.core.digests import file_sha256

    return file_sha256(path)


def variant_run_tags(variant: VariantSpec, build: dict[str, Any], parent_run_id: str,
                     hw_tags: dict[str, str]) -> dict[str, str]:
    """The tags a variant's run is created with: its parent run, name, backend, precision, the build's status,
    tailguard.gates `not_evaluated` (until the gates are decided) and `hw_tags` (`hardware.hardware_tags`: the node
    that validates and times the variant)."""
    return {"mlflow.parentRunId": parent_run_id, VARIANT_TAG: variant.name, BACKEND_TAG: variant.backend,
            PRECISION_TAG: variant.precision, STATUS_TAG: build["status"],
            GATES_TAG: GatesVerdict.NOT_EVALUATED.value, **hw_tags}


def write_validation_record(record: dict[str, Any]) -> None:
    """Under a local run ($TAILGUARD_RUN_DIR set by the runner), keep what this validation read and logged in
    `<run dir>/validations/<variant>[-on-<target>].json`: the build JSON, the baselines JSON, the folders of the
    variant's model, the reference outputs and the FP32 reference model, the variant's run id, status and model
    URI. A later run whose only change is in `gates` or `promotion` decides again on them (components/redecide).
    Nothing on a cluster; a write error is ignored (the later run then runs the whole pipeline)."""
    import os

    from tailguard.core.contract import RUN_DIR_ENV, VALIDATIONS_DIR

    run_dir = os.environ.get(RUN_DIR_ENV)
    if not run_dir:
        return
    name = record["variant"] + (f"-on-{record['target_name']}" if record.get("target_name") else "")
    try:
        folder = Path(run_dir) / VALIDATIONS_DIR
        folder.mkdir(parents=True, exist_ok=True)
        write_json(folder / f"{name}.json", record)
    except OSError:
        pass


def log_variant_result(client: Any, run_id: str, result: VariantResult) -> None:
    """Log `result` to run `run_id` as the artifact VARIANT_RESULT_FILE (JSON; inf/NaN as Python's json writes
    them). Written last for a validated candidate: its presence says the validation finished."""
    client.log_dict(run_id, result.to_dict(), VARIANT_RESULT_FILE)


def _log_failed_result(client: Any, run_id: str, identity: VariantResult, reason: str) -> None:
    """Best effort: a failed variant_result.json for a validation that raised (register treats a run without
    the file as failed anyway, so a store error here must not hide the original exception)."""
    import dataclasses

    try:
        log_variant_result(client, run_id, dataclasses.replace(identity, status=BuildStatus.FAILED, passed=False,
                                                               reason=reason[:5000]))
    except Exception:  # noqa: BLE001 - see the docstring
        pass


def coverage_line(cov: dict[str, Any]) -> str:
    """One line for logs and tags from an INT8 build's `quantization_coverage` details (the dict of
    components/quantize/macs.py `quantization_coverage`): '3/3 MAC nodes INT8, 100.0% of 3.39 kMACs per sample'."""
    frac = cov.get("quantized_mac_fraction")
    total = cov.get("macs_total") or 0
    size = next((f"{total / d:.3g} {u}" for d, u in ((1e9, "GMACs"), (1e6, "MMACs"), (1e3, "kMACs"))
                 if total >= d), f"{total} MACs")
    share = "no MACs counted" if frac is None else f"{frac * 100:.1f}% of {size} per sample"
    return f"{cov.get('quantized_mac_nodes', 0)}/{cov.get('quantizable_nodes', 0)} MAC nodes INT8, {share}"


def log_coverage(client: Any, run_id: str, build: dict[str, Any]) -> None:
    """An INT8 build's quantization coverage on the variant's run, as tag COVERAGE_TAG (one line, or the reason
    it could not be counted). The metric quantized_mac_fraction comes with the validation's metrics (read from
    the model file: `gates.build_metrics`). Nothing for builds without coverage (fp32, fp16, skipped)."""
    cov = (build.get("details") or {}).get("quantization_coverage")
    if isinstance(cov, dict):
        client.set_tag(run_id, COVERAGE_TAG, (f"not counted: {cov['error']}" if cov.get("error")
                                              else coverage_line(cov))[:5000])


def log_validation(client: Any, run_id: str, result: ValidationResult, *, metrics: Any = None,
                   model_id: str | None = None) -> tuple[bool, str]:
    """Log a ValidationResult's verdict to run `run_id`: metrics, gate tags, worst slice, reason.

    Args:
        client: an MlflowClient.
        run_id: the run to log to (it may be finished already).
        result: the ValidationResult.
        metrics: a KFP Output[Metrics] that also gets the metrics other than slice.* (None: MLflow only).
        model_id: the id of a LoggedModel already logged to this run: each metric is also linked to it (MLflow's
            `Metric.model_id`; the run gets the same metrics either way), in the one log_batch. None: the metrics
            are the run's only (MLflow links them to a model logged later itself, one query per metric).

    Returns:
        (passed, reason) as `gates.verdict` gives them; tags tailguard.gates and tailguard.reason say the same.
    """
    import mlflow

    flat = result.mlflow_metrics()
    client.log_batch(run_id, metrics=[mlflow.entities.Metric(k, float(v), 0, 0, model_id=model_id)
                                      for k, v in flat.items() if v is not None and np.isfinite(v)])
    if metrics is not None:
        for k, v in flat.items():
            if v is not None and not k.startswith("slice.") and np.isfinite(v):
                metrics.log_metric(k, float(v))
    from tailguard.components.validate.gates import verdict

    passed, reason = verdict(result)
    client.set_tag(run_id, GATES_TAG, GatesVerdict.PASSED if passed else GatesVerdict.FAILED)
    for g in result.gates:
        client.set_tag(run_id, gate_tag(g.gate), g.status)
        client.set_tag(run_id, gate_name_tag(g.gate), g.gate)  # the canonical spelling, in the value
    if result.worst_slice:
        client.set_tag(run_id, WORST_SLICE_TAG, json.dumps(result.worst_slice, default=str))
    if result.discovery is not None:
        client.set_tag(run_id, DISCOVERED_TAG, json.dumps(discovered_summary(result.discovered), default=str))
    if getattr(result, "numerics", None):  # consistent | hardware_dependent | not_checked (numerics.compare_numerics)
        client.set_tag(run_id, NUMERICS_TAG, str(result.numerics.get("status")))
    if reason:
        client.set_tag(run_id, REASON_TAG, reason[:5000])
    return passed, reason


def onnx_pip_requirements(execution_provider: str) -> list[str]:
    """The pip requirements saved with a logged ONNX variant: onnx and the ONNX Runtime distribution installed
    here, pinned (onnxruntime-gpu when it is installed or the execution provider is CUDA/TensorRT).

    Passing them to `mlflow.onnx.log_model` skips MLflow's requirement inference, which starts a subprocess
    that imports the flavor (seconds per logged model)."""
    from importlib import metadata

    import onnx

    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    gpu = version("onnxruntime-gpu")
    wants_gpu = execution_provider in ("CUDAExecutionProvider", "TensorrtExecutionProvider")
    ort = ("onnxruntime-gpu", gpu) if gpu or wants_gpu else ("onnxruntime", version("onnxruntime"))
    return [f"onnx=={onnx.__version__}", f"{ort[0]}=={ort[1]}" if ort[1] else ort[0]]


def log_validated_model(client: Any, run_id: str, result: ValidationResult, *, work_dir: Path, model_file: Path,
                        execution_provider: str, metrics: Any = None, report_path: str | None = None,
                        identity: VariantResult | None = None, onnx: bool = True,
                        model_uri: str | None = None) -> dict[str, Any]:
    """Log a validated model to its run the way the register step reads it.

    Logs, in this order: an ONNX model itself (mlflow.onnx.log_model under "model"; with `onnx` True and no
    `model_uri`), `log_validation`'s metrics and tags (the metrics linked to that model's LoggedModel in the same
    log_batch), result.json (`result.to_dict()`, written first so the logged copy is the final one), every file
    of `work_dir` as an artifact (slices.csv, report.html, result.json, ...), the model's sha256 (tag
    tailguard.sha256), a node-bound artefact (with `onnx` False), the model's URI (tag tailguard.model_uri) and,
    last, variant_result.json (`variant_result`: what register reads). Used by the validate step and by the
    search step for the chosen trial.

    The ONNX model goes first because MLflow 3's log_model links every step-0 metric already on the run to the
    new LoggedModel with one get_metric_history query per metric (`Model.log`): for the validation's hundreds of
    metrics, 0.7-1.2 s of each validate task (py-spy of `tailguard demo`, MLflow 3.17). Logged after it with the
    model's id, they end the same way (on the run and on the LoggedModel) in one log_batch; metrics logged on
    the run earlier are still copied by MLflow.

    Args:
        client: an MlflowClient.
        run_id: the run (tags tailguard.variant, tailguard.status already set by the caller).
        result: the model's ValidationResult.
        work_dir: the folder validate_variant wrote into.
        model_file: the validated .onnx file, or (with `onnx` False) a node-bound artefact with its manifest
            `<file>.json` beside it (a torch program.pt2 / package.pt2, a TensorRT plan).
        execution_provider: the ONNX Runtime EP the model is meant for (saved with the MLflow model).
        onnx: True: log with mlflow.onnx.log_model (an MLflow model); False: log the artefact and its manifest as
            the run's "model" folder (registered by the register step with create_model_version) and tag the
            artefact's fingerprint (ARTIFACT_FINGERPRINT_TAG) and the digest of the folder's files
            (FILES_SHA256_TAG).
        metrics: optional KFP Output[Metrics].
        report_path: optional path the report.html is copied to (a KFP Output[HTML]).
        identity: the candidate's name, backend, precision and search fields for variant_result.json (its
            verdict fields are filled here); None: named `result.variant`, backend and precision unknown ("").
        model_uri: the URI of this same model (same bytes: `model_file`) already logged by an earlier run: it is
            not logged again; the run's tailguard.model_uri and variant_result.json name that URI (a re-decided
            run, components/redecide). None: the model is logged to this run.

    Returns:
        {passed, reason, model_uri, overall, perf, gates, worst_slice} for the task's output JSON.
    """
    import mlflow

    logged_here = model_uri is None
    model_id = None
    if logged_here and onnx:  # before the metrics: see the docstring
        import onnx as onnx_lib

        with mlflow.start_run(run_id=run_id):
            # explicit requirements: without them MLflow infers them in a subprocess that imports the flavor
            # (measured 3.5 of the validate task's 9 s on the tiny MLP)
            info = mlflow.onnx.log_model(onnx_model=onnx_lib.load(str(model_file)), name="model",
                                         save_as_external_data=False,
                                         onnx_execution_providers=[execution_provider],
                                         pip_requirements=onnx_pip_requirements(execution_provider))
        model_uri, model_id = info.model_uri, info.model_id
    passed, reason = log_validation(client, run_id, result, metrics=metrics, model_id=model_id)
    d = result.to_dict()
    write_json(Path(work_dir) / VALIDATION_RESULT_FILE, d)  # before the upload below, so it is the one logged
    for f in sorted(Path(work_dir).iterdir()):
        if f.is_dir():
            client.log_artifacts(run_id, str(f), artifact_path=f.name)
        else:
            client.log_artifact(run_id, str(f))
    if report_path and (Path(work_dir) / "report.html").exists():
        Path(report_path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(Path(work_dir) / "report.html", report_path)
    sha = _sha256(Path(model_file))
    client.set_tag(run_id, SHA256_TAG, sha)
    if logged_here and not onnx:
        from tailguard.core.artifacts import manifest_path

        manifest = manifest_path(model_file)
        client.log_artifact(run_id, str(model_file), artifact_path="model")
        client.log_artifact(run_id, str(manifest), artifact_path="model")
        client.set_tag(run_id, ARTIFACT_FINGERPRINT_TAG,
                       json.dumps(json.loads(manifest.read_text()).get("fingerprint", {}), sort_keys=True)[:5000])
        from tailguard.core.digests import files_sha256

        # the folder as registered (`tailguard fetch` checks every file of it against this)
        client.set_tag(run_id, FILES_SHA256_TAG, files_sha256([Path(model_file), manifest], Path(model_file).parent))
        model_uri = f"runs:/{run_id}/model"
    client.set_tag(run_id, MODEL_URI_TAG, model_uri)
    identity = identity or VariantResult(variant=result.variant, backend="", precision="", status=BuildStatus.OK)
    log_variant_result(client, run_id, variant_result(identity, result, passed=passed, reason=reason,
                                                      run_id=run_id, model_uri=model_uri, sha256=sha))
    return {"passed": passed, "reason": reason, "model_uri": model_uri,
            "overall": d.get("overall"), "perf": d.get("perf"), "gates": d.get("gates"),
            "worst_slice": d.get("worst_slice")}


def variant_result(identity: VariantResult, result: ValidationResult, *, passed: bool, reason: str, run_id: str,
                   model_uri: str | None, sha256: str | None) -> VariantResult:
    """The VariantResult of a validated candidate: `identity`'s name, backend, precision and search fields, the
    verdict (`passed`, `reason`, as `gates.verdict` decided them), and from the ValidationResult `result` the scalar
    perf at each benchmark batch size (raw timings left out), the overall metrics, each gate's
    {gate, status, metric, observed, threshold}, the worst slice, the top discovered slices
    (`discovered_summary`), quantized_mac_fraction and the numerics check (`hardware_dependent`, `numerics`
    without the exact pass's full metrics and gates, which stay in result.json)."""
    import dataclasses
    import numbers

    def scalars(row: dict[str, Any]) -> dict[str, float]:
        return {k: float(v) for k, v in (row or {}).items()
                if isinstance(v, numbers.Real) and not isinstance(v, bool)}

    frac = result.overall.get("quantized_mac_fraction")
    num = getattr(result, "numerics", None) or None
    return dataclasses.replace(
        identity, status=BuildStatus.OK, passed=bool(passed), reason=reason, run_id=run_id, model_uri=model_uri,
        sha256=sha256, perf={int(bs): scalars(row) for bs, row in result.perf.items()},
        overall=scalars(result.overall),
        gates=[{"gate": g.gate, "status": g.status, "metric": g.metric, "observed": g.observed,
                "threshold": g.threshold} for g in result.gates],
        worst_slice=result.worst_slice,
        discovered=discovered_summary(result.discovered) if result.discovery is not None else [],
        quantized_mac_fraction=None if frac is None or np.isnan(float(frac)) else float(frac),
        hardware_dependent=None if num is None else num.get("hardware_dependent"),
        rows=int(result.rows), rows_used=None if getattr(result, "rows_used", None) is None else int(result.rows_used),
        numerics=None if num is None else {k: v for k, v in num.items() if k not in ("exact_overall", "exact_gates")})
