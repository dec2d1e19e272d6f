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
    if (result.status == "ok" and spec.analysis.sensitivity.enabled and variant.precision == "int8"
            and variant.backend == "onnxruntime" and variant.search is None):
        _sensitivity(spec, variant, Path(onnx_dir) / ONNX_FILE, out, calibration)
    d = result.to_dict()
    d["variant"] = variant_name
    write_json(out / "build.json", d)
    return json.dumps(d, default=str)


def _sensitivity(spec, variant, fp32_onnx: Path, out: Path, calibration) -> None:
    """analysis.sensitivity: rank the variant's quantizable nodes (components/search/sensitivity.py) into
    out/sensitivity/ (sensitivity.csv, sensitivity.png); the validate task logs that folder to the variant's run.
    Variants with a search get the same ranking from the search task instead."""
    import tempfile

    from tailguard.components.search.logic import write_sensitivity_artifacts
    from tailguard.components.search.sensitivity import node_sensitivity
    from tailguard.data import load_calibration

    rows = calibration if calibration is not None else load_calibration(spec)
    with tempfile.TemporaryDirectory(prefix=f"sensitivity-{variant.name}-") as work:
        table = node_sensitivity(variant, fp32_onnx, rows, spec.model, samples=spec.analysis.sensitivity.samples,
                                 work_dir=Path(work), batch_size=spec.data.calibration.batch_size)
    write_sensitivity_artifacts(table, out / "sensitivity")
