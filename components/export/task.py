"""Task glue of the export components: torch -> ONNX (checked), and the FP32 reference pass."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from tailguard.core.contract import ONNX_INLINE_LIMIT_BYTES
from tailguard.core.taskio import task_entry, write_json

from tailguard.core.contract import ONNX_FILE, REFERENCE_FILE  # noqa: F401 (file names shared with validate, search)


def _copy_onnx(src: Path, out_dir: Path) -> Path:
    """Copy an ONNX file and its external-data files (same folder) into out_dir as model.onnx."""
    out_dir.mkdir(parents=True, exist_ok=True)
    import onnx

    model = onnx.load(str(src), load_external_data=True)
    dst = out_dir / ONNX_FILE
    if model.ByteSize() < ONNX_INLINE_LIMIT_BYTES:
        onnx.save(model, str(dst))
    else:
        onnx.save(model, str(dst), save_as_external_data=True, location=ONNX_FILE + ".data")
    return dst


def check_batches(spec: Any, ds: Any) -> list[dict[str, np.ndarray]]:
    """Batches for the export check: the `export.check_samples` shortest-to-longest rows in two batch sizes.

    Two different batch sizes and padded lengths exercise both dynamic axes.
    """
    from tailguard.core.data import make_batch

    n = min(spec.model.export.check_samples, ds.n_rows)
    order = np.argsort(ds.lengths, kind="stable")
    picks = order[np.linspace(0, ds.n_rows - 1, num=n).astype(int)]
    first = picks[: max(1, n // 2)]
    second = picks[max(1, n // 2):] if n > 1 else picks
    return [make_batch(ds, idx, spec.model.inputs, pad_values=spec.model.pad_values) for idx in (first, second)]


def reference_parts(resolved: Any, spec: Any) -> dict[str, Any] | None:
    """What identifies the FP32 reference, for cache keys (tailguard.cache): its format, files and their bytes,
    the torch class it loads with (and the source file of that class's module), and the model section (exported
    shapes, export settings, pad values).

    Returns:
        The parts, or None (no caching) when the reference names a class whose module's source file cannot be
        found: an edit of that class could not be seen. Modules the class's module imports are not hashed.
    """
    from tailguard.core.cache import dir_sha256, file_sha256

    parts: dict[str, Any] = {
        "format": resolved.format, "model_file": resolved.model_file, "sha256": resolved.sha256,
        "files": dir_sha256(resolved.local_dir), "class_path": resolved.class_path,
        "init_kwargs": resolved.init_kwargs,
        "model": spec.model.model_dump(mode="json", exclude={"version", "registered_name"}),
    }
    if resolved.class_path:
        import importlib.util

        from tailguard.core import reference as resolve_logic

        if hasattr(resolve_logic, "add_model_path"):  # the folders a model class is imported from
            resolve_logic.add_model_path()
        try:
            found = importlib.util.find_spec(resolved.class_path.split(":")[0])
        except (ImportError, ValueError):
            found = None
        if found is None or not found.origin or not Path(found.origin).is_file():
            return None
        parts["class_source"] = file_sha256(found.origin)
    return parts


def _validation_parts(spec: Any) -> dict[str, Any] | None:
    """The validation section and file SHA-256, or None for a remote file (not cached)."""
    from tailguard.core.cache import data_sha256

    digest = data_sha256(spec.data.validation.uri)
    if digest is None:
        return None
    return {**spec.data.validation.model_dump(mode="json", exclude={"uri"}), "sha256": digest}


@task_entry("export")
def main(*, spec_yaml: str, resolved_json: str, reference_dir: str, out_dir: str) -> str:
    """Write `out_dir/model.onnx`: the exported (torch) or checked (ONNX) FP32 reference.

    A pure step (no MLflow): under `tailguard run` its output comes from the local cache (tailguard.cache) when
    the reference's bytes, the model section, the validation rows it checks with and the versions are unchanged.

    Returns:
        JSON facts of the export plus "cached" (true: copied from the cache, not exported).

    Raises:
        ExportMismatchError: an output differs beyond its tolerance (every output's max diff listed; exit 1).
        InputError: a corrupt ONNX reference (exit 2).
    """
    from tailguard.core.cache import cached_step
    from tailguard.core.reference import load_resolved
    from tailguard.core.spec import spec_from_yaml

    spec = spec_from_yaml(spec_yaml)
    resolved = load_resolved(resolved_json, reference_dir)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    parts = reference_parts(resolved, spec)
    if parts is not None and resolved.format != "onnx":  # the export check reads validation rows
        validation = _validation_parts(spec)
        parts = None if validation is None else {**parts, "validation": validation}
    facts = cached_step("export", parts, out, lambda: _export(spec, resolved, out), label="export")
    return json.dumps(facts, default=str)


def _export(spec: Any, resolved: Any, out: Path) -> dict[str, Any]:
    """Export (torch) or check and copy (ONNX) the reference into `out`; returns the facts."""
    from tailguard.components.export.logic import check_export, check_onnx_file, export_onnx

    if resolved.format == "onnx":
        facts = check_onnx_file(resolved.onnx_path)
        _copy_onnx(Path(resolved.onnx_path), out)
        facts["exporter"] = "none (reference is ONNX)"
        return facts
    from tailguard.core.reference import load_torch_reference
    from tailguard.core.data import load_validation
    from tailguard.core.runtime import TorchRunner

    module = load_torch_reference(resolved, spec.model)
    ds = load_validation(spec)
    batches = check_batches(spec, ds)
    facts = export_onnx(module, spec.model, batches[-1], out / ONNX_FILE)
    runner = TorchRunner(module, [i.name for i in spec.model.inputs])
    facts["check"] = check_export(runner, str(out / ONNX_FILE), batches, spec.model)
    write_json(out / "export.json", facts)
    return facts


@task_entry("reference-pass")
def reference_main(*, spec_yaml: str, resolved_json: str, parent_run_id: str, tracking_uri: str,
                   reference_dir: str, onnx_dir: str, out_dir: str, metrics: Any = None) -> str:
    """Run the FP32 reference over the validation set; time torch eager FP32 and ONNX Runtime FP32.

    Writes `out_dir/reference_outputs.npz` (one array per model output, (rows, ...), original row order). Those
    outputs are pure and served from the local cache under `tailguard run` (tailguard.cache); the timings and the
    MLflow logging (metrics and calibration coverage on the parent run) run every time, so KFP caching stays off
    for this task.

    Returns:
        JSON {"torch": {batch size: perf} | null, "onnx_fp32": {batch size: perf}, "rows": n}.

    Raises:
        StepError: the reference produced NaN/Inf (exit 1).
    """
    import mlflow

    from tailguard.core.cache import cached_step, dir_sha256
    from tailguard.core.reference import load_torch_reference
    from tailguard.core.reference import load_resolved
    from tailguard.core.latency import benchmark
    from tailguard.core.data import load_validation
    from tailguard.core.errors import StepError
    from tailguard.core.runtime import OrtRunner, TorchRunner, run_dataset
    from tailguard.core.spec import spec_from_yaml
    from tailguard.core.tracking import configure

    spec = spec_from_yaml(spec_yaml)
    resolved = load_resolved(resolved_json, reference_dir)
    configure(tracking_uri)
    ds = load_validation(spec)
    threads = spec.benchmark.intra_op_num_threads
    names = [i.name for i in spec.model.inputs]
    onnx_runner = OrtRunner(Path(onnx_dir) / ONNX_FILE, intra_op_num_threads=threads)
    torch_runner = None
    if resolved.format != "onnx":
        torch_runner = TorchRunner(load_torch_reference(resolved, spec.model), names, intra_op_num_threads=threads)
    truth = torch_runner or onnx_runner
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    def reference_outputs() -> dict[str, Any]:
        outputs = run_dataset(truth, ds, spec.model.inputs, batch_size=spec.data.validation.batch_size,
                              pad_values=spec.model.pad_values)
        for spec_out, arr in zip(spec.model.outputs, outputs):
            if np.issubdtype(arr.dtype, np.floating) and not np.isfinite(arr).all():
                bad = int((~np.isfinite(arr.reshape(len(arr), -1))).any(axis=1).sum())
                raise StepError(f"the FP32 reference output {spec_out.name!r} has NaN/Inf in {bad} validation rows",
                                step="reference-pass",
                                hint="check the validation inputs (data.validation.uri) and the reference model")
        np.savez(out / REFERENCE_FILE, **{o.name: a for o, a in zip(spec.model.outputs, outputs)})
        return {"rows": ds.n_rows}

    # The outputs are pure (cached under `tailguard run`); the timings below and the MLflow logging are not.
    validation, reference = _validation_parts(spec), reference_parts(resolved, spec)
    parts = None if validation is None or reference is None else {
        **reference, "validation": validation, "threads": threads,
        "onnx": dir_sha256(onnx_dir, prefix=ONNX_FILE) if torch_runner is None else None}
    cached_step("reference-outputs", parts, out, reference_outputs, label="reference outputs")
    baselines: dict[str, Any] = {"rows": ds.n_rows, "torch": None,
                                 "onnx_fp32": benchmark(onnx_runner, ds, spec.model.inputs, spec.benchmark,
                                                        pad_values=spec.model.pad_values)}
    if torch_runner is not None:
        baselines["torch"] = benchmark(torch_runner, ds, spec.model.inputs, spec.benchmark,
                                       pad_values=spec.model.pad_values)
    client = mlflow.MlflowClient()
    for name in ("torch", "onnx_fp32"):
        for bs, perf in (baselines[name] or {}).items():
            for k in ("p50", "p95", "p99"):
                key = f"baseline.{name}.bs{bs}.latency_ms.{k}"
                client.log_metric(parent_run_id, key, float(perf[f"latency_ms.{k}"]))
                if metrics is not None:
                    metrics.log_metric(key, float(perf[f"latency_ms.{k}"]))
    _log_calibration_coverage(spec, ds, client, parent_run_id, metrics)
    write_json(out / "baselines.json", baselines)
    return json.dumps(baselines, default=str)


def _log_calibration_coverage(spec: Any, validation: Any, client: Any, parent_run_id: str, metrics: Any) -> None:
    """Calibration coverage per declared slice (pipelines/core/coverage.py) on the parent run:
    calibration_coverage.csv, and metrics calibration.groups_missing (validation groups without a calibration
    row) and calibration.min_coverage_ratio (lowest calibration share / validation share)."""
    import tempfile

    from tailguard.core.coverage import calibration_coverage
    from tailguard.core.data import load_calibration

    if not spec.slices:
        return
    table = calibration_coverage(spec.slices, load_calibration(spec), validation)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "calibration_coverage.csv"
        table.to_csv(path, index=False)
        client.log_artifact(parent_run_id, str(path))
    judged = table[table["validation_rows"] > 0]
    values = {"calibration.groups_missing": float(judged["missing"].sum())}
    if len(judged):
        values["calibration.min_coverage_ratio"] = float(judged["coverage_ratio"].min())
    for key, value in values.items():
        client.log_metric(parent_run_id, key, value)
        if metrics is not None:
            metrics.log_metric(key, value)
