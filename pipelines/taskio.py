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

from tailguard.errors import StepError, TailguardError, dumps_error

ERROR_MARKER = "TAILGUARD_ERROR "
F = TypeVar("F", bound=Callable[..., Any])


def task_entry(step: str) -> Callable[[F], F]:
    """Decorator for a task's main function: report TailguardErrors with the marker line; wrap others in StepError."""

    def deco(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            from tailguard.home import quiet_environment

            quiet_environment()
            try:
                return fn(*args, **kwargs)
            except TailguardError as err:
                print(ERROR_MARKER + dumps_error(err), file=sys.stderr, flush=True)
                _record_on_parent(step, err, kwargs)
                raise
            except Exception as exc:  # an unexpected bug: keep the traceback in the log, report a StepError
                err = StepError(f"{type(exc).__name__}: {exc}", step=step, variant=kwargs.get("variant_name"))
                print(ERROR_MARKER + dumps_error(err), file=sys.stderr, flush=True)
                _record_on_parent(step, err, kwargs)
                raise

        return wrapper  # type: ignore[return-value]

    return deco


def _record_on_parent(step: str, err: TailguardError, kwargs: dict[str, Any]) -> None:
    """Put the error on the parent MLflow run when the task knows it (tasks after resolve): the cluster's exit
    handler (components/finalize) writes it into the failed run's description."""
    parent, uri = kwargs.get("parent_run_id"), kwargs.get("tracking_uri")
    if parent and uri:
        from tailguard.tracking import record_task_failure

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
