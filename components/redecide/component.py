"""KFP component: a local gate-only re-run decided in one task (components/redecide/task.py)."""

from kfp import dsl
from kfp.dsl import Model, Output

from tailguard.components.images import CPU_IMAGE


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def redecide(spec_yaml: str, tracking_uri: str, model_version: str, pipeline_run: str, earlier: str,
             reference: Output[Model]) -> str:
    """Resolve the reference, decide every variant's new gates on the earlier run's stored measurements, log the
    runs, register and promote; or decide nothing and say why (the runner then runs the whole pipeline).

    Returns:
        JSON run summary (as register-and-promote's), or {"redecide_fallback": reason}.
    """
    from tailguard.components.redecide.task import main

    return main(spec_yaml=spec_yaml, tracking_uri=tracking_uri, model_version=model_version,
                pipeline_run=pipeline_run, earlier_json=earlier, out_dir=reference.path)
