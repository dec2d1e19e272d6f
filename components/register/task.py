"""Task glue of the register-and-promote component: read the KFP inputs, then `finish.finish_run`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tailguard.core.taskio import task_entry


def baseline_runners(spec: Any, fetched_json: str, model_dir: str, onnx_dir: str) -> dict[str, Any]:
    """The FP32 references the promotion's paired rounds time beside the passing variants (issue 37): {"torch":
    torch eager (`TorchRunner` of the fetched reference; absent for an ONNX reference), "onnx_fp32": the ONNX
    export (`runtime.timed_ort_runner`)}, each with the spec's threads, as reference-pass builds them.

    Args:
        spec: the Spec. fetched_json: fetch-reference's `resolved` JSON. model_dir: its artifact folder.
        onnx_dir: export's output folder (model.onnx).

    Raises:
        InputError: the ONNX file or the reference does not load (names the file).
    """
    from tailguard.core.contract import ONNX_FILE
    from tailguard.core.reference import load_resolved, load_torch_reference
    from tailguard.core.runtime import TorchRunner, timed_ort_runner

    threads = spec.benchmark.intra_op_num_threads
    out: dict[str, Any] = {}
    resolved = load_resolved(fetched_json, model_dir)
    if resolved.format != "onnx":
        out["torch"] = TorchRunner(load_torch_reference(resolved, spec.model), [i.name for i in spec.model.inputs],
                                   intra_op_num_threads=threads)
    out["onnx_fp32"] = timed_ort_runner(Path(onnx_dir) / ONNX_FILE, intra_op_num_threads=threads)
    return out


@task_entry("register-and-promote")
def main(*, spec_yaml: str, resolved_json: str, parent_run_id: str, tracking_uri: str, baselines_json: str = "",
         reference_dir: str | None = None, fetched_json: str = "", model_dir: str | None = None,
         onnx_dir: str | None = None) -> str:
    """Log the FP32 baselines and calibration coverage (`log_reference`), register the variants, promote the
    fastest passing one (torch eager and the ONNX export timed in the same paired rounds: `baseline_runners`), log
    summary.json and close the parent run.

    Args:
        baselines_json: reference-pass's output ("" = none logged).
        reference_dir: reference-pass's output folder (calibration_coverage.csv / .json), or None.
        fetched_json, model_dir: fetch-reference's `resolved` JSON and artifact folder ("" / None: no torch eager
            in the paired rounds).
        onnx_dir: export's output folder (None: no baselines in the paired rounds).

    Returns:
        The RunSummary as JSON. No passing variant is not an error here: the summary says so and the CLI
        exits 3; no alias moves.
    """
    import mlflow

    from tailguard.components.register.finish import finish_run
    from tailguard.core.spec import spec_from_yaml
    from tailguard.core.tracking import configure

    spec = spec_from_yaml(spec_yaml)
    resolved = json.loads(resolved_json)
    configure(tracking_uri)
    baselines = None
    if onnx_dir and fetched_json and model_dir:
        def baselines() -> Any:  # the promotion's paired rounds build the baseline runners only if it needs them
            return baseline_runners(spec, fetched_json, model_dir, onnx_dir)
    return json.dumps(finish_run(mlflow.MlflowClient(), spec, parent_run_id=parent_run_id, resolved=resolved,
                                 baselines_json=baselines_json, reference_dir=reference_dir, baselines=baselines),
                      default=str)
