"""Task glue of the reference-pass component: inputs, the local cache, and the files of its output folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tailguard.core.contract import (
    BASELINES_FILE,
    COVERAGE_CSV,
    COVERAGE_JSON,
    ONNX_FILE,
    REFERENCE_FILE,
    baseline_metrics,
)
from tailguard.core.taskio import task_entry, write_json

if TYPE_CHECKING:
    from tailguard.core.data import Dataset
    from tailguard.core.reference import ResolvedModel
    from tailguard.core.spec.root import Spec



def cache_parts(spec: Spec, resolved: ResolvedModel, onnx_dir: str | Path) -> dict[str, Any] | None:
    """What reference-pass reads, for its cache key (tailguard.core.cache): the reference
    (`cache.reference_parts`), the validation rows, the exported FP32 ONNX model's bytes, the `benchmark`
    section, the threads, the batch sizes a gate reads the baselines at (`logic.timing_gates_key`; not the rest
    of `gates`, so a gate change still finds the cached pass), the machine (CPU model, CPU count, OS,
    architecture: the baselines are timings) and, with declared slices, the slices and the calibration rows (the
    coverage table).

    Returns:
        The parts, or None when an input cannot be hashed (a remote data file, a model class without a source
        file): then no caching.
    """
    from tailguard.core.cache import dataset_parts, machine_parts, reference_parts
    from tailguard.core.digests import dir_sha256

    from .logic import timing_gates_key

    reference, validation = reference_parts(resolved, spec), dataset_parts(spec.data.validation)
    if reference is None or validation is None:
        return None
    parts: dict[str, Any] = {
        **reference, "validation": validation, "onnx": dir_sha256(onnx_dir, prefix=ONNX_FILE),
        "benchmark": spec.benchmark.model_dump(mode="json"), "threads": spec.benchmark.intra_op_num_threads,
        "baseline_gates": timing_gates_key(spec), "machine": machine_parts()}
    if spec.slices:
        calibration = dataset_parts(spec.data.calibration)
        if calibration is None:
            return None
        parts["slices"] = [s.model_dump(mode="json") for s in spec.slices]
        parts["calibration"] = calibration
    return parts


@task_entry("reference-pass")
def main(*, spec_yaml: str, resolved_json: str, reference_dir: str, onnx_dir: str, out_dir: str,
         metrics: Any = None) -> str:
    """Run the FP32 reference over the validation set; time torch eager FP32 and ONNX Runtime FP32.

    A pure step (no MLflow). It writes into `out_dir`:
      - reference_outputs.npz: one array per model output, (rows, ...), original row order;
      - baselines.json: what it returns, without "cached": the timings (`logic.time_baselines`: torch timed beside
        an ORT session that stops spinning after each Run, the torch stability check and its "warnings") and
        "hardware", the node's facts (`tailguard.core.hardware.node_facts`) the timings were measured on;
      - with declared slices: calibration_coverage.csv (per slice group, `coverage.calibration_coverage`) and
        calibration_coverage.json ({"calibration.groups_missing": n, "calibration.min_coverage_ratio": r}).
    register-and-promote logs the baselines (`baseline.<torch|onnx_fp32>.bs<N>.latency_ms.<p>`) and the coverage
    to the parent run. Under `tailguard run` the whole step (outputs, timings, coverage) comes from the local
    cache when its inputs are unchanged (`cache_parts`, which includes the machine and the benchmark section):
    the baselines are then those measured when the entry was made. The variant's speedup_vs_onnx_fp32 is
    re-measured interleaved in validate anyway; speedup_vs_torch uses these baselines.

    Args:
        metrics: the KFP Metrics output (or None): receives the same metric keys.

    Returns:
        JSON {"rows": n, "torch": {batch size: perf} | null, "onnx_fp32": {batch size: perf}, "warnings": [str],
        "hardware": {...}, "cached": bool}.

    Raises:
        StepError: the reference produced NaN/Inf (exit 1).
    """
    from tailguard.core.cache import cached_step
    from tailguard.core.reference import load_resolved
    from tailguard.core.spec import spec_from_yaml

    spec = spec_from_yaml(spec_yaml)
    resolved = load_resolved(resolved_json, reference_dir)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    result = cached_step("reference-pass", cache_parts(spec, resolved, onnx_dir), out,
                         lambda: _reference_pass(spec, resolved, Path(onnx_dir), out), label="reference-pass")
    if metrics is not None:
        coverage = out / COVERAGE_JSON
        values = {**baseline_metrics(result), **(json.loads(coverage.read_text()) if coverage.is_file() else {})}
        for key, value in values.items():
            metrics.log_metric(key, float(value))
    return json.dumps(result, default=str)


def _reference_pass(spec: Spec, resolved: ResolvedModel, onnx_dir: Path, out: Path) -> dict[str, Any]:
    """Run, time and measure coverage; write the output folder; return the baselines."""
    import numpy as np

    from tailguard.components.reference.logic import output_kind_warnings, reference_outputs, time_baselines
    from tailguard.core.data import load_validation
    from tailguard.core.hardware import node_facts
    from tailguard.core.runtime import OrtRunner

    ds = load_validation(spec)
    threads = spec.benchmark.intra_op_num_threads
    torch_runner = None
    if resolved.format != "onnx":
        from tailguard.core.reference import load_torch_reference
        from tailguard.core.runtime import TorchRunner

        torch_runner = TorchRunner(load_torch_reference(resolved, spec.model), [i.name for i in spec.model.inputs],
                                   intra_op_num_threads=threads)
    truth = torch_runner or OrtRunner(onnx_dir / ONNX_FILE, intra_op_num_threads=threads)
    outputs = reference_outputs(truth, ds, spec)
    np.savez(out / REFERENCE_FILE, **{o.name: a for o, a in zip(spec.model.outputs, outputs)})
    # time_baselines builds the ORT session it times (its options are part of the method)
    baselines = {**time_baselines(onnx_dir / ONNX_FILE, torch_runner, ds, spec), "hardware": node_facts()}
    baselines["warnings"] = list(baselines.get("warnings") or []) + output_kind_warnings(spec, outputs[0])
    _write_coverage(spec, ds, out)
    write_json(out / BASELINES_FILE, baselines)
    return baselines


def _write_coverage(spec: Spec, validation: Dataset, out: Path) -> None:
    """calibration_coverage.csv and .json per declared slice (nothing without slices)."""
    if not spec.slices:
        return
    from tailguard.components.reference.coverage import calibration_coverage
    from tailguard.components.reference.logic import coverage_metrics
    from tailguard.core.data import load_calibration

    table = calibration_coverage(spec.slices, load_calibration(spec), validation)
    table.to_csv(out / COVERAGE_CSV, index=False)
    write_json(out / COVERAGE_JSON, coverage_metrics(table))
