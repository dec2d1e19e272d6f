"""`tailguard monitor serve`: one monitor process, from its start to its shutdown.

`serve` checks the model files and the ports, builds the MonitorService (monitoring/service.py `create_service`),
and serves its HTTP app (monitoring/app.py) with uvicorn, the OIP over gRPC (monitoring/grpc_ingest.py) when
asked, and the probe port (monitoring/probe.py) once the ingest port listens; it stops them all when uvicorn
returns.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from pathlib import Path
from typing import Any

from tailguard.core.errors import InputError
from tailguard.core.pt2_archive import MONITOR_FIX, check_pt2_archive
from tailguard.core.spec import load_spec
from tailguard.monitoring.app import uvicorn_config
from tailguard.monitoring.combine import WAIT_POLLS
from tailguard.monitoring.probe import ProbeServer
from tailguard.monitoring.service import create_service

# the monitor service's logger: one name for its records, whichever of the service's modules writes them
log = logging.getLogger("tailguard.monitoring.service")


def _announce_when_listening(server: Any, probe: ProbeServer | None, host: str) -> None:
    """Once uvicorn listens on the ingest port: log the address it bound (the port the kernel chose for `--port
    0`), then start answering on the probe port, so the probe port never says ready while mirrored traffic would
    be refused (a kubelet probe meanwhile waits in the socket's backlog)."""
    while not server.started and not server.should_exit:
        time.sleep(0.05)
    if not server.started:
        return
    log.warning("HTTP ingest on %s:%d", host, server.servers[0].sockets[0].getsockname()[1])  # set by startup
    if probe is not None:
        probe.start()
        log.warning("probe port (/healthz, /readyz, /metrics) on %s:%d", host, probe.port)


YOUNG_THRESHOLD = 10_000
"""The collector's youngest-generation threshold in a monitor process (`gc.set_threshold`; CPython's default is
700): net new container objects between young collections (`tune_collector`)."""


def tune_collector(young: int = YOUNG_THRESHOLD) -> None:
    """Set up the garbage collector for a long-running monitor, once the service is built: collect, move every
    object alive after start-up (imported modules, the spec, the service) into the permanent generation
    (`gc.freeze`, CPython's advice for long-running servers), and raise the youngest generation's threshold to
    `young` (`gc.set_threshold`, the older generations' thresholds kept).

    A full collection walks every tracked object. After start-up the monitor holds ~150,000 of them (onnx, numpy,
    pydantic, prometheus-client, the service); left in the oldest generation, each full collection the traffic
    triggers walked them all: ~100 ms of the worker (and, through the interpreter lock, of the HTTP thread) each
    time. With per-row slices a worker allocates more objects per request and triggered full collections sooner:
    4,000 one-row requests drained with `predicted` on spent 21-27 us per row in the collector against 2 us with
    the `domain` column slice alone, and 2.5-2.9 us once frozen (the worker draining a queue without HTTP load,
    the collector timed with `gc.callbacks`, 2-core AMD EPYC).

    A request's objects (parsed body, feeds, keys, groups) are freed by reference counting within the request; at
    CPython's threshold of 700 they still started a young collection every few requests, whose survivors (the
    requests queued for the shadow) moved to older generations and made full collections. With 10,000 the
    collector took 0 ms/s instead of 72-81 ms/s of a 10 s closed-loop HTTP load (wrk) on 1-row requests, and the
    shadow worker compared 18% (column slice) and 23% (`predicted` on) more rows per second: medians of 2 rounds per
    mode in two runs one after the other, not interleaved (`benchmarks/bench_monitor.py` derived_throughput's
    set-up, 2-core AMD EPYC with AVX-512). Cyclic garbage waits for at most 10,000 new objects (a few MB).
    Frozen objects are still freed by reference counting; only a cycle among them is never collected, which the
    start-up objects, alive until exit, do not need.

    Args:
        young: the youngest generation's threshold (objects), >= 1.
    """
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(young, older, oldest)


def serve(spec_path: str | Path, reference: str | Path | None, candidate: str | Path | None,
          host: str = "0.0.0.0", port: int = 8080, *, evidence_only: bool = False, peers: list[str] | None = None,
          poll_interval_s: float = 5.0, grpc_port: int | None = None, expect_replicas: int | None = None,
          peer_dns: list[str] | None = None, peer_wait_polls: int = WAIT_POLLS,
          auth_token_file: str | Path | None = None, candidate_version: str | None = None,
          tracking_uri: str | None = None, centroids: str | Path | None = None, trusted: bool = False,
          probe_port: int | None = None) -> None:
    """`tailguard monitor serve`: run the monitor until interrupted.

    A missing model file does not stop the service: live traffic is still accepted and counted, /readyz
    answers 503 naming the missing model (`dropped_total{reason="reference_missing"}` counts the sampled
    requests that could not be compared).

    Args:
        spec_path: spec YAML (its monitoring section is required).
        reference: FP32 reference .onnx.
        candidate: candidate .onnx (None: pairs-only monitor).
        host: bind address (HTTP and gRPC).
        port: TCP port of the HTTP service (0: one the kernel chooses; the log line `HTTP ingest on HOST:PORT`
            names it once it listens).
        evidence_only: run as a replica (export evidence, never alert).
        peers: replica base URLs to combine (run as the combiner).
        poll_interval_s: seconds between reads of the peers' evidence.
        expect_replicas: replica processes the deployment runs (combiner only; /readyz not ready while fewer
            answer).
        peer_dns: headless Services (`NAME:PORT`) whose addresses are the replicas (run as the combiner).
        peer_wait_polls: polls the combiner waits for an unreadable replica (evidence ordering).
        grpc_port: also serve the OIP over gRPC on this port (monitoring/grpc_ingest.py), feeding the same
            admission; None: HTTP only.
        auth_token_file: file holding the bearer token every endpoint but /healthz requires (overrides
            monitoring.auth_token_file / auth_token_env); None: the spec's source, or no authentication.
        candidate_version: the candidate's registry version (NAME@ALIAS, NAME/VERSION or models:/...), whose
            `tailguard.validated_on` tag the node check compares this node with; None: not checked.
        tracking_uri: the MLflow registry holding it (None: the store every command uses: the spec's
            mlflow.tracking_uri, else $MLFLOW_TRACKING_URI, else the one under $TAILGUARD_HOME).
        centroids: the centroids.npz of the nearest_centroid slices (None: from candidate_version's run).
        trusted: `--trusted`: load a .pt2 model file without first refusing an archive that holds code.
        probe_port: serve /healthz, /readyz and /metrics also on this port, from a server the ingest port's
            connections cannot starve (`ProbeServer`); None: monitoring.probe_port (default 8082); 0: off.

    Raises:
        SpecError: bad spec (exit 2).
        InputError: the gRPC or probe port cannot be bound (or is the HTTP port); the token cannot be read
            (exit 2).
        UntrustedModelError: (exit 2, before anything is served) a .pt2 reference or candidate whose loading would
            run code from it (a pickled weight or constant, a custom object, an AOTInductor package), without
            `trusted` (tailguard.core.pt2_archive).
    """
    import uvicorn

    for model_file in (reference, candidate):
        if model_file is not None and Path(model_file).suffix == ".pt2" and Path(model_file).is_file():
            check_pt2_archive(model_file, trusted=trusted, fix=MONITOR_FIX)

    # the probe port is checked and bound before the service starts any thread (a refusal then exits cleanly)
    if probe_port is None:
        mon = load_spec(spec_path).monitoring  # None: create_service refuses the spec below
        probe_port = mon.probe_port if mon is not None else 0
    probe = None
    if probe_port:
        if probe_port in (port, grpc_port):
            raise InputError(f"the probe port {probe_port} is also the {'HTTP' if probe_port == port else 'gRPC'} "
                             "port", hint="give --probe-port (monitoring.probe_port) a port of its own, or 0 to "
                                          "turn it off")
        probe = ProbeServer(None, host, probe_port)  # answers once the ingest port listens
    try:
        service = create_service(spec_path, reference, candidate, evidence_only=evidence_only, peers=peers,
                                 poll_interval_s=poll_interval_s, auth_token_file=auth_token_file,
                                 expect_replicas=expect_replicas, peer_dns=peer_dns, peer_wait_polls=peer_wait_polls,
                                 candidate_version=candidate_version, tracking_uri=tracking_uri, centroids=centroids,
                                 trusted=trusted)
    except BaseException:
        if probe is not None:
            probe.stop()
        raise
    if probe is not None:
        probe.attach(service)
    if service.auth is None:
        log.warning("no bearer token configured (monitoring.auth_token_env / auth_token_file): every endpoint is "
                    "open to whoever reaches the port; restrict it with a NetworkPolicy (docs/deploy.md)")
    grpc_server = None
    if grpc_port is not None:
        from tailguard.monitoring.grpc_ingest import start_grpc

        try:
            grpc_server, bound = start_grpc(service, host, grpc_port)
        except InputError:
            if probe is not None:
                probe.stop()
            service.stop()
            raise
        log.warning("OIP gRPC ingest on %s:%d", host, bound)
    tune_collector()
    try:
        # the app answers 503 past max_concurrent_requests ingest requests (counted); uvicorn's own limit bounds
        # the connections and tasks beyond that (its plain 503, not counted)
        server = uvicorn.Server(uvicorn_config(service, host, port))
        threading.Thread(target=_announce_when_listening, args=(server, probe, host), name="tg-listening",
                         daemon=True).start()
        server.run()
    finally:
        if grpc_server is not None:
            grpc_server.stop(1.0)
        if probe is not None:
            probe.stop()
