"""Task glue of the resolve component: resolve the registry version, open the parent MLflow run."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from tailguard.core.contract import (ALIAS_AT_START_TAG, KFP_RUN_TAG, LABEL_TAG_PREFIX, PARENT_TAG, RUNNER_HOST_TAG,
                                     RUNNER_PID_TAG, RUNNER_STARTED_TAG, SOURCE_FORMAT_TAG, SOURCE_MODEL_TAG,
                                     SOURCE_SHA256_TAG, SOURCE_VERSION_TAG, SPEC_SHA256_TAG, SPEC_TAG)
from tailguard.core.reference import alias_version
from tailguard.core.taskio import task_entry

# Set by the local runner (tailguard.runner.run_local) in the environment its tasks inherit; recorded on the parent
# run so that a later local run can tell a run whose runner died (kill -9) from one still going. Absent on a cluster.
RUNNER_ENV = {"TAILGUARD_RUNNER_PID": RUNNER_PID_TAG, "TAILGUARD_RUNNER_HOST": RUNNER_HOST_TAG,
              "TAILGUARD_RUNNER_STARTED": RUNNER_STARTED_TAG}


@task_entry("resolve")
def main(*, spec_yaml: str, tracking_uri: str, model_version: str, pipeline_run: str,
         out_dir: str, kfp_run: str = "") -> tuple[str, str]:
    """Resolve the FP32 reference into `out_dir` and create the parent run (status RUNNING).

    Returns:
        (resolved model JSON, parent run id).

    The spec.yaml artifact and the params of the parent run carry every URI with its credentials replaced by
    `***` (tailguard.core.redact).

    Raises:
        InputError: unknown registered model / version / alias, or a model file outside the downloaded folder or
        not a regular file (exit 2). UntrustedModelError: pickled model, or a class only the registry names,
        without `model.source.trusted` (exit 2).
    """
    import mlflow

    from tailguard.core.reference import resolve_reference
    from tailguard.core.spec import spec_from_yaml
    from tailguard.core.tracking import configure, experiment_name_for

    spec = spec_from_yaml(spec_yaml)
    exp_id = configure(tracking_uri, experiment_name_for(spec))
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    resolved = resolve_reference(spec, tracking_uri=tracking_uri, out_dir=Path(out_dir),
                                 version=model_version or None)
    run_id = open_parent_run(mlflow.MlflowClient(), exp_id, spec, spec_yaml, resolved, pipeline_run=pipeline_run,
                             kfp_run=kfp_run)
    d = resolved.to_dict()
    # Where the files sit inside the KFP artifact folder: later tasks see that folder at another path.
    d["artifact_subdir"] = str(Path(resolved.local_dir).resolve().relative_to(Path(out_dir).resolve()))
    return json.dumps(d, default=str), run_id


def open_parent_run(client: Any, exp_id: str, spec: Any, spec_yaml: str, resolved: Any, *, pipeline_run: str,
                    kfp_run: str = "", extra_tags: dict[str, str] | None = None) -> str:
    """Create the pipeline run's parent MLflow run (RUNNING) for the resolved reference: its tags (pipeline run,
    spec name and sha256, source model, version, format and sha256, labels, the local runner's pid / host / start
    time from the environment, the KFP job id, where the alias pointed at the start, `extra_tags`), the spec
    (credentials redacted) and its params. Used by resolve and by the re-decide task (components/redecide).

    Args:
        client: an MlflowClient. exp_id: the experiment. spec: the Spec. spec_yaml: its YAML as run.
        resolved: the `tailguard.core.reference.ResolvedModel`.

    Returns:
        The parent run's id.
    """
    from tailguard.core.redact import redact_spec_yaml, redact_text

    spec_hash = hashlib.sha256(spec_yaml.encode()).hexdigest()
    tags = {PARENT_TAG: pipeline_run or "", SPEC_TAG: spec.metadata.name,
            SPEC_SHA256_TAG: spec_hash, SOURCE_MODEL_TAG: spec.model.registered_name,
            SOURCE_VERSION_TAG: str(resolved.version), SOURCE_FORMAT_TAG: resolved.format,
            SOURCE_SHA256_TAG: resolved.sha256 or ""}
    tags.update({f"{LABEL_TAG_PREFIX}{k}": v for k, v in spec.metadata.labels.items()})
    tags.update({tag: os.environ[env] for env, tag in RUNNER_ENV.items() if os.environ.get(env)})
    if kfp_run:
        tags[KFP_RUN_TAG] = kfp_run
    tags.update(extra_tags or {})
    tags[ALIAS_AT_START_TAG] = alias_version(client, spec.optimized_model_name, spec.promotion.alias) or ""
    run = client.create_run(exp_id, run_name=f"{spec.metadata.name}-v{resolved.version}", tags=tags)
    # credentials in URIs (user:password@, ?token=) never reach the tracking store (tailguard.core.redact)
    client.log_text(run.info.run_id, redact_spec_yaml(spec_yaml), "spec.yaml")
    params = {"model.registered_name": spec.model.registered_name, "model.version": str(resolved.version),
              "variants": ",".join(v.name for v in spec.variants)}
    for key, value in params.items():
        client.log_param(run.info.run_id, key, redact_text(value))
    return run.info.run_id


@task_entry("fetch-reference")
def fetch_main(*, tracking_uri: str, model_json: str, version: str, sha256: str, out_dir: str,
               registry_uri: str = "") -> str:
    """Download the reference version that resolve found into `out_dir`: the pure twin of `main`.

    A pure step: it writes files and returns JSON, never MLflow runs or tags, so KFP may cache it on the cluster
    (its inputs are the concrete version and SHA-256, which do not change with gates or promotion). Under
    `tailguard run` the whole step is served from the local cache (tailguard.core.cache) when (tracking URI,
    registry URI, registered name, version, sha256, `model.source`) are unchanged; mlflow is imported only on a
    miss.

    Args:
        tracking_uri: MLflow tracking URI (also the registry URI unless `registry_uri` is given).
        model_json: the spec's `model` section as JSON (`ModelSpec`; `registered_name` and `source` are used).
        version: the concrete registry version resolve found (e.g. "3"; not "latest" or an alias).
        sha256: hex SHA-256 (64 chars) of the model file resolve found for that version.
        out_dir: the `reference` artifact folder (created).
        registry_uri: the spec's `mlflow.registry_uri` ('' = the tracking URI).

    Returns:
        The resolved model JSON (the shape of resolve's `resolved` output: format, version, sha256, files,
        artifact_subdir) plus "cached" (true: restored from the local cache, not downloaded).

    Raises:
        InputError: the downloaded model file's SHA-256 differs from `sha256` (names the version), or the
            version is gone from the registry (exit 2). UntrustedModelError: as resolve (exit 2).
    """
    from types import SimpleNamespace

    from tailguard.core.cache import cached_step
    from tailguard.core.spec.models import ModelSpec

    model = ModelSpec.model_validate_json(model_json)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    parts = {"tracking_uri": tracking_uri, "registry_uri": registry_uri or tracking_uri,
             "registered_name": model.registered_name, "version": str(version), "sha256": sha256,
             "source": model.source.model_dump(mode="json")}

    def fetch() -> dict[str, Any]:
        from tailguard.core.errors import InputError
        from tailguard.core.reference import resolve_reference

        # resolve_reference reads only `model` and `mlflow.registry_uri` of the spec
        view = SimpleNamespace(model=model, mlflow=SimpleNamespace(registry_uri=registry_uri or None))
        resolved = resolve_reference(view, tracking_uri=tracking_uri, out_dir=out, version=str(version))
        if resolved.sha256 != sha256:
            raise InputError(f"model.version: {model.registered_name!r} version {version}: the downloaded "
                             f"{resolved.model_file} has SHA-256 {resolved.sha256}, but resolve found {sha256} "
                             "in this pipeline run; the artifact changed while the pipeline ran",
                             hint="run the pipeline again (it resolves the version afresh), or check who "
                                  "rewrote the artifact store")
        d = resolved.to_dict()
        d["artifact_subdir"] = str(Path(resolved.local_dir).resolve().relative_to(out.resolve()))
        return d

    d = cached_step("fetch-reference", parts, out, fetch, label=f"fetch {model.registered_name} v{version}")
    return json.dumps(d, default=str)
