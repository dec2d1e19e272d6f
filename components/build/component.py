"""KFP components: build one variant (ONNX Runtime graph optimization / FP16 / INT8; TensorRT on GPU pools; torch
eager / inductor / AOTInductor from the torch reference)."""

from kfp import dsl
from kfp.dsl import Input, Model, Output

from tailguard.components.images import CPU_IMAGE


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def build_variant(spec_yaml: str, variant_name: str, onnx_model: Input[Model], variant_model: Output[Model]) -> str:
    """Quantize/compile the FP32 ONNX model into variant `variant_name`.

    Returns:
        JSON BuildResult: status ok | failed | skipped, reason, artifact file name, build details.
    """
    from tailguard.components.build.task import main

    return main(spec_yaml=spec_yaml, variant_name=variant_name, onnx_dir=onnx_model.path,
                out_dir=variant_model.path)


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def build_torch_variant(spec_yaml: str, variant_name: str, resolved: str, reference: Input[Model],
                        variant_model: Output[Model]) -> str:
    """Build torch variant `variant_name` (eager / inductor / AOTInductor) from the registered torch reference.

    Returns:
        JSON BuildResult: status ok | failed | skipped, reason, artifact file name (program.pt2 or package.pt2),
        build details (export and compile seconds, fingerprint).
    """
    from tailguard.components.build.task import torch_main

    return torch_main(spec_yaml=spec_yaml, variant_name=variant_name, resolved_json=resolved,
                      reference_dir=reference.path, out_dir=variant_model.path)
