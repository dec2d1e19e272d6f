"""Task glue of the redecide component: resolve, decide every variant's new gates on the earlier run's stored
measurements, log the runs, register and promote: one process for a gate-only re-run (issue 25)."""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tailguard.core.taskio import task_entry

FALLBACK_KEY = "redecide_fallback"  # the task's output when it decided nothing: {FALLBACK_KEY: reason}


@dataclass
class Decided:
    """One variant decided again: its spec, the earlier validation's record, and (built variants) the new
    ValidationResult, its model file and the folder its artifacts were written to."""

    variant: Any
    record: dict[str, Any]
    result: Any = None
    model_file: Path | None = None
    work: Path | None = None


def decide_variant(spec: Any, variant: Any, record: dict[str, Any], work: Path) -> Decided:
    """Decide `variant`'s gates of `spec` again on the measurements its earlier validation stored.

    The same call as the validate step's (`validate.logic.validate_variant` with the stored `Measurements`), with
    runners that refuse to run (`logic.StoredOnly`), so the result is the validate step's on those measurements.

    Args:
        spec: the new Spec. variant: its VariantSpec. record: the earlier validation's record
            (validate.run_log.write_validation_record). work: an empty folder for the variant's artifacts.

    Returns:
        Decided (result None for a variant whose build was not ok: it is carried over as it was).

    Raises:
        NotDecidable: a file of the earlier run is gone, its stored measurements are missing, pruned or do not
            match the digest stored with them (changed after they were stored), the
            earlier validation did not finish ok, or the new gates need rows or timing rounds never measured.
    """
    from tailguard.components.redecide.logic import NotDecidable, StoredOnly
    from tailguard.components.validate.logic import validate_variant
    from tailguard.components.validate.measurements import load_measurements
    from tailguard.components.validate.runners import load_reference_outputs, parse_baselines
    from tailguard.core.contract import REFERENCE_FILE
    from tailguard.core.data import load_validation
    from tailguard.core.results import BuildStatus

    build = record["build"]
    if build.get("status") != BuildStatus.OK:
        return Decided(variant, record)
    if record.get("status") != BuildStatus.OK or not record.get("model_uri"):
        raise NotDecidable(f"its earlier validation ended {record.get('status')!r} without a logged model")
    model_file = Path(record["variant_dir"]) / build["artifact"]
    reference_file = Path(record["reference_dir"]) / REFERENCE_FILE
    for f in (model_file, reference_file):
        if not f.exists():
            raise NotDecidable(f"{f} of the earlier run is gone")
    reference_model_dir = record.get("reference_model_dir")
    measurements, _ = load_measurements(spec, variant, model_file, reference_model_dir)
    if measurements is not None and measurements.discarded:  # changed after it was stored: never decide on it
        raise NotDecidable(measurements.discarded)
    if measurements is None or measurements.order is None:
        raise NotDecidable("its stored measurements are not in the local cache (pruned, or never stored)")
    baselines = parse_baselines(record.get("baselines_json") or "")
    result = validate_variant(
        spec, variant.name, StoredOnly("the variant"), load_reference_outputs(spec, reference_file),
        load_validation(spec), work, reference_perf=baselines["onnx_fp32"], torch_perf=baselines["torch"],
        model_path=model_file,
        baseline_runners={"onnx_fp32": StoredOnly("the FP32 baseline")} if reference_model_dir else None,
        exact_runner_factory=(lambda: StoredOnly("the exact-accumulation pass"))
        if variant.backend == "onnxruntime" else None,
        measurements=measurements)
    if measurements.changed:  # cannot happen with StoredOnly runners; never log a verdict on unstored data
        raise NotDecidable("the replay asked for measurements beyond the stored ones")
    if (Path(record["variant_dir"]) / "sensitivity").is_dir():  # as the validate step logs it
        shutil.copytree(Path(record["variant_dir"]) / "sensitivity", work / "sensitivity")
    return Decided(variant, record, result, model_file, work)


def log_decided(client: Any, exp_id: str, spec: Any, parent_run_id: str, d: Decided,
                hw_tags: dict[str, str]) -> dict[str, Any]:
    """Log one re-decided variant as the validate step logs it: a nested run with the same tags, params,
    build.json, metrics, gate tags, artifacts and variant_result.json, the model not logged again but named by
    the earlier run's model URI (same bytes: its sha256 is checked by `log_validated_model`). The metric
    peak_rss_mb is the earlier validation's (this process ran no model).

    Returns:
        The validation record of this run (`validate.run_log.write_validation_record`).
    """
    import dataclasses

    import mlflow

    from tailguard.components.validate.run_log import (
        flat_params,
        log_coverage,
        log_validated_model,
        log_variant_result,
        variant_run_tags,
    )
    from tailguard.core.contract import ARTIFACT_FINGERPRINT_TAG, REASON_TAG
    from tailguard.core.results import BuildResult, VariantResult
    from tailguard.core.tracking import closing_run

    v, build = d.variant, d.record["build"]
    step = BuildResult.from_dict(build, source=f"build output of variant {v.name!r}")
    run_id = client.create_run(exp_id, run_name=v.name,
                               tags=variant_run_tags(v, build, parent_run_id, hw_tags)).info.run_id
    client.log_batch(run_id, params=[mlflow.entities.Param(k, val) for k, val in flat_params(v).items()])
    identity = VariantResult(variant=v.name, backend=v.backend, precision=v.precision, status=step.status,
                             reason=step.reason, run_id=run_id,
                             warnings=[str(w) for w in step.details.get("warnings") or []])
    with closing_run(client, run_id):
        client.log_dict(run_id, build, "build.json")
        log_coverage(client, run_id, build)
        if d.result is None:
            client.set_tag(run_id, REASON_TAG, step.reason[:5000])
            log_variant_result(client, run_id, identity)
            return {**d.record, "run_id": run_id}
        earlier = client.get_run(d.record["run_id"]).data
        if "peak_rss_mb" in earlier.metrics:
            d.result.overall["peak_rss_mb"] = earlier.metrics["peak_rss_mb"]
        if earlier.tags.get(ARTIFACT_FINGERPRINT_TAG):
            client.set_tag(run_id, ARTIFACT_FINGERPRINT_TAG, earlier.tags[ARTIFACT_FINGERPRINT_TAG])
        out = log_validated_model(client, run_id, d.result, work_dir=d.work, model_file=d.model_file,
                                  execution_provider=v.execution_provider,
                                  identity=dataclasses.replace(identity), onnx=v.artifact == "onnx",
                                  model_uri=d.record["model_uri"])
    return {**d.record, "run_id": run_id, "model_uri": out["model_uri"]}


@task_entry("redecide")
def main(*, spec_yaml: str, tracking_uri: str, model_version: str, pipeline_run: str, earlier_json: str,
         out_dir: str) -> str:
    """Decide a gate-only re-run in this one process, or decide nothing and say why.

    First, without writing anything: resolve the reference (the resolve step's `resolve_reference`, into
    `out_dir`) and check it is the earlier run's version and SHA-256; decide every variant's new gates on the
    earlier run's stored measurements (`decide_variant`). Any doubt (`logic.spec_reasons`, another version, a
    variant without a stored validation, `NotDecidable`) returns {FALLBACK_KEY: reason} with nothing logged and
    no alias moved: the runner then runs the whole pipeline. Otherwise: the parent run as resolve opens it
    (tagged tailguard.redecided_from), one nested run per variant as validate logs it (`log_decided`), then
    register-and-promote's `finish_run` (registration, the promotion rule and its paired comparison, summary.json).

    Args:
        spec_yaml: the new spec. tracking_uri: MLflow. model_version: '' = the spec's. pipeline_run: this run's
            label. out_dir: the reference's folder (a KFP artifact).
        earlier_json: the earlier run (tailguard.rerun.earlier_run): {"pipeline_run", "version", "sha256",
            "validations": {variant: record}}.

    Returns:
        The RunSummary JSON (as register-and-promote's), or {FALLBACK_KEY: reason}.
    """
    import mlflow

    from tailguard.components.redecide.logic import NotDecidable, spec_reasons
    from tailguard.components.register.finish import finish_run
    from tailguard.components.resolve.parent_run import open_parent_run
    from tailguard.components.validate.run_log import write_validation_record
    from tailguard.core.contract import REDECIDED_FROM_TAG
    from tailguard.core.hardware import hardware_tags, node_facts
    from tailguard.core.reference import resolve_reference
    from tailguard.core.spec import spec_from_yaml
    from tailguard.core.tracking import configure, experiment_name_for

    def fallback(reason: str) -> str:
        print(f"tailguard redecide: not decided on the stored measurements: {reason}", flush=True)
        return json.dumps({FALLBACK_KEY: reason})

    spec = spec_from_yaml(spec_yaml)
    earlier = json.loads(earlier_json)
    if why := spec_reasons(spec):
        return fallback(why)
    exp_id = configure(tracking_uri, experiment_name_for(spec))
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    resolved = resolve_reference(spec, tracking_uri=tracking_uri, out_dir=Path(out_dir), version=model_version or None)
    if (str(resolved.version), resolved.sha256) != (str(earlier["version"]), earlier["sha256"]):
        return fallback(f"the reference is version {resolved.version} (sha256 {resolved.sha256[:12]}), the earlier "
                        f"run's was version {earlier['version']} (sha256 {str(earlier['sha256'])[:12]})")
    root = Path(tempfile.mkdtemp(prefix="tailguard-redecide-"))
    try:
        decided = []
        for v in spec.variants:
            record = (earlier.get("validations") or {}).get(v.name)
            if record is None:
                return fallback(f"variant {v.name!r} has no stored validation in run {earlier['pipeline_run']}")
            try:
                decided.append(decide_variant(spec, v, record, root / v.name))
            except NotDecidable as exc:
                return fallback(f"variant {v.name!r}: {exc}")
        # every verdict is decided: from here on the run is logged like a full one
        client = mlflow.MlflowClient()
        parent = open_parent_run(client, exp_id, spec, spec_yaml, resolved, pipeline_run=pipeline_run,
                                 extra_tags={REDECIDED_FROM_TAG: str(earlier["pipeline_run"])})
        hw = hardware_tags(node_facts())
        records = [log_decided(client, exp_id, spec, parent, d, hw) for d in decided]
        for d in decided:
            if d.result is not None:
                print(f"tailguard redecide: {d.variant.name}: gates decided on the stored measurements of run "
                      f"{earlier['pipeline_run']} ({d.result.rows_used} of {d.result.rows} rows)", flush=True)
        first = records[0] if records else {}
        summary = finish_run(client, spec, parent_run_id=parent,
                             resolved={"version": resolved.version, "sha256": resolved.sha256},
                             baselines_json=first.get("baselines_json") or "",
                             reference_dir=first.get("reference_dir"))
        for r in records:  # a later gate change decides again on the same inputs
            write_validation_record(r)
        return json.dumps(summary, default=str)
    finally:
        shutil.rmtree(root, ignore_errors=True)
