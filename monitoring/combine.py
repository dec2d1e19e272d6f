"""Replicas: one change detector over the traffic of N monitor replicas, from the evidence each one exports.

A Kubernetes Service spreads the mirrored traffic over N replicas at random, so each replica sees about 1/N of
every slice: alone, each would need N times the traffic to detect a drift. The detector's evidence is additive
across replicas: a slice's betting CUSUM multiplies one e-value factor per sampled row (monitoring/stats.py), and a
product over a set of rows does not depend on the order or the replica that computed each factor. So every
replica exports, per (slice, metric), the running sums of its rows' log factors for each bet (the "walks", alarm
and recovery side) and its row count (`GET /v1/evidence`); one combiner (`tailguard monitor serve --peer URL ...`)
polls them, adds each replica's increments since the last poll, and runs the CUSUM recursion on the merged
increments, clipping at zero only between polls (fewer candidate change points: the false-alarm bound still
holds, monitoring/stats.py). The combiner's own traffic is merged the same way.

Family accounting: the replicas run with `--evidence-only` (they measure, export parity gauges for their share
and never alert), so the alerts of a deployment are the combiner's, and its alpha covers the horizon counted in
sampled requests of all replicas together. A replica that restarts (new epoch) or evicts a slice (new
incarnation) starts its walks again from zero; the combiner notices and counts only what is new.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Callable, Mapping

from tailguard.monitoring.stats import Evaluation, SliceStatistics

log = logging.getLogger("tailguard.monitoring.combine")

Fetch = Callable[[str, int], Mapping[str, Any]]  # (peer, since) -> evidence document


@dataclass
class _PeerState:
    epoch: str = ""
    cursor: int = 0
    # (slice, metric) -> (incarnation, rows, alarm walk, recovery walk) last merged
    last: dict[tuple[str, str], tuple[int, int, list[float], list[float]]] = field(default_factory=dict)
    errors: int = 0
    last_error: str = ""


class Combiner:
    """Merges evidence documents (MonitorCore.evidence) from several sources into one SliceStatistics.

    Args:
        stats: the combined statistics (source "combined"); its alerts are the deployment's.
        fetch: gets a source's evidence document since a cursor; raises on failure (counted, retried next poll).
        sources: source names (peer base URLs, or "self").
        lock: held while merging (the service's worker lock), not while fetching.
    """

    def __init__(self, stats: SliceStatistics, fetch: Fetch, sources: list[str], lock: Any = None) -> None:
        self.stats = stats
        self.lock = lock if lock is not None else contextlib.nullcontext()
        self.fetch = fetch
        self.peers = {s: _PeerState() for s in sources}
        self.polls = 0

    def poll(self, now: datetime | None = None) -> Evaluation:
        """Fetch every source once and merge what is new.

        Returns:
            Alerts fired and cleared by the merge.
        """
        ev = Evaluation()
        for name, st in self.peers.items():
            try:
                doc = self.fetch(name, st.cursor)
            except Exception as exc:  # a peer down must not stop the others: count, log, retry next poll
                st.errors += 1
                st.last_error = str(exc)[:200]
                log.warning("evidence from %s not read: %s", name, st.last_error)
                continue
            with self.lock:
                part = self.merge(st, doc, now)
            ev.fired += part.fired
            ev.cleared += part.cleared
        self.polls += 1
        return ev

    def merge(self, st: _PeerState, doc: Mapping[str, Any], now: datetime | None) -> Evaluation:
        """Merge one evidence document from a source with state `st`."""
        ev = Evaluation()
        if doc.get("epoch") != st.epoch:  # first poll or the replica restarted: its walks start from zero
            st.epoch, st.cursor, st.last = str(doc.get("epoch")), 0, {}
        for key, entry in doc.get("slices", {}).items():
            inc, rows_now = int(entry["incarnation"]), int(entry["rows"])
            walks, rows = {}, 0
            for metric, w in entry["metrics"].items():
                prev = st.last.get((key, metric))
                if prev is None or prev[0] != inc:  # new slice, or evicted and re-created on the replica
                    prev = (inc, 0, [0.0] * len(w["alarm"]), [0.0] * len(w["recovery"]))
                rows = rows_now - prev[1]
                walks[metric] = ([a - b for a, b in zip(w["alarm"], prev[2])],
                                 [a - b for a, b in zip(w["recovery"], prev[3])])
                st.last[(key, metric)] = (inc, rows_now, list(w["alarm"]), list(w["recovery"]))
            part = self.stats.merge(key, walks, rows, now=now)
            ev.fired += part.fired
            ev.cleared += part.cleared
        st.cursor = int(doc.get("version", st.cursor))
        return ev

    def status(self) -> dict[str, Any]:
        """Per source: epoch, cursor, failed polls and the last error (served in /readyz)."""
        return {n: {"epoch": s.epoch, "cursor": s.cursor, "errors": s.errors, "last_error": s.last_error}
                for n, s in self.peers.items()}


def http_fetch(timeout_s: float = 5.0) -> Fetch:
    """A Fetch over HTTP: GET {peer}/v1/evidence?since=N (httpx)."""
    import httpx

    client = httpx.Client(timeout=timeout_s)

    def fetch(peer: str, since: int) -> Mapping[str, Any]:
        r = client.get(peer.rstrip("/") + "/v1/evidence", params={"since": since})
        r.raise_for_status()
        return r.json()

    return fetch


class PollLoop:
    """Calls `poll()` every `interval_s` seconds in a daemon thread until stopped."""

    def __init__(self, poll: Callable[[], Any], interval_s: float) -> None:
        self.poll = poll
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tg-combine", daemon=True)

    def start(self) -> None:
        """Start polling."""
        self._thread.start()

    def stop(self) -> None:
        """Stop polling (returns after the current poll)."""
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.poll()
            except Exception:  # never let one bad document end the loop
                log.exception("combining evidence failed")
