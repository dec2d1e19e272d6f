"""KFP component: the FP32 reference pass (reference outputs on the validation set, FP32 latency baselines)."""

from kfp import dsl
from kfp.dsl import Dataset, Input, Metrics, Model, Output

from tailguard.components.images import CPU_IMAGE


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def reference_pass(spec_yaml: str, resolved: str, reference: Input[Model], onnx_model: Input[Model],
                   outputs: Output[Dataset], metrics: Output[Metrics]) -> str:
    """Run the FP32 reference over the validation set and time the FP32 baselines (torch eager, ONNX FP32).

    Pure (artifacts only, no MLflow): register-and-promote logs the baselines and the calibration coverage to the
    parent run.

    Returns:
        JSON of the baselines: {"torch": perf per batch size or null, "onnx_fp32": perf per batch size, "rows",
        "cached"}.
    """
    from tailguard.components.reference.task import main

    return main(spec_yaml=spec_yaml, resolved_json=resolved, reference_dir=reference.path,
                onnx_dir=onnx_model.path, out_dir=outputs.path, metrics=metrics)
