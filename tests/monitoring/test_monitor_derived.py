"""Derived and header slices in the live monitor (issue 35): batched 16-row requests that carry no parameters,
sent by the real clients of the KServe v2 / Triton ecosystem (tritonclient.http in JSON and binary mode, in a
subprocess because it runs on gevent; tritonclient.grpc in this process) to a running monitor (uvicorn + the gRPC
ingest on one MonitorService, real tiny ONNX models from tests/helpers/derive_models.py).

A drift planted in the rows of one reference class, or of one bin of an input-derived value, is alerted on that
slice only; header slices read HTTP headers and gRPC metadata.
"""

import contextlib
import json
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest

tritonclient_grpc = pytest.importorskip("tritonclient.grpc")
pytest.importorskip("tritonclient.http")

from tailguard.core.spec import parse_spec  # noqa: E402
from tailguard.monitoring import testing as T  # noqa: E402
from tailguard.monitoring.app import build_app  # noqa: E402
from tailguard.monitoring.config import resolve_config  # noqa: E402
from tailguard.monitoring.service import MonitorService  # noqa: E402
from tests.helpers import derive_models as D  # noqa: E402
from tests.helpers.mlflow_server import uvicorn_in_thread  # noqa: E402

NAME = "tiny-clf"
BATCH = 16
# Monitoring settings of these tests: every request compared, the default threshold lowered to 0.8 so the rare
# slice's drift (9% of the rows for class 2, 4% for the ink bin) leaves `all` and the other slices above it, and a
# short horizon so the alarm threshold h is reached within a few hundred requests.
MON = {"sample_rate": 1.0, "seed": 0, "max_request_rows": BATCH, "horizon": 1000, "alpha": 0.05, "min_support": 10,
       "thresholds": {"top1_agree": {"min": 0.8}}}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("derived")
    return {"ref": D.reference_model(d / "ref.onnx"), "class": D.candidate_model(d / "class.onnx", "class"),
            "bin": D.candidate_model(d / "bin.onnx", "bin")}


@contextlib.contextmanager
def live(reference, candidate, *, slices, **mon):
    """A MonitorService served over HTTP (uvicorn, 127.0.0.1) and gRPC until the block ends: (svc, url, addr)."""
    from tailguard.monitoring.grpc_ingest import start_grpc

    cfg = resolve_config(parse_spec(T.spec_dict({**MON, **mon}, slices=slices)))
    svc = MonitorService(cfg, reference, candidate)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (svc.readiness()[0] or svc.load_errors):
        time.sleep(0.02)
    server, gport = start_grpc(svc, "127.0.0.1", 0)
    try:
        with uvicorn_in_thread(build_app(svc)) as url:
            yield svc, url, f"127.0.0.1:{gport}"
    finally:
        server.stop(None)
        svc.stop()


# tritonclient.http (gevent) in a subprocess: n requests of `batch` rows, request i holding rows seeded i (as
# derive_models.features), no parameters; header `tenant` on request i when tenants[i] is not "".
CLIENT = """
import json, sys
import numpy as np
import tritonclient.http as th
url, mode, n, batch, tenants = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), json.loads(sys.argv[5])
client = th.InferenceServerClient(url, connection_timeout=120, network_timeout=120)
sampled = 0
for i in range(n):
    x = np.random.default_rng(i).normal(size=(batch, 4)).astype(np.float32)
    if tenants and tenants[i] == "b":
        x[:, 0] = np.abs(x[:, 0]) + 1.8
    inp = th.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=(mode == "binary"))
    headers = {"X-Tenant": tenants[i]} if tenants and tenants[i] else None
    r = client.infer("tiny-clf", [inp], request_id=f"r{i}", headers=headers)
    sampled += bool(r.get_response()["parameters"]["tailguard.sampled"])
print(json.dumps(sampled))
"""


def rows(i, tenants=None):
    """Request i's rows, as the clients send them (tenant `b`'s rows all in the ink bin >= 1.8)."""
    x = D.features(i, BATCH)
    if tenants and tenants[i] == "b":
        x[:, 0] = np.abs(x[:, 0]) + D.INK_EDGE
    return x


def send(mode, url, addr, n, tenants=None):
    """n requests of BATCH rows with no parameters over `mode` (json, binary: tritonclient.http; grpc:
    tritonclient.grpc), tenant i as the X-Tenant header / gRPC metadata when given."""
    tenants = tenants or []
    if mode == "grpc":
        client = tritonclient_grpc.InferenceServerClient(addr)
        for i in range(n):
            x = rows(i, tenants)
            inp = tritonclient_grpc.InferInput("x", list(x.shape), "FP32")
            inp.set_data_from_numpy(x)
            headers = {"x-tenant": tenants[i]} if tenants and tenants[i] else None
            client.infer(NAME, [inp], request_id=f"r{i}", headers=headers, client_timeout=120)
        client.close()
        return
    out = subprocess.run([sys.executable, "-c", CLIENT, url.removeprefix("http://"), mode, str(n), str(BATCH),
                          json.dumps(tenants)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == n


def alerted(svc):
    return sorted({a["slice"] for a in svc.alerts()})


@pytest.mark.parametrize("mode", ["json", "binary", "grpc"])
def test_monitor_alerts_on_reference_class_only_when_bare_batched_requests_drift_in_that_class(models, mode):
    # no slice declared, no slice_columns: the monitor tracks `predicted` (the reference's top-1) by default
    with live(models["ref"], models["class"], slices=[]) as (svc, url, addr):
        send(mode, url, addr, 300)
        assert svc.wait_idle(120)
        assert svc.monitor.compared_rows == 300 * BATCH
        doc = httpx.get(f"{url}/v1/slices", timeout=30).json()
        assert {"all", "predicted=0", "predicted=1", "predicted=2"} <= set(doc["slices"])
        assert doc["keys_per_request"] == 1 + 4  # all + min(1024 rows, 3 classes + null)
        assert alerted(svc) == ["predicted=2"]
        # each (request, class group) with >= 1 row is one update of that group's statistics, with its rows only
        ref = np.concatenate([D.reference_logits(D.features(i, BATCH)) for i in range(300)]).argmax(1)
        per_request = ref.reshape(300, BATCH)
        for c in range(3):
            s = doc["slices"][f"predicted={c}"]
            assert s["samples_total"] == int((ref == c).sum())
            assert s["sampled_requests"] == int((per_request == c).any(axis=1).sum())
        assert doc["slices"]["all"]["sampled_requests"] == 300


@pytest.mark.parametrize("mode", ["json", "binary", "grpc"])
def test_monitor_alerts_on_input_derived_bin_only_when_bare_batched_requests_drift_in_that_bin(models, mode):
    with live(models["ref"], models["bin"], slices=[D.INK_SLICE]) as (svc, url, addr):
        send(mode, url, addr, 400)
        assert svc.wait_idle(120)
        doc = httpx.get(f"{url}/v1/slices", timeout=30).json()
        assert {"ink=[-10,1.8)", "ink=[1.8,10)"} <= set(doc["slices"])
        assert alerted(svc) == ["ink=[1.8,10)"]


@pytest.mark.parametrize("mode", ["json", "grpc"])
def test_monitor_alerts_on_header_slice_only_when_one_tenant_drifts_over_http_and_grpc(models, mode):
    # tenant b (1 request in 10) sends rows the bin candidate gets wrong; tenant a's rows stay below the edge
    n = 400
    tenants = ["b" if i % 10 == 0 else "a" for i in range(n)]
    with live(models["ref"], models["bin"], slices=[{"name": "tenant", "header": "X-Tenant"}],
              slice_columns=["tenant"]) as (svc, url, addr):
        send(mode, url, addr, n, tenants)
        assert svc.wait_idle(120)
        doc = httpx.get(f"{url}/v1/slices", timeout=30).json()
        assert set(doc["slices"]) == {"all", "tenant=a", "tenant=b"}
        assert doc["slices"]["tenant=b"]["requests_seen"] == n // 10
        assert alerted(svc) == ["tenant=b"]


def test_monitor_reads_topic_centroids_from_candidate_version_run_when_no_file_given(models, tmp_path):
    import mlflow

    from tailguard.core.contract import RUN_ID_TAG
    from tailguard.core.derive import CENTROIDS_FILE, save_centroids
    from tailguard.monitoring.service import create_service

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.MlflowClient(tracking_uri=uri, registry_uri=uri)
    exp = client.create_experiment("t", artifact_location=(tmp_path / "artifacts").as_uri())
    run = client.create_run(exp)
    centroids = {"topic": np.eye(3, dtype=np.float32)}
    save_centroids(str(tmp_path / CENTROIDS_FILE), centroids)
    client.log_artifact(run.info.run_id, str(tmp_path / CENTROIDS_FILE))
    client.create_registered_model("cand")
    mv = client.create_model_version("cand", source=f"runs:/{run.info.run_id}/model", run_id=run.info.run_id,
                                     tags={RUN_ID_TAG: run.info.run_id})
    client.set_registered_model_alias("cand", "production", mv.version)
    doc = T.spec_dict({"sample_rate": 1.0, "seed": 0}, slices=[])
    doc["model"]["task"] = "embedding"
    doc["gates"] = [{"metric": "nn_top1_agreement", "min": 0.9}]
    spec = parse_spec(doc)
    with_topic = create_service(spec, models["ref"], models["ref"], start=False, candidate_version="cand@production",
                                tracking_uri=uri)
    assert [r.name for r in with_topic.cfg.rules] == ["topic"]
    assert np.array_equal(with_topic.cfg.centroids["topic"], centroids["topic"])
    without = create_service(spec, models["ref"], models["ref"], start=False)  # no version, no file: no topic
    assert without.cfg.rules == []
    keys, _ = with_topic.monitor.admit({}, {"x": D.features(0, 4)})
    assert list(keys) == ["all"] and keys.labels == [None]  # labelled once the reference ran
    labels = with_topic.cfg.output_labels(with_topic.cfg.rules[0], np.array([[0.1, 2.0, 0.0], [3.0, 0.2, -1.0]]))
    assert labels == ["1", "0"]


def test_logger_event_feeds_header_slice_when_kserve_forwards_the_header_in_ce_metadata(models):
    """KServe's logger forwards the headers listed in logger.metadataHeaders as ce-metadata {"X-Tenant": ["b"]}."""
    from tailguard.monitoring.join import CE_REQUEST, CE_RESPONSE

    x = rows(0)
    request = {"id": "r0", "inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32",
                                        "data": x.ravel().tolist()}]}
    response = {"model_name": NAME, "outputs": [{"name": "logits", "shape": [BATCH, 3], "datatype": "FP32",
                                                 "data": D.reference_logits(x).ravel().tolist()}]}
    with live(models["ref"], None, slices=[{"name": "tenant", "header": "X-Tenant"}]) as (svc, url, _):
        with httpx.Client(base_url=url, timeout=30) as http:
            for i, tenant in enumerate(("b", None)):
                ce = {"ce-id": f"ev-{i}", "ce-source": "http://localhost:9081/", "ce-specversion": "1.0",
                      "content-type": "application/json"}
                if tenant:
                    ce["ce-metadata"] = json.dumps({"X-Tenant": [tenant], "Content-Type": ["application/json"]})
                for ce_type, doc in ((CE_REQUEST, request), (CE_RESPONSE, response)):
                    r = http.post(f"/v2/models/{NAME}/logger", content=json.dumps(doc).encode(),
                                  headers={**ce, "ce-type": ce_type})
                    assert r.status_code == 200, r.text
        assert svc.wait_idle(60)
        doc = svc.slices()
        assert doc["slices"]["tenant=b"]["sampled_requests"] == 1
        assert doc["slices"]["tenant=missing"]["sampled_requests"] == 1
        assert doc["slices"]["predicted=0"]["samples_total"] > 0  # the default slice, from the reference output
