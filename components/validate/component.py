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


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def validate_variant_on_target(spec_yaml: str, variant_name: str, target_name: str, placement: str, build: str,
                               baselines: str, parent_run_id: str, tracking_uri: str, variant_model: Input[Model],
                               reference_outputs: Input[Dataset], reference_model: Input[Model],
                               metrics: Output[Metrics], report: Output[HTML]) -> str:
    """`validate_variant` on one serving target (spec `serving_targets`): the same validation, run on the target's
    node pool, after checking this node against the target's `expect` (a node that differs validates nothing:
    skipped, with the differences).

    Args:
        target_name: the serving target's name (spec `serving_targets[].name`).
        placement: "node_pool" (a cluster run: the task was scheduled on the target's pool) or "this_node" (a
            local run: every target's task runs on this node).

    Returns:
        JSON of the variant's result on this target (status, metrics, gate verdicts, MLflow run id).
    """
    from tailguard.components.validate.task import main

    return main(spec_yaml=spec_yaml, variant_name=variant_name, build_json=build, baselines_json=baselines,
                parent_run_id=parent_run_id, tracking_uri=tracking_uri, variant_dir=variant_model.path,
                reference_dir=reference_outputs.path, metrics=metrics, report_path=report.path,
                reference_model_dir=reference_model.path, target_name=target_name, placement=placement)
