"""What every KFP task body shares: error reporting across the process boundary and JSON helpers.

A KFP task runs in its own process (a subprocess locally, a pod on a cluster). When a step raises a
`TailguardError`, `task_entry` prints one marker line `TAILGUARD_ERROR {json}` to stderr (visible in
the KFP UI's logs) and re-raises, so the task fails; the local runner scans the task logs for the
marker to give the user the original message and exit code instead of a traceback.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Any, Callable, TypeVar

from tailguard.core.errors import StepError, TailguardError, dumps_error

ERROR_MARKER = "TAILGUARD_ERROR "
TIMING_MARKER = "TAILGUARD_TASK_TIMING "  # one line per task body: see _timing_record
F = TypeVar("F", bound=Callable[..., Any])


def task_entry(step: str) -> Callable[[F], F]:
    """Decorator for a task's main function: report TailguardErrors with the marker line; wrap others in StepError.

    Every call also prints one `TAILGUARD_TASK_TIMING {json}` line to stdout when the body ends (returned or
    raised): the body's seconds, the seconds inside its import statements and whether its result came from the
    local cache (`_timing_record`); the local runner turns them into the run summary's per-task timings
    (`tailguard.runner.task_timings`).

    During a local run the body runs in a process forked from the run's task host, which has the task's
    libraries imported already (tailguard.core.taskhost): the markers and the timing line then come from that
    process, into the same log, and the task exits with its exit code."""

    def deco(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            from tailguard.core.taskhost import NOT_HOSTED, call_in_host

            hosted = call_in_host(wrapper, args, kwargs)  # a local run: the body runs in a child of the task host
            if hosted is not NOT_HOSTED:
                return hosted
            from tailguard.core.home import quiet_environment

            quiet_environment()
            clock = _ImportClock()
            ok, result = False, None
            try:
                with clock:
                    result = fn(*args, **kwargs)
                ok = True
                freeze_for_exit()
                return result
            except TailguardError as err:
                print(ERROR_MARKER + dumps_error(err), file=sys.stderr, flush=True)
                _record_on_parent(step, err, kwargs)
                raise
            except Exception as exc:  # an unexpected bug: keep the traceback in the log, report a StepError
                err = StepError(f"{type(exc).__name__}: {exc}", step=step, variant=kwargs.get("variant_name"))
                print(ERROR_MARKER + dumps_error(err), file=sys.stderr, flush=True)
                _record_on_parent(step, err, kwargs)
                raise
            finally:
                print(TIMING_MARKER + json.dumps(_timing_record(step, clock, ok, result, kwargs.get("variant_name"))),
                      flush=True)

        return wrapper  # type: ignore[return-value]

    return deco


def freeze_for_exit() -> None:
    """Move every object alive now into the garbage collector's permanent generation (`gc.freeze`).

    A task process ends soon after its body returns (the KFP executor writes its outputs and exits). At exit the
    interpreter's final collection traverses every tracked object; after mlflow, sqlalchemy and pandas are
    imported that took 0.7-0.8 s per process here (a create_run + exit script: wall 3.3 s, 2.6 s with
    `gc.freeze()` before exit, 3 runs each). Frozen objects are still freed by reference counting; only the
    cycle collector skips them, so nothing the task wrote is lost (files and MLflow writes are closed by then).
    Called by `task_entry` after a body returned; a failed body exits the normal way."""
    import gc

    gc.freeze()


# ------------------------------------------------------------------ task timings (the run summary's `tasks`)
class _ImportClock:
    """While entered: the task body's wall seconds (`body_s`) and the seconds spent inside its outermost `import`
    statements (`imports_s`: builtins.__import__ timed on the main thread, nested imports not counted twice,
    `importlib.import_module` not seen). The runner reads both from the TAILGUARD_TASK_TIMING line."""

    def __init__(self) -> None:
        self.body_s = self.imports_s = 0.0
        self._depth = 0

    def __enter__(self) -> "_ImportClock":
        import builtins
        import threading
        import time

        self._orig, self._main, self._t0 = builtins.__import__, threading.get_ident(), time.perf_counter()
        orig, main, get_ident, clock = self._orig, self._main, threading.get_ident, time.perf_counter

        def timed_import(*args: Any, **kwargs: Any) -> Any:
            if self._depth or get_ident() != main:
                return orig(*args, **kwargs)
            self._depth += 1
            t = clock()
            try:
                return orig(*args, **kwargs)
            finally:
                self.imports_s += clock() - t
                self._depth -= 1

        builtins.__import__ = timed_import
        return self

    def __exit__(self, *exc: Any) -> None:
        import builtins
        import time

        builtins.__import__ = self._orig
        self.body_s = time.perf_counter() - self._t0


def _timing_record(step: str, clock: _ImportClock, ok: bool, result: Any, variant: Any = None) -> dict[str, Any]:
    """The TAILGUARD_TASK_TIMING record: step, variant (the task's variant_name, or None), body_s, imports_s
    (seconds), ok, `hosted` (the body ran in a child of the local run's task host: tailguard.core.taskhost) and
    `cached` (bool) when the task's JSON result says whether it came from the local cache (export, builds), else
    None."""
    from tailguard.core import taskhost

    cached = None
    if isinstance(result, str) and result.startswith("{"):
        try:
            cached = json.loads(result).get("cached")
        except (ValueError, AttributeError):
            cached = None
    return {"step": step, "variant": variant if isinstance(variant, str) else None,
            "body_s": round(clock.body_s, 4), "imports_s": round(clock.imports_s, 4), "ok": ok,
            "hosted": taskhost._in_child,
            "cached": cached if isinstance(cached, bool) else None}


def _record_on_parent(step: str, err: TailguardError, kwargs: dict[str, Any]) -> None:
    """Put the error on the parent MLflow run when the task knows it (tasks after resolve): the cluster's exit
    handler (components/finalize) writes it into the failed run's description."""
    parent, uri = kwargs.get("parent_run_id"), kwargs.get("tracking_uri")
    if parent and uri:
        from tailguard.core.tracking import record_task_failure

        where = f"{step}" + (f" ({kwargs['variant_name']})" if kwargs.get("variant_name") else "")
        record_task_failure(uri, parent, f"{where}: {err.message}")


def find_error_records(text: str) -> list[dict[str, Any]]:
    """Every error record printed with the marker in a log text, in order."""
    out = []
    for line in text.splitlines():
        i = line.find(ERROR_MARKER)
        if i >= 0:
            try:
                out.append(json.loads(line[i + len(ERROR_MARKER):]))
            except json.JSONDecodeError:
                continue
    return out


def write_json(path: str | Path, obj: Any) -> Path:
    """Write JSON atomically (temp file + rename): readers never see a half-written file."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(p.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=json_default))
    tmp.replace(p)
    return p


def json_default(o: Any) -> Any:
    """`json.dumps(default=...)` for numpy scalars/arrays and paths."""
    import numpy as np

    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serializable: {type(o).__name__}")
