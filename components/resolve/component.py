"""KFP components: resolve (find the FP32 reference version in the MLflow registry, open the parent run) and
fetch-reference (download that exact version: the pure input of export and reference-pass)."""

from typing import NamedTuple

from kfp import dsl
from kfp.dsl import Model, Output

from tailguard.components.images import CPU_IMAGE


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def resolve(spec_yaml: str, tracking_uri: str, model_version: str, pipeline_run: str,
            reference: Output[Model], kfp_run: str = "") -> NamedTuple(
        "ResolveOutputs", [("resolved", str), ("parent_run_id", str), ("version", str), ("sha256", str)]):
    """Resolve `model.registered_name` at `model_version` ('' = the spec's), refuse untrusted pickles.

    `kfp_run` (the KFP job id) is recorded on the parent run: the exit handler (components/finalize) finds the
    run by it.

    Returns:
        resolved: JSON of the resolved model (format, version, sha256, files).
        parent_run_id: the MLflow parent run every variant's run nests under.
        version: the concrete registry version (e.g. "3"), for fetch-reference.
        sha256: hex SHA-256 of the model file of that version, for fetch-reference.
    """
    import json
    from collections import namedtuple

    from tailguard.components.resolve.task import main

    resolved, parent = main(spec_yaml=spec_yaml, tracking_uri=tracking_uri, model_version=model_version,
                            pipeline_run=pipeline_run, out_dir=reference.path, kfp_run=kfp_run)
    d = json.loads(resolved)
    return namedtuple("ResolveOutputs", ["resolved", "parent_run_id", "version", "sha256"])(
        resolved, parent, str(d["version"]), d.get("sha256") or "")


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def fetch_reference(tracking_uri: str, model_json: str, version: str, sha256: str, registry_uri: str,
                    reference: Output[Model]) -> NamedTuple("FetchOutputs", [("resolved", str)]):
    """Download version `version` of the reference (the spec's `model` section, JSON) and check its SHA-256.

    Pure (no MLflow writes): its inputs are the concrete version and SHA-256 resolve found, so a re-run after a
    gate change hits KFP's cache, and export and reference-pass, which read its artifact, can hit too.

    Returns:
        resolved: JSON of the resolved model (the shape of resolve's `resolved`), plus "cached".
    """
    from collections import namedtuple

    from tailguard.components.resolve.task import fetch_main

    resolved = fetch_main(tracking_uri=tracking_uri, model_json=model_json, version=version, sha256=sha256,
                          out_dir=reference.path, registry_uri=registry_uri)
    return namedtuple("FetchOutputs", ["resolved"])(resolved)
