"""The MLflow webhook trigger (tailguard.trigger): signature, clock skew, replays, model filter, idempotency, counters.

The seam: every test passes a *recording launcher* (a plain function that records its arguments and returns a fake
run id) in place of `tailguard.runner.launch_run`, because a KFP cluster cannot run here and the end-to-end variant
with the real local pipeline is a separate test. Everything else is real: the FastAPI app, prometheus-client
counters, and in the integration test a real `mlflow server` (SQLite store) delivering real webhooks over HTTP.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from pathlib import Path

import pytest
import yaml
from fastapi.testclient import TestClient

from tailguard.core.errors import InputError, SpecError
from tailguard.trigger import (
    DELIVERY_ID_HEADER,
    OUTCOMES,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    TriggerConfig,
    create_app,
    sign,
)
from tests.helpers.mlflow_server import mlflow_server as start_mlflow_server
from tests.helpers.mlflow_server import uvicorn_in_thread

SECRET = "s3cr3t-for-tests"
NOW = 1_750_000_000.0

SPEC = {
    "apiVersion": "tailguard/v1", "kind": "OptimizationSpec", "metadata": {"name": "tiny"},
    "model": {"registered_name": "tiny-clf", "task": "classification",
              "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 4]}],
              "outputs": [{"name": "logits", "dtype": "float32", "shape": ["batch", 3]}]},
    "data": {"calibration": {"uri": "calib.parquet"}, "validation": {"uri": "valid.parquet"}},
    "variants": [{"name": "ort-fp32", "backend": "onnxruntime", "precision": "fp32"}],
    "gates": [{"metric": "top1_agreement", "min": 0.9}],
}


class RecordingLauncher:
    """Stands in for tailguard.runner.launch_run (the narrow seam): records calls, returns run-<n>."""

    def __init__(self, fail_times: int = 0) -> None:
        self.calls: list[tuple[str, str, str]] = []
        self.fail_times = fail_times
        self.event = threading.Event()

    def __call__(self, spec_path: str, model_name: str, version: str) -> str:
        if self.fail_times > 0:
            self.fail_times -= 1
            raise RuntimeError("KFP API unavailable")
        self.calls.append((spec_path, model_name, version))
        self.event.set()
        return f"run-{len(self.calls)}"


def write_config(tmp: Path, **over) -> Path:
    spec = tmp / "specs" / "tiny.yaml"
    spec.parent.mkdir(parents=True, exist_ok=True)
    spec.write_text(yaml.safe_dump(SPEC))
    cfg = {"secret_env": "TG_TEST_SECRET", "models": {"tiny-clf": "specs/tiny.yaml"}, "max_clock_skew_s": 300}
    cfg.update(over)
    path = tmp / "trigger.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(autouse=True)
def _private_home(tmp_path, monkeypatch):
    """The receiver persists its replay cache under $TAILGUARD_HOME/trigger: a private one per test."""
    monkeypatch.setenv("TAILGUARD_HOME", str(tmp_path / "home"))


@pytest.fixture
def config(tmp_path) -> TriggerConfig:
    return TriggerConfig.load(write_config(tmp_path))


def delivery(name="tiny-clf", version="1", *, entity="model_version", action="created", ts=NOW, secret=SECRET,
             delivery_id=None):
    body = json.dumps({"entity": entity, "action": action, "timestamp": "2025-06-15T00:00:00+00:00",
                       "data": {"name": name, "version": version, "source": "models:/m-1", "run_id": None,
                                "tags": {}, "description": None}})
    did = delivery_id or str(uuid.uuid4())
    headers = {"Content-Type": "application/json", DELIVERY_ID_HEADER: did, TIMESTAMP_HEADER: str(int(ts)),
               SIGNATURE_HEADER: sign(secret, did, str(int(ts)), body)}
    return body, headers


def counts(app) -> dict[str, float]:
    return {o: app.state.trigger.webhooks.labels(outcome=o)._value.get() for o in OUTCOMES}


def make(config, launcher=None, now=NOW):
    launcher = launcher or RecordingLauncher()
    app = create_app(config, launch=launcher, clock=lambda: now, secret=SECRET)
    return app, TestClient(app), launcher


# ------------------------------------------------------------------------------------------------- unit
def test_sign_matches_mlflow_signature_when_same_inputs():
    from mlflow.webhooks.delivery import _generate_hmac_signature

    body = '{"a": 1}'
    assert sign(SECRET, "d-1", "1700000000", body) == _generate_hmac_signature(SECRET, "d-1", "1700000000", body)


def test_trigger_starts_one_run_when_signed_model_version_created(config):
    app, client, launcher = make(config)
    body, headers = delivery(version="7")
    r = client.post("/webhook", content=body, headers=headers)
    assert r.status_code == 202, r.text
    assert r.json()["run_id"] == "run-1"
    assert launcher.calls == [(config.models["tiny-clf"], "tiny-clf", "7")]
    assert counts(app)["accepted"] == 1
    assert app.state.trigger.runs_started._value.get() == 1


def test_trigger_rejects_and_counts_when_signature_is_bad(config):
    app, client, launcher = make(config)
    body, headers = delivery(secret="wrong-secret")
    r = client.post("/webhook", content=body, headers=headers)
    assert r.status_code == 401
    assert r.json()["outcome"] == "bad_signature"
    body, headers = delivery()
    r = client.post("/webhook", content=body.replace('"1"', '"2"'), headers=headers)  # body tampered after signing
    assert r.status_code == 401
    body, headers = delivery()
    del headers[SIGNATURE_HEADER]
    assert client.post("/webhook", content=body, headers=headers).status_code == 401
    assert counts(app)["bad_signature"] == 3
    assert launcher.calls == []


def test_trigger_rejects_and_counts_when_timestamp_is_stale_or_in_future(config):
    app, client, launcher = make(config)
    for ts in (NOW - 301, NOW + 301):
        body, headers = delivery(ts=ts)
        r = client.post("/webhook", content=body, headers=headers)
        assert r.status_code == 401 and r.json()["outcome"] == "stale"
    body, headers = delivery(ts=NOW - 299)  # inside the window
    assert client.post("/webhook", content=body, headers=headers).status_code == 202
    assert counts(app)["stale"] == 2 and len(launcher.calls) == 1


def test_trigger_rejects_and_counts_when_delivery_is_replayed(config):
    app, client, launcher = make(config)
    body, headers = delivery()
    assert client.post("/webhook", content=body, headers=headers).status_code == 202
    r = client.post("/webhook", content=body, headers=headers)
    assert r.status_code == 409 and r.json()["outcome"] == "replayed"
    assert counts(app)["replayed"] == 1 and len(launcher.calls) == 1


def test_trigger_launches_once_when_same_version_is_delivered_twice(config):
    app, client, launcher = make(config)
    for _ in range(2):
        body, headers = delivery(version="3")  # distinct delivery ids, same model version
        r = client.post("/webhook", content=body, headers=headers)
        assert r.status_code in (200, 202)
    assert r.json()["started"] is False and r.json()["run_id"] == "run-1"
    assert len(launcher.calls) == 1
    Path(config.models["tiny-clf"]).write_text(yaml.safe_dump({**SPEC, "metadata": {"name": "tiny2"}}))
    body, headers = delivery(version="3")  # the spec changed: a new (model, version, spec hash) key
    assert client.post("/webhook", content=body, headers=headers).status_code == 202
    assert len(launcher.calls) == 2


def test_trigger_ignores_and_counts_when_model_is_unknown(config):
    app, client, launcher = make(config)
    body, headers = delivery(name="someone-elses-model")
    r = client.post("/webhook", content=body, headers=headers)
    assert r.status_code == 200 and r.json()["outcome"] == "unknown_model"
    assert counts(app)["unknown_model"] == 1 and launcher.calls == []


def test_trigger_ignores_when_event_is_not_model_version_created(config):
    app, client, launcher = make(config)
    body, headers = delivery(entity="model_version_tag", action="set")
    r = client.post("/webhook", content=body, headers=headers)
    assert r.status_code == 200 and r.json()["outcome"] == "ignored_event"
    assert launcher.calls == []


def test_trigger_rejects_when_payload_is_not_a_webhook(config):
    app, client, launcher = make(config)
    for body in ("not json", json.dumps({"entity": "model_version", "action": "created", "data": {"name": "x"}})):
        did, ts = str(uuid.uuid4()), str(int(NOW))
        headers = {DELIVERY_ID_HEADER: did, TIMESTAMP_HEADER: ts, SIGNATURE_HEADER: sign(SECRET, did, ts, body)}
        assert client.post("/webhook", content=body, headers=headers).status_code == 400
    assert counts(app)["bad_payload"] == 2 and launcher.calls == []


def test_trigger_answers_500_and_accepts_retry_when_launcher_fails(config):
    app, client, launcher = make(config, RecordingLauncher(fail_times=1))
    body, headers = delivery()
    r = client.post("/webhook", content=body, headers=headers)
    assert r.status_code == 500 and r.json()["outcome"] == "launch_failed"
    r = client.post("/webhook", content=body, headers=headers)  # MLflow's retry: same headers
    assert r.status_code == 202
    assert counts(app)["launch_failed"] == 1 and len(launcher.calls) == 1


def test_metrics_endpoint_exports_every_outcome_when_scraped(config):
    app, client, _ = make(config)
    text = client.get("/metrics").text
    for o in OUTCOMES:
        assert f'tailguard_trigger_webhooks_total{{outcome="{o}"}} 0.0' in text
    assert "tailguard_trigger_runs_started_total 0.0" in text
    assert client.get("/healthz").status_code == 200


def test_create_app_raises_input_error_when_secret_env_is_unset(config, monkeypatch):
    monkeypatch.delenv("TG_TEST_SECRET", raising=False)
    with pytest.raises(InputError, match="TG_TEST_SECRET"):
        create_app(config, launch=RecordingLauncher())


def test_trigger_config_raises_spec_error_when_field_is_unknown_or_secret_inline(tmp_path):
    with pytest.raises(SpecError) as e:
        TriggerConfig.load(write_config(tmp_path, secret="inline-secret"))
    assert any(err.loc == "secret" for err in e.value.errors)


def test_create_app_raises_spec_error_when_spec_names_another_model(tmp_path):
    cfg = TriggerConfig.load(write_config(tmp_path, models={"other-model": "specs/tiny.yaml"}))
    with pytest.raises(SpecError, match="registered_name"):
        create_app(cfg, launch=RecordingLauncher(), secret=SECRET)


# ------------------------------------------------------------------------------------------ integration
@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """A real `mlflow server` (SQLite store, 1 worker) that may deliver webhooks to http://127.0.0.1."""
    with start_mlflow_server(tmp_path_factory.mktemp("mlflow-server")) as url:
        yield url


@pytest.fixture
def receiver(tmp_path, monkeypatch):
    """The trigger app under uvicorn in a thread on 127.0.0.1 (real HTTP), with a recording launcher."""
    monkeypatch.setenv("TG_TEST_SECRET", SECRET)
    launcher = RecordingLauncher()
    app = create_app(TriggerConfig.load(write_config(tmp_path)), launch=launcher)
    with uvicorn_in_thread(app) as url:
        yield app, f"{url}/webhook", launcher


def _wait(pred, timeout=30.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return True
        time.sleep(0.1)
    return False


@pytest.mark.integration
def test_trigger_launches_run_when_real_mlflow_server_creates_model_version(mlflow_server, receiver):
    from mlflow import MlflowClient

    app, url, launcher = receiver
    client = MlflowClient(tracking_uri=mlflow_server, registry_uri=mlflow_server)
    client.create_webhook(name="tailguard", url=url, events=["model_version.created"], secret=SECRET)
    client.create_webhook(name="forged", url=url, events=["model_version.created"], secret="not-the-secret")
    for name in ("tiny-clf", "unrelated-model"):
        client.create_registered_model(name)
        client.create_model_version(name, source="s3://bucket/models/m-1", run_id=None)

    ok = _wait(lambda: counts(app)["accepted"] >= 1 and counts(app)["bad_signature"] >= 2
               and counts(app)["unknown_model"] >= 1)
    c = counts(app)
    assert ok, f"deliveries not seen in time: {c}"
    spec_path = app.state.trigger.config.models["tiny-clf"]
    assert launcher.calls == [(spec_path, "tiny-clf", "1")]
    assert c["accepted"] == 1 and c["bad_signature"] == 2 and c["unknown_model"] == 1
    assert app.state.trigger.runs_started._value.get() == 1


def test_default_launcher_passes_kfp_host_to_runner_when_configured(config, monkeypatch):
    """Seam: tailguard.runner.launch_run is replaced by a recorder (it would submit to KFP or start a run)."""
    import tailguard.runner
    from tailguard.trigger import KFP_HOST_ENV, default_launcher

    seen = []
    monkeypatch.setattr(tailguard.runner, "launch_run",
                        lambda spec, name, version: seen.append((spec, name, version,
                                                                 os.environ.get(KFP_HOST_ENV))) or "run-x")
    monkeypatch.setenv(KFP_HOST_ENV, "http://stale-host")
    assert default_launcher(config)("s.yaml", "tiny-clf", "4") == "run-x"  # no kfp_host: local runner
    cfg = config.model_copy(update={"kfp_host": "http://ml-pipeline.kubeflow:8888"})
    default_launcher(cfg)("s.yaml", "tiny-clf", "5")
    assert seen == [("s.yaml", "tiny-clf", "4", None),
                    ("s.yaml", "tiny-clf", "5", "http://ml-pipeline.kubeflow:8888")]
