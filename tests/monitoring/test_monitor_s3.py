"""Sampled pairs to S3: a real moto S3 server on 127.0.0.1 and real boto3 over HTTP. "S3 down" is a port where
nothing listens (connection refused); "S3 back" is a moto server started on that very port."""

import io
import time

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
from fastapi.testclient import TestClient

from tailguard.core.spec import parse_spec
from tailguard.core.spec.monitor import MonitorS3Spec
from tailguard.monitoring import testing as T
from tailguard.monitoring.app import build_app
from tailguard.monitoring.config import resolve_config
from tailguard.monitoring.oip import request_json
from tailguard.monitoring.service import MonitorService
from tailguard.monitoring.sink import REDACTED, PairSink
from tests.helpers.mlflow_server import bound_socket

pytestmark = pytest.mark.integration
BUCKET = "tg-pairs"


@pytest.fixture(autouse=True)
def aws_env(monkeypatch):
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION":
                 "us-east-1", "AWS_SESSION_TOKEN": "testing"}.items():
        monkeypatch.setenv(k, v)


@pytest.fixture
def s3_down():
    """A port where S3 is down: bound by a socket that does not listen, so connections to it are refused and no
    other socket (a server, or a client's outgoing connection taking its local port) can take it meanwhile."""
    holder = bound_socket()
    yield holder
    holder.close()


def _moto(port=0):
    """moto's S3 server on 127.0.0.1 (`port` 0: one the kernel chooses; `server.get_host_and_port()`)."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    return server


def _stop(server):
    server.stop()
    server._server.server_close()  # ThreadedMotoServer.stop leaves the listening socket open


@pytest.fixture
def s3_up():
    server = _moto()
    port = server.get_host_and_port()[1]
    import boto3

    client = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", region_name="us-east-1")
    client.create_bucket(Bucket=BUCKET)
    yield port, client
    _stop(server)


def _records(n, start=0):
    rng = np.random.default_rng(start)
    return [{"request_id": f"r{i}", "row": 0, "request_index": i, "weight": 10.0, "slices": ["all", "domain=web"],
             "meta": {"domain": "web", "user": f"alice{i}"}, "inputs": {"x": rng.normal(size=4).astype(np.float32)},
             "reference": rng.normal(size=3), "candidate": rng.normal(size=3),
             "metrics": {"top1_agree": 1.0, "kl_divergence": 0.01}} for i in range(start, start + n)]


def _objects(client, bucket=BUCKET):
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents", [])]
    frames = [pd.read_parquet(io.BytesIO(client.get_object(Bucket=bucket, Key=k)["Body"].read())) for k in keys]
    return keys, (pd.concat(frames, ignore_index=True) if frames else pd.DataFrame())


def _sink(port, tmp_path, bucket=BUCKET, **kw):
    s3 = MonitorS3Spec(bucket=bucket, prefix="pairs", endpoint_url=f"http://127.0.0.1:{port}", batch_rows=5,
                       retry_interval_s=3600)
    # the slice rules read `domain` and `user`: the parameters the sink writes (sink_parameters)
    args = dict(redact_fields=["user", "x"], model="tiny-clf", slice_rules=[("domain", "domain"), ("u", "user")])
    args.update(kw)
    spool_max = args.pop("spool_max_bytes", 10 * 2**20)
    return PairSink(s3, tmp_path / "spool", spool_max, **args)


def test_sink_writes_redacted_parquet_batches_when_s3_up(s3_up, tmp_path):
    port, client = s3_up
    sink = _sink(port, tmp_path).start()
    for r in _records(12):
        assert sink.submit(r)
    sink.close()
    keys, df = _objects(client)
    assert len(keys) == 3 and len(df) == 12
    assert all(k.startswith("pairs/tiny-clf/") and k.endswith(".parquet") for k in keys)
    assert (df["user"] == REDACTED).all() and df["x"].isna().all()
    assert (df["domain"] == "web").all() and (df["_tg_weight"] == 10.0).all()
    assert len(df["_tg_reference"][0]) == 3
    assert sink.metrics.registry.get_sample_value("tailguard_monitor_s3_uploads_total", {"status": "ok"}) == 3


def test_sink_spools_and_later_uploads_everything_when_s3_down_then_back(s3_down, tmp_path):
    port = s3_down.getsockname()[1]  # nothing listens: S3 is down
    bucket = "tg-spool-back"  # moto keeps buckets per process: a bucket of its own
    sink = _sink(port, tmp_path, bucket)
    for r in _records(12):
        sink.submit(r)
    sink._drain()
    sink.tick()
    sink.flush()
    get = sink.metrics.registry.get_sample_value
    assert get("tailguard_monitor_s3_uploads_total", {"status": "spooled"}) == 3
    assert len(sink.spooled()) == 3 and get("tailguard_monitor_spool_bytes") > 0
    assert sink.retry_spool() == 0 and len(sink.spooled()) == 3  # still down: kept
    s3_down.close()
    server = _moto(port)  # S3 is back on the same endpoint
    try:
        import boto3

        client = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", region_name="us-east-1")
        client.create_bucket(Bucket=bucket)
        assert sink.retry_spool() == 3
        keys, df = _objects(client, bucket)
        assert len(keys) == 3 and sorted(df["_tg_request_id"]) == sorted(f"r{i}" for i in range(12))
        assert get("tailguard_monitor_s3_uploads_total", {"status": "retried_ok"}) == 3
        assert sink.spooled() == [] and get("tailguard_monitor_spool_bytes") == 0
    finally:
        _stop(server)


def test_sink_drops_and_counts_batches_when_spool_bound_reached(s3_down, tmp_path):
    sink = _sink(s3_down.getsockname()[1], tmp_path, spool_max_bytes=1024)  # smaller than one Parquet batch
    for r in _records(10):
        sink.submit(r)
    sink._drain()
    sink.flush()
    get = sink.metrics.registry.get_sample_value
    assert get("tailguard_monitor_s3_uploads_total", {"status": "dropped"}) == 1
    assert sink.spooled() == [] and sink.spool_bytes() == 0


def test_live_responses_unaffected_and_pairs_spooled_when_s3_down(s3_down, tmp_path):
    d = tmp_path
    ref, cand = T.linear_classifier(d / "ref.onnx"), T.linear_classifier(d / "cand.onnx", T.weights(noise=0.02))
    mon = {"sample_rate": 1.0, "seed": 0, "spool_dir": str(d / "spool"), "redact_fields": ["x"],
           "s3": {"bucket": BUCKET, "endpoint_url": f"http://127.0.0.1:{s3_down.getsockname()[1]}",
                  "batch_rows": 4}}
    svc = MonitorService(resolve_config(parse_spec(T.spec_dict(mon))), ref, cand)
    deadline = time.monotonic() + 20
    while not svc.readiness()[0] and time.monotonic() < deadline:
        time.sleep(0.02)
    with TestClient(build_app(svc)) as client:
        for i in range(10):
            body = request_json({"x": np.ones((1, 4), np.float32) * i}, {"domain": "web"})
            assert client.post("/v2/models/tiny-clf/infer", json=body).status_code == 200
        assert svc.wait_idle(20)
    # leaving the client stops the service and flushes the partial batch: 4 + 4 + 2 rows, all spooled
    rows = sum(len(pd.read_parquet(p)) for p in svc.sink.spooled())
    assert rows == 10
    assert svc.metrics.registry.get_sample_value("tailguard_monitor_s3_uploads_total", {"status": "spooled"}) == 3


# ------------------------------------------------------------------------------------------- hardening
def _wait(pred, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


@pytest.fixture
def s3_bucket(s3_up):
    """A bucket of its own on the moto server (moto keeps buckets per process, across servers)."""
    import uuid

    port, client = s3_up
    bucket = f"tg-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=bucket)
    return port, client, bucket


def _dropped(metrics, reason):
    return metrics.registry.get_sample_value("tailguard_monitor_dropped_total", {"reason": reason})


def test_sink_writer_survives_and_counts_sink_error_when_row_cannot_be_converted(s3_bucket, tmp_path):
    port, client, bucket = s3_bucket
    sink = _sink(port, tmp_path, bucket, redact_fields=[]).start()
    records = _records(10)
    records[2]["inputs"] = {"x": np.array([object(), 1], dtype=object)}  # Parquet cannot hold it
    for r in records[:5]:
        assert sink.submit(r)
    assert _wait(lambda: len(_objects(client, bucket)[0]) == 1)  # the batch, less its bad row
    for r in records[5:]:
        assert sink.submit(r)
    assert _wait(lambda: len(_objects(client, bucket)[0]) == 2)  # the writer thread is still alive and writing
    assert sink._thread.is_alive()
    sink.close()
    _, df = _objects(client, bucket)
    assert sorted(df["_tg_request_id"]) == sorted(f"r{i}" for i in range(10) if i != 2)
    assert _dropped(sink.metrics, "sink_error") == 1


def test_sink_counts_sink_full_when_writer_queue_full(s3_down, tmp_path):
    sink = _sink(s3_down.getsockname()[1], tmp_path, max_pending=2)  # not started: nothing drains the queue
    assert [sink.submit(r) for r in _records(5)] == [True, True, False, False, False]
    assert _dropped(sink.metrics, "sink_full") == 3


def test_sink_redacts_slice_keys_when_redacted_field_is_slice_column(s3_bucket, tmp_path):
    port, client, bucket = s3_bucket
    recs = _records(5)
    for r in recs:
        r["slices"] = ["all", "domain=web", f"u={r['meta']['user']}", f"domain=web&u={r['meta']['user']}"]
    # with the layout (as the service passes it): the rule `u` reads the redacted column `user`
    sink = _sink(port, tmp_path, bucket, slice_rules=[("domain", "domain"), ("u", "user")], slice_pairs=[(0, 1)])
    sink.start()
    for r in recs:
        assert sink.submit(r)
    sink.close()
    _, df = _objects(client, bucket)
    assert [list(s) for s in df["_tg_slices"]] == [["all", "domain=web", "u=<redacted>",
                                                    "domain=web&u=<redacted>"]] * 5
    assert "alice" not in df.to_json()
    # without a layout, keys named like a redacted field are redacted too
    sink = _sink(port, tmp_path / "b", bucket, redact_fields=["domain"], slice_rules=())
    row = sink.pending.get_nowait() if sink.submit(recs[0]) else None
    assert list(row["_tg_slices"]) == ["all", "domain=<redacted>", "u=alice0", "domain=<redacted>"]


def _serve_to_s3(tmp_path, port, bucket, mon, bodies, slices=None):
    d = tmp_path
    ref = T.linear_classifier(d / "ref.onnx")
    mon = {"sample_rate": 1.0, "seed": 0, "spool_dir": str(d / "spool"),
           "s3": {"bucket": bucket, "endpoint_url": f"http://127.0.0.1:{port}", "batch_rows": 4}, **mon}
    svc = MonitorService(resolve_config(parse_spec(T.spec_dict(mon, slices=slices))), ref, ref)
    assert _wait(lambda: svc.readiness()[0])
    with TestClient(build_app(svc)) as client:
        for body in bodies:
            r = client.post("/v2/models/tiny-clf/infer", content=body)
            assert r.status_code == 200, r.text
        assert svc.wait_idle(20)
    return svc  # leaving the client stopped the service and flushed the sink


def test_sink_keeps_input_column_when_request_parameter_named_like_input(s3_bucket, tmp_path):
    port, client, bucket = s3_bucket
    import json

    bodies = [json.dumps(request_json({"x": np.full((1, 4), i, np.float32)},
                                      {"domain": "web", **({"x": "evil", "_tg_weight": "w"} if i % 2 else {})},
                                      request_id=f"r{i}")).encode() for i in range(8)]
    svc = _serve_to_s3(tmp_path, port, bucket, {}, bodies)
    _, df = _objects(client, bucket)
    assert len(df) == 8 and svc.sink.spooled() == []
    assert [list(v) for v in df.sort_values("_tg_request_index")["x"]] == [[float(i)] * 4 for i in range(8)]
    assert (df["_tg_weight"] == 1.0).all()
    metas = [json.loads(m) for m in df.sort_values("_tg_request_index")["_tg_meta"]]
    assert metas == [{"domain": "web"}] * 8  # x and _tg_weight are no slice column: not written at all
    assert _params_dropped(svc.metrics) == 2 * 4
    assert _dropped(svc.metrics, "sink_error") == 0


def _params_dropped(metrics):
    return metrics.registry.get_sample_value("tailguard_monitor_sink_parameters_dropped_total")


def test_sink_writes_only_slice_column_parameters_and_counts_the_rest_when_requests_carry_many_names(s3_bucket,
                                                                                                     tmp_path):
    port, client, bucket = s3_bucket
    import json

    # 127 caller-chosen parameter names per request beside `domain` (ingest takes at most 128), new ones each
    # time: each would be a Parquet column
    bodies = [json.dumps(request_json({"x": np.full((1, 4), i, np.float32)},
                                      {"domain": "web", **{f"p{i}_{j}": "v" for j in range(127)}},
                                      request_id=f"r{i}")).encode() for i in range(8)]
    svc = _serve_to_s3(tmp_path, port, bucket, {}, bodies)
    keys, df = _objects(client, bucket)
    assert len(df) == 8 and svc.sink.spooled() == []
    params = [c for c in df.columns if c not in ("x", "domain") and not c.startswith("_tg_")]
    assert params == [] and (df["domain"] == "web").all()
    assert all(json.loads(m) == {"domain": "web"} for m in df["_tg_meta"])
    for k in keys:  # every object's schema: the input, the slice column and the monitor's own columns
        schema = pq.read_schema(io.BytesIO(client.get_object(Bucket=bucket, Key=k)["Body"].read()))
        assert len(schema.names) < 20, schema.names
    assert _params_dropped(svc.metrics) == 8 * 127
    assert "tailguard_monitor_sink_parameters_dropped_total 1016.0" in svc.metrics.exposition().decode()


def test_sink_writes_every_row_when_parameters_have_lone_surrogates(s3_bucket, tmp_path):
    port, client, bucket = s3_bucket
    body = ('{"id": "r\\ud800", "inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}],'
            ' "parameters": {"domain": "a\\udfff", "\\udc00k": "v\\ud800"}}').encode()
    svc = _serve_to_s3(tmp_path, port, bucket, {}, [body] * 3)
    _, df = _objects(client, bucket)
    assert len(df) == 3 and (df["domain"] == "a?").all() and "?k" not in df.columns  # no slice reads it
    assert (df["_tg_request_id"] == "r?").all()
    # the row's own keys: the default `predicted` (the reference's top-1) beside the request's `domain`
    assert [list(s)[:2] for s in df["_tg_slices"]] == [["all", "domain=a?"]] * 3
    assert all(len(s) == 3 and s[2].startswith("predicted=") for s in df["_tg_slices"])
    assert svc.sink.spooled() == []


def test_sink_writes_slice_key_redacted_when_redacted_field_is_slice_column(s3_bucket, tmp_path):
    port, client, bucket = s3_bucket
    import json

    slices = [{"name": "dom", "column": "domain", "values": ["legal", "web"]}, {"name": "tier", "column": "tier"}]
    bodies = [json.dumps(request_json({"x": np.ones((1, 4), np.float32)}, {"domain": "legal", "tier": "gold"}))
              .encode() for _ in range(3)]
    mon = {"redact_fields": ["domain"], "slice_pairs": True, "slice_columns": ["dom", "tier"]}  # no `predicted`
    svc = _serve_to_s3(tmp_path, port, bucket, mon, bodies, slices=slices)
    _, df = _objects(client, bucket)
    assert len(df) == 3
    assert [list(s) for s in df["_tg_slices"]] == [["all", "dom=<redacted>", "tier=gold",
                                                    "dom=<redacted>&tier=gold"]] * 3
    assert (df["domain"] == REDACTED).all() and "legal" not in df.to_json()
    assert "legal" not in str(svc.slices()) and "legal" not in svc.metrics.exposition().decode()


def test_sink_writes_each_rows_own_slice_keys_when_slices_are_derived_per_row(s3_bucket, tmp_path):
    """A 6-row request with the default `predicted` slice (the reference's top-1, per row) and a request-level
    `domain`: each Parquet row lists its own class's key, laid out as slice_keys lays them out (all, one per rule),
    not every class some row of its request has."""
    port, client, bucket = s3_bucket
    import json

    import onnxruntime as ort

    rng = np.random.default_rng(3)
    xs = [rng.normal(size=(6, T.N_FEATURES)).astype(np.float32) * 3 for _ in range(4)]
    bodies = [json.dumps(request_json({"x": x}, {"domain": "web"}, request_id=f"r{i}")).encode()
              for i, x in enumerate(xs)]
    svc = _serve_to_s3(tmp_path, port, bucket, {"max_request_rows": 8}, bodies)
    _, df = _objects(client, bucket)
    assert len(df) == 24 and svc.sink.spooled() == []
    sess = ort.InferenceSession(str(tmp_path / "ref.onnx"))
    want = {(f"r{i}", r): ["all", "domain=web", f"predicted={c}"]
            for i, x in enumerate(xs) for r, c in enumerate(sess.run(None, {"x": x})[0].argmax(axis=1))}
    assert len({v[2] for v in want.values()}) > 1  # the requests mix classes: a request-level key list would differ
    got = {(rid, int(row)): list(s) for rid, row, s in zip(df["_tg_request_id"], df["_tg_row"], df["_tg_slices"])}
    assert got == want
