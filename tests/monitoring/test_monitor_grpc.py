"""The Open Inference Protocol over gRPC (monitoring/grpc_ingest.py): the real client of the KServe v2 / Triton
ecosystem (tritonclient.grpc, raw_input_contents) and the protocol's own stub (service_pb2_grpc, typed contents
and bodies that lie) against a running monitor: uvicorn + the gRPC server on one MonitorService in this process,
and `tailguard monitor serve --grpc-port` as a subprocess."""

import time

import grpc
import httpx
import numpy as np
import pytest
import yaml

tritonclient_grpc = pytest.importorskip("tritonclient.grpc")
from tritonclient.grpc import service_pb2 as pb  # noqa: E402
from tritonclient.grpc import service_pb2_grpc as pb_grpc  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from tailguard.monitoring import testing as T  # noqa: E402
from tests.helpers.monitor_process import MonitorProcess  # noqa: E402
from tests.monitoring.test_monitor_binary import (  # noqa: E402
    BATCH,
    NAME,
    N,
    assert_all_compared,
    domain,
    features,
    live_monitor,
    value,
)

LIMIT = 65536  # monitoring.max_body_bytes in these tests


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("grpc")
    return {"ref": T.linear_classifier(d / "ref.onnx"),
            "cand": T.linear_classifier(d / "cand.onnx", T.weights(noise=0.02))}


def _infer(client, i, x=None, model=NAME):
    x = features(i) if x is None else x
    inp = tritonclient_grpc.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return client.infer(model, [inp], request_id=f"r{i}", parameters={"domain": domain(i)}, client_timeout=120)


def test_monitor_compares_every_request_when_tritonclient_grpc_sends_them(models):
    with live_monitor(models["ref"], models["cand"], grpc=True) as (svc, _, addr):
        client = tritonclient_grpc.InferenceServerClient(addr)
        assert client.is_server_live() and client.is_server_ready() and client.is_model_ready(NAME)
        assert not client.is_model_ready("other")
        meta = client.get_model_metadata(NAME, as_json=True)
        assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": ["-1", "4"]}]
        for i in range(N):
            r = _infer(client, i)
            assert r.get_response().id == f"r{i}"
            assert r.get_response().parameters["tailguard.sampled"].bool_param is True
        assert_all_compared(svc, "grpc")
        assert value(svc, "tailguard_monitor_ingest_seconds_count", endpoint="grpc") == N


def _stub_request(i, *, typed=False, raw=None, datatype="FP32", shape=None):
    """A ModelInferRequest built with the protocol's own message classes (typed contents or raw bytes)."""
    x = features(i)
    t = pb.ModelInferRequest.InferInputTensor(name="x", datatype=datatype, shape=shape or list(x.shape))
    req = pb.ModelInferRequest(model_name=NAME, id=f"t{i}", inputs=[t])
    req.parameters["domain"].string_param = domain(i)
    req.parameters["tier"].int64_param = 3
    if typed:  # the request holds a copy of t
        req.inputs[0].contents.fp32_contents.extend(x.ravel().tolist())
    else:
        req.raw_input_contents.append(x.tobytes() if raw is None else raw)
    return req


def test_model_infer_reads_typed_contents_and_parameters_when_client_sends_no_raw_bytes(models):
    with live_monitor(models["ref"], models["cand"], grpc=True) as (svc, _, addr):
        with grpc.insecure_channel(addr) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            for i in range(6):
                answer = stub.ModelInfer(_stub_request(i, typed=True))
                assert answer.id == f"t{i}" and answer.parameters["tailguard.sampled"].bool_param
        assert svc.wait_idle(60) and svc.monitor.compared_rows == 6 * BATCH
        assert value(svc, "tailguard_monitor_sampled_total", model=NAME, slice="domain=legal") == 2


def _code(call):
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code()
    except InferenceServerException as exc:
        return exc.status()
    return grpc.StatusCode.OK


def test_grpc_ingest_answers_status_code_counts_reason_and_stays_healthy_when_request_bad(models):
    with live_monitor(models["ref"], models["cand"], grpc=True, max_body_bytes=LIMIT) as (svc, _, addr):
        client = tritonclient_grpc.InferenceServerClient(addr)
        big = np.zeros((LIMIT // 16 + 64, 4), np.float32)  # > max_body_bytes on the wire
        assert "RESOURCE_EXHAUSTED" in str(_code(lambda: _infer(client, 0, big)))
        rows = np.zeros((1025, 4), np.float32)  # under the byte limit, over max_batch_rows
        assert "RESOURCE_EXHAUSTED" in str(_code(lambda: _infer(client, 0, rows)))
        assert "NOT_FOUND" in str(_code(lambda: _infer(client, 0, model="other")))
        with grpc.insecure_channel(addr) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            cases = {
                "binary_size_mismatch": _stub_request(1, raw=features(1).tobytes()[:-4]),
                "bad_datatype": _stub_request(1, raw=features(1).astype(np.float64).tobytes(), datatype="FP64"),
                "bad_shape": _stub_request(1, typed=True, shape=[3, 4]),
                "non_finite_input": _stub_request(1, raw=np.full((2, 4), np.nan, np.float32).tobytes()),
            }
            for reason, req in cases.items():
                with pytest.raises(grpc.RpcError) as err:
                    stub.ModelInfer(req)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and reason in err.value.details()
            # BYTES for the FP32 input, with a length prefix that lies: refused from its datatype, before the raw
            # contents are decoded (issue 36 item 10)
            bad_bytes = _stub_request(1, raw=(9).to_bytes(4, "little") + b"abc", datatype="BYTES", shape=[1, 1])
            with pytest.raises(grpc.RpcError) as err:
                stub.ModelInfer(bad_bytes)
            assert "bad_datatype" in err.value.details()
        # still serving, and a good request is compared
        assert client.is_server_live()
        _infer(client, 3)
        assert svc.wait_idle(60) and svc.monitor.compared_rows == BATCH
        # gRPC answers RESOURCE_EXHAUSTED to the client before the handler thread counts the refusal: wait for it
        deadline = time.monotonic() + 60
        while value(svc, "tailguard_monitor_invalid_requests_total", reason="body_too_large") < 1 and \
                time.monotonic() < deadline:
            time.sleep(0.01)
        for reason in ("body_too_large", "batch_too_large", "unknown_model", *cases):
            want = 2 if reason == "bad_datatype" else 1
            assert value(svc, "tailguard_monitor_invalid_requests_total", reason=reason) == want, reason
        assert value(svc, "tailguard_monitor_requests_total", model=NAME, endpoint="grpc") == 1


def test_server_ready_answers_false_not_error_when_reference_missing(models, tmp_path):
    with live_monitor(tmp_path / "absent.onnx", models["cand"], grpc=True) as (svc, _, addr):
        client = tritonclient_grpc.InferenceServerClient(addr)
        assert client.is_server_live()
        assert client.is_server_ready() is False and client.is_model_ready(NAME) is False
        _infer(client, 0)  # still accepted and counted, as over HTTP
        assert value(svc, "tailguard_monitor_dropped_total", reason="reference_missing") == 1


@pytest.mark.integration
def test_monitor_serve_accepts_grpc_beside_http_when_grpc_port_given(models, tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(T.spec_dict({"sample_rate": 1.0, "seed": 0})))
    proc = MonitorProcess(["--spec", str(spec), "--reference", str(models["ref"]), "--candidate",
                           str(models["cand"]), "--grpc-port", "0"], tmp_path / "serve.log")
    try:
        client = tritonclient_grpc.InferenceServerClient(f"127.0.0.1:{proc.grpc_port}")
        deadline = time.monotonic() + 90  # a bound on a hung process, not a timing assumption
        while time.monotonic() < deadline and proc.alive():
            try:
                if client.is_server_ready() and httpx.get(f"{proc.url}/readyz").status_code == 200:
                    break
            except (InferenceServerException, httpx.HTTPError):
                pass
            time.sleep(0.1)
        assert proc.alive(), proc.log()
        for i in range(5):
            _infer(client, i)
        text = ""
        while time.monotonic() < deadline and 'endpoint="grpc",model="tiny-clf"} 5.0' not in text:
            text = httpx.get(f"{proc.url}/metrics").text
            time.sleep(0.1)
        assert 'tailguard_monitor_requests_total{endpoint="grpc",model="tiny-clf"} 5.0' in text
    finally:
        proc.end()
