"""The slice monitor, shared by the HTTP service and the offline replay: slice keys -> sampling decision
(ingest side), and (reference, candidate) outputs -> per-row parity -> per-slice statistics -> alerts, metric
gauges, sampled-pair records (worker side)."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import time
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import numpy as np

from tailguard.core.errors import InputError
from tailguard.monitoring.combine import CheckpointLog, settings_hash
from tailguard.monitoring.compare import compare_rows, failure_rows, reference_non_finite
from tailguard.monitoring.config import ALL_SLICE, MonitorConfig, RowKeys
from tailguard.monitoring.detector import Evaluation, SliceStatistics
from tailguard.monitoring.prometheus import MonitorMetrics, SliceExport, SliceRow
from tailguard.monitoring.sampler import Decision, LongTailSampler
from tailguard.monitoring.units import GroupedRequest

log = logging.getLogger("tailguard.monitoring")


@dataclass
class Observation:
    """One sampled request's outputs (`SliceMonitor.observe`'s arguments; `observe_batch` takes a list).

    Attributes:
        keys: the request's slice keys (`SliceMonitor.admit`).
        decision: its sampling decision.
        reference: (batch, ...) reference output.
        candidate: (batch, ...) candidate output, or None when the candidate failed.
        request_index: sequence number for alert records.
        request_id: OIP request id (sampled-pair records).
        meta: slice metadata (sampled-pair records).
        feeds: model inputs (sampled-pair records; token_classification's mask).
        failure: the candidate's failure reason, or None.
        values: this request's rows of `compare_rows` computed for several requests at once, or None.
        candidate_source: where the candidate output came from (live | recomputed | recomputed_other_node).
    """

    keys: list[str]
    decision: Decision
    reference: np.ndarray
    candidate: np.ndarray | None
    request_index: int | None = None
    request_id: str = ""
    meta: Mapping[str, Any] | None = None
    feeds: Mapping[str, np.ndarray] | None = None
    failure: str | None = None
    values: Mapping[str, np.ndarray] | None = None
    candidate_source: str | None = None


class _Judged(NamedTuple):
    """`SliceMonitor._judge`'s result: reference (batch, ...) array, keep (batch,) bool (finite reference),
    failure, values {metric: (batch,)} (and "non_finite"), rows {metric: (kept,)} or None when no row is kept,
    whole: every row kept."""

    reference: np.ndarray
    keep: np.ndarray
    failure: str | None
    values: Mapping[str, np.ndarray]
    rows: dict[str, np.ndarray] | None
    whole: bool


class SliceMonitor:
    """Sampler + per-slice statistics and detectors + exporters' hooks for one (reference, candidate) pair.

    Args:
        cfg: resolved monitoring configuration.
        seed: sampler seed (default: the spec's monitoring.seed).
        metrics: Prometheus collectors to update, or None (replay without metrics). The per-slice families are
            attached to read this monitor at scrape time (`export`).
        on_sample: called with each sampled row's record (dict) after comparison (S3 sink, drift snapshots).
        lock: held while the exporter reads the statistics (the service's worker lock); None for replay.
        role: "standalone" (detects and alerts on its own rows), "replica" (`--evidence-only`: measures and exports
            evidence, never alerts) or "combiner" (`--peer`: its own rows and its peers' evidence feed one combined
            detector, whose alerts are the deployment's; monitoring/combine.py).
        max_request_rows: the detector's bound M on a request's rows (default: min(monitoring.max_request_rows,
            monitoring.max_batch_rows)); replay passes 1 (every logged row is a one-row request).
        clock: wall clock (s) of evidence time stamps (checkpoints, `as_of`; a combiner orders its sources'
            evidence by them, monitoring/combine.py Ordering).
    """

    def __init__(self, cfg: MonitorConfig, *, seed: int | None = None, metrics: MonitorMetrics | None = None,
                 on_sample: Callable[[dict[str, Any]], None] | None = None, lock: Any = None,
                 role: str = "standalone", max_request_rows: int | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        if role not in ("standalone", "replica", "combiner"):
            raise ValueError(f"role must be standalone, replica or combiner, got {role!r}")
        mon = cfg.mon
        self.cfg = cfg
        self.metrics = metrics
        self.on_sample = on_sample
        self.lock = lock
        self.sampler = LongTailSampler(mon.sample_rate, rare_slice_frequency=mon.rare_slice_frequency,
                                       max_oversample=mon.max_oversample,
                                       seed=seed if seed is not None else mon.seed, max_keys=mon.max_tracked_slices)
        self.role = role
        self.epoch = uuid.uuid4().hex  # identifies this process's evidence (a restart starts new walks)
        shared = dict(streams_per_request=cfg.keys_per_request, alpha=mon.alpha, horizon=mon.horizon,
                      window_size=mon.window_size, min_support=mon.min_support,
                      max_tracked_slices=mon.max_tracked_slices,
                      max_request_rows=(max_request_rows if max_request_rows is not None
                                        else min(mon.max_request_rows, mon.max_batch_rows)))
        self.stats = SliceStatistics(cfg.model_name, cfg.metrics, cfg.bounds, export_walks=role != "standalone",
                                     alerting=role == "standalone", **shared)
        self.stats.requests_seen = _SeenView(self.sampler)
        self.clock = clock
        # replicas and the combiner's own evidence: checkpoints every CHECKPOINT_EVERY sampled requests, so a
        # combiner that reads a backlog merges it in order (monitoring/combine.py Ordering)
        self.checkpoints = CheckpointLog(self.stats, clock=clock) if role != "standalone" else None
        self.last_reader = ""  # the combiner that read this evidence last (monitoring/combine.py Restart)
        self.combined = (SliceStatistics(cfg.model_name, cfg.metrics, cfg.bounds, source="combined", **shared)
                         if role == "combiner" else None)
        self.compared_rows = 0
        self.compared_requests = 0
        self.labels_cut = 0
        # fields added to every alert record when it is logged or read (`alerts`): the service's node check
        # (monitoring/node_check.py) puts the node's mismatch there; None: nothing added
        self.alert_notes: Callable[[], dict[str, Any]] | None = None
        if metrics is not None:
            metrics.attach(self.export)

    # ------------------------------------------------------------------------------------------ ingest
    def admit(self, meta: Mapping[str, Any], feeds: Mapping[str, np.ndarray] | None = None,
              headers: Mapping[str, str] | None = None) -> tuple[list[str], Decision]:
        """Slice keys (bounded) and the sampling decision for one request; counts `sampled_total`.

        The sampler decides on every key some row carries before the reference runs (column, header and
        input-derived slices), so a rare input-derived group is oversampled like a rare metadata value;
        output-derived keys are known only after the reference ran (`observe`).

        Args:
            meta: the request's slice metadata (OIP parameters or a replay row's metadata columns).
            feeds: the request's tensors, for input-derived slices (None: they are `missing`).
            headers: {lower-case name: value} for header slices.

        Returns:
            (keys: a `RowKeys` list, the Decision).

        Raises:
            InputError: a derived slice's input is missing or too short (the request's fault).
        """
        keys, cut = self.cfg.row_keys(meta, feeds, headers)
        self.labels_cut += cut
        return keys, self.sampler.decide(keys)

    # ------------------------------------------------------------------------------------------ worker
    def observe(self, keys: list[str], decision: Decision, reference: np.ndarray, candidate: np.ndarray | None, *,
                request_index: int | None = None, request_id: str = "", meta: Mapping[str, Any] | None = None,
                feeds: Mapping[str, np.ndarray] | None = None, now: datetime | None = None,
                failure: str | None = None, values: Mapping[str, np.ndarray] | None = None,
                candidate_source: str | None = None) -> Evaluation:
        """Compare one sampled request's outputs row by row and update statistics and alerts (one bet per slice
        and metric on the request: monitoring/detector.py).

        Rows whose reference output is non-finite are excluded (`dropped_total{reason="non_finite"}`, and each
        slice's `reference_failures`); a non-finite candidate row stays in, scored worst-case by parity. A
        candidate that failed (`failure` given, or `candidate` None, or an output shape other than the
        reference's) counts as the worst disagreement on every row (compare.failure_rows; candidate_error_rate 1).

        Args:
            keys: the request's slice keys (from `admit`).
            decision: its sampling decision (the weight is used).
            reference: (batch, ...) reference output.
            candidate: (batch, ...) candidate output, or None when the candidate failed.
            request_index: sequence number for alert records.
            request_id: OIP request id (for sampled-pair records).
            meta: slice metadata (for sampled-pair records).
            feeds: model inputs (for sampled-pair records).
            now: time stamp of fired alerts (default now).
            failure: the candidate's failure reason ("candidate_error", "candidate_timeout", "candidate_shape"),
                or None.
            values: this request's rows of `compare_rows` computed for several requests at once (the shadow
                worker's micro-batch), or None to compute them here.
            candidate_source: where the candidate output came from (metrics.CANDIDATE_SOURCES: live | recomputed
                | recomputed_other_node), copied to the sampled-pair records; None (replay): not recorded.

        Returns:
            The alerts fired/cleared.
        """
        return self.observe_batch([Observation(keys, decision, reference, candidate, request_index, request_id, meta,
                                               feeds, failure, values, candidate_source)], now=now)[0]

    def observe_batch(self, items: Sequence[Observation], *, now: datetime | None = None) -> list[Evaluation]:
        """`observe` of several sampled requests (the shadow worker's micro-batch), in order: the same statistics,
        alerts, counters and sampled-pair records as one `observe` per request, with the per-request numpy work
        done once for the batch (the reference's output-derived labels of every row: one `output_labels` call per
        rule; the slice groups' sums: `RowReducer.reduce_batch`, monitoring/units.py).

        Args:
            items: the requests in arrival order (Observation: `observe`'s arguments).
            now: time stamp of fired alerts (default now).

        Returns:
            One Evaluation per item (the alerts its update fired and cleared).
        """
        judged = [self._judge(it) for it in items]
        per_row = [j.rows is not None and isinstance(it.keys, RowKeys) and it.keys.per_row
                   for it, j in zip(items, judged)]
        kept = [(j.reference if j.whole else j.reference[j.keep]) if p else None  # per-row requests' outputs
                for j, p in zip(judged, per_row)]
        labels = iter(self._output_labels([ref for ref in kept if ref is not None]))
        requests: list[GroupedRequest | None] = []
        row_labels: list[list[str | list[str]] | None] = []  # per request, its rules' labels of the kept rows
        for it, j, p, ref in zip(items, judged, per_row, kept):
            row_labels.append(None)
            if j.rows is None:
                requests.append(None)
                continue
            uneven = any(x != 1.0 for x in it.decision.ratios)  # else every key's ratio is 1 (None below)
            ratios = dict(zip(it.keys, it.decision.ratios)) if uneven else {}
            if p:
                base = ratios.get(ALL_SLICE, 1.0)
                outs = next(labels)
                one = (self.cfg.one_row_group(it.keys, outs)  # type: ignore[arg-type]
                       if ref.shape[0] == 1 and j.whole else None)  # type: ignore[union-attr]
                if one is not None:  # a one-row request: its row's keys, one group
                    per_rule = one[0]
                    groups = [(one[1], None)]
                else:
                    per_rule = self.cfg.rule_labels(it.keys, ref, j.keep, outputs=outs)  # type: ignore[arg-type]
                    groups = self.cfg.groups_of(per_rule, int(ref.shape[0]))  # type: ignore[union-attr]
                row_labels[-1] = per_rule
                r = [[ratios.get(k, base) for k in group_keys] for group_keys, _ in groups] if ratios else None
            else:
                groups = [(list(it.keys), None)]
                r = [list(it.decision.ratios)] if uneven else None
            requests.append(GroupedRequest(groups, j.rows, it.decision.weight, r, it.request_index))
        batch = self.stats.reducer.reduce_batch([r for r in requests if r is not None])
        at = np.cumsum([req is not None for req in requests]).tolist()  # a request's batch position + 1
        # requests that only add to the statistics (compared, every reference row finite) are applied a run at a
        # time (`SliceStatistics.apply_batch`): the state after each run is the state one request at a time
        # leaves; the others (reference failures change the slices' versions in between; a process with
        # checkpoints takes them between requests) one at a time, in order
        clean = [req is not None and self.checkpoints is None and j.whole
                 for req, j in zip(requests, judged)]
        out: list[Evaluation] = []
        i = 0
        while i < len(items):
            end = i + 1
            if clean[i]:
                while end < len(items) and clean[end]:
                    end += 1
                evs = self.stats.apply_batch(requests[i:end], batch, now, first=at[i] - 1)  # type: ignore[arg-type]
            else:
                evs = [None]  # type: ignore[list-item]
            out += [self._add(items[n], judged[n], requests[n],
                              batch.per_request(at[n] - 1) if requests[n] is not None and ev is None else None,
                              now, row_labels[n], ev)
                    for n, ev in zip(range(i, end), evs)]
            i = end
        return out

    def _judge(self, it: Observation) -> _Judged:
        """One request's per-row values (no state changed): the candidate's failure, if any, decided as `observe`
        documents; rows with a non-finite reference output left out."""
        ref = np.asarray(it.reference)
        rows = int(ref.shape[0]) if ref.ndim else 1
        failure, values, candidate = it.failure, it.values, it.candidate
        if failure is None and (candidate is None or np.shape(candidate) != ref.shape):
            failure = "candidate_error" if candidate is None else "candidate_shape"
        if failure is None and values is None:
            try:
                values = compare_rows(self.cfg.model_task, ref, candidate, self.cfg.metrics,  # type: ignore[arg-type]
                                      probabilities=self.cfg.output.kind == "probabilities",
                                      decode=self.cfg.spec.model.decode, feeds=it.feeds)
            except InputError:  # an output the task cannot score (e.g. not 2-D logits): the candidate's fault
                failure = "candidate_shape"
        if failure is not None:
            values = failure_rows(rows, self.cfg.metrics, self.cfg.bounds)
            values["non_finite"] = np.zeros(rows, dtype=bool)
        keep = ~reference_non_finite(ref)
        whole = bool(keep.all())
        if whole:
            kept = {m: values[m] for m in self.cfg.metrics}  # type: ignore[index]
        else:
            kept = {m: values[m][keep] for m in self.cfg.metrics} if keep.any() else None  # type: ignore[index]
        return _Judged(ref, keep, failure, values, kept, whole)  # type: ignore[arg-type]

    def _output_labels(self, refs: list[np.ndarray]) -> list[list[list[str] | None] | None]:
        """Per request (its kept rows' reference output `refs[i]`), per rule, the labels of the output-derived
        rules (None for other rules, and for a rule whose labels the request computes on its own): one
        `output_labels` call per rule for every request of the batch whose outputs share a shape (the labels are
        per row)."""
        rules = [(i, r) for i, r in enumerate(self.cfg.rules) if r.source == "output"]
        if not rules or len(refs) < 2 or len({r.shape[1:] for r in refs}) > 1:
            return [None] * len(refs)
        joined = np.concatenate(refs)
        ends = np.cumsum([r.shape[0] for r in refs]).tolist()
        out: list[list[list[str] | None] | None] = [[None] * len(self.cfg.rules) for _ in refs]
        for i, rule in rules:
            try:
                labs = self.cfg.output_labels(rule, joined)
            except InputError:  # each request finds out on its own (its rule's group: `missing`)
                continue
            start = 0
            for n, end in enumerate(ends):
                out[n][i] = labs[start:end]  # type: ignore[index]
                start = end
        return out

    def _add(self, it: Observation, j: _Judged, req: GroupedRequest | None, prepared: Any,
             now: datetime | None, per_rule: list[str | list[str]] | None = None,
             applied: Evaluation | None = None) -> Evaluation:
        """The state changes of one judged request, in arrival order: counters, reference failures, the slices'
        statistics and detectors (`SliceStatistics.apply_groups`; `applied`: the Evaluation of a request the
        caller has applied already, `apply_batch`), checkpoints, alert logs, sampled-pair records (only with an
        `on_sample` consumer; each row's `slices` are its own keys: with per-row slices, `per_rule`, the rules'
        labels of the kept rows, gives them, `MonitorConfig.keys_per_row`)."""
        n_bad = 0 if j.whole else int(j.keep.size - np.count_nonzero(j.keep))
        if n_bad:
            if self.metrics is not None:
                self.metrics.dropped.labels("non_finite").inc(n_bad)
            self.stats.reference_failed(it.keys, n_bad)
        if j.failure is not None and self.metrics is not None:
            self.metrics.candidate_failures.labels(j.failure).inc()
        if req is None:
            return Evaluation()
        ev = applied if applied is not None else self.stats.apply_groups(req, prepared, now)
        if self.checkpoints is not None:
            self.checkpoints.tick()
        self.compared_rows += int(j.keep.shape[0]) if j.whole else int(np.count_nonzero(j.keep))
        self.compared_requests += 1
        self.report(ev)
        if self.on_sample is not None:
            values, ref, candidate = j.values, j.reference, it.candidate
            rows = np.flatnonzero(j.keep)
            own = self.cfg.keys_per_row(per_rule, rows.size) if per_rule is not None else None
            for pos, i in enumerate(rows):
                rec = {"request_id": it.request_id, "row": int(i), "request_index": it.request_index,
                       "weight": it.decision.weight, "slices": own[pos] if own is not None else list(it.keys),
                       "meta": dict(it.meta or {}),
                       "inputs": {k: np.asarray(v)[i] for k, v in (it.feeds or {}).items()},
                       "reference": np.asarray(ref[i]),
                       "candidate": np.asarray(candidate[i]) if j.failure is None else None,  # type: ignore[index]
                       "metrics": {m: float(values[m][i]) for m in self.cfg.metrics},
                       "non_finite_candidate": bool(values["non_finite"][i]), "candidate_failure": j.failure,
                       "candidate_source": it.candidate_source}
                self.on_sample(rec)
        return ev

    def reference_failed(self, keys: list[str], rows: int) -> None:
        """A sampled request the reference could not judge (error, timeout): excluded from the evidence (not the
        candidate's fault), counted in each of its slices (`reference_failures` in /v1/slices)."""
        self.stats.reference_failed(keys, rows)

    def observe_values(self, keys: list[str], decision: Decision, row: Mapping[str, Any], *,
                       request_index: int | None = None, now: datetime | None = None) -> Evaluation:
        """Add one sampled request's per-row metric values to its slices' statistics and detectors; log alerts.

        Args:
            keys: slice keys (from `admit`).
            decision: the request's sampling decision (weight 1/p and per-key ratios pi_k / p).
            row: {metric: (rows,) values, or a float for a one-row request} for every tracked metric.
            request_index: sequence number for alert records.
            now: time stamp for alert records.
        """
        ev = self.stats.update(keys, row, decision.weight, decision.ratios or None, request_index=request_index,
                               now=now)
        if self.checkpoints is not None:
            self.checkpoints.tick()
        first = next(iter(row.values()), 0.0)
        self.compared_rows += int(np.size(first))
        self.compared_requests += 1
        self.report(ev)
        return ev

    def report(self, ev: Evaluation) -> None:
        """Count and log fired / cleared alerts (with `alert_notes`)."""
        notes = self.alert_notes() if self.alert_notes is not None else {}
        for rec in ev.fired:
            if self.metrics is not None:
                self.metrics.alerts.labels(rec.model, rec.slice, rec.metric).inc()
            log.warning("alert fired: %s", json.dumps({**rec.to_dict(), **notes}))
        for rec in ev.cleared:
            log.info("alert cleared: %s", json.dumps({**rec.to_dict(), **notes}))

    def export(self) -> SliceExport:
        """The bounded per-slice view Prometheus scrapes (`all`, alerting slices, the max_slices worst)."""
        with self.lock if self.lock is not None else contextlib.nullcontext():
            st, local = self.decider, self.stats
            rows = []
            if ALL_SLICE not in st.slices:  # nothing compared yet: `all` is exported all the same (rate(), absent())
                rows.append(SliceRow(ALL_SLICE, self.sampler.sampled(ALL_SLICE), 0,
                                     {m: math.nan for m in self.cfg.metrics},
                                     {m: 0.0 for m in self.cfg.bounds}, {m: False for m in self.cfg.bounds}))
            for key in st.exported(self.cfg.mon.max_slices):
                s, mine = st.slices[key], local.slices.get(key)  # display estimates come from this process's rows
                rows.append(SliceRow(key, self.sampler.sampled(key), s.rows,
                                     {m: mine.mean(m) if mine is not None else math.nan for m in self.cfg.metrics},
                                     {m: x.alarm.statistic() / st.h for m, x in s.streams.items()},
                                     {m: x.active for m, x in s.streams.items()}))
            return SliceExport(self.cfg.model_name, rows, len(st.slices),
                               {"statistics": st.evicted, "sampler": self.sampler.evicted}, self.labels_cut)

    @property
    def decider(self) -> SliceStatistics:
        """The statistics whose detectors alert: the combined ones on a combiner, else this process's."""
        return self.combined if self.combined is not None else self.stats

    def evidence(self, since: int = 0, reader: str = "") -> dict[str, Any]:
        """This process's evidence since cursor `since` (GET /v1/evidence; monitoring/combine.py): the slices
        updated after it, the checkpoints after it, `as_of` (this clock), and its epoch, role and detector
        `settings` hash (a combiner refuses peers whose settings differ from its own).

        Args:
            since: the reader's cursor (a version of this process's statistics).
            reader: the reading combiner's id; the document reports the previous one (`last_reader`).
        """
        doc = self.stats.evidence(since)
        doc.update(self.evidence_checkpoints(since))
        return self.with_identity(doc, reader)

    def evidence_checkpoints(self, since: int) -> dict[str, Any]:
        """{"as_of", "checkpoints", "checkpoint_floor"} of an evidence document (take it with the version, under
        the same hold of the lock)."""
        cps = self.checkpoints
        return {"as_of": self.clock(), "checkpoints": cps.after(since) if cps is not None else [],
                "checkpoint_floor": cps.floor if cps is not None else 0}

    def with_identity(self, doc: dict[str, Any], reader: str = "") -> dict[str, Any]:
        """An evidence document ({"version", "slices", ...}) with this process's epoch, model, role, settings hash
        and `last_reader` (the reader before this one, "" if none) added (the service builds the slices in
        chunks, monitoring/service.py); records `reader` as the last one."""
        doc.update(epoch=self.epoch, model=self.cfg.model_name, role=self.role, settings=self.settings,
                   last_reader=self.last_reader)
        if reader:
            self.last_reader = reader[:128]
        return doc

    @functools.cached_property
    def settings(self) -> str:
        """sha256 of the detector settings and the spec's monitoring section (combine.settings_hash)."""
        return settings_hash(self.stats, self.cfg.mon.model_dump(mode="json"))

    # ---------------------------------------------------------------------------------------- reports
    def alerts(self) -> list[dict[str, Any]]:
        """Every alert fired so far (active or cleared), as dicts, in firing order, with `alert_notes`' fields."""
        notes = self.alert_notes() if self.alert_notes is not None else {}
        return [{**a.to_dict(), **notes} for a in self.decider.history]

    def slices(self, offset: int = 0, limit: int | None = None) -> dict[str, Any]:
        """Per-slice statistics plus the sampler's view (traffic counts, frequencies), sorted by slice key.

        Args:
            offset: first slice (in key order) to include.
            limit: at most this many slices (None: all of them).

        Returns:
            The slices.json document; `slices_total` is the number of tracked slices, `next_offset` the offset of
            the next page or None.
        """
        keys = sorted(self.decider.slices)
        page = keys[offset: None if limit is None else offset + limit]
        end = offset + len(page)
        return {**self.slices_header(), "slices_tracked": len(keys), "slices_total": len(keys), "offset": offset,
                "next_offset": end if end < len(keys) else None, "slices": self.slice_entries(page)}

    def slice_entries(self, keys: list[str]) -> dict[str, Any]:
        """{key: per-slice statistics plus the sampler's view} for those of `keys` still tracked, in that order
        (the service builds a page in chunks, each under the worker lock)."""
        st = self.decider
        summary = st.slice_summary([k for k in keys if k in st.slices])
        for key, entry in summary.items():
            entry["requests_seen"] = self.sampler.seen(key)
            entry["sampled"] = self.sampler.sampled(key)
            entry["traffic_share"] = round(self.sampler.frequency(key), 6)
        return summary

    def slices_header(self) -> dict[str, Any]:
        """The slices.json fields other than the page (`slices_tracked`, `slices_total`, `offset`, `next_offset`,
        `slices`): settings, counters, thresholds."""
        st = self.decider
        mon = self.cfg.mon
        return {"model": self.cfg.model_name, "task": self.cfg.model_task, "requests": self.sampler.total,
                "sampled": self.sampler.sampled_total, "compared_rows": self.compared_rows,
                "compared_requests": self.compared_requests,
                "sample_rate": mon.sample_rate, "window_size": mon.window_size, "min_support": mon.min_support,
                "alpha": mon.alpha, "horizon": mon.horizon, "detector": st.method,
                "max_request_rows": st.max_request_rows,
                "alarm_threshold": round(st.h, 6), "keys_per_request": self.cfg.keys_per_request, "role": self.role,
                "slices_evicted": st.evicted, "slices_evicted_strong": st.evicted_strong,
                "sampler_keys_evicted": self.sampler.evicted, "slice_values_cut": self.labels_cut,
                "slice_values_lumped": self.cfg.new_values.lumped if self.cfg.new_values is not None else 0,
                "thresholds": {m: {"value": b.value, "direction": "min" if b.higher_is_better else "max",
                                   "source": b.source} for m, b in self.cfg.bounds.items()}}


class _SeenView:
    """{slice key: requests seen} read from the sampler's table (for alert records)."""

    def __init__(self, sampler: LongTailSampler) -> None:
        self.sampler = sampler

    def get(self, key: str, default: int = 0) -> int:
        return self.sampler.seen(key) or default
