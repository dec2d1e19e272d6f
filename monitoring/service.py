"""The shadow monitor's HTTP service (FastAPI + uvicorn).

Endpoints:
    POST /v2/models/{name}/infer   OIP request, as Istio mirroring sends it; the monitor runs both models.
    POST /v2/models/{name}/pairs   {"request": OIP request, "response": OIP response}: the live response is the
                                   candidate's output (as a KServe payload logger records it).
    GET  /metrics                  Prometheus text format (names: monitoring/metrics.py METRIC_NAMES).
    GET  /healthz                  200 while the process serves.
    GET  /readyz                   200 once the models are loaded (reference, and candidate unless pairs-only or
                                   noise-floor mode), else 503 with what is missing.
    GET  /v1/alerts, /v1/slices    alert records and per-slice statistics (JSON).

Isolation of the live path: ingest parses and checks the body, draws the sampling decision and puts a sampled
request on a bounded queue with `put_nowait`; it never waits for a model. A full queue drops the request
(`dropped_total{reason="queue_full"}`). A worker thread runs the models, each call in its own one-thread pool
with a timeout: a slow, crashing, NaN-returning or missing reference only moves `dropped_total{reason=...}`.
Ingest answers 200 with `{"model_name", "id", "outputs": [], "parameters": {"tailguard.sampled": bool}}` (the
mirror's response is discarded by Istio); malformed bodies get 4xx with `{"error", "reason"}`.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tailguard.errors import InputError
from tailguard.home import home
from tailguard.monitoring.config import MonitorConfig, resolve_config
from tailguard.monitoring.core import MonitorCore
from tailguard.monitoring.metrics import MonitorMetrics
from tailguard.monitoring.oip import OipError, parse_request, parse_response_output
from tailguard.monitoring.sampler import Decision
from tailguard.runtime import OrtRunner, Runner
from tailguard.spec import Spec, load_spec

log = logging.getLogger("tailguard.monitoring.service")


@dataclass
class _Item:
    keys: list[str]
    decision: Decision
    feeds: dict[str, np.ndarray]
    meta: dict[str, Any]
    request_id: str
    index: int
    endpoint: str
    candidate: np.ndarray | None = None
    enqueued: float = field(default_factory=time.perf_counter)


class MonitorService:
    """Models, queue, worker and exporters of one monitor process (the FastAPI app is `build_app(service)`).

    Args:
        cfg: resolved monitoring configuration.
        reference: reference .onnx path or a Runner (None: not available; sampled traffic is dropped with reason
            reference_missing and /readyz stays 503).
        candidate: candidate .onnx path or a Runner; None for a pairs-only monitor.
        metrics: collectors (default: new, on a private registry).
        seed: sampler seed (default: monitoring.seed).
        s3_client: boto3 client for the sink (default: made from monitoring.s3).
        start: start the worker / loaders at once (tests may start later).
    """

    def __init__(self, cfg: MonitorConfig, reference: str | Path | Runner | None,
                 candidate: str | Path | Runner | None, *, metrics: MonitorMetrics | None = None,
                 seed: int | None = None, s3_client: Any = None, start: bool = True) -> None:
        self.cfg = cfg
        mon = cfg.mon
        self.metrics = metrics or MonitorMetrics()
        self.sink = None
        if mon.s3 is not None:
            from tailguard.monitoring.sink import PairSink

            spool = Path(mon.spool_dir) if mon.spool_dir else home() / "monitor" / "spool"
            self.sink = PairSink(mon.s3, spool, mon.spool_max_bytes, redact_fields=mon.redact_fields,
                                 model=cfg.model_name, metrics=self.metrics, client=s3_client)
        self.drift = None
        if mon.evidently_workspace:
            from tailguard.monitoring.drift import DriftSnapshots

            self.drift = DriftSnapshots(cfg)
        self.core = MonitorCore(cfg, seed=seed, metrics=self.metrics, on_sample=self._on_sample)
        self.queue: queue.Queue[_Item] = queue.Queue(maxsize=mon.queue_size)
        self._sources = {"reference": reference, "candidate": None if mon.noise_floor else candidate}
        self.runners: dict[str, Runner | None] = {"reference": None, "candidate": None}
        self.load_errors: dict[str, str] = {}
        self._pools = {r: cf.ThreadPoolExecutor(1, thread_name_prefix=f"tg-{r}") for r in ("reference", "candidate")}
        self._stuck: dict[str, cf.Future | None] = {"reference": None, "candidate": None}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._seq = 0
        self._worker: threading.Thread | None = None
        self.processed = 0
        if start:
            self.start()

    # ----------------------------------------------------------------------------------------- life
    def start(self) -> None:
        """Load the models in the background and start the worker (and the sink's writer)."""
        threading.Thread(target=self._load_models, name="tg-load", daemon=True).start()
        self._worker = threading.Thread(target=self._work, name="tg-worker", daemon=True)
        self._worker.start()
        if self.sink is not None:
            self.sink.start()

    def stop(self) -> None:
        """Stop the worker, flush the sink (to S3 or the spool) and release the pools."""
        self._stop.set()
        if self._worker is not None:
            self._worker.join(5)
        if self.sink is not None:
            self.sink.close()
        for p in self._pools.values():
            p.shutdown(wait=False, cancel_futures=True)

    def _load_models(self) -> None:
        for role, src in self._sources.items():
            if src is None:
                continue
            try:
                self.runners[role] = src if hasattr(src, "run") else OrtRunner(src)  # type: ignore[arg-type]
                self.metrics.models_ready.labels(role).set(1)
            except InputError as exc:
                self.load_errors[role] = exc.message
                log.error("%s model not loaded: %s", role, exc.message)

    @property
    def needs_candidate(self) -> bool:
        """True when the infer endpoint must run a candidate model."""
        return self._sources["candidate"] is not None

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """(ready, details): ready once the reference and (if configured) the candidate are loaded."""
        need = ["reference"] + (["candidate"] if self.needs_candidate else [])
        missing = [r for r in need if self.runners[r] is None]
        return not missing, {"ready": not missing, "missing": missing, "errors": self.load_errors,
                             "queue_depth": self.queue.qsize(), "noise_floor": self.cfg.mon.noise_floor}

    # --------------------------------------------------------------------------------------- ingest
    def ingest(self, endpoint: str, name: str, body: bytes) -> tuple[int, dict[str, Any]]:
        """Handle one OIP body without waiting for any model.

        Args:
            endpoint: "infer" or "pairs".
            name: model name from the path.
            body: raw JSON body.

        Returns:
            (HTTP status, JSON response).
        """
        t0 = time.perf_counter()
        m = self.metrics
        try:
            if name != self.cfg.model_name:
                raise OipError("unknown_model", f"model {name!r} is not monitored here; use "
                                                f"/v2/models/{self.cfg.model_name}/{endpoint}", status=404)
            cand = None
            if endpoint == "pairs":
                try:
                    doc = json.loads(body)
                except (ValueError, UnicodeDecodeError) as exc:
                    raise OipError("invalid_json", f"body is not JSON: {str(exc)[:120]}", status=400) from None
                if not isinstance(doc, dict) or "request" not in doc or "response" not in doc:
                    raise OipError("not_an_object", "pairs body must be {\"request\": ..., \"response\": ...}",
                                   status=400)
                req = parse_request(doc["request"], self.cfg.inputs)
                cand = parse_response_output(doc["response"], self.cfg.output, req.batch)
            else:
                req = parse_request(body, self.cfg.inputs)
        except OipError as exc:
            m.invalid_requests.labels(exc.reason).inc()
            m.ingest_seconds.labels(endpoint).observe(time.perf_counter() - t0)
            return exc.status, {"error": exc.message, "reason": exc.reason}
        m.requests.labels(self.cfg.model_name, endpoint).inc()
        keys, decision = self.core.admit(req.parameters)
        self._seq += 1
        if decision.sampled:
            if self.runners["reference"] is None:
                m.dropped.labels("reference_missing").inc()
            else:
                item = _Item(keys, decision, req.feeds, req.parameters, req.id, self._seq, endpoint, cand)
                try:
                    self.queue.put_nowait(item)
                except queue.Full:
                    m.dropped.labels("queue_full").inc()
            m.queue_depth.set(self.queue.qsize())
        m.ingest_seconds.labels(endpoint).observe(time.perf_counter() - t0)
        return 200, {"model_name": self.cfg.model_name, "id": req.id, "outputs": [],
                     "parameters": {"tailguard.sampled": decision.sampled}}

    # --------------------------------------------------------------------------------------- worker
    def _infer(self, role: str, feeds: dict[str, np.ndarray]) -> np.ndarray | None:
        """Run one model with the reference timeout; None (and a counted drop) on any failure."""
        m = self.metrics
        err_reason = "reference_error" if role == "reference" else "candidate_error"
        timeout_reason = "reference_timeout" if role == "reference" else "candidate_error"
        runner = self.runners[role]
        if runner is None:
            m.dropped.labels("reference_missing" if role == "reference" else "candidate_error").inc()
            return None
        stuck = self._stuck[role]
        if stuck is not None:
            if not stuck.done():  # a timed-out call still holds the model's thread: do not pile up behind it
                m.dropped.labels(timeout_reason).inc()
                return None
            self._stuck[role] = None
        t0 = time.perf_counter()
        fut = self._pools[role].submit(runner.run, feeds)
        try:
            outs = fut.result(timeout=self.cfg.mon.reference_timeout_s)
        except cf.TimeoutError:
            self._stuck[role] = fut
            m.dropped.labels(timeout_reason).inc()
            return None
        except Exception as exc:  # the model raised (ORT runtime error, bad output): count, never propagate
            log.warning("%s model failed: %s", role, str(exc).splitlines()[0][:200] if str(exc) else type(exc))
            m.dropped.labels(err_reason).inc()
            return None
        m.inference_seconds.labels(self.cfg.model_name, role).observe(time.perf_counter() - t0)
        names = list(getattr(runner, "output_names", []) or [])
        out = np.asarray(outs[names.index(self.cfg.output.name) if self.cfg.output.name in names else 0])
        first = next(iter(feeds.values()))
        if out.ndim == 0 or out.shape[0] != first.shape[0]:
            m.dropped.labels(err_reason).inc()
            return None
        return out

    def _process(self, item: _Item) -> None:
        ref = self._infer("reference", item.feeds)
        if ref is None:
            return
        if self.cfg.mon.noise_floor:
            cand = self._infer("reference", item.feeds)
        elif item.endpoint == "pairs":
            cand = item.candidate
        else:
            cand = self._infer("candidate", item.feeds)
        if cand is None:
            return
        if cand.shape != ref.shape:
            self.metrics.dropped.labels("candidate_error").inc()
            return
        with self._lock:
            self.core.observe(item.keys, item.decision, ref, cand, request_index=item.index,
                              request_id=item.request_id, meta=item.meta, feeds=item.feeds)

    def _work(self) -> None:
        while not self._stop.is_set():
            try:
                item = self.queue.get(timeout=0.1)
            except queue.Empty:
                continue
            self.metrics.queue_depth.set(self.queue.qsize())
            try:
                self._process(item)
            except Exception:  # never let one request stop the worker
                log.exception("shadow comparison failed")
                self.metrics.dropped.labels("candidate_error").inc()
            finally:
                self.processed += 1
                self.queue.task_done()

    def _on_sample(self, record: dict[str, Any]) -> None:
        if self.sink is not None:
            self.sink.submit(record)
        if self.drift is not None:
            self.drift.add(record)

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """Block until the queue is empty and the worker idle (tests, benchmark). True when it got there."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.queue.unfinished_tasks == 0:
                return True
            time.sleep(0.01)
        return False

    # ---------------------------------------------------------------------------------------- reports
    def alerts(self) -> list[dict[str, Any]]:
        """Alert records fired so far."""
        with self._lock:
            return self.core.alerts()

    def slices(self) -> dict[str, Any]:
        """Per-slice statistics."""
        with self._lock:
            return self.core.slices()


def build_app(service: MonitorService) -> Any:
    """The FastAPI app for a MonitorService (routes: module docstring)."""
    @contextlib.asynccontextmanager
    async def lifespan(_app: Any) -> AsyncIterator[None]:
        yield
        service.stop()

    app = FastAPI(title="tailguard shadow monitor", version="1", lifespan=lifespan)

    @app.post("/v2/models/{name}/infer")
    async def infer(name: str, request: Request) -> Response:
        status, doc = service.ingest("infer", name, await request.body())
        return JSONResponse(doc, status_code=status)

    @app.post("/v2/models/{name}/pairs")
    async def pairs(name: str, request: Request) -> Response:
        status, doc = service.ingest("pairs", name, await request.body())
        return JSONResponse(doc, status_code=status)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(service.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/healthz")
    async def healthz() -> Response:
        return JSONResponse({"status": "ok"})

    @app.get("/readyz")
    async def readyz() -> Response:
        ok, details = service.readiness()
        return JSONResponse(details, status_code=200 if ok else 503)

    @app.get("/v1/alerts")
    async def alerts() -> Response:
        return JSONResponse(service.alerts())

    @app.get("/v1/slices")
    async def slices() -> Response:
        return JSONResponse(service.slices())

    return app


def create_service(spec: Spec | str | Path, reference: str | Path | None, candidate: str | Path | None, *,
                   seed: int | None = None, start: bool = True) -> MonitorService:
    """Build a MonitorService from a spec (object or path).

    Raises:
        SpecError: a bad spec or monitoring section (exit 2).
    """
    source = str(spec) if not isinstance(spec, Spec) else "spec"
    spec_obj = load_spec(spec) if not isinstance(spec, Spec) else spec
    cfg: MonitorConfig = resolve_config(spec_obj, source=source)
    return MonitorService(cfg, reference, candidate, seed=seed, start=start)


def serve(spec_path: str | Path, reference: str | Path | None, candidate: str | Path | None,
          host: str = "0.0.0.0", port: int = 8080) -> None:
    """`tailguard monitor serve`: run the monitor until interrupted.

    A missing model file does not stop the service: live traffic is still accepted and counted, /readyz
    answers 503 naming the missing model (`dropped_total{reason="reference_missing"}` counts the sampled
    requests that could not be compared).

    Args:
        spec_path: spec YAML (its monitoring section is required).
        reference: FP32 reference .onnx.
        candidate: candidate .onnx (None: pairs-only monitor).
        host: bind address.
        port: TCP port.

    Raises:
        SpecError: bad spec (exit 2).
    """
    import uvicorn

    service = create_service(spec_path, reference, candidate)
    uvicorn.run(build_app(service), host=host, port=port, log_level="warning", access_log=False)
