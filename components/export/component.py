"""KFP components: torch -> ONNX export (checked against torch), and the FP32 reference pass."""

from kfp import dsl
from kfp.dsl import Dataset, Input, Metrics, Model, Output

from tailguard.components.images import CPU_IMAGE


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def export(spec_yaml: str, resolved: str, reference: Input[Model], onnx_model: Output[Model]) -> str:
    """Export the reference to ONNX with named dynamic axes and check every output against torch.

    Returns:
        JSON facts of the export (exporter, opset, nodes, bytes, max abs diff per output).
    """
    from tailguard.components.export.task import main

    return main(spec_yaml=spec_yaml, resolved_json=resolved, reference_dir=reference.path,
                out_dir=onnx_model.path)


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def reference_pass(spec_yaml: str, resolved: str, parent_run_id: str, tracking_uri: str,
                   reference: Input[Model], onnx_model: Input[Model], outputs: Output[Dataset],
                   metrics: Output[Metrics]) -> str:
    """Run the FP32 reference over the validation set and time the FP32 baselines (torch eager, ONNX FP32).

    Returns:
        JSON of the baselines: {"torch": perf per batch size or null, "onnx_fp32": perf per batch size}.
    """
    from tailguard.components.export.task import reference_main

    return reference_main(spec_yaml=spec_yaml, resolved_json=resolved, parent_run_id=parent_run_id,
                          tracking_uri=tracking_uri, reference_dir=reference.path, onnx_dir=onnx_model.path,
                          out_dir=outputs.path, metrics=metrics)
