"""KFP component: validate one variant against the FP32 reference and log its nested MLflow run."""

from kfp import dsl
from kfp.dsl import HTML, Dataset, Input, Metrics, Model, Output

from tailguard.components.images import CPU_IMAGE


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def validate_variant(spec_yaml: str, variant_name: str, build: str, baselines: str, parent_run_id: str,
                     tracking_uri: str, variant_model: Input[Model], reference_outputs: Input[Dataset],
                     reference_model: Input[Model], metrics: Output[Metrics], report: Output[HTML]) -> str:
    """Parity overall and per slice, latency, cost and gates for one variant; logs a nested MLflow run.

    `reference_model` (the export step's FP32 ONNX) is timed interleaved with the variant, so the speed ratio
    and its confidence bound come from paired rounds in this one process.

    Returns:
        JSON of the variant's result (status, metrics, gate verdicts, MLflow run id).
    """
    from tailguard.components.validate.task import main

    return main(spec_yaml=spec_yaml, variant_name=variant_name, build_json=build, baselines_json=baselines,
                parent_run_id=parent_run_id, tracking_uri=tracking_uri, variant_dir=variant_model.path,
                reference_dir=reference_outputs.path, metrics=metrics, report_path=report.path,
                reference_model_dir=reference_model.path)
