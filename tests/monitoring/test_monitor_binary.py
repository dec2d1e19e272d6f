"""The Open Inference Protocol's binary tensor data extension on the monitor's HTTP ingest (/infer, /pairs, /logger).

Real parts: a running monitor (uvicorn in a thread on 127.0.0.1, real tiny ONNX models), and the real client
library of the KServe v2 / Triton ecosystem, tritonclient.http, in JSON and binary mode. tritonclient.http runs on
gevent, so its calls run in a subprocess (pytest's threads stay unpatched); bodies that lie about their sizes are
built by hand and sent with httpx, since no client library sends them.
"""

import contextlib
import json
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest

tritonclient = pytest.importorskip("tritonclient.http")
from tritonclient.utils import serialize_bf16_tensor, serialize_byte_tensor  # noqa: E402

from tailguard.core.spec import parse_spec  # noqa: E402
from tailguard.monitoring import testing as T  # noqa: E402
from tailguard.monitoring.app import build_app  # noqa: E402
from tailguard.monitoring.config import resolve_config  # noqa: E402
from tailguard.monitoring.join import CE_REQUEST, CE_RESPONSE  # noqa: E402
from tailguard.monitoring.oip import OIP_ITEMSIZE, OipError, decode_binary, parse_request  # noqa: E402
from tailguard.monitoring.service import MonitorService  # noqa: E402
from tests.helpers.mlflow_server import uvicorn_in_thread  # noqa: E402

NAME = "tiny-clf"
N = 24  # requests per client run
BATCH = 2  # rows per request


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("binary")
    return {"ref": T.linear_classifier(d / "ref.onnx"),
            "cand": T.linear_classifier(d / "cand.onnx", T.weights(noise=0.02))}


@contextlib.contextmanager
def live_monitor(reference, candidate, *, grpc=False, **mon):
    """A MonitorService served by uvicorn on 127.0.0.1 (and by the gRPC ingest when `grpc`), until the block ends.

    Yields:
        (service, HTTP base URL, gRPC address or None).
    """
    cfg = resolve_config(parse_spec(T.spec_dict({"sample_rate": 1.0, "seed": 0, **mon})))
    svc = MonitorService(cfg, reference, candidate)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (svc.readiness()[0] or svc.load_errors):
        time.sleep(0.02)
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


def value(svc, name, **labels):
    return svc.metrics.registry.get_sample_value(name, labels) or 0.0


def features(i, batch=BATCH):
    """Request i's input x: (batch, 4) float32."""
    return np.random.default_rng(i).normal(size=(batch, 4)).astype(np.float32)


def domain(i):
    return "legal" if i % 3 == 0 else "web"


# The tritonclient.http calls, run in a subprocess (gevent): N requests of BATCH rows with the slice metadata as
# request parameters; prints the answers as JSON.
CLIENT = """
import json, sys
import numpy as np
import tritonclient.http as th
url, mode, n, batch = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
client = th.InferenceServerClient(url, connection_timeout=120, network_timeout=120)
answers = []
for i in range(n):
    x = np.random.default_rng(i).normal(size=(batch, 4)).astype(np.float32)
    inp = th.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=(mode == "binary"))
    r = client.infer("tiny-clf", [inp], request_id=f"r{i}",
                     parameters={"domain": "legal" if i % 3 == 0 else "web"})
    answers.append(r.get_response())
print(json.dumps(answers))
"""


def run_http_client(url, mode, n=N, batch=BATCH):
    out = subprocess.run([sys.executable, "-c", CLIENT, url.removeprefix("http://"), mode, str(n), str(batch)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def assert_all_compared(svc, endpoint, n=N, batch=BATCH):
    """Every one of the n requests admitted, sampled (rate 1) and compared, under its slice; nothing refused."""
    assert svc.wait_idle(60)
    assert value(svc, "tailguard_monitor_requests_total", model=NAME, endpoint=endpoint) == n
    legal = sum(domain(i) == "legal" for i in range(n))
    assert value(svc, "tailguard_monitor_sampled_total", model=NAME, slice="domain=legal") == legal
    assert value(svc, "tailguard_monitor_sampled_total", model=NAME, slice="domain=web") == n - legal
    assert svc.monitor.compared_rows == n * batch
    refused = [(s.labels["reason"], s.value) for m in svc.metrics.invalid_requests.collect() for s in m.samples
               if s.name.endswith("_total") and s.value]
    assert refused == []


@pytest.mark.parametrize("mode", ["json", "binary"])
def test_monitor_compares_every_request_when_tritonclient_http_sends_json_or_binary(models, mode):
    with live_monitor(models["ref"], models["cand"]) as (svc, url, _):
        answers = run_http_client(url, mode)
        assert [a["id"] for a in answers] == [f"r{i}" for i in range(N)]
        assert all(a["parameters"]["tailguard.sampled"] is True for a in answers)
        assert_all_compared(svc, "infer")


def test_parse_request_drops_binary_data_output_when_client_sends_it():
    """tritonclient adds binary_data_output to every request without named outputs: protocol, not slice metadata."""
    body = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}],
            "parameters": {"domain": "web", "binary_data_output": True}}
    cfg = resolve_config(parse_spec(T.spec_dict()))
    assert parse_request(json.dumps(body).encode(), cfg.inputs).parameters == {"domain": "web"}


def binary_half(tensors, **kw):
    """(JSON part, binary part) of a body tritonclient.http builds (InferenceServerClient.generate_request_body)."""
    body, json_size = tritonclient.InferenceServerClient.generate_request_body(tensors, **kw)
    return json.loads(body[:json_size]), body[json_size:]


def infer_input(name, arr, datatype, binary=True):
    t = tritonclient.InferInput(name, list(arr.shape), datatype)
    t.set_data_from_numpy(arr, binary_data=binary)
    return t


def pairs_body(i, *, extra_label=True):
    """A binary pairs body (layout: docs/deploy.md): JSON {"request", "response"}, then the request inputs'
    sections, then the response outputs'. The response's logits are the reference's own; an extra BYTES output
    (a label, not compared) shows that every section is walked."""
    x = features(i)
    logits = x @ T.weights()
    req_json, req_bin = binary_half([infer_input("x", x, "FP32")], request_id=f"r{i}",
                                    parameters={"domain": domain(i)})
    outs = [infer_input("logits", logits, "FP32")]
    if extra_label:
        outs.append(infer_input("label", np.array([b"cat", b"\xff" * 3][:len(x)], dtype=object), "BYTES"))
    out_json, out_bin = binary_half(outs)
    header = json.dumps({"request": req_json, "response": {"model_name": NAME, "outputs": out_json["inputs"]}})
    return header.encode() + req_bin + out_bin, len(header)


def test_pairs_compares_decoded_tensors_when_body_uses_binary_extension(models):
    with live_monitor(models["ref"], None) as (svc, url, _):
        with httpx.Client(base_url=url, timeout=30) as http:
            for i in range(N):
                body, size = pairs_body(i)
                r = http.post(f"/v2/models/{NAME}/pairs", content=body,
                              headers={"Inference-Header-Content-Length": str(size)})
                assert r.status_code == 200, r.text
        assert_all_compared(svc, "pairs")
        # the live answers are the reference's own outputs on the decoded inputs: every row agrees
        assert value(svc, "tailguard_monitor_slice_parity", model=NAME, slice="all", metric="top1_agree") == 1.0


def test_logger_joins_binary_request_half_when_kserve_forwards_header_in_ce_metadata(models):
    """KServe's logger forwards the request body verbatim and the headers named in logger.metadataHeaders as
    ce-metadata (kserve pkg/logger/handler.go, worker.go): a binary request half is read from that header."""
    x = features(0)
    body, size = tritonclient.InferenceServerClient.generate_request_body(
        [infer_input("x", x, "FP32")], request_id="r0", parameters={"domain": "legal"})
    ce = {"ce-id": "ev-1", "ce-source": "http://localhost:9081/", "ce-specversion": "1.0",
          "content-type": "application/octet-stream"}
    response = {"model_name": NAME, "outputs": [{"name": "logits", "shape": [2, 3], "datatype": "FP32",
                                                 "data": (x @ T.weights()).ravel().tolist()}]}
    with live_monitor(models["ref"], None) as (svc, url, _):
        with httpx.Client(base_url=url, timeout=30) as http:
            meta = json.dumps({"Inference-Header-Content-Length": [str(size)]})
            r = http.post(f"/v2/models/{NAME}/logger", content=body,
                          headers={**ce, "ce-type": CE_REQUEST, "ce-metadata": meta})
            assert r.status_code == 200 and r.json()["joined"] is False, r.text
            r = http.post(f"/v2/models/{NAME}/logger", content=json.dumps(response).encode(),
                          headers={**ce, "ce-type": CE_RESPONSE, "ce-metadata": meta})
            assert r.status_code == 200 and r.json()["joined"] is True, r.text
        assert svc.wait_idle(60) and svc.monitor.compared_rows == 2
        assert value(svc, "tailguard_monitor_sampled_total", model=NAME, slice="domain=legal") == 1
        assert value(svc, "tailguard_monitor_slice_parity", model=NAME, slice="all", metric="top1_agree") == 1.0


def _lie(kind):
    """(body, Inference-Header-Content-Length, expected reason) of a binary /infer body that lies."""
    x = features(1)
    head = {"inputs": [{"name": "x", "shape": [2, 4], "datatype": "FP32", "parameters": {"binary_data_size": 32}}],
            "parameters": {"domain": "web"}}
    raw = x.tobytes()
    if kind == "header_past_body":
        text = json.dumps(head).encode()
        return text + raw, len(text) + len(raw) + 1, "bad_header_length"
    if kind == "size_not_shape":
        head["inputs"][0]["parameters"]["binary_data_size"] = 28
        text = json.dumps(head).encode()
        return text + raw[:28], len(text), "binary_size_mismatch"
    if kind == "truncated":
        text = json.dumps(head).encode()
        return text + raw[:20], len(text), "truncated_binary"
    if kind == "trailing":
        text = json.dumps(head).encode()
        return text + raw + b"\0\0\0\0", len(text), "trailing_binary"
    if kind == "bytes_prefix":  # BYTES: the second element's prefix says 200 bytes, 3 are there; the model takes
        # FP32: refused from the datatype before the section is decoded (issue 36 item 10)
        payload = (3).to_bytes(4, "little") + b"abc" + (200).to_bytes(4, "little") + b"xyz"
        head["inputs"][0].update({"datatype": "BYTES", "shape": [2, 1],
                                  "parameters": {"binary_data_size": len(payload)}})
        text = json.dumps(head).encode()
        return text + payload, len(text), "bad_datatype"
    if kind == "huge_shape":  # a shape whose product would need exabytes: refused from the sizes, nothing allocated
        head["inputs"][0]["shape"] = [2**40, 2**30]
        text = json.dumps(head).encode()
        return text + raw, len(text), "binary_size_mismatch"
    raise AssertionError(kind)


LIES = ["header_past_body", "size_not_shape", "truncated", "trailing", "bytes_prefix", "huge_shape"]


def test_binary_ingest_answers_4xx_counts_reason_and_stays_healthy_when_sizes_lie(models):
    with live_monitor(models["ref"], models["cand"]) as (svc, url, _):
        with httpx.Client(base_url=url, timeout=30) as http:
            for kind in LIES:
                body, header, reason = _lie(kind)
                r = http.post(f"/v2/models/{NAME}/infer", content=body,
                              headers={"Inference-Header-Content-Length": str(header)})
                assert 400 <= r.status_code < 500 and r.json()["reason"] == reason, (kind, r.text)
                assert r.json()["error"]
            r = http.post(f"/v2/models/{NAME}/infer", content=b"{}",
                          headers={"Inference-Header-Content-Length": "-3"})
            assert r.status_code == 400 and r.json()["reason"] == "bad_header_length"
            assert http.get("/healthz").status_code == 200
            body, header = pairs_body(5)
            assert http.post(f"/v2/models/{NAME}/pairs", content=body[:-2],
                             headers={"Inference-Header-Content-Length": str(header)}).json()["reason"] == (
                "truncated_binary")
            # still serving: a good binary request is compared
            assert http.post(f"/v2/models/{NAME}/infer", content=_lie("trailing")[0][:-4],
                             headers={"Inference-Header-Content-Length": str(_lie("trailing")[1])}).status_code == 200
        assert svc.wait_idle(60) and svc.monitor.compared_rows == 2
        for kind in LIES:
            reason = _lie(kind)[2]
            assert value(svc, "tailguard_monitor_invalid_requests_total", reason=reason) >= 1, reason
        assert value(svc, "tailguard_monitor_invalid_requests_total", reason="bad_header_length") == 2
        assert value(svc, "tailguard_monitor_invalid_requests_total", reason="truncated_binary") == 2


def _wire(arr, datatype):
    """The binary section tritonclient would send for `arr` (its own serializers for BYTES and BF16)."""
    if datatype == "BYTES":  # both serializers give a 0-d object array holding the bytes
        return serialize_byte_tensor(arr).item()
    if datatype == "BF16":
        return serialize_bf16_tensor(arr).item()
    return np.ascontiguousarray(arr).astype(arr.dtype.newbyteorder("<")).tobytes()


SAMPLES = {"BOOL": np.array([True, False, True, True]), "UINT8": np.array([0, 7, 255, 1], np.uint8),
           "UINT16": np.array([0, 65535, 3, 9], np.uint16), "UINT32": np.array([0, 2**32 - 1, 5, 6], np.uint32),
           "UINT64": np.array([0, 2**64 - 1, 5, 6], np.uint64), "INT8": np.array([-128, 127, 0, 1], np.int8),
           "INT16": np.array([-2**15, 2**15 - 1, 0, 1], np.int16),
           "INT32": np.array([-2**31, 2**31 - 1, 0, 1], np.int32),
           "INT64": np.array([-2**63, 2**63 - 1, 0, 1], np.int64),
           "FP16": np.array([0.5, -2.0, 65504.0, 1e-3], np.float16),
           "FP32": np.array([0.5, -2.0, 3.4e38, 1e-30], np.float32), "FP64": np.array([0.5, -2.0, 1e300, 1e-300]),
           "BF16": np.array([1.0, -2.5, 2.0**127, 0.15625], np.float32),
           "BYTES": np.array([b"", b"abc", "\u00e9".encode(), b"\x00" * 5], dtype=object)}


@pytest.mark.parametrize("datatype", sorted(SAMPLES))
def test_decode_binary_gives_tritonclient_values_when_datatype_is_any_oip_type(datatype):
    arr = SAMPLES[datatype]
    out = decode_binary(memoryview(_wire(arr, datatype)), "t", [2, 2], datatype, "input")
    assert out.shape == (4,)
    if datatype == "BYTES":
        assert list(out) == list(arr)
    else:
        assert out.dtype == (np.float32 if datatype == "BF16" else arr.dtype)
        np.testing.assert_array_equal(out, arr)  # BF16 samples are exact in bfloat16
    if datatype != "BYTES":  # one byte short of shape x itemsize: refused before decoding
        with pytest.raises(OipError) as err:
            decode_binary(memoryview(_wire(arr, datatype)[:-1]), "t", [2, 2], datatype, "input")
        assert err.value.reason == "binary_size_mismatch" and OIP_ITEMSIZE[datatype] >= 1
