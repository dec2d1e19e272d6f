"""Task glue of the search component: run the accuracy-driven search for one variant and log it to MLflow.

MLflow layout (docs/architecture.md "MLflow names"):

    parent run
    ├─ <V>                    the validate step's run of variant V; after the search it gets the tags
    │   │                     tailguard.search (chosen trial name | none | not_needed | skipped | failed) and
    │   │                     tailguard.search_stopped_by, the metric search.skipped_families (families of the
    │   │                     space skipped as unable to differ from a planned one), and the artifacts search/
    │   │                     (search.json, pareto.csv, pareto.png, trials.csv, sensitivity.csv, sensitivity.png)
    │   └─ <V>-tNN            one nested run per trial: tailguard.search_of = V, tailguard.trial = NN, status,
    │                         gates and gate.<key> tags, params = the trial's config, the validation metrics
    └─ <V>-searched           the chosen trial as a candidate the register step sees (a direct child of the
                              parent run, logged exactly like a validated variant: tailguard.variant = <V>-searched,
                              tailguard.search_of = V, tailguard.trial_run_id, artifacts, the ONNX model)

Trials are judged by V's gates (a gate's `variants` list names spec variants, so a trial of V is matched
as V); runs and files are named by the trial.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from tailguard.core.contract import (
    BACKEND_TAG,
    GATES_TAG,
    PRECISION_TAG,
    REASON_TAG,
    SEARCH_ARTIFACT_PATH,
    SEARCH_OF_TAG,
    SEARCH_STOPPED_TAG,
    SEARCH_TAG,
    STATUS_TAG,
    TRIAL_NAME_TAG,
    TRIAL_RUN_TAG,
    TRIAL_TAG,
    VARIANT_TAG,
    searched_name,
)
from tailguard.core.results import BuildStatus, GatesVerdict
from tailguard.core.taskio import task_entry, write_json
from tailguard.core.tracking import closing_run

if TYPE_CHECKING:
    from tailguard.components.search.logic import Trial
    from tailguard.core.data import Dataset
    from tailguard.core.spec.root import Spec
    from tailguard.core.spec.variants import VariantSpec


class SearchStatus(StrEnum):
    """The tag tailguard.search on a searched variant's run when no trial was chosen (a chosen trial writes its
    name instead), and search.json's status when the search did not run."""

    NONE = "none"              # the search ran and no trial passed every gate
    NOT_NEEDED = "not_needed"  # search.when on_failure and the variant passed as specified
    SKIPPED = "skipped"        # no search section, or the variant's build was skipped
    FAILED = "failed"          # the search raised


def search_decision(variant: VariantSpec, validation: dict[str, Any]) -> tuple[str | None, str]:
    """Whether the search of `variant` runs, from the validate step's output.

    Args:
        variant: the VariantSpec (its `search` section).
        validation: the validate task's output JSON, parsed ({variant, status, passed, reason, run_id, ...}).

    Returns:
        (None, "") when the search runs; otherwise (status, reason) with the SearchStatus "skipped" (no search
        section, or the variant's build was skipped, e.g. no execution provider here) or "not_needed"
        (search.when is on_failure and the variant passed as specified).
    """
    if variant.search is None:
        return SearchStatus.SKIPPED, f"variant {variant.name!r} has no search section"
    if validation.get("status") == BuildStatus.SKIPPED:
        return SearchStatus.SKIPPED, f"the variant's build was skipped: {validation.get('reason', '')}".rstrip(": ")
    if (variant.search.when == "on_failure" and validation.get("status") == BuildStatus.OK
            and validation.get("passed")):
        return SearchStatus.NOT_NEEDED, "the variant passed its gates as specified (search.when: on_failure)"
    return None, ""


def _trial_params(trial: Trial) -> dict[str, str]:
    """A trial's config as MLflow params (lists as JSON, values cut to MLflow's 6000 characters)."""
    out = {}
    for k, v in trial.config.items():
        out[f"search.{k}"] = (json.dumps(v) if isinstance(v, (list, dict)) else str(v))[:6000]
    return out


def log_trial(client: Any, experiment_id: str, variant_run_id: str, variant: VariantSpec, trial: Trial) -> str:
    """Log one trial as a nested run under the variant's run (no model). Returns the run id.

    Tags: mlflow.parentRunId = `variant_run_id`, tailguard.search_of, tailguard.trial, tailguard.status
    (ok | failed), tailguard.gates (passed | failed | not_evaluated), gate.<key>, tailguard.worst_slice,
    tailguard.reason. Params: the trial's config (search.*). Metrics: ValidationResult.mlflow_metrics()
    and trial.seconds (build + evaluation wall time, s).
    """
    import mlflow

    from tailguard.components.validate.run_log import log_validation

    tags = {"mlflow.parentRunId": variant_run_id, SEARCH_OF_TAG: variant.name, TRIAL_TAG: str(trial.index),
            TRIAL_NAME_TAG: trial.name, BACKEND_TAG: variant.backend,
            PRECISION_TAG: variant.precision, STATUS_TAG: str(trial.status),
            GATES_TAG: GatesVerdict.NOT_EVALUATED.value}
    run_id = client.create_run(experiment_id, run_name=trial.name, tags=tags).info.run_id
    with closing_run(client, run_id):
        client.log_batch(run_id, params=[mlflow.entities.Param(k, v) for k, v in _trial_params(trial).items()])
        client.log_metric(run_id, "trial.seconds", float(trial.seconds))
        if trial.result is not None:
            log_validation(client, run_id, trial.result)
        if trial.status != BuildStatus.OK and trial.reason:
            client.set_tag(run_id, REASON_TAG, trial.reason[:5000])
    return run_id


def log_searched_candidate(client: Any, experiment_id: str, parent_run_id: str, variant: VariantSpec, trial: Trial,
                           trial_run_id: str, work_dir: Path) -> str:
    """Log the chosen trial as candidate '<V>-searched', a direct child of the parent run, exactly as the
    validate step logs a variant (components/validate/run_log.py `log_validated_model`), variant_result.json
    included (search_of = V, trial_run_id = `trial_run_id`: what the register step reads). Returns the run id.

    Raises:
        StepError: the chosen trial has no model file or no validation result.
    """
    import mlflow

    from tailguard.components.validate.run_log import flat_params, log_validated_model
    from tailguard.core.errors import StepError
    from tailguard.core.results import VariantResult

    if trial.result is None or not trial.model_path or not Path(trial.model_path).is_file():
        raise StepError(f"chosen trial {trial.name} has no validated model file ({trial.model_path})",
                        step="search", variant=variant.name)
    name = searched_name(variant.name)
    tags = {"mlflow.parentRunId": parent_run_id, VARIANT_TAG: name, SEARCH_OF_TAG: variant.name,
            TRIAL_RUN_TAG: trial_run_id, TRIAL_NAME_TAG: trial.name, BACKEND_TAG: variant.backend,
            PRECISION_TAG: variant.precision, STATUS_TAG: BuildStatus.OK.value,
            GATES_TAG: GatesVerdict.NOT_EVALUATED.value}
    run_id = client.create_run(experiment_id, run_name=name, tags=tags).info.run_id
    with closing_run(client, run_id):
        client.log_batch(run_id, params=[mlflow.entities.Param(k, v)
                                         for k, v in flat_params(trial.variant).items()])
        client.log_dict(run_id, dict(trial.config), "search_config.json")
        identity = VariantResult(variant=name, backend=variant.backend, precision=variant.precision,
                                 status=BuildStatus.OK,
                                 run_id=run_id, search_of=variant.name, trial_run_id=trial_run_id or None)
        log_validated_model(client, run_id, trial.result, work_dir=work_dir, model_file=Path(trial.model_path),
                            execution_provider=trial.variant.execution_provider, identity=identity)
    return run_id


def decision_batch_sizes(spec: Spec) -> list[int]:
    """The benchmark batch sizes a search decision reads, in spec order: the promotion batch size ('fastest' is
    judged there: `logic._p50`) and the batch size of every batched gate (latency, throughput, cost, speedup:
    `Spec.gate_batch_size`)."""
    from tailguard.core.spec.gates import BATCHED_METRICS

    wanted = {spec.promotion.batch_size or spec.benchmark.batch_sizes[0]}
    wanted |= {spec.gate_batch_size(g) for g in spec.gates if g.metric in BATCHED_METRICS}
    return [bs for bs in spec.benchmark.batch_sizes if bs in wanted]


def decision_spec(spec: Spec) -> Any:
    """`spec` with benchmark.batch_sizes cut to `decision_batch_sizes`: what each search trial is timed at.

    Timing is most of a trial's cost (every batch size up to benchmark.max_seconds, the FP32 reference
    interleaved), and a batch size no gate and no promotion reads cannot change which trial is chosen. The
    chosen trial's run therefore has perf rows at these batch sizes only (docs/spec.md, `search`)."""
    sizes = decision_batch_sizes(spec)
    if sizes == list(spec.benchmark.batch_sizes):
        return spec
    return spec.model_copy(update={"benchmark": spec.benchmark.model_copy(update={"batch_sizes": sizes})})


def make_evaluate(spec: Spec, variant: VariantSpec, *, reference_outputs: list, validation: Dataset,
                  baselines: dict[str, Any], work_root: Path,
                  reference_model_dir: str | Path | None = None) -> tuple[Callable[[Any, Path], Any], dict[str, Path]]:
    """The `evaluate(trial_variant, model_path)` run_search calls, mirroring the validate step.

    Each trial runs on its own execution provider with spec.benchmark.intra_op_num_threads, over the same
    validation rows and FP32 reference outputs as the validate step, against the same latency baselines, timed
    at the batch sizes the decision reads only (`decision_spec`); its rows are scored sequentially and stop as
    soon as its verdict is known (`analysis.sequential`, so a clearly failing trial costs its build and a few
    hundred rows), and under `tailguard run` its measurements go through the local cache. Gates
    are matched with the SPEC variant's name (`variant.name`), so gates that list variants judge a trial of V
    by V's gates; files go to work_root/<trial name>/. As in the validate step, a trial with non-finite outputs
    fails whatever its gates say (`ValidationResult.passed` is set to False).

    Returns:
        (evaluate, work dirs by trial name) -- the dict fills as trials are evaluated.
    """
    from tailguard.components.validate.gates import verdict
    from tailguard.components.validate.logic import validate_variant
    from tailguard.components.validate.measurements import load_measurements
    from tailguard.components.validate.runners import reference_runners
    from tailguard.core.runtime import timed_ort_runner

    dirs: dict[str, Path] = {}
    # as in the validate step: the FP32 reference timed interleaved with each trial (speed-ratio bounds)
    baseline_runners = reference_runners(spec, reference_model_dir)
    trial_spec = decision_spec(spec)

    def evaluate(trial_variant: VariantSpec, model_path: Path) -> Any:
        runner = timed_ort_runner(model_path, providers=[trial_variant.execution_provider],
                                  intra_op_num_threads=spec.benchmark.intra_op_num_threads)
        d = work_root / trial_variant.name
        if d.exists():
            shutil.rmtree(d)
        dirs[trial_variant.name] = d
        # a trial's outputs and timing rounds are keyed on its model bytes like a variant's (the local cache):
        # a re-run that builds the same trial decides on them again
        measurements, save = load_measurements(trial_spec, trial_variant, model_path, reference_model_dir)
        result = validate_variant(trial_spec, variant.name, runner, reference_outputs, validation, d,
                                  reference_perf=baselines["onnx_fp32"], torch_perf=baselines["torch"],
                                  model_path=model_path, baseline_runners=baseline_runners,
                                  measurements=measurements, p50_decides=True)
        save(measurements)
        result.passed = verdict(result)[0]  # the validate step's verdict: non-finite outputs fail too
        return result

    return evaluate, dirs


@task_entry("search")
def main(*, spec_yaml: str, variant_name: str, validation_json: str, baselines_json: str, parent_run_id: str,
         tracking_uri: str, onnx_dir: str, reference_dir: str, out_dir: str, metrics: Any = None) -> str:
    """Search mixed-precision configurations of `variant_name` for the fastest one that passes every gate.

    Args:
        spec_yaml: the spec.
        variant_name: a spec variant with a `search` section.
        validation_json: the validate task's output for that variant ({variant, status, passed, run_id, ...}).
        baselines_json: reference-pass's output (latency baselines).
        parent_run_id: the pipeline's parent MLflow run.
        tracking_uri: MLflow.
        onnx_dir: export's output folder (model.onnx, the FP32 model).
        reference_dir: reference-pass's output folder (reference_outputs.npz).
        out_dir: output folder: the search artifacts under search/ and, when a trial was chosen, its model as
            model.onnx.
        metrics: optional KFP Output[Metrics] (search.trials, search.passed_trials, search.skipped_families,
            search.chosen_p50_ms).

    Returns:
        JSON: SearchResult.to_dict() plus status (ok | not_needed | skipped | failed), reason, variant_run_id,
        searched_run_id (the '<V>-searched' run or None), trial_run_ids ({index: run id}).

    A search that raises (a trial graph ONNX cannot read, an opset the quantizer cannot write...) fails alone: V's
    run is tagged tailguard.search = failed, its search/search.json says why (status failed, reason) and the task
    returns, so the run's other variants and its summary go on (issue 38: a broken search stopped the whole run).

    Raises:
        StepError: the validate output has no run id.
    """
    import mlflow

    from tailguard.components.search.logic import run_search, write_search_artifacts
    from tailguard.components.validate.runners import load_reference_outputs, parse_baselines
    from tailguard.core.contract import ONNX_FILE, REFERENCE_FILE
    from tailguard.core.data import load_calibration, load_validation
    from tailguard.core.errors import StepError
    from tailguard.core.spec import spec_from_yaml
    from tailguard.core.tracking import configure, experiment_name_for

    spec = spec_from_yaml(spec_yaml)
    variant = next(v for v in spec.variants if v.name == variant_name)
    validation = json.loads(validation_json)
    variant_run_id = validation.get("run_id")
    if not variant_run_id:
        raise StepError("the validate output names no MLflow run", step="search", variant=variant_name)
    exp_id = configure(tracking_uri, experiment_name_for(spec))
    client = mlflow.MlflowClient()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    base: dict[str, Any] = {"variant": variant.name, "variant_run_id": variant_run_id, "searched_run_id": None,
                            "trial_run_ids": {}}
    status, reason = search_decision(variant, validation)
    if status is not None:
        client.set_tag(variant_run_id, SEARCH_TAG, status)
        d = {**base, "status": status, "reason": reason}
        write_json(out / "search.json", d)
        return json.dumps(d, default=str)

    work = Path(tempfile.mkdtemp(prefix=f"tailguard-search-{variant.name}-"))
    try:
        calibration_all = load_calibration(spec)
        static = variant.quantization is not None and variant.quantization.mode == "static"
        evaluate, dirs = make_evaluate(
            spec, variant, reference_outputs=load_reference_outputs(spec, Path(reference_dir) / REFERENCE_FILE),
            validation=load_validation(spec), baselines=parse_baselines(baselines_json), work_root=work / "eval",
            reference_model_dir=onnx_dir)
        trial_runs: dict[int, str] = {}

        def on_trial(trial: Trial) -> None:
            trial_runs[trial.index] = log_trial(client, exp_id, variant_run_id, variant, trial)

        result = run_search(spec, variant, Path(onnx_dir) / ONNX_FILE, work / "search",
                            calibration=calibration_all if static else None, sensitivity_data=calibration_all,
                            evaluate=evaluate, on_trial=on_trial)
        artifacts_dir = out / SEARCH_ARTIFACT_PATH
        write_search_artifacts(result, artifacts_dir)
        client.log_artifacts(variant_run_id, str(artifacts_dir), artifact_path=SEARCH_ARTIFACT_PATH)
        chosen = result.trials[result.chosen] if result.chosen is not None else None
        client.set_tag(variant_run_id, SEARCH_STOPPED_TAG, result.stopped_by)
        client.log_metric(variant_run_id, "search.skipped_families", float(len(result.skipped)))
        searched_run_id = None
        if chosen is not None:
            searched_run_id = log_searched_candidate(client, exp_id, parent_run_id, variant, chosen,
                                                     trial_runs.get(chosen.index, ""), dirs[chosen.name])
            shutil.copyfile(chosen.model_path, out / "model.onnx")
        client.set_tag(variant_run_id, SEARCH_TAG, chosen.name if chosen is not None else SearchStatus.NONE)
        if metrics is not None:
            metrics.log_metric("search.trials", float(len(result.trials)))
            metrics.log_metric("search.passed_trials", float(sum(t.passed for t in result.trials)))
            metrics.log_metric("search.skipped_families", float(len(result.skipped)))
            if chosen is not None and chosen.p50_ms is not None:
                metrics.log_metric("search.chosen_p50_ms", float(chosen.p50_ms))
        d = {**result.to_dict(), **base, "status": BuildStatus.OK,
             "reason": "" if chosen is not None else "no trial passed every gate",
             "searched_run_id": searched_run_id, "trial_run_ids": {str(k): v for k, v in trial_runs.items()}}
        return json.dumps(d, default=str)
    except Exception as exc:  # a search that breaks fails alone: the other variants and the summary go on
        first = (str(exc).strip().splitlines() or [""])[0][:400]
        reason = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
        client.set_tag(variant_run_id, SEARCH_TAG, SearchStatus.FAILED)
        d = {**base, "status": SearchStatus.FAILED, "reason": reason, "trials": [],
             "stopped_by": f"failed ({reason})"}
        write_json(out / "search.json", d)
        client.log_artifact(variant_run_id, str(out / "search.json"), artifact_path=SEARCH_ARTIFACT_PATH)
        print(f"tailguard search: {variant.name}: the search failed, the run goes on without it: {reason}",
              file=sys.stderr)
        return json.dumps(d, default=str)
    except BaseException:
        client.set_tag(variant_run_id, SEARCH_TAG, SearchStatus.FAILED)
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
