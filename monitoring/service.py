"""The shadow monitor's HTTP service (FastAPI + uvicorn).

Endpoints:
    POST /v2/models/{name}/infer   OIP request, as Istio mirroring sends it; the monitor runs both models.
    POST /v2/models/{name}/pairs   {"request": OIP request, "response": OIP response}: the live response is the
                                   candidate's output (as a KServe payload logger records it).
    POST /v2/models/{name}/logger  one KServe payload-logger CloudEvent (binary content mode: ce-id, ce-type
                                   headers; body the OIP request or response). Request and response are joined
                                   by ce-id in a bounded buffer (monitoring/join.py), then go the pairs way.
    The three take JSON, or the OIP binary tensor data extension (`Inference-Header-Content-Length` header; on
    /logger also read from ce-metadata for the request half; /pairs: the JSON part, then the request inputs'
    sections, then the response outputs'; monitoring/oip.py). Answers are JSON.
    gRPC (`monitor serve --grpc-port`, monitoring/grpc_ingest.py): inference.GRPCInferenceService ModelInfer,
                                   ServerLive, ServerReady, ModelReady, ServerMetadata, ModelMetadata; ModelInfer
                                   goes the /infer way (metrics endpoint="grpc").
    GET  /metrics                  Prometheus text format (names: monitoring/prometheus.py METRIC_NAMES).
    GET  /healthz                  200 while the process serves.
    GET  /v2/health/live, /v2/health/ready, /v2/models/{name}/ready, /v2/models/{name}
                                   the Open Inference Protocol's liveness (200), readiness (200 as /readyz, else
                                   503), model readiness and metadata (404 unknown_model for another name), so
                                   KServe v2 / Triton clients' is_server_ready, is_model_ready and
                                   get_model_metadata work against the monitor.
    GET  /readyz                   200 once the models are loaded (reference, and candidate unless pairs-only or
                                   noise-floor mode) and answering, else 503 with what is missing or failing
                                   (every one of a model's last HEALTH_WINDOW calls failed). `node_check` /
                                   `node_mismatch`: this node against the nodes the candidate was validated on
                                   (monitoring/node_check.py; a mismatch leaves the monitor ready).
    Probe port (`monitoring.probe_port`, `monitor serve --probe-port`; default 8082, 0 = off): /healthz, /readyz,
                                   /metrics (and /v2/health/live, /v2/health/ready) again, from a server of their
                                   own (`ProbeServer`, stdlib threads) that the ingest port's connections cannot
                                   starve: kubelet probes and Prometheus scrapes go there (issue 36 item 5).
    GET  /v1/alerts, /v1/slices    alert records and per-slice statistics (JSON; /v1/slices?offset=&limit= pages
                                   through every tracked slice in key order, limit <= 10000, default 1000).

Isolation of the live path: ingest parses and checks the body (on a parse thread, `MonitorService.parse_pool`:
the event loop that serves /healthz only reads bodies and never parses one), draws the sampling decision and puts
a sampled request on a bounded queue with `put_nowait`; it never waits for a model. A full queue drops the request
(`dropped_total{reason="queue_full"}`). A worker thread runs the models, each call in its own one-thread pool
with a timeout: a slow, crashing, NaN-returning or missing reference only moves `dropped_total{reason=...}`.
Ingest answers 200 with `{"model_name", "id", "outputs": [], "parameters": {"tailguard.sampled": bool}}` (the
mirror's response is discarded by Istio); malformed bodies get 4xx with `{"error", "reason"}`. The logger
endpoint answers 200 `{"model_name", "id", "joined": false}` for a half that waits for its partner, and the
ingest answer plus `"joined": true` for the half that completes a pair; a waiting half is kept as its raw body
and parsed again at the join; halves that expire (monitoring.logger_join_ttl_s) or overflow the buffer
(monitoring.logger_join_max_entries, logger_join_max_bytes) are counted as
`dropped_total{reason="unmatched"|"join_overflow"}`, a first half over logger_join_max_entry_bytes is refused (413
join_entry_too_large).

Before any route (`_Guard`, before a body is read): the bearer token when one is configured (monitoring.auth_token_env
/ auth_token_file / --auth-token-file; every route but /healthz, /readyz and /metrics as configured; 401
unauthenticated). Ingest bodies are read within monitoring.max_inflight_body_bytes over all requests in flight
(bytes reserved as they arrive; 503 body_budget_exceeded) and monitoring.body_read_timeout_s each (408
body_read_timeout); then at most monitoring.max_concurrent_requests bodies are parsed at once (503
too_many_requests), on parse threads or, from PROCESS_PARSE_BYTES, worker processes (monitoring/parsing.py), never
on the event loop that answers /healthz. /v1/slices and /v1/evidence build their entries in chunks of READ_CHUNK
slices, each under the worker lock, never all of them at once.

Limits (monitoring/oip.py): a body over monitoring.max_body_bytes is refused from its Content-Length, or while it
is read, before any parsing (413 body_too_large); then JSON nesting (400 too_deep), binary sections against shapes
and datatypes before anything is allocated (400 bad_header_length, binary_size_mismatch, truncated_binary,
trailing_binary, bad_bytes_prefix), batch rows (monitoring.max_batch_rows, 413 batch_too_large), shapes, NaN/Inf
inputs (422 non_finite_input). Admission (sampler, sequence numbers) is serialized by a lock: it runs on the
event loop and on the gRPC threads. Request parameters
named in monitoring.redact_fields are replaced by '<redacted>' at admission, so a redacted slice column gives the
key `<name>=<redacted>` everywhere (statistics, /metrics, /v1/slices, alerts, evidence, S3, Evidently).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures as cf
import contextlib
import dataclasses
import functools
import http.server
import json
import logging
import queue
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterable, Mapping

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import Counter, Gauge

from tailguard.core.errors import InputError, TailguardError
from tailguard.core.home import home
from tailguard.core.pt2_archive import MONITOR_FIX, check_pt2_archive
from tailguard.core.runtime import Runner, runner_for_file
from tailguard.core.spec import load_spec
from tailguard.core.spec.models import Spec
from tailguard.monitoring.combine import (
    INCOMPLETE_REASONS,
    WAIT_POLLS,
    Combiner,
    PeerError,
    PollLoop,
    http_fetch,
    peers_from_dns,
)
from tailguard.monitoring.compare import compare_rows
from tailguard.monitoring.config import (
    BearerAuth,
    MonitorConfig,
    NewValueLimiter,
    SliceRule,
    load_auth_token,
    resolve_config,
)
from tailguard.monitoring.engine import MonitorEngine
from tailguard.monitoring.join import CE_TYPES, EntryTooLarge, JoinBuffer
from tailguard.monitoring.node_check import NodeCheck, NodeCheckStatus, run_node_check
from tailguard.monitoring.oip import (
    BINARY_HEADER,
    SPEC_TO_OIP,
    InferRequest,
    OipError,
    check_batch,
    load_json,
    parse_request,
    utf8_text,
)
from tailguard.monitoring.parsing import BodyParser, ParseLimits, parse_body, parse_half
from tailguard.monitoring.prometheus import CANDIDATE_SOURCES, MonitorMetrics
from tailguard.monitoring.sampler import Decision

log = logging.getLogger("tailguard.monitoring.service")
HEALTH_WINDOW = 20  # /readyz answers 503 while each of a model's last 20 calls failed (error, timeout, bad output)
REDACTED = "<redacted>"  # the value of a redacted parameter (the S3 sink writes the same text)
READ_CHUNK = 512  # slice entries /v1/evidence and /v1/slices build per hold of the worker lock
# uvicorn's limit_concurrency = max_concurrent_requests + this: it counts open connections (idle keep-alive ones of
# every mirroring Envoy too) and tasks, so it is a memory bound far above the app's own limit, not the limit itself
CONNECTION_HEADROOM = 1024
# threads that parse HTTP ingest bodies (JSON, binary sections, CloudEvents headers), off the event loop that serves
# /healthz; more requests wait for one (at most monitoring.max_concurrent_requests are in flight)
PARSE_WORKERS = 4
# the probe port's server (ProbeServer): a client must deliver its request line and headers within this many
# seconds, else its connection is closed (kubelet probes and Prometheus scrapes send theirs at once)
PROBE_READ_TIMEOUT_S = 10.0
# Drops that are seen (issue 38 items 6, 7): /readyz is `degraded` (503) while more than monitoring.max_drop_rate of
# the sampled requests of the last DROP_WINDOW_S seconds were dropped uncompared, once at least DROP_MIN_SAMPLED
# were sampled in that window (a few drops at start, a model's first slow call, do not flip it). A window in
# seconds, not in requests: an unready pod gets no mirrored traffic, so a window of requests would never empty and
# the pod would never be ready again; this one empties a minute after the drops stop.
DROP_WINDOW_S = 60.0
DROP_MIN_SAMPLED = 20
# Reasons a sampled request is dropped uncompared (what the drop rate counts): the monitor's own failures to keep
# up. reference_missing makes /readyz 503 by itself (`missing`); non_finite counts rows the reference judged
# non-finite (the model's output, not a drop of the monitor).
SERVICE_DROPS = ("queue_full", "reference_timeout", "reference_error", "internal_error", "candidate_missing",
                 "reference_missing")
# The shadow worker's micro-batch size adapts to the measured inference time (`BatchSizer`): a call slower than
# ADAPT_HIGH x reference_timeout_s halves the rows of the next calls, a full call faster than ADAPT_LOW x
# reference_timeout_s grows them (doubling until the first slow call, then by 1/ADAPT_GROW_DIV), up to
# monitoring.shadow_batch_rows; it starts at ADAPT_START_ROWS rows. With a cost linear in rows a doubled call stays
# under 2 x ADAPT_LOW = ADAPT_HIGH of the timeout: the search never reaches the timeout (TCP's slow start and
# additive-increase / multiplicative-decrease, Jacobson 1988, "Congestion avoidance and control", SIGCOMM).
ADAPT_HIGH = 0.5
ADAPT_LOW = 0.25
ADAPT_GROW_DIV = 8
ADAPT_START_ROWS = 16


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


def _redacted_config(cfg: MonitorConfig, fields: frozenset[str] | set[str]) -> MonitorConfig:
    """`cfg` with each slice rule that reads a redacted field (by column or name) grouping by plain value, so the
    redacted value '<redacted>' gives the key `<name>=<redacted>` whatever the rule's bins or values."""
    rules = [SliceRule(r.name, r.column, source=r.source) if not r.derived and (r.column in fields or r.name in fields)
             else r for r in cfg.rules]
    return cfg if rules == cfg.rules else dataclasses.replace(cfg, rules=rules)


@dataclass
class _Item:
    """One sampled request waiting for the shadow worker (`rows`, `signature` derived from the feeds)."""

    keys: list[str]
    decision: Decision
    feeds: dict[str, np.ndarray]
    meta: dict[str, Any]
    request_id: str
    index: int
    endpoint: str
    candidate: np.ndarray | None = None
    enqueued: float = field(default_factory=time.perf_counter)
    rows: int = 0
    signature: tuple = ()

    def __post_init__(self) -> None:
        first = next(iter(self.feeds.values()), None)
        self.rows = int(first.shape[0]) if first is not None and first.ndim else 1
        # requests that can share one inference call: same input names, dtypes and non-batch dimensions
        self.signature = tuple((k, v.dtype.str, v.shape[1:]) for k, v in sorted(self.feeds.items()))


class DropWindow:
    """Sampled requests and the ones dropped uncompared over the last `window_s` seconds (thread-safe: admission
    runs on the event loop and gRPC threads, drops and comparisons on the worker).

    Args:
        window_s: the window (DROP_WINDOW_S).
        clock: monotonic seconds (tests pass a fixed one).
    """

    def __init__(self, window_s: float, clock: Callable[[], float]) -> None:
        self.window_s = float(window_s)
        self.clock = clock
        self._buckets: collections.deque[list[Any]] = collections.deque()  # [second, sampled, dropped, {reason: n}]
        self._lock = threading.Lock()

    def add(self, n: int = 1, reason: str | None = None) -> None:
        """Record `n` sampled requests that were compared (`reason` None) or dropped for `reason`."""
        now = self.clock()
        second = int(now)
        with self._lock:
            self._expire(now)
            if not self._buckets or self._buckets[-1][0] != second:
                self._buckets.append([second, 0, 0, {}])
            b = self._buckets[-1]
            b[1] += n
            if reason is not None:
                b[2] += n
                b[3][reason] = b[3].get(reason, 0) + n

    def _expire(self, now: float) -> None:
        while self._buckets and self._buckets[0][0] + 1 <= now - self.window_s:
            self._buckets.popleft()

    def totals(self) -> tuple[int, int, dict[str, int]]:
        """(sampled, dropped, {reason: dropped}) over the window."""
        with self._lock:
            self._expire(self.clock())
            reasons: dict[str, int] = {}
            for b in self._buckets:
                for k, v in b[3].items():
                    reasons[k] = reasons.get(k, 0) + v
            return sum(b[1] for b in self._buckets), sum(b[2] for b in self._buckets), reasons


class BatchSizer:
    """The shadow worker's micro-batch size for one model, adapted to its measured inference time so that a call
    fits monitoring.reference_timeout_s (issue 38 item 7: 256-row batches of MiniLM took longer than the 2 s
    timeout and 1,467 of 1,500 sampled requests were dropped).

    Rules (ADAPT_* constants): start at min(ADAPT_START_ROWS, `limit`) rows; a call of r rows that took longer than
    ADAPT_HIGH x timeout (or timed out) sets the size to max(1, r // 2); a call of at least the current size that
    took at most ADAPT_LOW x timeout doubles it until the first slow call, then grows it by size // ADAPT_GROW_DIV
    (at least 1); never above `limit` (monitoring.shadow_batch_rows). With `adapt` False the size is `limit`.

    Args:
        limit: monitoring.shadow_batch_rows.
        timeout_s: monitoring.reference_timeout_s.
        adapt: monitoring.shadow_batch_adapt.
    """

    def __init__(self, limit: int, timeout_s: float, adapt: bool = True) -> None:
        self.limit = int(limit)
        self.timeout_s = float(timeout_s)
        self.adapt = adapt
        self.rows = min(ADAPT_START_ROWS, self.limit) if adapt else self.limit
        self.slow_start = True

    def observe(self, rows: int, seconds: float | None) -> int:
        """Account one call of `rows` rows that took `seconds` (None: it timed out); returns the new size."""
        if not self.adapt or rows <= 0:
            return self.rows
        if seconds is None or seconds > ADAPT_HIGH * self.timeout_s:
            self.rows = max(1, min(self.rows, rows // 2))
            self.slow_start = False
        elif seconds <= ADAPT_LOW * self.timeout_s and rows >= self.rows:
            grown = self.rows * 2 if self.slow_start else self.rows + max(1, self.rows // ADAPT_GROW_DIV)
            self.rows = min(self.limit, grown)
        return self.rows


class MonitorService:
    """Models, queue, worker and exporters of one monitor process (the FastAPI app is `build_app(service)`).

    Args:
        cfg: resolved monitoring configuration.
        reference: reference .onnx path or a Runner (None: not available; sampled traffic is dropped with reason
            reference_missing and /readyz stays 503).
        candidate: candidate .onnx path or a Runner; None for a pairs-only monitor.
        metrics: collectors (default: new, on a private registry).
        seed: sampler seed (default: monitoring.seed).
        s3_client: boto3 client for the sink (default: made from monitoring.s3).
        start: start the worker / loaders at once (tests may start later).
        evidence_only: a replica: measure and export evidence (GET /v1/evidence), never alert.
        peers: base URLs of replicas whose evidence this process combines with its own (it becomes the combiner,
            the deployment's only alerting process; monitoring/combine.py).
        poll_interval_s: seconds between two reads of the peers' evidence.
        expect_replicas: replica processes the deployment runs (`--expect-replicas`): while fewer live ones
            answer, /readyz is not ready (`incomplete`; monitoring/combine.py Combiner.incomplete). None: unchecked.
        peer_dns: `NAME:PORT` of headless Services whose DNS records list the replicas (`--peer-dns`): looked up
            at every poll, one peer per address (combine.peers_from_dns); with `peers` or alone.
        resolver: the DNS lookup, `socket.getaddrinfo` (tests pass one with its signature: the seam that stands
            in for a DNS server).
        peer_wait_polls: polls the combiner waits for a replica it cannot read before merging the others' newer
            evidence without it (`--peer-wait-polls`; monitoring/combine.py Ordering).
        auth_token: the bearer token every endpoint but /healthz requires (config.load_auth_token), also sent
            when the combiner reads its peers; None: no authentication.
        clock: monotonic time source in seconds for the per-column cap on new slice values
            (monitoring.max_new_values_per_minute; tests inject one).
        node_check: called once at start, in the background, to compare this node with the nodes the candidate
            was validated on (monitoring/node_check.py `run_node_check`); None: not configured.
        trusted: `--trusted`: a .pt2 model file is loaded without first refusing an archive that holds code
            (tailguard.core.pt2_archive); otherwise such a file is not loaded (load_errors, /readyz).
        timer: monotonic seconds that time each inference call (the micro-batch adaptation, the latency
            histogram, and a call that returns later than monitoring.reference_timeout_s is a timeout); tests pass
            one a slowed reference advances (a declared time per row).
    """

    def __init__(self, cfg: MonitorConfig, reference: str | Path | Runner | None,
                 candidate: str | Path | Runner | None, *, metrics: MonitorMetrics | None = None,
                 seed: int | None = None, s3_client: Any = None, start: bool = True, evidence_only: bool = False,
                 peers: list[str] | None = None, poll_interval_s: float = 5.0, auth_token: str | None = None,
                 expect_replicas: int | None = None, peer_dns: list[str] | None = None,
                 resolver: Callable[..., Any] = socket.getaddrinfo, peer_wait_polls: int = WAIT_POLLS,
                 clock: Callable[[], float] = time.monotonic,
                 node_check: Callable[[], NodeCheck] | None = None, trusted: bool = False,
                 timer: Callable[[], float] = time.perf_counter) -> None:
        if evidence_only and (peers or peer_dns):
            raise InputError("--evidence-only and --peer / --peer-dns exclude each other: a replica exports evidence, "
                             "the combiner reads it",
                             hint="start replicas with --evidence-only, one combiner with --peer")
        for target in peer_dns or []:
            name, sep, port = target.rpartition(":")
            if not sep or not name or not port.isdigit() or not 0 < int(port) < 65536:
                raise InputError(f"--peer-dns {target!r} is not NAME:PORT",
                                 hint="give the headless Service's DNS name and port, e.g. "
                                      "tailguard-monitor-replicas.<ns>.svc.cluster.local:8080")
        mon = cfg.mon
        self.metrics = metrics or MonitorMetrics()
        self.lumped = Counter("tailguard_monitor_slice_values_lumped", "Slice values lumped into <name>=__new__ "
                              "(past monitoring.max_new_values_per_minute new values of the column), by slice name.",
                              ["model", "slice"], registry=self.metrics.registry)
        if mon.max_new_values_per_minute is not None:
            cfg = dataclasses.replace(cfg, new_values=NewValueLimiter(
                mon.max_new_values_per_minute, max_known=mon.max_tracked_slices, clock=clock,
                on_lump=lambda name: self.lumped.labels(cfg.model_name, name).inc()))
        self.cfg = cfg
        self.auth = BearerAuth(auth_token) if auth_token else None
        self.body_budget = BodyBudget(mon.max_inflight_body_bytes)
        self.in_flight = 0  # HTTP ingest bodies being parsed (the event loop's count; max_concurrent_requests)
        self.redact = frozenset(mon.redact_fields)
        redacted_slices = [r.name for r in cfg.rules if r.column in self.redact or r.name in self.redact]
        if redacted_slices:
            log.warning("slice(s) %s read a field in monitoring.redact_fields: their key is '<name>=%s' for every "
                        "request that carries the field", redacted_slices, REDACTED)
        self.sink = None
        if mon.s3 is not None:
            from tailguard.monitoring.sink import PairSink

            spool = Path(mon.spool_dir) if mon.spool_dir else home() / "monitor" / "spool"
            self.sink = PairSink(mon.s3, spool, mon.spool_max_bytes, redact_fields=mon.redact_fields,
                                 model=cfg.model_name, metrics=self.metrics, client=s3_client,
                                 slice_rules=[(r.name, r.column) for r in cfg.rules], slice_pairs=cfg.pairs)
        self.drift = None
        if mon.evidently_workspace:
            from tailguard.monitoring.drift import DriftSnapshots

            self.drift = DriftSnapshots(cfg)
        self._lock = threading.Lock()
        role = "replica" if evidence_only else "combiner" if peers or peer_dns else "standalone"
        self.engine = MonitorEngine(_redacted_config(cfg, self.redact), seed=seed, metrics=self.metrics,
                                    on_sample=self._on_sample, lock=self._lock, role=role)
        self.combiner: Combiner | None = None
        self._poller: PollLoop | None = None
        if self.engine.combined is not None:
            peer_fetch = http_fetch(headers=self.auth.header if self.auth is not None else None,
                                    reader=self.engine.epoch)

            def fetch(source: str, since: int) -> Mapping[str, Any]:
                if source == "self":
                    with self._lock:
                        return self.engine.evidence(since)
                return peer_fetch(source, since)

            for reason in INCOMPLETE_REASONS:
                self.metrics.incomplete_polls.labels(reason)
            for peer in peers or []:  # zeros from the start, so rate() and absent() work
                for reason in PeerError:
                    self.metrics.peer_errors.labels(peer, reason.value)
            self.combiner = Combiner(self.engine.combined, fetch, ["self", *(peers or [])], lock=self._lock,
                                     settings=self.engine.settings, local="self", reader=self.engine.epoch,
                                     expect_replicas=expect_replicas, wait_polls=peer_wait_polls,
                                     on_incomplete=lambda reason: self.metrics.incomplete_polls.labels(reason).inc(),
                                     discover=(functools.partial(_discover, list(peer_dns), resolver)
                                               if peer_dns else None),
                                     on_error=lambda peer, reason: self.metrics.peer_errors.labels(peer, reason).inc())
            self._poller = PollLoop(self.combine, poll_interval_s)
        self.queue: queue.Queue[_Item] = queue.Queue(maxsize=mon.queue_size)
        self.join = JoinBuffer(mon.logger_join_max_entries, mon.logger_join_ttl_s, max_bytes=mon.logger_join_max_bytes,
                               max_entry_bytes=mon.logger_join_max_entry_bytes or mon.max_body_bytes,
                               on_drop=lambda reason, n: self.metrics.dropped.labels(reason).inc(n))
        self._sources = {"reference": reference, "candidate": None if mon.noise_floor else candidate}
        self._trusted = trusted
        self.runners: dict[str, Runner | None] = {"reference": None, "candidate": None}
        self.load_errors: dict[str, str] = {}
        self._pools = {r: cf.ThreadPoolExecutor(1, thread_name_prefix=f"tg-{r}") for r in ("reference", "candidate")}
        # every parse of an HTTP ingest body runs here, never on the event loop (issue 36 item 2)
        self.parse_pool = cf.ThreadPoolExecutor(PARSE_WORKERS, thread_name_prefix="tg-parse")
        # and a body of PROCESS_PARSE_BYTES or more in a worker process (its GIL holds would stall every thread)
        self.parser = BodyParser(ParseLimits(tuple(cfg.inputs), cfg.output, int(mon.max_body_bytes),
                                             int(mon.max_batch_rows)))
        self._stuck: dict[str, cf.Future | None] = {"reference": None, "candidate": None}
        self._batching = {"reference": True, "candidate": True}  # False once a model fails only when batched
        self._timer = timer
        self.sizers = {r: BatchSizer(mon.shadow_batch_rows, mon.reference_timeout_s, mon.shadow_batch_adapt)
                       for r in ("reference", "candidate")}
        self._carry: _Item | None = None  # a request taken that did not fit the last micro-batch: the next one's
        self.drops = DropWindow(DROP_WINDOW_S, clock)
        self.batch_rows_gauge = Gauge("tailguard_monitor_shadow_batch_rows", "Rows the shadow worker puts in one "
                                      "inference call now, by role (adapted to the measured inference time, "
                                      "monitoring.shadow_batch_adapt; at most monitoring.shadow_batch_rows).",
                                      ["role"], registry=self.metrics.registry)
        for r, sizer in self.sizers.items():
            self.batch_rows_gauge.labels(r).set(sizer.rows)
        # per role, the drop reason of each of the last HEALTH_WINDOW calls (None = it answered)
        self._health: dict[str, collections.deque[str | None]] = {
            r: collections.deque(maxlen=HEALTH_WINDOW) for r in ("reference", "candidate")}
        self._stop = threading.Event()
        self._seq = 0
        self._admit_lock = threading.Lock()  # admission runs on the HTTP event loop and on gRPC threads
        self._worker: threading.Thread | None = None
        self.processed = 0
        # the node check (monitoring/node_check.py): pending until its thread has read the registry
        self._node_check_fn = node_check or (lambda: run_node_check(None))
        self.node_check = NodeCheck(NodeCheckStatus.PENDING.value, {}, reason="the node check has not finished")
        self.sources = {s: 0 for s in CANDIDATE_SOURCES}  # compared requests by candidate_source (worker lock)
        self.metrics.node_mismatch.labels(cfg.model_name).set(0)
        for s in CANDIDATE_SOURCES:  # zeros from the start, so rate() and absent() work
            self.metrics.candidate_source.labels(cfg.model_name, s)
        self.engine.alert_notes = self._alert_notes
        if start:
            self.start()

    # ----------------------------------------------------------------------------------------- life
    def start(self) -> None:
        """Load the models and check the node in the background, start the worker (and the sink's writer)."""
        threading.Thread(target=self._load_models, name="tg-load", daemon=True).start()
        threading.Thread(target=self._check_node, name="tg-node-check", daemon=True).start()
        self._worker = threading.Thread(target=self._work, name="tg-worker", daemon=True)
        self._worker.start()
        if self.sink is not None:
            self.sink.start()
        if self._poller is not None:
            self._poller.start()

    def combine(self) -> None:
        """Read every source's evidence once and merge it (the combiner's poll; tests call it directly)."""
        if self.combiner is not None:
            self.engine.report(self.combiner.poll())

    def evidence(self, since: int = 0, reader: str = "") -> dict[str, Any]:
        """This process's evidence since cursor `since` (GET /v1/evidence; `reader`: the reading combiner's id,
        engine.with_identity), built without holding the worker lock
        for more than READ_CHUNK slices: the keys updated after `since` and the version are taken under the lock
        (a scan, no entry built), then the entries in chunks, each under the lock. An entry may be newer than the
        version returned: the next read (since=version) returns it again, and the combiner merges only what it
        has not merged (its walks are cumulative per epoch, monitoring/combine.py)."""
        stats = self.engine.stats
        with self._lock:
            version, keys = stats.evidence_keys(since)
            marks = self.engine.evidence_checkpoints(since)  # checkpoints and as_of with the version
        out: dict[str, Any] = {}
        for i in range(0, len(keys), READ_CHUNK):
            with self._lock:
                out.update(stats.evidence_entries(keys[i:i + READ_CHUNK]))
        with self._lock:
            return self.engine.with_identity({"version": version, "slices": out, **marks}, reader)

    def stop(self) -> None:
        """Stop the worker, flush the sink (to S3 or the spool) and release the pools."""
        self._stop.set()
        if self._poller is not None:
            self._poller.stop()
        if self._worker is not None:
            self._worker.join(5)
        if self.sink is not None:
            self.sink.close()
        for p in (*self._pools.values(), self.parse_pool):
            p.shutdown(wait=False, cancel_futures=True)
        self.parser.close()

    def _load_models(self) -> None:
        for role, src in self._sources.items():
            if src is None:
                continue
            try:
                self.runners[role] = src if hasattr(src, "run") else runner_for_file(
                    src, self.cfg.inputs, trusted=self._trusted, fix=MONITOR_FIX)
                self.metrics.models_ready.labels(role).set(1)
            except TailguardError as exc:  # a bad file, or a torch artefact built for another node
                self.load_errors[role] = exc.message
                log.error("%s model not loaded: %s", role, exc.message)

    def _check_node(self) -> None:
        """Run the node check once; set the gauge; warn on a mismatch (the monitor serves whatever the outcome)."""
        try:
            check = self._node_check_fn()
        except Exception as exc:  # noqa: BLE001 - a check that fails leaves the monitor serving, status unknown
            check = NodeCheck(NodeCheckStatus.UNKNOWN.value, {}, reason=f"the node check failed: {exc}")
        self.node_check = check
        self.metrics.node_mismatch.labels(self.cfg.model_name).set(1 if check.mismatch else 0)
        if check.mismatch:
            log.warning("node check: %s: %s; candidate outputs this monitor recomputes (mirror path) are marked "
                        "recomputed_other_node; prefer the payload-logger path (live responses) for INT8 variants",
                        check.reason, json.dumps(check.differences))
        elif check.status == NodeCheckStatus.UNKNOWN.value:
            log.warning("node check: %s", check.reason)

    def _alert_notes(self) -> dict[str, Any]:
        """Fields added to every alert record while this node matches none of the candidate's validated nodes:
        `node_mismatch` (the differing facts) and `recomputed_other_node_share` (of the requests compared so far,
        the share whose candidate output this monitor recomputed on this node; 0 when every one was a live
        response). Called under the worker lock. {} otherwise."""
        check = self.node_check
        if not check.mismatch:
            return {}
        total = sum(self.sources.values())
        share = self.sources["recomputed_other_node"] / total if total else 0.0
        return {"node_mismatch": check.differences, "recomputed_other_node_share": round(share, 4)}

    def candidate_source(self, live: bool) -> str:
        """Where a compared request's candidate output came from: live (the served response), else recomputed
        here, `recomputed_other_node` when the node check found a mismatch (metrics.CANDIDATE_SOURCES)."""
        if live:
            return "live"
        return "recomputed_other_node" if self.node_check.mismatch else "recomputed"

    @property
    def needs_candidate(self) -> bool:
        """True when the infer endpoint must run a candidate model."""
        return self._sources["candidate"] is not None

    def degraded(self) -> str | None:
        """"degraded: ..." while more than monitoring.max_drop_rate of the sampled requests of the last
        DROP_WINDOW_S seconds (at least DROP_MIN_SAMPLED) were dropped uncompared (SERVICE_DROPS); else None."""
        sampled, dropped, reasons = self.drops.totals()
        limit = self.cfg.mon.max_drop_rate
        if sampled < DROP_MIN_SAMPLED or dropped <= limit * sampled:
            return None
        top = ", ".join(f"{k} {v}" for k, v in sorted(reasons.items(), key=lambda kv: -kv[1]))
        return (f"degraded: {dropped} of {sampled} sampled requests of the last {DROP_WINDOW_S:g} s dropped "
                f"uncompared ({dropped / sampled:.1%} > monitoring.max_drop_rate {limit:g}; {top}); see "
                "tailguard_monitor_dropped_total and docs/monitor.md, Drops")

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """(ready, details): ready once the reference and (if configured) the candidate are loaded, and not while
        every one of a model's last HEALTH_WINDOW calls failed (`failing` names the model and the last reason),
        nor while the monitor is `degraded` (`reason`: more than monitoring.max_drop_rate of the recent sampled
        requests dropped, `degraded`; `drops` holds the window's counts).
        A node mismatch does not make the monitor unready: `node_mismatch` names the differing facts
        ({fact: {node, validated}}; null when none) and `node_check` holds the whole check."""
        need = ["reference"] + (["candidate"] if self.needs_candidate else [])
        missing = [r for r in need if self.runners[r] is None]
        failing = {}
        for r in need:
            window = list(self._health[r])
            if self.runners[r] is not None and len(window) == HEALTH_WINDOW and all(window):
                failing[r] = f"the last {HEALTH_WINDOW} calls failed (last: {window[-1]})"
        incomplete = self.combiner.incomplete() if self.combiner is not None else {}
        degraded = self.degraded()
        ready = not missing and not failing and not incomplete and degraded is None
        check = self.node_check
        sampled, dropped, reasons = self.drops.totals()
        return ready, {"ready": ready, "missing": missing, "failing": failing, "errors": self.load_errors,
                       **({"reason": degraded} if degraded is not None else {}),
                       "drops": {"window_s": DROP_WINDOW_S, "sampled": sampled, "dropped": dropped,
                                 "reasons": reasons, "max_drop_rate": self.cfg.mon.max_drop_rate},
                             "queue_depth": self.queue.qsize(), "join_pending": len(self.join),
                             "noise_floor": self.cfg.mon.noise_floor, "role": self.engine.role,
                             "node_check": check.to_dict(), "node_mismatch": check.differences or None,
                             **({"incomplete": incomplete} if self.combiner is not None else {}),
                             **({"discovery": self.combiner.discovery}
                                if self.combiner is not None and self.combiner.discover is not None else {}),
                             **({"peers": self.combiner.status()} if self.combiner is not None else {})}

    # --------------------------------------------------------------------------------------- ingest
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
                keys, decision = self.engine.admit(meta, req.feeds, headers)
                self._seq += 1
                seq = self._seq
        except InputError as exc:  # a derived slice cannot be computed from this request's tensors
            return self._refuse(endpoint, OipError("bad_shape", f"{exc}"), t0)
        m.requests.labels(self.cfg.model_name, endpoint).inc()
        if decision.sampled:
            if self.runners["reference"] is None:
                self._drop("reference_missing")
            else:
                item = _Item(keys, decision, req.feeds, meta, req.id, seq, endpoint, cand)
                try:
                    self.queue.put_nowait(item)
                except queue.Full:
                    self._drop("queue_full")
            m.queue_depth.set(self.queue.qsize())
        m.ingest_seconds.labels(endpoint).observe(time.perf_counter() - t0)
        return 200, {"model_name": self.cfg.model_name, "id": req.id, "outputs": [],
                     "parameters": {"tailguard.sampled": decision.sampled}}

    # --------------------------------------------------------------------------------------- worker
    # The worker takes a sampled request, then whatever else is queued (up to monitoring.shadow_batch_rows rows,
    # waiting at most shadow_batch_wait_ms), groups the requests by input signature and runs each group as one
    # inference call per model; outputs are split back per request, so each request keeps its own evidence (one
    # bet per request, monitoring/detector.py). A batched call that raises is retried request by request, so a
    # failure is charged to the request that causes it (and a model that cannot batch, e.g. a fixed batch
    # dimension, is run one request at a time from then on). A timeout is charged to every request of the call.
    def _call(self, role: str, feeds: dict[str, np.ndarray]) -> tuple[np.ndarray | None, str | None]:
        """Run one model on `feeds` with the reference timeout: (output, None) or (None, failure reason). Rows
        past the model's adapted micro-batch size (`sizers`, BatchSizer) run as consecutive calls of at most that
        many rows (while the model batches and monitoring.shadow_batch_adapt is on), each with its own timeout; one
        failure fails the whole."""
        first = next(iter(feeds.values()), None)
        rows = int(first.shape[0]) if first is not None and first.ndim else 1
        sizer = self.sizers[role]
        size = sizer.rows
        if rows <= size or not sizer.adapt or not self._batching[role]:
            return self._call_once(role, feeds)
        outs = []
        for a in range(0, rows, size):
            out, reason = self._call_once(role, {k: v[a:a + size] for k, v in feeds.items()})
            if out is None:
                return None, reason
            outs.append(out)
        return np.concatenate(outs), None

    def _timed(self, role: str, rows: int, seconds: float | None) -> None:
        """Account one inference call (BatchSizer, the gauge)."""
        self.batch_rows_gauge.labels(role).set(self.sizers[role].observe(rows, seconds))

    def _call_once(self, role: str, feeds: dict[str, np.ndarray]) -> tuple[np.ndarray | None, str | None]:
        """One inference call (`_call`). A call that times out is observed in inference_seconds at the time it
        was given up (reference_timeout_s), so the histogram's tail shows it (dropped_total{reason} counts the
        request); a call refused because an earlier timed-out call still holds the model's thread is no call
        and is not observed."""
        ref = role == "reference"
        err_reason = "reference_error" if ref else "candidate_error"
        timeout_reason = "reference_timeout" if ref else "candidate_timeout"
        runner = self.runners[role]
        if runner is None:
            return None, "reference_missing" if ref else "candidate_missing"
        stuck = self._stuck[role]
        if stuck is not None:
            if not stuck.done():  # a timed-out call still holds the model's thread: do not pile up behind it
                return None, timeout_reason
            self._stuck[role] = None
        first = next(iter(feeds.values()), None)
        rows = int(first.shape[0]) if first is not None and first.ndim else 1
        timeout_s = self.cfg.mon.reference_timeout_s
        hist = self.metrics.inference_seconds.labels(self.cfg.model_name, role)
        t0 = self._timer()
        fut = self._pools[role].submit(runner.run, feeds)
        try:
            outs = fut.result(timeout=timeout_s)
        except cf.TimeoutError:
            self._stuck[role] = fut
            hist.observe(max(self._timer() - t0, timeout_s))
            self._timed(role, rows, None)
            return None, timeout_reason
        except Exception as exc:  # the model raised (ORT runtime error, bad output): count, never propagate
            log.warning("%s model failed: %s", role, str(exc).splitlines()[0][:200] if str(exc) else type(exc))
            return None, err_reason
        elapsed = self._timer() - t0
        hist.observe(elapsed)
        self._timed(role, rows, elapsed if elapsed <= timeout_s else None)
        if elapsed > timeout_s:  # answered, but later than the timeout allows: a timeout, as if it had not
            return None, timeout_reason
        names = list(getattr(runner, "output_names", []) or [])
        out = np.asarray(outs[names.index(self.cfg.output.name) if self.cfg.output.name in names else 0])
        first = next(iter(feeds.values()))
        if out.ndim == 0 or out.shape[0] != first.shape[0]:
            return None, err_reason if ref else "candidate_shape"
        return out, None

    def _run_one(self, role: str, item: _Item) -> tuple[np.ndarray | None, str | None]:
        out, reason = self._call(role, item.feeds)
        self._health[role].append(reason)
        return out, reason

    def _run_group(self, role: str, items: list[_Item]) -> list[tuple[np.ndarray | None, str | None]]:
        """One model's outputs for requests of one input signature: one call when it can batch, else one each."""
        if not items:
            return []
        if len(items) == 1 or not self._batching[role]:
            return [self._run_one(role, it) for it in items]
        feeds = {k: np.concatenate([it.feeds[k] for it in items]) for k in items[0].feeds}
        out, reason = self._call(role, feeds)
        if out is not None:
            self._health[role].append(None)
            bounds = np.cumsum([0] + [it.rows for it in items])
            return [(out[a:b], None) for a, b in zip(bounds[:-1], bounds[1:])]
        if reason in ("reference_timeout", "candidate_timeout", "reference_missing", "candidate_missing"):
            self._health[role].append(reason)
            return [(None, reason)] * len(items)
        results = [self._run_one(role, it) for it in items]  # find the request(s) that fail
        if all(o is not None for o, _ in results):
            self._batching[role] = False
            log.warning("%s model fails on batched requests but not one by one (fixed batch dimension?): "
                        "comparing one request per call from now on", role)
        return results

    def _drop(self, reason: str, n: int = 1) -> None:
        """Count `n` sampled requests dropped uncompared (dropped_total{reason}, and the drop window)."""
        self.metrics.dropped.labels(reason).inc(n)
        if reason in SERVICE_DROPS:
            self.drops.add(n, reason)

    def _process(self, items: list[_Item]) -> None:
        """Compare a micro-batch of sampled requests: group by input signature, run each model once per group,
        then add each request's evidence (under the worker lock)."""
        groups: dict[tuple, list[_Item]] = {}
        for it in items:
            groups.setdefault(it.signature, []).append(it)
        for group in groups.values():
            refs = self._run_group("reference", group)
            judged = [(it, ref) for it, (ref, reason) in zip(group, refs) if ref is not None]
            failed = [(it, reason) for it, (ref, reason) in zip(group, refs) if ref is None]
            for _it, reason in failed:
                self._drop(reason or "reference_error")
            if self.cfg.mon.noise_floor:  # the reference against a second run of itself
                seconds = self._run_group("reference", [it for it, _ in judged])
            else:
                need = [it for it, _ in judged if it.candidate is None]
                outs = iter(self._run_group("candidate", need))
                seconds = [(it.candidate, None) if it.candidate is not None else next(outs) for it, _ in judged]
            shared = self._compare_group(judged, seconds)
            with self._lock:
                for it, _reason in failed:
                    self.engine.reference_failed(it.keys, it.rows)
                for n, ((it, ref), (cand, reason)) in enumerate(zip(judged, seconds)):
                    if reason == "candidate_missing" or (self.cfg.mon.noise_floor and cand is None):
                        self._drop(reason or "reference_error")
                        continue
                    self.drops.add(1)
                    source = None if self.cfg.mon.noise_floor else self.candidate_source(it.candidate is not None)
                    if source is not None:
                        self.sources[source] += 1
                        self.metrics.candidate_source.labels(self.cfg.model_name, source).inc()
                    self.engine.observe(it.keys, it.decision, ref, cand, request_index=it.index,
                                        request_id=it.request_id, meta=it.meta, feeds=it.feeds, failure=reason,
                                        values=shared.get(n), candidate_source=source)

    def _compare_group(self, judged: list[tuple[_Item, np.ndarray]],
                       seconds: list[tuple[np.ndarray | None, str | None]]) -> dict[int, dict[str, np.ndarray]]:
        """Per-row parity of every answered request of a group in one `compare_rows` call (its numpy work is
        per call, not per row), split back per request: {position in `judged`: {metric: (rows,) values}}. Requests
        the candidate failed on, or answered in another shape, are left to `MonitorEngine.observe`."""
        ok = [n for n, ((_, ref), (cand, reason)) in enumerate(zip(judged, seconds))
              if reason is None and cand is not None and cand.shape == ref.shape]
        if len(ok) < 2 or len({judged[n][1].shape[1:] for n in ok}) > 1:
            return {}
        decode = self.cfg.spec.model.decode
        feeds = None
        if decode is not None and decode.mask_input is not None:  # token_classification: the rows' masks too
            masks = [(judged[n][0].feeds or {}).get(decode.mask_input) for n in ok]
            if any(m is None for m in masks) or len({np.shape(m)[1:] for m in masks}) > 1:
                return {}
            feeds = {decode.mask_input: np.concatenate(masks)}
        try:
            values = compare_rows(self.cfg.task, np.concatenate([judged[n][1] for n in ok]),
                                  np.concatenate([seconds[n][0] for n in ok]), self.cfg.metrics,
                                  probabilities=self.cfg.output.kind == "probabilities", decode=decode,
                                  feeds=feeds)
        except InputError:  # an output the task cannot score: each request finds out on its own
            return {}
        bounds = np.cumsum([0] + [judged[n][1].shape[0] for n in ok])
        return {n: {m: v[a:b] for m, v in values.items()} for n, a, b in zip(ok, bounds[:-1], bounds[1:])}

    def _gather(self, first: _Item) -> list[_Item]:
        """`first` plus queued requests, up to monitoring.shadow_batch_rows rows, waiting at most
        monitoring.shadow_batch_wait_ms for more."""
        items, rows = [first], first.rows
        limit = self.sizers["reference"].rows  # adapted (BatchSizer), at most monitoring.shadow_batch_rows
        deadline = time.monotonic() + self.cfg.mon.shadow_batch_wait_ms / 1000.0
        while rows < limit:
            try:
                item = self.queue.get_nowait()
            except queue.Empty:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    item = self.queue.get(timeout=remaining)
                except queue.Empty:
                    break
            if rows + item.rows > limit:  # it would overfill this call: it starts the next micro-batch
                self._carry = item
                break
            items.append(item)
            rows += item.rows
        return items

    def _work(self) -> None:
        while not self._stop.is_set():
            try:
                first, self._carry = self._carry or self.queue.get(timeout=0.1), None
            except queue.Empty:
                self.join.sweep()  # idle: expire payload-logger halves that will never be joined
                continue
            items = self._gather(first)
            self.metrics.queue_depth.set(self.queue.qsize())
            try:
                self._process(items)
            except Exception:  # never let one request stop the worker
                log.exception("shadow comparison failed")
                self._drop("internal_error", len(items))
            finally:
                self.processed += len(items)
                for _ in items:
                    self.queue.task_done()

    def _on_sample(self, record: dict[str, Any]) -> None:
        if self.sink is not None:
            self.sink.submit(record)
        if self.drift is not None:
            self.drift.add(record)

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """Block until the queue is empty and the worker idle (tests, benchmark). True when it got there."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.queue.unfinished_tasks == 0:
                return True
            time.sleep(0.01)
        return False

    # ---------------------------------------------------------------------------------------- reports
    def alerts(self) -> list[dict[str, Any]]:
        """Alert records fired so far."""
        with self._lock:
            return self.engine.alerts()

    def slices(self, offset: int = 0, limit: int | None = None) -> dict[str, Any]:
        """Per-slice statistics, one page in key order (MonitorEngine.slices' document). Only the key list is
        copied under the worker lock; it is sorted outside it, and the page's entries are built in chunks of
        READ_CHUNK, each under the lock (a slice evicted in between is left out of the page)."""
        with self._lock:
            keys = list(self.engine.decider.slices)
        keys.sort()
        page = keys[offset: None if limit is None else offset + limit]
        entries: dict[str, Any] = {}
        for i in range(0, len(page), READ_CHUNK):
            with self._lock:
                entries.update(self.engine.slice_entries(page[i:i + READ_CHUNK]))
        with self._lock:
            doc = self.engine.slices_header()
        end = offset + len(page)
        doc.update(slices_tracked=len(keys), slices_total=len(keys), offset=offset,
                   next_offset=end if end < len(keys) else None, slices=entries)
        return doc


class BodyBudget:
    """Bytes of HTTP ingest bodies being read at once, over every request in flight
    (monitoring.max_inflight_body_bytes). Used on the event loop only (no lock).

    Args:
        limit: the budget in bytes.
    """

    def __init__(self, limit: int) -> None:
        self.limit = int(limit)
        self.used = 0

    def take(self, n: int) -> bool:
        """Reserve `n` bytes; False (nothing reserved) when they do not fit."""
        if self.used + n > self.limit:
            return False
        self.used += n
        return True

    def give(self, n: int) -> None:
        """Release `n` reserved bytes."""
        self.used -= n


def _needs_auth(path: str, mon: Any) -> bool:
    """Whether a route requires the bearer token: every one but /healthz and /v2/health/live; /readyz,
    /v2/health/ready and /metrics as configured (monitoring.auth_readyz, auth_metrics)."""
    if path in ("/healthz", "/v2/health/live"):
        return False
    if path in ("/readyz", "/v2/health/ready"):
        return bool(mon.auth_readyz)
    if path == "/metrics":
        return bool(mon.auth_metrics)
    return True


class _Guard:
    """ASGI middleware ahead of every route, before any body is read: the bearer token (401 `unauthenticated`,
    with `WWW-Authenticate: Bearer`, counted in invalid_requests_total{reason}). The number of ingest bodies
    being parsed (monitoring.max_concurrent_requests) is checked once a body is read (`build_app`'s `_handle`):
    a client that stalls mid-body holds no parse slot."""

    def __init__(self, app: Any, service: MonitorService) -> None:
        self.app = app
        self.service = service

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        svc, path = self.service, scope.get("path", "")
        if svc.auth is not None and _needs_auth(path, svc.cfg.mon):
            given = next((v for k, v in scope.get("headers") or () if k == b"authorization"), None)
            if not svc.auth.check(given):
                svc.metrics.invalid_requests.labels("unauthenticated").inc()
                doc = {"error": "missing or wrong bearer token: send 'Authorization: Bearer <token>' (the monitor's "
                                "token, monitoring.auth_token_env / auth_token_file)", "reason": "unauthenticated"}
                await JSONResponse(doc, status_code=401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


def model_metadata(cfg: MonitorConfig) -> dict[str, Any]:
    """The monitored model's OIP metadata (GET /v2/models/{name}): name, platform, the spec's inputs and the
    compared output, each {"name", "datatype", "shape"} with symbolic dimensions as -1 (as gRPC ModelMetadata)."""
    def meta(s: Any) -> dict[str, Any]:
        return {"name": s.name, "datatype": SPEC_TO_OIP.get(getattr(s, "dtype", "float32"), "FP32"),
                "shape": [d if isinstance(d, int) else -1 for d in s.shape]}

    return {"name": cfg.model_name, "versions": [], "platform": "tailguard-shadow-monitor",
            "inputs": [meta(s) for s in cfg.inputs], "outputs": [meta(cfg.output)]}


def _unknown_model(service: MonitorService, name: str) -> dict[str, Any]:
    return {"error": f"model {utf8_text(str(name))[:200]!r} is not monitored here; use "
                     f"{service.cfg.model_name!r}", "reason": "unknown_model"}


def build_app(service: MonitorService) -> Any:
    """The FastAPI app for a MonitorService (routes: module docstring), behind `_Guard` (authentication and the
    ingest concurrency limit); ingest bodies are read within the body budget (`_read_body`)."""
    @contextlib.asynccontextmanager
    async def lifespan(_app: Any) -> AsyncIterator[None]:
        yield
        service.stop()

    app = FastAPI(title="tailguard shadow monitor", version="1", lifespan=lifespan)
    app.add_middleware(_Guard, service=service)

    async def _handle(endpoint: str, request: Request, handle: Callable[[bytes], tuple[int, dict[str, Any]]]
                      ) -> Response:
        """Read the body within the limits (size, body budget, monitoring.body_read_timeout_s), then, when fewer
        than monitoring.max_concurrent_requests bodies are being parsed, hand it to `handle` on a parse thread
        (`service.parse_pool`: no parse runs on the event loop, so /healthz answers whatever a body holds);
        release its share of the body budget. A client that stalls mid-body holds only the bytes it sent, until
        its read deadline: never a parse slot (issue 36 item 5)."""
        body, reason, held = await _read_body(request, service.max_body_bytes, service.body_budget,
                                              service.cfg.mon.body_read_timeout_s)
        try:
            if body is None:
                status, doc = service.refuse_body(endpoint, reason)
            elif service.in_flight >= service.cfg.mon.max_concurrent_requests:
                status, doc = service.refuse_body(endpoint, "too_many_requests")
            else:
                service.in_flight += 1
                try:
                    loop = asyncio.get_running_loop()
                    status, doc = await loop.run_in_executor(service.parse_pool, handle, body)
                finally:
                    service.in_flight -= 1
        finally:
            service.body_budget.give(held)
        return JSONResponse(doc, status_code=status, headers={"Retry-After": "1"} if status == 503 else None)

    def _ingest(endpoint: str, name: str, request: Request) -> Callable[[bytes], tuple[int, dict[str, Any]]]:
        header = request.headers.get(BINARY_HEADER)  # binary tensor data extension
        return lambda body: service.ingest(endpoint, name, body, header=header, headers=request.headers)

    @app.post("/v2/models/{name}/infer")
    async def infer(name: str, request: Request) -> Response:
        return await _handle("infer", request, _ingest("infer", name, request))

    @app.post("/v2/models/{name}/pairs")
    async def pairs(name: str, request: Request) -> Response:
        return await _handle("pairs", request, _ingest("pairs", name, request))

    @app.post("/v2/models/{name}/logger")
    async def logger(name: str, request: Request) -> Response:
        return await _handle("logger", request, lambda body: service.ingest_event(name, request.headers, body))

    @app.get("/metrics")
    def metrics() -> Response:  # sync: FastAPI runs it in its thread pool, off the event loop that ingests
        service.sweep()
        return Response(service.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/healthz")
    async def healthz() -> Response:
        return JSONResponse({"status": "ok"})

    @app.get("/readyz")
    async def readyz() -> Response:
        ok, details = service.readiness()
        return JSONResponse(details, status_code=200 if ok else 503)

    # the Open Inference Protocol's health and metadata routes (KServe v2 / Triton clients call them first)
    @app.get("/v2/health/live")
    async def oip_live() -> Response:
        return JSONResponse({"live": True})

    @app.get("/v2/health/ready")
    async def oip_ready() -> Response:
        ok = service.readiness()[0]
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)

    @app.get("/v2/models/{name}/ready")
    async def oip_model_ready(name: str) -> Response:
        if name != service.cfg.model_name:
            return JSONResponse(_unknown_model(service, name), status_code=404)
        ok = service.readiness()[0]
        return JSONResponse({"name": name, "ready": ok}, status_code=200 if ok else 503)

    @app.get("/v2/models/{name}")
    async def oip_model_metadata(name: str) -> Response:
        if name != service.cfg.model_name:
            return JSONResponse(_unknown_model(service, name), status_code=404)
        return JSONResponse(model_metadata(service.cfg))

    @app.get("/v1/alerts")
    async def alerts() -> Response:
        return JSONResponse(service.alerts())

    @app.get("/v1/evidence")
    def evidence(since: int = 0, reader: str = "") -> Response:  # sync (thread pool): in chunks under the lock
        return JSONResponse(service.evidence(max(since, 0), reader))

    @app.get("/v1/slices")
    def slices(offset: int = 0, limit: int = 1000) -> Response:
        if offset < 0 or not 1 <= limit <= 10000:
            return JSONResponse({"error": "offset must be >= 0 and limit in [1, 10000]", "reason": "bad_page"},
                                status_code=422)
        return JSONResponse(service.slices(offset, limit))

    return app


class ProbeServer:
    """The probe port: /healthz, /readyz, /metrics (and the OIP /v2/health/live, /v2/health/ready) served apart
    from the ingest port, so that no number of ingest connections can make a kubelet probe or a scrape fail.

    Why a stdlib `http.server.ThreadingHTTPServer` on its own thread, not a second uvicorn server: the ingest port's
    starvation is uvicorn's connection accounting (`limit_concurrency` counts every open connection, also ones whose
    headers never finish: ~1,100 of them answered /healthz 503 for 31 s, issue 36 item 5) and its one event loop.
    This server shares neither: it accepts on its own socket and answers each connection on a thread of its own
    (a handful of probes at a time; the answers are a dict lookup, `MonitorService.readiness` and the Prometheus
    exposition), with no ASGI stack between the socket and the answer. A client here that stalls mid-headers holds
    one thread for at most PROBE_READ_TIMEOUT_S; keep the port to the kubelet and Prometheus (NetworkPolicy,
    docs/deploy.md). The same authentication rules as the main port: /healthz and /v2/health/live open, /readyz
    and /v2/health/ready as monitoring.auth_readyz says, /metrics as monitoring.auth_metrics says (401
    `unauthenticated`, counted).

    Args:
        service: the monitor whose state the routes report (None: `attach` it before `start`).
        host: bind address.
        port: TCP port (0: a free one, see `port`).

    Raises:
        InputError: the port cannot be bound (exit 2, naming the port and --probe-port).
    """

    def __init__(self, service: MonitorService | None, host: str, port: int) -> None:
        self._handler = handler = type("_ProbeHandler", (_ProbeHandler,), {"service": service,
                                                                           "timeout": PROBE_READ_TIMEOUT_S})
        try:
            self.httpd = http.server.ThreadingHTTPServer((host, port), handler)
        except OSError as exc:
            raise InputError(f"cannot bind the probe port {host}:{port}: {exc.strerror or exc}",
                             hint="choose a free port with --probe-port (or monitoring.probe_port), 0 turns it "
                                  "off") from None
        self.httpd.daemon_threads = True
        self.port = int(self.httpd.server_address[1])
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.5},
                                        name="tg-probe", daemon=True)

    def attach(self, service: MonitorService) -> None:
        """Report `service` (when the port was bound before the service was made: `serve`)."""
        self._handler.service = service

    def start(self) -> "ProbeServer":
        """Serve in a daemon thread; returns self."""
        if self._handler.service is None:
            raise RuntimeError("ProbeServer.start before attach: no service to report")
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop accepting and close the socket."""
        if self._thread.is_alive():
            self.httpd.shutdown()
        self.httpd.server_close()


class _ProbeHandler(http.server.BaseHTTPRequestHandler):
    """One probe-port connection (ProbeServer); `service` and `timeout` are set on the subclass it makes."""

    service: MonitorService
    protocol_version = "HTTP/1.0"  # one request per connection: nothing idles on a thread after its answer
    server_version = "tailguard-probe"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - no access log (as the main port)
        return

    def _send(self, status: int, body: bytes, ctype: str = "application/json",
              headers: Mapping[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, doc: Any, headers: Mapping[str, str] | None = None) -> None:
        self._send(status, json.dumps(doc, default=str).encode(), headers=headers)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        svc, path = self.service, self.path.split("?", 1)[0]
        if path not in _PROBE_ROUTES:
            self._json(404, {"error": f"{utf8_text(path)[:200]!r} is not served on the probe port; it serves "
                                      f"{sorted(_PROBE_ROUTES)}", "reason": "not_found"})
            return
        if svc.auth is not None and _needs_auth(path, svc.cfg.mon) and not svc.auth.check(
                self.headers.get("Authorization")):
            svc.metrics.invalid_requests.labels("unauthenticated").inc()
            self._json(401, {"error": "missing or wrong bearer token: send 'Authorization: Bearer <token>' (the "
                                      "monitor's token, monitoring.auth_token_env / auth_token_file)",
                             "reason": "unauthenticated"}, headers={"WWW-Authenticate": "Bearer"})
            return
        if path in ("/healthz", "/v2/health/live"):
            self._json(200, {"status": "ok"} if path == "/healthz" else {"live": True})
        elif path == "/metrics":
            svc.sweep()
            self._send(200, svc.metrics.exposition(), "text/plain; version=0.0.4; charset=utf-8")
        else:
            ok, details = svc.readiness()
            self._json(200 if ok else 503, details if path == "/readyz" else {"ready": ok})

    do_HEAD = do_GET


_PROBE_ROUTES = frozenset({"/healthz", "/readyz", "/metrics", "/v2/health/live", "/v2/health/ready"})


def _start_probe_when_listening(server: Any, probe: ProbeServer, host: str) -> None:
    """Start answering on the probe port once uvicorn listens on the ingest port, so the probe port never says
    ready while mirrored traffic would be refused (a kubelet probe meanwhile waits in the socket's backlog)."""
    while not server.started and not server.should_exit:
        time.sleep(0.05)
    if server.started:
        probe.start()
        log.warning("probe port (/healthz, /readyz, /metrics) on %s:%d", host, probe.port)


def uvicorn_config(service: MonitorService, host: str, port: int, *, headroom: int = CONNECTION_HEADROOM) -> Any:
    """The ingest port's uvicorn.Config (what `serve` runs): the app, and limit_concurrency =
    monitoring.max_concurrent_requests + `headroom` (open connections and tasks past it get uvicorn's plain 503,
    /healthz and /metrics on this port too: the probe port is the one that stays answering)."""
    import uvicorn

    return uvicorn.Config(build_app(service), host=host, port=port, log_level="warning", access_log=False,
                          limit_concurrency=service.cfg.mon.max_concurrent_requests + headroom)


async def _read_body(request: Request, limit: int, budget: BodyBudget, timeout_s: float
                     ) -> tuple[bytes | None, str | None, int]:
    """The request body, read within `limit` bytes, the shared body budget and `timeout_s` seconds.

    A declared Content-Length is checked against `limit`, and against what is left of `budget`, before anything
    is read; bytes are reserved in `budget` as they arrive (a client that stalls holds what it sent, not what it
    declared). Nothing over either bound is held in memory.

    Returns:
        (body, None, bytes reserved) or (None, reason, bytes reserved) with reason `body_too_large` (over
        `limit`), `body_budget_exceeded` (the budget is taken by bodies in flight), `client_disconnected` (the
        client went away mid-body) or `body_read_timeout` (not all there within `timeout_s`, counted from the
        headers: monitoring.body_read_timeout_s). The caller gives the reserved bytes back (`budget.give`).
    """
    import anyio
    from starlette.requests import ClientDisconnect

    try:
        declared = int(request.headers.get("content-length", ""))
    except ValueError:  # absent (chunked) or garbage: count while reading
        declared = 0
    if declared > limit:
        return None, "body_too_large", 0
    if declared > budget.limit - budget.used:
        return None, "body_budget_exceeded", 0
    chunks, size = [], 0
    try:
        with anyio.fail_after(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    return None, "body_too_large", size - len(chunk)
                if not budget.take(len(chunk)):
                    return None, "body_budget_exceeded", size - len(chunk)
                chunks.append(chunk)
    except ClientDisconnect:
        return None, "client_disconnected", size
    except TimeoutError:
        return None, "body_read_timeout", sum(map(len, chunks))
    return b"".join(chunks), None, size


def _discover(targets: list[str], resolver: Callable[..., Any]) -> list[str]:
    """Every peer URL the `--peer-dns` targets resolve to (combine.peers_from_dns), in target order."""
    return [url for t in targets for url in peers_from_dns(t, resolver)]


def create_service(spec: Spec | str | Path, reference: str | Path | None, candidate: str | Path | None, *,
                   seed: int | None = None, start: bool = True, evidence_only: bool = False,
                   peers: list[str] | None = None, poll_interval_s: float = 5.0, expect_replicas: int | None = None,
                   peer_dns: list[str] | None = None, peer_wait_polls: int = WAIT_POLLS,
                   auth_token_file: str | Path | None = None, candidate_version: str | None = None,
                   tracking_uri: str | None = None, centroids: str | Path | None = None,
                   trusted: bool = False) -> MonitorService:
    """Build a MonitorService from a spec (object or path); the keyword options are MonitorService's, and
    `auth_token_file` (`--auth-token-file`) overrides the spec's token source (config.load_auth_token).
    `candidate_version` (`--candidate-version NAME@ALIAS`, read from the registry at `tracking_uri`) is the
    registry version the candidate file came from: the node check (monitoring/node_check.py) compares this node
    with the nodes it was validated on; None: the check is not configured. The centroids of nearest_centroid
    slices come from `centroids` (`--centroids FILE`), else from that version's validate run
    (monitoring/centroids.py).

    Raises:
        SpecError: a bad spec or monitoring section (exit 2).
        InputError: --evidence-only with --peer; a token source that cannot be read or is too short (exit 2).
    """
    source = str(spec) if not isinstance(spec, Spec) else "spec"
    spec_obj = load_spec(spec) if not isinstance(spec, Spec) else spec
    from tailguard.core.tracking import tracking_uri_for
    from tailguard.monitoring.centroids import resolve_centroids

    if candidate_version and not tracking_uri:  # the store every other command uses ($TAILGUARD_HOME's by default)
        tracking_uri = tracking_uri_for(spec_obj)

    cfg: MonitorConfig = resolve_config(spec_obj, source=source, centroids=resolve_centroids(
        spec_obj, centroids, candidate_version, tracking_uri))
    token = load_auth_token(cfg.mon, auth_token_file)
    return MonitorService(cfg, reference, candidate, seed=seed, start=start, evidence_only=evidence_only,
                          peers=peers, poll_interval_s=poll_interval_s, auth_token=token,
                          expect_replicas=expect_replicas, peer_dns=peer_dns, peer_wait_polls=peer_wait_polls,
                          node_check=lambda: run_node_check(candidate_version, tracking_uri,
                                                            candidate_file=candidate), trusted=trusted)


def serve(spec_path: str | Path, reference: str | Path | None, candidate: str | Path | None,
          host: str = "0.0.0.0", port: int = 8080, *, evidence_only: bool = False, peers: list[str] | None = None,
          poll_interval_s: float = 5.0, grpc_port: int | None = None, expect_replicas: int | None = None,
          peer_dns: list[str] | None = None, peer_wait_polls: int = WAIT_POLLS,
          auth_token_file: str | Path | None = None, candidate_version: str | None = None,
          tracking_uri: str | None = None, centroids: str | Path | None = None, trusted: bool = False,
          probe_port: int | None = None) -> None:
    """`tailguard monitor serve`: run the monitor until interrupted.

    A missing model file does not stop the service: live traffic is still accepted and counted, /readyz
    answers 503 naming the missing model (`dropped_total{reason="reference_missing"}` counts the sampled
    requests that could not be compared).

    Args:
        spec_path: spec YAML (its monitoring section is required).
        reference: FP32 reference .onnx.
        candidate: candidate .onnx (None: pairs-only monitor).
        host: bind address (HTTP and gRPC).
        port: TCP port of the HTTP service.
        evidence_only: run as a replica (export evidence, never alert).
        peers: replica base URLs to combine (run as the combiner).
        poll_interval_s: seconds between reads of the peers' evidence.
        expect_replicas: replica processes the deployment runs (combiner only; /readyz not ready while fewer
            answer).
        peer_dns: headless Services (`NAME:PORT`) whose addresses are the replicas (run as the combiner).
        peer_wait_polls: polls the combiner waits for an unreadable replica (evidence ordering).
        grpc_port: also serve the OIP over gRPC on this port (monitoring/grpc_ingest.py), feeding the same
            admission; None: HTTP only.
        auth_token_file: file holding the bearer token every endpoint but /healthz requires (overrides
            monitoring.auth_token_file / auth_token_env); None: the spec's source, or no authentication.
        candidate_version: the candidate's registry version (NAME@ALIAS, NAME/VERSION or models:/...), whose
            `tailguard.validated_on` tag the node check compares this node with; None: not checked.
        tracking_uri: the MLflow registry holding it (None: the store every command uses: the spec's
            mlflow.tracking_uri, else $MLFLOW_TRACKING_URI, else the one under $TAILGUARD_HOME).
        centroids: the centroids.npz of the nearest_centroid slices (None: from candidate_version's run).
        trusted: `--trusted`: load a .pt2 model file without first refusing an archive that holds code.
        probe_port: serve /healthz, /readyz and /metrics also on this port, from a server the ingest port's
            connections cannot starve (`ProbeServer`); None: monitoring.probe_port (default 8082); 0: off.

    Raises:
        SpecError: bad spec (exit 2).
        InputError: the gRPC or probe port cannot be bound (or is the HTTP port); the token cannot be read
            (exit 2).
        UntrustedModelError: (exit 2, before anything is served) a .pt2 reference or candidate whose loading would
            run code from it (a pickled weight or constant, a custom object, an AOTInductor package), without
            `trusted` (tailguard.core.pt2_archive).
    """
    import uvicorn

    for model_file in (reference, candidate):
        if model_file is not None and Path(model_file).suffix == ".pt2" and Path(model_file).is_file():
            check_pt2_archive(model_file, trusted=trusted, fix=MONITOR_FIX)

    # the probe port is checked and bound before the service starts any thread (a refusal then exits cleanly)
    if probe_port is None:
        mon = load_spec(spec_path).monitoring  # None: create_service refuses the spec below
        probe_port = mon.probe_port if mon is not None else 0
    probe = None
    if probe_port:
        if probe_port in (port, grpc_port):
            raise InputError(f"the probe port {probe_port} is also the {'HTTP' if probe_port == port else 'gRPC'} "
                             "port", hint="give --probe-port (monitoring.probe_port) a port of its own, or 0 to "
                                          "turn it off")
        probe = ProbeServer(None, host, probe_port)  # answers once the ingest port listens
    try:
        service = create_service(spec_path, reference, candidate, evidence_only=evidence_only, peers=peers,
                                 poll_interval_s=poll_interval_s, auth_token_file=auth_token_file,
                                 expect_replicas=expect_replicas, peer_dns=peer_dns, peer_wait_polls=peer_wait_polls,
                                 candidate_version=candidate_version, tracking_uri=tracking_uri, centroids=centroids,
                                 trusted=trusted)
    except BaseException:
        if probe is not None:
            probe.stop()
        raise
    if probe is not None:
        probe.attach(service)
    if service.auth is None:
        log.warning("no bearer token configured (monitoring.auth_token_env / auth_token_file): every endpoint is "
                    "open to whoever reaches the port; restrict it with a NetworkPolicy (docs/deploy.md)")
    grpc_server = None
    if grpc_port is not None:
        from tailguard.monitoring.grpc_ingest import start_grpc

        try:
            grpc_server, bound = start_grpc(service, host, grpc_port)
        except InputError:
            if probe is not None:
                probe.stop()
            service.stop()
            raise
        log.warning("OIP gRPC ingest on %s:%d", host, bound)
    try:
        # the app answers 503 past max_concurrent_requests ingest requests (counted); uvicorn's own limit bounds
        # the connections and tasks beyond that (its plain 503, not counted)
        server = uvicorn.Server(uvicorn_config(service, host, port))
        if probe is not None:
            threading.Thread(target=_start_probe_when_listening, args=(server, probe, host), name="tg-probe-start",
                             daemon=True).start()
        server.run()
    finally:
        if grpc_server is not None:
            grpc_server.stop(1.0)
        if probe is not None:
            probe.stop()
