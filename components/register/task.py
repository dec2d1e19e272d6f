"""Task glue of the register-and-promote component."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tailguard.core.contract import (COVERAGE_CSV, COVERAGE_JSON, OUTCOME_TAG, PROMOTED_VARIANT_TAG,
                                     PROMOTED_VERSION_TAG, baseline_metrics)
from tailguard.core.results import PromotionStatus, RunOutcome
from tailguard.core.taskio import task_entry



def log_reference(client: Any, parent_run_id: str, baselines_json: str, reference_dir: str | None) -> None:
    """Log what reference-pass measured to the parent run: metrics
    `baseline.<torch|onnx_fp32>.bs<N>.latency_ms.<p50|p95|p99>` (ms, from its `baselines` JSON) and, when it wrote
    them (declared slices), the artifact calibration_coverage.csv and the metrics calibration.groups_missing /
    calibration.min_coverage_ratio (from calibration_coverage.json).

    Args:
        client: an `mlflow.MlflowClient`.
        parent_run_id: the pipeline run's parent MLflow run.
        baselines_json: reference-pass's output: {"torch": {batch size: perf} | null, "onnx_fp32": {...}, ...}.
        reference_dir: reference-pass's output folder, or None.
    """
    import time

    from mlflow.entities import Metric

    baselines = json.loads(baselines_json) if baselines_json else {}
    values = baseline_metrics(baselines)
    folder = Path(reference_dir) if reference_dir else None
    if folder is not None and (folder / COVERAGE_JSON).is_file():
        values.update({k: float(v) for k, v in json.loads((folder / COVERAGE_JSON).read_text()).items()})
    if folder is not None and (folder / COVERAGE_CSV).is_file():
        client.log_artifact(parent_run_id, str(folder / COVERAGE_CSV))
    now = int(time.time() * 1000)
    if values:
        client.log_batch(parent_run_id, metrics=[Metric(k, v, now, 0) for k, v in values.items()])


def baseline_notes(baselines_json: str) -> tuple[dict[str, Any], list[str]]:
    """The run summary's `hardware` and `warnings` from reference-pass's baselines JSON: the facts of the node the
    baselines were timed on (this node's `tailguard.core.hardware.node_facts()` when the JSON has none) and its
    warnings (an unstable torch baseline)."""
    from tailguard.core.hardware import node_facts

    baselines = json.loads(baselines_json) if baselines_json else {}
    return baselines.get("hardware") or node_facts(), [str(w) for w in baselines.get("warnings") or []]


def baseline_runners(spec: Any, fetched_json: str, model_dir: str, onnx_dir: str) -> dict[str, Any]:
    """The FP32 references the promotion's paired rounds time beside the passing variants (issue 37): {"torch":
    torch eager (`TorchRunner` of the fetched reference; absent for an ONNX reference), "onnx_fp32": the ONNX
    export (`runtime.timed_ort_runner`)}, each with the spec's threads, as reference-pass builds them.

    Args:
        spec: the Spec. fetched_json: fetch-reference's `resolved` JSON. model_dir: its artifact folder.
        onnx_dir: export's output folder (model.onnx).

    Raises:
        InputError: the ONNX file or the reference does not load (names the file).
    """
    from tailguard.core.contract import ONNX_FILE
    from tailguard.core.reference import load_resolved, load_torch_reference
    from tailguard.core.runtime import TorchRunner, timed_ort_runner

    threads = spec.benchmark.intra_op_num_threads
    out: dict[str, Any] = {}
    resolved = load_resolved(fetched_json, model_dir)
    if resolved.format != "onnx":
        out["torch"] = TorchRunner(load_torch_reference(resolved, spec.model), [i.name for i in spec.model.inputs],
                                   intra_op_num_threads=threads)
    out["onnx_fp32"] = timed_ort_runner(Path(onnx_dir) / ONNX_FILE, intra_op_num_threads=threads)
    return out


@task_entry("register-and-promote")
def main(*, spec_yaml: str, resolved_json: str, parent_run_id: str, tracking_uri: str, baselines_json: str = "",
         reference_dir: str | None = None, fetched_json: str = "", model_dir: str | None = None,
         onnx_dir: str | None = None) -> str:
    """Log the FP32 baselines and calibration coverage (`log_reference`), register the variants, promote the
    fastest passing one (torch eager and the ONNX export timed in the same paired rounds: `baseline_runners`), log
    summary.json and close the parent run.

    Args:
        baselines_json: reference-pass's output ("" = none logged).
        reference_dir: reference-pass's output folder (calibration_coverage.csv / .json), or None.
        fetched_json, model_dir: fetch-reference's `resolved` JSON and artifact folder ("" / None: no torch eager
            in the paired rounds).
        onnx_dir: export's output folder (None: no baselines in the paired rounds).

    Returns:
        The RunSummary as JSON. No passing variant is not an error here: the summary says so and the CLI
        exits 3; no alias moves.
    """
    import mlflow

    from tailguard.core.spec import spec_from_yaml
    from tailguard.core.tracking import configure

    spec = spec_from_yaml(spec_yaml)
    resolved = json.loads(resolved_json)
    configure(tracking_uri)
    baselines = None
    if onnx_dir and fetched_json and model_dir:
        baselines = lambda: baseline_runners(spec, fetched_json, model_dir, onnx_dir)  # noqa: E731
    return json.dumps(finish_run(mlflow.MlflowClient(), spec, parent_run_id=parent_run_id, resolved=resolved,
                                 baselines_json=baselines_json, reference_dir=reference_dir, baselines=baselines),
                      default=str)


def finish_run(client: Any, spec: Any, *, parent_run_id: str, resolved: dict[str, Any], baselines_json: str,
               reference_dir: str | None, baselines: Any = None) -> dict[str, Any]:
    """What register-and-promote does after reading its inputs, in this process (also the re-decide task's last
    step, components/redecide): `log_reference`, `logic.register_and_promote`, summary.json and the outcome tags
    on the parent run, which is closed FINISHED.

    Args:
        client: an MlflowClient on the run's tracking store.
        spec: the Spec. parent_run_id: the parent run. resolved: the resolved reference (its "version",
            "sha256"). baselines_json, reference_dir: as `main`'s.
        baselines: callable() -> the FP32 runners of the paired rounds (`baseline_runners`), or None.

    Returns:
        The RunSummary as a dict (`RunSummary.to_dict`).
    """
    from tailguard.components.register.logic import register_and_promote
    from tailguard.core.contract import ALIAS_VERSION_TAG, PROMOTION_TAG

    # before the registration: the report and summary read the baseline.* metrics from the parent run
    log_reference(client, parent_run_id, baselines_json, reference_dir)
    parent = client.get_run(parent_run_id)
    summary = register_and_promote(spec, parent_run_id=parent_run_id, experiment_id=parent.info.experiment_id,
                                   source_version=str(resolved["version"]), source_sha256=resolved.get("sha256"),
                                   baselines=baselines)
    summary.hardware, summary.warnings = baseline_notes(baselines_json)
    d = summary.to_dict()
    client.log_dict(parent_run_id, d, "summary.json")
    client.set_tag(parent_run_id, PROMOTED_VARIANT_TAG, summary.promoted_variant or "none")
    client.set_tag(parent_run_id, PROMOTED_VERSION_TAG, summary.promoted_version or "none")
    client.set_tag(parent_run_id, OUTCOME_TAG, RunOutcome.PROMOTED if summary.promoted_version else
                   RunOutcome.SUPERSEDED if summary.promotion == PromotionStatus.SUPERSEDED else
                   (RunOutcome.NO_PASSING_VARIANT if not summary.any_passed else RunOutcome.PROMOTION_DISABLED))
    if summary.promotion == PromotionStatus.NOT_PROMOTED:  # promoted / superseded: `promote` tagged the run
        client.set_tag(parent_run_id, PROMOTION_TAG, PromotionStatus.NOT_PROMOTED)
        client.set_tag(parent_run_id, ALIAS_VERSION_TAG, summary.alias_version or "none")
    client.set_terminated(parent_run_id, "FINISHED")
    return d
