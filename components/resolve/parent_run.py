"""The pipeline run's parent MLflow run: opened by resolve (task.py `main`) and by the re-decide task
(components/redecide), which imports it from here, not from resolve's task module."""

from __future__ import annotations

import hashlib
import os
from typing import Any

from tailguard.core.contract import (
    ALIAS_AT_START_TAG,
    KFP_RUN_TAG,
    LABEL_TAG_PREFIX,
    PARENT_TAG,
    RUNNER_HOST_TAG,
    RUNNER_PID_TAG,
    RUNNER_STARTED_TAG,
    SOURCE_FORMAT_TAG,
    SOURCE_MODEL_TAG,
    SOURCE_SHA256_TAG,
    SOURCE_VERSION_TAG,
    SPEC_SHA256_TAG,
    SPEC_TAG,
)
from tailguard.core.reference import alias_version

# Set by the local runner (tailguard.runner.run_local) in the environment its tasks inherit; recorded on the parent
# run so that a later local run can tell a run whose runner died (kill -9) from one still going. Absent on a cluster.
RUNNER_ENV = {"TAILGUARD_RUNNER_PID": RUNNER_PID_TAG, "TAILGUARD_RUNNER_HOST": RUNNER_HOST_TAG,
              "TAILGUARD_RUNNER_STARTED": RUNNER_STARTED_TAG}



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
