"""The spec's `monitoring` section: the shadow-traffic monitor's settings (`MonitoringSpec`), its per-metric
thresholds (`MonitorThreshold`, checked against the metric catalogue's direction and range) and the S3 sink
(`MonitorS3Spec`). Used by `tailguard monitor serve` / `replay` (docs/monitor.md) and checked by `spec check`.
"""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from tailguard.core import metrics as _metrics
from tailguard.core.errors import FieldError
from tailguard.core.spec.base import SpecModel

# Per-row parity metrics (tailguard.core.parity) the shadow monitor can track and alert on (metric catalogue).
MONITOR_METRICS: tuple[str, ...] = tuple(r.key for r in _metrics.ROW_METRICS if r.monitored)


# Direction and range of a monitored metric come from the metric catalogue (tailguard.core.metrics.ROW_METRICS);
# `spec check` checks each threshold against them (MonitorThreshold.problems, via MonitoringSpec.model_task_problems).
class MonitorThreshold(SpecModel):
    """When a monitored per-row parity metric is bad in a slice: an absolute bound, or an allowed drop from a
    baseline (e.g. the variant's validation value). Give exactly one of `min`, `max`, or `baseline` + `max_drop`.

    The direction of `max_drop` follows the metric: agreement and cosine similarity are higher-is-better
    (bad when < baseline - max_drop); KL divergence and errors are lower-is-better (bad when > baseline + max_drop).
    """

    min: float | None = Field(None, description="Bad when the slice's mean is confidently below this value.")
    max: float | None = Field(None, description="Bad when the slice's mean is confidently above this value.")
    baseline: float | None = Field(None, description=(
        "Expected value of the metric (e.g. the promoted variant's validation value); needs max_drop."))
    max_drop: float | None = Field(None, ge=0, description=(
        "Allowed change from `baseline` in the metric's bad direction (absolute units of the metric)."))
    truncate_at: float | None = Field(None, gt=0, description=(
        "For a lower-is-better metric without an upper end (kl_divergence, abs_error, rel_error): row values "
        "above this count as this value in both the alarm and the recovery test, so the detector watches the "
        "truncated mean E[min(x, truncate_at)] on both sides and an alert can clear on evidence. Without it "
        "such an alert stays active until the monitor restarts (docs/monitor.md, Recovery)."))

    @model_validator(mode="after")
    def _one_kind(self) -> "MonitorThreshold":
        kinds = [k for k, v in (("min", self.min), ("max", self.max)) if v is not None]
        relative = self.baseline is not None or self.max_drop is not None
        if relative and (self.baseline is None or self.max_drop is None):
            raise ValueError("baseline and max_drop go together")
        if len(kinds) + int(relative) != 1:
            raise ValueError("give exactly one of min, max, or baseline + max_drop")
        return self

    def problems(self, metric: str, path: str) -> list[FieldError]:
        """What is wrong with this threshold for a per-row metric, from the metric catalogue's direction and range.

        Rules: `min` only for a higher-is-better metric, `max` only for a lower-is-better one (the bad side);
        every value (min, max, baseline) inside the metric's range; and the resolved threshold (min, max, or
        baseline -/+ max_drop) short of the range's bad end, where the slice mean could never be confidently
        beyond it, so the alert could never fire (e.g. top1_agree min 0, cosine_similarity min -1).

        Args:
            metric: a per-row key of the catalogue's ROW_METRICS, e.g. "top1_agree".
            path: field path of this threshold, e.g. "monitoring.thresholds.top1_agree".

        Returns:
            One FieldError per problem (path + ".min", ".max", ".baseline" or ".max_drop"); [] when sound.

        Raises:
            InputError: `metric` is not a per-row key.
        """
        row = _metrics.row_metric(metric)
        higher = row.higher_is_better
        lo, hi = row.value_range
        bad_end = lo if higher else hi  # the value the slice mean cannot be confidently beyond
        where = f"[{lo:g}, {hi:g}]" if hi != float("inf") else f"[{lo:g}, inf)"
        units = f" ({row.units}{', a fraction, not a percentage' if (lo, hi) == (0.0, 1.0) else ''})"
        never = "a slice mean is never confidently beyond it, so this threshold never alerts"
        errors: list[FieldError] = []
        for key in ("min", "max"):
            value = getattr(self, key)
            if value is None:
                continue
            if (key == "min") != higher:
                kind = "higher-is-better (bad when low)" if higher else "lower-is-better (bad when high)"
                errors.append(FieldError(f"{path}.{key}", f"{metric} is {kind}: give {'min' if higher else 'max'}, "
                                                          f"not {key}", value))
            elif not lo <= value <= hi:
                errors.append(FieldError(f"{path}.{key}", f"{metric} lies in {where}{units}, got {value:g}", value))
            elif value == bad_end:
                errors.append(FieldError(f"{path}.{key}", f"{metric} {key} {value:g} is the metric's "
                                                          f"{'lowest' if higher else 'highest'} value: {never}", value))
        if self.baseline is not None and self.max_drop is not None:
            threshold = self.baseline - self.max_drop if higher else self.baseline + self.max_drop
            if not lo <= self.baseline <= hi:
                errors.append(FieldError(f"{path}.baseline", f"{metric} lies in {where}{units}, got "
                                                             f"{self.baseline:g}", self.baseline))
            elif (threshold <= lo) if higher else (threshold >= hi):
                errors.append(FieldError(f"{path}.max_drop", (
                    f"baseline {'-' if higher else '+'} max_drop = {threshold:g} is at or beyond {metric}'s "
                    f"{'lowest' if higher else 'highest'} value {bad_end:g}: {never}; give a max_drop below "
                    f"{abs(self.baseline - bad_end):g}"), self.max_drop))
        if self.truncate_at is not None:
            threshold = (self.min if self.min is not None else self.max if self.max is not None
                         else (self.baseline or 0.0) + (self.max_drop or 0.0))
            if higher or hi != float("inf"):
                errors.append(FieldError(f"{path}.truncate_at", (
                    f"{metric} is bounded on its bad side ({where}): truncate_at is only for a lower-is-better "
                    "metric without an upper end (kl_divergence, abs_error, rel_error); remove it"),
                    self.truncate_at))
            elif self.truncate_at <= threshold:
                errors.append(FieldError(f"{path}.truncate_at", (
                    f"truncate_at {self.truncate_at:g} must lie above the threshold {threshold:g} (a truncated "
                    "value at or below the threshold could never look bad); e.g. 10x the threshold"),
                    self.truncate_at))
        return errors


class MonitorS3Spec(SpecModel):
    """Where sampled (request, reference, candidate) pairs go: Parquet batches in S3 (boto3)."""

    bucket: str = Field(description="S3 bucket.", min_length=3)
    prefix: str = Field("tailguard/monitor",
                        description="Key prefix; objects are <prefix>/<model>/<date>/<id>.parquet.")
    endpoint_url: str | None = Field(None, description="S3-compatible endpoint (MinIO, moto); default AWS.")
    region: str | None = Field(None, description="AWS region (default: the boto3 configuration).")
    batch_rows: int = Field(500, ge=1, description="Sampled pairs per Parquet object.")
    flush_interval_s: float = Field(60.0, gt=0, description="Write a partial batch after this long (s).")
    retry_interval_s: float = Field(30.0, gt=0, description="Retry spooled batches this often (s).")


class MonitoringSpec(SpecModel):
    """Shadow-traffic monitor settings (used by `tailguard monitor serve` / `replay`; docs/monitor.md).

    Slices come from the request's OIP `parameters` (serve) or the metadata columns (replay). Every slice key is
    measured (up to `max_tracked_slices`); per (slice, metric) with a threshold, a betting CUSUM (sequential
    change detection) tests the slice's traffic mean against the threshold, with the probability of any false
    alarm within `horizon` sampled requests at most `alpha`, across every slice and metric. Only `all`, alerting
    slices and the `max_slices` slices with the most evidence are exported as Prometheus labels.
    """

    sample_rate: float = Field(gt=0, le=1, description=(
        "Base fraction of live requests compared with the reference (required: there is no safe default)."))
    seed: int | None = Field(None, description="Sampler seed (serve); None draws one. Replay takes --seed.")
    rare_slice_frequency: float = Field(0.05, ge=0, le=1, description=(
        "A slice seen in less than this fraction of the traffic so far is oversampled by "
        "rare_slice_frequency / frequency (capped by max_oversample); 0 turns oversampling off."))
    max_oversample: float = Field(20.0, ge=1, description="Cap of the rare-slice oversampling factor.")
    slice_columns: list[str] | None = Field(None, description=(
        "Slices to track: names of declared `slices` (their column, header or derive rule, bins and values "
        "apply) or plain metadata columns / request parameters (grouped by value). Default: every declared "
        "slice, plus by model task `predicted` (classification: the reference's top-1 class) or `topic` (embedding: "
        "the nearest of the pipeline's 16 topic centroids, given with --centroids), which need nothing from "
        "the client."))
    per_row_metadata: bool = Field(False, description=(
        "Column slices accept one value per row: a request parameter holding a list (or a string with a JSON "
        "list) of as many values as the request has rows. Each such rule then counts min(max_batch_rows, its "
        "groups) keys per request in the false-alarm budget instead of 1 (docs/monitor.md, Per-row slices)."))
    slice_pairs: bool | list[list[str]] = Field(False, description=(
        "Intersections tracked as slices too (keys like 'locale=37&ink=low'): true for every pair of "
        "slice_columns, or a list of [name, name] pairs. Each pair adds one detector update per sampled request, "
        "which the false-alarm control counts."))
    max_tracked_slices: int = Field(100_000, ge=1, le=10_000_000, description=(
        "Memory bound on measured slice keys (about 1 KB each); past it the least recently updated slice "
        "without an active alert is evicted and counted (tailguard_monitor_slices_evicted_total)."))
    max_slices: int = Field(50, ge=1, le=1000, description=(
        "Prometheus label bound: besides 'all' and every slice with an active alert, at most this many slices "
        "(those with the most evidence) are exported; every slice is in /v1/slices and slices.json."))
    metrics: list[str] | None = Field(None, description=(
        "Per-row parity metrics to track (tailguard.core.parity); default by model task: classification "
        "top1_agree, kl_divergence, abs_error; embedding cosine_similarity, abs_error; regression/generic "
        "abs_error, rel_error. candidate_error_rate (1 for a sampled row the candidate failed on) is always "
        "tracked."))
    thresholds: dict[str, MonitorThreshold] | None = Field(None, description=(
        "Alert thresholds by per-row metric; default: classification top1_agree min 0.97, embedding "
        "cosine_similarity min 0.98, none for regression/generic; candidate_error_rate max 0 always (a "
        "candidate that fails on sampled rows alerts) unless given here. Metrics without a threshold are "
        "exported, never alerted on."))
    alpha: float = Field(0.01, gt=0, lt=0.5, description=(
        "Probability of any false alarm (any slice, any metric) within `horizon` sampled requests while every "
        "slice's per-row mean (rows weighted equally, as the pipeline's gates weight them) sits at or on the "
        "good side of its threshold (requests independent of each other given the past; the rows of one "
        "request need not be: the request is the unit of evidence, docs/monitor.md)."))
    horizon: int = Field(1_000_000, ge=1, description=(
        "Sampled requests (not rows: a 64-row request counts once; one of more than max_request_rows rows "
        "counts as ceil(rows / max_request_rows)) the alpha guarantee covers; the average run length to a "
        "false alarm is at least horizon / alpha sampled requests."))
    max_request_rows: int = Field(64, ge=1, le=2**20, description=(
        "Declared bound M on the rows one request brings to a slice (the detector's scale: each request bets "
        "on the sum of its rows' excesses over the threshold divided by M, which keeps every bet valid "
        "whatever the dependence between a request's rows, docs/monitor.md). Set it to the largest batch your "
        "clients send: a smaller M gives small requests more power; a request with more rows is split into "
        "ceil(rows / M) consecutive bets of at most M rows and counted (oversize_requests in /v1/slices), "
        "and the guarantee then also assumes each such chunk is on the good side given the chunks before "
        "it. Values above max_batch_rows act as max_batch_rows (no larger request is accepted)."))
    window_size: int = Field(1000, ge=10, description=(
        "Span (sampled rows) of each slice's exponentially weighted display estimate (the parity gauges); "
        "alerts do not depend on it."))
    min_support: int = Field(30, ge=1, description=(
        "A slice alerts only once it has this many sampled rows (a guard against alerts on a handful of rows; "
        "the false-alarm guarantee does not need it)."))
    shadow_batch_rows: int = Field(256, ge=1, le=65536, description=(
        "The shadow worker runs queued sampled requests that share an input signature (names, dtypes, "
        "non-batch dimensions) as one inference call per model, up to this many rows; each request keeps its "
        "own evidence. 1 turns micro-batching off."))
    shadow_batch_adapt: bool = Field(True, description=(
        "Adapt the micro-batch size to the measured inference time so that a call fits reference_timeout_s: it "
        "starts at 16 rows (at most shadow_batch_rows), halves after a call slower than half the timeout, and "
        "grows back (doubling at first, then by 1/8) after full calls faster than a quarter of it, never above "
        "shadow_batch_rows (docs/monitor.md, Drops); the size is exported as "
        "tailguard_monitor_shadow_batch_rows{role}. false: always shadow_batch_rows."))
    shadow_batch_wait_ms: float = Field(2.0, ge=0, le=1000, description=(
        "Longest wait (ms) for more queued requests to fill a micro-batch once one is taken; 0 takes only "
        "what is already queued."))
    noise_floor: bool = Field(False, description=(
        "Compare the reference with itself (a second run) instead of the candidate: measures the "
        "comparison's own noise; must never alert."))
    queue_size: int = Field(1000, ge=1, description="Sampled requests waiting for the shadow; more are dropped.")
    reference_timeout_s: float = Field(2.0, gt=0, description=(
        "A model call slower than this is given up (s): its sampled requests are dropped "
        "(dropped_total{reason=\"reference_timeout\"}; a candidate's counts as candidate_timeout) and the call is "
        "observed in tailguard_monitor_inference_seconds at this time."))
    body_read_timeout_s: float = Field(30.0, gt=0, le=3600, description=(
        "Seconds an ingest request may take to deliver its body once its headers arrived (HTTP) or its message "
        "once the call started (gRPC ModelInfer); a slower one is refused (HTTP 408, gRPC CANCELLED) and counted "
        "(invalid_requests_total{reason=\"body_read_timeout\"}), so stalled clients cannot hold the ingest."))
    logger_join_max_entries: int = Field(10000, ge=1, description=(
        "KServe payload-logger endpoint (POST /v2/models/{name}/logger): at most this many CloudEvent halves "
        "(a request or a response whose other half has not arrived) wait to be joined by ce-id; when full, the "
        "oldest is dropped (dropped_total{reason=\"join_overflow\"}). Memory grows with it (one body each)."))
    logger_join_ttl_s: float = Field(30.0, gt=0, description=(
        "A payload-logger half whose other half has not arrived within this many seconds is dropped "
        "(dropped_total{reason=\"unmatched\"}); cover the serving latency plus the logger's queueing delay."))
    model_name: str | None = Field(None, description=(
        "Model name in the OIP paths /v2/models/{name}/... (default: metadata.name)."))
    redact_fields: list[str] = Field(default_factory=list, description=(
        "Input names or request parameters replaced by '<redacted>' before sampled pairs leave the process."))
    s3: MonitorS3Spec | None = Field(None, description="Sampled pairs to S3 as Parquet (off when absent).")
    spool_dir: str | None = Field(None, description=(
        "Local spool for batches S3 did not take (default $TAILGUARD_HOME/monitor/spool)."))
    spool_max_bytes: int = Field(256 * 2**20, ge=1024, description="Spool bound (bytes); beyond it batches are "
                                                                    "dropped and counted.")
    evidently_workspace: str | None = Field(None, description=(
        "Evidently workspace folder for drift snapshots (`evidently ui --workspace PATH`); off when absent."))
    evidently_project: str = Field("tailguard-monitor", description="Evidently project name.")
    snapshot_every: int = Field(1000, ge=10, description="Sampled rows per Evidently snapshot (one window).")
    drift_reference: str | None = Field(None, description=(
        "Parquet file of reference inputs for input drift (default: data.calibration.uri)."))
    max_body_bytes: int = Field(8 * 2**20, ge=1024, le=2**31, description=(
        "Largest body accepted by the ingest endpoints (infer, pairs, and each payload-logger CloudEvent), in "
        "bytes; larger ones are refused with 413 before they are parsed "
        "(invalid_requests_total{reason=\"body_too_large\"})."))
    max_batch_rows: int = Field(1024, ge=1, le=2**31, description=(
        "Most rows (the first dimension of the inputs) one request may carry; larger requests are refused with "
        "413 (invalid_requests_total{reason=\"batch_too_large\"}), so one request cannot flood the windows."))
    logger_join_max_bytes: int = Field(256 * 2**20, ge=1024, le=2**40, description=(
        "Payload-logger join buffer: most bytes of waiting halves held at once (each half is kept as the raw "
        "body it arrived as, parsed again when its partner comes); a half that does not fit evicts the oldest "
        "ones (dropped_total{reason=\"join_overflow\"})."))
    logger_join_max_entry_bytes: int | None = Field(None, ge=1024, le=2**31, description=(
        "Payload-logger join buffer: largest half that may wait for its partner, in bytes (default: "
        "max_body_bytes); a larger first half is refused with 413 "
        "(invalid_requests_total{reason=\"join_entry_too_large\"})."))
    max_concurrent_requests: int = Field(64, ge=1, le=100_000, description=(
        "HTTP ingest requests (POST /v2/...) handled at once; more are answered 503 at once, before their body "
        "is read (invalid_requests_total{reason=\"too_many_requests\"}). uvicorn's own limit_concurrency (open "
        "connections and tasks, a memory bound) is set to this plus 1024."))
    max_inflight_body_bytes: int = Field(256 * 2**20, ge=1024, le=2**40, description=(
        "Bytes of HTTP ingest bodies being read at once, over every request in flight (a declared "
        "Content-Length is reserved before reading); a body that does not fit is answered 503 "
        "(invalid_requests_total{reason=\"body_budget_exceeded\"}). At least max_body_bytes."))
    max_new_values_per_minute: int | None = Field(1000, ge=1, le=10_000_000, description=(
        "Per slice column, at most this many values the monitor does not track yet get their own slice key per "
        "minute (a token bucket); the excess is lumped into '<name>=__new__' and counted "
        "(tailguard_monitor_slice_values_lumped_total), so a flood of unique values cannot evict real slices. "
        "null: no limit."))
    auth_token_env: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", description=(
        "Name of the environment variable holding the bearer token every monitor endpoint requires "
        "(Authorization: Bearer <token>; gRPC metadata `authorization`), e.g. from a Kubernetes Secret. Never "
        "the token itself. Unset (and no auth_token_file / --auth-token-file): no authentication."))
    auth_token_file: str | None = Field(None, description=(
        "Path of a file holding the bearer token (a mounted Secret); `monitor serve --auth-token-file` "
        "overrides it. At most one of auth_token_env and auth_token_file."))
    probe_port: int = Field(8082, ge=0, le=65535, description=(
        "`monitor serve` also answers /healthz, /readyz and /metrics (same authentication rules) on this port, "
        "from a small server of its own that no number of ingest connections can starve (uvicorn's "
        "limit_concurrency on the ingest port counts every open connection); point the kubelet probes and "
        "Prometheus here. `monitor serve --probe-port` overrides it; 0 turns it off. The routes stay on the "
        "ingest port too."))
    max_drop_rate: float = Field(0.05, ge=0, le=1, description=(
        "/readyz answers 503 `degraded` while more than this share of the sampled requests of the last "
        "DROP_WINDOW_S seconds (at least DROP_MIN_SAMPLED of them; monitoring/readiness.py) were dropped "
        "uncompared (queue_full, reference_timeout, reference_error, internal_error): the evidence is then no "
        "longer the sample the false-alarm guarantee assumes (docs/monitor.md, Drops). 1 never degrades."))
    auth_readyz: bool = Field(False, description=(
        "With a token: /readyz (and gRPC ServerReady/ModelReady) require it too. Default false: kubelet probes "
        "send no token. /healthz and gRPC ServerLive never require it."))
    auth_metrics: bool = Field(True, description=(
        "With a token: /metrics requires it (give Prometheus the token: ServiceMonitor "
        "`authorization.credentials`). false: /metrics is open."))

    @model_validator(mode="after")
    def _hardening_bounds(self) -> "MonitoringSpec":
        if self.max_inflight_body_bytes < self.max_body_bytes:
            raise ValueError(f"max_inflight_body_bytes ({self.max_inflight_body_bytes}) is below max_body_bytes "
                             f"({self.max_body_bytes}): a largest body could never be read; raise it")
        if self.auth_token_env and self.auth_token_file:
            raise ValueError("auth_token_env and auth_token_file both set: name one source of the token")
        return self

    @field_validator("thresholds")
    @classmethod
    def _known_threshold_metrics(cls, v: dict[str, MonitorThreshold] | None) -> dict[str, MonitorThreshold] | None:
        known = MONITOR_METRICS
        for k in v or {}:
            if k not in known:
                raise ValueError(f"unknown per-row metric {k!r}; choose from {sorted(known)}")
        return v

    @field_validator("metrics")
    @classmethod
    def _known_metrics(cls, v: list[str] | None) -> list[str] | None:
        known = MONITOR_METRICS
        for k in v or []:
            if k not in known:
                raise ValueError(f"unknown per-row metric {k!r}; choose from {sorted(known)}")
        return v

    def model_task_problems(self, model_task: str) -> list[FieldError]:
        """What is wrong with the tracked metrics and thresholds for the model's task (field paths under
        `monitoring.`); `Spec` reports them at `spec check`, `monitoring.config.resolve_config` again.

        Rules: every `metrics` entry is a per-row metric the monitor computes for the model task (catalogue:
        classification top1_agree, kl_divergence, abs_error; embedding cosine_similarity, abs_error;
        regression/generic abs_error, rel_error); every `thresholds` key is tracked (`metrics`, default all of
        the model task's); each threshold passes `MonitorThreshold.problems` (direction, range).

        Args:
            model_task: model.task.

        Returns:
            One FieldError per problem, [] when sound.
        """
        available = _metrics.monitor_metrics(model_task)
        tracked = tuple(self.metrics) if self.metrics else available
        errors = [FieldError(f"monitoring.metrics.{i}", f"{m!r} is not a per-row metric of model.task "
                                                       f"{model_task!r}; use {sorted(available)}", m)
                  for i, m in enumerate(self.metrics or []) if m not in available]
        for m, threshold in (self.thresholds or {}).items():
            path = f"monitoring.thresholds.{m}"
            if m not in tracked:
                why = (f"{m!r} is not a per-row metric of model.task {model_task!r} (use {sorted(available)})"
                       if m not in available else f"{m!r} is not tracked (add it to monitoring.metrics)")
                errors.append(FieldError(path, f"{why}; tracked metrics: {list(tracked)}"))
            elif m in _metrics.ROW_CATALOGUE and _metrics.ROW_CATALOGUE[m].direction is not None:
                errors.extend(threshold.problems(m, path))
        return errors
