"""Sampled pairs to S3 as Parquet batches (boto3), with redaction and a bounded local spool.

A batch is one Parquet object laid out like validation data, so it can be replayed as is
(`tailguard monitor replay --requests batch.parquet`): one column per model input (the row's values, flattened;
None when redacted), one column per request parameter (`'<redacted>'` when redacted), and monitor columns
prefixed `_tg_`: request id, request index, row, weight, slices, reference and candidate outputs (flattened),
per-row metrics, a UTC time stamp.

When S3 refuses a batch (down, unreachable, access denied) it is written to the spool folder; spooled batches
are retried every `retry_interval_s`, oldest first, and deleted once uploaded. The spool is bounded by
`spool_max_bytes`: a batch that does not fit is dropped and counted (`s3_uploads_total{status="dropped"}`), so
nothing is lost within the bound and memory/disk stay bounded beyond it.
"""

from __future__ import annotations

import io
import logging
import queue
import threading
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pandas as pd

from tailguard.monitoring.metrics import MonitorMetrics
from tailguard.spec import MonitorS3Spec

log = logging.getLogger("tailguard.monitoring.sink")
REDACTED = "<redacted>"


def redact_row(record: dict[str, Any], fields: set[str]) -> dict[str, Any]:
    """One sampled-pair record as a flat Parquet row, with `fields` (input names or parameters) redacted.

    Args:
        record: a record from MonitorCore.observe (inputs, meta, reference, candidate, metrics, ...).
        fields: names to redact.

    Returns:
        {column: value}: input columns (list of numbers, None if redacted), parameter columns
        ('<redacted>' if redacted, else the value as text), `_tg_*` monitor columns.
    """
    row: dict[str, Any] = {}
    for k, v in record.get("inputs", {}).items():
        row[k] = None if k in fields else np.asarray(v).reshape(-1).tolist()
    for k, v in record.get("meta", {}).items():
        row[k] = REDACTED if k in fields else (None if v is None else str(v))
    row.update({
        "_tg_request_id": record.get("request_id", ""),
        "_tg_request_index": record.get("request_index"),
        "_tg_row": record.get("row", 0),
        "_tg_weight": float(record.get("weight", 1.0)),
        "_tg_slices": list(record.get("slices", [])),
        "_tg_reference": np.asarray(record["reference"], dtype=np.float64).reshape(-1).tolist(),
        "_tg_candidate": np.asarray(record["candidate"], dtype=np.float64).reshape(-1).tolist(),
        "_tg_time": datetime.now(timezone.utc).isoformat(),
    })
    for m, v in record.get("metrics", {}).items():
        row[f"_tg_metric_{m}"] = float(v)
    return row


def parquet_bytes(rows: list[dict[str, Any]]) -> bytes:
    """Parquet file content of the rows (pyarrow)."""
    buf = io.BytesIO()
    pd.DataFrame(rows).to_parquet(buf, index=False)
    return buf.getvalue()


def make_s3_client(s3: MonitorS3Spec) -> Any:
    """A boto3 S3 client for the spec's endpoint/region with short timeouts and one attempt (the spool retries)."""
    import boto3
    from botocore.config import Config

    cfg = Config(connect_timeout=2, read_timeout=10, retries={"max_attempts": 1, "mode": "standard"})
    return boto3.client("s3", endpoint_url=s3.endpoint_url, region_name=s3.region or "us-east-1", config=cfg)


class PairSink:
    """Buffers sampled-pair records and writes Parquet batches to S3, spooling what S3 does not take.

    Args:
        s3: bucket, prefix, endpoint, batch size and intervals.
        spool_dir: spool folder (created).
        spool_max_bytes: spool bound (bytes).
        redact_fields: input names / parameters to redact.
        model: model name (part of the object key).
        metrics: collectors (s3_uploads_total, spool_bytes).
        client: a boto3 S3 client (default: `make_s3_client(s3)`).
        max_pending: records waiting for the writer thread; more are refused (counted in `refused`).
        clock: monotonic clock (s), for tests.
    """

    def __init__(self, s3: MonitorS3Spec, spool_dir: str | Path, spool_max_bytes: int, *,
                 redact_fields: list[str] | tuple[str, ...] = (), model: str = "model",
                 metrics: MonitorMetrics | None = None, client: Any = None, max_pending: int = 10_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.s3 = s3
        self.spool = Path(spool_dir)
        self.spool.mkdir(parents=True, exist_ok=True)
        self.spool_max_bytes = spool_max_bytes
        self.redact = set(redact_fields)
        self.model = model
        self.metrics = metrics or MonitorMetrics()
        self.client = client if client is not None else make_s3_client(s3)
        self.clock = clock
        self.pending: queue.Queue[dict[str, Any]] = queue.Queue(maxsize=max_pending)
        self.buffer: list[dict[str, Any]] = []
        self.refused = 0
        self._last_flush = clock()
        self._last_retry = clock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.metrics.spool_bytes.set(self.spool_bytes())

    # ---------------------------------------------------------------------------------------- intake
    def submit(self, record: dict[str, Any]) -> bool:
        """Queue one record without blocking; False (and counted in `refused`) when the queue is full."""
        try:
            self.pending.put_nowait(redact_row(record, self.redact))
            return True
        except queue.Full:
            self.refused += 1
            return False

    def start(self) -> "PairSink":
        """Start the writer thread."""
        self._thread = threading.Thread(target=self._loop, name="tailguard-s3-sink", daemon=True)
        self._thread.start()
        return self

    def close(self, timeout: float = 10.0) -> None:
        """Stop the writer thread, then flush what is buffered (to S3 or the spool)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self._drain()
        if self.buffer:
            self.flush()

    def _drain(self) -> None:
        while True:
            try:
                self.buffer.append(self.pending.get_nowait())
            except queue.Empty:
                return

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.buffer.append(self.pending.get(timeout=0.2))
                self._drain()
            except queue.Empty:
                pass
            self.tick()

    def tick(self) -> None:
        """Flush full or old batches and retry the spool when due (the writer thread calls this)."""
        now = self.clock()
        while len(self.buffer) >= self.s3.batch_rows:
            self._flush_rows(self.buffer[: self.s3.batch_rows])
            self.buffer = self.buffer[self.s3.batch_rows:]
            self._last_flush = now
        if self.buffer and now - self._last_flush >= self.s3.flush_interval_s:
            self.flush()
        if now - self._last_retry >= self.s3.retry_interval_s:
            self.retry_spool()

    # ---------------------------------------------------------------------------------------- output
    def flush(self) -> None:
        """Write every buffered row as one batch now."""
        rows, self.buffer = self.buffer, []
        if rows:
            self._flush_rows(rows)
        self._last_flush = self.clock()

    def _key(self) -> str:
        day = datetime.now(timezone.utc).strftime("%Y-%m-%d")
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%f")
        return f"{self.s3.prefix.strip('/')}/{self.model}/{day}/{stamp}-{uuid.uuid4().hex[:8]}.parquet"

    def _put(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.s3.bucket, Key=key, Body=data)

    def _flush_rows(self, rows: list[dict[str, Any]]) -> None:
        data = parquet_bytes(rows)
        key = self._key()
        try:
            self._put(key, data)
            self.metrics.s3_uploads.labels("ok").inc()
            return
        except Exception as exc:  # botocore raises many types (connection, credentials, client errors)
            log.warning("S3 upload of %s failed (%s); spooling", key, str(exc).splitlines()[0][:200])
        with self._lock:
            if self.spool_bytes() + len(data) > self.spool_max_bytes:
                self.metrics.s3_uploads.labels("dropped").inc()
                log.error("spool full (%d bytes bound): dropped a batch of %d rows", self.spool_max_bytes,
                          len(rows))
                return
            path = self.spool / key.replace("/", "__")
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(data)
            tmp.rename(path)
            self.metrics.s3_uploads.labels("spooled").inc()
            self.metrics.spool_bytes.set(self.spool_bytes())

    def spooled(self) -> list[Path]:
        """Spooled batch files, oldest first."""
        return sorted(self.spool.glob("*.parquet"))

    def spool_bytes(self) -> int:
        """Bytes held in the spool."""
        return sum(p.stat().st_size for p in self.spool.glob("*.parquet"))

    def retry_spool(self) -> int:
        """Upload spooled batches, oldest first, stopping at the first failure.

        Returns:
            Number of batches uploaded (and removed from the spool).
        """
        self._last_retry = self.clock()
        done = 0
        with self._lock:
            for path in self.spooled():
                key = path.name.replace("__", "/")
                try:
                    self._put(key, path.read_bytes())
                except Exception as exc:  # still down: keep the file, try again later
                    log.info("spool retry failed (%s); %d batch(es) waiting", str(exc).splitlines()[0][:200],
                             len(self.spooled()))
                    break
                path.unlink()
                done += 1
                self.metrics.s3_uploads.labels("retried_ok").inc()
            self.metrics.spool_bytes.set(self.spool_bytes())
        return done
