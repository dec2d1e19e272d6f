"""Readiness of a monitor process (GET /readyz, /v2/health/ready, the probe port, gRPC ServerReady) and the
accounting of the sampled requests dropped uncompared that it judges from.

/readyz is 200 once the reference and (unless pairs-only or noise-floor) the candidate are loaded, and not while
every one of a model's last HEALTH_WINDOW calls failed, nor while the monitor is `degraded` (more than
monitoring.max_drop_rate of the sampled requests of the last DROP_WINDOW_S seconds dropped uncompared for one of
SERVICE_DROPS: `DropWindow`), nor while the combiner's view misses a replica (monitoring/combine.py).
`ReadinessMixin` is the part of `MonitorService` (monitoring/service.py) that answers it and counts the drops.
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Callable

HEALTH_WINDOW = 20  # /readyz answers 503 while each of a model's last 20 calls failed (error, timeout, bad output)
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


class ReadinessMixin:
    """The readiness answer and the drop accounting of `MonitorService` (monitoring/service.py), whose __init__
    sets the state they read: `cfg`, `metrics`, `runners` and `load_errors` (the loaded models, and why one is
    not), `_sources` (the model sources; None: not configured), `_health` (per role, the drop reason of each of
    the last HEALTH_WINDOW calls, None = it answered; the shadow worker appends), `drops` (a DropWindow),
    `combiner` (None but on the combiner), `node_check`, `queue`, `join` and `monitor`."""

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
                             "noise_floor": self.cfg.mon.noise_floor, "role": self.monitor.role,
                             "node_check": check.to_dict(), "node_mismatch": check.differences or None,
                             **({"incomplete": incomplete} if self.combiner is not None else {}),
                             **({"discovery": self.combiner.discovery}
                                if self.combiner is not None and self.combiner.discover is not None else {}),
                             **({"peers": self.combiner.status()} if self.combiner is not None else {})}

    def _drop(self, reason: str, n: int = 1) -> None:
        """Count `n` sampled requests dropped uncompared (dropped_total{reason}, and the drop window)."""
        self.metrics.dropped.labels(reason).inc(n)
        if reason in SERVICE_DROPS:
            self.drops.add(n, reason)
