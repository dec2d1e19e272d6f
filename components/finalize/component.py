"""KFP component: the pipeline's exit handler. Closes the parent MLflow run when the pipeline did not.

It runs after every other task, whether they succeeded or not (`dsl.ExitHandler`). A KFP exit task may take only
pipeline parameters and placeholders, never another task's output, so it finds the parent run by the KFP job id
that resolve recorded on it (`tailguard.kfp_run`).
"""

from kfp import dsl

from tailguard.components.images import CPU_IMAGE


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def finalize_run(spec_yaml: str, tracking_uri: str, kfp_run: str, status: dsl.PipelineTaskFinalStatus) -> None:
    """Mark the parent run FAILED, with the error in its description, unless register-and-promote closed it.

    Args:
        kfp_run: the pipeline job id (dsl.PIPELINE_JOB_ID_PLACEHOLDER), as recorded by resolve.
        status: the final status of the exit handler's group (state, error message, job resource name).
    """
    from tailguard.components.finalize.task import main

    main(spec_yaml=spec_yaml, tracking_uri=tracking_uri, kfp_run=kfp_run, state=status.state,
         error_message=status.error_message or "", job=status.pipeline_job_resource_name or "")
