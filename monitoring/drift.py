"""Evidently drift snapshots, one pair per window of sampled rows, written to an Evidently workspace
(`evidently ui --workspace PATH` shows them under the project `monitoring.evidently_project`).

Per window (`monitoring.snapshot_every` sampled rows):

* input drift: the window's input features vs the calibration reference (`monitoring.drift_reference`, default
  `data.calibration.uri`). Features per row: for each model input its length (first axis; 1 for scalars), the
  mean and standard deviation of its values; plus the slice metadata columns. Evidently's DataDriftPreset
  picks the test per column (K-S / chi-square / Z / Wasserstein by size and type).
* output drift: the candidate's output features (current) vs the reference model's (reference dataset) on the
  same rows: classification: top-1 class (categorical) and top-1 softmax probability; embedding: the vector
  norm and the first 8 components; regression/generic: the first 8 output values.

Snapshots are built in a background thread (the Evidently import and report take ~0.3-10 s); a window that
completes while the previous one is still being written is skipped and counted (`skipped`).
"""

from __future__ import annotations

import logging
import threading
from datetime import datetime, timezone
from typing import Any

import numpy as np
import pandas as pd

from tailguard.monitoring.config import MonitorConfig

log = logging.getLogger("tailguard.monitoring.drift")
N_COMPONENTS = 8


def input_features(inputs: dict[str, np.ndarray], meta: dict[str, Any], columns: list[str]) -> dict[str, Any]:
    """Drift features of one row (see module docstring).

    Args:
        inputs: {input name: the row's array (no batch axis)}.
        meta: the row's metadata.
        columns: metadata columns to keep (the slice columns).
    """
    out: dict[str, Any] = {}
    for k, v in inputs.items():
        a = np.asarray(v, dtype=np.float64)
        out[f"{k}.length"] = float(a.shape[0]) if a.ndim else 1.0
        out[f"{k}.mean"] = float(a.mean()) if a.size else 0.0
        out[f"{k}.std"] = float(a.std()) if a.size else 0.0
    for c in columns:
        v = meta.get(c)
        out[c] = None if v is None else str(v)
    return out


def output_features(model_task: str, out: np.ndarray) -> dict[str, Any]:
    """Drift features of one output row (see module docstring)."""
    a = np.asarray(out, dtype=np.float64).reshape(-1)
    if model_task == "classification":
        z = a - a.max()
        p = np.exp(z) / np.exp(z).sum()
        return {"top1": str(int(a.argmax())), "top1_prob": float(p.max())}
    feats: dict[str, Any] = {}
    if model_task == "embedding":
        feats["norm"] = float(np.linalg.norm(a))
    for i in range(min(N_COMPONENTS, a.size)):
        feats[f"out{i}"] = float(a[i])
    return feats


def _dataset(df: pd.DataFrame) -> Any:
    from evidently import DataDefinition, Dataset

    num = [c for c in df.columns if pd.api.types.is_numeric_dtype(df[c])]
    cat = [c for c in df.columns if c not in num]
    return Dataset.from_pandas(df, data_definition=DataDefinition(numerical_columns=num, categorical_columns=cat))


class DriftSnapshots:
    """Collects sampled rows and writes two Evidently snapshots per window.

    Args:
        cfg: resolved configuration (monitoring.evidently_workspace must be set).
        reference_frame: input-feature rows of the drift reference (default: computed from
            monitoring.drift_reference or data.calibration.uri; None there when unreadable, then only output
            drift is written).
        background: build snapshots in a thread (False: synchronously, for tests and replay).
        session: a label telling this monitor process / replay apart from others writing to the same project
            (default: its UTC start time and a random suffix, e.g. '20261123T230501Z-3fa2c1'). It is in every
            snapshot's name, tags ('session:<label>') and metadata (session, window, model, started), so the
            snapshots of two replays of the same requests can be told apart.
    """

    def __init__(self, cfg: MonitorConfig, *, reference_frame: pd.DataFrame | None = None,
                 background: bool = True, session: str | None = None) -> None:
        if not cfg.mon.evidently_workspace:
            raise ValueError("monitoring.evidently_workspace is not set")
        import uuid

        self.started = datetime.now(timezone.utc)
        self.session = session or f"{self.started:%Y%m%dT%H%M%SZ}-{uuid.uuid4().hex[:6]}"
        self.cfg = cfg
        self.every = cfg.mon.snapshot_every
        self.background = background
        self.rows: list[dict[str, Any]] = []
        self.ref_out: list[dict[str, Any]] = []
        self.cand_out: list[dict[str, Any]] = []
        self.windows = 0
        self.skipped = 0
        self.written: list[dict[str, Any]] = []
        self._ref_frame = reference_frame
        self._ref_loaded = reference_frame is not None
        self._thread: threading.Thread | None = None
        self._ws: Any = None
        self._project: Any = None

    def add(self, record: dict[str, Any]) -> None:
        """Add one sampled row (a SliceMonitor record); completes a window every `snapshot_every` rows."""
        self.rows.append(input_features(record.get("inputs", {}), record.get("meta", {}),
                                        self.cfg.metadata_columns))
        self.ref_out.append(output_features(self.cfg.model_task, record["reference"]))
        self.cand_out.append(output_features(self.cfg.model_task, record["candidate"]))
        if len(self.rows) >= self.every:
            window = (pd.DataFrame(self.rows), pd.DataFrame(self.ref_out), pd.DataFrame(self.cand_out))
            self.rows, self.ref_out, self.cand_out = [], [], []
            self.windows += 1
            if not self.background:
                self._write(self.windows, *window)
            elif self._thread is not None and self._thread.is_alive():
                self.skipped += 1
            else:
                self._thread = threading.Thread(target=self._write, args=(self.windows, *window),
                                                name="tg-evidently", daemon=True)
                self._thread.start()

    def join(self, timeout: float = 60.0) -> None:
        """Wait for a snapshot being written."""
        if self._thread is not None:
            self._thread.join(timeout)

    def _reference(self) -> pd.DataFrame | None:
        if not self._ref_loaded:
            self._ref_loaded = True
            uri = self.cfg.mon.drift_reference or self.cfg.spec.data.calibration.uri
            try:
                from tailguard.core.data import load_dataset

                ds = load_dataset(uri, self.cfg.inputs, field="monitoring.drift_reference")
                cols = [c for c in self.cfg.metadata_columns if c in ds.frame.columns]
                meta = ds.frame[cols].to_dict("records") if cols else [{}] * ds.n_rows
                self._ref_frame = pd.DataFrame([
                    input_features({k: v[i] for k, v in ds.inputs.items()}, meta[i], self.cfg.metadata_columns)
                    for i in range(ds.n_rows)])
            except Exception as exc:  # an unreadable reference only disables input drift
                log.warning("input drift disabled: cannot read the drift reference %s: %s", uri, exc)
                self._ref_frame = None
        return self._ref_frame

    def _workspace(self) -> tuple[Any, Any]:
        if self._ws is None:
            from evidently.ui.workspace import Workspace

            self._ws = Workspace(self.cfg.mon.evidently_workspace)
            name = self.cfg.mon.evidently_project
            found = [p for p in self._ws.list_projects() if p.name == name]
            self._project = found[0] if found else self._ws.create_project(
                name, description=f"tailguard shadow monitor: {self.cfg.model_name}")
        return self._ws, self._project

    def _write(self, window: int, inputs: pd.DataFrame, ref_out: pd.DataFrame, cand_out: pd.DataFrame) -> None:
        try:
            from evidently import Report
            from evidently.presets import DataDriftPreset

            ws, project = self._workspace()
            stamp = datetime.now(timezone.utc)
            entry: dict[str, Any] = {"window": window, "rows": len(inputs), "session": self.session}
            meta = {"session": self.session, "window": str(window), "model": str(self.cfg.model_name),
                    "started": self.started.isoformat(), "rows": str(len(inputs))}
            tags = [f"session:{self.session}", self.cfg.model_name]
            ref_in = self._reference()
            if ref_in is not None and len(ref_in):
                cols = [c for c in inputs.columns if c in ref_in.columns]
                snap = Report([DataDriftPreset()]).run(
                    _dataset(inputs[cols]), _dataset(ref_in[cols]), timestamp=stamp, metadata=meta,
                    name=f"input drift, window {window} [{self.session}]", tags=["input_drift", *tags])
                entry["input_snapshot"] = str(ws.add_run(project.id, snap).id)
                entry["input_drift_share"] = _drift_share(snap)
            snap = Report([DataDriftPreset()]).run(
                _dataset(cand_out), _dataset(ref_out), timestamp=stamp, metadata=meta,
                name=f"output drift (candidate vs reference), window {window} [{self.session}]",
                tags=["output_drift", *tags])
            entry["output_snapshot"] = str(ws.add_run(project.id, snap).id)
            entry["output_drift_share"] = _drift_share(snap)
            self.written.append(entry)
        except Exception:  # drift reports are best effort; the statistics and alerts do not depend on them
            log.exception("Evidently snapshot for window %d failed", window)


def _drift_share(snapshot: Any) -> float | None:
    for m in snapshot.dict().get("metrics", []):
        if str(m.get("metric_name", "")).startswith("DriftedColumnsCount"):
            v = m.get("value") or {}
            return float(v.get("share")) if isinstance(v, dict) and "share" in v else None
    return None
