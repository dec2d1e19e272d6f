"""KFP component: torch -> ONNX export (checked against torch)."""

from kfp import dsl
from kfp.dsl import Input, Model, Output

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
