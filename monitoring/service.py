"""The shadow monitor's service: one monitor process's models, queue, shadow worker, exporters and reports
(`MonitorService`), built from a spec by `create_service`.

`MonitorService` is put together from one module per concern; each mixin holds its concern's methods and names
the state it reads, which `MonitorService.__init__` sets:
    monitoring/ingest.py      IngestMixin: OIP bodies checked, counted, sampled and queued (never waits for a model)
    monitoring/worker.py      ShadowWorkerMixin: the queue's requests compared in adapted micro-batches
    monitoring/readiness.py   ReadinessMixin: /readyz, and the drops it judges from
This module holds the life cycle (start, stop, model loading, the node check), the combiner's poll, and the
reports: /v1/evidence and /v1/slices build their entries in chunks of READ_CHUNK slices, each under the worker
lock, never all of them at once. Around it: monitoring/app.py (the FastAPI app and its routes: the endpoints are
listed there), monitoring/probe.py (the probe port), monitoring/body_budget.py (bodies read within the limits),
monitoring/serve.py (`tailguard monitor serve`).
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import dataclasses
import functools
import json
import logging
import queue
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping

from prometheus_client import Counter, Gauge

from tailguard.core.errors import InputError, TailguardError
from tailguard.core.home import home
from tailguard.core.pt2_archive import MONITOR_FIX
from tailguard.core.runtime import Runner, runner_for_file
from tailguard.core.spec import load_spec
from tailguard.core.spec.root import Spec
from tailguard.monitoring.body_budget import BodyBudget
from tailguard.monitoring.combine import INCOMPLETE_REASONS, WAIT_POLLS, Combiner, PeerError
from tailguard.monitoring.config import (
    BearerAuth,
    MonitorConfig,
    NewValueLimiter,
    load_auth_token,
    resolve_config,
)
from tailguard.monitoring.ingest import PARSE_WORKERS, REDACTED, IngestMixin, redacted_config
from tailguard.monitoring.join import JoinBuffer
from tailguard.monitoring.node_check import NodeCheck, NodeCheckStatus, run_node_check
from tailguard.monitoring.parsing import BodyParser, ParseLimits
from tailguard.monitoring.peers import PollLoop, http_fetch, peers_from_dns
from tailguard.monitoring.prometheus import CANDIDATE_SOURCES, MonitorMetrics
from tailguard.monitoring.readiness import DROP_WINDOW_S, HEALTH_WINDOW, DropWindow, ReadinessMixin
from tailguard.monitoring.slice_monitor import SliceMonitor
from tailguard.monitoring.worker import BatchSizer, SampledRequest, ShadowWorkerMixin

log = logging.getLogger("tailguard.monitoring.service")
READ_CHUNK = 512  # slice entries /v1/evidence and /v1/slices build per hold of the worker lock


class MonitorService(IngestMixin, ShadowWorkerMixin, ReadinessMixin):
    """Models, queue, worker and exporters of one monitor process (the FastAPI app is `build_app(service)`,
    monitoring/app.py; the methods of ingest, the shadow worker and readiness come from their mixins).

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
            at every poll, one peer per address (peers.peers_from_dns); with `peers` or alone.
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
        consumer = self.sink is not None or self.drift is not None  # without one, no per-row records are built
        self.monitor = SliceMonitor(redacted_config(cfg, self.redact), seed=seed, metrics=self.metrics,
                                    on_sample=self._on_sample if consumer else None, lock=self._lock, role=role)
        self.combiner: Combiner | None = None
        self._poller: PollLoop | None = None
        if self.monitor.combined is not None:
            peer_fetch = http_fetch(headers=self.auth.header if self.auth is not None else None,
                                    reader=self.monitor.epoch)

            def fetch(source: str, since: int) -> Mapping[str, Any]:
                if source == "self":
                    with self._lock:
                        return self.monitor.evidence(since)
                return peer_fetch(source, since)

            for reason in INCOMPLETE_REASONS:
                self.metrics.incomplete_polls.labels(reason)
            for peer in peers or []:  # zeros from the start, so rate() and absent() work
                for reason in PeerError:
                    self.metrics.peer_errors.labels(peer, reason.value)
            self.combiner = Combiner(self.monitor.combined, fetch, ["self", *(peers or [])], lock=self._lock,
                                     settings=self.monitor.settings, local="self", reader=self.monitor.epoch,
                                     expect_replicas=expect_replicas, wait_polls=peer_wait_polls,
                                     on_incomplete=lambda reason: self.metrics.incomplete_polls.labels(reason).inc(),
                                     discover=(functools.partial(_discover, list(peer_dns), resolver)
                                               if peer_dns else None),
                                     on_error=lambda peer, reason: self.metrics.peer_errors.labels(peer, reason).inc())
            self._poller = PollLoop(self.combine, poll_interval_s)
        self.queue: queue.Queue[SampledRequest] = queue.Queue(maxsize=mon.queue_size)
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
        # a request taken that did not fit the last micro-batch: the next one's
        self._carry: SampledRequest | None = None
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
        self.monitor.alert_notes = self._alert_notes
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
            self.monitor.report(self.combiner.poll())

    def evidence(self, since: int = 0, reader: str = "") -> dict[str, Any]:
        """This process's evidence since cursor `since` (GET /v1/evidence; `reader`: the reading combiner's id,
        monitor.with_identity), built without holding the worker lock
        for more than READ_CHUNK slices: the keys updated after `since` and the version are taken under the lock
        (a scan, no entry built), then the entries in chunks, each under the lock. An entry may be newer than the
        version returned: the next read (since=version) returns it again, and the combiner merges only what it
        has not merged (its walks are cumulative per epoch, monitoring/combine.py)."""
        stats = self.monitor.stats
        with self._lock:
            version, keys = stats.evidence_keys(since)
            marks = self.monitor.evidence_checkpoints(since)  # checkpoints and as_of with the version
        out: dict[str, Any] = {}
        for i in range(0, len(keys), READ_CHUNK):
            with self._lock:
                out.update(stats.evidence_entries(keys[i:i + READ_CHUNK]))
        with self._lock:
            return self.monitor.with_identity({"version": version, "slices": out, **marks}, reader)

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

    def _on_sample(self, record: dict[str, Any]) -> None:
        if self.sink is not None:
            self.sink.submit(record)
        if self.drift is not None:
            self.drift.add(record)

    # ---------------------------------------------------------------------------------------- reports
    def alerts(self) -> list[dict[str, Any]]:
        """Alert records fired so far."""
        with self._lock:
            return self.monitor.alerts()

    def slices(self, offset: int = 0, limit: int | None = None) -> dict[str, Any]:
        """Per-slice statistics, one page in key order (SliceMonitor.slices' document). Only the key list is
        copied under the worker lock; it is sorted outside it, and the page's entries are built in chunks of
        READ_CHUNK, each under the lock (a slice evicted in between is left out of the page)."""
        with self._lock:
            keys = list(self.monitor.decider.slices)
        keys.sort()
        page = keys[offset: None if limit is None else offset + limit]
        entries: dict[str, Any] = {}
        for i in range(0, len(page), READ_CHUNK):
            with self._lock:
                entries.update(self.monitor.slice_entries(page[i:i + READ_CHUNK]))
        with self._lock:
            doc = self.monitor.slices_header()
        end = offset + len(page)
        doc.update(slices_tracked=len(keys), slices_total=len(keys), offset=offset,
                   next_offset=end if end < len(keys) else None, slices=entries)
        return doc


def _discover(targets: list[str], resolver: Callable[..., Any]) -> list[str]:
    """Every peer URL the `--peer-dns` targets resolve to (peers.peers_from_dns), in target order."""
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
