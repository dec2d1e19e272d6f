"""A real `mlflow server` for integration tests (SQLite store, artifacts proxied by the server, webhooks on).

Shared by tests/integration/test_trigger.py and tests/integration/test_trigger_e2e.py. The server runs with
`--serve-artifacts` and an `--artifacts-destination` folder, so new experiments get `mlflow-artifacts:/` locations
and every client (the test, the pipeline's task subprocesses) uploads and downloads artifacts over HTTP, as pods of a
cluster would.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bound_socket(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A TCP socket bound to (`host`, `port`; 0: a port the kernel chooses), for a server to listen on
    (uvicorn's `Server.run(sockets=[...])`): unlike `free_port`, the port stays this socket's."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, port))
    return s


@contextlib.contextmanager
def mlflow_server(folder: Path, startup_timeout_s: float = 90.0) -> Iterator[str]:
    """Run `mlflow server` (1 worker) in its own process group; yields its URL, then ends the group.

    Webhooks may be delivered to http://127.0.0.1 (private IPs allowed), without retries, with a 1 s webhook
    cache; the webhook secrets are Fernet-encrypted in the store with a key generated here.

    Args:
        folder: where the SQLite store (mlflow.db), the artifacts (artifacts/) and server.log go.
        startup_timeout_s: how long to wait for GET /health (s).
    """
    import requests
    from cryptography.fernet import Fernet

    env = {**os.environ, "MLFLOW_WEBHOOK_ALLOWED_SCHEMES": "http,https", "MLFLOW_WEBHOOK_ALLOW_PRIVATE_IPS": "true",
           "MLFLOW_WEBHOOK_CACHE_TTL": "1", "MLFLOW_WEBHOOK_REQUEST_MAX_RETRIES": "0",
           "MLFLOW_WEBHOOK_SECRET_ENCRYPTION_KEY": Fernet.generate_key().decode()}
    env.pop("MLFLOW_TRACKING_URI", None)
    log_path = folder / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}",
             "--serve-artifacts", "--artifacts-destination", (folder / "artifacts").as_uri(),
             "--host", "127.0.0.1", "--port", "0", "--workers", "1"],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=folder)
        url = None
        try:
            deadline = time.monotonic() + startup_timeout_s
            while True:
                if proc.poll() is not None:
                    pytest.fail(f"mlflow server exited: {log_path.read_text()[-2000:]}")
                # --port 0: the kernel chooses the port (no other socket can take it before the server binds);
                # uvicorn's log names it
                if url is None and (m := re.search(r"Uvicorn running on (http://127\.0\.0\.1:\d+)",
                                                   log_path.read_text())):
                    url = m.group(1)
                try:
                    if url is not None and requests.get(f"{url}/health", timeout=1).ok:
                        break
                except requests.RequestException:
                    pass
                if time.monotonic() > deadline:
                    pytest.fail(f"mlflow server did not become healthy in {startup_timeout_s:.0f} s")
                time.sleep(0.3)
            yield url
        finally:
            os.killpg(proc.pid, signal.SIGTERM)  # the CLI starts uvicorn as a child: end the whole group it leads
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)


@contextlib.contextmanager
def uvicorn_in_thread(app, startup_timeout_s: float = 60.0, port: int | None = None,
                      host: str = "127.0.0.1", sock: socket.socket | None = None) -> Iterator[str]:
    """Serve an ASGI app with uvicorn in a daemon thread on `host` (a loopback address, default 127.0.0.1) and
    `port` (default one the kernel chooses), or on `sock` (from `bound_socket`, when the URL must be known before
    the app is built); yields its base URL (real HTTP). The listening socket is bound before uvicorn starts, so no
    other socket can take the port in between. `startup_timeout_s` bounds a hung server; it is not a timing
    assumption."""
    import threading
    import time

    import uvicorn

    sock = sock or bound_socket(host, port or 0)
    host, port = sock.getsockname()[:2]
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                           access_log=False, timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout_s
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started, f"uvicorn did not start in {startup_timeout_s} s"
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
