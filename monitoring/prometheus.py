"""Prometheus metrics of the shadow monitor. The names and labels are a contract shared with the Grafana
dashboard and the PrometheusRule in manifests/: change them only with a deprecation path.

Label sets are bounded: every slice is measured, but the per-slice series (`sampled_total`, `slice_parity`,
`slice_samples`, `slice_evidence`, `alert_active`) exist only for the exported set, built at each scrape: `all`,
every slice with an active alert, and the monitoring.max_slices others with the most evidence
(monitoring/detector.py `SliceStatistics.exported`). `metric` takes the tracked per-row metrics; `reason` /
`status` / `role` / `endpoint` the fixed sets below. `alerts_total` carries the slices that ever fired.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# The exposed names (counters carry the _total suffix in the exposition format).
METRIC_NAMES: tuple[str, ...] = (
    "tailguard_monitor_requests_total",
    "tailguard_monitor_invalid_requests_total",
    "tailguard_monitor_sampled_total",
    "tailguard_monitor_dropped_total",
    "tailguard_monitor_candidate_failures_total",
    "tailguard_monitor_queue_depth",
    "tailguard_monitor_inference_seconds",
    "tailguard_monitor_ingest_seconds",
    "tailguard_monitor_slice_parity",
    "tailguard_monitor_slice_samples",
    "tailguard_monitor_slice_evidence",
    "tailguard_monitor_slices_tracked",
    "tailguard_monitor_slices_evicted_total",
    "tailguard_monitor_slice_values_cut_total",
    "tailguard_monitor_alert_active",
    "tailguard_monitor_alerts_total",
    "tailguard_monitor_models_ready",
    "tailguard_monitor_s3_uploads_total",
    "tailguard_monitor_spool_bytes",
    "tailguard_monitor_sink_parameters_dropped_total",
    "tailguard_monitor_peer_errors_total",
    "tailguard_monitor_incomplete_polls_total",
    "tailguard_monitor_node_mismatch",
    "tailguard_monitor_candidate_source_total",
)
DROP_REASONS = ("queue_full", "reference_error", "reference_timeout", "non_finite", "reference_missing",
                "candidate_missing", "internal_error", "unmatched", "join_overflow", "sink_full", "sink_error")
# A candidate failure is not a drop: it is compared, as the worst disagreement (candidate_error_rate = 1 on its
# rows, agreement 0; monitoring/compare.py failure_rows), and counted here by what happened.
CANDIDATE_FAILURES = ("candidate_error", "candidate_timeout", "candidate_shape")
# unmatched / join_overflow: a KServe payload-logger half (request or response CloudEvent) that never met its
# partner within monitoring.logger_join_ttl_s, or was evicted from a full join buffer (monitoring/join.py).
UPLOAD_STATUSES = ("ok", "spooled", "retried_ok", "dropped")
ENDPOINTS = ("infer", "pairs", "logger", "grpc")
# Where a compared request's candidate output came from (label `source` of candidate_source_total, field
# `candidate_source` of sampled-pair records; monitoring/node_check.py): the served
# response (live: /pairs, /logger), or recomputed by the monitor (mirror: /infer, gRPC) on a node that matches a node
# the candidate was validated on or could not be checked (recomputed), or on one that matches none of them.
CANDIDATE_SOURCES = ("live", "recomputed", "recomputed_other_node")
ROLES = ("reference", "candidate")
# Ingest is sub-millisecond; inference spans ms to seconds.
INGEST_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
INFERENCE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass
class SliceRow:
    """One exported slice at scrape time.

    Attributes:
        slice: slice key.
        sampled: sampled requests counted under the key.
        rows: rows compared in the slice.
        means: {metric: display estimate}.
        evidence: {metric: alarm statistic / alarm threshold} for metrics with a threshold.
        active: {metric: alert active} for metrics with a threshold.
    """

    slice: str
    sampled: int
    rows: int
    means: dict[str, float]
    evidence: dict[str, float] = field(default_factory=dict)
    active: dict[str, bool] = field(default_factory=dict)


@dataclass
class SliceExport:
    """What the slice collector exposes at one scrape (monitoring/slice_monitor.py `SliceMonitor.export`)."""

    model: str
    rows: list[SliceRow]
    tracked: int
    evicted: dict[str, int]
    cut: int


class SliceCollector:
    """Builds the per-slice series at scrape time from `source()` (bounded label set: module docstring)."""

    def __init__(self, source: Callable[[], SliceExport]) -> None:
        self.source = source

    def collect(self) -> Iterator[Any]:
        """Yield the metric families (prometheus_client custom-collector protocol)."""
        p = "tailguard_monitor_"
        snap = self.source()
        sampled = CounterMetricFamily(p + "sampled", "Requests chosen for the shadow comparison, by slice "
                                                     "(exported slices).", labels=["model", "slice"])
        parity = GaugeMetricFamily(p + "slice_parity", "Display estimate of a per-row parity metric (weighted, "
                                                       "decayed mean), by slice.", labels=["model", "slice", "metric"])
        samples = GaugeMetricFamily(p + "slice_samples", "Rows compared in the slice.", labels=["model", "slice"])
        evidence = GaugeMetricFamily(p + "slice_evidence", "Change-detector statistic over its alarm level "
                                                           "(1 = alarm).", labels=["model", "slice", "metric"])
        active = GaugeMetricFamily(p + "alert_active", "1 while a (slice, metric) alert is active.",
                                   labels=["model", "slice", "metric"])
        for r in snap.rows:
            sampled.add_metric([snap.model, r.slice], r.sampled)
            samples.add_metric([snap.model, r.slice], r.rows)
            for m, v in r.means.items():
                parity.add_metric([snap.model, r.slice, m], v)
            for m, v in r.evidence.items():
                evidence.add_metric([snap.model, r.slice, m], v)
                active.add_metric([snap.model, r.slice, m], 1.0 if r.active.get(m) else 0.0)
        tracked = GaugeMetricFamily(p + "slices_tracked", "Slice keys measured now.", labels=["model"])
        tracked.add_metric([snap.model], snap.tracked)
        evicted = CounterMetricFamily(p + "slices_evicted", "Slice keys evicted by the memory bound "
                                      "(max_tracked_slices), by table.", labels=["model", "table"])
        for table, n in snap.evicted.items():
            evicted.add_metric([snap.model, table], n)
        cut = CounterMetricFamily(p + "slice_values_cut", "Slice values changed to be exportable (invalid UTF-8 or "
                                                          "longer than 64 characters).", labels=["model"])
        cut.add_metric([snap.model], snap.cut)
        yield from (sampled, parity, samples, evidence, active, tracked, evicted, cut)


class MonitorMetrics:
    """The monitor's Prometheus collectors, on their own registry (one per monitor, so tests can run several).

    Args:
        registry: registry to register on (default: a new CollectorRegistry).

    Attributes: requests, invalid_requests, dropped, queue_depth, inference_seconds, ingest_seconds, alerts,
        models_ready, s3_uploads, spool_bytes, sink_parameters_dropped, peer_errors, incomplete_polls, node_mismatch,
        candidate_source
        (named like METRIC_NAMES without the `tailguard_monitor_` prefix and `_total` suffix). The per-slice families
        come from a SliceCollector registered with `attach`.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        p = "tailguard_monitor_"
        self.requests = Counter(p + "requests", "OIP requests received.", ["model", "endpoint"], registry=r)
        self.invalid_requests = Counter(p + "invalid_requests", "Malformed OIP bodies refused (4xx), by reason.",
                                        ["reason"], registry=r)
        self.dropped = Counter(p + "dropped", "Sampled requests not compared, unjoined payload-logger halves, or "
                                              "sampled rows the S3 writer lost, by reason.", ["reason"], registry=r)
        self.candidate_failures = Counter(p + "candidate_failures", "Sampled requests the candidate failed on "
                                          "(raised, timed out, wrong output shape): compared as disagreement.",
                                          ["reason"], registry=r)
        self.queue_depth = Gauge(p + "queue_depth", "Sampled requests waiting for the shadow.", registry=r)
        self.inference_seconds = Histogram(p + "inference_seconds", "Shadow inference time per request (s).",
                                           ["model", "role"], buckets=INFERENCE_BUCKETS, registry=r)
        self.ingest_seconds = Histogram(p + "ingest_seconds", "Time ingest spends on a request (s).",
                                        ["endpoint"], buckets=INGEST_BUCKETS, registry=r)
        self.alerts = Counter(p + "alerts", "Alerts fired.", ["model", "slice", "metric"], registry=r)
        self.models_ready = Gauge(p + "models_ready", "1 when the model is loaded.", ["role"], registry=r)
        self.s3_uploads = Counter(p + "s3_uploads", "Sampled-pair batches by outcome.", ["status"], registry=r)
        self.spool_bytes = Gauge(p + "spool_bytes", "Bytes in the local spool waiting for S3.", registry=r)
        self.sink_parameters_dropped = Counter(p + "sink_parameters_dropped", "Request parameters not written to "
                                               "S3 (no slice rule reads them), one per parameter and row.",
                                               registry=r)
        # the combiner's peers (one per --peer, bounded) x combine.PeerError reasons
        self.peer_errors = Counter(p + "peer_errors", "Evidence documents from a peer not merged (or, "
                                   "epoch_flip, merged but served by several processes), by reason "
                                   "(monitoring/combine.py PeerError).", ["peer", "reason"], registry=r)
        self.incomplete_polls = Counter(p + "incomplete_polls", "Combiner polls that found its view of the "
                                        "replicas incomplete, by reason: several_processes (a --peer URL answers from "
                                        "more than one process: a load-balanced Service) or replicas_missing (fewer "
                                        "live replicas than --expect-replicas); /readyz is not ready meanwhile "
                                        "(monitoring/combine.py Combiner.incomplete).", ["reason"], registry=r)
        self.node_mismatch = Gauge(p + "node_mismatch", "1 when the candidate outputs this monitor recomputes are "
                                   "not computed as on any node the candidate passed its gates on (other ISA flags, "
                                   "or another execution provider; monitoring/node_check.py); 0 otherwise.",
                                   ["model"], registry=r)
        self.candidate_source = Counter(p + "candidate_source", "Compared requests by where the candidate's output "
                                        "came from: live (the served response), recomputed (by the monitor), "
                                        "recomputed_other_node (by the monitor, on a node unlike the validated ones).",
                                        ["model", "source"], registry=r)
        self.slices: SliceCollector | None = None
        for reason in DROP_REASONS:  # export zeros so rate() and absent() work from the start
            self.dropped.labels(reason)
        for reason in CANDIDATE_FAILURES:
            self.candidate_failures.labels(reason)
        for status in UPLOAD_STATUSES:
            self.s3_uploads.labels(status)
        for role in ROLES:
            self.models_ready.labels(role).set(0)

    def attach(self, source: Callable[[], SliceExport]) -> None:
        """Register the per-slice families, read from `source()` at each scrape (once per MonitorMetrics)."""
        if self.slices is None:
            self.slices = SliceCollector(source)
            self.registry.register(self.slices)

    def exposition(self) -> bytes:
        """The text exposition format (what /metrics serves)."""
        return generate_latest(self.registry)
