"""Reading the replicas' evidence (the combiner's side of the wire): who the peers are (`peers_from_dns`, a
headless Service's addresses looked up at every poll), one read of a peer's GET /v1/evidence over HTTP with bounded
size and time (`http_fetch`), and the thread that polls them (`PollLoop`). What is done with a document, checked
and merged in order, is monitoring/combine.py's `Combiner`.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from typing import Any, Callable, Mapping

from tailguard.monitoring.combine import Fetch, PeerDocumentError, PeerError

# the combiner's logger: one name for its records, in either of its modules
log = logging.getLogger("tailguard.monitoring.combine")

MAX_EVIDENCE_BYTES = 128 * 2**20  # a body past this is refused (about 250k (slice, metric) walks)
FETCH_TIMEOUT_S = 5.0  # connect / per-read timeout of one poll
FETCH_DEADLINE_S = 60.0  # total time to read one body (a slow drip ends here, give or take one read timeout)


def peers_from_dns(target: str, resolver: Callable[..., Any] = socket.getaddrinfo) -> list[str]:
    """The peers behind a headless Service: `NAME:PORT` -> one base URL per address its DNS name resolves to
    (A and AAAA records; `http://ADDR:PORT`, IPv6 bracketed), sorted. A headless Service (`clusterIP: None`)
    answers with every ready pod's address, so each pod is one source, polled on its own connection.

    Args:
        target: `NAME:PORT` (e.g. `tailguard-monitor-replicas.ns.svc.cluster.local:8080`).
        resolver: `socket.getaddrinfo` (the stdlib resolver); tests pass a function with its signature, the one
            seam that stands in for a DNS server.

    Returns:
        The peer URLs ([] when the name has no address).

    Raises:
        ValueError: `target` is not NAME:PORT with a port in 1..65535.
        OSError: the lookup failed (socket.gaierror; the combiner keeps the last list).
    """
    name, sep, port = target.rpartition(":")
    if not sep or not name or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--peer-dns {target!r}: expected NAME:PORT, e.g. tailguard-monitor-replicas:8080")
    infos = resolver(name, int(port), 0, socket.SOCK_STREAM)
    addrs = sorted({info[4][0] for info in infos})
    return [f"http://[{a}]:{port}" if ":" in a else f"http://{a}:{port}" for a in addrs]


def http_fetch(timeout_s: float = FETCH_TIMEOUT_S, *, max_bytes: int = MAX_EVIDENCE_BYTES,
               deadline_s: float = FETCH_DEADLINE_S, headers: Mapping[str, str] | None = None,
               reader: str = "") -> Fetch:
    """A Fetch over HTTP: GET {peer}/v1/evidence?since=N&reader=ID (httpx, streamed), with bounded size and time.

    Every fetch opens a new connection (no keep-alive): a URL that load-balances per connection (a Kubernetes
    Service) is then answered by its pods in turn, so the combiner sees their epochs flip and reports the URL
    incomplete (Combiner.incomplete), instead of reading one pinned pod forever as if it were the whole URL.

    Args:
        timeout_s: connect and per-read timeout (s).
        max_bytes: largest body read (bytes, after content decoding); past it: body_too_large.
        deadline_s: total time to read one body (s); past it: read_timeout. Checked between reads, so a stalled
            peer ends within deadline_s + timeout_s.
        headers: sent with every fetch: the monitor's `Authorization: Bearer <token>` when it has one
            (monitoring.auth_token_env / auth_token_file; replicas and combiner share the token), else none.
        reader: the combiner's id, sent as `reader` (the replica reports the previous one: Restart).

    Returns:
        fetch(peer, since) -> the parsed document; raises PeerDocumentError (body_too_large, read_timeout,
        invalid_json) or httpx errors (counted as fetch_failed).
    """
    import httpx

    client = httpx.Client(timeout=timeout_s, headers=dict(headers or {}),
                          limits=httpx.Limits(max_keepalive_connections=0))

    def fetch(peer: str, since: int) -> Mapping[str, Any]:
        end = time.monotonic() + deadline_s
        params = {"since": since, "reader": reader}
        with client.stream("GET", peer.rstrip("/") + "/v1/evidence", params=params) as r:
            r.raise_for_status()
            declared = r.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > max_bytes:
                raise PeerDocumentError(PeerError.BODY_TOO_LARGE, f"Content-Length {declared} over {max_bytes} bytes")
            body = bytearray()
            for chunk in r.iter_bytes():
                body += chunk
                if len(body) > max_bytes:
                    raise PeerDocumentError(PeerError.BODY_TOO_LARGE, f"body over {max_bytes} bytes")
                if time.monotonic() > end:
                    raise PeerDocumentError(PeerError.READ_TIMEOUT, f"body not read within {deadline_s} s "
                                            f"({len(body)} bytes so far)")
        try:
            return json.loads(body)
        except (ValueError, RecursionError) as exc:
            raise PeerDocumentError(PeerError.INVALID_JSON, f"not JSON: {str(exc)[:120]}") from None

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
        if self._thread.ident is not None:  # started
            self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.poll()
            except Exception:  # never let one bad document end the loop
                log.exception("combining evidence failed")
