"""The shadow monitor's HTTP app (FastAPI, served by uvicorn: `uvicorn_config`) over a MonitorService.

Endpoints:
    POST /v2/models/{name}/infer   OIP request, as Istio mirroring sends it; the monitor runs both models.
    POST /v2/models/{name}/pairs   {"request": OIP request, "response": OIP response}: the live response is the
                                   candidate's output (as a KServe payload logger records it).
    POST /v2/models/{name}/logger  one KServe payload-logger CloudEvent (binary content mode: ce-id, ce-type
                                   headers; body the OIP request or response). Request and response are joined
                                   by ce-id in a bounded buffer (monitoring/join.py), then go the pairs way.
    The three take JSON, or the OIP binary tensor data extension (`Inference-Header-Content-Length` header; on
    /logger also read from ce-metadata for the request half; /pairs: the JSON part, then the request inputs'
    sections, then the response outputs'; monitoring/oip.py). Answers are JSON.
    gRPC (`monitor serve --grpc-port`, monitoring/grpc_ingest.py): inference.GRPCInferenceService ModelInfer,
                                   ServerLive, ServerReady, ModelReady, ServerMetadata, ModelMetadata; ModelInfer
                                   goes the /infer way (metrics endpoint="grpc").
    GET  /metrics                  Prometheus text format (names: monitoring/prometheus.py METRIC_NAMES).
    GET  /healthz                  200 while the process serves.
    GET  /v2/health/live, /v2/health/ready, /v2/models/{name}/ready, /v2/models/{name}
                                   the Open Inference Protocol's liveness (200), readiness (200 as /readyz, else
                                   503), model readiness and metadata (404 unknown_model for another name), so
                                   KServe v2 / Triton clients' is_server_ready, is_model_ready and
                                   get_model_metadata work against the monitor.
    GET  /readyz                   200 once the models are loaded (reference, and candidate unless pairs-only or
                                   noise-floor mode) and answering, else 503 with what is missing or failing
                                   (every one of a model's last HEALTH_WINDOW calls failed). `node_check` /
                                   `node_mismatch`: this node against the nodes the candidate was validated on
                                   (monitoring/node_check.py; a mismatch leaves the monitor ready).
    Probe port (`monitoring.probe_port`, `monitor serve --probe-port`; default 8082, 0 = off): /healthz, /readyz,
                                   /metrics (and /v2/health/live, /v2/health/ready) again, from a server of their
                                   own (`ProbeServer`, stdlib threads) that the ingest port's connections cannot
                                   starve: kubelet probes and Prometheus scrapes go there (issue 36 item 5).
    GET  /v1/alerts, /v1/slices    alert records and per-slice statistics (JSON; /v1/slices?offset=&limit= pages
                                   through every tracked slice in key order, limit <= 10000, default 1000).

Before any route (`_Guard`, before a body is read): the bearer token when one is configured (monitoring.auth_token_env
/ auth_token_file / --auth-token-file; every route but /healthz, /readyz and /metrics as configured; 401
unauthenticated). Ingest bodies are read within monitoring.max_inflight_body_bytes over all requests in flight
(bytes reserved as they arrive; 503 body_budget_exceeded) and monitoring.body_read_timeout_s each (408
body_read_timeout; monitoring/body_budget.py); then at most monitoring.max_concurrent_requests bodies are parsed at
once (503 too_many_requests), on parse threads or, from PROCESS_PARSE_BYTES, worker processes
(monitoring/parsing.py), never on the event loop that answers /healthz. /v1/slices and /v1/evidence build their
entries in chunks of READ_CHUNK slices, each under the worker lock, never all of them at once
(monitoring/service.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tailguard.monitoring.body_budget import read_body
from tailguard.monitoring.config import MonitorConfig, route_needs_auth
from tailguard.monitoring.oip import BINARY_HEADER, SPEC_TO_OIP, utf8_text
from tailguard.monitoring.service import MonitorService

# uvicorn's limit_concurrency = max_concurrent_requests + this: it counts open connections (idle keep-alive ones of
# every mirroring Envoy too) and tasks, so it is a memory bound far above the app's own limit, not the limit itself
CONNECTION_HEADROOM = 1024


class _Guard:
    """ASGI middleware ahead of every route, before any body is read: the bearer token (401 `unauthenticated`,
    with `WWW-Authenticate: Bearer`, counted in invalid_requests_total{reason}). The number of ingest bodies
    being parsed (monitoring.max_concurrent_requests) is checked once a body is read (`build_app`'s `_handle`):
    a client that stalls mid-body holds no parse slot."""

    def __init__(self, app: Any, service: MonitorService) -> None:
        self.app = app
        self.service = service

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        svc, path = self.service, scope.get("path", "")
        if svc.auth is not None and route_needs_auth(path, svc.cfg.mon):
            given = next((v for k, v in scope.get("headers") or () if k == b"authorization"), None)
            if not svc.auth.check(given):
                svc.metrics.invalid_requests.labels("unauthenticated").inc()
                doc = {"error": "missing or wrong bearer token: send 'Authorization: Bearer <token>' (the monitor's "
                                "token, monitoring.auth_token_env / auth_token_file)", "reason": "unauthenticated"}
                await JSONResponse(doc, status_code=401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


def model_metadata(cfg: MonitorConfig) -> dict[str, Any]:
    """The monitored model's OIP metadata (GET /v2/models/{name}): name, platform, the spec's inputs and the
    compared output, each {"name", "datatype", "shape"} with symbolic dimensions as -1 (as gRPC ModelMetadata)."""
    def meta(s: Any) -> dict[str, Any]:
        return {"name": s.name, "datatype": SPEC_TO_OIP.get(getattr(s, "dtype", "float32"), "FP32"),
                "shape": [d if isinstance(d, int) else -1 for d in s.shape]}

    return {"name": cfg.model_name, "versions": [], "platform": "tailguard-shadow-monitor",
            "inputs": [meta(s) for s in cfg.inputs], "outputs": [meta(cfg.output)]}


def _unknown_model(service: MonitorService, name: str) -> dict[str, Any]:
    return {"error": f"model {utf8_text(str(name))[:200]!r} is not monitored here; use "
                     f"{service.cfg.model_name!r}", "reason": "unknown_model"}


def build_app(service: MonitorService) -> Any:
    """The FastAPI app for a MonitorService (routes: module docstring), behind `_Guard` (authentication and the
    ingest concurrency limit); ingest bodies are read within the body budget (`read_body`)."""
    @contextlib.asynccontextmanager
    async def lifespan(_app: Any) -> AsyncIterator[None]:
        yield
        service.stop()

    app = FastAPI(title="tailguard shadow monitor", version="1", lifespan=lifespan)
    app.add_middleware(_Guard, service=service)

    async def _handle(endpoint: str, request: Request, handle: Callable[[bytes], tuple[int, dict[str, Any]]]
                      ) -> Response:
        """Read the body within the limits (size, body budget, monitoring.body_read_timeout_s), then, when fewer
        than monitoring.max_concurrent_requests bodies are being parsed, hand it to `handle` on a parse thread
        (`service.parse_pool`: no parse runs on the event loop, so /healthz answers whatever a body holds);
        release its share of the body budget. A client that stalls mid-body holds only the bytes it sent, until
        its read deadline: never a parse slot (issue 36 item 5)."""
        body, reason, held = await read_body(request, service.max_body_bytes, service.body_budget,
                                             service.cfg.mon.body_read_timeout_s)
        try:
            if body is None:
                status, doc = service.refuse_body(endpoint, reason)
            elif service.in_flight >= service.cfg.mon.max_concurrent_requests:
                status, doc = service.refuse_body(endpoint, "too_many_requests")
            else:
                service.in_flight += 1
                try:
                    loop = asyncio.get_running_loop()
                    status, doc = await loop.run_in_executor(service.parse_pool, handle, body)
                finally:
                    service.in_flight -= 1
        finally:
            service.body_budget.give(held)
        return JSONResponse(doc, status_code=status, headers={"Retry-After": "1"} if status == 503 else None)

    def _ingest(endpoint: str, name: str, request: Request) -> Callable[[bytes], tuple[int, dict[str, Any]]]:
        header = request.headers.get(BINARY_HEADER)  # binary tensor data extension
        return lambda body: service.ingest(endpoint, name, body, header=header, headers=request.headers)

    @app.post("/v2/models/{name}/infer")
    async def infer(name: str, request: Request) -> Response:
        return await _handle("infer", request, _ingest("infer", name, request))

    @app.post("/v2/models/{name}/pairs")
    async def pairs(name: str, request: Request) -> Response:
        return await _handle("pairs", request, _ingest("pairs", name, request))

    @app.post("/v2/models/{name}/logger")
    async def logger(name: str, request: Request) -> Response:
        return await _handle("logger", request, lambda body: service.ingest_event(name, request.headers, body))

    @app.get("/metrics")
    def metrics() -> Response:  # sync: FastAPI runs it in its thread pool, off the event loop that ingests
        service.sweep()
        return Response(service.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/healthz")
    async def healthz() -> Response:
        return JSONResponse({"status": "ok"})

    @app.get("/readyz")
    async def readyz() -> Response:
        ok, details = service.readiness()
        return JSONResponse(details, status_code=200 if ok else 503)

    # the Open Inference Protocol's health and metadata routes (KServe v2 / Triton clients call them first)
    @app.get("/v2/health/live")
    async def oip_live() -> Response:
        return JSONResponse({"live": True})

    @app.get("/v2/health/ready")
    async def oip_ready() -> Response:
        ok = service.readiness()[0]
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)

    @app.get("/v2/models/{name}/ready")
    async def oip_model_ready(name: str) -> Response:
        if name != service.cfg.model_name:
            return JSONResponse(_unknown_model(service, name), status_code=404)
        ok = service.readiness()[0]
        return JSONResponse({"name": name, "ready": ok}, status_code=200 if ok else 503)

    @app.get("/v2/models/{name}")
    async def oip_model_metadata(name: str) -> Response:
        if name != service.cfg.model_name:
            return JSONResponse(_unknown_model(service, name), status_code=404)
        return JSONResponse(model_metadata(service.cfg))

    @app.get("/v1/alerts")
    async def alerts() -> Response:
        return JSONResponse(service.alerts())

    @app.get("/v1/evidence")
    def evidence(since: int = 0, reader: str = "") -> Response:  # sync (thread pool): in chunks under the lock
        return JSONResponse(service.evidence(max(since, 0), reader))

    @app.get("/v1/slices")
    def slices(offset: int = 0, limit: int = 1000) -> Response:
        if offset < 0 or not 1 <= limit <= 10000:
            return JSONResponse({"error": "offset must be >= 0 and limit in [1, 10000]", "reason": "bad_page"},
                                status_code=422)
        return JSONResponse(service.slices(offset, limit))

    return app


def uvicorn_config(service: MonitorService, host: str, port: int, *, headroom: int = CONNECTION_HEADROOM) -> Any:
    """The ingest port's uvicorn.Config (what `serve` runs): the app, and limit_concurrency =
    monitoring.max_concurrent_requests + `headroom` (open connections and tasks past it get uvicorn's plain 503,
    /healthz and /metrics on this port too: the probe port is the one that stays answering)."""
    import uvicorn

    return uvicorn.Config(build_app(service), host=host, port=port, log_level="warning", access_log=False,
                          limit_concurrency=service.cfg.mon.max_concurrent_requests + headroom)
