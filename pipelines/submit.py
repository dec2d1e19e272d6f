"""Submit a spec's pipeline to a KFP cluster (kfp.Client), idempotent per (model, version, spec hash).

The run's display name carries the key `tg-<model>-v<version>-<spec sha256[:12]>`; before creating a run,
the experiment's runs are searched for that name, and a run that exists and did not fail is returned
instead of starting a second one. `<version>` is always a concrete version number: `latest` and `@alias` are
resolved in the MLflow registry first (`concrete_version`), so a new version submitted as `latest` gets a new
key and a new run, and the run is started with that number (not the moving `latest`). The model version is a
run parameter; secrets are never parameters (they reach the pods as Kubernetes secret references, see
`kubeflow.secrets`).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from tailguard.core.errors import InputError
from tailguard.core.spec import dump_spec
from tailguard.core.spec.root import Spec

FAILED_STATES = {"FAILED", "CANCELED", "CANCELING", "SKIPPED"}


def run_key(spec: Spec, model_version: str) -> str:
    """Idempotency key: tg-<registered name>-v<version>-<sha256 of the spec YAML, 12 hex>.

    `model_version` must be a concrete version number (see `concrete_version`): a key on the literal `latest`
    or `@alias` would name every version the reference ever has.
    """
    if not str(model_version).isdigit():
        raise ValueError(f"run_key needs a concrete version number, got {model_version!r} "
                         "(resolve it with concrete_version)")
    digest = hashlib.sha256(dump_spec(spec).encode()).hexdigest()[:12]
    return f"tg-{spec.model.registered_name}-v{model_version}-{digest}"


def concrete_version(spec: Spec, version: str, tracking_uri: str) -> str:
    """The version number `version` names now: a number as is; `latest` / `@alias` looked up in the MLflow
    registry (spec `mlflow.registry_uri`, else `tracking_uri`) as the pipeline's resolve step does
    (`tailguard.core.reference.resolve_version`).

    Raises:
        InputError: unknown model, version or alias, or a registry that cannot be reached (hint: pass
            --model-version <number>).
    """
    version = str(version).strip()
    if version.isdigit():
        return version
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    from tailguard.core.reference import resolve_version

    registry = spec.mlflow.registry_uri or tracking_uri
    try:
        mv = resolve_version(MlflowClient(tracking_uri=tracking_uri, registry_uri=registry),
                             spec.model.registered_name, version)
    except InputError:
        raise
    except (MlflowException, OSError) as exc:
        raise InputError(f"model.version: cannot resolve {version!r} of {spec.model.registered_name!r} in the "
                         f"registry at {registry}: {exc}",
                         hint="the submit key needs the concrete version; make the registry reachable from "
                              "here, or pass --model-version <number>") from None
    return str(mv.version)


def make_client(host: str) -> Any:
    """The one seam to the cluster: a kfp.Client for `host` (tests replace this function)."""
    import kfp

    return kfp.Client(host=host)


def submit(spec: Spec, *, host: str, model_version: str | None = None, experiment: str | None = None,
           tracking_uri: str | None = None) -> str:
    """Compile and submit, or return the existing run for the same (model, version, spec).

    Args:
        spec: validated spec.
        host: KFP API endpoint.
        model_version: overrides spec.model.version ("latest", a number, "@alias"; resolved to a number first).
        experiment: KFP experiment (default kubeflow.experiment, else tailguard-<metadata.name>).
        tracking_uri: MLflow URI the pods use (default spec.mlflow.tracking_uri, else $MLFLOW_TRACKING_URI).

    Returns:
        The KFP run id.

    Raises:
        InputError: no MLflow tracking URI a cluster could reach (the embedded SQLite store is local only), or
            `latest` / `@alias` that does not resolve in the registry (`concrete_version`).
    """
    from tailguard.pipeline import compile_pipeline

    version = model_version or spec.model.version
    uri = tracking_uri or spec.mlflow.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", "")
    if not uri or uri.startswith("sqlite:") or uri.startswith("file:"):
        raise InputError("mlflow.tracking_uri: a cluster run needs an MLflow tracking server URI "
                         f"(got {uri or 'none'})", hint="set mlflow.tracking_uri in the spec, e.g. "
                                                        "http://mlflow.mlflow.svc:5000")
    version = concrete_version(spec, version, uri)  # the key and the run name one version, not `latest`
    client = make_client(host)
    exp_name = experiment or spec.kubeflow.experiment or f"tailguard-{spec.metadata.name}"
    key = run_key(spec, version)
    exp = client.create_experiment(name=exp_name) if _find_experiment(client, exp_name) is None \
        else _find_experiment(client, exp_name)
    exp_id = getattr(exp, "experiment_id", None) or exp.id
    existing = _find_run(client, exp_id, key)
    if existing is not None:
        return existing
    with tempfile.TemporaryDirectory() as tmp:
        package = str(Path(tmp) / "pipeline.yaml")
        compile_pipeline(spec, package)
        run = client.create_run_from_pipeline_package(
            package, arguments={"spec_yaml": dump_spec(spec), "tracking_uri": uri, "model_version": version,
                                "pipeline_run": key},
            run_name=key, experiment_id=exp_id, enable_caching=False)
    return getattr(run, "run_id", None) or run.run_info.id


def _find_experiment(client: Any, name: str) -> Any | None:
    try:
        return client.get_experiment(experiment_name=name)
    except Exception:  # kfp raises ValueError / ApiException when missing
        return None


def _find_run(client: Any, experiment_id: str, key: str) -> str | None:
    flt = json.dumps({"predicates": [{"key": "display_name", "operation": "EQUALS", "string_value": key}]})
    resp = client.list_runs(experiment_id=experiment_id, filter=flt, page_size=50)
    for run in getattr(resp, "runs", None) or []:
        if str(getattr(run, "state", "")).upper() not in FAILED_STATES:
            return run.run_id
    return None
