"""Hardening of the shadow monitor (issue 22, items 2 and 4): the payload-logger join buffer bounded in bytes, the
ingest concurrency limit and the request-body budget, bearer-token authentication (HTTP, gRPC, the combiner's peer
fetch, `tailguard monitor serve --auth-token-file`), eviction that keeps strong evidence, the per-column cap on new
slice values, and read endpoints that never build every slice under the worker lock.

Real parts: MonitorServices served by uvicorn on 127.0.0.1 in a thread (and the gRPC ingest), real tiny ONNX models
(monitoring/testing.py), raw sockets for clients that stall mid-body, tritonclient.grpc, `tailguard monitor serve`
as a subprocess. Time is injected (a list-backed clock) wherever a rate is tested; every wait is on a condition.
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Iterator

import httpx
import numpy as np
import pytest
import yaml

from tailguard.core.errors import InputError
from tailguard.core.spec import parse_spec
from tailguard.monitoring import testing as T
from tailguard.monitoring.app import build_app
from tailguard.monitoring.config import NEW_VALUE, Bound, load_auth_token, resolve_config
from tailguard.monitoring.detector import PROTECT_FRACTION, SliceStatistics
from tailguard.monitoring.join import CE_REQUEST, CE_RESPONSE, EntryTooLarge, JoinBuffer
from tailguard.monitoring.oip import request_json, tensor_json
from tailguard.monitoring.peers import http_fetch
from tailguard.monitoring.sampler import Decision
from tailguard.monitoring.service import READ_CHUNK, MonitorService
from tests.helpers.mlflow_server import uvicorn_in_thread
from tests.helpers.monitor_process import MonitorProcess

NAME = "tiny-clf"
TOKEN = "s3cret-token-0123456789abcdef"
INFER = f"/v2/models/{NAME}/infer"
LOGGER = f"/v2/models/{NAME}/logger"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("hardening")
    return {"ref": T.linear_classifier(d / "ref.onnx"),
            "cand": T.linear_classifier(d / "cand.onnx", T.weights(noise=0.02))}


def _wait(pred: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s  # a bound on a hung server, not a timing assumption
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def _cfg(**mon: Any):
    return resolve_config(parse_spec(T.spec_dict({"sample_rate": 1.0, "seed": 0, **mon})))


@contextlib.contextmanager
def _live(reference, candidate, *, grpc: bool = False, auth_token: str | None = None, peers=None,
          evidence_only: bool = False, **mon: Any) -> Iterator[tuple[MonitorService, str, str | None]]:
    """A MonitorService served by uvicorn on 127.0.0.1 (and the gRPC ingest when `grpc`) until the block ends."""
    svc = MonitorService(_cfg(**mon), reference, candidate, auth_token=auth_token, peers=peers,
                         evidence_only=evidence_only, poll_interval_s=3600.0)
    _wait(lambda: svc.readiness()[0] or bool(svc.load_errors) or reference is None, "models loaded")
    grpc_server, addr = None, None
    if grpc:
        from tailguard.monitoring.grpc_ingest import start_grpc

        grpc_server, gport = start_grpc(svc, "127.0.0.1", 0)
        addr = f"127.0.0.1:{gport}"
    try:
        with uvicorn_in_thread(build_app(svc)) as url:
            yield svc, url, addr
    finally:
        if grpc_server is not None:
            grpc_server.stop(None)
        svc.stop()


def _value(svc: MonitorService, name: str, **labels: str) -> float:
    return svc.metrics.registry.get_sample_value(name, labels) or 0.0


def _body(i: int = 0, domain: str = "web") -> dict:
    x = np.random.default_rng(i).normal(size=(1, 4)).astype(np.float32)
    return request_json({"x": x}, {"domain": domain}, request_id=f"r{i}")


def _response(i: int, total: int | None = None) -> bytes:
    """The live answer to `_body(i)` (the reference's logits), padded with JSON whitespace to `total` bytes."""
    x = np.asarray(_body(i)["inputs"][0]["data"], np.float32).reshape(1, 4)
    doc = {"model_name": NAME, "id": f"r{i}", "outputs": [tensor_json("logits", x @ T.weights())]}
    raw = json.dumps(doc).encode()
    return raw + b" " * (total - len(raw)) if total is not None else raw


def _ce(half: str, ce_id: str) -> dict[str, str]:
    return {"ce-id": ce_id, "ce-type": CE_REQUEST if half == "request" else CE_RESPONSE, "ce-specversion": "1.0",
            "ce-source": "http://localhost:9081/", "content-type": "application/json"}


class _Stalled:
    """A raw HTTP client that sends the headers of a POST (Content-Length `declared`) and `sent` body bytes, then
    stalls until closed: a request the server is reading, for as long as the test wants."""

    def __init__(self, base: str, path: str, declared: int, sent: int = 16) -> None:
        host, port = base.removeprefix("http://").split(":")
        self.sock = socket.create_connection((host, int(port)), timeout=30)
        head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {declared}\r\n\r\n").encode()
        self.sock.sendall(head + b" " * sent)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


# ------------------------------------------------------------------------------------------ item 2: join buffer
def test_join_buffer_evicts_oldest_and_counts_overflow_when_bytes_over_budget():
    drops: list[tuple[str, int]] = []
    buf = JoinBuffer(100, 30.0, max_bytes=1000, on_drop=lambda r, n: drops.append((r, n)), clock=lambda: 0.0)
    for i in range(3):
        assert buf.add(f"e{i}", "request", f"v{i}", size=400) is None
        assert buf.bytes <= 1000
    assert len(buf) == 2 and buf.bytes == 800 and drops == [("join_overflow", 1)]  # e0 made room for e2
    assert buf.add("e0", "response", "late") is None  # its partner was evicted: it waits alone now
    assert buf.add("e2", "response", "r2") == ("v2", "r2") and buf.bytes == 400  # the pair leaves, bytes too


def test_join_buffer_refuses_half_when_over_per_entry_cap():
    buf = JoinBuffer(100, 30.0, max_bytes=10_000, max_entry_bytes=1000, clock=lambda: 0.0)
    with pytest.raises(EntryTooLarge, match="1001 bytes"):
        buf.add("big", "response", "x", size=1001)
    assert len(buf) == 0 and buf.bytes == 0
    buf.add("ok", "request", "q", size=1000)
    assert buf.add("ok", "response", "r", size=50_000) == ("q", "r")  # a completing half never waits


def test_logger_keeps_raw_halves_within_byte_budget_and_counts_overflow_when_partners_never_come(models):
    size = 20_000
    with _live(models["ref"], None, logger_join_max_bytes=3 * size + 100,
               logger_join_max_entry_bytes=2 * size) as (svc, url, _):
        with httpx.Client(base_url=url, timeout=60) as client:
            for i in range(10):
                r = client.post(LOGGER, content=_response(i, size), headers=_ce("response", f"ev-{i}"))
                assert r.status_code == 200 and r.json()["joined"] is False
                assert svc.join.bytes <= 3 * size + 100  # the raw bytes held: the budget is the memory held
            assert len(svc.join) == 3 and svc.join.bytes == 3 * size
            assert _value(svc, "tailguard_monitor_dropped_total", reason="join_overflow") == 7
            big = _response(99, 2 * size + 1)
            r = client.post(LOGGER, content=big, headers=_ce("response", "ev-big"))
            assert r.status_code == 413 and r.json()["reason"] == "join_entry_too_large"
            assert _value(svc, "tailguard_monitor_invalid_requests_total", reason="join_entry_too_large") == 1
            # the newest waiting half still joins, parsed again from its raw bytes
            r = client.post(LOGGER, json=_body(9), headers=_ce("request", "ev-9"))
            assert r.status_code == 200 and r.json()["joined"] is True, r.json()
            assert svc.wait_idle(30) and svc.monitor.compared_rows == 1
            assert _value(svc, "tailguard_monitor_slice_parity", model=NAME, slice="all",
                          metric="top1_agree") == 1.0


# ---------------------------------------------------------------------------- item 2: concurrency, body budget
def test_ingest_answers_503_and_counts_when_max_concurrent_requests_are_in_flight(models):
    # the limit counts bodies being parsed (issue 36 item 5: a client stalled mid-body holds no slot); two parses
    # are held on an event until the third request has been answered
    with _live(models["ref"], models["cand"], max_concurrent_requests=2) as (svc, url, _):
        release, ingest = threading.Event(), svc.ingest
        svc.ingest = lambda *a, **k: release.wait(60) and ingest(*a, **k)
        stalled = [_Stalled(url, INFER, declared=4096) for _ in range(3)]  # mid-body: not counted
        held = [threading.Thread(target=httpx.post, args=(url + INFER,), kwargs={"json": _body(i), "timeout": 120})
                for i in range(2)]
        try:
            for t in held:
                t.start()
            _wait(lambda: svc.in_flight == 2, "two ingest requests in flight")
            r = httpx.post(url + INFER, json=_body(1), timeout=60)
            assert r.status_code == 503 and r.json()["reason"] == "too_many_requests"
            assert r.headers["retry-after"] == "1"
            assert httpx.get(url + "/healthz").status_code == 200  # probes are not ingest: never limited
            assert _value(svc, "tailguard_monitor_invalid_requests_total", reason="too_many_requests") == 1
        finally:
            release.set()
            for t in held:
                t.join(120)
            for s in stalled:
                s.close()
        _wait(lambda: svc.in_flight == 0, "the held requests ended")
        del svc.ingest
        assert httpx.post(url + INFER, json=_body(2), timeout=60).status_code == 200


def test_ingest_answers_503_body_budget_exceeded_when_bodies_in_flight_hold_the_budget(models):
    with _live(models["ref"], models["cand"], max_body_bytes=40_000, max_inflight_body_bytes=50_000) as (
            svc, url, _):
        stalled = _Stalled(url, INFER, declared=40_000, sent=39_990)  # what arrived is reserved, not what is declared
        try:
            _wait(lambda: svc.body_budget.used == 39_990, "the stalled body's bytes reserved")
            big = json.dumps(_body(1)).encode() + b" " * 15_000  # fits max_body_bytes, not what is left
            r = httpx.post(url + INFER, content=big, timeout=60)
            assert r.status_code == 503 and r.json()["reason"] == "body_budget_exceeded", r.text
            assert _value(svc, "tailguard_monitor_invalid_requests_total", reason="body_budget_exceeded") == 1

            def chunked():  # no Content-Length: reserved chunk by chunk, refused once over what is left
                yield json.dumps(_body(2)).encode()
                yield b" " * 15_000

            r = httpx.post(url + INFER, content=chunked(), timeout=60)
            assert r.status_code == 503 and r.json()["reason"] == "body_budget_exceeded"
            assert httpx.post(url + INFER, json=_body(3), timeout=60).status_code == 200  # small ones still fit
        finally:
            stalled.close()
        _wait(lambda: svc.body_budget.used == 0, "the budget given back")
        assert httpx.post(url + INFER, content=big, timeout=60).status_code == 200


# ------------------------------------------------------------------------------------------- item 4: auth
def test_monitor_answers_401_and_counts_on_every_route_but_healthz_when_bearer_token_missing_or_wrong(models):
    pairs = json.dumps({"request": _body(0), "response": json.loads(_response(0))}).encode()
    routes = [("GET", "/v1/slices", None), ("GET", "/v1/evidence?since=0", None), ("GET", "/v1/alerts", None),
              ("GET", "/metrics", None), ("GET", "/openapi.json", None), ("GET", "/no-such-route", None),
              ("POST", INFER, json.dumps(_body(0)).encode()), ("POST", f"/v2/models/{NAME}/pairs", pairs),
              ("POST", LOGGER, json.dumps(_body(0)).encode()), ("GET", f"/v2/models/{NAME}", None),
              ("GET", f"/v2/models/{NAME}/ready", None)]
    wrong = ({}, {"Authorization": "Bearer wrong-token-0123456789"}, {"Authorization": TOKEN},
             {"Authorization": f"Basic {TOKEN}"})
    with _live(models["ref"], models["cand"], auth_token=TOKEN) as (svc, url, _), \
            httpx.Client(base_url=url, timeout=60) as client:
        for method, path, body in routes:
            for headers in wrong:
                r = client.request(method, path, content=body, headers={**_ce("request", "ev-1"), **headers})
                assert r.status_code == 401 and r.json()["reason"] == "unauthenticated", (path, headers)
                assert r.headers["www-authenticate"] == "Bearer"
        assert _value(svc, "tailguard_monitor_invalid_requests_total", reason="unauthenticated") == \
            len(routes) * len(wrong)
        assert _value(svc, "tailguard_monitor_requests_total", model=NAME, endpoint="infer") == 0
        good = {"Authorization": f"Bearer {TOKEN}"}
        for method, path, body in routes:
            r = client.request(method, path, content=body, headers={**_ce("request", "ev-1"), **good})
            assert r.status_code == (404 if path == "/no-such-route" else 200), (path, r.text)
        for path in ("/healthz", "/readyz", "/v2/health/live", "/v2/health/ready"):  # probes: open by default
            assert client.get(path).status_code == 200


def test_readyz_and_metrics_follow_their_switches_when_token_configured(models):
    with _live(models["ref"], models["cand"], auth_token=TOKEN, auth_readyz=True, auth_metrics=False) as (
            svc, url, _):
        assert httpx.get(url + "/readyz").status_code == 401
        assert httpx.get(url + "/readyz", headers={"Authorization": f"bearer {TOKEN}"}).status_code == 200
        assert httpx.get(url + "/metrics").status_code == 200


def test_grpc_answers_unauthenticated_and_counts_when_metadata_lacks_the_token(models):
    tritonclient_grpc = pytest.importorskip("tritonclient.grpc")
    from tritonclient.utils import InferenceServerException

    with _live(models["ref"], models["cand"], grpc=True, auth_token=TOKEN) as (svc, _, addr):
        client = tritonclient_grpc.InferenceServerClient(addr)
        assert client.is_server_live()  # like /healthz: no token needed
        x = np.ones((1, 4), np.float32)
        inp = tritonclient_grpc.InferInput("x", [1, 4], "FP32")
        inp.set_data_from_numpy(x)
        with pytest.raises(InferenceServerException, match="UNAUTHENTICATED|unauthenticated"):
            client.infer(NAME, [inp], client_timeout=60)
        with pytest.raises(InferenceServerException, match="UNAUTHENTICATED|unauthenticated"):
            client.get_model_metadata(NAME, headers={"authorization": "Bearer wrong-token-0123456789"})
        assert _value(svc, "tailguard_monitor_invalid_requests_total", reason="unauthenticated") == 2
        r = client.infer(NAME, [inp], headers={"authorization": f"Bearer {TOKEN}"}, client_timeout=60)
        assert r.get_response().parameters["tailguard.sampled"].bool_param is True
        assert _value(svc, "tailguard_monitor_requests_total", model=NAME, endpoint="grpc") == 1


def test_combiner_fetch_sends_the_token_when_replicas_require_it(models):
    with _live(models["ref"], models["cand"], auth_token=TOKEN, evidence_only=True) as (rep, rep_url, _):
        with httpx.Client(base_url=rep_url, timeout=60, headers={"Authorization": f"Bearer {TOKEN}"}) as c:
            for i in range(5):
                assert c.post(INFER, json=_body(i)).status_code == 200
        assert rep.wait_idle(30)
        with pytest.raises(httpx.HTTPStatusError, match="401"):
            http_fetch()(rep_url, 0)
        assert http_fetch(headers={"Authorization": f"Bearer {TOKEN}"})(rep_url, 0)["role"] == "replica"
        with _live(models["ref"], models["cand"], auth_token=TOKEN, peers=[rep_url]) as (comb, _, _):
            comb.combine()
            status = comb.combiner.status()[rep_url]
            assert status["ok"] and not status["errors"], status
            assert comb.monitor.combined.slices["all"].requests == 5


def test_load_auth_token_reads_file_or_env_and_exits_2_naming_the_source_when_unusable(tmp_path, monkeypatch):
    mon = _cfg(auth_token_env="TG_TEST_TOKEN").mon
    monkeypatch.delenv("TG_TEST_TOKEN", raising=False)
    with pytest.raises(InputError, match="TG_TEST_TOKEN"):
        load_auth_token(mon)
    monkeypatch.setenv("TG_TEST_TOKEN", TOKEN)
    assert load_auth_token(mon) == TOKEN
    f = tmp_path / "token"
    f.write_text("short\n")
    with pytest.raises(InputError, match="fewer than 16"):
        load_auth_token(mon, f)
    f.write_text(TOKEN + "\n")
    assert load_auth_token(mon, f) == TOKEN  # the file wins over the spec's source; the newline is stripped
    with pytest.raises(InputError, match="cannot be read"):
        load_auth_token(mon, tmp_path / "absent")
    with pytest.raises(Exception, match="name one source"):
        _cfg(auth_token_env="A", auth_token_file="/x")


@pytest.mark.integration
def test_monitor_serve_requires_the_token_from_auth_token_file(models, tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(T.spec_dict({"sample_rate": 1.0, "seed": 0})))
    cmd = [sys.executable, "-c", "from tailguard.cli import main; main()", "monitor", "serve", "--spec", str(spec),
           "--reference", str(models["ref"]), "--candidate", str(models["cand"]), "--host", "127.0.0.1",
           "--probe-port", "0"]
    bad = subprocess.run([*cmd, "--port", "0", "--auth-token-file", str(tmp_path / "absent")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "absent" in bad.stdout + bad.stderr and "Traceback" not in bad.stderr
    (tmp_path / "token").write_text(TOKEN + "\n")
    proc = MonitorProcess(["--spec", str(spec), "--reference", str(models["ref"]), "--candidate",
                           str(models["cand"]), "--auth-token-file", str(tmp_path / "token")], tmp_path / "serve.log")
    try:
        def up() -> bool:
            assert proc.alive(), proc.log()
            with contextlib.suppress(httpx.HTTPError):
                return httpx.get(proc.url + "/readyz").status_code == 200
            return False

        _wait(up, "monitor serve ready", 120)
        assert httpx.get(proc.url + "/v1/slices").status_code == 401
        r = httpx.get(proc.url + "/v1/slices", headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 200 and r.json()["model"] == NAME
    finally:
        proc.end()


# ------------------------------------------------------------------------------------ item 4: eviction
def test_evict_keeps_a_slice_with_strong_evidence_when_a_flood_of_new_keys_arrives():
    top1 = {"top1_agree": Bound("top1_agree", 0.97, True, "min")}
    st = SliceStatistics("m", ["top1_agree"], top1, streams_per_request=2, alpha=0.01, horizon=10_000,
                         min_support=10**9, max_tracked_slices=6)  # min_support: it never alerts
    for _ in range(200):  # d=drift disagrees on every row: evidence well above half the alarm level
        st.update(["all", "d=drift"], {"top1_agree": 0.0}, 1.0)
    assert st.slices["d=drift"].evidence(st.h) >= PROTECT_FRACTION and not st.alerting_keys
    for i in range(50):  # a flood of one-request slices, each agreeing (weak evidence)
        st.update(["all", f"d=flood{i}"], {"top1_agree": 1.0}, 1.0)
    assert "d=drift" in st.slices and "all" in st.slices
    assert sorted(k for k in st.slices if k.startswith("d=flood")) == [f"d=flood{i}" for i in range(46, 50)]
    assert st.evicted == 46 and st.evicted_strong == 0


def test_evict_drops_the_oldest_strong_slice_and_counts_it_when_no_weak_one_is_left():
    top1 = {"top1_agree": Bound("top1_agree", 0.97, True, "min")}
    st = SliceStatistics("m", ["top1_agree"], top1, streams_per_request=2, alpha=0.01, horizon=10_000,
                         min_support=10**9, max_tracked_slices=2)
    for key in ("d=a", "d=b", "d=c"):
        for _ in range(200):
            st.update([key], {"top1_agree": 0.0}, 1.0)
    assert list(st.slices) == ["d=b", "d=c"]  # every slice strong: the least recently updated went
    assert st.evicted == st.evicted_strong == 1


# ------------------------------------------------------------------------------ item 4: new values per minute
def test_new_slice_values_past_the_per_minute_cap_are_lumped_and_counted_when_values_flood(models):
    now = [0.0]
    svc = MonitorService(_cfg(max_new_values_per_minute=3), models["ref"], models["cand"], clock=lambda: now[0])
    from fastapi.testclient import TestClient

    with TestClient(build_app(svc)) as client:
        for i in range(10):
            assert client.post(INFER, json=_body(i, domain=f"flood-{i}")).status_code == 200
        seen = set(svc.monitor.sampler.counts)
        assert {"domain=flood-0", "domain=flood-1", "domain=flood-2"} <= seen
        assert f"domain={NEW_VALUE}" in seen and "domain=flood-3" not in seen
        assert _value(svc, "tailguard_monitor_slice_values_lumped_total", model=NAME, slice="domain") == 7
        assert client.post(INFER, json=_body(0, domain="flood-0")).status_code == 200  # known: no token needed
        assert svc.monitor.sampler.seen("domain=flood-0") == 2
        now[0] += 20.0  # a third of a minute: one token back
        client.post(INFER, json=_body(11, domain="late-1"))
        client.post(INFER, json=_body(12, domain="late-2"))
        assert svc.monitor.sampler.seen("domain=late-1") == 1 and svc.monitor.sampler.seen("domain=late-2") == 0
        assert client.get("/v1/slices").json()["slice_values_lumped"] == 8


# ------------------------------------------------------------------------ item 4: read endpoints and the lock
class _CountingLock:
    """The worker lock, counting how often it is taken (a read that builds everything takes it once)."""

    def __init__(self) -> None:
        self.inner, self.acquired = threading.Lock(), 0

    def __enter__(self) -> "_CountingLock":
        self.inner.acquire()
        self.acquired += 1
        return self

    def __exit__(self, *exc: Any) -> None:
        self.inner.release()


def test_slices_and_evidence_build_in_chunks_under_the_worker_lock_when_many_slices_are_tracked(models):
    from fastapi.testclient import TestClient

    svc = MonitorService(_cfg(), models["ref"], models["cand"], start=False, evidence_only=True)
    n = 3 * READ_CHUNK + 7
    for i in range(n):
        svc.monitor.observe_values(["all", f"domain=v{i:05d}"], Decision(True, 1.0, 1.0, 1.0, (1.0, 1.0)),
                                  {m: 1.0 if m == "top1_agree" else 0.0 for m in svc.cfg.metrics})
    expect_slices, expect_evidence = svc.monitor.slices(0, 10000), svc.monitor.evidence(0)
    lock = svc._lock = _CountingLock()
    with TestClient(build_app(svc)) as client:
        doc = client.get("/v1/slices", params={"limit": 10000}).json()
        assert lock.acquired >= n // READ_CHUNK + 1  # one hold per chunk, never one for everything
        assert doc == json.loads(json.dumps(expect_slices))
        lock.acquired = 0
        ev = client.get("/v1/evidence", params={"since": 0}).json()
        assert lock.acquired >= n // READ_CHUNK + 1
        assert ev["as_of"] >= expect_evidence["as_of"]  # the clock at each read (combine.py Ordering)
        assert {**ev, "as_of": 0} == json.loads(json.dumps({**expect_evidence, "as_of": 0}))
        page = client.get("/v1/slices", params={"offset": 5, "limit": 3}).json()
        assert list(page["slices"]) == sorted(expect_slices["slices"])[5:8] and page["next_offset"] == 8
