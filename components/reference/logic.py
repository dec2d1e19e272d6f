"""The computation of the reference pass: FP32 reference outputs (checked finite), FP32 latency baselines, and
the calibration coverage figures. No file or MLflow I/O (task.py does that)."""

from __future__ import annotations

from typing import Any

import numpy as np


def reference_outputs(truth: Any, ds: Any, spec: Any) -> list[np.ndarray]:
    """The FP32 reference's outputs over the validation set.

    Args:
        truth: the reference runner (`tailguard.core.runtime.Runner`: torch eager, or ONNX Runtime for an ONNX
            reference).
        ds: the validation Dataset (rows in file order).
        spec: the validated spec (model.inputs / outputs / pad_values, data.validation.batch_size).

    Returns:
        One array per `model.outputs` entry, (rows, ...), the model's dtype, original row order.

    Raises:
        StepError: an output holds NaN/Inf (the message counts the rows; exit 1).
    """
    from tailguard.core.errors import StepError
    from tailguard.core.runtime import run_dataset

    outputs = run_dataset(truth, ds, spec.model.inputs, batch_size=spec.data.validation.batch_size,
                          pad_values=spec.model.pad_values)
    for spec_out, arr in zip(spec.model.outputs, outputs):
        if np.issubdtype(arr.dtype, np.floating) and not np.isfinite(arr).all():
            bad = int((~np.isfinite(arr.reshape(len(arr), -1))).any(axis=1).sum())
            raise StepError(f"the FP32 reference output {spec_out.name!r} has NaN/Inf in {bad} validation rows",
                            step="reference-pass",
                            hint="check the validation inputs (data.validation.uri) and the reference model")
    return outputs


def time_baselines(onnx_runner: Any, torch_runner: Any | None, ds: Any, spec: Any) -> dict[str, Any]:
    """Time ONNX Runtime FP32 and (for a torch reference) torch eager FP32 at every benchmark batch size, with
    the spec's `benchmark` section.

    With a torch reference the two are timed interleaved in rounds on the same batches
    (`tailguard.core.latency.interleaved_benchmark`, as the validate step times a variant against the ONNX
    FP32 reference): one `benchmark.max_seconds` budget per batch size covers both, where timing them one
    after the other spent it twice, and a load change hits both alike. An ONNX reference is timed alone
    (`latency.benchmark`).

    Returns:
        {"rows": validation rows, "torch": {batch size: perf} | None, "onnx_fp32": {batch size: perf}}; perf as
        `benchmark` returns it (latency_ms.p50/.p95/.p99/.mean in ms, throughput_per_s, samples_ms, ...).
    """
    from tailguard.core.latency import benchmark, interleaved_benchmark

    if torch_runner is None:
        return {"rows": ds.n_rows, "torch": None,
                "onnx_fp32": benchmark(onnx_runner, ds, spec.model.inputs, spec.benchmark,
                                       pad_values=spec.model.pad_values)}
    timed = interleaved_benchmark({"onnx_fp32": onnx_runner, "torch": torch_runner}, ds, spec.model.inputs,
                                  spec.benchmark, pad_values=spec.model.pad_values)
    return {"rows": ds.n_rows, "torch": timed["torch"], "onnx_fp32": timed["onnx_fp32"]}


def coverage_metrics(table: Any) -> dict[str, float]:
    """Calibration coverage figures from `tailguard.core.coverage.calibration_coverage`'s table (one row per
    declared slice group; columns validation_rows, missing, coverage_ratio).

    Returns:
        {"calibration.groups_missing": validation groups without a calibration row (count, as float),
         "calibration.min_coverage_ratio": lowest calibration share / validation share} (the ratio only when a
        group has validation rows).
    """
    judged = table[table["validation_rows"] > 0]
    values = {"calibration.groups_missing": float(judged["missing"].sum())}
    if len(judged):
        values["calibration.min_coverage_ratio"] = float(judged["coverage_ratio"].min())
    return values
