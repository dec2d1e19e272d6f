"""The monitor's HTTP service: OIP ingest, isolation of the live path from misbehaving real references,
/metrics, /healthz, /readyz. The app runs in-process through Starlette's TestClient (real ASGI, real models)."""

import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from fastapi.testclient import TestClient

from tailguard.core.spec import parse_spec
from tailguard.monitoring import testing as T
from tailguard.monitoring.app import build_app
from tailguard.monitoring.config import resolve_config
from tailguard.monitoring.oip import request_json, tensor_json
from tailguard.monitoring.prometheus import METRIC_NAMES
from tailguard.monitoring.service import MonitorService

NAME = "tiny-clf"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("svc")
    return {"ref": T.linear_classifier(d / "ref.onnx"),
            "cand": T.linear_classifier(d / "cand.onnx", T.weights(noise=0.02)),
            "nan": T.nan_classifier(d / "nan.onnx"), "crash": T.crashing_classifier(d / "crash.onnx"),
            "slow": T.slow_classifier(d / "slow.onnx"), "dir": d}


def _service(reference, candidate, **mon):
    cfg = resolve_config(parse_spec(T.spec_dict({"sample_rate": 1.0, "seed": 0, **mon})))
    svc = MonitorService(cfg, reference, candidate)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not (svc.readiness()[0] or svc.load_errors):
        time.sleep(0.02)
    return svc, TestClient(build_app(svc))


def _value(svc, name, **labels):
    return svc.metrics.registry.get_sample_value(name, labels) or 0.0


def _body(i=0, domain="web", batch=1):
    x = np.random.default_rng(i).normal(size=(batch, 4)).astype(np.float32)
    return request_json({"x": x}, {"domain": domain}, request_id=f"r{i}")


def _send(client, n, path=f"/v2/models/{NAME}/infer", start=0):
    statuses, times = [], []
    for i in range(start, start + n):
        t0 = time.perf_counter()
        r = client.post(path, json=_body(i))
        times.append(time.perf_counter() - t0)
        statuses.append(r.status_code)
    return statuses, times


@pytest.mark.parametrize("body,status,reason", [
    (b"{not json", 400, "invalid_json"),
    (b"[1, 2]", 400, "not_an_object"),
    (b'{"inputs": []}', 422, "missing_inputs"),
    (b'{"inputs": [{"name": "y", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}', 422,
     "unknown_input"),
    (b'{"inputs": [{"name": "x", "shape": [1, 4], "datatype": "INT64", "data": [1, 2, 3, 4]}]}', 422,
     "bad_datatype"),
    (b'{"inputs": [{"name": "x", "shape": [1, 5], "datatype": "FP32", "data": [1, 2, 3, 4, 5]}]}', 422,
     "bad_shape"),
    (b'{"inputs": [{"name": "x", "shape": [2, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}', 422,
     "bad_shape"),
    (b'{"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": ["a", 2, 3, 4]}]}', 422,
     "bad_data"),
    (b'{"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}], '
     b'"parameters": {"domain": [1, 2]}}', 422, "bad_parameters"),
])
def test_ingest_answers_4xx_with_reason_and_counts_when_body_malformed(models, body, status, reason):
    svc, client = _service(models["ref"], models["cand"])
    with client:
        r = client.post(f"/v2/models/{NAME}/infer", content=body)
        assert r.status_code == status and r.json()["reason"] == reason and r.json()["error"]
        assert _value(svc, "tailguard_monitor_invalid_requests_total", reason=reason) == 1
        assert _value(svc, "tailguard_monitor_requests_total", model=NAME, endpoint="infer") == 0


def test_ingest_answers_404_when_model_name_unknown(models):
    svc, client = _service(models["ref"], models["cand"])
    with client:
        r = client.post("/v2/models/other/infer", json=_body())
        assert r.status_code == 404 and r.json()["reason"] == "unknown_model"


def test_service_compares_sampled_requests_and_exports_metrics_when_models_healthy(models):
    svc, client = _service(models["ref"], models["cand"])
    with client:
        assert client.get("/readyz").status_code == 200 and client.get("/healthz").status_code == 200
        statuses, _ = _send(client, 40)
        assert set(statuses) == {200}
        assert svc.wait_idle(20)
        text = client.get("/metrics").text
        for name in METRIC_NAMES:
            assert name in text, name
        assert _value(svc, "tailguard_monitor_requests_total", model=NAME, endpoint="infer") == 40
        assert _value(svc, "tailguard_monitor_sampled_total", model=NAME, slice="domain=web") == 40
        assert _value(svc, "tailguard_monitor_slice_samples", model=NAME, slice="all") == 40
        assert 0.9 <= _value(svc, "tailguard_monitor_slice_parity", model=NAME, slice="all",
                             metric="top1_agree") <= 1.0
        calls = _value(svc, "tailguard_monitor_inference_seconds_count", model=NAME, role="candidate")
        assert 1 <= calls <= 40  # micro-batched: queued requests of one signature share a call
        assert _value(svc, "tailguard_monitor_models_ready", role="reference") == 1
        doc = client.get("/v1/slices").json()
        assert doc["compared_rows"] == 40 and doc["compared_requests"] == 40


def test_live_responses_unaffected_and_errors_counted_when_reference_crashes(models):
    svc, client = _service(models["crash"], models["cand"])
    with client:
        statuses, _ = _send(client, 20)
        assert statuses == [200] * 20
        assert svc.wait_idle(20)
        assert _value(svc, "tailguard_monitor_dropped_total", reason="reference_error") == 20
        assert svc.monitor.compared_rows == 0


def test_readyz_503_naming_the_reference_when_its_last_calls_all_failed(models):
    svc, client = _service(models["crash"], models["cand"])
    with client:
        assert client.get("/readyz").status_code == 200  # loaded, not yet called
        _send(client, 25)
        assert svc.wait_idle(20)
        r = client.get("/readyz")
        assert r.status_code == 503 and "reference" in r.json()["failing"]
        assert "reference_error" in r.json()["failing"]["reference"]


def test_readyz_stays_200_when_reference_calls_succeed(models):
    svc, client = _service(models["ref"], models["cand"])
    with client:
        _send(client, 25)
        assert svc.wait_idle(20)
        assert client.get("/readyz").status_code == 200 and client.get("/readyz").json()["failing"] == {}


def test_live_responses_unaffected_and_drops_counted_when_reference_returns_nan(models):
    svc, client = _service(models["nan"], models["cand"])
    with client:
        statuses, _ = _send(client, 15)
        assert statuses == [200] * 15
        assert svc.wait_idle(20)
        assert _value(svc, "tailguard_monitor_dropped_total", reason="non_finite") == 15
        assert svc.alerts() == []


class GatedRunner:
    """A real ONNX Runtime runner whose calls wait until `gate` opens: a live answer that arrives while the gate
    is closed cannot have waited for the model (no wall-clock assumption)."""

    def __init__(self, path):
        from tailguard.core.runtime import OrtRunner

        self.inner, self.gate, self.calls = OrtRunner(path), threading.Event(), 0
        self.output_names = self.inner.output_names

    def run(self, feeds):
        self.calls += 1
        self.gate.wait(300)  # bounded: a test that fails before opening the gate must not hang the process at exit
        return self.inner.run(feeds)


def test_live_responses_answered_while_reference_blocked_and_timeouts_counted_when_reference_slow(models):
    ref = GatedRunner(models["ref"])
    svc, client = _service(ref, models["cand"], reference_timeout_s=0.01, queue_size=100)
    with client:
        statuses, _ = _send(client, 20)  # every answer comes back while the reference cannot answer
        assert statuses == [200] * 20 and ref.calls >= 1
        ref.gate.set()
        assert svc.wait_idle(30)
        assert _value(svc, "tailguard_monitor_dropped_total", reason="reference_timeout") >= 1


def test_ingest_never_blocks_and_counts_queue_full_when_shadow_overloaded(models):
    ref = GatedRunner(models["ref"])
    svc, client = _service(ref, models["cand"], reference_timeout_s=600.0, queue_size=2, shadow_batch_wait_ms=0)
    try:
        with client:
            statuses, _ = _send(client, 40)  # the reference is blocked for the whole time: nothing is compared
            assert statuses == [200] * 40
            full = _value(svc, "tailguard_monitor_dropped_total", reason="queue_full")
            # at most queue_size waiting plus one micro-batch (what was queued when the worker took it) in its hands
            assert full >= 40 - 2 - 3 and svc.queue.qsize() <= 2 and svc.monitor.compared_rows == 0
    finally:
        ref.gate.set()  # a failed assertion must not leave the worker blocked (the test process would hang)
        svc.stop()


def test_readyz_503_and_traffic_counted_when_reference_missing(models):
    svc, client = _service(models["dir"] / "missing.onnx", models["cand"])
    with client:
        r = client.get("/readyz")
        assert r.status_code == 503 and r.json()["missing"] == ["reference"]
        assert "not found" in r.json()["errors"]["reference"]
        statuses, _ = _send(client, 5)
        assert statuses == [200] * 5
        assert _value(svc, "tailguard_monitor_dropped_total", reason="reference_missing") == 5
        assert _value(svc, "tailguard_monitor_requests_total", model=NAME, endpoint="infer") == 5
        assert _value(svc, "tailguard_monitor_models_ready", role="reference") == 0


def _pair(i, domain, flip=False):
    body = _body(i, domain)
    x = np.asarray(body["inputs"][0]["data"], np.float32).reshape(1, 4)
    logits = x @ T.weights()
    if flip:
        logits = T.flip_top1(logits, np.ones(1, bool), 1.0)
    return {"request": body, "response": {"model_name": NAME, "outputs": [tensor_json("logits", logits)]}}


def test_pairs_endpoint_alerts_on_slice_when_live_responses_disagree(models):
    svc, client = _service(models["ref"], None, min_support=30, window_size=100, max_request_rows=1)  # 1-row
    with client:
        for i in range(120):
            flip = i >= 40 and i % 2 == 0  # "legal" rows: half the live answers differ from the reference
            r = client.post(f"/v2/models/{NAME}/pairs", json=_pair(i, "legal" if i % 2 == 0 else "web", flip))
            assert r.status_code == 200
        assert svc.wait_idle(20)
        alerts = client.get("/v1/alerts").json()
        assert any(a["slice"] == "domain=legal" and a["metric"] == "top1_agree" for a in alerts)
        assert not any(a["slice"] == "domain=web" for a in alerts)
        assert _value(svc, "tailguard_monitor_alert_active", model=NAME, slice="domain=legal",
                      metric="top1_agree") == 1
        assert _value(svc, "tailguard_monitor_alerts_total", model=NAME, slice="domain=legal",
                      metric="top1_agree") == 1


def test_pairs_endpoint_answers_422_when_response_batch_differs(models):
    svc, client = _service(models["ref"], None)
    with client:
        doc = _pair(0, "web")
        doc["response"]["outputs"][0]["shape"] = [3, 1]
        r = client.post(f"/v2/models/{NAME}/pairs", json=doc)
        assert r.status_code == 422 and r.json()["reason"] == "batch_mismatch"


def test_noise_floor_service_never_alerts_when_reference_compared_with_itself(models):
    svc, client = _service(models["ref"], models["cand"], noise_floor=True, min_support=20, window_size=50)
    with client:
        _send(client, 60)
        assert svc.wait_idle(20)
        assert svc.alerts() == [] and svc.monitor.compared_rows == 60
        assert _value(svc, "tailguard_monitor_slice_parity", model=NAME, slice="all", metric="top1_agree") == 1.0


# ------------------------------------------------------------------------------------------- hardening
def _raw_request(data="[1, 2, 3, 4]", shape="[1, 4]", extra=""):
    return (f'{{"inputs": [{{"name": "x", "shape": {shape}, "datatype": "FP32", "data": {data}}}]{extra}}}'
            ).encode()


def _deep(n):
    return "[" * n + "1" + "]" * n


@pytest.mark.parametrize("endpoint", ["infer", "pairs"])
@pytest.mark.parametrize("where", ["data", "parameters", "id"])
def test_ingest_answers_400_too_deep_when_json_nested_deeply(models, endpoint, where):
    svc, client = _service(models["ref"], models["cand"])
    deep = _deep(200_000)  # far past Python's recursion limit: json.loads raised RecursionError (a 500)
    req = {"data": _raw_request(data=deep), "parameters": _raw_request(extra=f', "parameters": {{"a": {deep}}}'),
           "id": _raw_request(extra=f', "id": {deep}')}[where]
    body = req if endpoint == "infer" else b'{"request": ' + req + b', "response": {"outputs": []}}'
    with client:
        r = client.post(f"/v2/models/{NAME}/{endpoint}", content=body)
        assert r.status_code == 400 and r.json()["reason"] == "too_deep"
        assert _value(svc, "tailguard_monitor_invalid_requests_total", reason="too_deep") == 1
        # brackets inside strings do not count: a shallow body full of them is accepted
        shallow = _raw_request(extra=', "id": "' + "[{" * 5000 + '\\"' + "[" * 100 + '", "parameters": {"d": "[["}')
        r = client.post(f"/v2/models/{NAME}/infer", content=shallow)
        assert r.status_code == 200 and r.json()["id"].startswith("[{[{")


@pytest.mark.parametrize("endpoint", ["infer", "pairs", "logger"])
@pytest.mark.parametrize("chunked", [False, True])
def test_ingest_answers_413_body_too_large_when_body_over_max_body_bytes(models, endpoint, chunked):
    svc, client = _service(models["ref"], models["cand"], max_body_bytes=4096)
    body = b'{"request": ' + _raw_request(data="[" + "1, " * 3000 + "4]") + b', "response": {}}'
    headers = {"ce-id": "ev-1", "ce-type": "org.kubeflow.serving.inference.request"} if endpoint == "logger" else {}
    content = iter([body[i:i + 1000] for i in range(0, len(body), 1000)]) if chunked else body
    with client:
        r = client.post(f"/v2/models/{NAME}/{endpoint}", content=content, headers=headers)
        assert r.status_code == 413 and r.json()["reason"] == "body_too_large"
        assert _value(svc, "tailguard_monitor_invalid_requests_total", reason="body_too_large") == 1
        assert len(svc.join) == 0


def test_pairs_answers_413_when_body_over_default_limit(models):
    svc, client = _service(models["ref"], None)
    with client:  # 9 MiB: the pairs endpoint had no size limit at all
        body = b'{"request": ' + _raw_request() + b', "response": {"outputs": [], "pad": "' + b"a" * 9 * 2**20 + b'"}}'
        r = client.post(f"/v2/models/{NAME}/pairs", content=body)
        assert r.status_code == 413 and r.json()["reason"] == "body_too_large"


def test_ingest_answers_413_batch_too_large_when_rows_over_max_batch_rows(models):
    svc, client = _service(models["ref"], models["cand"])
    with client:
        ok = client.post(f"/v2/models/{NAME}/infer", json=_body(0, batch=1024))
        assert ok.status_code == 200
        r = client.post(f"/v2/models/{NAME}/infer", json=_body(1, batch=1025))
        assert r.status_code == 413 and r.json()["reason"] == "batch_too_large"
        assert _value(svc, "tailguard_monitor_invalid_requests_total", reason="batch_too_large") == 1
        assert _value(svc, "tailguard_monitor_requests_total", model=NAME, endpoint="infer") == 1
    svc, client = _service(models["ref"], None, max_batch_rows=2)
    with client:
        doc = _pair(0, "web")
        doc["request"] = _body(0, batch=3)
        r = client.post(f"/v2/models/{NAME}/pairs", json=doc)
        assert r.status_code == 413 and r.json()["reason"] == "batch_too_large"


def test_ingest_answers_4xx_when_shape_product_overflows_int64(models):
    svc, client = _service(models["ref"], None)
    with client:  # 2**62 * 4 and 2 * 2**63 are 0 modulo 2**64: np.prod said 0 values, then reshape raised (a 500)
        r = client.post(f"/v2/models/{NAME}/infer", content=_raw_request(data="[]", shape="[4611686018427387904, 4]"))
        assert r.status_code == 413 and r.json()["reason"] == "batch_too_large"
        doc = _pair(0, "web")
        doc["request"] = _body(0, batch=2)
        doc["response"]["outputs"][0].update(shape=[2, 2**63], data=[])
        r = client.post(f"/v2/models/{NAME}/pairs", json=doc)
        assert r.status_code == 422 and r.json()["reason"] == "bad_shape"
        assert _value(svc, "tailguard_monitor_invalid_requests_total", reason="bad_shape") == 1


def test_parse_request_refuses_bad_shape_when_shape_product_overflows_int64():
    from types import SimpleNamespace

    from tailguard.monitoring.oip import OipError, parse_request

    specs = {2: [SimpleNamespace(name="ids", dtype="int64", shape=["batch", "seq"])],
             3: [SimpleNamespace(name="ids", dtype="int64", shape=["batch", "seq", "dim"])]}
    # 4 * 2**62 is 0 modulo 2**64; [1, 0, 2**70] has no values but a dimension numpy cannot allocate
    for shape in ([4, 2**62], [1, 0, 2**70], [2, 0, 2**63], [1, 2**63 + 1]):
        body = {"inputs": [{"name": "ids", "shape": shape, "datatype": "INT64", "data": []}]}
        with pytest.raises(OipError) as err:
            parse_request(body, specs[len(shape)])
        assert err.value.reason == "bad_shape", shape


@pytest.mark.parametrize("data", ["[NaN, 1, 2, 3]", "[1, Infinity, 2, 3]", "[1, 2, -Infinity, 3]",
                                  "[1e39, 1, 2, 3]", "[1, 2, 3, 1e400]", '["nan", 1, 2, 3]'])
def test_ingest_answers_422_non_finite_input_when_inputs_nan_or_inf(models, data):
    svc, client = _service(models["ref"], models["cand"])
    with client:
        r = client.post(f"/v2/models/{NAME}/infer", content=_raw_request(data=data))
        assert r.status_code == 422 and r.json()["reason"] == "non_finite_input"
        assert _value(svc, "tailguard_monitor_invalid_requests_total", reason="non_finite_input") == 1
        assert _value(svc, "tailguard_monitor_requests_total", model=NAME, endpoint="infer") == 0


def test_ingest_answers_200_with_encodable_id_when_id_has_lone_surrogate(models):
    svc, client = _service(models["ref"], models["cand"])
    with client:
        r = client.post(f"/v2/models/{NAME}/infer", content=_raw_request(extra=', "id": "a\\ud800b\\udfff"'))
        assert r.status_code == 200 and r.json()["id"] == "a?b?"
        r = client.post(f"/v2/models/{NAME}/infer", content=_raw_request(
            extra=', "id": "\\ud800", "parameters": {"\\udc00": [1]}'))
        assert r.status_code == 422 and r.json()["reason"] == "bad_parameters"
        r.json()["error"].encode("utf-8")


def test_ingest_answers_422_bad_parameters_when_parameters_too_many_or_int_past_int64(models):
    svc, client = _service(models["ref"], models["cand"])
    with client:
        many = ", ".join(f'"p{i}": {i}' for i in range(129))
        for extra in (f', "parameters": {{{many}}}', ', "parameters": {"domain": ' + "9" * 400 + "}"):
            r = client.post(f"/v2/models/{NAME}/infer", content=_raw_request(extra=extra))
            assert r.status_code == 422 and r.json()["reason"] == "bad_parameters"


def test_ingest_never_answers_5xx_when_bodies_hostile(models):
    svc, client = _service(models["ref"], models["cand"])
    bodies = [_deep(50), _deep(64), b"{" * 100_000, b'{"a":' * 100_000, b"\xff\xfe[\x00", "[\ud800]".encode(
        "utf-8", "surrogatepass"), b'{"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": ' +
        _deep(60).encode() + b"}]}", _raw_request(shape="[1, 4, 0, 99999999999999999999999]", data="[]"),
        _raw_request(extra=', "id": ' + "[" * 60 + "]" * 60), b'{"inputs": [{"name": ' + _deep(60).encode() +
        b', "shape": [1], "datatype": {"a": [[[]]]}, "data": []}]}', b'{"request": ' + _deep(70).encode() + b"}"]
    codes = []
    with TestClient(build_app(svc), raise_server_exceptions=False) as c:
        for b in bodies:
            b = b.encode() if isinstance(b, str) else b
            for ep in ("infer", "pairs"):
                codes.append(c.post(f"/v2/models/{NAME}/{ep}", content=b).status_code)
    assert len(codes) == 22 and all(s < 500 for s in codes), codes


def test_slice_key_is_redacted_everywhere_when_slice_column_in_redact_fields(models):
    svc, client = _service(models["ref"], models["cand"], redact_fields=["domain"], slice_columns=["domain"])
    with client:
        for i in range(5):
            assert client.post(f"/v2/models/{NAME}/infer", json=_body(i, domain=f"secret-{i}")).status_code == 200
        assert svc.wait_idle(20)
        slices = client.get("/v1/slices").json()["slices"]
        assert "domain=<redacted>" in slices and not any("secret" in k for k in slices)
        assert "secret" not in client.get("/metrics").text
        assert "secret" not in str(client.get("/v1/evidence").json())


def test_tune_collector_freezes_the_heap_and_raises_only_the_young_threshold_when_called():
    """`tailguard monitor serve` calls tune_collector once the service is built (a fresh interpreter: the test
    process's collector is left as it is)."""
    code = ("import gc; from tailguard.monitoring.serve import tune_collector, YOUNG_THRESHOLD; "
            "before = gc.get_threshold(); tune_collector(); after = gc.get_threshold(); "
            "print(gc.get_freeze_count() > 1000, after == (YOUNG_THRESHOLD, *before[1:]), YOUNG_THRESHOLD > before[0])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "True", "True"]
