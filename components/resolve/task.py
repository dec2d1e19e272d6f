"""Task glue of the resolve component: resolve the registry version, open the parent MLflow run (`parent_run.py`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tailguard.core.taskio import task_entry


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

    from tailguard.components.resolve.parent_run import open_parent_run
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
    from tailguard.core.spec.model import ModelSpec

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
