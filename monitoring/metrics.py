"""Prometheus metrics of the shadow monitor. The names and labels are a contract shared with the Grafana
dashboard and the PrometheusRule in manifests/: change them only with a deprecation path.

Label sets are bounded: `slice` takes at most monitoring.max_slices values plus "all" and "<name>=other";
`metric` the tracked per-row metrics; `reason` / `status` / `role` / `endpoint` the fixed sets below.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# The exposed names (counters carry the _total suffix in the exposition format).
METRIC_NAMES: tuple[str, ...] = (
    "tailguard_monitor_requests_total",
    "tailguard_monitor_invalid_requests_total",
    "tailguard_monitor_sampled_total",
    "tailguard_monitor_dropped_total",
    "tailguard_monitor_queue_depth",
    "tailguard_monitor_inference_seconds",
    "tailguard_monitor_ingest_seconds",
    "tailguard_monitor_slice_parity",
    "tailguard_monitor_slice_samples",
    "tailguard_monitor_alert_active",
    "tailguard_monitor_alerts_total",
    "tailguard_monitor_models_ready",
    "tailguard_monitor_s3_uploads_total",
    "tailguard_monitor_spool_bytes",
)
DROP_REASONS = ("queue_full", "reference_error", "reference_timeout", "non_finite", "reference_missing",
                "candidate_error", "unmatched", "join_overflow")
# unmatched / join_overflow: a KServe payload-logger half (request or response CloudEvent) that never met its
# partner within monitoring.logger_join_ttl_s, or was evicted from a full join buffer (monitoring/join.py).
UPLOAD_STATUSES = ("ok", "spooled", "retried_ok", "dropped")
ENDPOINTS = ("infer", "pairs", "logger")
ROLES = ("reference", "candidate")
# Ingest is sub-millisecond; inference spans ms to seconds.
INGEST_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
INFERENCE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class MonitorMetrics:
    """The monitor's Prometheus collectors, on their own registry (one per monitor, so tests can run several).

    Args:
        registry: registry to register on (default: a new CollectorRegistry).

    Attributes: one per METRIC_NAMES entry, named without the `tailguard_monitor_` prefix and `_total` suffix
        (requests, invalid_requests, sampled, dropped, queue_depth, inference_seconds, ingest_seconds,
        slice_parity, slice_samples, alert_active, alerts, models_ready, s3_uploads, spool_bytes).
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        p = "tailguard_monitor_"
        self.requests = Counter(p + "requests", "OIP requests received.", ["model", "endpoint"], registry=r)
        self.invalid_requests = Counter(p + "invalid_requests", "Malformed OIP bodies refused (4xx), by reason.",
                                        ["reason"], registry=r)
        self.sampled = Counter(p + "sampled", "Requests chosen for the shadow comparison, by slice.",
                               ["model", "slice"], registry=r)
        self.dropped = Counter(p + "dropped", "Sampled requests (or unjoined payload-logger halves) not compared, "
                                              "by reason.", ["reason"], registry=r)
        self.queue_depth = Gauge(p + "queue_depth", "Sampled requests waiting for the shadow.", registry=r)
        self.inference_seconds = Histogram(p + "inference_seconds", "Shadow inference time per request (s).",
                                           ["model", "role"], buckets=INFERENCE_BUCKETS, registry=r)
        self.ingest_seconds = Histogram(p + "ingest_seconds", "Time ingest spends on a request (s).",
                                        ["endpoint"], buckets=INGEST_BUCKETS, registry=r)
        self.slice_parity = Gauge(p + "slice_parity", "Window mean of a per-row parity metric, by slice.",
                                  ["model", "slice", "metric"], registry=r)
        self.slice_samples = Gauge(p + "slice_samples", "Rows in the slice's sliding window.",
                                   ["model", "slice"], registry=r)
        self.alert_active = Gauge(p + "alert_active", "1 while a (slice, metric) alert is active.",
                                  ["model", "slice", "metric"], registry=r)
        self.alerts = Counter(p + "alerts", "Alerts fired.", ["model", "slice", "metric"], registry=r)
        self.models_ready = Gauge(p + "models_ready", "1 when the model is loaded.", ["role"], registry=r)
        self.s3_uploads = Counter(p + "s3_uploads", "Sampled-pair batches by outcome.", ["status"], registry=r)
        self.spool_bytes = Gauge(p + "spool_bytes", "Bytes in the local spool waiting for S3.", registry=r)
        for reason in DROP_REASONS:  # export zeros so rate() and absent() work from the start
            self.dropped.labels(reason)
        for status in UPLOAD_STATUSES:
            self.s3_uploads.labels(status)
        for role in ROLES:
            self.models_ready.labels(role).set(0)

    def exposition(self) -> bytes:
        """The text exposition format (what /metrics serves)."""
        return generate_latest(self.registry)
