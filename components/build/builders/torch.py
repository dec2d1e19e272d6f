"""The `torch` builder: a torch variant built from the registered FP32 torch reference (not from the ONNX
export), through the kernel's torch backend (tailguard.core.torch_backend).

Outcomes, as every builder's (BuildResult):
    ok        the artefact (program.pt2 or package.pt2) and its manifest `<artefact>.json` in out_dir; details hold
              the build facts: export and compile seconds, the dynamic axes as exported, the fingerprint (torch
              version, device, GPU name and compute capability or CPU model and ISA flags) and the source model's
              sha256, which the validate step checks again before loading.
    skipped   the node cannot run the variant (no CUDA device for device cuda, a CPU without bf16 kernels, no C++
              compiler for inductor / AOTInductor on CPU), or the reference is an ONNX model (no torch module to
              build from): the reason says which.
    failed    torch.export cannot capture the model (data-dependent control flow), the model's code fixes a named
              axis, or the compiler failed: torch's reason, the traceback in build.log; nothing else is left.
"""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from tailguard.components.build.registry import register_builder
from tailguard.core.results import BuildResult

if TYPE_CHECKING:  # pragma: no cover
    from tailguard.core.data import Dataset
    from tailguard.core.spec.model import ModelSpec
    from tailguard.core.spec.variants import VariantSpec

EXAMPLE_ROWS = 4  # rows of the export example: the longest calibration rows (>= 2 along every named axis)


def example_batch(rows: "Dataset", model: "ModelSpec") -> dict[str, np.ndarray]:
    """The export example: the EXAMPLE_ROWS longest rows of `rows`, padded together ({input: (batch, ...)}); a
    set of one row is repeated so that the batch axis has 2.

    Raises:
        InputError: `rows` is empty.
    """
    from tailguard.core.data import make_batch
    from tailguard.core.errors import InputError

    if rows.n_rows == 0:
        raise InputError("data.calibration: no rows to export the torch variant with",
                         hint="point data.calibration at a Parquet file with the model inputs")
    idx = np.argsort(-rows.lengths, kind="stable")[:EXAMPLE_ROWS]
    if idx.size == 1:
        idx = np.repeat(idx, 2)
    return make_batch(rows, idx, model.inputs, pad_values=model.pad_values)


@register_builder("torch", source="torch")
def compile_torch(variant: "VariantSpec", load_module: Callable[[], Any], out_dir: str | Path, *,
                  calibration: "Dataset", model: "ModelSpec", source_sha256: str,
                  reference_format: str = "state_dict") -> BuildResult:
    """Build a torch variant into `out_dir` (module docstring for the outcomes).

    Args:
        variant: the spec's torch variant.
        load_module: returns the FP32 reference as a torch.nn.Module (`tailguard.core.reference.load_torch_reference`);
            called only when the node can build the variant.
        out_dir: folder for the artefact, its manifest and build.log (created).
        calibration: rows to take the export example from (`data.calibration`).
        model: the spec's model section (inputs with named axes, pad values).
        source_sha256: the reference's digest (recorded in the manifest; validate checks it).
        reference_format: the reference's format (`ResolvedModel.format`); "onnx" cannot be built with torch.

    Returns:
        BuildResult ok / skipped / failed.
    """
    from tailguard.core.torch_backend import TorchBuildError, build_torch_variant, config_of, unavailable_reason

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = config_of(variant)
    details: dict[str, Any] = {"backend": "torch", "precision": variant.precision, "compile": config.compile,
                               "device": config.device, "cuda_graphs": config.cuda_graphs,
                               "source_sha256": source_sha256}
    if reference_format == "onnx":
        return BuildResult("skipped", reason=(f"torch variant {variant.name}: the registered reference is an ONNX "
                                             "model; the torch backend builds from a torch reference (state dict, "
                                             "torch.export program or trusted pickle)"), details=details)
    reason = unavailable_reason(config)
    if reason:
        return BuildResult("skipped", reason=f"torch variant {variant.name}: {reason}", details=details)
    log = out / "build.log"
    try:
        build = build_torch_variant(load_module(), example_batch(calibration, model), model.inputs, config, out,
                                    source_sha256=source_sha256)
    except TorchBuildError as exc:
        log.write_text(traceback.format_exc())
        return BuildResult("failed", reason=f"torch variant {variant.name}: {exc.message}"
                          + (f" (fix: {exc.hint})" if exc.hint else "") + f" (log: {log})", details=details)
    except Exception as exc:  # an op without a kernel, an out-of-memory, a compiler crash: the variant fails
        log.write_text(traceback.format_exc())
        first = str(exc).strip().splitlines()[0][:400] if str(exc).strip() else ""
        return BuildResult("failed", reason=f"torch variant {variant.name}: {type(exc).__name__}: {first} "
                                           f"(log: {log})", details=details)
    details.update({k: v for k, v in build.details.items() if k not in ("config",)})
    details["build_seconds"] = round(build.export_seconds + build.compile_seconds, 3)
    return BuildResult("ok", artifact=str(build.path), details=details)
