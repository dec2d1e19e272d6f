"""The monitor's HTTP service: OIP ingest, isolation of the live path from misbehaving real references,
/metrics, /healthz, /readyz. The app runs in-process through Starlette's TestClient (real ASGI, real models)."""

import time

import numpy as np
import pytest
from fastapi.testclient import TestClient

from tailguard.monitoring import testing as T
from tailguard.monitoring.config import resolve_config
from tailguard.monitoring.metrics import METRIC_NAMES
from tailguard.monitoring.oip import request_json, tensor_json
from tailguard.monitoring.service import MonitorService, build_app
from tailguard.spec import parse_spec

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
        assert _value(svc, "tailguard_monitor_inference_seconds_count", model=NAME, role="candidate") == 40
        assert _value(svc, "tailguard_monitor_models_ready", role="reference") == 1
        assert client.get("/v1/slices").json()["compared_rows"] == 40


def test_live_responses_unaffected_and_errors_counted_when_reference_crashes(models):
    svc, client = _service(models["crash"], models["cand"])
    with client:
        statuses, _ = _send(client, 20)
        assert statuses == [200] * 20
        assert svc.wait_idle(20)
        assert _value(svc, "tailguard_monitor_dropped_total", reason="reference_error") == 20
        assert svc.core.compared_rows == 0


def test_live_responses_unaffected_and_drops_counted_when_reference_returns_nan(models):
    svc, client = _service(models["nan"], models["cand"])
    with client:
        statuses, _ = _send(client, 15)
        assert statuses == [200] * 15
        assert svc.wait_idle(20)
        assert _value(svc, "tailguard_monitor_dropped_total", reason="non_finite") == 15
        assert svc.alerts() == []


def test_live_responses_fast_and_timeouts_counted_when_reference_slow(models):
    svc, client = _service(models["slow"], models["cand"], reference_timeout_s=0.01, queue_size=100)
    with client:
        statuses, times = _send(client, 20)
        assert statuses == [200] * 20
        assert svc.wait_idle(30)
        assert _value(svc, "tailguard_monitor_dropped_total", reason="reference_timeout") >= 1
        # a test client round trip includes the ASGI plumbing; the model call (~100+ ms) is not in it
        assert max(times) < 0.1


def test_ingest_never_blocks_and_counts_queue_full_when_shadow_overloaded(models):
    svc, client = _service(models["slow"], models["cand"], reference_timeout_s=5.0, queue_size=2)
    with client:
        statuses, times = _send(client, 40)
        assert statuses == [200] * 40
        full = _value(svc, "tailguard_monitor_dropped_total", reason="queue_full")
        assert full >= 30 and svc.queue.qsize() <= 2
        assert max(times) < 0.1
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
    svc, client = _service(models["ref"], None, min_support=30, window_size=100)
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
        assert svc.alerts() == [] and svc.core.compared_rows == 60
        assert _value(svc, "tailguard_monitor_slice_parity", model=NAME, slice="all", metric="top1_agree") == 1.0
