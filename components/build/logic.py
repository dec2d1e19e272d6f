"""Build one inference variant from the FP32 ONNX reference: the dispatch to its backend's builder.

One entry point, `build_variant`, dispatches through the entry the builder registry (`registry.py`) holds for the
variant's backend: `builders/onnxruntime.py` builds every ONNX Runtime variant, `builders/tensorrt.py` TensorRT
engines (skipped, with the reason, where no GPU / TensorRT is present). Both build from the ONNX export; the
`torch` builder (`builders/torch.py`) builds from the registered torch reference and is called by the task's
`torch_main` instead. Each builder returns a `BuildResult` with a status (ok / failed / skipped, with the reason).
Within one `build_variant` call each ONNX graph file is parsed once (`onnx_files._graph_scope`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from tailguard.components.build.onnx_files import _graph_scope
from tailguard.components.build.registry import get_builder
from tailguard.core.results import BuildResult

if TYPE_CHECKING:  # tailguard.core.data imports pandas: a build that reads no calibration rows never loads it
    from tailguard.core.data import Dataset
    from tailguard.core.spec.model import ModelSpec
    from tailguard.core.spec.variants import VariantSpec


def build_variant(variant: VariantSpec, fp32_onnx: str | Path, out_dir: str | Path, *, calibration: Dataset | None,
                  model: ModelSpec, calibration_batch_size: int = 8, profile: dict | None = None) -> BuildResult:
    """Build one variant from the FP32 ONNX reference, through the builder registered for its backend.

    Args:
        variant: `tailguard.core.spec.variants.VariantSpec`.
        fp32_onnx: the FP32 reference .onnx file (the checked export).
        out_dir: folder for the variant's files (created): `<variant.name>.onnx`, `build.log` (the tools' output;
            the traceback on failure), `reproduce.sh` with `variant.json` and `model.json`, and
            `calibration.parquet` (the exact calibration rows) for static INT8.
        calibration: calibration rows (needed by static INT8 only; `tailguard.core.data.load_dataset`).
        model: `tailguard.core.spec.model.ModelSpec` (inputs, pad_values).
        calibration_batch_size: rows per calibration batch (`spec.data.calibration.batch_size`).
        profile: the TensorRT optimization profile (`profiles.spec_profile`) of a variant on backend tensorrt
            or on TensorrtExecutionProvider; None for the others.

    Returns:
        BuildResult: ok (artifact = the .onnx file, details = facts of the build), failed (ORT tooling broke for
        this variant; reason and log path), or skipped (execution provider / GPU / TensorRT missing; reason).

    Raises:
        InputError: `fp32_onnx` is missing or not an ONNX file, or a static INT8 variant gets no calibration rows.
        UnknownBuilderError: no builder is registered for the variant's backend.
        ValueError: the backend's builder builds from the torch reference (backend torch: the task's
            `torch_main`), not from the ONNX export.
    """
    builder = get_builder(variant.backend)
    if builder.source != "onnx":
        raise ValueError(f"variant {variant.name}: the {variant.backend} builder builds from the "
                         f"{builder.source} reference, not from an ONNX file; build it with the build-<variant> "
                         "task's torch_main (components/build/task.py)")
    with _graph_scope():  # each graph file parsed once by this build (`_graph`)
        return builder.build(variant, fp32_onnx, out_dir, calibration=calibration, model=model,
                             calibration_batch_size=calibration_batch_size, profile=profile)
