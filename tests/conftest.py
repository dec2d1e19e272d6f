"""Shared test setup: no telemetry, offline model hubs, MLflow URIs that do not leak, a private $TAILGUARD_HOME
fixture."""

import os

for _k, _v in {"MLFLOW_DISABLE_TELEMETRY": "true", "GX_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1",
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
               "MLFLOW_ENABLE_ASYNC_LOGGING": "false"}.items():
    os.environ[_k] = _v

import pytest  # noqa: E402

from tailguard.core.hardware import gpu_unavailable_reason  # noqa: E402
from tailguard.core.runtime import tensorrt_unavailable_reason  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """Skip `requires_gpu` / `requires_tensorrt` tests where no GPU / TensorRT is present, with the reason."""
    gpu, trt = gpu_unavailable_reason(), tensorrt_unavailable_reason()
    for item in items:
        if gpu and "requires_gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=gpu))
        if trt and "requires_tensorrt" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=trt))


MLFLOW_URI_VARS = ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")


@pytest.fixture(autouse=True)
def _mlflow_uris_do_not_leak():
    """mlflow.set_tracking_uri / set_registry_uri also export MLFLOW_TRACKING_URI / MLFLOW_REGISTRY_URI into
    os.environ; a test that points MLflow at its own store must not send a later test's subprocesses (which
    inherit os.environ) to that store. Restores both variables after every test (module fixtures that set them
    restore their own, see test_search_pipeline.py)."""
    saved = {k: os.environ.get(k) for k in MLFLOW_URI_VARS}
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture
def private_home(tmp_path, monkeypatch):
    """A $TAILGUARD_HOME of the test's own, with no MLflow URI in the environment: `spec check` resolves
    model.registered_name in the local store when one exists, so a store another test of the session left in the
    default home must not decide a test that checks specs (use with pytest.mark.usefixtures("private_home"))."""
    monkeypatch.setenv("TAILGUARD_HOME", str(tmp_path / "private-home"))
    for k in MLFLOW_URI_VARS:
        monkeypatch.delenv(k, raising=False)
    return tmp_path / "private-home"
