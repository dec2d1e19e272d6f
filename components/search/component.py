"""KFP component: accuracy-driven mixed-precision search for one INT8 variant (runs after its validation)."""

from kfp import dsl
from kfp.dsl import Dataset, Input, Metrics, Model, Output

from tailguard.components.images import CPU_IMAGE


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def search_variant(spec_yaml: str, variant_name: str, validation: str, baselines: str, parent_run_id: str,
                   tracking_uri: str, onnx_model: Input[Model], reference_outputs: Input[Dataset],
                   searched_model: Output[Model], metrics: Output[Metrics]) -> str:
    """Search quantization configurations of `variant_name` for the fastest one passing every gate.

    Runs only when the variant failed its gates (search.when: on_failure) or always (search.when: always).
    Each trial is a nested MLflow run under the variant's run; the chosen trial becomes the candidate
    '<variant>-searched' that register-and-promote registers and may promote.

    Returns:
        JSON of the search (status, trials with the Pareto front, chosen trial, stopped_by, MLflow run ids).
    """
    from tailguard.components.search.task import main

    return main(spec_yaml=spec_yaml, variant_name=variant_name, validation_json=validation,
                baselines_json=baselines, parent_run_id=parent_run_id, tracking_uri=tracking_uri,
                onnx_dir=onnx_model.path, reference_dir=reference_outputs.path, out_dir=searched_model.path,
                metrics=metrics)
