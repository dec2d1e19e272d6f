"""The KServe payload-logger endpoint (POST /v2/models/{name}/logger): CloudEvents in binary content mode, joined
by ce-id in a bounded, time-limited buffer, then compared the pairs endpoint's way. Real FastAPI app through
Starlette's TestClient, real tiny ONNX reference models (monitoring/testing.py); the events carry the headers
KServe's logger sets (kserve/kserve pkg/logger/worker.go)."""

import json
import time

import numpy as np
import pytest

from tailguard.monitoring import testing as T
from tailguard.monitoring.join import CE_REQUEST, CE_RESPONSE, JoinBuffer
from tailguard.monitoring.oip import tensor_json
from tests.monitoring.test_monitor_service import NAME, GatedRunner, _body, _service, _value

PATH = f"/v2/models/{NAME}/logger"
TYPES = {"request": CE_REQUEST, "response": CE_RESPONSE}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("logger")
    return {"ref": T.linear_classifier(d / "ref.onnx"), "slow": T.slow_classifier(d / "slow.onnx")}


def _headers(half, ce_id, **extra):
    h = {"ce-id": ce_id, "ce-type": TYPES[half], "ce-source": "http://localhost:9081/", "ce-specversion": "1.0",
         "ce-inferenceservicename": NAME, "ce-namespace": "tg", "ce-component": "predictor",
         "ce-endpoint": "default", "ce-metadata": "{}", "content-type": "application/json"}
    h.update(extra)
    return {k: v for k, v in h.items() if v is not None}


def _response(i, domain="web", *, logits=None):
    """The live answer to request `_body(i, domain)`: the reference's own logits unless given."""
    if logits is None:
        x = np.asarray(_body(i, domain)["inputs"][0]["data"], np.float32).reshape(1, 4)
        logits = x @ T.weights()
    return {"model_name": NAME, "id": f"r{i}", "outputs": [tensor_json("logits", logits)]}


def _post(client, half, ce_id, body, **extra):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return client.post(PATH, content=content, headers=_headers(half, ce_id, **extra))


@pytest.mark.parametrize("order", [("request", "response"), ("response", "request")])
def test_logger_compares_one_pair_when_both_halves_arrive_in_either_order(models, order):
    svc, client = _service(models["ref"], None)
    halves = {"request": _body(0, "legal"), "response": _response(0, "legal")}
    with client:
        first = _post(client, order[0], "ev-1", halves[order[0]])
        assert first.status_code == 200 and first.json()["joined"] is False
        assert len(svc.join) == 1 and _value(svc, "tailguard_monitor_requests_total", model=NAME,
                                             endpoint="logger") == 0
        second = _post(client, order[1], "ev-1", halves[order[1]])
        assert second.status_code == 200, second.json()
        assert second.json()["joined"] is True and second.json()["parameters"]["tailguard.sampled"] is True
        assert svc.wait_idle(20)
        assert len(svc.join) == 0
        assert _value(svc, "tailguard_monitor_requests_total", model=NAME, endpoint="logger") == 1
        assert _value(svc, "tailguard_monitor_sampled_total", model=NAME, slice="domain=legal") == 1
        assert svc.monitor.compared_rows == 1
        assert _value(svc, "tailguard_monitor_slice_parity", model=NAME, slice="domain=legal",
                      metric="top1_agree") == 1.0
        assert _value(svc, "tailguard_monitor_dropped_total", reason="unmatched") == 0


def test_logger_pairs_each_id_with_its_own_partner_when_events_interleave(models):
    svc, client = _service(models["ref"], None)
    with client:
        # live answers of id ev-1 disagree with the reference; ev-0 and ev-2 agree
        flipped = T.flip_top1(np.asarray(_response(1)["outputs"][0]["data"], np.float32).reshape(1, 3),
                              np.ones(1, bool), 1.0)
        for half, i in [("request", 0), ("request", 1), ("response", 2), ("response", 0), ("request", 2)]:
            assert _post(client, half, f"ev-{i}", _body(i) if half == "request" else _response(i)).status_code == 200
        _post(client, "response", "ev-1", _response(1, logits=flipped))
        assert svc.wait_idle(20)
        assert svc.monitor.compared_rows == 3 and len(svc.join) == 0
        # the display estimate is exponentially weighted (span 1000 rows): 2 of 3 agree, within 0.001
        assert _value(svc, "tailguard_monitor_slice_parity", model=NAME, slice="all",
                      metric="top1_agree") == pytest.approx(2 / 3, abs=1e-3)


def test_logger_counts_unmatched_drop_when_half_expires(models):
    svc, client = _service(models["ref"], None, logger_join_ttl_s=0.05)
    with client:
        assert _post(client, "request", "ev-1", _body(1)).status_code == 200
        time.sleep(0.2)
        text = client.get("/metrics").text  # a scrape expires stale halves first
        assert 'tailguard_monitor_dropped_total{reason="unmatched"} 1.0' in text
        late = _post(client, "response", "ev-1", _response(1))
        assert late.status_code == 200 and late.json()["joined"] is False  # its partner is gone
        assert svc.wait_idle(5)
        assert svc.monitor.compared_rows == 0
        assert _value(svc, "tailguard_monitor_requests_total", model=NAME, endpoint="logger") == 0
        deadline = time.monotonic() + 5  # the idle worker sweeps too
        while time.monotonic() < deadline and len(svc.join):
            time.sleep(0.05)
        assert len(svc.join) == 0
        assert _value(svc, "tailguard_monitor_dropped_total", reason="unmatched") == 2


def test_logger_buffer_stays_bounded_and_counts_overflow_when_partners_never_come(models):
    svc, client = _service(models["ref"], None, logger_join_max_entries=5)
    with client:
        for i in range(20):
            assert _post(client, "request", f"ev-{i}", _body(i)).status_code == 200
            assert len(svc.join) <= 5
        assert len(svc.join) == 5
        assert _value(svc, "tailguard_monitor_dropped_total", reason="join_overflow") == 15
        assert _post(client, "response", "ev-19", _response(19)).json()["joined"] is True  # newest survived
        assert _post(client, "response", "ev-0", _response(0)).json()["joined"] is False  # oldest was evicted
        assert svc.wait_idle(20)
        assert svc.monitor.compared_rows == 1
        assert client.get("/readyz").json()["join_pending"] == 5


GOOD_REQ = json.dumps(_body(0)).encode()
GOOD_RESP = json.dumps(_response(0)).encode()


@pytest.mark.parametrize("half,headers,body,status,reason", [
    ("request", {"ce-id": None}, GOOD_REQ, 400, "missing_ce_id"),
    ("request", {"ce-id": "  "}, GOOD_REQ, 400, "missing_ce_id"),
    ("request", {"ce-type": "org.kubeflow.serving.inference.explain"}, GOOD_REQ, 400, "unknown_ce_type"),
    ("response", {"ce-type": None}, GOOD_RESP, 400, "unknown_ce_type"),
    ("request", {}, b"{not json", 400, "invalid_json"),
    ("response", {}, b"{not json", 400, "invalid_json"),
    ("response", {}, b"[1, 2]", 400, "not_an_object"),
    ("response", {}, b'{"model_name": "tiny-clf", "outputs": []}', 422, "missing_output"),
    ("request", {}, b'{"inputs": [{"name": "y", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}',
     422, "unknown_input"),
    ("request", {"content-type": "application/cloudevents+json"}, GOOD_REQ, 415, "structured_mode"),
])
def test_logger_answers_4xx_with_reason_and_counts_when_event_malformed(models, half, headers, body, status,
                                                                         reason):
    svc, client = _service(models["ref"], None)
    with client:
        r = _post(client, half, "ev-1", body, **headers)
        assert r.status_code == status and r.json()["reason"] == reason and r.json()["error"]
        assert _value(svc, "tailguard_monitor_invalid_requests_total", reason=reason) == 1
        assert len(svc.join) == 0


def test_logger_answers_422_and_consumes_pair_when_response_batch_differs_from_request(models):
    svc, client = _service(models["ref"], None)
    with client:
        _post(client, "request", "ev-1", _body(1, batch=2))
        r = _post(client, "response", "ev-1", _response(1))  # batch 1 answer to a batch-2 request
        assert r.status_code == 422 and r.json()["reason"] == "batch_mismatch"
        assert _value(svc, "tailguard_monitor_invalid_requests_total", reason="batch_mismatch") == 1
        assert len(svc.join) == 0 and svc.monitor.compared_rows == 0


@pytest.mark.parametrize("nan_json", [b"NaN", b"null"])  # Python's json writes NaN; orjson (KServe) writes null
def test_logger_scores_nan_response_worst_case_when_live_output_not_finite(models, nan_json):
    svc, client = _service(models["ref"], None)
    with client:
        resp = json.dumps(_response(3, logits=np.full((1, 3), 7.0, np.float32))).encode()
        resp = resp.replace(b"7.0", nan_json)
        assert _post(client, "request", "ev-3", _body(3)).status_code == 200
        r = _post(client, "response", "ev-3", resp)
        assert r.status_code == 200 and r.json()["joined"] is True
        assert svc.wait_idle(20)
        assert svc.monitor.compared_rows == 1  # kept (a real regression), not dropped
        assert _value(svc, "tailguard_monitor_dropped_total", reason="non_finite") == 0
        assert _value(svc, "tailguard_monitor_slice_parity", model=NAME, slice="all", metric="top1_agree") == 0.0
        # the pairs endpoint scores the same body the same way
        doc = {"request": _body(3), "response": json.loads(resp)}
        body = json.dumps(doc).replace("NaN", nan_json.decode()).encode()
        assert client.post(f"/v2/models/{NAME}/pairs", content=body).status_code == 200
        assert svc.wait_idle(20)
        assert svc.monitor.compared_rows == 2
        assert _value(svc, "tailguard_monitor_slice_parity", model=NAME, slice="all", metric="top1_agree") == 0.0


def test_logger_answers_at_once_when_shadow_overloaded(models):
    ref = GatedRunner(models["ref"])
    svc, client = _service(ref, None, reference_timeout_s=600.0, queue_size=2, shadow_batch_wait_ms=0)
    try:
        with client:
            for i in range(15):  # every answer comes back while the reference is blocked: none waited for it
                for half in ("request", "response"):
                    r = _post(client, half, f"ev-{i}", _body(i) if half == "request" else _response(i))
                    assert r.status_code == 200
            # at most queue_size waiting plus one micro-batch (what was queued when the worker took it: <= 3)
            assert _value(svc, "tailguard_monitor_dropped_total", reason="queue_full") >= 15 - 2 - 3
            assert svc.queue.qsize() <= 2 and svc.monitor.compared_rows == 0
    finally:
        ref.gate.set()  # a failed assertion must not leave the worker blocked (the test process would hang)
        svc.stop()


def test_join_buffer_replaces_and_counts_duplicate_half_when_same_id_and_type_arrive_twice():
    drops = []
    now = [0.0]
    buf = JoinBuffer(10, 1.0, on_drop=lambda reason, n: drops.append((reason, n)), clock=lambda: now[0])
    assert buf.add("a", "request", "req-1") is None
    assert buf.add("a", "request", "req-2") is None
    assert drops == [("unmatched", 1)] and len(buf) == 1
    assert buf.add("a", "response", "resp") == ("req-2", "resp")
    now[0] = 0.5
    assert buf.add("b", "response", "rb") is None
    now[0] = 1.6  # "b" is 1.1 s old: past the 1 s TTL
    assert buf.add("b", "request", "qb") is None
    assert drops[-1] == ("unmatched", 1) and len(buf) == 1 and buf.joined == 1


# ------------------------------------------------------------------------------------------- hardening
@pytest.mark.parametrize("half", ["request", "response"])
def test_logger_answers_400_too_deep_when_half_nested_deeply(models, half):
    svc, client = _service(models["ref"], None)
    deep = "[" * 200_000 + "]" * 200_000  # json.loads raised RecursionError: a 500
    body = {"request": GOOD_REQ[:-1] + f', "parameters": {{"a": {deep}}}}}'.encode(),
            "response": GOOD_RESP[:-1] + f', "parameters": {deep}}}'.encode()}[half]
    with client:
        r = _post(client, half, "ev-1", body)
        assert r.status_code == 400 and r.json()["reason"] == "too_deep"
        assert _value(svc, "tailguard_monitor_invalid_requests_total", reason="too_deep") == 1
        assert len(svc.join) == 0


@pytest.mark.parametrize("half", ["request", "response"])
def test_logger_answers_413_body_too_large_when_half_over_max_body_bytes(models, half):
    svc, client = _service(models["ref"], None, max_body_bytes=2048)
    pad = b', "pad": "' + b"a" * 4096 + b'"}'
    with client:
        r = _post(client, half, "ev-1", (GOOD_REQ if half == "request" else GOOD_RESP)[:-1] + pad)
        assert r.status_code == 413 and r.json()["reason"] == "body_too_large"
        assert _value(svc, "tailguard_monitor_invalid_requests_total", reason="body_too_large") == 1
        assert _post(client, half, "ev-2", GOOD_REQ if half == "request" else GOOD_RESP).status_code == 200


def test_logger_answers_422_non_finite_input_when_request_half_has_nan(models):
    svc, client = _service(models["ref"], None)
    with client:
        body = json.dumps(_body(1)).replace(str(_body(1)["inputs"][0]["data"][0]), "NaN").encode()
        r = _post(client, "request", "ev-1", body)
        assert r.status_code == 422 and r.json()["reason"] == "non_finite_input"
        assert len(svc.join) == 0


def test_logger_answers_200_with_encodable_id_when_request_id_has_lone_surrogate(models):
    svc, client = _service(models["ref"], None)
    with client:
        body = GOOD_REQ.replace(b'"id": "r0"', b'"id": "r\\ud800"')
        assert b"ud800" in body
        assert _post(client, "request", "ev-1", body).status_code == 200
        r = _post(client, "response", "ev-1", GOOD_RESP)
        assert r.status_code == 200 and r.json()["joined"] is True and r.json()["id"] == "r?"
