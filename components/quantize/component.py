"""KFP component: build one variant (ONNX Runtime graph optimization / FP16 / INT8; TensorRT on GPU pools)."""

from kfp import dsl
from kfp.dsl import Input, Model, Output

from tailguard.components.images import CPU_IMAGE


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def build_variant(spec_yaml: str, variant_name: str, onnx_model: Input[Model], variant_model: Output[Model]) -> str:
    """Quantize/compile the FP32 ONNX model into variant `variant_name`.

    Returns:
        JSON StepResult: status ok | failed | skipped, reason, artifact file name, build details.
    """
    from tailguard.components.quantize.task import main

    return main(spec_yaml=spec_yaml, variant_name=variant_name, onnx_dir=onnx_model.path,
                out_dir=variant_model.path)
