"""Ingest cost of the monitor's protocols on this machine: JSON vs binary tensor data extension, HTTP vs gRPC.

`bench_protocols(duration_s)` measures, on the tiny classifier (monitoring/testing.py, real ONNX models):

* ingest p50/p99 of a 64-row request, JSON and binary: the server-side time of `MonitorService.ingest` (parse,
  checks, sampling, queue put; what `tailguard_monitor_ingest_seconds` measures), called in-process with the
  same body bytes the HTTP app would pass, at sample_rate 0.1 while the worker runs;
* closed-loop request throughput over the wire, one-row requests: HTTP (uvicorn + FastAPI, JSON bodies) and gRPC
  (ModelInfer, raw_input_contents), each driven by CLIENT_PROCS client processes (tritonclient.http with
  JSON / tritonclient.grpc), one request in flight per process, for `duration_s` seconds each.

Called from benchmarks/bench_monitor.py; run alone: `python -m benchmarks.monitor_protocols [duration_s]`.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

ROWS = 64
CLIENT_PROCS = 3
NAME = "tiny-clf"


def _client(kind: str, target: str, duration_s: float, out: Any) -> None:
    """One closed-loop client process: requests answered in `duration_s` seconds, put on `out`."""
    x = np.random.default_rng(os.getpid()).normal(size=(1, 4)).astype(np.float32)
    if kind == "grpc":
        import tritonclient.grpc as tc
    else:
        import tritonclient.http as tc
    client = tc.InferenceServerClient(target)
    inp = tc.InferInput("x", [1, 4], "FP32")
    if kind == "grpc":
        inp.set_data_from_numpy(x)
    else:
        inp.set_data_from_numpy(x, binary_data=False)
    done, end = 0, time.perf_counter() + duration_s
    while time.perf_counter() < end:
        client.infer(NAME, [inp], parameters={"domain": "web"})
        done += 1
    out.put(done)


def _throughput(kind: str, target: str, duration_s: float) -> float:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_client, args=(kind, target, duration_s, q)) for _ in range(CLIENT_PROCS)]
    for p in procs:
        p.start()
    counts = [q.get(timeout=duration_s + 120) for _ in procs]
    for p in procs:
        p.join(30)
    return round(sum(counts) / duration_s, 1)


def _pct(times: list[float], q: float) -> float:
    return round(float(np.percentile(np.asarray(times) * 1e3, q)), 4)


def bench_protocols(duration_s: float) -> dict[str, Any]:
    """Ingest latency (JSON vs binary, 64 rows) and HTTP vs gRPC throughput of the monitor on this machine.

    Args:
        duration_s: seconds of each phase (ingest loop per encoding; closed-loop load per protocol).

    Returns:
        {"ingest_ms": {"json"|"binary": {"p50", "p99", "n", "body_bytes"}}, "ingest_measured": what,
         "throughput_rps": {"http_json", "grpc"}, "client_procs", "rows", "cpu_count"}.
    """
    import httpx
    import tritonclient.http as th
    import uvicorn

    from tailguard.core.spec import parse_spec
    from tailguard.monitoring import testing as T
    from tailguard.monitoring.app import build_app
    from tailguard.monitoring.config import resolve_config
    from tailguard.monitoring.grpc_ingest import start_grpc
    from tailguard.monitoring.oip import request_json
    from tailguard.monitoring.service import MonitorService

    tmp = Path(tempfile.mkdtemp(prefix="tg-protocols-"))
    ref = T.linear_classifier(tmp / "ref.onnx")
    cand = T.linear_classifier(tmp / "cand.onnx", T.weights(noise=0.02))
    cfg = resolve_config(parse_spec(T.spec_dict({"sample_rate": 0.1, "seed": 0})))
    svc = MonitorService(cfg, ref, cand)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not svc.readiness()[0]:
        time.sleep(0.05)

    x = np.random.default_rng(0).normal(size=(ROWS, 4)).astype(np.float32)
    json_body = json.dumps(request_json({"x": x}, {"domain": "web"}, request_id="r")).encode()
    inp = th.InferInput("x", [ROWS, 4], "FP32")
    inp.set_data_from_numpy(x, binary_data=True)
    bin_body, json_size = th.InferenceServerClient.generate_request_body([inp], request_id="r",
                                                                         parameters={"domain": "web"})
    ingest: dict[str, Any] = {}
    for enc, body, header in (("json", json_body, None), ("binary", bin_body, str(json_size))):
        times: list[float] = []
        end = time.perf_counter() + duration_s
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            status, _ = svc.ingest("infer", NAME, body, header=header)
            times.append(time.perf_counter() - t0)
            assert status == 200
        ingest[enc] = {"p50": _pct(times, 50), "p99": _pct(times, 99), "n": len(times), "body_bytes": len(body)}

    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(svc), host="127.0.0.1", port=port, log_level="error",
                                           access_log=False))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    grpc_server, gport = start_grpc(svc, "127.0.0.1", 0)
    while not server.started and thread.is_alive():
        time.sleep(0.05)
    try:
        assert httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200
        rps = {"http_json": _throughput("http", f"127.0.0.1:{port}", duration_s),
               "grpc": _throughput("grpc", f"127.0.0.1:{gport}", duration_s)}
    finally:
        grpc_server.stop(None)
        server.should_exit = True
        thread.join(30)
        svc.stop()
    return {"ingest_ms": ingest, "ingest_measured": "server-side MonitorService.ingest time, in-process, "
                                                    f"{ROWS}-row request, sample_rate 0.1",
            "throughput_rps": rps, "throughput_measured": f"closed loop, {CLIENT_PROCS} client processes "
                                                          "(tritonclient), 1-row requests, round trips per second",
            "client_procs": CLIENT_PROCS, "rows": ROWS, "cpu_count": os.cpu_count()}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    print(json.dumps(bench_protocols(float(sys.argv[1]) if len(sys.argv) > 1 else 5.0), indent=2))
