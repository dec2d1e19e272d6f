"""Liveness served even when ingest is saturated (issue 36 item 5, last part).

~1,100 sockets with unfinished HTTP headers filled uvicorn's limit_concurrency on the ingest port (it counts every
open connection), so /healthz and /metrics answered 503 for 31 s and a kubelet would have restarted a healthy pod.
The probe port (`monitoring.probe_port`, `monitor serve --probe-port`) serves /healthz, /readyz and /metrics from
a server of its own (probe.ProbeServer); the tests saturate the ingest port with more unfinished-header sockets
than its limit and probe the other port.

Real parts: a MonitorService with real tiny ONNX models, the ingest app served by uvicorn with the config `serve`
uses (service.uvicorn_config; its connection headroom made small, so that a few dozen sockets exceed the limit
instead of 1,100), the probe server on a real socket, raw sockets and httpx clients. Timeouts only bound a hung
server; no latency is asserted (the benchmark measures it: benchmarks/bench_monitor.py --only liveness).
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Iterator

import httpx
import pytest
import uvicorn
import yaml

from tailguard.core.errors import InputError
from tailguard.monitoring import testing as T
from tailguard.monitoring.app import uvicorn_config
from tailguard.monitoring.probe import ProbeServer
from tailguard.monitoring.service import MonitorService
from tests.helpers.mlflow_server import bound_socket, free_port
from tests.helpers.monitor_process import MonitorProcess
from tests.monitoring.test_monitor_hardening import _cfg, _value, _wait

HUNG_S = 60.0  # bounds a hung server or client; never a timing assumption
HEADROOM = 8  # the ingest port's connection headroom in these tests (serve uses CONNECTION_HEADROOM, 1024)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("liveness")
    return {"ref": T.linear_classifier(d / "ref.onnx"),
            "cand": T.linear_classifier(d / "cand.onnx", T.weights(noise=0.02))}


@contextlib.contextmanager
def _served(models: dict, auth_token: str | None = None, **mon: Any) -> Iterator[tuple[MonitorService, str, str]]:
    """(service, ingest URL, probe URL): the ingest app under uvicorn with serve's config, the probe server."""
    svc = MonitorService(_cfg(**mon), models["ref"], models["cand"], auth_token=auth_token)
    _wait(lambda: svc.readiness()[0], "models loaded")
    sock = bound_socket()  # bound before uvicorn starts: no other socket takes the port in between
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn_config(svc, "127.0.0.1", port, headroom=HEADROOM))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    probe = ProbeServer(svc, "127.0.0.1", 0).start()
    try:
        _wait(lambda: server.started, "uvicorn started")
        yield svc, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{probe.port}"
    finally:
        probe.stop()
        server.should_exit = True
        thread.join(HUNG_S)
        svc.stop()


def _unfinished(url: str, n: int) -> list[socket.socket]:
    """`n` connections that each sent part of a request's headers and then nothing (the issue's attack)."""
    host, port = url.removeprefix("http://").split(":")
    socks = []
    for _ in range(n):
        s = socket.create_connection((host, int(port)), timeout=HUNG_S)
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        socks.append(s)
    return socks


def _close(socks: list[socket.socket]) -> None:
    for s in socks:
        with contextlib.suppress(OSError):
            s.close()


def test_probe_port_answers_healthz_readyz_metrics_when_unfinished_headers_exhaust_the_ingest_port(models):
    with _served(models, max_concurrent_requests=1) as (svc, url, probe):
        limit = svc.cfg.mon.max_concurrent_requests + HEADROOM
        socks = _unfinished(url, limit + 8)  # more than the ingest port's limit
        try:
            # uvicorn counts the connections as they are accepted: wait (condition, not time) until the ingest
            # port refuses, which is the state
            def saturated() -> bool:
                return httpx.get(url + "/healthz", timeout=HUNG_S).status_code == 503
            _wait(saturated, "the ingest port saturated")
            with httpx.Client(base_url=probe, timeout=HUNG_S) as http:
                assert http.get("/healthz").json() == {"status": "ok"}
                r = http.get("/readyz")
                assert r.status_code == 200 and r.json()["ready"] is True, r.text
                m = http.get("/metrics")
                assert m.status_code == 200 and "tailguard_monitor_requests_total" in m.text
                assert http.get("/v2/health/live").json() == {"live": True}
                assert http.get("/v2/health/ready").json() == {"ready": True}
                assert http.head("/healthz").status_code == 200
                nf = http.get("/v2/models/x/infer")
                assert nf.status_code == 404 and nf.json()["reason"] == "not_found"
            assert httpx.get(url + "/healthz", timeout=HUNG_S).status_code == 503  # still saturated meanwhile
        finally:
            _close(socks)
        _wait(lambda: httpx.get(url + "/healthz", timeout=HUNG_S).status_code == 200, "the ingest port back")


def test_probe_port_keeps_the_auth_rules_when_a_token_is_configured(models):
    token = "t" * 32
    with _served(models, auth_token=token) as (svc, _, probe):
        with httpx.Client(base_url=probe, timeout=HUNG_S) as http:
            assert http.get("/healthz").status_code == 200  # open, as on the main port
            assert http.get("/readyz").status_code == 200  # monitoring.auth_readyz false (default)
            r = http.get("/metrics")
            assert r.status_code == 401 and r.json()["reason"] == "unauthenticated"
            assert r.headers["WWW-Authenticate"] == "Bearer"
            assert http.get("/metrics", headers={"Authorization": "Bearer " + "x" * 32}).status_code == 401
            assert http.get("/metrics", headers={"Authorization": "Bearer " + token}).status_code == 200
        assert _value(svc, "tailguard_monitor_invalid_requests_total", reason="unauthenticated") == 2
    with _served(models, auth_token=token, auth_readyz=True, auth_metrics=False) as (_, _, probe):
        with httpx.Client(base_url=probe, timeout=HUNG_S) as http:
            assert http.get("/readyz").status_code == 401
            assert http.get("/v2/health/ready").status_code == 401
            assert http.get("/v2/health/live").status_code == 200
            assert http.get("/metrics").status_code == 200


def test_probe_server_refuses_with_input_error_when_port_taken(models):
    svc = MonitorService(_cfg(), models["ref"], models["cand"], start=False)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(InputError) as err:
            ProbeServer(svc, "127.0.0.1", taken.getsockname()[1])
    assert "--probe-port" in err.value.hint


def test_monitor_serve_answers_on_probe_port_when_started_from_the_cli(models, tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(T.spec_dict({"sample_rate": 1.0, "seed": 0})))
    port, probe = free_port(), free_port()
    cmd = [sys.executable, "-c", "from tailguard.cli import main; main()", "monitor", "serve", "--spec", str(spec),
           "--reference", str(models["ref"]), "--candidate", str(models["cand"]), "--host", "127.0.0.1"]
    same = subprocess.run([*cmd, "--port", str(port), "--probe-port", str(port)], capture_output=True, text=True,
                          timeout=120)
    assert same.returncode == 2 and "probe port" in same.stdout + same.stderr and "Traceback" not in same.stderr
    with socket.socket() as taken:  # a port another process holds: exit 2 naming the option, before any model loads
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = subprocess.run([*cmd, "--port", str(port), "--probe-port", str(taken.getsockname()[1])],
                              capture_output=True, text=True, timeout=120)
    assert busy.returncode == 2 and "--probe-port" in busy.stdout + busy.stderr and "Traceback" not in busy.stderr
    # the main port is the kernel's choice; the probe port was free a moment ago (it is bound before the models load)
    proc = MonitorProcess(cmd[5:cmd.index("--host")] + ["--probe-port", str(probe)], tmp_path / "serve.log")
    try:
        deadline = time.monotonic() + HUNG_S * 2  # bounds a hung process
        while time.monotonic() < deadline:
            assert proc.alive(), proc.log()
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{probe}/readyz", timeout=5).status_code == 200:
                    break
            time.sleep(0.1)
        assert httpx.get(f"http://127.0.0.1:{probe}/healthz", timeout=HUNG_S).status_code == 200
        assert httpx.get(f"{proc.url}/healthz", timeout=HUNG_S).status_code == 200  # kept on main
    finally:
        proc.end()
