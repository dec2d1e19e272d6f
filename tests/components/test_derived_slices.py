"""Derived slices in the validate step and in the monitor (issue 35): the validate step computes them from the rows
it scores (no metadata column in the data), writes them to slices.csv, gates and MLflow metrics, fits and writes
the topic centroids; a live monitor fed the same rows in bare 16-row requests shows the same group labels with the
same rows in /v1/slices. Real parts: ONNX Runtime models, the validate step's logic, a MonitorService served by
uvicorn, httpx."""

import httpx
import numpy as np
import pandas as pd
import pytest

from tailguard.components.validate.logic import validate_variant
from tailguard.core.data import Dataset
from tailguard.core.derive import CENTROIDS_FILE, load_centroids
from tailguard.core.runtime import OrtRunner, run_dataset
from tailguard.core.spec import parse_spec
from tailguard.monitoring import testing as T
from tailguard.monitoring.app import build_app
from tailguard.monitoring.config import resolve_config
from tailguard.monitoring.service import MonitorService
from tests.helpers import derive_models as D
from tests.helpers.mlflow_server import uvicorn_in_thread

N = 320  # validation rows = 20 requests of 16 rows
SLICES = [D.INK_SLICE, {"name": "predicted", "derive": {"output": "reference", "reduce": "argmax"}}]


def _spec(task="classification", slices=SLICES, gates=None, monitoring=None):
    doc = T.spec_dict({"sample_rate": 1.0, "seed": 0, "min_support": 1, **(monitoring or {})}, slices=slices)
    doc["model"]["task"] = task
    doc["model"].pop("source")
    doc["gates"] = gates or []
    doc["benchmark"] = {"batch_sizes": [1], "warmup": 1, "iterations": 3}
    doc["promotion"] = {"enabled": False}
    doc["analysis"] = {"sequential": {"enabled": False}}  # every row scored: the monitor gets the same rows
    doc["data"]["validation"]["batch_size"] = 16
    return parse_spec(doc)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("derived_validate")
    x = np.concatenate([D.features(i) for i in range(N // 16)])
    ds = Dataset({"x": list(x)}, pd.DataFrame(index=range(N)), np.full(N, 4, dtype=np.int64), str(d / "v.parquet"))
    ref = D.reference_model(d / "ref.onnx")
    reference = run_dataset(OrtRunner(ref), ds, _spec().model.inputs, batch_size=16)
    return d, ds, x, ref, reference


def _monitor_groups(spec, ref, cand, x, centroids=None):
    """{(slice, value): rows} of a live monitor fed x in bare 16-row requests (JSON over HTTP)."""
    svc = MonitorService(resolve_config(spec, centroids=centroids), ref, cand)
    try:
        with uvicorn_in_thread(build_app(svc)) as url:
            with httpx.Client(base_url=url, timeout=60) as client:
                assert client.get("/readyz").status_code in (200, 503)
                for i in range(0, len(x), 16):
                    body = {"inputs": [{"name": "x", "shape": [16, 4], "datatype": "FP32",
                                        "data": x[i:i + 16].ravel().tolist()}]}
                    assert client.post("/v2/models/tiny-clf/infer", json=body).status_code == 200
                assert svc.wait_idle(60)
                doc = client.get("/v1/slices").json()
    finally:
        svc.stop()
    return {tuple(k.split("=", 1)): v["samples_total"] for k, v in doc["slices"].items() if k != "all"}


def test_validate_computes_derived_slices_without_metadata_and_monitor_shows_same_groups_when_same_rows(setup):
    d, ds, x, ref, reference = setup
    cand = D.candidate_model(d / "cand.onnx", "class")
    spec = _spec(gates=[{"metric": "top1_agreement", "min": 0.8, "scope": "per_slice", "slice": "predicted",
                         "min_support": 5}])
    res = validate_variant(spec, "ort-fp32", OrtRunner(cand), reference, ds, d / "v")
    csv = pd.read_csv(d / "v" / "slices.csv", dtype={"value": str})
    validation = {(r.slice, r.value): int(r.support) for r in csv.itertuples() if r.support}
    labels = D.reference_logits(x).argmax(1)
    assert validation[("predicted", "2")] == int((labels == 2).sum())
    assert validation[("ink", "[1.8,10)")] == int((x[:, 0] >= D.INK_EDGE).sum())
    # the per-slice gate speaks of the derived slice: the planted class fails it
    gate = res.gates[0]
    assert gate.status == "failed" and [f["value"] for f in gate.detail["failing"]] == ["2"]
    metrics = res.mlflow_metrics()
    assert metrics["slice.predicted.2.top1_agreement"] == 0.0 and metrics["slice.predicted.0.top1_agreement"] == 1.0
    assert not (d / "v" / CENTROIDS_FILE).exists()  # classification: no centroids
    # discovery searches the derived values as columns (there is no metadata column at all here; `predicted=2`,
    # 29 rows, is under discovery's min_support of 30)
    found = pd.read_csv(d / "v" / "discovered.csv", dtype=str)
    assert "ink" in set(found["slice"])
    assert _monitor_groups(spec, ref, cand, x) == validation


def test_validate_fits_topic_centroids_and_monitor_labels_topics_alike_when_given_them(setup):
    d, ds, x, ref, reference = setup
    topic = {"name": "topic", "derive": {"output": "reference", "reduce": "nearest_centroid", "centroids": 4}}
    spec = _spec("embedding", slices=[topic])
    validate_variant(spec, "ort-fp32", OrtRunner(ref), reference, ds, d / "e")
    centroids = load_centroids(str(d / "e" / CENTROIDS_FILE))
    # the declared slice, and the monitor's default `topic` would be it (declared wins); 4 unit-norm centroids
    assert set(centroids) == {"topic"} and centroids["topic"].shape == (4, 3)
    csv = pd.read_csv(d / "e" / "slices.csv", dtype={"value": str})
    validation = {(r.slice, r.value): int(r.support) for r in csv.itertuples() if r.support}
    assert sum(validation.values()) == N and len(validation) == 4
    assert _monitor_groups(spec, ref, ref, x, centroids) == validation
