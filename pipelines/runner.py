"""Run a spec's pipeline: locally with kfp.local's SubprocessRunner (the embedded default), or on a cluster.

Local runs use MLflow at sqlite:///$TAILGUARD_HOME/mlflow.db (unless the spec names a tracking URI),
KFP artifacts under $TAILGUARD_HOME/kfp and a log per run under $TAILGUARD_HOME/runs/<run>/pipeline.log.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from tailguard.components.register.logic import RunSummary
from tailguard.components.validate.gates import insufficient_reason
from tailguard.errors import StepError, TailguardError, error_from_dict
from tailguard.home import ENV_HOME, home, quiet_environment
from tailguard.spec import Spec, dump_spec, load_spec
from tailguard.taskio import find_error_records
from tailguard.tracking import configure, experiment_name_for, tracking_uri_for

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_EXEC = re.compile(r"Executing task '?([\w\-]+)'?")
_DONE = re.compile(r"Task '?([\w\-]+)'? finished with status (\w+)")


@dataclass
class LocalRun:
    """Where a local run left things: its id, log, and the summary (None when it failed)."""

    pipeline_run: str
    log_path: Path
    summary: RunSummary | None


class _LogTee(io.TextIOBase):
    """sys.stdout replacement during a local run: every line to the log file, task events to a callback."""

    def __init__(self, log: io.TextIOBase, on_event: Callable[[str, str], None] | None) -> None:
        self.log, self.on_event, self.buf = log, on_event, ""

    def write(self, s: str) -> int:
        self.log.write(s)
        self.buf += s
        while "\n" in self.buf:
            line, self.buf = self.buf.split("\n", 1)
            plain = _ANSI.sub("", line)
            if self.on_event:
                if m := _EXEC.search(plain):
                    self.on_event(m.group(1), "running")
                elif m := _DONE.search(plain):
                    self.on_event(m.group(1), m.group(2).lower())
        return len(s)

    def flush(self) -> None:
        self.log.flush()


@contextlib.contextmanager
def _redirect(log_path: Path, on_event: Callable[[str, str], None] | None) -> Iterator[None]:
    import logging

    with open(log_path, "a", buffering=1) as log:
        tee = _LogTee(log, on_event)
        old_out, old_err = sys.stdout, sys.stderr
        sys.stdout = sys.stderr = tee  # type: ignore[assignment]
        root_handlers = logging.getLogger().handlers[:]
        try:
            yield
        finally:
            sys.stdout, sys.stderr = old_out, old_err
            logging.getLogger().handlers[:] = root_handlers


def task_count(spec: Spec) -> int:
    """Number of tasks in the spec's pipeline: 4 fixed + 2 per variant + 1 per variant with a search +
    register-and-promote."""
    return 5 + 2 * len(spec.variants) + sum(v.search is not None for v in spec.variants)


def run_local(spec: Spec, *, model_version: str | None = None,
              on_event: Callable[[str, str], None] | None = None) -> LocalRun:
    """Run the pipeline with kfp.local (SubprocessRunner, use_venv=False) and return its summary.

    Args:
        spec: a validated spec (data URIs absolute).
        model_version: overrides spec.model.version ("latest", a number, "@alias").
        on_event: called with (task name, "running" | "success" | "failure") as tasks start and end.

    Raises:
        TailguardError: the first error a task reported (its own exit code: 2 bad input, 1 runtime),
            or StepError naming the log when a task failed without a report. The parent MLflow run is
            marked FAILED and no alias moves.
    """
    quiet_environment()
    os.environ[ENV_HOME] = str(home())
    from kfp import local

    uri = tracking_uri_for(spec)
    configure(uri, experiment_name_for(spec))
    pipeline_run = uuid.uuid4().hex[:12]
    run_dir = home() / "runs" / pipeline_run
    run_dir.mkdir(parents=True, exist_ok=True)
    log_path = run_dir / "pipeline.log"
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(home() / "kfp"),
               raise_on_error=True)
    from tailguard.builder import build_pipeline

    pipeline = build_pipeline(spec, cluster=False)
    try:
        with warnings.catch_warnings(), _redirect(log_path, on_event):
            warnings.simplefilter("ignore")
            task = pipeline(spec_yaml=dump_spec(spec), tracking_uri=uri, model_version=model_version or "",
                            pipeline_run=pipeline_run)
    except Exception as exc:
        _mark_failed(spec, uri, pipeline_run)
        records = find_error_records(log_path.read_text(errors="replace"))
        if records:
            err = error_from_dict(records[0])
            err.message += f"\n  (log: {log_path})"
            raise err from None
        if isinstance(exc, TailguardError):
            raise
        raise StepError(f"the local pipeline failed: {exc}", step="pipeline", log_path=str(log_path)) from None
    summary = RunSummary.from_dict(json.loads(task.output))
    (run_dir / "summary.json").write_text(json.dumps(summary.to_dict(), indent=2))
    return LocalRun(pipeline_run, log_path, summary)


def _mark_failed(spec: Spec, uri: str, pipeline_run: str) -> None:
    """Mark the parent run of `pipeline_run` (and its still-running children) FAILED, if it was created."""
    import mlflow

    try:
        mlflow.set_tracking_uri(uri)
        client = mlflow.MlflowClient()
        exp = client.get_experiment_by_name(experiment_name_for(spec))
        if exp is None:
            return
        for run in client.search_runs([exp.experiment_id],
                                      filter_string=f"tags.`tailguard.pipeline_run` = '{pipeline_run}'"):
            client.set_tag(run.info.run_id, "tailguard.outcome", "failed")
            client.set_terminated(run.info.run_id, "FAILED")
            for child in client.search_runs([exp.experiment_id],
                                            filter_string=f"tags.mlflow.parentRunId = '{run.info.run_id}'"):
                if child.info.status == "RUNNING":
                    client.set_terminated(child.info.run_id, "FAILED")
    except Exception:  # best effort: never hide the task's own error behind a bookkeeping failure
        pass


def launch_run(spec_path: str, model_name: str, version: str) -> str:
    """Start a run for a new model version without waiting (used by the webhook trigger).

    With `kubeflow`-host configuration in $TAILGUARD_KFP_HOST the run is submitted to that KFP cluster;
    otherwise `tailguard run SPEC --model-version V` starts in a detached local process, logging to
    $TAILGUARD_HOME/runs/trigger-<id>.log.

    Returns:
        An id of the started run (KFP run id, or the local process' log name).

    Raises:
        SpecError: the spec is invalid. InputError: the spec's model is not `model_name`.
    """
    from tailguard.errors import InputError

    spec = load_spec(spec_path)
    if spec.model.registered_name != model_name:
        raise InputError(f"spec {spec_path} is for model {spec.model.registered_name!r}, not {model_name!r}")
    host = os.environ.get("TAILGUARD_KFP_HOST")
    if host:
        from tailguard.submit import submit

        return submit(spec, host=host, model_version=version)
    run_id = f"trigger-{uuid.uuid4().hex[:12]}"
    log = home() / "runs" / f"{run_id}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        subprocess.Popen([sys.executable, "-m", "tailguard.cli", "run", str(spec_path), "--model-version",
                          str(version)], stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                         start_new_session=True, env={**os.environ, ENV_HOME: str(home())})
    return run_id


def summary_rows(summary: RunSummary) -> list[dict[str, Any]]:
    """Rows of the end-of-run table: variant, status, speedups, p50/p99 ms, worst slice, discovered slices (the
    worst significant ones), gates, promoted."""
    rows = []
    for v in summary.variants:
        failed = [k for k, s in v.gates.items() if s == "failed"]
        insufficient = [k for k, s in v.gates.items() if s == "insufficient_data"]
        ws = v.worst_slice
        rows.append({
            "variant": v.variant, "status": v.status if v.status != "ok" else ("passed" if v.passed else "failed gates"),
            "x torch": v.speedup_vs_torch, "x onnx fp32": v.speedup_vs_onnx_fp32, "p50 ms": v.p50_ms,
            "p99 ms": v.p99_ms,
            "worst slice": f"{ws['slice']}={ws['value']}: {ws['observed']:.3f} (n={ws['support']})" if ws else "",
            "discovered": "; ".join(f"{d['slice']}={d['value']}: {d['value_in_slice']:.3f} vs {d['value_rest']:.3f} "
                                    f"(n={d['support']}, q={d['q_value']:.2g})" for d in (v.discovered or [])),
            "gates": (f"{len(v.gates) - len(failed)}/{len(v.gates)} passed" if v.gates else "-")
                     + (f"; failed: {', '.join(failed)}" if failed else "")
                     + (f"; {insufficient_reason(insufficient)}" if insufficient else "")
                     + (f"; {v.reason}" if v.status != "ok" and v.reason else ""),
            "promoted": f"{summary.alias} -> v{v.version}" if v.promoted else (f"v{v.version}" if v.version else ""),
        })
    return rows


def _excluded_nodes(record: dict[str, Any]) -> str:
    nodes = record.get("excluded_nodes")
    if isinstance(nodes, str):
        try:
            nodes = json.loads(nodes)
        except ValueError:
            return nodes
    if not nodes:
        return "-"
    nodes = [str(n) for n in nodes]
    return ", ".join(nodes) if len(nodes) <= 3 else f"{len(nodes)}: {', '.join(nodes[:3])}, ..."


def search_rows(search: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows of one search's Pareto table (from its search.json, `RunSummary.searches`), in trial order.

    Columns: trial, excluded nodes, per_channel, p50 ms, worst slice (the key parity metric of the worst slice
    group), passed, front (not dominated on lower p50 and higher worst-slice value among ok trials), chosen.
    """
    rows = []
    for t in search.get("trials") or []:
        status = t.get("status", "ok")
        rows.append({
            "trial": t.get("name", str(t.get("index", ""))),
            "excluded nodes": _excluded_nodes(t),
            "per_channel": t.get("per_channel", ""),
            "p50 ms": t.get("p50_ms"),
            "worst slice": t.get("worst_slice_value"),
            "passed": ("yes" if t.get("passed") else "no") if status == "ok" else status,
            "front": "*" if t.get("on_front") else "",
            "chosen": "<-" if t.get("chosen") else "",
        })
    return rows


def search_title(search: dict[str, Any]) -> str:
    """One line on a search: variant, trials run, the chosen trial (or none), why it stopped and the key parity
    metric of the worst-slice column."""
    trials = search.get("trials") or []
    n = len(trials)
    chosen = search.get("chosen_name") or "none passed every gate"
    metric = next((t["metric"] for t in trials if t.get("metric")), None)
    return (f"search {search.get('variant', '?')}: {n} trial{'s' if n != 1 else ''}, chosen {chosen}; "
            f"stopped by {search.get('stopped_by', '?')}" + (f" (worst slice: {metric})" if metric else ""))
