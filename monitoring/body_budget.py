"""HTTP ingest bodies read within the limits: one body within monitoring.max_body_bytes and
monitoring.body_read_timeout_s, all bodies in flight within monitoring.max_inflight_body_bytes (`BodyBudget`).

A declared Content-Length is checked before anything is read; bytes are reserved as they arrive, so a client that
stalls mid-body holds only what it sent, until its read deadline (issue 36 item 5). The app (monitoring/app.py)
reads every ingest body with `read_body`, then hands it to a parse thread.
"""

from __future__ import annotations

from fastapi import Request


class BodyBudget:
    """Bytes of HTTP ingest bodies being read at once, over every request in flight
    (monitoring.max_inflight_body_bytes). Used on the event loop only (no lock).

    Args:
        limit: the budget in bytes.
    """

    def __init__(self, limit: int) -> None:
        self.limit = int(limit)
        self.used = 0

    def take(self, n: int) -> bool:
        """Reserve `n` bytes; False (nothing reserved) when they do not fit."""
        if self.used + n > self.limit:
            return False
        self.used += n
        return True

    def give(self, n: int) -> None:
        """Release `n` reserved bytes."""
        self.used -= n


async def read_body(request: Request, limit: int, budget: BodyBudget, timeout_s: float
                    ) -> tuple[bytes | None, str | None, int]:
    """The request body, read within `limit` bytes, the shared body budget and `timeout_s` seconds.

    A declared Content-Length is checked against `limit`, and against what is left of `budget`, before anything
    is read; bytes are reserved in `budget` as they arrive (a client that stalls holds what it sent, not what it
    declared). Nothing over either bound is held in memory.

    Returns:
        (body, None, bytes reserved) or (None, reason, bytes reserved) with reason `body_too_large` (over
        `limit`), `body_budget_exceeded` (the budget is taken by bodies in flight), `client_disconnected` (the
        client went away mid-body) or `body_read_timeout` (not all there within `timeout_s`, counted from the
        headers: monitoring.body_read_timeout_s). The caller gives the reserved bytes back (`budget.give`).
    """
    import anyio
    from starlette.requests import ClientDisconnect

    try:
        declared = int(request.headers.get("content-length", ""))
    except ValueError:  # absent (chunked) or garbage: count while reading
        declared = 0
    if declared > limit:
        return None, "body_too_large", 0
    if declared > budget.limit - budget.used:
        return None, "body_budget_exceeded", 0
    chunks, size = [], 0
    try:
        with anyio.fail_after(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    return None, "body_too_large", size - len(chunk)
                if not budget.take(len(chunk)):
                    return None, "body_budget_exceeded", size - len(chunk)
                chunks.append(chunk)
    except ClientDisconnect:
        return None, "client_disconnected", size
    except TimeoutError:
        return None, "body_read_timeout", sum(map(len, chunks))
    return b"".join(chunks), None, size
