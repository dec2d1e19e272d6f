"""The monitor checks its own node (issue 23, item 4): at start it compares its node's kernel facts (ISA flags, GPU
compute capabilities) with the nodes its candidate's registry version was validated on (tag tailguard.validated_on,
written by the register step); a mismatch keeps it ready but shows in /readyz, a gauge, the compared-request
counter, sampled-pair records and alert records.

Real parts: a SQLite MLflow registry holding a version with the tag, the monitor service with real ONNX models
through Starlette's TestClient. The validated nodes are written from this node's own facts (the same, or with
one ISA flag changed), so the test holds on any machine.
"""

import json
import time

import mlflow
import numpy as np
import pytest
from fastapi.testclient import TestClient

from tailguard.core.hardware import KERNEL_ISA_FLAGS, kernel_facts, node_facts
from tailguard.core.spec import parse_spec
from tailguard.monitoring import testing as T
from tailguard.monitoring.app import build_app
from tailguard.monitoring.node_check import NodeCheckStatus, check_node, read_validated_on, run_node_check
from tailguard.monitoring.service import create_service
from tailguard.monitoring.sink import redact_row
from tests.monitoring.test_monitor_service import NAME, _body, _pair

MODEL = "tiny-clf-optimized"


def here() -> dict:
    return kernel_facts(node_facts())


def other_isa(isa: str) -> str:
    """This node's ISA text with one kernel flag added or removed: another kind of node."""
    flags = [] if isa in ("none", "unknown") else isa.split()
    if KERNEL_ISA_FLAGS[-1] in flags:
        return " ".join(f for f in flags if f != KERNEL_ISA_FLAGS[-1]) or "none"
    return " ".join(flags + [KERNEL_ISA_FLAGS[-1]])


def entry(target, isa, *, gpu="none", passed=True) -> dict:
    return {"target": target, "status": "ok", "passed": passed, "placement": "node_pool", "cpu": "some CPU",
            "isa": isa, "gpu": gpu}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("node-check")
    return {"ref": T.linear_classifier(d / "ref.onnx"),
            "bad": T.linear_classifier(d / "bad.onnx", T.weights(noise=3.0)), "dir": d}


@pytest.fixture
def registry(tmp_path):
    """A SQLite MLflow registry; `put(entries, alias)` registers a version tagged with them."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.MlflowClient(uri, uri)
    client.create_registered_model(MODEL)

    def put(entries, alias="production", provider="CPUExecutionProvider"):
        mv = client.create_model_version(MODEL, source=str(tmp_path), tags={
            "tailguard.validated_on": json.dumps(entries) if entries is not None else "",
            "tailguard.execution_provider": provider})
        client.set_registered_model_alias(MODEL, alias, mv.version)
        return mv.version

    return uri, put


def service(models, candidate, uri, ref=f"{MODEL}@production"):
    spec = parse_spec(T.spec_dict({"sample_rate": 1.0, "seed": 0, "min_support": 30, "window_size": 100}))
    svc = create_service(spec, models["ref"], candidate, candidate_version=ref, tracking_uri=uri)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (svc.readiness()[0] and svc.node_check.status != "pending"):
        time.sleep(0.02)
    return svc, TestClient(build_app(svc))


def value(svc, name, **labels):
    return svc.metrics.registry.get_sample_value(name, labels) or 0.0


# ---------------------------------------------------------------------------------------------- check_node
def test_check_node_matches_a_passing_node_with_the_same_isa_when_the_cpu_name_or_a_gpu_differs():
    # the monitor recomputes on the CPU: the CPU kernels are chosen by the ISA flags, not the model name or a GPU
    node = {"cpu": "Intel(R) Xeon(R) Platinum 8481C", "isa": "avx2 fma f16c avx512f avx512_vnni", "gpu": "sm9.0"}
    check = check_node(node, [entry("avx2", "avx2 fma f16c"), entry("vnni", "avx512_vnni avx512f avx2 fma f16c")])
    assert check.status == NodeCheckStatus.MATCHED.value and check.matched == "vnni" and not check.mismatch


def test_check_node_names_the_differing_facts_of_the_closest_node_when_none_matches():
    node = {"cpu": "AMD EPYC 7B13", "isa": "avx2 fma f16c", "gpu": "none"}
    check = check_node(node, [entry("vnni", "avx2 fma f16c avx512f avx512_vnni"),
                              entry("avx2", "avx2 fma f16c", passed=False)])  # failed there: validates nothing
    assert check.mismatch and check.closest == "vnni"
    assert check.differences == {"isa": {"node": "avx2 fma f16c", "validated": "avx2 fma f16c avx512f avx512_vnni"}}
    assert [v["target"] for v in check.validated] == ["vnni"]


def test_check_node_mismatches_on_the_execution_provider_when_the_version_was_validated_on_a_gpu():
    node = {"cpu": "AMD EPYC 7B13", "isa": "avx2 fma f16c", "gpu": "sm8.9"}
    check = check_node(node, [entry("l4", "avx2 fma f16c", gpu="sm8.9")], execution_provider="CUDAExecutionProvider")
    assert check.mismatch and set(check.differences) == {"execution_provider"}
    assert check.differences["execution_provider"]["validated"] == "CUDAExecutionProvider"


def test_check_node_is_unknown_not_matched_when_the_version_records_no_passing_node():
    node = here()
    assert check_node(node, []).status == "unknown" and "no tailguard.validated_on" in check_node(node, []).reason
    failed = check_node(node, [entry(None, node["isa"], passed=False)])
    assert failed.status == "unknown" and not failed.mismatch and "none of its 1" in failed.reason


# ------------------------------------------------------------------------------------------------ registry
def test_run_node_check_reads_the_versions_validated_nodes_from_the_registry_when_given_an_alias(registry):
    uri, put = registry
    v = put([entry(None, here()["isa"], gpu=here()["gpu"])])
    where, entries, provider, _ = read_validated_on(f"models:/{MODEL}@production", uri)
    assert where == f"{MODEL}/{v}" and entries[0]["target"] is None and provider == "CPUExecutionProvider"
    check = run_node_check(f"{MODEL}/{v}", uri)
    assert check.status == "matched" and check.matched == "build node" and check.version == f"{MODEL}/{v}"


def test_run_node_check_mismatches_when_the_registered_version_runs_on_another_execution_provider(registry):
    uri, put = registry
    put([entry("l4", here()["isa"], gpu="sm8.9")], alias="gpu", provider="CUDAExecutionProvider")
    check = run_node_check(f"{MODEL}@gpu", uri)
    assert check.mismatch and check.differences["execution_provider"]["validated"] == "CUDAExecutionProvider"


@pytest.mark.parametrize("ref, words", [(f"{MODEL}@nope", "nope"), ("no-version-here", "neither an alias"),
                                        ("other-model/1", "other-model")])
def test_run_node_check_is_unknown_with_the_reason_when_the_version_cannot_be_read(registry, ref, words):
    uri, put = registry
    put([entry(None, "avx2")])
    check = run_node_check(ref, uri)
    assert check.status == "unknown" and words in check.reason


def test_run_node_check_is_not_configured_when_no_version_is_named():
    assert run_node_check(None).status == NodeCheckStatus.NOT_CONFIGURED.value


# ------------------------------------------------------------------------------------------------- service
def test_monitor_stays_ready_and_reports_the_node_mismatch_when_its_node_differs_from_the_validated_ones(
        models, registry):
    uri, put = registry
    node = here()
    put([entry("vnni", other_isa(node["isa"]), gpu=node["gpu"])])
    svc, client = service(models, models["bad"], uri)
    with client:
        r = client.get("/readyz")
        assert r.status_code == 200 and r.json()["ready"]
        doc = r.json()
        assert doc["node_check"]["status"] == "mismatch" and doc["node_check"]["closest"] == "vnni"
        assert set(doc["node_mismatch"]) == {"isa"}
        assert doc["node_mismatch"]["isa"] == {"node": node["isa"], "validated": other_isa(node["isa"])}
        assert value(svc, "tailguard_monitor_node_mismatch", model=NAME) == 1
        # mirror path: the monitor recomputes the candidate here, on another kind of node
        for i in range(120):
            assert client.post(f"/v2/models/{NAME}/infer", json=_body(i, "legal")).status_code == 200
        # pairs path: the live response, the serving node's own
        for i in range(120, 160):
            assert client.post(f"/v2/models/{NAME}/pairs", json=_pair(i, "web")).status_code == 200
        assert svc.wait_idle(30)
        assert value(svc, "tailguard_monitor_candidate_source_total", model=NAME,
                     source="recomputed_other_node") == 120
        assert value(svc, "tailguard_monitor_candidate_source_total", model=NAME, source="live") == 40
        assert value(svc, "tailguard_monitor_candidate_source_total", model=NAME, source="recomputed") == 0
        alerts = client.get("/v1/alerts").json()
        assert alerts and all(a["node_mismatch"] == doc["node_mismatch"] for a in alerts)
        assert all(a["recomputed_other_node_share"] == 0.75 for a in alerts)  # 120 of 160 compared requests
        assert "tailguard_monitor_node_mismatch{" in client.get("/metrics").text


def test_monitor_reports_no_mismatch_and_plain_recomputed_outputs_when_its_node_matches(models, registry):
    uri, put = registry
    node = here()
    put([entry("elsewhere", other_isa(node["isa"])), entry("here", node["isa"], gpu=node["gpu"])])
    svc, client = service(models, models["bad"], uri)
    with client:
        doc = client.get("/readyz").json()
        assert doc["node_check"]["status"] == "matched" and doc["node_check"]["matched"] == "here"
        assert doc["node_mismatch"] is None
        assert value(svc, "tailguard_monitor_node_mismatch", model=NAME) == 0
        for i in range(120):
            client.post(f"/v2/models/{NAME}/infer", json=_body(i, "legal"))
        assert svc.wait_idle(30)
        assert value(svc, "tailguard_monitor_candidate_source_total", model=NAME, source="recomputed") == 120
        alerts = client.get("/v1/alerts").json()
        assert alerts and not any("node_mismatch" in a for a in alerts)


def test_monitor_serves_with_the_check_unknown_when_the_registry_cannot_be_read(models, tmp_path):
    svc, client = service(models, models["bad"], f"sqlite:///{tmp_path / 'empty.db'}")
    with client:
        r = client.get("/readyz")
        assert r.status_code == 200 and r.json()["node_check"]["status"] == "unknown"
        assert r.json()["node_mismatch"] is None and value(svc, "tailguard_monitor_node_mismatch", model=NAME) == 0


def test_sampled_pair_rows_carry_where_the_candidate_output_came_from_when_written_for_s3():
    rec = {"request_id": "r", "row": 0, "weight": 1.0, "slices": ["all"], "meta": {}, "inputs": {},
           "reference": np.zeros(3), "candidate": np.zeros(3), "metrics": {},
           "candidate_source": "recomputed_other_node"}
    assert redact_row(rec, set())["_tg_candidate_source"] == "recomputed_other_node"


# ------------------------------------------------------------------------- the candidate file and the store
def _put_with_digest(uri, tmp_path, digest):
    client = mlflow.MlflowClient(uri, uri)
    client.create_registered_model(MODEL)
    mv = client.create_model_version(MODEL, source=str(tmp_path), tags={
        "tailguard.validated_on": json.dumps([entry(None, here()["isa"], gpu=here()["gpu"])]),
        "tailguard.execution_provider": "CPUExecutionProvider", "tailguard.sha256": digest})
    client.set_registered_model_alias(MODEL, "production", mv.version)


def test_run_node_check_mismatches_on_sha256_when_the_candidate_file_is_not_that_versions_model(tmp_path, models):
    from tailguard.core.digests import file_sha256

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    _put_with_digest(uri, tmp_path, file_sha256(models["ref"]))  # the version holds the reference file

    same = run_node_check(f"{MODEL}@production", uri, candidate_file=models["ref"])
    other = run_node_check(f"{MODEL}@production", uri, candidate_file=models["bad"])

    assert same.status == "matched"
    assert other.status == "mismatch" and set(other.differences) == {"sha256"}  # was "matched": no digest compared
    assert other.differences["sha256"]["validated"] == file_sha256(models["ref"]) and "is not the model" in other.reason


def test_monitor_reads_the_candidate_version_from_the_tailguard_home_store_when_no_tracking_uri_is_given(
        tmp_path, models, monkeypatch):
    from tailguard.core.home import default_tracking_uri

    monkeypatch.setenv("TAILGUARD_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)  # a stray store in the working folder must not be the one read
    uri = default_tracking_uri()
    client = mlflow.MlflowClient(uri, uri)
    client.create_registered_model(MODEL)
    mv = client.create_model_version(MODEL, source=str(tmp_path), tags={
        "tailguard.validated_on": json.dumps([entry(None, here()["isa"], gpu=here()["gpu"])]),
        "tailguard.execution_provider": "CPUExecutionProvider"})
    client.set_registered_model_alias(MODEL, "production", mv.version)

    svc, _ = service(models, models["bad"], None)

    assert svc.node_check.status == "matched", svc.node_check.reason  # was "unknown": MLflow's default store read
    svc.stop()
