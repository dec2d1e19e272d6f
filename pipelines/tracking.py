"""MLflow location for a spec: the spec's tracking URI, or the embedded SQLite store under $TAILGUARD_HOME."""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

from tailguard.home import artifact_root, default_tracking_uri, quiet_environment


def tracking_uri_for(spec: Any | None = None) -> str:
    """Tracking URI: spec.mlflow.tracking_uri, else $MLFLOW_TRACKING_URI, else the embedded SQLite store."""
    if spec is not None and spec.mlflow.tracking_uri:
        return spec.mlflow.tracking_uri
    return os.environ.get("MLFLOW_TRACKING_URI") or default_tracking_uri()


def experiment_name_for(spec: Any) -> str:
    """Experiment name: spec.mlflow.experiment, else tailguard/<metadata.name>."""
    return spec.mlflow.experiment or f"tailguard/{spec.metadata.name}"


def configure(tracking_uri: str, experiment: str | None = None) -> str | None:
    """Point MLflow at `tracking_uri` (registry too) and make `experiment` current.

    A new experiment in a local store gets its artifacts under $TAILGUARD_HOME/artifacts (not ./mlruns).

    Returns:
        The experiment id, or None when no experiment was given.
    """
    quiet_environment()
    import mlflow

    mlflow.set_tracking_uri(tracking_uri)
    mlflow.set_registry_uri(tracking_uri)
    if experiment is None:
        return None
    client = mlflow.MlflowClient()
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        location = None
        if tracking_uri.startswith("sqlite:") or tracking_uri.startswith("file:"):
            location = (artifact_root() / experiment.replace("/", "_")).as_uri()
        exp_id = client.create_experiment(experiment, artifact_location=location)
    else:
        exp_id = exp.experiment_id
    mlflow.set_experiment(experiment_id=exp_id)
    return exp_id


@contextlib.contextmanager
def closing_run(client: Any, run_id: str) -> Iterator[str]:
    """End a run opened with `MlflowClient.create_run` when the block ends: FAILED when it raises (the exception
    propagates), FINISHED otherwise unless the block already ended the run. Yields `run_id`."""
    try:
        yield run_id
    except BaseException:
        client.set_terminated(run_id, "FAILED")
        raise
    if client.get_run(run_id).info.status == "RUNNING":
        client.set_terminated(run_id, "FINISHED")
