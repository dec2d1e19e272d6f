"""Join the two CloudEvents a KServe payload logger sends per inference (request, then response) by `ce-id`.

KServe's logger (`spec.predictor.logger`, mode `all`; kserve/kserve pkg/logger/handler.go and worker.go) posts
each request and each response as its own CloudEvent in HTTP binary content mode, both with the same id
(`ce-id`: the caller's `Ce-Id` header or a fresh UUID) and type `org.kubeflow.serving.inference.request` /
`org.kubeflow.serving.inference.response`. Its workers send concurrently, so either half may arrive first; a
response is only logged when the model answered 200, so a failed request never gets its second half.

`JoinBuffer` holds the half that arrived first until the other one comes, bounded in entries and age:
an entry older than the TTL is dropped as `unmatched`; a new entry in a full buffer evicts the oldest one
(`join_overflow`). Both are reported through `on_drop(reason, count)`.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Literal

CE_REQUEST = "org.kubeflow.serving.inference.request"
CE_RESPONSE = "org.kubeflow.serving.inference.response"
CE_TYPES: dict[str, str] = {CE_REQUEST: "request", CE_RESPONSE: "response"}
Half = Literal["request", "response"]


@dataclass
class _Pending:
    half: Half
    value: Any
    since: float


class JoinBuffer:
    """Bounded, time-limited buffer of unmatched CloudEvent halves, keyed by event id. Thread-safe.

    Args:
        max_entries: most halves held at once (monitoring.logger_join_max_entries); a new half in a full buffer
            evicts the oldest, reported as `join_overflow`.
        ttl_s: seconds a half waits for its partner (monitoring.logger_join_ttl_s); older ones are reported as
            `unmatched` by the next `add` or `sweep`.
        on_drop: called with (reason, count) for dropped halves (`unmatched` or `join_overflow`).
        clock: monotonic time source in seconds (default time.monotonic).
    """

    def __init__(self, max_entries: int, ttl_s: float, *, on_drop: Callable[[str, int], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_entries = int(max_entries)
        self.ttl_s = float(ttl_s)
        self.on_drop = on_drop
        self.clock = clock
        self._pending: OrderedDict[str, _Pending] = OrderedDict()  # oldest first
        self._lock = threading.Lock()
        self.joined = 0

    def __len__(self) -> int:
        return len(self._pending)

    def _drop(self, reason: str, n: int) -> None:
        if n and self.on_drop is not None:
            self.on_drop(reason, n)

    def _expire(self, now: float) -> int:
        n = 0
        cutoff = now - self.ttl_s
        while self._pending:
            key, entry = next(iter(self._pending.items()))
            if entry.since > cutoff:
                break
            del self._pending[key]
            n += 1
        return n

    def add(self, event_id: str, half: Half, value: Any) -> tuple[Any, Any] | None:
        """Add one half; return (request value, response value) once both halves of `event_id` are in.

        A second half of the same kind for a pending id replaces the first one (which is reported as
        `unmatched`). Expired halves are dropped first, so a partner older than the TTL never joins.

        Args:
            event_id: the CloudEvent id (`ce-id`).
            half: "request" or "response".
            value: what to hand back at the join (a parsed request or a decoded response).

        Returns:
            (request, response) when this half completes a pair (the entry leaves the buffer), else None.
        """
        expired = overflow = replaced = 0
        out = None
        with self._lock:
            now = self.clock()
            expired = self._expire(now)
            other = self._pending.get(event_id)
            if other is not None and other.half != half:
                del self._pending[event_id]
                self.joined += 1
                out = (value, other.value) if half == "request" else (other.value, value)
            else:
                if other is not None:
                    del self._pending[event_id]
                    replaced = 1
                while len(self._pending) >= self.max_entries:
                    self._pending.popitem(last=False)
                    overflow += 1
                self._pending[event_id] = _Pending(half, value, now)
        self._drop("unmatched", expired + replaced)
        self._drop("join_overflow", overflow)
        return out

    def sweep(self) -> int:
        """Drop (and report as `unmatched`) every half older than the TTL; returns how many."""
        with self._lock:
            n = self._expire(self.clock())
        self._drop("unmatched", n)
        return n
