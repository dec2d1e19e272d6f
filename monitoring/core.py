"""The monitor's engine, shared by the HTTP service and the offline replay: slice keys -> sampling decision
(ingest side), and (reference, candidate) outputs -> per-row parity -> per-slice statistics -> alerts, metric
gauges, sampled-pair records (worker side)."""

from __future__ import annotations

import json
import logging
from datetime import datetime
from typing import Any, Callable, Mapping

import numpy as np

from tailguard.monitoring.compare import compare_rows, reference_non_finite
from tailguard.monitoring.config import MonitorConfig, SliceRegistry
from tailguard.monitoring.metrics import MonitorMetrics
from tailguard.monitoring.sampler import Decision, LongTailSampler
from tailguard.monitoring.stats import AlertRecord, Evaluation, SliceStatistics

log = logging.getLogger("tailguard.monitoring")


class MonitorCore:
    """Sampler + slice bound + statistics + exporters' hooks for one (reference, candidate) pair.

    Args:
        cfg: resolved monitoring configuration.
        seed: sampler seed (default: the spec's monitoring.seed).
        metrics: Prometheus collectors to update, or None (replay without metrics).
        on_sample: called with each sampled row's record (dict) after comparison (S3 sink, drift snapshots).
    """

    def __init__(self, cfg: MonitorConfig, *, seed: int | None = None, metrics: MonitorMetrics | None = None,
                 on_sample: Callable[[dict[str, Any]], None] | None = None) -> None:
        mon = cfg.mon
        self.cfg = cfg
        self.metrics = metrics
        self.on_sample = on_sample
        self.registry = SliceRegistry(mon.max_slices)
        self.sampler = LongTailSampler(mon.sample_rate, rare_slice_frequency=mon.rare_slice_frequency,
                                       max_oversample=mon.max_oversample,
                                       seed=seed if seed is not None else mon.seed)
        self.stats = SliceStatistics(cfg.model_name, cfg.metrics, cfg.bounds, window_size=mon.window_size,
                                     min_support=mon.min_support, alpha=mon.alpha, correction=mon.correction,
                                     max_slices=mon.max_slices, clear_factor=mon.clear_factor)
        self.compared_rows = 0

    # ------------------------------------------------------------------------------------------ ingest
    def admit(self, meta: Mapping[str, Any]) -> tuple[list[str], Decision]:
        """Slice keys (bounded) and the sampling decision for one request; counts `sampled_total`.

        Args:
            meta: the request's slice metadata (OIP parameters or a replay row's metadata columns).
        """
        keys = self.registry.bound(self.cfg.slice_keys(meta))
        d = self.sampler.decide(keys)
        if d.sampled and self.metrics is not None:
            for k in keys:
                self.metrics.sampled.labels(self.cfg.model_name, k).inc()
        return keys, d

    # ------------------------------------------------------------------------------------------ worker
    def observe(self, keys: list[str], decision: Decision, reference: np.ndarray, candidate: np.ndarray, *,
                request_index: int | None = None, request_id: str = "", meta: Mapping[str, Any] | None = None,
                feeds: Mapping[str, np.ndarray] | None = None, now: datetime | None = None) -> Evaluation:
        """Compare one sampled request's outputs row by row and update statistics and alerts.

        Rows whose reference output is non-finite are dropped (`dropped_total{reason="non_finite"}`); a
        non-finite candidate row stays in, scored worst-case by parity.

        Args:
            keys: the request's slice keys (from `admit`).
            decision: its sampling decision (the weight is used).
            reference: (batch, ...) reference output.
            candidate: (batch, ...) candidate output.
            request_index: sequence number for alert records.
            request_id: OIP request id (for sampled-pair records).
            meta: slice metadata (for sampled-pair records).
            feeds: model inputs (for sampled-pair records).
            now: time stamp of fired alerts (default now).

        Returns:
            The alerts fired/cleared.

        Raises:
            InputError: output shapes differ or do not suit the task.
        """
        bad_ref = reference_non_finite(reference)
        if bad_ref.any() and self.metrics is not None:
            self.metrics.dropped.labels("non_finite").inc(int(bad_ref.sum()))
        values = compare_rows(self.cfg.task, reference, candidate, self.cfg.metrics)
        total = Evaluation()
        for i in range(reference.shape[0]):
            if bad_ref[i]:
                continue
            row = {m: float(values[m][i]) for m in self.cfg.metrics}
            ev = self.observe_values(keys, decision.weight, row, request_index=request_index, now=now)
            total.fired += ev.fired
            total.cleared += ev.cleared
            if self.on_sample is not None:
                rec = {"request_id": request_id, "row": i, "request_index": request_index, "weight": decision.weight,
                       "slices": list(keys), "meta": dict(meta or {}),
                       "inputs": {k: np.asarray(v)[i] for k, v in (feeds or {}).items()},
                       "reference": np.asarray(reference[i]), "candidate": np.asarray(candidate[i]),
                       "metrics": row, "non_finite_candidate": bool(values["non_finite"][i])}
                self.on_sample(rec)
        return total

    def observe_values(self, keys: list[str], weight: float, row: Mapping[str, float], *,
                       request_index: int | None = None, now: datetime | None = None) -> Evaluation:
        """Add one row's per-row metric values to its slices; update gauges and alert state.

        Args:
            keys: slice keys.
            weight: sampling weight 1/p.
            row: {metric: value} for every tracked metric.
            request_index: sequence number for alert records.
            now: time stamp for alert records.
        """
        ev = self.stats.update(keys, row, weight, request_index=request_index, now=now)
        self.compared_rows += 1
        m = self.metrics
        if m is not None:
            name = self.cfg.model_name
            for k in keys:
                w = self.stats.windows[k]
                m.slice_samples.labels(name, k).set(w.n)
                for j, metric in enumerate(self.cfg.metrics):
                    m.slice_parity.labels(name, k, metric).set(w.mean(j))
        for rec in ev.fired:
            self._fired(rec)
        for rec in ev.cleared:
            if m is not None:
                m.alert_active.labels(rec.model, rec.slice, rec.metric).set(0)
            log.info("alert cleared: %s", json.dumps(rec.to_dict()))
        return ev

    def _fired(self, rec: AlertRecord) -> None:
        if self.metrics is not None:
            self.metrics.alerts.labels(rec.model, rec.slice, rec.metric).inc()
            self.metrics.alert_active.labels(rec.model, rec.slice, rec.metric).set(1)
        log.warning("alert fired: %s", json.dumps(rec.to_dict()))

    # ---------------------------------------------------------------------------------------- reports
    def alerts(self) -> list[dict[str, Any]]:
        """Every alert fired so far (active or cleared), as dicts, in firing order."""
        return [a.to_dict() for a in self.stats.history]

    def slices(self) -> dict[str, Any]:
        """Per-slice statistics plus the sampler's view (traffic counts, frequencies)."""
        summary = self.stats.slice_summary()
        for key, entry in summary.items():
            entry["requests_seen"] = self.sampler.counts.get(key, 0)
            entry["traffic_share"] = round(self.sampler.frequency(key), 6)
        return {"model": self.cfg.model_name, "task": self.cfg.task, "requests": self.sampler.total,
                "sampled": self.sampler.sampled_total, "compared_rows": self.compared_rows,
                "sample_rate": self.cfg.mon.sample_rate, "window_size": self.cfg.mon.window_size,
                "min_support": self.cfg.mon.min_support, "alpha": self.cfg.mon.alpha,
                "correction": self.cfg.mon.correction,
                "thresholds": {m: {"value": b.value, "direction": "min" if b.higher_is_better else "max",
                                   "source": b.source} for m, b in self.cfg.bounds.items()},
                "slices": summary}
