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
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
import warnings
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

from tailguard.components.register.summary import RunSummary
from tailguard.core.cache import ENV_CACHE
from tailguard.core.contract import (
    PARENT_TAG,
    RUN_DIR_ENV,
    RUNNER_HOST_TAG,
    RUNNER_PID_TAG,
    RUNNER_STARTED_TAG,
    SOURCE_MODEL_TAG,
    SOURCE_SHA256_TAG,
    insufficient_reason,
)
from tailguard.core.errors import RunInterrupted, StepError, TailguardError, error_from_dict
from tailguard.core.home import ENV_HOME, home, quiet_environment
from tailguard.core.report import timing_cells
from tailguard.core.results import BuildStatus, GateStatus
from tailguard.core.spec import dump_spec, load_spec
from tailguard.core.spec.root import Spec
from tailguard.core.taskhost import PRELOAD as HOST_PRELOAD
from tailguard.core.taskhost import task_host
from tailguard.core.taskio import find_error_records
from tailguard.core.torch_load import MODEL_PATH_ENV
from tailguard.core.tracking import configure, experiment_name_for, tracking_uri_for
from tailguard.rerun import earlier_run, write_record

if TYPE_CHECKING:
    from tailguard.components.register.summary import VariantSummary

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
    """Number of tasks in the spec's pipeline: 5 fixed (check-data, resolve, fetch-reference, export,
    reference-pass) + 2 per variant (build, validate; with `serving_targets` 1 + one validate per target serving
    it) + 1 per variant with a search + register-and-promote."""
    validations = sum(len(spec.targets_for(v)) or 1 for v in spec.variants)
    return 6 + len(spec.variants) + validations + sum(v.search is not None for v in spec.variants)


def run_local(spec: Spec, *, model_version: str | None = None,
              on_event: Callable[[str, str], None] | None = None, cache: bool = True,
              model_path: Iterable[str | Path] = ()) -> LocalRun:
    """Run the pipeline with kfp.local (SubprocessRunner, use_venv=False) and return its summary.

    Args:
        spec: a validated spec (data URIs absolute).
        model_version: overrides spec.model.version ("latest", a number, "@alias").
        on_event: called with (task name, "running" | "success" | "failure") as tasks start and end.
        cache: serve the pure steps (export, builds, reference outputs) from $TAILGUARD_HOME/cache
            (tailguard.core.cache); False (`tailguard run --no-cache`) runs them all.
        model_path: folders the tasks import a state dict's model class from, after the installed packages
            (`tailguard run` passes --model-path and the spec's folder); set as $TAILGUARD_MODEL_PATH for the
            tasks during the run, ahead of any inherited value.

    Raises:
        TailguardError: the first error a task reported (its own exit code: 2 bad input, 1 runtime),
            or StepError naming the log when a task failed without a report. The parent MLflow run is
            marked FAILED with the error in its description (mlflow.note.content) and no alias moves.
        RunInterrupted: SIGINT / SIGTERM: the tasks are terminated, the parent run is marked FAILED with the
            signal in its description.

    Temporary files: the tasks run with TMPDIR=$TAILGUARD_HOME/runs/<run>/tmp (kfp.local's per-task
    `ephemeral_component.py` folders land there, and kfp's workspace too); the folder is removed when the run
    ends, passed, failed or interrupted, and TMPDIR is restored, so a local run leaves no temporary folder.

    The whole pipeline's task bodies run in children of a task host started for the run (tailguard.core.taskhost:
    one process imports the libraries once, each task's process hands its body to a fresh fork of it; Linux,
    unless $TAILGUARD_TASK_HOST is "0"; not for the one-task `redecide` pipeline); the host stops when the run
    ends, however it ends.

    Before it starts, RUNNING parent runs of the same model whose local runner died (kill -9) are marked FAILED
    (`reap_dead_runs`); this run's runner pid / host / start time go on its parent run for the same purpose.

    A gate-only re-run (with `cache`): when an earlier finished run in this home differs from this one only in
    `gates` and/or `promotion` (`tailguard.rerun.earlier_run`: same reference version and SHA-256, data bytes, code,
    node), a one-task pipeline (`pipeline.build_redecide_pipeline`, components/redecide) decides it on that run's
    stored measurements; when it cannot (it logged nothing), one line on stderr says why and the whole pipeline
    runs, in the same run folder and log. The summary's `tasks["redecide"]` says which: {"used": bool, "from_run":
    the earlier pipeline run (when one matched), "reason": why not ("" when used)}. Each finished run keeps its
    record for the next (`rerun.write_record`; the validate tasks keep their inputs under $TAILGUARD_RUN_DIR).
    """
    quiet_environment()
    os.environ[ENV_HOME] = str(home())
    os.environ[ENV_CACHE] = "1" if cache else "0"  # tasks inherit it (tailguard.core.cache.enabled)
    uri = tracking_uri_for(spec)
    configure(uri, experiment_name_for(spec))  # also creates a fresh local store's tables, under a file lock
    pipeline_run = uuid.uuid4().hex[:12]
    reap_dead_runs(spec, uri, by=pipeline_run)
    # Recorded on the parent run by resolve (tasks inherit the environment): who runs it, for reap_dead_runs.
    me = _this_process()
    os.environ.update({"TAILGUARD_RUNNER_PID": str(me.pid), "TAILGUARD_RUNNER_HOST": socket.gethostname(),
                       "TAILGUARD_RUNNER_STARTED": repr(me.create_time())})
    inherited_model_path = os.environ.get(MODEL_PATH_ENV)
    if model_path:  # tasks inherit it (tailguard.core.torch_load.add_model_path)
        os.environ[MODEL_PATH_ENV] = os.pathsep.join([str(Path(p).resolve()) for p in model_path]
                                                     + ([inherited_model_path] if inherited_model_path else []))
    run_dir = home() / "runs" / pipeline_run
    run_dir.mkdir(parents=True, exist_ok=True)
    log_path = run_dir / "pipeline.log"
    # kfp.local leaves a folder per task ($(mktemp -d)/ephemeral_component.py: kfp.dsl.component_factory) and one
    # per run (local.init's kfp-workspace-*): the tasks get TMPDIR, and kfp its workspace, in the run's own tmp
    # folder, which is removed when the run ends (whatever the outcome)
    tmp_dir = run_dir / "tmp"
    (tmp_dir / "kfp-workspace").mkdir(parents=True, exist_ok=True)
    inherited_tmpdir = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(tmp_dir)
    inherited_run_dir = os.environ.get(RUN_DIR_ENV)
    os.environ[RUN_DIR_ENV] = str(run_dir)  # validate tasks keep their inputs there (tailguard.rerun)
    # A gate-only change of an earlier finished run is decided in one task on its stored measurements
    try:
        earlier, why_not = earlier_run(spec, uri, model_version, home() / "runs") if cache else (None, "--no-cache")
    except Exception as exc:  # noqa: BLE001 - any doubt: the whole pipeline
        earlier, why_not = None, f"the earlier runs could not be compared ({type(exc).__name__}: {exc})"
    redecide: dict[str, Any] = {"used": False, "reason": why_not}
    received: list[str] = []

    def on_signal(signum: int, frame: Any) -> None:
        received.append(signal.Signals(signum).name)
        raise KeyboardInterrupt  # KeyboardInterrupt: subprocess.Popen.__exit__ does not wait for the task then

    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            previous[sig] = signal.signal(sig, on_signal)
        except ValueError:  # not the main thread: no handlers (the caller owns the signals)
            pass
    stack = contextlib.ExitStack()  # the task host, when the whole pipeline runs; closed in the `finally` below
    try:
        from kfp import local

        local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(home() / "kfp"),
                   workspace_root=str(tmp_dir / "kfp-workspace"), raise_on_error=True)
        from tailguard.components.redecide.task import FALLBACK_KEY
        from tailguard.pipeline import build_pipeline, build_redecide_pipeline

        output = None
        if earlier is not None:
            with warnings.catch_warnings(), _redirect(log_path, on_event):
                warnings.simplefilter("ignore")
                task = build_redecide_pipeline(spec)(spec_yaml=dump_spec(spec), tracking_uri=uri,
                                                     model_version=model_version or "", pipeline_run=pipeline_run,
                                                     earlier=json.dumps(earlier))
            answer = json.loads(task.output)
            if FALLBACK_KEY in answer:
                redecide = {"used": False, "from_run": earlier["pipeline_run"], "reason": answer[FALLBACK_KEY]}
                print(f"tailguard run: not decided on the stored measurements of run {earlier['pipeline_run']} "
                      f"({answer[FALLBACK_KEY]}): running the whole pipeline", file=sys.stderr)
            else:
                output = task.output
                redecide = {"used": True, "from_run": earlier["pipeline_run"], "reason": ""}
        if output is None:
            # The tasks' bodies fork from one warm interpreter (tailguard.core.taskhost); not for the one-task
            # `redecide` pipeline above, whose single task would only wait for the host's imports
            stack.enter_context(task_host(run_dir, preload=(*HOST_PRELOAD, *TASK_MODULES)))
            pipeline = build_pipeline(spec, cluster=False)
            with warnings.catch_warnings(), _redirect(log_path, on_event):
                warnings.simplefilter("ignore")
                output = pipeline(spec_yaml=dump_spec(spec), tracking_uri=uri, model_version=model_version or "",
                                  pipeline_run=pipeline_run).output
    except KeyboardInterrupt:
        for sig in previous:  # a second Ctrl-C must not cut the bookkeeping short
            signal.signal(sig, signal.SIG_IGN)
        _stop_children()
        name = received[0] if received else "SIGINT"
        note = (f"Interrupted by {name}: the local run (pipeline run {pipeline_run}) was stopped before it "
                f"finished; its tasks were terminated. Log: {log_path}")
        marked = _mark_failed(spec, uri, pipeline_run, note)
        raise RunInterrupted(f"interrupted by {name}: " + (f"parent run {', '.join(marked)} marked FAILED"
                                                           if marked else "no MLflow run had been created yet")
                             + f" (log: {log_path})") from None
    except Exception as exc:
        records = find_error_records(log_path.read_text(errors="replace")) if log_path.exists() else []
        if records:
            err = error_from_dict(records[0])
            err.message += f"\n  (log: {log_path})"
        elif isinstance(exc, TailguardError):
            err = exc
        else:
            err = StepError(f"the local pipeline failed: {exc}", step="pipeline", log_path=str(log_path))
        _mark_failed(spec, uri, pipeline_run, f"Failed: {err.message}")
        raise err from None
    finally:
        stack.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if model_path:
            _restore_env(MODEL_PATH_ENV, inherited_model_path)
        _restore_env("TMPDIR", inherited_tmpdir)
        _restore_env(RUN_DIR_ENV, inherited_run_dir)
        shutil.rmtree(tmp_dir, ignore_errors=True)
    summary = RunSummary.from_dict(json.loads(output))
    summary.tasks = {**task_timings(log_path.read_text(errors="replace")), "redecide": redecide}
    (run_dir / "summary.json").write_text(json.dumps(summary_document(summary), indent=2))
    if cache:  # without the cache no measurements were stored: nothing to decide on again
        write_record(run_dir, spec, uri, pipeline_run=pipeline_run, version=summary.source_version,
                     sha256=_source_sha256(uri, summary.parent_run_id))
    return LocalRun(pipeline_run, log_path, summary)


def _source_sha256(uri: str, parent_run_id: str) -> str | None:
    """The reference's SHA-256 that resolve recorded on the parent run (tag tailguard.source_sha256), or None."""
    try:
        import mlflow

        return mlflow.MlflowClient(tracking_uri=uri).get_run(parent_run_id).data.tags.get(SOURCE_SHA256_TAG) or None
    except Exception:  # noqa: BLE001 - best effort: without it the next run is a full one
        return None


# The task modules the task host imports after its libraries (tailguard.core.taskhost.PRELOAD), in pipeline order
TASK_MODULES = tuple(f"tailguard.components.{c}.task" for c in (
    "check_data", "resolve", "export", "build", "reference", "validate", "search", "register", "finalize"))


# ---------------------------------------------------------------------------------- per-task timings
_STAMP = re.compile(r"^(\d\d):(\d\d):(\d\d)\.(\d{3}) - ")
_TIMING_MARKER = "TAILGUARD_TASK_TIMING "  # tailguard.core.taskio.TIMING_MARKER


def _stamp_s(line: str) -> float | None:
    m = _STAMP.match(line)
    if not m:
        return None
    h, mi, sec, ms = map(int, m.groups())
    return h * 3600 + mi * 60 + sec + ms / 1000.0


def task_timings(log_text: str) -> dict[str, Any]:
    """Per-task timings of a local run from its pipeline.log (kfp.local runs the tasks one at a time).

    For each task: `wall_s` = its "finished with status" minus its "Executing task" log timestamp (kfp.local's own
    HH:MM:SS.mmm stamps, a midnight wrap handled); `body_s` and `imports_s` from the TAILGUARD_TASK_TIMING line
    the task body prints (tailguard.core.taskio.task_entry): seconds inside the task's main function, and the
    part of those inside its outermost import statements; `overhead_s` = wall_s - body_s: process start,
    interpreter and kfp executor start-up, the component module's imports, the executor's input/output files;
    `cached`: true / false for the steps served by the local cache (export, reference-pass, builds), None for
    the others; `hosted`: the body ran in a child of the run's task host (tailguard.core.taskhost), None without a
    timing line. `task` is the pipeline's task name (build-<variant>, as in the compiled IR: pipeline.named).

    Returns:
        {"tasks": [{task, variant, status, cached, hosted, wall_s, body_s, imports_s, overhead_s}, ...] in run order
         (variant: the build / validate / search task's variant, from its timing line; else None),
         "total_s": first task start to the pipeline's end (seconds; None without tasks),
         "startup_s": the sum of overhead_s + imports_s over the tasks with a timing line,
         "startup_share": startup_s / the sum of those tasks' wall_s (0..1; None when unknown)}.
        Seconds are rounded to 3 decimals; body_s is capped at wall_s (the two clocks differ by the log's
        millisecond stamps) and imports_s at body_s. A task without a timing line (it failed before its body ran) has
        body_s, imports_s and overhead_s None.
    """
    tasks: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None
    first = last = None
    offset, previous = 0.0, None
    for raw in log_text.splitlines():
        line = _ANSI.sub("", raw)
        t = _stamp_s(line)
        if t is not None:
            if previous is not None and t + offset < previous - 43200:  # past midnight
                offset += 86400.0
            t += offset
            previous = t
        if t is not None and (m := _EXEC.search(line)):
            current = {"task": m.group(1), "variant": None, "status": "running", "cached": None, "start": t,
                       "end": None, "body_s": None, "imports_s": None, "hosted": None}
            tasks.append(current)
            first = t if first is None else first
        elif t is not None and (m := _DONE.search(line)):
            for task in reversed(tasks):
                if task["task"] == m.group(1) and task["end"] is None:
                    task["end"], task["status"] = t, m.group(2).lower()
                    break
            last = t
        elif t is not None and "Pipeline" in line and "finished with status" in line:
            last = t
        elif current is not None and (i := line.find(_TIMING_MARKER)) >= 0:
            try:
                rec = json.loads(line[i + len(_TIMING_MARKER):])
            except ValueError:
                continue
            current.update(body_s=rec.get("body_s"), imports_s=rec.get("imports_s"), cached=rec.get("cached"),
                           variant=rec.get("variant"), hosted=rec.get("hosted"))
    rows, startup, timed_wall = [], 0.0, 0.0
    for task in tasks:
        wall = None if task["end"] is None else round(task["end"] - task["start"], 3)
        body = None if task["body_s"] is None else round(min(task["body_s"], wall if wall is not None else 1e18), 3)
        imports = None if task["imports_s"] is None else round(min(task["imports_s"], body or 0.0), 3)
        overhead = None if wall is None or body is None else round(wall - body, 3)
        if overhead is not None:
            startup += overhead + (imports or 0.0)
            timed_wall += wall
        rows.append({"task": task["task"], "variant": task["variant"], "status": task["status"],
                     "cached": task["cached"], "hosted": task["hosted"], "wall_s": wall,
                     "body_s": body, "imports_s": imports, "overhead_s": overhead})
    return {"tasks": rows, "total_s": None if first is None or last is None else round(last - first, 3),
            "startup_s": round(startup, 3) if timed_wall else None,
            "startup_share": round(startup / timed_wall, 3) if timed_wall else None}


def timings_line(timings: dict[str, Any] | None) -> str:
    """One line on a run's tasks (from `task_timings`), for the end of `tailguard run`'s summary, e.g.
    "tasks 42.7 s, start-up + imports 70%: check-data 0.9 s, export 0.5 s cached, build-ort-fp32 0.3 s cached, ...".
    Task names are the pipeline's (pipeline.named: build-<variant>, the same as in the compiled IR).
    Empty when there are no timings."""
    if not timings or not timings.get("tasks"):
        return ""
    parts = []
    for t in timings["tasks"]:
        wall = "?" if t.get("wall_s") is None else f"{t['wall_s']:.1f} s"
        state = " cached" if t.get("cached") else (" ran" if t.get("cached") is False else "")
        bad = f" {t['status']}" if t.get("status") not in ("success", None) else ""
        parts.append(f"{t['task']} {wall}{state}{bad}")
    total = timings.get("total_s")
    share = timings.get("startup_share")
    head = "tasks" + (f" {total:.1f} s" if total is not None else "") + (
        f", start-up + imports {share:.0%}" if share is not None else "")
    return f"{head}: " + ", ".join(parts)


def _restore_env(key: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(key, None)
    else:
        os.environ[key] = value


def _this_process() -> Any:
    import psutil

    return psutil.Process()


def _stop_children(timeout_s: float = 5.0) -> None:
    """Terminate the task processes this runner started (and theirs), then kill what is left after `timeout_s`."""
    import psutil

    try:
        children = _this_process().children(recursive=True)
    except psutil.Error:
        return
    for child in children:
        with contextlib.suppress(psutil.Error):
            child.terminate()
    _, alive = psutil.wait_procs(children, timeout=timeout_s)
    for child in alive:
        with contextlib.suppress(psutil.Error):
            child.kill()


def _fail_run(client: Any, experiment_id: str, run_id: str, note: str, failure: str) -> None:
    """Mark a parent run and its still-running children FAILED (tracking.fail_parent_run)."""
    from tailguard.core.tracking import fail_parent_run

    fail_parent_run(client, experiment_id, run_id, note, failure)


def _mark_failed(spec: Spec, uri: str, pipeline_run: str, note: str = "") -> list[str]:
    """Mark the parent run of `pipeline_run` (and its still-running children) FAILED, if it was created, with
    `note` (why) as its description. Returns the parent run ids marked."""
    import mlflow

    marked = []
    try:
        mlflow.set_tracking_uri(uri)
        client = mlflow.MlflowClient()
        exp = client.get_experiment_by_name(experiment_name_for(spec))
        if exp is None:
            return marked
        for run in client.search_runs([exp.experiment_id],
                                      filter_string=f"tags.`{PARENT_TAG}` = '{pipeline_run}'"):
            _fail_run(client, exp.experiment_id, run.info.run_id, note,
                      "interrupted" if note.startswith("Interrupted") else "error")
            marked.append(run.info.run_id)
    except Exception:  # best effort: never hide the task's own error behind a bookkeeping failure
        pass
    return marked


def _runner_alive(pid: str, started: str) -> bool:
    """Whether the process `pid` of this host is the runner that started at `started` (create time, seconds)."""
    import psutil

    try:
        proc = psutil.Process(int(pid))
        return abs(proc.create_time() - float(started)) < 1.0 and proc.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, ValueError):
        return False
    except psutil.Error:  # exists but unreadable (another user's process): assume alive
        return True


def reap_dead_runs(spec: Spec, uri: str, *, by: str = "") -> list[str]:
    """Mark FAILED the RUNNING parent runs of this spec's model whose local runner is gone (kill -9, a crash).

    Only runs started by a local runner of this host (tags tailguard.runner.host/pid/started, which resolve
    records from the runner's environment) are judged; runs on a cluster or another machine are left alone.
    A runner is gone when no process has its pid, or the process with that pid started at another time (pid
    reuse). Each marked run gets a note saying so. Returns the run ids marked; never raises.
    """
    import mlflow

    marked = []
    try:
        client = mlflow.MlflowClient(tracking_uri=uri)
        exp = client.get_experiment_by_name(experiment_name_for(spec))
        if exp is None:
            return marked
        host = socket.gethostname()
        runs = client.search_runs(
            [exp.experiment_id], max_results=1000,
            filter_string=(f"attributes.status = 'RUNNING' and tags.`{SOURCE_MODEL_TAG}` = "
                           f"'{spec.model.registered_name}' and tags.`{RUNNER_HOST_TAG}` = '{host}'"))
        for run in runs:
            tags = run.data.tags
            pid, started = tags.get(RUNNER_PID_TAG, ""), tags.get(RUNNER_STARTED_TAG, "")
            if not pid or _runner_alive(pid, started):
                continue
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(started))) if started else "?"
            note = (f"Marked FAILED by a later local run{f' (pipeline run {by})' if by else ''}: the local runner "
                    f"that started this run (pid {pid} on {host}, started {when}) died without closing it "
                    "(killed with SIGKILL / kill -9, crashed, or the machine restarted).")
            _fail_run(client, exp.experiment_id, run.info.run_id, note, "runner_died")
            marked.append(run.info.run_id)
    except Exception:  # best effort: a bookkeeping failure must not stop the new run
        pass
    return marked


def launch_run(spec_path: str, model_name: str, version: str, env: "dict[str, str] | None" = None) -> str:
    """Start a run for a new model version without waiting (used by the webhook trigger).

    With `kubeflow`-host configuration in $TAILGUARD_KFP_HOST the run is submitted to that KFP cluster;
    otherwise `tailguard run SPEC --model-version V` starts in a detached local process, logging to
    $TAILGUARD_HOME/runs/trigger-<id>.log, with the environment `env` (the trigger passes
    `tailguard.trigger.run_environment`: never the webhook secret) plus $TAILGUARD_HOME; None: this process's.

    Returns:
        An id of the started run (KFP run id, or the local process' log name).

    Raises:
        SpecError: the spec is invalid. InputError: the spec's model is not `model_name`.
    """
    from tailguard.core.errors import InputError

    spec = load_spec(spec_path)
    if spec.model.registered_name != model_name:
        raise InputError(f"spec {spec_path} is for model {spec.model.registered_name!r}, not {model_name!r}")
    host = os.environ.get("TAILGUARD_KFP_HOST")
    if host:
        from tailguard.submit import submit

        return submit(spec, host=host, model_version=version)
    # Create the store's tables and the experiment here, once, before detached runs race to do it.
    configure(tracking_uri_for(spec), experiment_name_for(spec))
    run_id = f"trigger-{uuid.uuid4().hex[:12]}"
    log = home() / "runs" / f"{run_id}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        subprocess.Popen([sys.executable, "-m", "tailguard.cli", "run", str(spec_path), "--model-version",
                          str(version)], stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                         start_new_session=True, env={**(os.environ if env is None else env), ENV_HOME: str(home())})
    return run_id


class GatesStatus(str, Enum):
    """A variant's gate verdict in the summary JSON (`gates_status`), apart from its build's status
    (`build_status`: ok | failed | skipped)."""

    PASSED = "passed"  # every gate that applies passed
    FAILED = "failed"  # at least one gate failed
    INSUFFICIENT_DATA = "insufficient_data"  # none failed, but one had too little data to decide: not promoted
    NOT_RUN = "not_run"  # the build or validation did not finish: no gate was judged


def gates_status(v: VariantSummary) -> GatesStatus:
    """The gate verdict of a VariantSummary (see `GatesStatus`); `passed` is the validate step's, never
    recomputed."""
    if v.status != BuildStatus.OK:
        return GatesStatus.NOT_RUN
    statuses = set((v.gates or {}).values())
    if GateStatus.FAILED in statuses:
        return GatesStatus.FAILED
    if GateStatus.INSUFFICIENT_DATA in statuses:
        return GatesStatus.INSUFFICIENT_DATA
    return GatesStatus.PASSED if v.passed else GatesStatus.FAILED


def summary_document(summary: RunSummary) -> dict[str, Any]:
    """The run summary as `tailguard run --summary-json` and $TAILGUARD_HOME/runs/<run>/summary.json write it:
    `RunSummary.to_dict()` with, per variant, `build_status` (ok | failed | skipped: the build and validation,
    the same as `status`) and `gates_status` (`GatesStatus`: passed | failed | insufficient_data | not_run) as
    separate fields, so a variant that built but failed its gates reads "build_status": "ok",
    "gates_status": "failed". `gates` stays the {gate key: status} map; `overall` holds the overall metrics."""
    doc = summary.to_dict()
    for row, v in zip(doc.get("variants") or [], summary.variants):
        row["build_status"] = v.status
        row["gates_status"] = gates_status(v).value
    return doc


# The overall "agreement" column: the task's top-1 agreement metric (classification, embedding, token_classification:
# per position), in this order.
AGREEMENT_METRICS = ("top1_agreement", "nn_top1_agreement", "token_top1_agreement")


def gate_ids(summary: RunSummary) -> dict[str, str]:
    """Short ids for the summary table's gates column, {gate key: "G1", ...}, in spec order (the union over the
    variants, first appearance first). Gate keys such as 'nn_top1_agreement>=0.97@lb95@per_slice:lexname' are
    longer than a table column; the table names them by id and a legend under it spells each key out whole."""
    ids: dict[str, str] = {}
    for v in summary.variants:
        for key in v.gates or {}:
            if key not in ids:
                ids[key] = f"G{len(ids) + 1}"
    return ids


def worst_slice_cell(v: VariantSummary) -> str:
    """The summary's "worst slice" cell: 'slice=value: observed (n=support)' only when the worst slice is not
    perfect (its value is worse than the metric's self-score, e.g. below 1 for an agreement; the catalogue's
    `self_score`) or a per-slice gate failed; "-" otherwise (a perfect variant has no worst slice, so none is
    named); "" when none was measured."""
    from tailguard.core.metrics import CATALOGUE

    ws = v.worst_slice
    if not ws:
        return ""
    metric = CATALOGUE.get(ws.get("metric", ""))
    observed = ws.get("observed")
    failed_slice_gate = any(s == GateStatus.FAILED and "@per_slice" in k for k, s in (v.gates or {}).items())
    perfect = (metric is not None and metric.self_score is not None and observed is not None
               and (observed >= metric.self_score if metric.direction == "higher" else observed <= metric.self_score))
    if perfect and not failed_slice_gate:
        return "-"
    return f"{ws['slice']}={ws['value']}: {observed:.3f} (n={ws['support']})"


def target_status(v: VariantSummary) -> str:
    """A variant's verdict per serving target, "avx512: passed, avx2: failed gates, arm: skipped" ("" without
    targets): passed | failed gates | the status (skipped: the node did not match the target's expect)."""
    def word(e: dict[str, Any]) -> str:
        return ("passed" if e.get("passed") else
                "failed gates" if e.get("status") == BuildStatus.OK else str(e.get("status")))

    return ", ".join(f"{t}: {word(e)}" for t, e in (getattr(v, "targets", None) or {}).items())


def summary_rows(summary: RunSummary) -> list[dict[str, Any]]:
    """Rows of the end-of-run table: variant, status, speedups, p50/p99 ms (text, `core.report.timing_cells`: from
    the promotion's paired rounds with bounds, else the task's figures marked "*"), agreement and accuracy (overall,
    from the variant's result; None when not measured), worst slice (`worst_slice_cell`), discovered slices (the worst
    significant ones), gates (failed ones by their `gate_ids` id), registered (the version registered, if any) and
    promoted (only the version the alias, or a per-target alias `<alias>-<target>`, was moved to by this run; "tied"
    added for a variant the paired rounds could not rank against the fastest). With
    serving targets, the status of a variant that did not pass everywhere names each target's verdict
    (`target_status`)."""
    ids = gate_ids(summary)
    rows = []
    for v in summary.variants:
        failed = [ids[k] for k, s in v.gates.items() if s == GateStatus.FAILED]
        insufficient = [ids[k] for k, s in v.gates.items() if s == GateStatus.INSUFFICIENT_DATA]
        undecided = [ids[k] for k, s in v.gates.items() if s == GateStatus.UNDECIDED]
        passed = sum(1 for s in v.gates.values() if s == GateStatus.PASSED)
        overall = v.overall or {}
        agreement = next((overall[m] for m in AGREEMENT_METRICS if overall.get(m) is not None), None)
        rows.append({
            "variant": v.variant, "status": v.status if v.status != BuildStatus.OK else (
                "passed" if v.passed else target_status(v) or "failed gates"),
            # one timing truth (issue 37): the paired rounds' figures, else the task's marked as such
            **timing_cells(getattr(v, "paired", None), p50_ms=v.p50_ms, p99_ms=v.p99_ms,
                           speedup_vs_torch=v.speedup_vs_torch, speedup_vs_onnx_fp32=v.speedup_vs_onnx_fp32),
            "agreement": agreement, "accuracy": overall.get("accuracy"),
            "worst slice": worst_slice_cell(v),
            "discovered": "; ".join(f"{d['slice']}={d['value']}: {d['value_in_slice']:.3f} vs {d['value_rest']:.3f} "
                                    f"(n={d['support']}, q={d['q_value']:.2g})" for d in (v.discovered or [])),
            # passed counts passed gates only (undecided, insufficient_data and not_applicable are not passed),
            # as summary.json and the report count them
            "gates": (f"{passed}/{len(v.gates)} passed" if v.gates else "-")
                     + (f"; failed: {', '.join(failed)}" if failed else "")
                     + (f"; undecided: {', '.join(undecided)}" if undecided else "")
                     + (f"; {insufficient_reason(insufficient)}" if insufficient else "")
                     + (f"; {v.reason}" if v.status != BuildStatus.OK and v.reason else ""),
            # registered: every version this run registered; promoted: only the one the alias moved to
            # ("reused v1 (same sha256)": an existing version holds this artefact; register.registration_policy)
            "registered": (v.registration_note if v.registration == "reused" else f"v{v.version}") if v.version
            else "",
            "promoted": " ".join(x for x in (", ".join(
                ([f"@{summary.alias} -> v{v.version}"] if v.promoted else [])
                + [f"@{a} -> v{v.version}" for a in getattr(v, "target_aliases", None) or []]),
                "tied" if (getattr(v, "paired", None) or {}).get("tied") else "") if x),
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
