"""`tailguard report RUN_ID|latest`: the parent run's report.html, rebuilt from the MLflow store.

The register step logs the same report (components/register/report.py `log_run_report`) when a run finishes; this
module rebuilds it for any parent run, also for one that failed before the register step (then the report shows
the run's error and the variant runs that were logged) or one logged before reports existed.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

from tailguard.core.contract import (
    BACKEND_TAG,
    FAILURE_MESSAGE_TAG,
    GATES_TAG,
    PARENT_TAG,
    PRECISION_TAG,
    REASON_TAG,
    SOURCE_MODEL_TAG,
    SOURCE_VERSION_TAG,
    STATUS_TAG,
    TRIAL_TAG,
    VARIANT_TAG,
    WORST_SLICE_TAG,
)
from tailguard.core.errors import InputError


def _client(tracking_uri: str | None) -> tuple[Any, str]:
    from tailguard.core.home import quiet_environment

    quiet_environment()  # before mlflow reads it: no artifact progress bars on the terminal
    import mlflow

    from tailguard.core.tracking import init_store, tracking_uri_for

    uri = tracking_uri or tracking_uri_for(None)
    init_store(uri)
    return mlflow.MlflowClient(tracking_uri=uri, registry_uri=uri), uri


def latest_parent_run(client: Any) -> Any:
    """The most recently started tailguard parent run (tag tailguard.pipeline_run) of any experiment.

    Raises:
        InputError: the store holds no tailguard run.
    """
    exps = [e.experiment_id for e in client.search_experiments(max_results=1000)]
    runs = client.search_runs(exps, filter_string=f"tags.`{PARENT_TAG}` != ''", max_results=1,
                              order_by=["attributes.start_time DESC"]) if exps else []
    if not runs:
        raise InputError("no tailguard run in this MLflow store", hint="run `tailguard run SPEC` first, or pass "
                         "--tracking-uri for the store that holds the run")
    return runs[0]


def parent_run(client: Any, run_ref: str) -> Any:
    """The parent run named by `run_ref`: 'latest', a parent run id, or a variant run id (its parent is used).

    Raises:
        InputError: no run with that id in the store (exit 2).
    """
    from mlflow.exceptions import MlflowException

    if run_ref == "latest":
        return latest_parent_run(client)
    try:
        run = client.get_run(run_ref)
    except MlflowException:
        raise InputError(f"no MLflow run {run_ref!r} in this store",
                         hint="pass a parent run id as `tailguard run` printed it, or `latest`; --tracking-uri "
                              "selects the store") from None
    parent_id = run.data.tags.get("mlflow.parentRunId")
    return client.get_run(parent_id) if parent_id else run


def _stored_summary(client: Any, run_id: str) -> dict[str, Any] | None:
    from mlflow.exceptions import MlflowException

    try:
        if "summary.json" not in {a.path for a in client.list_artifacts(run_id)}:
            return None
        with tempfile.TemporaryDirectory() as tmp:
            return json.loads(Path(client.download_artifacts(run_id, "summary.json", tmp)).read_text())
    except (MlflowException, OSError, ValueError):
        return None


def _worst_slice(text: str | None) -> dict[str, Any] | None:
    """The tailguard.worst_slice tag (a JSON object), or None when absent or not a JSON object."""
    try:
        doc = json.loads(text) if text else None
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def partial_summary(client: Any, parent: Any) -> dict[str, Any]:
    """A summary-shaped dict for a run without summary.json (it failed before the register step): one row per
    logged variant run, from its tags and metrics (latency at the first batch size it logged). Tag values are
    checked before use: a status outside results.BuildStatus becomes "failed" (the reason names it), a gate status
    outside report.CellStatus becomes "unknown", a worst-slice tag that is not a JSON object is ignored."""
    from tailguard.components.register.report import gate_statuses
    from tailguard.core.report import cell_status
    from tailguard.core.results import BuildStatus, GatesVerdict, PromotionStatus

    rows = []
    children = client.search_runs([parent.info.experiment_id], max_results=1000,
                                  filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'",
                                  order_by=["attributes.start_time ASC"])
    for c in children:
        tags, m = c.data.tags, c.data.metrics
        if VARIANT_TAG not in tags or tags.get(TRIAL_TAG):
            continue
        status, reason = tags.get(STATUS_TAG, BuildStatus.FAILED.value), tags.get(REASON_TAG, "")
        if status not in tuple(BuildStatus):  # checked before use: a tag is text anyone with write access can set
            status, reason = BuildStatus.FAILED.value, f"unknown status tag {status[:80]!r}; {reason}".rstrip("; ")
        gates = {k: cell_status(v).value for k, v in gate_statuses(tags).items()}
        rows.append({"variant": tags[VARIANT_TAG], "backend": tags.get(BACKEND_TAG),
                     "precision": tags.get(PRECISION_TAG), "status": status,
                     "reason": reason, "passed": tags.get(GATES_TAG) == GatesVerdict.PASSED,
                     "run_id": c.info.run_id, "version": None, "p50_ms": m.get("latency_ms.p50"),
                     "p99_ms": m.get("latency_ms.p99"), "speedup_vs_torch": m.get("speedup_vs_torch"),
                     "speedup_vs_onnx_fp32": m.get("speedup_vs_onnx_fp32"),
                     "quantized_mac_fraction": m.get("quantized_mac_fraction"),
                     "worst_slice": _worst_slice(tags.get(WORST_SLICE_TAG)), "gates": gates,
                     "promoted": False, "discovered": []})
    tags = parent.data.tags
    return {"parent_run_id": parent.info.run_id, "experiment_id": parent.info.experiment_id,
            "source_model": tags.get(SOURCE_MODEL_TAG), "source_version": tags.get(SOURCE_VERSION_TAG),
            "optimized_model": "", "alias": "", "promotion_enabled": False, "batch_size": None,
            "variants": rows, "searches": [], "promotion": PromotionStatus.NOT_PROMOTED.value}


def build_run_report(run_ref: str, *, tracking_uri: str | None = None,
                     ui_url: str | None = None) -> tuple[str, str]:
    """The report.html text of a parent run, from the store.

    Args:
        run_ref: 'latest', a parent run id, or a variant run id (its parent's report).
        tracking_uri: the store (default: $MLFLOW_TRACKING_URI, else the local store under $TAILGUARD_HOME).
        ui_url: MLflow UI base URL for the variant run links (default: the tracking server, or
            http://127.0.0.1:5000 for a local store).

    Returns:
        (html, parent run id).

    Raises:
        InputError: unknown run id, or no run in the store (exit 2).
    """
    from tailguard.components.register.report import report_inputs, run_report_html
    from tailguard.core.contract import NOTE_TAG

    client, uri = _client(tracking_uri)
    parent = parent_run(client, run_ref)
    summary = _stored_summary(client, parent.info.run_id)
    failed = summary is None or parent.info.status == "FAILED"
    if summary is None:
        summary = partial_summary(client, parent)
    tags = parent.data.tags
    run = {"run_id": parent.info.run_id, "experiment_id": parent.info.experiment_id, "status": parent.info.status,
           "name": parent.info.run_name, "note": tags.get(NOTE_TAG, ""),
           "error": tags.get(FAILURE_MESSAGE_TAG) or (tags.get(NOTE_TAG) if failed else None),
           "start": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(parent.info.start_time / 1000))}
    if failed and parent.info.status != "FAILED" and not run["error"]:
        run["error"] = f"the run is {parent.info.status} and has no summary yet (still running, or it died)"
    text = run_report_html(summary, run=run,
                           **report_inputs(client, summary, tracking_uri=uri, ui_url=ui_url))
    return text, parent.info.run_id


def write_run_report_file(run_ref: str, out: str | Path | None = None, *, tracking_uri: str | None = None,
                          ui_url: str | None = None) -> tuple[Path, str]:
    """Write `build_run_report` to `out` (default ./report-<parent run id>.html). Returns (path, parent run id)."""
    text, run_id = build_run_report(run_ref, tracking_uri=tracking_uri, ui_url=ui_url)
    path = Path(out) if out else Path(f"report-{run_id}.html")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path, run_id
