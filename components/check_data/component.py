"""KFP component: Great Expectations checks over the calibration and validation Parquet files."""

from kfp import dsl
from kfp.dsl import Artifact, Output

from tailguard.components.images import CPU_IMAGE


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def check_data(spec_yaml: str, report: Output[Artifact]) -> str:
    """Run the data-check suite; fail the task (DataCheckError, exit 1) when an expectation fails.

    Returns:
        JSON summary of the check (datasets, expectations evaluated, failures).
    """
    from tailguard.components.check_data.task import main

    return main(spec_yaml=spec_yaml, report_dir=report.path)
