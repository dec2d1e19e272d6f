"""Issue 22 items 5 and 8 on the webhook receiver (tailguard.trigger): body limits before reading (real HTTP:
uvicorn on 127.0.0.1 and raw http.client requests), reason codes instead of exception text, the replay cache
surviving a restart, and the environment a triggered local run inherits (a real `launch_run` starting a real
process).

Seams: the recording launcher of tests/integration/test_trigger.py where a run is not the point; in the environment
test the program `launch_run` starts is a small shell script standing in for `python -m tailguard.cli run` (it writes
the environment it was given and exits), so no pipeline runs on this machine's 2 cores.
"""

from __future__ import annotations

import http.client
import json
import os
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest
from fastapi.testclient import TestClient

from tailguard.trigger import REASONS, TriggerConfig, create_app, run_environment, sign
from tests.helpers.mlflow_server import uvicorn_in_thread
from tests.integration.test_trigger import NOW, SECRET, RecordingLauncher, counts, delivery, write_config

TIMEOUT_S = 60.0  # generous: the answers come at once; a receiver that reads first never answers


@pytest.fixture(autouse=True)
def _private_home(tmp_path, monkeypatch):
    monkeypatch.setenv("TAILGUARD_HOME", str(tmp_path / "home"))


@pytest.fixture
def served(tmp_path):
    """The receiver (max_body_bytes 4096, recording launcher) under uvicorn; yields (app, host, port)."""
    launcher = RecordingLauncher()
    app = create_app(TriggerConfig.load(write_config(tmp_path, max_body_bytes=4096)), launch=launcher,
                     clock=lambda: NOW, secret=SECRET)
    with uvicorn_in_thread(app) as url:
        u = urlparse(url)
        yield app, u.hostname, u.port, launcher


def _answer(conn: http.client.HTTPConnection) -> tuple[int, dict]:
    resp = conn.getresponse()
    return resp.status, json.loads(resp.read() or b"{}")


# ------------------------------------------------------------------------------------- item 5: body limits
def test_webhook_answers_413_without_reading_when_content_length_is_over_the_limit(served):
    app, host, port, launcher = served
    conn = http.client.HTTPConnection(host, port, timeout=TIMEOUT_S)
    conn.putrequest("POST", "/webhook")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(8 << 30))  # 8 GiB announced; not one byte of it is ever sent
    conn.endheaders()
    status, body = _answer(conn)
    conn.close()
    assert (status, body["outcome"], body["reason"]) == (413, "too_large", "content_length_over_limit")
    assert counts(app)["too_large"] == 1 and launcher.calls == []


def test_webhook_answers_413_at_the_limit_when_a_chunked_body_keeps_coming(served):
    app, host, port, launcher = served
    conn = http.client.HTTPConnection(host, port, timeout=TIMEOUT_S)
    conn.putrequest("POST", "/webhook")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Transfer-Encoding", "chunked")
    conn.endheaders()
    chunk = b"x" * 1024
    for _ in range(5):  # 5 KiB > 4096 bytes, and the body never ends (no terminating chunk)
        conn.send(b"%x\r\n%s\r\n" % (len(chunk), chunk))
    status, body = _answer(conn)
    conn.close()
    assert (status, body["outcome"], body["reason"]) == (413, "too_large", "body_over_limit")
    assert counts(app)["too_large"] == 1 and launcher.calls == []


def test_webhook_still_accepts_a_signed_delivery_when_under_the_limit(served):
    app, host, port, launcher = served
    payload, headers = delivery()
    conn = http.client.HTTPConnection(host, port, timeout=TIMEOUT_S)
    conn.request("POST", "/webhook", body=payload.encode(), headers=headers)
    status, body = _answer(conn)
    conn.close()
    assert (status, body["outcome"], body["reason"]) == (202, "accepted", "run_started")
    assert len(launcher.calls) == 1


def test_trigger_config_exits_2_when_max_body_bytes_is_below_a_webhook(tmp_path):
    from tailguard.core.errors import SpecError

    with pytest.raises(SpecError) as exc:
        TriggerConfig.load(write_config(tmp_path, max_body_bytes=10))
    assert exc.value.exit_code == 2 and any(e.loc == "max_body_bytes" for e in exc.value.errors)


# ------------------------------------------------------------------------------ item 8: answers and replays
def test_trigger_answers_a_reason_code_without_exception_text_when_launch_fails(tmp_path):
    def failing(spec_path, model_name, version):
        raise RuntimeError("token=sk-live-SECRET at https://admin:hunter2@kfp.internal")

    app = create_app(TriggerConfig.load(write_config(tmp_path)), launch=failing, clock=lambda: NOW, secret=SECRET)
    payload, headers = delivery()
    r = TestClient(app).post("/webhook", content=payload, headers=headers)
    assert r.status_code == 500
    assert (r.json()["outcome"], r.json()["reason"]) == ("launch_failed", "launcher_error")
    assert "SECRET" not in r.text and "hunter2" not in r.text and "RuntimeError" not in r.text


def test_trigger_answers_only_known_reason_codes_when_deliveries_are_bad(tmp_path):
    app = create_app(TriggerConfig.load(write_config(tmp_path)), launch=RecordingLauncher(), clock=lambda: NOW,
                     secret=SECRET)
    client = TestClient(app)
    payload, headers = delivery()
    did = headers["X-MLflow-Delivery-Id"]
    soon = {**headers, "X-MLflow-Timestamp": "soon", "X-MLflow-Signature": sign(SECRET, did, "soon", payload)}
    answers = [client.post("/webhook", content=payload, headers={**headers, "X-MLflow-Signature": "v1,bad"}),
               client.post("/webhook", content=payload, headers=soon),
               client.post("/webhook", content=payload, headers=headers),
               client.post("/webhook", content=payload, headers=headers)]
    assert [a.json()["reason"] for a in answers] == ["signature_mismatch", "timestamp_invalid", "run_started",
                                                     "delivery_replayed"]
    assert all(a.json()["reason"] in REASONS for a in answers)


def test_trigger_refuses_a_replay_when_the_receiver_restarted(tmp_path):
    config = TriggerConfig.load(write_config(tmp_path))
    payload, headers = delivery()
    first = create_app(config, launch=RecordingLauncher(), clock=lambda: NOW, secret=SECRET)
    assert TestClient(first).post("/webhook", content=payload, headers=headers).status_code == 202
    assert (Path(os.environ["TAILGUARD_HOME"]) / "trigger" / "replay.json").is_file()

    restarted = create_app(config, launch=RecordingLauncher(), clock=lambda: NOW + 60, secret=SECRET)
    r = TestClient(restarted).post("/webhook", content=payload, headers=headers)
    assert (r.status_code, r.json()["outcome"]) == (409, "replayed")


def test_replay_cache_forgets_ids_when_they_are_older_than_the_window(tmp_path):
    config = TriggerConfig.load(write_config(tmp_path))
    did = "11111111-2222-3333-4444-555555555555"
    first = create_app(config, launch=RecordingLauncher(), clock=lambda: NOW, secret=SECRET)
    payload, headers = delivery(delivery_id=did)
    assert TestClient(first).post("/webhook", content=payload, headers=headers).status_code == 202
    later = NOW + 2 * config.max_clock_skew_s + 1
    restarted = create_app(config, launch=RecordingLauncher(), clock=lambda: later, secret=SECRET)
    assert did not in restarted.state.trigger.replays


# --------------------------------------------------------------------- item 8: what a triggered run inherits
def test_run_environment_keeps_what_runs_need_and_drops_the_secret_when_filtering():
    config = TriggerConfig(models={"m": "/s.yaml"}, run_env=["MY_PROXY_CONF"])
    env = {"PATH": "/bin", "TAILGUARD_HOME": "/h", "TAILGUARD_WEBHOOK_SECRET": "s", "MLFLOW_TRACKING_URI": "u",
           "AWS_ACCESS_KEY_ID": "k", "GITHUB_TOKEN": "t", "MY_PROXY_CONF": "p", "LC_ALL": "C"}
    assert run_environment(config, env) == {"PATH": "/bin", "TAILGUARD_HOME": "/h", "MLFLOW_TRACKING_URI": "u",
                                            "AWS_ACCESS_KEY_ID": "k", "MY_PROXY_CONF": "p", "LC_ALL": "C"}


def test_triggered_local_run_inherits_no_webhook_secret_when_started_by_the_default_launcher(
        tmp_path, monkeypatch):
    """A real delivery over HTTP -> the default launcher -> the real `launch_run` -> a detached process; the
    program started is a shell script (see the module docstring) that records its environment."""
    dump = tmp_path / "run-env.json"
    script = tmp_path / "fake-python"
    script.write_text(f"#!/bin/sh\n{sys.executable} -c 'import json, os; json.dump(dict(os.environ), "
                      f"open(\"{dump}.tmp\", \"w\"))' && mv {dump}.tmp {dump}\n")
    script.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(script))  # launch_run starts [sys.executable, -m, tailguard.cli ...]
    monkeypatch.setenv("TAILGUARD_WEBHOOK_SECRET", SECRET)
    monkeypatch.setenv("UNRELATED_API_TOKEN", "do-not-pass")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    config = TriggerConfig.load(write_config(tmp_path, secret_env="TAILGUARD_WEBHOOK_SECRET"))
    app = create_app(config, clock=time.time)  # default launcher, secret from the environment

    payload, headers = delivery(ts=time.time())
    with uvicorn_in_thread(app) as url:
        u = urlparse(url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=TIMEOUT_S * 3)
        conn.request("POST", "/webhook", body=payload.encode(), headers=headers)
        status, body = _answer(conn)
        conn.close()
    assert status == 202, body
    deadline = time.monotonic() + TIMEOUT_S
    while not dump.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    env = json.loads(dump.read_text())
    assert "TAILGUARD_WEBHOOK_SECRET" not in env and SECRET not in json.dumps(env)
    assert "UNRELATED_API_TOKEN" not in env
    assert env["PATH"] == os.environ["PATH"] and env["MLFLOW_TRACKING_URI"] == os.environ["MLFLOW_TRACKING_URI"]
    assert env["TAILGUARD_HOME"] == os.environ["TAILGUARD_HOME"]
