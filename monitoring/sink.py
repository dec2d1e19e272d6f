"""Sampled pairs to S3 as Parquet batches (boto3), with redaction and a bounded local spool.

A batch is one Parquet object laid out like validation data, so it can be replayed as is
(`tailguard monitor replay --requests batch.parquet`): one column per model input (the row's values, flattened;
None when redacted), one column per request parameter (its value as text, `'<redacted>'` when redacted), and
monitor columns prefixed `_tg_`: request id, request index, row, weight, slices, reference and candidate outputs
(flattened), per-row metrics, a UTC time stamp, and `_tg_meta`: the written request parameters as a JSON object
({name: text}, redacted alike). Only parameters that a slice rule reads (the spec's slice columns) are written:
the caller chooses parameter names, and each distinct name would be a Parquet column (128 names x 500 rows could
make ~64k columns in one object), so every other parameter is dropped and counted in
`tailguard_monitor_sink_parameters_dropped_total` (one per parameter and row). A parameter named like a model input
or starting with `_tg_` gets no column of its own (it would overwrite that column): it is kept in `_tg_meta` only.
Redaction covers the slice keys too: a slice that reads a redacted field is written `<name>=<redacted>` in
`_tg_slices`. Text that UTF-8 cannot encode (lone surrogates) is written with "?" in their place.

The writer thread is supervised: a row that cannot be written (or converted) is dropped alone and counted in
`tailguard_monitor_dropped_total{reason="sink_error"}`, the rest of its batch is written, and no error ends the
thread. Rows refused because the writer's queue is full are counted as `dropped_total{reason="sink_full"}`.

When S3 refuses a batch (down, unreachable, access denied) it is written to the spool folder; spooled batches
are retried every `retry_interval_s`, oldest first, and deleted once uploaded. The spool is bounded by
`spool_max_bytes`: a batch that does not fit is dropped and counted (`s3_uploads_total{status="dropped"}`), so
nothing is lost within the bound and memory/disk stay bounded beyond it.
"""

from __future__ import annotations

import io
import json
import logging
import queue
import threading
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Collection, Sequence

import numpy as np
import pandas as pd

from tailguard.core.spec.monitor import MonitorS3Spec
from tailguard.monitoring.prometheus import MonitorMetrics

log = logging.getLogger("tailguard.monitoring.sink")
REDACTED = "<redacted>"
MONITOR_PREFIX = "_tg_"
SLICE_PAIR_SEPARATOR = "&"  # as in monitoring/config.py slice keys


def _utf8(text: str) -> str:
    return text if text.isascii() else text.encode("utf-8", "replace").decode("utf-8")


def redact_slices(keys: Sequence[str], fields: Collection[str], rules: Sequence[tuple[str, str]] = (),
                  pairs: Sequence[tuple[int, int]] = ()) -> list[str]:
    """Slice keys with every slice that reads a redacted field written `<name>=<redacted>`.

    Args:
        keys: a request's keys as MonitorConfig.slice_keys lays them out: "all", one per rule, one per pair.
        fields: redacted names (a rule is redacted when its name or its column is one of them).
        rules: (name, column) of the slice rules in order (MonitorConfig.rules); with them and `pairs` the keys are
            rebuilt by position, whatever their values contain.
        pairs: (i, j) rule indices of the pair keys (MonitorConfig.pairs).

    Returns:
        The keys, redacted. Without `rules` (or when the keys do not have that layout), a key from the position of
        `<field>=` on is replaced by `<field>=<redacted>` (it may hide the second half of a pair key; never leaks).
    """
    if rules and len(keys) == 1 + len(rules) + len(pairs):
        hidden = [name in fields or column in fields for name, column in rules]
        if not any(hidden):
            return list(keys)
        parts = [f"{name}={REDACTED}" if h else keys[1 + i] for i, ((name, _), h) in enumerate(zip(rules, hidden))]
        return [keys[0], *parts, *(parts[i] + SLICE_PAIR_SEPARATOR + parts[j] for i, j in pairs)]
    names = set(fields) | {name for name, column in rules if column in fields}
    out = []
    for key in keys:
        for name in names:
            tag = f"{name}="
            at = 0 if key.startswith(tag) else key.find(SLICE_PAIR_SEPARATOR + tag) + 1
            if key.startswith(tag) or at > 0:
                key = key[:at] + tag + REDACTED
        out.append(key)
    return out


def redact_row(record: dict[str, Any], fields: Collection[str], rules: Sequence[tuple[str, str]] = (),
               pairs: Sequence[tuple[int, int]] = (), params: Collection[str] | None = None) -> dict[str, Any]:
    """One sampled-pair record as a flat Parquet row, with `fields` (input names or parameters) redacted.

    Args:
        record: a record from SliceMonitor.observe (inputs, meta, slices, reference, candidate, metrics, ...).
        fields: names to redact.
        rules: (name, column) per slice rule, pairs: rule indices of pair keys (see `redact_slices`).
        params: the request parameters written (`sink_parameters(rules)`: the slice columns); the others are
            left out of the row and of `_tg_meta` (`dropped_parameters` counts them). None: every parameter.

    Returns:
        {column: value}: input columns (list of numbers, None if redacted), parameter columns
        ('<redacted>' if redacted, else the value as text; none for a parameter named like an input or `_tg_*`),
        `_tg_*` monitor columns (`_tg_meta`: the written parameters, JSON; `_tg_slices`: redacted slice keys).
    """
    row: dict[str, Any] = {}
    inputs = record.get("inputs", {})
    for k, v in inputs.items():
        row[k] = None if k in fields else np.asarray(v).reshape(-1).tolist()
    meta: dict[str, str | None] = {}
    for k, v in record.get("meta", {}).items():
        if params is not None and k not in params:
            continue
        name = _utf8(str(k))
        meta[name] = REDACTED if k in fields or name in fields else (None if v is None else _utf8(str(v)))
        if name not in inputs and not name.startswith(MONITOR_PREFIX):  # never overwrite an input / monitor column
            row[name] = meta[name]
    row.update({
        "_tg_request_id": _utf8(str(record.get("request_id", ""))),
        "_tg_request_index": record.get("request_index"),
        "_tg_row": record.get("row", 0),
        "_tg_weight": float(record.get("weight", 1.0)),
        "_tg_slices": [_utf8(k) for k in redact_slices(list(record.get("slices", [])), fields, rules, pairs)],
        "_tg_meta": json.dumps(meta, ensure_ascii=False, sort_keys=True),
        "_tg_reference": np.asarray(record["reference"], dtype=np.float64).reshape(-1).tolist(),
        "_tg_candidate": np.asarray(record["candidate"], dtype=np.float64).reshape(-1).tolist(),
        "_tg_time": datetime.now(timezone.utc).isoformat(),
        # live | recomputed | recomputed_other_node (monitoring/node_check.py); None when not recorded (replay)
        "_tg_candidate_source": record.get("candidate_source"),
    })
    for m, v in record.get("metrics", {}).items():
        row[f"_tg_metric_{m}"] = float(v)
    return row


def sink_parameters(rules: Sequence[tuple[str, str]]) -> frozenset[str]:
    """The request parameters the S3 sink writes: the columns the slice rules read ((name, column) pairs)."""
    return frozenset(column for _, column in rules)


def dropped_parameters(record: dict[str, Any], params: Collection[str]) -> int:
    """How many of a record's request parameters `redact_row(..., params=params)` leaves out."""
    return sum(1 for k in record.get("meta", {}) if k not in params)


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
        metrics: collectors (s3_uploads_total, spool_bytes, dropped_total{reason="sink_full"|"sink_error"},
            sink_parameters_dropped_total).
        client: a boto3 S3 client (default: `make_s3_client(s3)`).
        max_pending: records waiting for the writer thread; more are refused (counted in `refused` and
            dropped_total{reason="sink_full"}).
        clock: monotonic clock (s), for tests.
        slice_rules: (name, column) of the slice rules (MonitorConfig.rules), for redacting slice keys; their
            columns are the only request parameters written (`sink_parameters`).
        slice_pairs: (i, j) rule indices of the pair keys (MonitorConfig.pairs).
    """

    def __init__(self, s3: MonitorS3Spec, spool_dir: str | Path, spool_max_bytes: int, *,
                 redact_fields: list[str] | tuple[str, ...] = (), model: str = "model",
                 metrics: MonitorMetrics | None = None, client: Any = None, max_pending: int = 10_000,
                 clock: Callable[[], float] = time.monotonic, slice_rules: Sequence[tuple[str, str]] = (),
                 slice_pairs: Sequence[tuple[int, int]] = ()) -> None:
        self.s3 = s3
        self.spool = Path(spool_dir)
        self.spool.mkdir(parents=True, exist_ok=True)
        self.spool_max_bytes = spool_max_bytes
        self.redact = set(redact_fields)
        self.slice_rules = [(str(n), str(c)) for n, c in slice_rules]
        self.slice_pairs = [(int(i), int(j)) for i, j in slice_pairs]
        self.params = sink_parameters(self.slice_rules)
        self.model = model
        self.metrics = metrics or MonitorMetrics()
        self.client = client if client is not None else make_s3_client(s3)
        self.clock = clock
        self.pending: queue.Queue[dict[str, Any]] = queue.Queue(maxsize=max_pending)
        self.buffer: list[dict[str, Any]] = []
        self.refused = 0  # rows refused at submit (queue full or not convertible); also in dropped_total
        self.lost = 0  # rows the writer could not write (dropped_total{reason="sink_error"})
        self._last_flush = clock()
        self._last_retry = clock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.metrics.spool_bytes.set(self.spool_bytes())

    # ---------------------------------------------------------------------------------------- intake
    def submit(self, record: dict[str, Any]) -> bool:
        """Queue one record without blocking; False (counted in `refused` and dropped_total) when the queue is full
        (reason sink_full) or the record cannot be made a row (reason sink_error). Never raises."""
        try:
            row = redact_row(record, self.redact, self.slice_rules, self.slice_pairs, params=self.params)
            dropped = dropped_parameters(record, self.params)
            if dropped:
                self.metrics.sink_parameters_dropped.inc(dropped)
        except Exception as exc:  # a malformed record must not reach the caller (the service's worker)
            log.warning("sampled pair not written to S3: %s", str(exc).splitlines()[0][:200] if str(exc) else exc)
            self.refused += 1
            self._count_lost(1, refused=True)
            return False
        try:
            self.pending.put_nowait(row)
            return True
        except queue.Full:
            self.refused += 1
            self.metrics.dropped.labels("sink_full").inc()
            return False

    def _count_lost(self, n: int, *, refused: bool = False) -> None:
        if n:
            if not refused:
                self.lost += n
            self.metrics.dropped.labels("sink_error").inc(n)

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

    def alive(self) -> bool:
        """True while the writer thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                try:
                    self.buffer.append(self.pending.get(timeout=0.2))
                    self._drain()
                except queue.Empty:
                    pass
                self.tick()
            except Exception:  # supervision: nothing ends the writer; what was in hand is counted as lost
                log.exception("S3 sink writer error; %d buffered row(s) dropped, writer continues", len(self.buffer))
                self._count_lost(len(self.buffer))
                self.buffer = []
                self._last_flush = self.clock()

    def tick(self) -> None:
        """Flush full or old batches and retry the spool when due (the writer thread calls this)."""
        now = self.clock()
        while len(self.buffer) >= self.s3.batch_rows:
            rows = self.buffer[: self.s3.batch_rows]
            self.buffer = self.buffer[self.s3.batch_rows:]
            self._last_flush = now
            self._flush_rows(rows)
        if self.buffer and now - self._last_flush >= self.s3.flush_interval_s:
            self.flush()
        if now - self._last_retry >= self.s3.retry_interval_s:
            try:
                self.retry_spool()
            except Exception:  # e.g. the spool folder vanished: try again at the next interval
                log.exception("spool retry failed")

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

    def _encode(self, rows: list[dict[str, Any]]) -> tuple[bytes | None, int]:
        """(Parquet bytes, rows in them): a batch that does not convert is retried row by row; the rows that
        cannot be written alone are dropped and counted (sink_error), the others written together."""
        try:
            return parquet_bytes(rows), len(rows)
        except Exception as exc:
            log.warning("a batch of %d rows did not convert to Parquet (%s); isolating the bad rows", len(rows),
                        str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__)
        good = []
        for row in rows:
            try:
                parquet_bytes([row])
                good.append(row)
            except Exception:
                pass
        self._count_lost(len(rows) - len(good))
        if not good:
            return None, 0
        try:
            return parquet_bytes(good), len(good)
        except Exception:  # rows that convert alone but not together: give up on the batch, counted
            self._count_lost(len(good))
            return None, 0

    def _flush_rows(self, rows: list[dict[str, Any]]) -> None:
        """Write one batch to S3, else to the spool; never raises (what cannot be written is counted)."""
        data, n = self._encode(rows)
        if data is None:
            return
        key = self._key()
        try:
            self._put(key, data)
            self.metrics.s3_uploads.labels("ok").inc()
            return
        except Exception as exc:  # botocore raises many types (connection, credentials, client errors)
            log.warning("S3 upload of %s failed (%s); spooling", key,
                        str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__)
        with self._lock:
            try:
                if self.spool_bytes() + len(data) > self.spool_max_bytes:
                    self.metrics.s3_uploads.labels("dropped").inc()
                    log.error("spool full (%d bytes bound): dropped a batch of %d rows", self.spool_max_bytes, n)
                    return
                path = self.spool / key.replace("/", "__")
                tmp = path.with_suffix(".tmp")
                tmp.write_bytes(data)
                tmp.rename(path)
                self.metrics.s3_uploads.labels("spooled").inc()
                self.metrics.spool_bytes.set(self.spool_bytes())
            except OSError as exc:  # disk full, folder removed: the batch is lost, counted
                self.metrics.s3_uploads.labels("dropped").inc()
                log.error("spool write failed (%s): dropped a batch of %d rows", exc, n)

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
