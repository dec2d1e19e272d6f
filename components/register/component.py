"""KFP component: register every built variant and promote the selected passing one by alias."""

from kfp import dsl
from kfp.dsl import Dataset, Input, Model

from tailguard.components.images import CPU_IMAGE


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def register_and_promote(spec_yaml: str, resolved: str, parent_run_id: str, tracking_uri: str, baselines: str,
                         reference_outputs: Input[Dataset], fetched: str, reference: Input[Model],
                         onnx_model: Input[Model]) -> str:
    """Log reference-pass's baselines and calibration coverage to the parent run, read the variants' nested runs,
    time the passing variants with torch eager (`fetched` / `reference`: fetch-reference's outputs) and the ONNX
    export (`onnx_model`) in one set of paired rounds, register each built variant, set the alias on the selected
    one.

    Returns:
        JSON run summary (per variant: status, speedups, latency, worst slice, gates; promoted version).
    """
    from tailguard.components.register.task import main

    return main(spec_yaml=spec_yaml, resolved_json=resolved, parent_run_id=parent_run_id,
                tracking_uri=tracking_uri, baselines_json=baselines, reference_dir=reference_outputs.path,
                fetched_json=fetched, model_dir=reference.path, onnx_dir=onnx_model.path)
