"""Named INT8 quantization presets: plain data, each with the hardware constraint behind its choices.

A preset is a dict of `tailguard.spec.QuantizationSpec` fields (tailguard.core.presets); a spec selects one with
`quantization: {preset: <name>}`, and `quantization_preset(name, **overrides)` builds the same from Python. Sources: ONNX Runtime's `quantize_static` docstring ("Choosing parameters for CPU
inference", onnxruntime/quantization/quantize.py) and the TensorRT developer guide (explicit quantization: QDQ,
symmetric INT8, per-channel weights).
"""

from __future__ import annotations

from typing import Any

from tailguard.core.errors import FieldError, SpecError

from tailguard.core.presets import QUANTIZATION_PRESETS  # noqa: E402,F401  the data lives in the kernel


def quantization_preset(name: str, **overrides: Any):
    """A validated `QuantizationSpec` from a named preset, with field overrides.

    Args:
        name: a key of QUANTIZATION_PRESETS.
        **overrides: QuantizationSpec fields that replace the preset's.

    Raises:
        SpecError: unknown preset name (listing the known ones) or an invalid override.
    """
    from pydantic import ValidationError

    from tailguard.core.spec import QuantizationSpec

    if name not in QUANTIZATION_PRESETS:
        raise SpecError([FieldError("quantization.preset", f"unknown preset {name!r}; known: "
                                                          f"{sorted(QUANTIZATION_PRESETS)}")])
    try:
        return QuantizationSpec.model_validate({"preset": name, **overrides})
    except ValidationError as exc:
        raise SpecError([FieldError(".".join(map(str, e["loc"])) or "quantization", e["msg"])
                         for e in exc.errors(include_url=False)], source=f"preset {name}") from None
