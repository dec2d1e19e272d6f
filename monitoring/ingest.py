"""Ingest of a monitor process: an OIP request (HTTP JSON or binary, /pairs, a payload-logger CloudEvent, or a
request gRPC decoded) checked, counted, sampled and queued for the shadow worker, without waiting for any model.

Ingest parses and checks the body (HTTP: on a parse thread, `MonitorService.parse_pool`, or from
PROCESS_PARSE_BYTES in a worker process, monitoring/parsing.py: the event loop that serves /healthz only reads
bodies and never parses one), draws the sampling decision and puts a sampled request on a bounded queue with
`put_nowait`. A full queue drops the request (`dropped_total{reason="queue_full"}`).
Ingest answers 200 with `{"model_name", "id", "outputs": [], "parameters": {"tailguard.sampled": bool}}` (the
mirror's response is discarded by Istio); malformed bodies get 4xx with `{"error", "reason"}`. The logger
endpoint answers 200 `{"model_name", "id", "joined": false}` for a half that waits for its partner, and the
ingest answer plus `"joined": true` for the half that completes a pair; a waiting half is kept as its raw body
and parsed again at the join; halves that expire (monitoring.logger_join_ttl_s) or overflow the buffer
(monitoring.logger_join_max_entries, logger_join_max_bytes) are counted as
`dropped_total{reason="unmatched"|"join_overflow"}`, a first half over logger_join_max_entry_bytes is refused (413
join_entry_too_large).

Limits (monitoring/oip.py): a body over monitoring.max_body_bytes is refused from its Content-Length, or while it
is read, before any parsing (413 body_too_large, monitoring/body_budget.py); then JSON nesting (400 too_deep),
binary sections against shapes and datatypes before anything is allocated (400 bad_header_length,
binary_size_mismatch, truncated_binary, trailing_binary, bad_bytes_prefix), batch rows (monitoring.max_batch_rows,
413 batch_too_large), shapes, NaN/Inf inputs (422 non_finite_input). Admission (sampler, sequence numbers) is
serialized by a lock: it runs on the event loop and on the gRPC threads. Request parameters named in
monitoring.redact_fields are replaced by '<redacted>' at admission, so a redacted slice column gives the key
`<name>=<redacted>` everywhere (statistics, /metrics, /v1/slices, alerts, evidence, S3, Evidently).
`IngestMixin` is the part of `MonitorService` (monitoring/service.py) that does it.
"""

from __future__ import annotations

import dataclasses
import queue
import time
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from tailguard.core.errors import InputError
from tailguard.monitoring.config import MonitorConfig, SliceRule
from tailguard.monitoring.join import CE_TYPES, EntryTooLarge
from tailguard.monitoring.oip import (
    BINARY_HEADER,
    InferRequest,
    OipError,
    check_batch,
    load_json,
    parse_request,
    utf8_text,
)
from tailguard.monitoring.parsing import parse_body, parse_half
from tailguard.monitoring.worker import SampledRequest

REDACTED = "<redacted>"  # the value of a redacted parameter (the S3 sink writes the same text)
# threads that parse HTTP ingest bodies (JSON, binary sections, CloudEvents headers), off the event loop that serves
# /healthz; more requests wait for one (at most monitoring.max_concurrent_requests are in flight)
PARSE_WORKERS = 4


def redact_params(params: dict[str, Any], fields: frozenset[str]) -> dict[str, Any]:
    """Request parameters with those in `fields` (monitoring.redact_fields) replaced by '<redacted>' (absent stay
    absent, null stays null): what the slice keys, and every record that leaves the process, are made from."""
    if not fields or fields.isdisjoint(params):
        return params
    return {k: REDACTED if k in fields and v is not None else v for k, v in params.items()}


def _event_header(h: Mapping[str, str], half: str) -> str | None:
    """The JSON length of a payload-logger half in binary extension form: the event's own
    `Inference-Header-Content-Length`, else (request half only) the one KServe's logger copied into `ce-metadata`
    ({"Inference-Header-Content-Length": ["123"]}, when listed in `logger.metadataHeaders`); None: a JSON body.
    An unreadable ce-metadata is KServe's, not the body's: it is ignored."""
    if BINARY_HEADER in h:
        return h[BINARY_HEADER]
    if half != "request" or not h.get("ce-metadata"):
        return None
    try:
        meta = load_json(h["ce-metadata"], max_bytes=65536, what="ce-metadata")
    except OipError:
        return None
    for k, v in (meta.items() if isinstance(meta, dict) else ()):
        if str(k).lower() == BINARY_HEADER and isinstance(v, list) and v:
            return str(v[0])
    return None


def redacted_config(cfg: MonitorConfig, fields: frozenset[str] | set[str]) -> MonitorConfig:
    """`cfg` with each slice rule that reads a redacted field (by column or name) grouping by plain value, so the
    redacted value '<redacted>' gives the key `<name>=<redacted>` whatever the rule's bins or values."""
    rules = [SliceRule(r.name, r.column, source=r.source) if not r.derived and (r.column in fields or r.name in fields)
             else r for r in cfg.rules]
    return cfg if rules == cfg.rules else dataclasses.replace(cfg, rules=rules)


class IngestMixin:
    """Ingest and admission of `MonitorService` (monitoring/service.py), whose __init__ sets the state they read:
    `cfg`, `metrics`, `monitor` (admission: slice keys and the sampling decision), `parser` (a BodyParser),
    `join` (the payload-logger JoinBuffer), `redact` (monitoring.redact_fields), `runners`, `queue` (of
    SampledRequest, for the shadow worker), `_admit_lock` and `_seq`; it calls `_drop` (ReadinessMixin)."""

    @property
    def max_body_bytes(self) -> int:
        """Largest ingest body accepted (monitoring.max_body_bytes)."""
        return int(self.cfg.mon.max_body_bytes)

    def _parse_request(self, body: bytes | dict, header: str | None = None) -> InferRequest:
        return parse_request(body, self.cfg.inputs, max_bytes=self.max_body_bytes,
                             max_batch_rows=self.cfg.mon.max_batch_rows, header=header)

    def refuse_oversized(self, endpoint: str) -> tuple[int, dict[str, Any]]:
        """The answer to a body the app stopped reading at max_body_bytes (413 body_too_large, counted)."""
        return self.refuse_body(endpoint, "body_too_large")

    def refuse_body(self, endpoint: str, reason: str | None) -> tuple[int, dict[str, Any]]:
        """The answer to a body the app did not read or parse (counted in invalid_requests_total{reason}): 413
        `body_too_large` (over monitoring.max_body_bytes), 503 `body_budget_exceeded` (the bodies in flight hold
        monitoring.max_inflight_body_bytes; retry), 400 `client_disconnected` (the client left mid-body), 408
        `body_read_timeout` (not all there within monitoring.body_read_timeout_s), 503 `too_many_requests`
        (monitoring.max_concurrent_requests bodies being parsed, or every gRPC ingest slot taken; retry)."""
        mon = self.cfg.mon
        if reason == "body_budget_exceeded":
            exc = OipError(reason, f"the bodies being read hold the budget of {mon.max_inflight_body_bytes} bytes "
                                   "(monitoring.max_inflight_body_bytes); retry later", status=503)
        elif reason == "client_disconnected":
            exc = OipError(reason, "the client closed the connection before the body was read", status=400)
        elif reason == "body_read_timeout":
            exc = OipError(reason, f"the body did not arrive within {mon.body_read_timeout_s} s "
                                   "(monitoring.body_read_timeout_s)", status=408)
        elif reason == "too_many_requests":
            exc = OipError(reason, f"more than {mon.max_concurrent_requests} ingest requests in flight "
                                   "(monitoring.max_concurrent_requests); retry later", status=503)
        else:
            exc = OipError("body_too_large", f"body over {self.max_body_bytes} bytes (monitoring.max_body_bytes)",
                           status=413)
        return self._refuse(endpoint, exc, time.perf_counter())

    def ingest(self, endpoint: str, name: str, body: bytes, header: str | None = None,
               headers: Mapping[str, str] | None = None) -> tuple[int, dict[str, Any]]:
        """Handle one OIP body without waiting for any model.

        Args:
            endpoint: "infer" or "pairs".
            name: model name from the path.
            body: raw body: JSON, or with `header` the binary tensor data extension's JSON part and sections (a
                pairs body: the request inputs' sections, then the response outputs').
            header: the `Inference-Header-Content-Length` header (None: a JSON body).
            headers: the request's HTTP headers, for header slices (`slices[].header`); None: none.

        Returns:
            (HTTP status, JSON response): 200, or 4xx with `{"error", "reason"}` (never a 5xx).
        """
        t0 = time.perf_counter()
        try:
            self._check_name(name, endpoint)
            req, cand = self.parser.run(parse_body, endpoint, body, header, size=len(body))
        except OipError as exc:
            return self._refuse(endpoint, exc, t0)
        return self._admit(endpoint, req, cand, t0, self.slice_headers(headers))

    def slice_headers(self, headers: Mapping[str, Any] | Iterable[tuple[str, Any]] | None
                      ) -> dict[str, str] | None:
        """{lower-case name: value} of the headers the header slices read (HTTP headers, gRPC metadata pairs,
        or a logger event's forwarded `ce-metadata` {name: [value]}); None when no slice reads one."""
        names = self.cfg.header_names
        if not names or headers is None:
            return None
        items = headers.items() if isinstance(headers, Mapping) else headers
        out: dict[str, str] = {}
        for k, v in items:
            k = str(k).lower()
            if k in names and k not in out:
                if isinstance(v, list):
                    v = v[0] if v else None
                if isinstance(v, bytes):
                    v = v.decode("utf-8", "replace")
                if v is not None:
                    out[k] = str(v)
        return out

    def ingest_event(self, name: str, headers: Mapping[str, str], body: bytes) -> tuple[int, dict[str, Any]]:
        """Handle one KServe payload-logger CloudEvent (HTTP binary content mode) without waiting for any model.

        The request half is checked against the spec's inputs at once; the response half must be a JSON object
        with an `outputs` list. Either half may be a binary tensor data extension body when its JSON length is
        known: from an `Inference-Header-Content-Length` header on the event, or, for the request half, from
        `ce-metadata` (KServe's logger forwards the request body verbatim, and the request headers listed in the
        InferenceService's `logger.metadataHeaders` as ce-metadata; it forwards no response header, so a binary
        response half needs the header set by whatever posts it). The first half of an id waits in the join
        buffer (answer 200, `"joined": false`);
        the second one completes the pair, which then goes exactly the pairs endpoint's way (`check_batch`:
        response output checked against the request's batch, slice keys, sampling, queue).

        Args:
            name: model name from the path.
            headers: the HTTP headers (`ce-id`, `ce-type`, `ce-metadata`, `inference-header-content-length`
                used; names case-insensitive).
            body: raw body: the OIP request or response (JSON or binary extension).

        Returns:
            (HTTP status, JSON response): 200 when buffered or joined; 4xx with `{"error", "reason"}` for a
            missing `ce-id` (400 missing_ce_id), a `ce-type` other than the two inference types (400
            unknown_ce_type), a structured-mode event (415 structured_mode), a body that is not JSON (400) or
            not a valid OIP request/response (422), a first half over monitoring.logger_join_max_entry_bytes (413
            join_entry_too_large), or a joined pair whose response does not fit its request.
        """
        t0 = time.perf_counter()
        endpoint = "logger"
        h = {k.lower(): v for k, v in headers.items()}
        try:
            self._check_name(name, endpoint)
            ctype = h.get("content-type", "")
            if ctype.startswith("application/cloudevents"):
                raise OipError("structured_mode", f"content type {ctype!r}: send CloudEvents in binary content "
                                                  "mode (ce-* headers, OIP JSON body), as KServe's logger does",
                               status=415)
            event_id = h.get("ce-id", "").strip()
            if not event_id:
                raise OipError("missing_ce_id", "no ce-id header: a payload-logger CloudEvent needs the id that "
                                                "joins a request with its response", status=400)
            half = CE_TYPES.get(h.get("ce-type", ""))
            if half is None:
                raise OipError("unknown_ce_type", f"ce-type {h.get('ce-type', '')!r} is not one of "
                                                  f"{sorted(CE_TYPES)}", status=400)
            header = _event_header(h, half)
            # checked now (a bad half is refused at once); if it has to wait, only its raw bytes are kept and it
            # is parsed again when its partner comes (monitoring/join.py: the byte budget is what is held)
            parsed = self.parser.run(parse_half, half, body, header, size=len(body))
            try:
                pair = self.join.add(event_id, half, (body, header), size=len(body) + len(header or ""))
            except EntryTooLarge as exc:
                raise OipError("join_entry_too_large", f"{exc} (monitoring.logger_join_max_entry_bytes)",
                               status=413) from None
            if pair is None:
                self.metrics.ingest_seconds.labels(endpoint).observe(time.perf_counter() - t0)
                return 200, {"model_name": self.cfg.model_name, "id": event_id, "joined": False}
            other_half = "response" if half == "request" else "request"
            other_body, other_header = pair[1] if half == "request" else pair[0]
            other = self.parser.run(parse_half, other_half, other_body, other_header, size=len(other_body))
            req, cand = (parsed, other) if half == "request" else (other, parsed)
            if not req.id:
                req.id = event_id
            check_batch(cand, req.batch)
        except OipError as exc:
            return self._refuse(endpoint, exc, t0)
        status, doc = self._admit(endpoint, req, cand, t0, self._forwarded(h))
        doc["joined"] = status == 200
        return status, doc

    def _forwarded(self, h: Mapping[str, str]) -> dict[str, str] | None:
        """The header slices' values a KServe logger event forwards in `ce-metadata` (the InferenceService's
        `logger.metadataHeaders`, as {"X-Tenant": ["a"]}); an unreadable ce-metadata forwards none."""
        if not self.cfg.header_names or not h.get("ce-metadata"):
            return None
        try:
            meta = load_json(h["ce-metadata"], max_bytes=65536, what="ce-metadata")
        except OipError:
            return None
        return self.slice_headers(meta) if isinstance(meta, dict) else None

    def sweep(self) -> int:
        """Drop payload-logger halves older than monitoring.logger_join_ttl_s (counted); returns how many."""
        return self.join.sweep()

    def ingest_decoded(self, endpoint: str, name: str, decode: Callable[[], dict[str, Any]],
                       headers: Iterable[tuple[str, Any]] | None = None) -> tuple[int, dict[str, Any]]:
        """Handle one request that another transport decoded (gRPC ModelInfer: monitoring/grpc_ingest.py) the
        /infer way: model name, the OIP checks of `parse_request`, then the same admission (`_admit`).

        Args:
            endpoint: metrics label ("grpc").
            name: the requested model name.
            decode: returns the request as an OIP dict (tensors' `data` may be arrays), or raises OipError.
            headers: the call's metadata (gRPC invocation metadata pairs), for header slices.

        Returns:
            (HTTP-style status, JSON-style answer), as `ingest`; a refusal is counted by reason.
        """
        t0 = time.perf_counter()
        try:
            self._check_name(name, endpoint)
            req = self._parse_request(decode())
        except OipError as exc:
            return self._refuse(endpoint, exc, t0)
        return self._admit(endpoint, req, None, t0, self.slice_headers(headers))

    def _check_name(self, name: str, endpoint: str) -> None:
        if name != self.cfg.model_name:
            where = (f"model_name {self.cfg.model_name!r}" if endpoint == "grpc"
                     else f"/v2/models/{self.cfg.model_name}/{endpoint}")
            raise OipError("unknown_model", f"model {utf8_text(str(name))[:200]!r} is not monitored here; use {where}",
                           status=404)

    def _refuse(self, endpoint: str, exc: OipError, t0: float) -> tuple[int, dict[str, Any]]:
        self.metrics.invalid_requests.labels(exc.reason).inc()
        self.metrics.ingest_seconds.labels(endpoint).observe(time.perf_counter() - t0)
        return exc.status, {"error": exc.message, "reason": exc.reason}

    def _admit(self, endpoint: str, req: InferRequest, cand: np.ndarray | None,
               t0: float, headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
        """Count, draw the sampling decision and put a sampled request on the queue (never blocks)."""
        m = self.metrics
        meta = redact_params(req.parameters, self.redact)
        try:
            with self._admit_lock:  # the sampler's counts and draws, and the sequence number, are not thread-safe
                keys, decision = self.monitor.admit(meta, req.feeds, headers)
                self._seq += 1
                seq = self._seq
        except InputError as exc:  # a derived slice cannot be computed from this request's tensors
            return self._refuse(endpoint, OipError("bad_shape", f"{exc}"), t0)
        m.requests.labels(self.cfg.model_name, endpoint).inc()
        if decision.sampled:
            if self.runners["reference"] is None:
                self._drop("reference_missing")
            else:
                item = SampledRequest(keys, decision, req.feeds, meta, req.id, seq, endpoint, cand)
                try:
                    self.queue.put_nowait(item)
                except queue.Full:
                    self._drop("queue_full")
            m.queue_depth.set(self.queue.qsize())
        m.ingest_seconds.labels(endpoint).observe(time.perf_counter() - t0)
        return 200, {"model_name": self.cfg.model_name, "id": req.id, "outputs": [],
                     "parameters": {"tailguard.sampled": decision.sampled}}
