"""Task glue of the build-variant component."""

from __future__ import annotations

import json
from pathlib import Path

from tailguard.taskio import task_entry, write_json


@task_entry("build-variant")
def main(*, spec_yaml: str, variant_name: str, onnx_dir: str, out_dir: str) -> str:
    """Build variant `variant_name` from `onnx_dir/model.onnx` into `out_dir`.

    A variant that cannot be built here (no GPU for TensorRT, a quantizer failure) is returned with status
    skipped/failed and its reason; the run goes on with the other variants.

    Returns:
        JSON StepResult; `artifact` is the model file name relative to `out_dir`.
    """
    from tailguard.components.export.task import ONNX_FILE
    from tailguard.components.quantize.logic import build_variant
    from tailguard.data import load_calibration
    from tailguard.spec import spec_from_yaml

    spec = spec_from_yaml(spec_yaml)
    variant = next(v for v in spec.variants if v.name == variant_name)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    needs_calibration = variant.quantization is not None and variant.quantization.mode == "static"
    calibration = load_calibration(spec) if needs_calibration else None
    result = build_variant(variant, str(Path(onnx_dir) / ONNX_FILE), str(out), calibration=calibration,
                           model=spec.model, calibration_batch_size=spec.data.calibration.batch_size)
    if result.artifact:
        result.artifact = str(Path(result.artifact).resolve().relative_to(out.resolve()))
    d = result.to_dict()
    d["variant"] = variant_name
    write_json(out / "build.json", d)
    return json.dumps(d, default=str)
