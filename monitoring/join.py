"""Join the two CloudEvents a KServe payload logger sends per inference (request, then response) by `ce-id`.

KServe's logger (`spec.predictor.logger`, mode `all`; kserve/kserve pkg/logger/handler.go and worker.go) posts
each request and each response as its own CloudEvent in HTTP binary content mode, both with the same id
(`ce-id`: the caller's `Ce-Id` header or a fresh UUID) and type `org.kubeflow.serving.inference.request` /
`org.kubeflow.serving.inference.response`. Its workers send concurrently, so either half may arrive first; a
response is only logged when the model answered 200, so a failed request never gets its second half.

`JoinBuffer` holds the half that arrived first until the other one comes, bounded in entries, bytes and age:
an entry older than the TTL is dropped as `unmatched`; a new entry that does not fit (too many entries, or its
bytes over the total budget) evicts the oldest ones (`join_overflow`); a single entry over the per-entry cap is
refused (`EntryTooLarge`), never buffered. Both drops are reported through `on_drop(reason, count)`. The caller
gives each entry's size: the service keeps a waiting half as the raw body it arrived as (bytes, parsed again
when its partner comes), so the budget is the memory held, not a fraction of it (a decoded 8 MiB JSON response
takes about 51 MiB as Python floats, measured with tracemalloc).
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


class EntryTooLarge(ValueError):
    """A first half larger than the buffer's per-entry cap: refused, never buffered (the service answers 413
    `join_entry_too_large`)."""


@dataclass
class _Pending:
    half: Half
    value: Any
    since: float
    size: int


class JoinBuffer:
    """Bounded, time-limited buffer of unmatched CloudEvent halves, keyed by event id. Thread-safe.

    Args:
        max_entries: most halves held at once (monitoring.logger_join_max_entries); a new half in a full buffer
            evicts the oldest, reported as `join_overflow`.
        ttl_s: seconds a half waits for its partner (monitoring.logger_join_ttl_s); older ones are reported as
            `unmatched` by the next `add` or `sweep`.
        max_bytes: most bytes held at once, summed over the entries' `size` (monitoring.logger_join_max_bytes;
            None: unbounded); a half that does not fit evicts the oldest ones (`join_overflow`).
        max_entry_bytes: largest `size` one waiting half may have (monitoring.logger_join_max_entry_bytes;
            None: max_bytes); a larger one raises EntryTooLarge.
        on_drop: called with (reason, count) for dropped halves (`unmatched` or `join_overflow`).
        clock: monotonic time source in seconds (default time.monotonic).
    """

    def __init__(self, max_entries: int, ttl_s: float, *, max_bytes: int | None = None,
                 max_entry_bytes: int | None = None, on_drop: Callable[[str, int], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_entries = int(max_entries)
        self.ttl_s = float(ttl_s)
        self.max_bytes = None if max_bytes is None else int(max_bytes)
        cap = max_entry_bytes if max_entry_bytes is not None else self.max_bytes
        self.max_entry_bytes = None if cap is None else min(int(cap), self.max_bytes or int(cap))
        self.on_drop = on_drop
        self.clock = clock
        self._pending: OrderedDict[str, _Pending] = OrderedDict()  # oldest first
        self._lock = threading.Lock()
        self.joined = 0
        self.bytes = 0  # sum of the held entries' sizes

    def __len__(self) -> int:
        return len(self._pending)

    def _drop(self, reason: str, n: int) -> None:
        if n and self.on_drop is not None:
            self.on_drop(reason, n)

    def _pop(self, key: str | None = None) -> _Pending:
        entry = self._pending.pop(key) if key is not None else self._pending.popitem(last=False)[1]
        self.bytes -= entry.size
        return entry

    def _expire(self, now: float) -> int:
        n = 0
        cutoff = now - self.ttl_s
        while self._pending:
            key, entry = next(iter(self._pending.items()))
            if entry.since > cutoff:
                break
            self._pop(key)
            n += 1
        return n

    def add(self, event_id: str, half: Half, value: Any, size: int = 0) -> tuple[Any, Any] | None:
        """Add one half; return (request value, response value) once both halves of `event_id` are in.

        A second half of the same kind for a pending id replaces the first one (which is reported as
        `unmatched`). Expired halves are dropped first, so a partner older than the TTL never joins.

        Args:
            event_id: the CloudEvent id (`ce-id`).
            half: "request" or "response".
            value: what to hand back at the join (the service: the raw body and its binary header).
            size: bytes this half holds while it waits (the service: the raw body's length).

        Returns:
            (request, response) when this half completes a pair (the entry leaves the buffer), else None.

        Raises:
            EntryTooLarge: the half would have to wait and `size` is over max_entry_bytes (nothing is changed,
                except that expired halves are dropped and a same-kind half of this id is replaced).
        """
        expired = overflow = replaced = 0
        out = None
        too_large = False
        with self._lock:
            now = self.clock()
            expired = self._expire(now)
            other = self._pending.get(event_id)
            if other is not None and other.half != half:
                self._pop(event_id)
                self.joined += 1
                out = (value, other.value) if half == "request" else (other.value, value)
            else:
                if other is not None:
                    self._pop(event_id)
                    replaced = 1
                if self.max_entry_bytes is not None and size > self.max_entry_bytes:
                    too_large = True
                else:
                    while self._pending and (len(self._pending) >= self.max_entries or (
                            self.max_bytes is not None and self.bytes + size > self.max_bytes)):
                        self._pop()
                        overflow += 1
                    self._pending[event_id] = _Pending(half, value, now, int(size))
                    self.bytes += int(size)
        self._drop("unmatched", expired + replaced)
        self._drop("join_overflow", overflow)
        if too_large:
            raise EntryTooLarge(f"a {half} half of {size} bytes is over the join buffer's per-entry cap of "
                                f"{self.max_entry_bytes} bytes")
        return out

    def sweep(self) -> int:
        """Drop (and report as `unmatched`) every half older than the TTL; returns how many."""
        with self._lock:
            n = self._expire(self.clock())
        self._drop("unmatched", n)
        return n
