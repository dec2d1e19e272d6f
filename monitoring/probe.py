"""The probe port (`monitoring.probe_port`, `monitor serve --probe-port`; default 8082, 0 = off): /healthz,
/readyz, /metrics (and /v2/health/live, /v2/health/ready) of a MonitorService again, from a server of its own
(`ProbeServer`, stdlib threads) that the ingest port's connections cannot starve: kubelet probes and Prometheus
scrapes go there (issue 36 item 5).
"""

from __future__ import annotations

import http.server
import json
import threading
from typing import Any, Mapping

from tailguard.core.errors import InputError
from tailguard.monitoring.config import route_needs_auth
from tailguard.monitoring.oip import utf8_text
from tailguard.monitoring.service import MonitorService

# the probe port's server (ProbeServer): a client must deliver its request line and headers within this many
# seconds, else its connection is closed (kubelet probes and Prometheus scrapes send theirs at once)
PROBE_READ_TIMEOUT_S = 10.0


class ProbeServer:
    """The probe port: /healthz, /readyz, /metrics (and the OIP /v2/health/live, /v2/health/ready) served apart
    from the ingest port, so that no number of ingest connections can make a kubelet probe or a scrape fail.

    Why a stdlib `http.server.ThreadingHTTPServer` on its own thread, not a second uvicorn server: the ingest port's
    starvation is uvicorn's connection accounting (`limit_concurrency` counts every open connection, also ones whose
    headers never finish: ~1,100 of them answered /healthz 503 for 31 s, issue 36 item 5) and its one event loop.
    This server shares neither: it accepts on its own socket and answers each connection on a thread of its own
    (a handful of probes at a time; the answers are a dict lookup, `MonitorService.readiness` and the Prometheus
    exposition), with no ASGI stack between the socket and the answer. A client here that stalls mid-headers holds
    one thread for at most PROBE_READ_TIMEOUT_S; keep the port to the kubelet and Prometheus (NetworkPolicy,
    docs/deploy.md). The same authentication rules as the main port: /healthz and /v2/health/live open, /readyz
    and /v2/health/ready as monitoring.auth_readyz says, /metrics as monitoring.auth_metrics says (401
    `unauthenticated`, counted).

    Args:
        service: the monitor whose state the routes report (None: `attach` it before `start`).
        host: bind address.
        port: TCP port (0: a free one, see `port`).

    Raises:
        InputError: the port cannot be bound (exit 2, naming the port and --probe-port).
    """

    def __init__(self, service: MonitorService | None, host: str, port: int) -> None:
        self._handler = handler = type("_ProbeHandler", (_ProbeHandler,), {"service": service,
                                                                           "timeout": PROBE_READ_TIMEOUT_S})
        try:
            self.httpd = http.server.ThreadingHTTPServer((host, port), handler)
        except OSError as exc:
            raise InputError(f"cannot bind the probe port {host}:{port}: {exc.strerror or exc}",
                             hint="choose a free port with --probe-port (or monitoring.probe_port), 0 turns it "
                                  "off") from None
        self.httpd.daemon_threads = True
        self.port = int(self.httpd.server_address[1])
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.5},
                                        name="tg-probe", daemon=True)

    def attach(self, service: MonitorService) -> None:
        """Report `service` (when the port was bound before the service was made: `serve`)."""
        self._handler.service = service

    def start(self) -> "ProbeServer":
        """Serve in a daemon thread; returns self."""
        if self._handler.service is None:
            raise RuntimeError("ProbeServer.start before attach: no service to report")
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop accepting and close the socket."""
        if self._thread.is_alive():
            self.httpd.shutdown()
        self.httpd.server_close()


class _ProbeHandler(http.server.BaseHTTPRequestHandler):
    """One probe-port connection (ProbeServer); `service` and `timeout` are set on the subclass it makes."""

    service: MonitorService
    protocol_version = "HTTP/1.0"  # one request per connection: nothing idles on a thread after its answer
    server_version = "tailguard-probe"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - no access log (as the main port)
        return

    def _send(self, status: int, body: bytes, ctype: str = "application/json",
              headers: Mapping[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, doc: Any, headers: Mapping[str, str] | None = None) -> None:
        self._send(status, json.dumps(doc, default=str).encode(), headers=headers)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        svc, path = self.service, self.path.split("?", 1)[0]
        if path not in _PROBE_ROUTES:
            self._json(404, {"error": f"{utf8_text(path)[:200]!r} is not served on the probe port; it serves "
                                      f"{sorted(_PROBE_ROUTES)}", "reason": "not_found"})
            return
        if svc.auth is not None and route_needs_auth(path, svc.cfg.mon) and not svc.auth.check(
                self.headers.get("Authorization")):
            svc.metrics.invalid_requests.labels("unauthenticated").inc()
            self._json(401, {"error": "missing or wrong bearer token: send 'Authorization: Bearer <token>' (the "
                                      "monitor's token, monitoring.auth_token_env / auth_token_file)",
                             "reason": "unauthenticated"}, headers={"WWW-Authenticate": "Bearer"})
            return
        if path in ("/healthz", "/v2/health/live"):
            self._json(200, {"status": "ok"} if path == "/healthz" else {"live": True})
        elif path == "/metrics":
            svc.sweep()
            self._send(200, svc.metrics.exposition(), "text/plain; version=0.0.4; charset=utf-8")
        else:
            ok, details = svc.readiness()
            self._json(200 if ok else 503, details if path == "/readyz" else {"ready": ok})

    do_HEAD = do_GET


_PROBE_ROUTES = frozenset({"/healthz", "/readyz", "/metrics", "/v2/health/live", "/v2/health/ready"})
