"""Where local state lives: $TAILGUARD_HOME (default ./.tailguard) holds the embedded MLflow store
(mlflow.db, a SQLite tracking + registry store), its artifacts, and per-run working folders."""

from __future__ import annotations

import os
from pathlib import Path

ENV_HOME = "TAILGUARD_HOME"


def home() -> Path:
    """$TAILGUARD_HOME as an absolute path (created), default ./.tailguard."""
    p = Path(os.environ.get(ENV_HOME, ".tailguard")).resolve()
    p.mkdir(parents=True, exist_ok=True)
    return p


def default_tracking_uri() -> str:
    """sqlite:///$TAILGUARD_HOME/mlflow.db (tracking and registry)."""
    return f"sqlite:///{home() / 'mlflow.db'}"


def artifact_root() -> Path:
    """Artifact root for experiments created in the embedded store."""
    p = home() / "artifacts"
    p.mkdir(parents=True, exist_ok=True)
    return p


def quiet_environment() -> None:
    """Turn off telemetry and chatty logs of MLflow, Great Expectations and friends (idempotent)."""
    for k, v in {"MLFLOW_DISABLE_TELEMETRY": "true", "GX_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1",
                 "MLFLOW_ENABLE_ASYNC_LOGGING": "false",
                 "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false", "TOKENIZERS_PARALLELISM": "false",
                 "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}.items():
        os.environ.setdefault(k, v)
