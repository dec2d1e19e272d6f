"""Offline replay: logged requests (a Parquet file laid out like validation data: one column per model input
plus metadata columns) go through the same sampler, comparison and per-slice statistics as live traffic.

Deterministic: the sampler is seeded, rows are admitted in file order, and each sampled row's statistics update
happens in that order, so equal inputs and seeds give equal alerts.json / slices.json (apart from `fired_at`,
which is the row's `timestamp` column when the file has one, else the replay's start time).
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pandas as pd

from tailguard.core.data import Dataset, load_dataset
from tailguard.core.errors import EXIT_ALERT, EXIT_OK, InputError, StepError, TailguardError
from tailguard.monitoring.compare import compare_rows, reference_non_finite
from tailguard.monitoring.config import MonitorConfig, resolve_config
from tailguard.monitoring.core import MonitorCore
from tailguard.monitoring.drift import DriftSnapshots
from tailguard.core.runtime import OrtRunner, Runner, run_dataset
from tailguard.core.spec import Spec, load_spec

TIMESTAMP_COLUMN = "timestamp"
# perturb(candidate_outputs (n_sampled, ...), row_indices (n_sampled,), frame) -> candidate_outputs
Perturb = Callable[[np.ndarray, np.ndarray, pd.DataFrame], np.ndarray]


def _output_index(runner: Runner, name: str) -> int:
    names = getattr(runner, "output_names", None) or []
    return names.index(name) if name in names else 0


def _run(runner: Runner, ds: Dataset, cfg: MonitorConfig, role: str) -> np.ndarray:
    spec = cfg.spec
    try:
        outs = run_dataset(runner, ds, cfg.inputs, batch_size=spec.data.validation.batch_size,
                           pad_values=spec.model.pad_values)
    except TailguardError:
        raise
    except Exception as exc:  # ORT raises its own runtime errors; report them as a failed replay step
        raise StepError(f"{role} model failed on the replayed requests: {str(exc).splitlines()[0][:300]}",
                        step="monitor.replay") from None
    return outs[_output_index(runner, cfg.output.name)]


def _timestamps(frame: pd.DataFrame, start: datetime) -> list[datetime]:
    if TIMESTAMP_COLUMN in frame.columns:
        ts = pd.to_datetime(frame[TIMESTAMP_COLUMN], utc=True, errors="coerce")
        return [t.to_pydatetime() if not pd.isna(t) else start for t in ts]
    return [start] * len(frame)


def replay(spec: Spec, reference: str | Path | Runner, candidate: str | Path | Runner, requests: str | Path,
           out_dir: str | Path, *, seed: int = 0, perturb: Perturb | None = None, source: str = "spec"
           ) -> dict[str, Any]:
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

    Returns:
        {"alerts": [alert dicts, each with request_index], "slices": slices.json content, "exit_code": 0 or 4,
        "out_dir": str, "requests": n rows, "sampled": n sampled}. With monitoring.evidently_workspace set, an
        Evidently snapshot pair is also written per `snapshot_every` compared rows (monitoring/drift.py).

    Raises:
        SpecError: no monitoring section or an invalid one (exit 2).
        InputError: missing/unreadable files, a missing input or slice column (exit 2).
        StepError: a model failed at run time (exit 1).
    """
    cfg = resolve_config(spec, source=source)
    ds = load_dataset(str(requests), cfg.inputs, field="requests")
    missing = [r.column for r in cfg.rules if r.column not in ds.frame.columns]
    if missing:
        raise InputError(f"requests: {requests} has no metadata column(s) {missing} used by monitoring slices; "
                         f"columns: {list(ds.frame.columns)}",
                         hint="log the slice metadata with each request, or change monitoring.slice_columns")
    ref_runner = reference if hasattr(reference, "run") else OrtRunner(reference)  # type: ignore[arg-type]
    if cfg.mon.noise_floor:
        cand_runner = ref_runner
    else:
        cand_runner = candidate if hasattr(candidate, "run") else OrtRunner(candidate)  # type: ignore[arg-type]

    core = MonitorCore(cfg, seed=seed)
    cols = cfg.metadata_columns
    meta_rows = ds.frame[cols].to_dict("records") if cols else [{}] * ds.n_rows
    admitted = [core.admit(m) for m in meta_rows]
    idx = np.array([i for i, (_, d) in enumerate(admitted) if d.sampled], dtype=np.int64)
    start = datetime.now(timezone.utc)
    stamps = _timestamps(ds.frame, start)
    if idx.size:
        sub = ds.subset(idx)
        ref_out = _run(ref_runner, sub, cfg, "reference")
        cand_out = _run(cand_runner, sub, cfg, "candidate")
        if perturb is not None:
            cand_out = perturb(cand_out.copy(), idx, ds.frame)
        bad_ref = reference_non_finite(ref_out)
        values = compare_rows(cfg.task, ref_out, cand_out, cfg.metrics)
        snaps = DriftSnapshots(cfg, background=False) if cfg.mon.evidently_workspace else None
        for j, i in enumerate(idx):
            if bad_ref[j]:
                continue
            keys, d = admitted[i]
            row = {m: float(values[m][j]) for m in cfg.metrics}
            core.observe_values(keys, d, row, request_index=int(i), now=stamps[i])
            if snaps is not None:
                snaps.add({"inputs": {k: v[j] for k, v in sub.inputs.items()}, "meta": meta_rows[i],
                           "reference": ref_out[j], "candidate": cand_out[j]})
    alerts = core.alerts()
    slices = core.slices()
    slices["dropped_non_finite_reference"] = int(reference_non_finite(ref_out).sum()) if idx.size else 0
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "alerts.json").write_text(json.dumps(alerts, indent=2))
    (out / "slices.json").write_text(json.dumps(slices, indent=2))
    return {"alerts": alerts, "slices": slices, "exit_code": EXIT_ALERT if alerts else EXIT_OK,
            "out_dir": str(out), "requests": ds.n_rows, "sampled": int(idx.size)}


def replay_cli(spec_path: str | Path, reference: str | Path, candidate: str | Path, requests: str | Path,
               out_dir: str | Path, *, seed: int = 0) -> int:
    """`tailguard monitor replay`: load the spec, replay, write DIR/alerts.json and DIR/slices.json.

    Args:
        spec_path: spec YAML.
        reference: FP32 reference .onnx.
        candidate: candidate .onnx.
        requests: Parquet file of logged requests.
        out_dir: output folder.
        seed: sampler seed.

    Returns:
        0 when no alert fired, 4 when any did.

    Raises:
        SpecError / InputError: bad spec or input (exit_code 2). StepError: a model failed (exit_code 1).
    """
    for label, p in (("--reference", reference), ("--candidate", candidate), ("--requests", requests)):
        if not Path(p).is_file():
            raise InputError(f"{label}: file not found: {p}", hint=f"pass an existing file to {label}")
    spec = load_spec(spec_path)
    return int(replay(spec, reference, candidate, requests, out_dir, seed=seed, source=str(spec_path))["exit_code"])
