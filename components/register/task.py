"""Task glue of the register-and-promote component."""

from __future__ import annotations

import json

from tailguard.core.taskio import task_entry


@task_entry("register-and-promote")
def main(*, spec_yaml: str, resolved_json: str, parent_run_id: str, tracking_uri: str) -> str:
    """Register the variants, promote the fastest passing one, log summary.json and close the parent run.

    Returns:
        The RunSummary as JSON. No passing variant is not an error here: the summary says so and the CLI
        exits 3; no alias moves.
    """
    import mlflow

    from tailguard.components.register.logic import ALIAS_VERSION_TAG, PROMOTION_TAG, register_and_promote
    from tailguard.core.spec import spec_from_yaml
    from tailguard.core.tracking import configure

    spec = spec_from_yaml(spec_yaml)
    resolved = json.loads(resolved_json)
    configure(tracking_uri)
    client = mlflow.MlflowClient()
    parent = client.get_run(parent_run_id)
    summary = register_and_promote(spec, parent_run_id=parent_run_id, experiment_id=parent.info.experiment_id,
                                   source_version=str(resolved["version"]), source_sha256=resolved.get("sha256"))
    d = summary.to_dict()
    client.log_dict(parent_run_id, d, "summary.json")
    client.set_tag(parent_run_id, "tailguard.promoted_variant", summary.promoted_variant or "none")
    client.set_tag(parent_run_id, "tailguard.promoted_version", summary.promoted_version or "none")
    client.set_tag(parent_run_id, "tailguard.outcome", "promoted" if summary.promoted_version else
                   "superseded" if summary.promotion == "superseded" else
                   ("no_passing_variant" if not summary.any_passed else "promotion_disabled"))
    if summary.promotion == "not_promoted":  # promoted / superseded: `promote` tagged the run under its lock
        client.set_tag(parent_run_id, PROMOTION_TAG, "not_promoted")
        client.set_tag(parent_run_id, ALIAS_VERSION_TAG, summary.alias_version or "none")
    client.set_terminated(parent_run_id, "FINISHED")
    return json.dumps(d, default=str)
