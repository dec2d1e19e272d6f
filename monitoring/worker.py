"""The shadow worker of a monitor process: sampled requests from the bounded queue, compared in micro-batches.

Isolation of the live path: ingest (monitoring/ingest.py) only puts a sampled request on the bounded queue with
`put_nowait`; a worker thread runs the models, each call in its own one-thread pool with a timeout: a slow,
crashing, NaN-returning or missing reference only moves `dropped_total{reason=...}` (monitoring/readiness.py
counts the drops). The micro-batch size adapts to the measured inference time (`BatchSizer`).
`ShadowWorkerMixin` is the part of `MonitorService` (monitoring/service.py) that runs it.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import queue
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tailguard.core.errors import InputError
from tailguard.monitoring.compare import compare_rows
from tailguard.monitoring.sampler import Decision
from tailguard.monitoring.slice_monitor import Observation

# the monitor service's logger: one name for its records, whichever of the service's modules writes them
log = logging.getLogger("tailguard.monitoring.service")

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


@dataclass
class SampledRequest:
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


class ShadowWorkerMixin:
    """The shadow worker of `MonitorService` (monitoring/service.py), whose __init__ sets the state it reads:
    `cfg`, `metrics`, `monitor` and `_lock` (the worker lock: evidence is added under it), `queue` (of
    SampledRequest), `join` (swept when idle), `runners`, `_pools` (one one-thread pool per role), `sizers` (a
    BatchSizer per role) and `batch_rows_gauge`, `_stuck` (per role, a timed-out call that still holds the model's
    thread), `_batching` (per role, False once a model fails only when batched), `_health` (per role, the last
    HEALTH_WINDOW calls' drop reasons, monitoring/readiness.py), `_carry`, `_timer`, `_stop`, `drops`,
    `sources` and `processed`; it calls `_drop` (ReadinessMixin) and `candidate_source` (MonitorService).
    `MonitorService.start` runs `_work` on a thread."""

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

    def _run_one(self, role: str, item: SampledRequest) -> tuple[np.ndarray | None, str | None]:
        out, reason = self._call(role, item.feeds)
        self._health[role].append(reason)
        return out, reason

    def _run_group(self, role: str, items: list[SampledRequest]) -> list[tuple[np.ndarray | None, str | None]]:
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

    def _process(self, items: list[SampledRequest]) -> None:
        """Compare a micro-batch of sampled requests: group by input signature, run each model once per group,
        then add each request's evidence (under the worker lock)."""
        groups: dict[tuple, list[SampledRequest]] = {}
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
                    self.monitor.reference_failed(it.keys, it.rows)
                batch: list[Observation] = []
                for n, ((it, ref), (cand, reason)) in enumerate(zip(judged, seconds)):
                    if reason == "candidate_missing" or (self.cfg.mon.noise_floor and cand is None):
                        self._drop(reason or "reference_error")
                        continue
                    self.drops.add(1)
                    source = None if self.cfg.mon.noise_floor else self.candidate_source(it.candidate is not None)
                    if source is not None:
                        self.sources[source] += 1
                        self.metrics.candidate_source.labels(self.cfg.model_name, source).inc()
                    batch.append(Observation(it.keys, it.decision, ref, cand, request_index=it.index,
                                             request_id=it.request_id, meta=it.meta, feeds=it.feeds,
                                             failure=reason, values=shared.get(n), candidate_source=source))
                self.monitor.observe_batch(batch)  # in arrival order, the group's numpy work done once

    def _compare_group(self, judged: list[tuple[SampledRequest, np.ndarray]],
                       seconds: list[tuple[np.ndarray | None, str | None]]) -> dict[int, dict[str, np.ndarray]]:
        """Per-row parity of every answered request of a group in one `compare_rows` call (its numpy work is
        per call, not per row), split back per request: {position in `judged`: {metric: (rows,) values}}. Requests
        the candidate failed on, or answered in another shape, are left to `SliceMonitor.observe_batch`."""
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
            values = compare_rows(self.cfg.model_task, np.concatenate([judged[n][1] for n in ok]),
                                  np.concatenate([seconds[n][0] for n in ok]), self.cfg.metrics,
                                  probabilities=self.cfg.output.kind == "probabilities", decode=decode,
                                  feeds=feeds)
        except InputError:  # an output the task cannot score: each request finds out on its own
            return {}
        bounds = np.cumsum([0] + [judged[n][1].shape[0] for n in ok])
        return {n: {m: v[a:b] for m, v in values.items()} for n, a, b in zip(ok, bounds[:-1], bounds[1:])}

    def _gather(self, first: SampledRequest) -> list[SampledRequest]:
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

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """Block until the queue is empty and the worker idle (tests, benchmark). True when it got there."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.queue.unfinished_tasks == 0:
                return True
            time.sleep(0.01)
        return False
