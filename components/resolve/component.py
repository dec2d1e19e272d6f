"""KFP component: fetch the FP32 reference version from the MLflow registry and open the parent run."""

from typing import NamedTuple

from kfp import dsl
from kfp.dsl import Model, Output

from tailguard.components.images import CPU_IMAGE


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def resolve(spec_yaml: str, tracking_uri: str, model_version: str, pipeline_run: str,
            reference: Output[Model], kfp_run: str = "") -> NamedTuple("ResolveOutputs", [("resolved", str), ("parent_run_id", str)]):
    """Resolve `model.registered_name` at `model_version` ('' = the spec's), refuse untrusted pickles.

    `kfp_run` (the KFP job id) is recorded on the parent run: the exit handler (components/finalize) finds the
    run by it.

    Returns:
        resolved: JSON of the resolved model (format, version, sha256, files).
        parent_run_id: the MLflow parent run every variant's run nests under.
    """
    from collections import namedtuple

    from tailguard.components.resolve.task import main

    resolved, parent = main(spec_yaml=spec_yaml, tracking_uri=tracking_uri, model_version=model_version,
                            pipeline_run=pipeline_run, out_dir=reference.path, kfp_run=kfp_run)
    return namedtuple("ResolveOutputs", ["resolved", "parent_run_id"])(resolved, parent)
