"""What the monitor measures vs what it exports, over real HTTP (Starlette's TestClient, real ONNX models):
every slice in /v1/slices (paged), a bounded label set in /metrics, slice values made exportable."""

import time

import numpy as np
import pytest
from fastapi.testclient import TestClient

from tailguard.core.spec import parse_spec
from tailguard.monitoring import testing as T
from tailguard.monitoring.app import build_app
from tailguard.monitoring.config import resolve_config
from tailguard.monitoring.oip import request_json
from tailguard.monitoring.service import MonitorService

NAME = "tiny-clf"


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    return T.linear_classifier(tmp_path_factory.mktemp("slices") / "ref.onnx")


def _service(ref, **mon):
    cfg = resolve_config(parse_spec(T.spec_dict({"sample_rate": 1.0, "seed": 0, **mon})))
    svc = MonitorService(cfg, ref, ref)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not svc.readiness()[0]:
        time.sleep(0.02)
    return svc, TestClient(build_app(svc))


def _body(i, domain):
    x = np.random.default_rng(i).normal(size=(1, 4)).astype(np.float32)
    return request_json({"x": x}, {"domain": domain}, request_id=f"r{i}")


def test_metrics_and_slices_stay_200_when_slice_value_is_lone_surrogate(ref):
    svc, client = _service(ref)
    with client:
        raw = ('{"id": "a", "inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}], '
               '"parameters": {"domain": "\\ud800"}}').encode()
        assert client.post(f"/v2/models/{NAME}/infer", content=raw).status_code == 200
        assert svc.wait_idle(20)
        assert client.get("/metrics").status_code == 200
        r = client.get("/v1/slices")
        assert r.status_code == 200 and "domain=?" in r.json()["slices"]
        assert svc.metrics.registry.get_sample_value("tailguard_monitor_slice_values_cut_total",
                                                     {"model": NAME}) == 1


def test_metrics_stay_small_when_slice_values_are_one_megabyte(ref):
    svc, client = _service(ref)
    with client:
        for i in range(20):
            assert client.post(f"/v2/models/{NAME}/infer", json=_body(i, f"{i}" + "x" * 2**20)).status_code == 200
        assert svc.wait_idle(30)
        assert len(client.get("/metrics").content) < 64 * 1024
        assert all(len(k) <= 64 + len("domain=") for k in client.get("/v1/slices").json()["slices"])


def test_metrics_export_bounded_labels_and_slices_pages_every_slice_when_many_slices_seen(ref):
    svc, client = _service(ref, max_slices=3, slice_columns=["domain"])  # no default `predicted`: 40 + all
    with client:
        for i in range(40):
            assert client.post(f"/v2/models/{NAME}/infer", json=_body(i, f"d{i}")).status_code == 200
        assert svc.wait_idle(30)
        text = client.get("/metrics").text
        series = [ln for ln in text.splitlines() if ln.startswith("tailguard_monitor_slice_samples{")]
        assert len(series) == 1 + 3  # all + the 3 with the most evidence (none alerting)
        assert 'tailguard_monitor_slices_tracked{model="tiny-clf"} 41.0' in text
        seen, offset = [], 0
        while offset is not None:
            page = client.get("/v1/slices", params={"offset": offset, "limit": 15}).json()
            seen += list(page["slices"])
            offset = page["next_offset"]
        assert len(seen) == len(set(seen)) == 41 and page["slices_total"] == 41
        assert client.get("/v1/slices", params={"limit": 0}).status_code == 422
