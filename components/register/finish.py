"""What register-and-promote does once its inputs are read, in this process: log reference-pass's measurements to the
parent run, register and promote (`logic.register_and_promote`), write summary.json and the outcome tags, close the
parent run. Task.py's `main` calls it after reading the KFP inputs; the re-decide task (components/redecide) calls it
from here, not from register's task module."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tailguard.components.register.logic import register_and_promote
from tailguard.core.contract import (
    COVERAGE_CSV,
    COVERAGE_JSON,
    OUTCOME_TAG,
    PROMOTED_VARIANT_TAG,
    PROMOTED_VERSION_TAG,
    baseline_metrics,
)
from tailguard.core.results import PromotionStatus, RunOutcome


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
