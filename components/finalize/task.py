"""Task glue of the finalize (exit handler) component."""

from __future__ import annotations

from tailguard.core.taskio import task_entry


@task_entry("finalize")
def main(*, spec_yaml: str, tracking_uri: str, kfp_run: str, state: str, error_message: str = "",
         job: str = "") -> list[str]:
    """Close the parent run(s) of KFP job `kfp_run` that are still RUNNING: FAILED, with the first task error
    (`tailguard.failure_message`, recorded by the failing task) or KFP's message as the run's description.

    A run that register-and-promote closed (FINISHED) is left as it is. A pipeline that KFP reports SUCCEEDED but
    whose parent run is still RUNNING cannot happen through register-and-promote; it is marked FAILED too, since
    no decision was recorded.

    Args:
        state: KFP's final state of the exit handler's group (SUCCEEDED, FAILED, CANCELED, ...).
        error_message: KFP's error message for the group ("" on success).
        job: the KFP pipeline job resource name, for the note.

    Returns:
        The parent run ids marked FAILED.
    """
    import mlflow

    from tailguard.core.contract import FAILURE_MESSAGE_TAG, KFP_RUN_TAG
    from tailguard.core.spec import spec_from_yaml
    from tailguard.core.tracking import configure, experiment_name_for, fail_parent_run

    spec = spec_from_yaml(spec_yaml)
    exp_id = configure(tracking_uri, experiment_name_for(spec))
    client = mlflow.MlflowClient()
    marked = []
    for run in client.search_runs([exp_id], filter_string=f"tags.`{KFP_RUN_TAG}` = '{kfp_run}'"):
        if run.info.status != "RUNNING":
            continue
        cause = run.data.tags.get(FAILURE_MESSAGE_TAG) or error_message or "no task reported an error"
        where = f"KFP pipeline job {job or kfp_run}"
        note = (f"Failed: {cause}\n\n{where} ended {state}; the exit handler marked this run FAILED. "
                "No alias moved. See the failed task's logs in the KFP UI.")
        fail_parent_run(client, exp_id, run.info.run_id, note,
                        "kfp_canceled" if state.upper().startswith("CANCEL") else "kfp_failed")
        marked.append(run.info.run_id)
    return marked
