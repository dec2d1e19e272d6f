"""A monitor that cannot be stalled (issue 36 items 2, 5, 7, 10, 11).

Item 2: `oip.json_depth` was a regex, quadratic on 65 `[`, one `"`, then n x `\\"` (64 KB: 14.6 s), and every body
was parsed on the event loop, so /healthz waited as long. The scan is now linear (read in pieces of DEPTH_CHUNK
bytes, each a fixed number of bytes/numpy passes: the pieces are counted, no wall time is measured), and every
parse runs on a parse thread: a /healthz probe sent while a parse thread holds a hostile body (it waits on an event
the test sets only after /healthz answered) is answered first.

Real parts: a MonitorService served by uvicorn on 127.0.0.1 in a thread, real tiny ONNX models, httpx clients.
Every wait is on a condition or an event; the timeouts only bound a hung server.
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
from typing import Any, Iterator

import httpx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tailguard.monitoring import oip
from tailguard.monitoring import testing as T
from tailguard.monitoring.join import CE_REQUEST
from tailguard.monitoring.oip import MAX_JSON_DEPTH, OipError, load_json, request_json, tensor_json
from tailguard.monitoring.parsing import PROCESS_PARSE_BYTES
from tests.monitoring.test_monitor_hardening import NAME, _live, _value

HUNG_S = 60.0  # bounds a hung server or client; never a timing assumption


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("stalls")
    return {"ref": T.linear_classifier(d / "ref.onnx"),
            "cand": T.linear_classifier(d / "cand.onnx", T.weights(noise=0.02))}


def hostile(n: int) -> bytes:
    """The issue's body: 65 `[`, one `"`, then `\\"` up to n bytes (quadratic for the old string regex)."""
    head = b"[" * (MAX_JSON_DEPTH + 1) + b'"'
    return head + b'\\"' * ((n - len(head)) // 2)


def _reference_depth(raw: bytes) -> int:
    """Deepest bracket nesting outside strings, byte by byte (the obvious scanner json_depth must agree with)."""
    depth = deepest = 0
    in_string = escaped = False
    for c in raw:
        if in_string:
            if escaped:
                escaped = False
            elif c == 0x5C:
                escaped = True
            elif c == 0x22:
                in_string = False
        elif c == 0x22:
            in_string = True
        elif c in b"[{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in b"]}":
            depth -= 1
    return deepest


# ------------------------------------------------------------------------------------- item 2: the depth scan
@pytest.mark.parametrize("n", [1 << 15, 1 << 16, 1 << 20, 8 << 20])
def test_json_depth_reads_hostile_text_in_bounded_pieces_when_escapes_repeat(monkeypatch, n):
    pieces: list[int] = []
    chunk = oip._depth_chunk

    def counting(piece: bytes, state: Any) -> None:
        pieces.append(len(piece))
        chunk(piece, state)

    monkeypatch.setattr(oip, "_depth_chunk", counting)
    raw = hostile(n)
    assert oip.json_depth(raw) == MAX_JSON_DEPTH + 1
    # linear: one piece per DEPTH_CHUNK bytes, each at most DEPTH_CHUNK bytes (a fixed number of passes over it),
    # and together exactly the text: twice the text, twice the pieces
    assert len(pieces) == math.ceil(len(raw) / oip.DEPTH_CHUNK)
    assert max(pieces) <= oip.DEPTH_CHUNK and sum(pieces) == len(raw)
    with pytest.raises(OipError) as err:
        load_json(raw, max_bytes=8 << 20)
    assert err.value.reason == "too_deep"


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet='\\"[]{}ab\u00e9'),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(alphabet='\\"[]{}a'), children,
                                                                        max_size=3),
    max_leaves=40)


@settings(max_examples=300, deadline=None)
@given(value=_json_values, wrap=st.integers(0, 80), piece=st.integers(1, 9))
def test_json_depth_matches_a_byte_scanner_when_pieces_split_escapes_and_strings(value, wrap, piece):
    raw = json.dumps([value] if wrap else value, ensure_ascii=False).encode()
    raw = b"[" * max(wrap - 1, 0) + raw + b"]" * max(wrap - 1, 0)
    want = _reference_depth(raw)
    old = oip.DEPTH_CHUNK
    oip.DEPTH_CHUNK = piece  # small pieces: every boundary falls inside escapes, strings and bracket runs
    try:
        got = oip.json_depth(raw)
    finally:
        oip.DEPTH_CHUNK = old
    short = raw.count(b"[") + raw.count(b"{") <= MAX_JSON_DEPTH  # the shortcut's bound, never an undercount
    assert got == want or (short and got == raw.count(b"[") + raw.count(b"{") >= want)


# ----------------------------------------------------------------------------- item 2: parsing off the loop
@contextlib.contextmanager
def _held_parse(svc: Any) -> Iterator[tuple[threading.Event, threading.Event, list[str]]]:
    """Make every ingest parse wait on `release` after setting `entered` (on its own thread): while it waits, the
    body is being parsed, so whatever answers meanwhile was not blocked by the parse. Yields (entered, release,
    names of the threads that parsed)."""
    entered, release, threads = threading.Event(), threading.Event(), []
    originals = {m: getattr(svc, m) for m in ("ingest", "ingest_event")}

    def held(method: str):
        def run(*args: Any, **kwargs: Any) -> Any:
            threads.append(threading.current_thread().name)
            entered.set()
            release.wait(HUNG_S)  # on the event loop (the old code), /healthz cannot answer before this ends
            return originals[method](*args, **kwargs)
        return run

    for m in originals:
        setattr(svc, m, held(m))
    try:
        yield entered, release, threads
    finally:
        release.set()
        for m in originals:
            delattr(svc, m)


def _hostile_request(kind: str, n: int) -> tuple[str, bytes, dict[str, str], int, str | None]:
    """(path, body, headers, expected status, expected reason) of a hostile request of about n bytes."""
    if kind == "json":
        return f"/v2/models/{NAME}/infer", hostile(n), {}, 400, "too_deep"
    if kind == "binary":  # the JSON part of a binary-extension body
        body = hostile(n)
        return f"/v2/models/{NAME}/infer", body, {oip.BINARY_HEADER: str(len(body))}, 400, "too_deep"
    if kind == "pairs":
        return f"/v2/models/{NAME}/pairs", b'{"request": ' + hostile(n), {}, 400, "too_deep"
    # the logger path: a hostile ce-metadata header beside a good request half (an unreadable ce-metadata is
    # ignored: the half waits for its partner)
    x = np.ones((1, 4), np.float32)
    body = json.dumps(request_json({"x": x}, request_id="r0")).encode()
    headers = {"ce-id": "ev-1", "ce-type": CE_REQUEST, "ce-specversion": "1.0", "ce-source": "http://x/",
               "content-type": "application/json", "ce-metadata": hostile(n).decode()}
    return f"/v2/models/{NAME}/logger", body, headers, 200, None


@pytest.mark.parametrize("kind", ["json", "binary", "pairs", "logger"])
def test_healthz_answers_while_a_parse_thread_holds_a_hostile_body_when_body_stalls_parsing(models, kind):
    n = 40_000 if kind == "logger" else 1 << 20  # the 40 KB ce-metadata; 1 MiB bodies
    path, body, headers, status, reason = _hostile_request(kind, n)
    with _live(models["ref"], models["cand"], max_body_bytes=2 << 20) as (svc, url, _):
        with _held_parse(svc) as (entered, release, threads):
            answer: dict[str, Any] = {}

            def post() -> None:
                answer["r"] = httpx.post(url + path, content=body, headers=headers, timeout=HUNG_S * 2)

            poster = threading.Thread(target=post)
            poster.start()
            assert entered.wait(HUNG_S), "the body never reached the parse"
            health = httpx.get(url + "/healthz", timeout=HUNG_S)  # the parse has not finished: it waits on us
            assert health.status_code == 200 and not release.is_set() and "r" not in answer
            release.set()
            poster.join(HUNG_S * 2)
        assert threads and all(t.startswith("tg-parse") for t in threads), threads
        r = answer["r"]
        assert r.status_code == status, r.text
        if reason is not None:
            assert r.json()["reason"] == reason
            assert _value(svc, "tailguard_monitor_invalid_requests_total", reason=reason) == 1
        else:
            assert r.json()["joined"] is False and len(svc.join) == 1


def test_large_bodies_are_parsed_in_a_worker_process_when_at_least_process_parse_bytes(models):
    # json.loads and the list-to-array conversion hold the GIL for a whole call: a large body is parsed in a
    # worker process, so no thread of the monitor waits for it; the answers and refusals are the same
    pad = b" " * PROCESS_PARSE_BYTES  # JSON whitespace: a large body that is cheap to build
    x = np.random.default_rng(0).normal(size=(4, 4)).astype(np.float32)
    good = json.dumps(request_json({"x": x}, {"domain": "web"}, request_id="big")).encode() + pad
    pairs = (b'{"request": ' + json.dumps(request_json({"x": x}, request_id="p")).encode() + b', "response": '
             + json.dumps({"outputs": [tensor_json("logits", x @ T.weights())]}).encode() + pad + b"}")
    with _live(models["ref"], models["cand"], max_body_bytes=4 << 20) as (svc, url, _):
        with httpx.Client(base_url=url, timeout=HUNG_S * 2) as http:
            r = http.post(f"/v2/models/{NAME}/infer", content=good)
            assert r.status_code == 200 and r.json()["id"] == "big"
            r = http.post(f"/v2/models/{NAME}/infer", content=hostile(PROCESS_PARSE_BYTES + 10))
            assert r.status_code == 400 and r.json()["reason"] == "too_deep"  # an OipError from the child
            assert http.post(f"/v2/models/{NAME}/pairs", content=pairs).status_code == 200
            small = json.dumps(request_json({"x": x}, request_id="small")).encode()
            assert http.post(f"/v2/models/{NAME}/infer", content=small).status_code == 200
        assert svc.parser.in_process == 3  # the three large bodies, not the small one
        assert svc.wait_idle(HUNG_S) and svc.monitor.compared_rows == 3 * 4
        assert _value(svc, "tailguard_monitor_candidate_source_total", model=NAME, source="live") == 1


# ------------------------------------------------------------------------------------- item 10: BYTES decoded last
def test_bytes_sections_are_not_decoded_when_input_name_or_datatype_is_wrong(models, monkeypatch):
    decoded: list[str] = []
    decode = oip.decode_binary

    def counting(section: Any, name: str, *args: Any) -> Any:
        decoded.append(name)
        return decode(section, name, *args)

    monkeypatch.setattr(oip, "decode_binary", counting)
    n = 50_000  # empty BYTES elements: 4 bytes of length prefix each (the issue sent 2.1 M)
    section = b"\0\0\0\0" * n

    def binary(name: str) -> tuple[bytes, dict[str, str]]:
        head = json.dumps({"inputs": [{"name": name, "shape": [n, 1], "datatype": "BYTES",
                                       "parameters": {"binary_data_size": len(section)}}]}).encode()
        return head + section, {oip.BINARY_HEADER: str(len(head))}

    with _live(models["ref"], models["cand"], max_body_bytes=4 << 20) as (svc, url, _):
        with httpx.Client(base_url=url, timeout=HUNG_S * 2) as http:
            for name, reason in (("not-an-input", "unknown_input"), ("x", "bad_datatype")):
                body, headers = binary(name)
                r = http.post(f"/v2/models/{NAME}/infer", content=body, headers=headers)
                assert r.status_code == 422 and r.json()["reason"] == reason, r.text
    assert decoded == []


def test_grpc_raw_bytes_are_not_decoded_when_input_name_or_datatype_is_wrong(models, monkeypatch):
    import grpc
    from tritonclient.grpc import service_pb2 as pb
    from tritonclient.grpc import service_pb2_grpc as pb_grpc

    from tailguard.monitoring import grpc_ingest

    decoded: list[str] = []
    decode = grpc_ingest.decode_binary
    monkeypatch.setattr(grpc_ingest, "decode_binary", lambda s, name, *a: decoded.append(name) or decode(s, name, *a))
    n = 50_000
    with _live(models["ref"], models["cand"], grpc=True, max_body_bytes=4 << 20) as (svc, _, addr):
        with grpc.insecure_channel(addr) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            for name, reason in (("not-an-input", "unknown_input"), ("x", "bad_datatype")):
                t = pb.ModelInferRequest.InferInputTensor(name=name, datatype="BYTES", shape=[n, 1])
                req = pb.ModelInferRequest(model_name=NAME, inputs=[t], raw_input_contents=[b"\0\0\0\0" * n])
                with pytest.raises(grpc.RpcError) as err:
                    stub.ModelInfer(req, timeout=HUNG_S)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and reason in err.value.details()
        assert _value(svc, "tailguard_monitor_invalid_requests_total", reason="unknown_input") == 1
    assert decoded == []


# ------------------------------------------------------------------------------------- item 5: slow clients
class _StalledStream:
    """A raw gRPC ModelInfer call that sends its headers and no message until closed (the issue's stalled stream)."""

    def __init__(self, channel: Any) -> None:
        from tritonclient.grpc import service_pb2 as pb

        self._stop = threading.Event()
        call = channel.stream_unary("/inference.GRPCInferenceService/ModelInfer",
                                    request_serializer=pb.ModelInferRequest.SerializeToString,
                                    response_deserializer=pb.ModelInferResponse.FromString)
        self.future = call.future(self._never())

    def _never(self) -> Iterator[Any]:
        self._stop.wait(HUNG_S * 10)
        return
        yield  # a generator that yields nothing

    def close(self) -> None:
        self._stop.set()
        self.future.cancel()


@contextlib.contextmanager
def _stalled_monitor(models: dict, **mon: Any) -> Iterator[tuple[Any, str, str, Any]]:
    """A monitor (HTTP and gRPC) whose gRPC servicer the test can see: (service, url, gRPC address, servicer)."""
    from tailguard.monitoring.grpc_ingest import InferenceServicer, start_grpc

    with _live(models["ref"], models["cand"], **mon) as (svc, url, _):
        servicer = InferenceServicer(svc)
        server, port = start_grpc(svc, "127.0.0.1", 0, servicer=servicer)
        try:
            yield svc, url, f"127.0.0.1:{port}", servicer
        finally:
            server.stop(None)


def _infer_grpc(addr: str, i: int) -> bool:
    import tritonclient.grpc as tg

    client = tg.InferenceServerClient(addr)
    x = np.random.default_rng(i).normal(size=(1, 4)).astype(np.float32)
    inp = tg.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    r = client.infer(NAME, [inp], request_id=f"g{i}", client_timeout=HUNG_S)
    return r.get_response().parameters["tailguard.sampled"].bool_param


def test_healthz_liveness_and_fresh_inference_answer_when_64_http_bodies_and_8_grpc_streams_stall(models):
    import grpc
    import tritonclient.grpc as tg

    from tests.monitoring.test_monitor_hardening import INFER, _body, _Stalled, _wait

    # the defaults (max_concurrent_requests 64); the read deadline far away: the stalls last the whole test
    with _stalled_monitor(models, body_read_timeout_s=3600) as (svc, url, addr, servicer):
        http_stalls = [_Stalled(url, INFER, declared=4096) for _ in range(64)]
        with grpc.insecure_channel(addr) as channel:
            streams = [_StalledStream(channel) for _ in range(8)]
            try:
                _wait(lambda: svc.body_budget.used == 64 * 16, "64 bodies stalled mid-read")
                _wait(lambda: servicer.active == 8, "8 ModelInfer streams stalled before their message")
                assert httpx.get(url + "/healthz", timeout=HUNG_S).status_code == 200
                assert httpx.get(url + "/metrics", timeout=HUNG_S).status_code == 200
                assert tg.InferenceServerClient(addr).is_server_live(client_timeout=HUNG_S)
                r = httpx.post(url + INFER, json=_body(7), timeout=HUNG_S)  # a fresh HTTP inference call
                assert r.status_code == 200, r.text
                assert _infer_grpc(addr, 8) is True  # and a fresh gRPC one
            finally:
                for s in streams:
                    s.close()
                for h in http_stalls:
                    h.close()
        assert svc.wait_idle(HUNG_S) and svc.monitor.compared_rows == 2


def test_stalled_bodies_and_streams_are_refused_and_counted_when_body_read_timeout_passes(models):
    import grpc

    from tests.monitoring.test_monitor_hardening import INFER, _Stalled, _wait

    with _stalled_monitor(models, body_read_timeout_s=0.2) as (svc, url, addr, servicer):
        http_stalls = [_Stalled(url, INFER, declared=4096) for _ in range(3)]
        with grpc.insecure_channel(addr) as channel:
            streams = [_StalledStream(channel) for _ in range(2)]
            try:
                reason = "body_read_timeout"
                _wait(lambda: _value(svc, "tailguard_monitor_invalid_requests_total", reason=reason) == 5,
                      "5 read deadlines")
                for s in streams:  # cancelled by the monitor
                    with pytest.raises(grpc.FutureCancelledError if s.future.cancelled() else grpc.RpcError):
                        s.future.result(timeout=HUNG_S)
                for h in http_stalls:
                    h.sock.settimeout(HUNG_S)
                    assert h.sock.recv(4096).startswith(b"HTTP/1.1 408")
                assert svc.body_budget.used == 0 and servicer.active == 0
                assert _value(svc, "tailguard_monitor_invalid_requests_total", reason="body_too_large") == 0
            finally:
                for s in streams:
                    s.close()
                for h in http_stalls:
                    h.close()


# -------------------------------------------------------------------- issue 38 item 6: the OIP health routes
# tritonclient.http runs on gevent: its calls run in a subprocess (pytest's threads stay unpatched)
HEALTH_CLIENT = """
import json, sys
import tritonclient.http as th
from tritonclient.utils import InferenceServerException
client = th.InferenceServerClient(sys.argv[1], connection_timeout=120, network_timeout=120)
out = {"live": client.is_server_live(), "ready": client.is_server_ready(),
       "model_ready": client.is_model_ready("tiny-clf"), "other_ready": client.is_model_ready("other"),
       "metadata": client.get_model_metadata("tiny-clf")}
try:
    client.get_model_metadata("other")
    out["other_metadata"] = "answered"
except InferenceServerException as exc:
    out["other_metadata"] = str(exc)
print(json.dumps(out))
"""


def test_tritonclient_http_health_and_metadata_calls_succeed_when_pointed_at_the_monitor(models, tmp_path):
    import subprocess
    import sys

    def client(url: str) -> dict:
        out = subprocess.run([sys.executable, "-c", HEALTH_CLIENT, url.removeprefix("http://")],
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    with _live(models["ref"], models["cand"]) as (svc, url, _):
        got = client(url)
        assert got["live"] and got["ready"] and got["model_ready"] and not got["other_ready"]
        assert got["metadata"]["name"] == NAME and got["metadata"]["platform"] == "tailguard-shadow-monitor"
        assert got["metadata"]["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}]
        assert "not monitored here" in got["other_metadata"]
    with _live(tmp_path / "absent.onnx", models["cand"]) as (svc, url, _):  # not ready: false, not an error
        got = client(url)
        assert got["live"] and not got["ready"] and not got["model_ready"]
