"""MLflow location for a spec: the spec's tracking URI, or the embedded SQLite store under $TAILGUARD_HOME."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from tailguard.core.contract import FAILURE_MESSAGE_TAG, FAILURE_TAG, NOTE_TAG, OUTCOME_TAG
from tailguard.core.home import artifact_root, default_tracking_uri, home, quiet_environment
from tailguard.core.results import RunOutcome

if TYPE_CHECKING:
    from tailguard.core.spec.root import Spec

_INITIALISED: set[str] = set()  # tracking URIs this process has initialised (tables created, under the lock)


def tracking_uri_for(spec: Any | None = None) -> str:
    """Tracking URI: spec.mlflow.tracking_uri, else $MLFLOW_TRACKING_URI, else the embedded SQLite store."""
    if spec is not None and spec.mlflow.tracking_uri:
        return spec.mlflow.tracking_uri
    return os.environ.get("MLFLOW_TRACKING_URI") or default_tracking_uri()


def experiment_name_for(spec: Spec) -> str:
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
    init_store(tracking_uri)
    if experiment is None:
        return None
    client = mlflow.MlflowClient()
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        location = None
        if is_local_store(tracking_uri):
            location = (artifact_root() / experiment.replace("/", "_")).as_uri()
        with store_lock(tracking_uri, "experiments"):
            exp = client.get_experiment_by_name(experiment)  # another process may have created it meanwhile
            exp_id = exp.experiment_id if exp is not None else \
                client.create_experiment(experiment, artifact_location=location)
    else:
        exp_id = exp.experiment_id
    mlflow.set_experiment(experiment_id=exp_id)
    return exp_id


def is_local_store(tracking_uri: str) -> bool:
    """A store on this machine's disk (sqlite: or file:): processes sharing it can coordinate with file locks."""
    return tracking_uri.startswith("sqlite:") or tracking_uri.startswith("file:")


@contextlib.contextmanager
def store_lock(tracking_uri: str, name: str) -> Iterator[Path | None]:
    """An exclusive fcntl lock $TAILGUARD_HOME/locks/<name>.lock held for the block, for a local store only.

    Processes of one machine sharing a local (SQLite / file) store serialize store initialisation, experiment
    creation and alias promotion with it. A remote store (a tracking server) gets no lock: yields None.
    """
    if not is_local_store(tracking_uri):
        yield None
        return
    import fcntl

    path = home() / "locks" / f"{name}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield path
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def init_store(tracking_uri: str) -> None:
    """Create the tables of a local SQLite store once, under a file lock, before anything else touches them.

    Several processes opening a fresh SQLite store at once (trigger-launched runs, parallel tasks) otherwise race
    in MLflow's table creation ("table ... already exists"). Idempotent and cheap after the first call of a
    process; a no-op for other stores (a tracking server initialises its own database).
    """
    if not tracking_uri.startswith("sqlite:") or tracking_uri in _INITIALISED:
        return
    import mlflow

    with store_lock(tracking_uri, "store-init"):
        client = mlflow.MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
        client.search_experiments(max_results=1)  # tracking store: creates / migrates the tables
        client.search_registered_models(max_results=1)  # registry store (same database)
    _INITIALISED.add(tracking_uri)


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


def fail_parent_run(client: Any, experiment_id: str, run_id: str, note: str, failure: str) -> None:
    """Mark a parent run and its still-running children FAILED, with `note` as the parent's description.

    Args:
        client: an `mlflow.MlflowClient`.
        experiment_id / run_id: the parent run.
        note: the description (mlflow.note.content): why it failed, in words.
        failure: a short code for the `tailguard.failure` tag (error, interrupted, runner_died, kfp_failed...).
    """
    client.set_tag(run_id, OUTCOME_TAG, RunOutcome.FAILED)
    client.set_tag(run_id, FAILURE_TAG, failure)
    client.set_tag(run_id, NOTE_TAG, note)
    client.set_terminated(run_id, "FAILED")
    for child in client.search_runs([experiment_id], filter_string=f"tags.mlflow.parentRunId = '{run_id}'",
                                    max_results=1000):
        if child.info.status == "RUNNING":
            client.set_terminated(child.info.run_id, "FAILED")


def record_task_failure(tracking_uri: str, parent_run_id: str, message: str) -> None:
    """Best effort: put a failing task's error on its parent run (`tailguard.failure_message`), unless an earlier
    task already did, so that a cluster run's exit handler can write it into the run's description.
    Never raises (the task's own error must not be hidden by bookkeeping)."""
    try:
        import mlflow

        mlflow.set_tracking_uri(tracking_uri)
        client = mlflow.MlflowClient()
        if FAILURE_MESSAGE_TAG not in client.get_run(parent_run_id).data.tags:
            client.set_tag(parent_run_id, FAILURE_MESSAGE_TAG, message[:4000])
    except Exception:
        pass
