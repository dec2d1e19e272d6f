"""Task glue of the validate component: run the variant, compute parity/latency/gates, log the nested run."""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tailguard.core.contract import (
    REASON_TAG,
    STATUS_TAG,
    TARGET_CHECK_TAG,
    TARGET_PLACEMENT_TAG,
    TARGET_TAG,
)
from tailguard.core.results import BuildResult, BuildStatus, VariantResult
from tailguard.core.spec.targets import target_task_name
from tailguard.core.taskio import task_entry

from .measurements import load_measurements
from .run_log import (
    _log_failed_result,
    flat_params,
    log_coverage,
    log_validated_model,
    log_variant_result,
    variant_run_tags,
    write_validation_record,
)
from .runners import (
    VariantUnusable,
    load_reference_outputs,
    ort_session_providers,
    parse_baselines,
    reference_runners,
    torch_runner,
    variant_runner,
)

if TYPE_CHECKING:
    from tailguard.core.spec.root import Spec
    from tailguard.core.spec.variants import VariantSpec


@task_entry("validate")
def main(*, spec_yaml: str, variant_name: str, build_json: str, baselines_json: str, parent_run_id: str,
         tracking_uri: str, variant_dir: str, reference_dir: str, metrics: Any = None,
         report_path: str | None = None, reference_model_dir: str | None = None, target_name: str = "",
         placement: str = "") -> str:
    """Validate one built variant and log its nested MLflow run (also for skipped/failed builds).

    With `target_name` (spec `serving_targets`) the run is the variant's validation on that serving target: tagged
    tailguard.target, tailguard.target_placement (`placement`: node_pool on a cluster, this_node in a local run)
    and tailguard.target_check, and a node that does not match the target's `expect` (`target_check`) validates
    nothing: the run and its variant_result.json say skipped, with the differences as the reason, never passed.

    With `reference_model_dir` (the export step's folder holding the FP32 reference model.onnx) the FP32
    ONNX Runtime reference is timed in this process, interleaved with the variant in rounds on the same
    batches (`latency.interleaved_benchmark`): speedup_vs_onnx_fp32 is then the ratio of medians of those
    paired rounds, with bounds speedup_vs_onnx_fp32.lb95 / .ub95 (paired bootstrap, `latency.speed_ratio`),
    and a speedup gate with `confidence` is decided on its bound. Without it the ratio compares the
    reference-pass timing (another process, another time) and has no bound. torch eager is timed in
    reference-pass only (speedup_vs_torch has no bound).

    Every outcome (ok, failed or skipped build, validation that raised) leaves variant_result.json
    (`VariantResult`, the register step's input) on the run; a validation that raised leaves a failed one and
    re-raises.

    Returns:
        JSON {variant, status, reason, passed, run_id, model_uri, build, overall, perf, gates, worst_slice}.
    """
    import mlflow

    from tailguard.core.contract import REFERENCE_FILE
    from tailguard.core.spec import spec_from_yaml
    from tailguard.core.tracking import closing_run, configure, experiment_name_for

    spec = spec_from_yaml(spec_yaml)
    variant = next(v for v in spec.variants if v.name == variant_name)
    build = json.loads(build_json)
    step = BuildResult.from_dict(build, source=f"build output of variant {variant_name!r}")
    exp_id = configure(tracking_uri, experiment_name_for(spec))
    client = mlflow.MlflowClient()
    from tailguard.core.hardware import hardware_tags, node_facts

    facts = node_facts()
    tags = variant_run_tags(variant, build, parent_run_id, hardware_tags(facts))
    mismatch, run_name = [], variant.name
    if target_name:
        mismatch, target_tags = target_check(spec, target_name, facts, placement)
        tags.update(target_tags)
        run_name = target_task_name(variant.name, target_name).removeprefix("validate-")
    run = client.create_run(exp_id, run_name=run_name, tags=tags)
    run_id = run.info.run_id
    client.log_batch(run_id, params=[mlflow.entities.Param(k, v) for k, v in flat_params(variant).items()])
    summary: dict[str, Any] = {"variant": variant.name, "status": step.status, "reason": step.reason,
                               "passed": False, "run_id": run_id, "model_uri": None, "build": build}
    identity = VariantResult(variant=variant.name, backend=variant.backend, precision=variant.precision,
                             status=step.status, reason=step.reason, run_id=run_id,
                             warnings=[str(w) for w in step.details.get("warnings") or []])
    inputs = {"variant": variant.name, "target_name": target_name, "build": build, "baselines_json": baselines_json,
              "variant_dir": variant_dir, "reference_dir": reference_dir,
              "reference_model_dir": reference_model_dir}

    def done() -> str:  # the task's output, and (local runs) the inputs a later re-decide reads
        write_validation_record({**inputs, "run_id": run_id, "status": summary["status"],
                                 "model_uri": summary.get("model_uri")})
        return json.dumps(summary, default=str)

    with closing_run(client, run_id):
        client.log_dict(run_id, build, "build.json")
        log_coverage(client, run_id, build)
        if step.status != BuildStatus.OK:
            client.set_tag(run_id, REASON_TAG, step.reason[:5000])
            log_variant_result(client, run_id, identity)
            return done()
        if mismatch:  # not the node the target names: nothing validated here, so nothing can pass
            reason = (f"not validated on serving target {target_name!r}: this node does not match its expect: "
                      + "; ".join(mismatch))
            client.set_tag(run_id, STATUS_TAG, BuildStatus.SKIPPED)
            client.set_tag(run_id, REASON_TAG, reason[:5000])
            log_variant_result(client, run_id,
                               dataclasses.replace(identity, status=BuildStatus.SKIPPED, reason=reason))
            summary.update(status=BuildStatus.SKIPPED, reason=reason)
            return done()
        try:
            summary.update(_validate(spec, variant, build, parse_baselines(baselines_json), Path(variant_dir),
                                     Path(reference_dir) / REFERENCE_FILE, run_id, client, metrics, report_path,
                                     reference_model_dir, identity=identity))
        except VariantUnusable as exc:  # this variant fails; the run goes on with the others
            reason = f"variant {variant.name} cannot run on this node: {exc}"
            client.set_tag(run_id, STATUS_TAG, BuildStatus.FAILED)
            client.set_tag(run_id, REASON_TAG, reason[:5000])
            _log_failed_result(client, run_id, identity, reason)
            summary.update(status=BuildStatus.FAILED, reason=reason)
        except Exception as exc:
            _log_failed_result(client, run_id, identity, f"validation raised {type(exc).__name__}: {exc}")
            raise
        return done()


def target_check(spec: Spec, target_name: str, facts: dict[str, Any],
                 placement: str) -> tuple[list[str], dict[str, str]]:
    """This node against serving target `target_name`'s `expect` (tailguard.core.hardware.expect_mismatches).

    Args:
        spec: the Spec (its serving_targets).
        target_name: a serving target's name.
        facts: this node's `node_facts()`.
        placement: node_pool | this_node ("" reads as this_node).

    Returns:
        (the differences, one line each, [] when the node matches; the run's target tags: TARGET_TAG,
        TARGET_PLACEMENT_TAG, TARGET_CHECK_TAG = matched | mismatch | no_expect).

    Raises:
        InputError: no serving target of that name in the spec.
    """
    from tailguard.core.errors import InputError
    from tailguard.core.hardware import expect_mismatches

    target = next((t for t in spec.serving_targets if t.name == target_name), None)
    if target is None:
        raise InputError(f"serving target {target_name!r} is not in the spec's serving_targets "
                         f"{[t.name for t in spec.serving_targets]}", hint="compile the pipeline from this spec again")
    expect = target.expect.model_dump() if target.expect is not None else {}
    mismatch = expect_mismatches(facts, **expect)
    check = "mismatch" if mismatch else ("matched" if any(expect.values()) else "no_expect")
    return mismatch, {TARGET_TAG: target.name, TARGET_PLACEMENT_TAG: placement or "this_node",
                      TARGET_CHECK_TAG: check}


def _validate(spec: Spec, variant: VariantSpec, build: dict, baselines: dict, variant_dir: Path, reference_file: Path,
              run_id: str, client: Any, metrics: Any, report_path: str | None,
              reference_model_dir: str | None = None, *, identity: VariantResult | None = None) -> dict[str, Any]:
    from tailguard.components.validate.logic import validate_variant
    from tailguard.core.artifacts import ArtifactMismatchError
    from tailguard.core.data import load_validation
    from tailguard.core.runtime import OrtRunner

    model_file = variant_dir / build["artifact"]
    if variant.backend == "torch":  # the probe of an AOTInductor package runs a validation batch
        ds = load_validation(spec)
        runner = torch_runner(spec, variant, model_file, build, ds)
    else:
        try:
            runner = variant_runner(spec, variant, build, variant_dir, reference_model_dir)
        except ArtifactMismatchError as exc:  # a TensorRT plan built for another node: the variant fails
            raise VariantUnusable(str(exc)) from None
        ds = load_validation(spec)
    baseline_runners = reference_runners(spec, reference_model_dir)
    work = Path(tempfile.mkdtemp(prefix=f"tailguard-validate-{variant.name}-"))

    def exact_runner() -> OrtRunner:  # the numerics check's second pass: exact integer accumulation
        return OrtRunner(model_file, providers=ort_session_providers(variant, build, variant_dir),
                         intra_op_num_threads=spec.benchmark.intra_op_num_threads, exact_int8_accumulation=True)

    measurements, save_measurements = load_measurements(spec, variant, model_file, reference_model_dir)
    reused = measurements is not None and measurements.order is not None
    try:
        result = validate_variant(spec, variant.name, runner, load_reference_outputs(spec, reference_file), ds,
                                  work, reference_perf=baselines["onnx_fp32"], torch_perf=baselines["torch"],
                                  model_path=model_file, baseline_runners=baseline_runners,
                                  exact_runner_factory=exact_runner if variant.backend == "onnxruntime" else None,
                                  measurements=measurements)
        save_measurements(measurements)
        if (variant_dir / "sensitivity").is_dir():  # analysis.sensitivity, written by the build step
            shutil.copytree(variant_dir / "sensitivity", work / "sensitivity")
        out = log_validated_model(client, run_id, result, work_dir=work, model_file=model_file,
                                  execution_provider=variant.execution_provider, metrics=metrics,
                                  report_path=report_path, identity=identity,
                                  onnx=variant.artifact == "onnx")  # torch, TensorRT: the file + manifest
        if measurements is not None:  # the local cache: true when nothing was measured again (a gate-only change)
            out["cached"] = reused and not measurements.changed
        return out
    finally:
        shutil.rmtree(work, ignore_errors=True)
