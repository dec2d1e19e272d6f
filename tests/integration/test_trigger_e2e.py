"""End to end, nothing stubbed: MLflow registers a model version -> webhook -> trigger -> pipeline -> alias.

A real `mlflow server` (SQLite store, artifacts proxied by the server as `mlflow-artifacts:/`) has a webhook for
`model_version.created` pointing at the real receiver (`tailguard.trigger.create_app` with its default launcher,
i.e. `tailguard.runner.launch_run`, under uvicorn on 127.0.0.1). Registering the tiny BERT of
tests/integration/test_pipeline_local.py on the server makes MLflow deliver the signed webhook; the receiver starts
`tailguard run SPEC --model-version V` as a detached local process (kfp.local SubprocessRunner), which resolves the
version from the server, builds and validates an ONNX Runtime FP32 variant, registers it and moves
`tiny-encoder-optimized@production`. The test only polls the server for that alias.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers.mlflow_server import mlflow_server, uvicorn_in_thread
from tests.integration.test_pipeline_local import TINY_KWARGS, make_rows, write_spec

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SECRET = "e2e-webhook-secret"
MODEL = "tiny-encoder"
OPTIMIZED = f"{MODEL}-optimized"
ALIAS = "production"
TIMEOUT_S = 360.0
POLL_S = 2.0


@pytest.fixture
def server(tmp_path):
    folder = tmp_path / "mlflow-server"
    folder.mkdir()
    with mlflow_server(folder) as url:
        yield url


@pytest.fixture
def tailguard_home(tmp_path, monkeypatch):
    """A private $TAILGUARD_HOME (inherited by the detached run) and MLflow globals restored afterwards."""
    import mlflow

    home = tmp_path / "home"
    monkeypatch.setenv("TAILGUARD_HOME", str(home))
    monkeypatch.delenv("TAILGUARD_KFP_HOST", raising=False)  # local runner
    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI"):  # mlflow.set_*_uri export these
        monkeypatch.delenv(var, raising=False)
    yield home
    mlflow.set_tracking_uri(None)
    mlflow.set_registry_uri(None)


@pytest.fixture
def receiver(tmp_path, tailguard_home, server, monkeypatch):
    """The trigger app with the default launcher, served by uvicorn in a thread; yields (app, webhook URL).

    On teardown, any pipeline process the launcher started and that is still running is ended (its whole
    process group: it was started in a new session), found among this process' children by its command line.
    """
    import psutil

    from tailguard.trigger import TriggerConfig, create_app

    make_rows(120, 0).to_parquet(tmp_path / "validation.parquet")
    make_rows(40, 1).to_parquet(tmp_path / "calibration.parquet")
    spec = write_spec(tmp_path, variants=[{"name": "ort-fp32", "backend": "onnxruntime", "precision": "fp32"}],
                      mlflow={"tracking_uri": server, "experiment": "tailguard/trigger-e2e"})
    cfg = tmp_path / "trigger.yaml"
    cfg.write_text(yaml.safe_dump({"secret_env": "TG_E2E_SECRET", "models": {MODEL: spec.name}}))
    monkeypatch.setenv("TG_E2E_SECRET", SECRET)
    app = create_app(TriggerConfig.load(cfg))
    with uvicorn_in_thread(app) as url:
        yield app, f"{url}/webhook"
    for child in psutil.Process().children(recursive=False):
        try:
            if "tailguard.cli" in " ".join(child.cmdline()) and child.is_running():
                os.killpg(child.pid, signal.SIGTERM)
                child.wait(10)
        except (psutil.Error, ProcessLookupError):
            pass


def trigger_log_tail(home: Path, chars: int = 4000) -> str:
    logs = sorted((home / "runs").glob("trigger-*.log")) if (home / "runs").is_dir() else []
    if not logs:
        return "(no $TAILGUARD_HOME/runs/trigger-*.log: the receiver started no run)"
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-chars:]}" for p in logs)


def test_trigger_promotes_optimized_version_when_real_mlflow_server_registers_a_model_version(
        server, receiver, tailguard_home):
    import mlflow
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    from tailguard.core.tracking import configure
    from tailguard.models import MeanPooledEncoder
    from tailguard.registration import register_reference

    app, url = receiver
    client = MlflowClient(tracking_uri=server, registry_uri=server)
    client.create_webhook(name="tailguard", url=url, events=["model_version.created"], secret=SECRET)

    configure(server, "registration")
    torch.manual_seed(0)
    mv = register_reference(MODEL, state_dict=MeanPooledEncoder(**TINY_KWARGS).state_dict(),
                            class_path="tailguard.models:MeanPooledEncoder", init_kwargs=TINY_KWARGS)
    assert mlflow.get_run(mv.run_id).info.artifact_uri.startswith("mlflow-artifacts:/"), \
        "the server should proxy artifacts (pods of a cluster cannot read its disk)"

    promoted = None
    deadline = time.time() + TIMEOUT_S
    while time.time() < deadline:
        try:
            promoted = client.get_model_version_by_alias(OPTIMIZED, ALIAS)
            break
        except MlflowException:
            time.sleep(POLL_S)
    counts = {s.labels["outcome"]: s.value for m in app.state.trigger.registry.collect() for s in m.samples
              if s.name == "tailguard_trigger_webhooks_total"}
    assert promoted is not None, (
        f"{OPTIMIZED}@{ALIAS} did not appear within {TIMEOUT_S:.0f} s; webhooks {counts}\n"
        f"{trigger_log_tail(tailguard_home)}")

    assert counts["accepted"] == 1 and app.state.trigger.runs_started._value.get() == 1, counts
    assert promoted.tags["tailguard.source_version"] == str(mv.version)
    assert promoted.tags["tailguard.variant"] == "ort-fp32"
    variant_run = client.get_run(promoted.run_id)
    parent_id = variant_run.data.tags["mlflow.parentRunId"]
    # the alias moves before register-and-promote writes its outcome tags, the report and closes the parent run
    parent = client.get_run(parent_id)
    while parent.info.status == "RUNNING" and time.time() < deadline:
        time.sleep(POLL_S)
        parent = client.get_run(parent_id)
    assert parent.info.status == "FINISHED", parent.info.status
    assert parent.data.tags["tailguard.outcome"] == "promoted"
