"""Offline replay: logged requests (a Parquet file laid out like validation data: one column per model input
plus metadata columns) go through the same sampler, comparison and per-slice statistics as live traffic.

Deterministic: the sampler is seeded, rows are admitted in file order, and each sampled row's statistics update
happens in that order, so equal inputs and seeds give equal alerts.json / slices.json (apart from `fired_at`,
which is the row's `timestamp` column when the file has one, else the replay's start time).
"""

from __future__ import annotations

import contextlib
import json
import logging
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import numpy as np
import pandas as pd
from rich.console import Console
from rich.table import Table
from rich.text import Text

from tailguard.core.data import Dataset, load_dataset
from tailguard.core.derive import load_centroids
from tailguard.core.errors import EXIT_ALERT, EXIT_OK, InputError, StepError, TailguardError
from tailguard.core.pt2_archive import MONITOR_FIX
from tailguard.core.runtime import Runner, run_dataset, runner_for_file
from tailguard.core.spec import load_spec
from tailguard.core.spec.root import Spec
from tailguard.core.tokens import IGNORE, NON_FINITE, align, decode_settings, run_token_ids
from tailguard.monitoring.compare import compare_rows, reference_non_finite
from tailguard.monitoring.config import MonitorConfig, resolve_config
from tailguard.monitoring.drift import DriftSnapshots
from tailguard.monitoring.slice_monitor import SliceMonitor

TIMESTAMP_COLUMN = "timestamp"
# perturb(candidate_outputs (n_sampled, ...), row_indices (n_sampled,), frame) -> candidate_outputs
Perturb = Callable[[np.ndarray, np.ndarray, pd.DataFrame], np.ndarray]


def _output_index(runner: Runner, name: str) -> int:
    names = getattr(runner, "output_names", None) or []
    return names.index(name) if name in names else 0


def _run(runner: Runner, ds: Dataset, cfg: MonitorConfig, role: str) -> np.ndarray:
    """The compared output of `runner` on `ds`, (rows, ...); for token_classification its per-position top-1 ids
    (rows, time) int32 (`tokens.run_token_ids`: one batch of scores held at a time, the mask applied)."""
    spec = cfg.spec
    try:
        if cfg.model_task == "token_classification":
            return run_token_ids(runner, ds, cfg.inputs, batch_size=spec.data.validation.batch_size,
                                 pad_values=spec.model.pad_values,
                                 mask_input=decode_settings(spec.model)["mask_input"],
                                 output_index=_output_index(runner, cfg.output.name))
        outs = run_dataset(runner, ds, cfg.inputs, batch_size=spec.data.validation.batch_size,
                           pad_values=spec.model.pad_values)
    except TailguardError:
        raise
    except Exception as exc:  # ORT raises its own runtime errors; report them as a failed replay step
        raise StepError(f"{role} model failed on the replayed requests: {str(exc).splitlines()[0][:300]}",
                        step="monitor.replay") from None
    return outs[_output_index(runner, cfg.output.name)]


def _run_candidate(runner: Runner, ds: Dataset, cfg: MonitorConfig, shape: tuple[int, ...]
                   ) -> tuple[np.ndarray, list[str | None]]:
    """The candidate's outputs on the sampled rows and, per row, its failure reason or None. A batched run that
    fails is retried row by row, so a candidate that fails on some inputs fails those rows only (they are compared
    as the worst disagreement, docs/monitor.md "Failures count"); rows it answered keep their outputs."""
    n = shape[0]
    try:
        out = _run(runner, ds, cfg, "candidate")
    except StepError:
        out = None
    if out is not None and cfg.model_task == "token_classification" and out.ndim == 2 and out.shape[0] == n and \
            out.shape[1] < shape[1]:  # ids of a run padded shorter: positions past it are not compared
        out = align(out, np.zeros(shape, dtype=np.int32))[0]
    if out is not None and out.shape == shape:
        return out, [None] * n
    if out is not None:  # answered, but not the reference's shape: every row is a shape failure
        return np.zeros(shape, dtype=np.int32 if cfg.model_task == "token_classification" else np.float32), \
            ["candidate_shape"] * n
    rows = (np.full(shape, IGNORE, dtype=np.int32) if cfg.model_task == "token_classification"
            else np.zeros(shape, dtype=np.float32))
    failed: list[str | None] = []
    for j in range(n):
        try:
            one = _run(runner, ds.subset(np.array([j])), cfg, "candidate")
        except StepError:
            failed.append("candidate_error")
            continue
        token = cfg.model_task == "token_classification" and one.ndim == 2 and one.shape[1] <= shape[1]
        if one.shape != (1, *shape[1:]) and not token:
            failed.append("candidate_shape")
            continue
        rows[j, :one.shape[1]] = one[0]  # token ids of a shorter padded width keep IGNORE past it
        failed.append(None)
    return rows, failed


def _timestamps(frame: pd.DataFrame, start: datetime) -> list[datetime]:
    if TIMESTAMP_COLUMN in frame.columns:
        ts = pd.to_datetime(frame[TIMESTAMP_COLUMN], utc=True, errors="coerce")
        return [t.to_pydatetime() if not pd.isna(t) else start for t in ts]
    return [start] * len(frame)


def replay(spec: Spec, reference: str | Path | Runner, candidate: str | Path | Runner, requests: str | Path,
           out_dir: str | Path, *, seed: int = 0, perturb: Perturb | None = None, source: str = "spec",
           centroids: Mapping[str, np.ndarray] | None = None, trusted: bool = False) -> dict[str, Any]:
    """Replay logged requests through the monitor and write DIR/alerts.json and DIR/slices.json.

    Args:
        spec: the spec (its monitoring section is required).
        reference: FP32 reference .onnx path (or a Runner).
        candidate: candidate .onnx path (or a Runner); ignored when monitoring.noise_floor (reference vs itself).
        requests: Parquet file, one row per request: a column per model input plus metadata columns.
        out_dir: output folder (created).
        seed: sampler seed.
        perturb: optional hook changing the candidate's outputs of the sampled rows (planted drift, demo only).
        source: spec file name for error messages.
        centroids: {slice name: (k, dim)} for nearest_centroid slices (the pipeline's centroids.npz).
        trusted: `--trusted`: a .pt2 model file is loaded without first refusing an archive that holds code
            (tailguard.core.pt2_archive); otherwise such a file is refused (UntrustedModelError, exit 2).

    Returns:
        {"alerts": [alert dicts, each with request_index], "slices": slices.json content, "exit_code": 0 or 4,
        "out_dir": str, "requests": n rows, "sampled": n sampled}. With monitoring.evidently_workspace set, an
        Evidently snapshot pair is also written per `snapshot_every` compared rows (monitoring/drift.py).

    Raises:
        SpecError: no monitoring section or an invalid one (exit 2).
        InputError: missing/unreadable files, a missing input or slice column (exit 2).
        StepError: the reference model failed at run time (exit 1); a candidate that fails on some rows is
            compared as the worst disagreement on those rows (docs/monitor.md "Failures count").
    """
    cfg = resolve_config(spec, source=source, centroids=centroids)
    ds = load_dataset(str(requests), cfg.inputs, field="requests")
    # column and header slices read the requests' metadata columns (a header's column is named like it); derived
    # slices are computed from the inputs and the reference's output
    missing = [r.column for r in cfg.rules if not r.derived and r.column not in ds.frame.columns]
    if missing:
        raise InputError(f"requests: {requests} has no metadata column(s) {missing} used by monitoring slices; "
                         f"columns: {list(ds.frame.columns)}",
                         hint="log the slice metadata with each request, or change monitoring.slice_columns")
    ref_runner = reference if hasattr(reference, "run") else runner_for_file(reference, cfg.inputs, trusted=trusted,
                                                                             fix=MONITOR_FIX)
    if cfg.mon.noise_floor:
        cand_runner = ref_runner
    else:
        cand_runner = candidate if hasattr(candidate, "run") else runner_for_file(candidate, cfg.inputs,
                                                                                  trusted=trusted, fix=MONITOR_FIX)

    monitor = SliceMonitor(cfg, seed=seed, max_request_rows=1)  # every logged row is a one-row request
    cols = cfg.metadata_columns
    meta_rows = ds.frame[cols].to_dict("records") if cols else [{}] * ds.n_rows
    heads = cfg.header_names
    head_rows = ds.frame[heads].astype(str).to_dict("records") if heads else [None] * ds.n_rows
    derived_inputs = any(r.source == "input" for r in cfg.rules)
    admitted = [monitor.admit(m, {k: v[i][None] for k, v in ds.inputs.items()} if derived_inputs else None, h)
                for i, (m, h) in enumerate(zip(meta_rows, head_rows))]
    idx = np.array([i for i, (_, d) in enumerate(admitted) if d.sampled], dtype=np.int64)
    start = datetime.now(timezone.utc)
    stamps = _timestamps(ds.frame, start)
    if idx.size:
        sub = ds.subset(idx)
        ref_out = _run(ref_runner, sub, cfg, "reference")
        cand_out, failed = _run_candidate(cand_runner, sub, cfg, ref_out.shape)
        if perturb is not None:
            cand_out = perturb(cand_out.copy(), idx, ds.frame)
        bad_ref = ((ref_out == NON_FINITE).any(axis=1) if cfg.model_task == "token_classification"  # ids: a sentinel
                   else reference_non_finite(ref_out))
        values = compare_rows(cfg.model_task, ref_out, cand_out, cfg.metrics,
                              probabilities=cfg.output.kind == "probabilities", decode=cfg.spec.model.decode)
        snaps = DriftSnapshots(cfg, background=False) if cfg.mon.evidently_workspace else None
        for j, i in enumerate(idx):
            keys, d = admitted[i]
            if failed[j] is not None:  # the candidate failed on this row: compared as the worst disagreement
                monitor.observe(keys, d, ref_out[j:j + 1], None, request_index=int(i), now=stamps[i],
                               failure=failed[j])
                continue
            if bad_ref[j]:
                monitor.reference_failed(keys, 1)
                continue
            if getattr(keys, "per_row", False):  # derived slices: labelled from this row's reference output
                monitor.observe(keys, d, ref_out[j:j + 1], cand_out[j:j + 1], request_index=int(i), now=stamps[i],
                               values={m: values[m][j:j + 1] for m in cfg.metrics})
            else:
                row = {m: float(values[m][j]) for m in cfg.metrics}
                monitor.observe_values(keys, d, row, request_index=int(i), now=stamps[i])
            if snaps is not None:
                snaps.add({"inputs": {k: v[j] for k, v in sub.inputs.items()}, "meta": meta_rows[i],
                           "reference": ref_out[j], "candidate": cand_out[j]})
    alerts = monitor.alerts()
    slices = monitor.slices()
    slices["dropped_non_finite_reference"] = int(reference_non_finite(ref_out).sum()) if idx.size else 0
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "alerts.json").write_text(json.dumps(alerts, indent=2))
    (out / "slices.json").write_text(json.dumps(slices, indent=2))
    return {"alerts": alerts, "slices": slices, "exit_code": EXIT_ALERT if alerts else EXIT_OK,
            "out_dir": str(out), "requests": ds.n_rows, "sampled": int(idx.size)}


def replay_cli(spec_path: str | Path, reference: str | Path, candidate: str | Path, requests: str | Path,
               out_dir: str | Path, *, seed: int = 0, console: Console | None = None,
               err_console: Console | None = None, centroids: str | Path | None = None,
               trusted: bool = False) -> int:
    """`tailguard monitor replay`: load the spec, replay, write DIR/alerts.json and DIR/slices.json.

    With consoles given (the CLI's), it prints a warning on `err_console` when reference and candidate are the same
    file (`same_file_warning`; not with monitoring.noise_floor, which ignores the candidate), then on `console` one
    line per alert in firing order (`alert_line`), the alerts table (`alerts_table`) and where the files are.
    The monitor's own "alert fired" log records (logger tailguard.monitoring) are held back meanwhile, so no
    alert is printed twice. alerts.json / slices.json are the same with or without consoles.

    Args:
        spec_path: spec YAML.
        reference: FP32 reference .onnx.
        candidate: candidate .onnx.
        requests: Parquet file of logged requests.
        out_dir: output folder.
        seed: sampler seed.
        console: where the alert lines and the table go (None: print nothing).
        err_console: where the same-file warning goes (None: `console`'s, else nothing).
        centroids: a centroids.npz (`--centroids`) for nearest_centroid slices.
        trusted: `--trusted` (as `replay`).

    Returns:
        0 when no alert fired, 4 when any did.

    Raises:
        SpecError / InputError: bad spec or input (exit_code 2). StepError: a model failed (exit_code 1).
    """
    for label, p in (("--reference", reference), ("--candidate", candidate), ("--requests", requests)):
        if not Path(p).is_file():
            raise InputError(f"{label}: file not found: {p}", hint=f"pass an existing file to {label}")
    spec = load_spec(spec_path)
    warn_to = err_console or console
    if warn_to is not None and not (spec.monitoring is not None and spec.monitoring.noise_floor):
        if (warning := same_file_warning(reference, candidate)) is not None:
            warn_to.print(Text.assemble(("warning", "bold yellow"), ": ", warning), soft_wrap=True)
    with _alert_logs_held_back():
        result = replay(spec, reference, candidate, requests, out_dir, seed=seed, source=str(spec_path),
                        centroids=load_centroids(str(centroids)) if centroids is not None else None,
                        trusted=trusted)
    if console is not None:
        print_replay(result, console)
    return int(result["exit_code"])


# ---------------------------------------------------------------------------------------------- printing
_ALERT_LOGGER = "tailguard.monitoring"  # SliceMonitor logs "alert fired: {json}" / "alert cleared: {json}" there


class _DropAlertRecords(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(("alert fired", "alert cleared"))


@contextlib.contextmanager
def _alert_logs_held_back() -> Iterator[None]:
    """Drop the slice monitor's per-alert log records while the block runs (replay prints each alert itself)."""
    logger, flt = logging.getLogger(_ALERT_LOGGER), _DropAlertRecords()
    logger.addFilter(flt)
    try:
        yield
    finally:
        logger.removeFilter(flt)


def same_file_warning(reference: str | Path, candidate: str | Path | None) -> str | None:
    """The warning for a monitor whose reference and candidate are the same file (equal sha256), else None.

    A monitor comparing a model file with itself agrees on every row and can never alert: it proves nothing
    about the promoted variant (e.g. when `ort-fp32` is both promoted and used as the FP32 reference).

    Args:
        reference: the reference model file.
        candidate: the candidate model file, or None (a pairs-only monitor: nothing to compare).

    Returns:
        One sentence naming both files and the digest, or None when they differ, the candidate is None or
        either file cannot be read (the caller reports missing files).
    """
    if candidate is None:
        return None
    from tailguard.core.digests import file_sha256

    try:
        same = Path(reference).resolve() == Path(candidate).resolve() or \
            file_sha256(reference) == file_sha256(candidate)
        digest = file_sha256(reference) if same else ""
    except OSError:
        return None
    if not same:
        return None
    return (f"--reference {reference} and --candidate {candidate} are the same model file "
            f"(sha256 {digest[:12]}...): "
            "the monitor compares it with itself, agrees on every row and cannot alert. Pass the promoted variant "
            "as --candidate (`tailguard fetch NAME-optimized@ALIAS -o DIR`) and the FP32 reference as --reference.")


def _num(v: Any) -> str:
    if isinstance(v, bool) or v is None:
        return "-" if v is None else str(v)
    if isinstance(v, (int, float, np.floating, np.integer)):
        return f"{float(v):.4g}"
    return str(v)


def alert_line(alert: dict[str, Any]) -> str:
    """One line for one alert record (alerts.json), e.g.
    "ALERT domain=legal top1_agree 0.8123 < 0.95 at request 6123 (change near request 5400; 87 samples,
    betting_cusum)". The comparison sign comes from `direction` ("min": bad below, "max": bad above)."""
    sign = ">" if alert.get("direction") == "max" else "<"
    where = f" at request {alert['request_index']}" if alert.get("request_index") is not None else ""
    extra = []
    if alert.get("change_point_request_index") is not None:
        extra.append(f"change near request {alert['change_point_request_index']}")
    if alert.get("samples_seen") is not None:
        extra.append(f"{alert['samples_seen']} samples")
    if alert.get("detector") or alert.get("method"):
        extra.append(str(alert.get("detector") or alert.get("method")))
    return (f"ALERT {alert.get('slice', '?')} {alert.get('metric', '?')} {_num(alert.get('value'))} {sign} "
            f"{_num(alert.get('threshold'))}{where}" + (f" ({'; '.join(extra)})" if extra else ""))


def alerts_table(alerts: list[dict[str, Any]]) -> Table:
    """The end-of-replay table: one row per alert in firing order with slice, metric, value, threshold and the
    request it fired at (the row index of the replayed file); the threshold reads "min 0.95" (bad below) or
    "max 0.05" (bad above). Slice keys fold only when the terminal is too narrow for them (on an 80-column terminal
    a 20-character key stays whole); metric names never wrap, headers wrap at their spaces."""
    table = Table(title=f"{len(alerts)} alert{'s' if len(alerts) != 1 else ''}", show_lines=False)
    table.add_column("slice", overflow="fold")
    table.add_column("metric", no_wrap=True)
    for col in ("value", "threshold", "fired at request"):  # headers wrap at their spaces, numbers never
        table.add_column(col, justify="right")
    for a in alerts:
        kind = a.get("direction")  # "min": the slice must stay above it, "max": below it
        table.add_row(Text(str(a.get("slice", "?"))), Text(str(a.get("metric", "?"))), _num(a.get("value")),
                      f"{kind} {_num(a.get('threshold'))}" if kind in ("min", "max") else _num(a.get("threshold")),
                      _num(a.get("request_index")))
    return table


def print_replay(result: dict[str, Any], console: Console) -> None:
    """Print a `replay` result: one `alert_line` per alert, the `alerts_table` (when any fired) and a last line
    with the counts and the files written."""
    alerts = result.get("alerts") or []
    for a in alerts:
        console.print(Text(alert_line(a), style="red"), soft_wrap=True)
    if alerts:
        console.print(alerts_table(alerts))
    out = Path(result.get("out_dir", "."))
    console.print(f"{len(alerts)} alert(s) over {result.get('requests', '?')} requests ({result.get('sampled', '?')} "
                  f"sampled); wrote {out / 'alerts.json'} and {out / 'slices.json'}", markup=False, highlight=False)
