"""Task glue of the validate component: run the variant, compute parity/latency/gates, log the nested run."""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tailguard.core.contract import (
    ARTIFACT_FINGERPRINT_TAG,
    BACKEND_TAG,
    COVERAGE_TAG,
    DISCOVERED_TAG,
    FILES_SHA256_TAG,
    GATES_TAG,
    MODEL_URI_TAG,
    NUMERICS_TAG,
    PRECISION_TAG,
    REASON_TAG,
    SHA256_TAG,
    STATUS_TAG,
    TARGET_CHECK_TAG,
    TARGET_PLACEMENT_TAG,
    TARGET_TAG,
    VALIDATION_RESULT_FILE,
    VARIANT_RESULT_FILE,
    VARIANT_TAG,
    WORST_SLICE_TAG,
    gate_name_tag,
    gate_tag,
)
from tailguard.core.results import BuildResult, BuildStatus, GatesVerdict, VariantResult
from tailguard.core.spec.models import target_task_name
from tailguard.core.taskio import task_entry, write_json

if TYPE_CHECKING:
    from tailguard.components.validate.logic import ValidationResult
    from tailguard.core.data import Dataset
    from tailguard.core.spec.models import Spec, VariantSpec


def discovered_summary(records: list[dict[str, Any]], top: int = 3) -> list[dict[str, Any]]:
    """The `top` worst significant discovered slices (discovery table records, worst first) as
    {slice, value, support, metric, value_in_slice, value_rest, q_value}: the `tailguard.discovered` tag."""
    keys = ("slice", "value", "support", "metric", "value_in_slice", "value_rest", "q_value")
    return [{k: r.get(k) for k in keys} for r in records if bool(r.get("significant"))][:top]


def flat_params(variant: VariantSpec) -> dict[str, str]:
    """The variant's spec as flat MLflow params (quantization.mode=static, ...)."""
    out: dict[str, str] = {}

    def walk(prefix: str, obj: Any) -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        else:
            out[prefix] = json.dumps(obj) if isinstance(obj, list) else str(obj)

    walk("", variant.model_dump(mode="json"))
    return {k: v[:6000] for k, v in out.items()}


def _sha256(path: Path) -> str:
    """sha256 of a file, hex (tailguard.core.digests.file_sha256)."""
    from tailguard.core.digests import file_sha256

    return file_sha256(path)


def parse_baselines(baselines_json: str) -> dict[str, Any]:
    """Baselines JSON with batch-size keys turned back into ints."""
    raw = json.loads(baselines_json) if baselines_json else {}
    def fix(d):
        return {int(k): v for k, v in d.items()} if d else None
    return {"torch": fix(raw.get("torch")), "onnx_fp32": fix(raw.get("onnx_fp32")), "rows": raw.get("rows")}


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


def variant_run_tags(variant: VariantSpec, build: dict[str, Any], parent_run_id: str,
                     hw_tags: dict[str, str]) -> dict[str, str]:
    """The tags a variant's run is created with: its parent run, name, backend, precision, the build's status,
    tailguard.gates `not_evaluated` (until the gates are decided) and `hw_tags` (`hardware.hardware_tags`: the node
    that validates and times the variant)."""
    return {"mlflow.parentRunId": parent_run_id, VARIANT_TAG: variant.name, BACKEND_TAG: variant.backend,
            PRECISION_TAG: variant.precision, STATUS_TAG: build["status"],
            GATES_TAG: GatesVerdict.NOT_EVALUATED.value, **hw_tags}


def write_validation_record(record: dict[str, Any]) -> None:
    """Under a local run ($TAILGUARD_RUN_DIR set by the runner), keep what this validation read and logged in
    `<run dir>/validations/<variant>[-on-<target>].json`: the build JSON, the baselines JSON, the folders of the
    variant's model, the reference outputs and the FP32 reference model, the variant's run id, status and model
    URI. A later run whose only change is in `gates` or `promotion` decides again on them (components/redecide).
    Nothing on a cluster; a write error is ignored (the later run then runs the whole pipeline)."""
    import os

    from tailguard.core.contract import RUN_DIR_ENV, VALIDATIONS_DIR

    run_dir = os.environ.get(RUN_DIR_ENV)
    if not run_dir:
        return
    name = record["variant"] + (f"-on-{record['target_name']}" if record.get("target_name") else "")
    try:
        folder = Path(run_dir) / VALIDATIONS_DIR
        folder.mkdir(parents=True, exist_ok=True)
        write_json(folder / f"{name}.json", record)
    except OSError:
        pass


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


def log_variant_result(client: Any, run_id: str, result: VariantResult) -> None:
    """Log `result` to run `run_id` as the artifact VARIANT_RESULT_FILE (JSON; inf/NaN as Python's json writes
    them). Written last for a validated candidate: its presence says the validation finished."""
    client.log_dict(run_id, result.to_dict(), VARIANT_RESULT_FILE)


def _log_failed_result(client: Any, run_id: str, identity: VariantResult, reason: str) -> None:
    """Best effort: a failed variant_result.json for a validation that raised (register treats a run without
    the file as failed anyway, so a store error here must not hide the original exception)."""
    import dataclasses

    try:
        log_variant_result(client, run_id, dataclasses.replace(identity, status=BuildStatus.FAILED, passed=False,
                                                               reason=reason[:5000]))
    except Exception:  # noqa: BLE001 - see the docstring
        pass


class VariantUnusable(Exception):
    """The built variant cannot be loaded on this node (a torch artefact or TensorRT plan built for another node or
    library version, or a torch package whose native loader crashed a probe process): the variant fails with the
    reason, the run goes on."""


def torch_runner(spec: Spec, variant: VariantSpec, model_file: Path, build: dict[str, Any], ds: Dataset) -> Any:
    """The torch variant's runner: its manifest checked against this node (and, for an AOTInductor package, a
    load-and-run probe in a child process first, `torch_backend.probe_load`), a program.pt2 read for code
    (`tailguard.core.pt2_archive`, unless model.source.trusted), then loaded here.

    Raises:
        VariantUnusable: the manifest check failed, the program.pt2 holds code (a pickled weight, e.g. of a tensor
            subclass, without model.source.trusted) or the probe process crashed (the reason names which).
    """
    from tailguard.core.artifacts import ArtifactMismatchError
    from tailguard.core.data import make_batch
    from tailguard.core.errors import UntrustedModelError
    from tailguard.core.torch_backend import TorchVariantRunner, config_of, loads_trusted, probe_load

    config = config_of(variant)
    source = (build.get("details") or {}).get("source_sha256", "")
    trusted = loads_trusted(variant, spec.model.source.trusted)
    try:
        if config.compile == "aot_inductor":
            feeds = make_batch(ds, np.arange(min(2, ds.n_rows)), spec.model.inputs, pad_values=spec.model.pad_values)
            crash = probe_load(model_file, config, spec.model.inputs, source_sha256=source, feeds=feeds,
                               trusted=trusted)
            if crash:
                raise VariantUnusable(crash)
        return TorchVariantRunner(model_file, config, spec.model.inputs, source_sha256=source,
                                  intra_op_num_threads=spec.benchmark.intra_op_num_threads, trusted=trusted)
    except (ArtifactMismatchError, UntrustedModelError) as exc:  # the variant fails with the reason; the run goes on
        raise VariantUnusable(str(exc)) from None


MEASUREMENTS_STEP = "validate-measurements"  # the local cache's step name of a variant's stored measurements
MEASUREMENTS_NPZ, TIMING_JSON = "measurements.npz", "timing.json"


def measurement_parts(spec: Spec, variant: VariantSpec, model_file: Path,
                      reference_model_dir: str | Path | None) -> dict[str, Any] | None:
    """What a variant's measurements (its outputs on the validation rows and its timing rounds, `logic.Measurements`)
    are a function of, for the local cache key: the variant's model bytes, its execution provider and the threads,
    the FP32 baseline model it is timed against, the validation rows (bytes and section), the model's inputs,
    outputs and pad values, the `benchmark` section, the row order and blocks (`analysis.sequential` seed,
    block_rows, enabled) and the node (`tailguard.core.hardware.node_facts`: CPU model, ISA flags, cores, library
    versions). Not the gates nor promotion: a re-run that changes only those decides on the stored measurements.

    Returns:
        The parts, or None when the validation file cannot be hashed (a remote URI): then nothing is cached.
    """
    from tailguard.core.cache import dataset_parts
    from tailguard.core.contract import ONNX_FILE
    from tailguard.core.digests import dir_sha256, file_sha256
    from tailguard.core.hardware import node_facts

    validation = dataset_parts(spec.data.validation)
    if validation is None:
        return None
    seq = spec.analysis.sequential
    return {"variant_model": file_sha256(model_file), "execution_provider": variant.execution_provider,
            "threads": spec.benchmark.intra_op_num_threads,
            "baseline_model": dir_sha256(reference_model_dir, prefix=ONNX_FILE) if reference_model_dir else None,
            "validation": validation,
            "model": spec.model.model_dump(mode="json", include={"inputs", "outputs", "pad_values", "task"}),
            "benchmark": spec.benchmark.model_dump(mode="json"),
            "order": {"enabled": seq.enabled, "seed": seq.seed, "block_rows": seq.block_rows},
            "node": node_facts()}


MEASUREMENTS_DIGEST = "content_sha256"  # the entry's result.json field: digest of measurements.npz and timing.json


def measurements_digest(files: Path) -> str:
    """Hex SHA-256 over the stored measurement files (`MEASUREMENTS_NPZ`, `TIMING_JSON`: names and bytes) in
    `files` (`tailguard.core.digests.files_sha256`)."""
    from tailguard.core.digests import files_sha256

    return files_sha256([files / MEASUREMENTS_NPZ, files / TIMING_JSON], files)


def load_measurements(spec: Spec, variant: VariantSpec, model_file: Path,
                      reference_model_dir: str | Path | None) -> tuple[Any, Any]:
    """The variant's stored measurements from the local cache and the function that stores them again.

    The entry carries the digest of its files (`measurements_digest`, stored in its result as
    `MEASUREMENTS_DIGEST`), checked here before anything is read: an entry whose files changed after they were
    stored (an edited outputs array, a truncated copy) or that has no digest is not used, and says so on stderr;
    the returned Measurements is then empty with `discarded` set, so a validation measures again and a gate-only
    re-run falls back to a full run instead of deciding on it.

    Returns:
        (Measurements, save) when the cache is on (`tailguard run`, tailguard.core.cache.enabled) and the inputs can
        be hashed: an empty Measurements on a miss; save(measurements) stores it (replacing the entry) when its
        `changed` is set. (None, a no-op) otherwise.
    """
    from tailguard.components.validate.logic import Measurements
    from tailguard.core import cache

    if not cache.enabled():
        return None, lambda m: None
    parts = measurement_parts(spec, variant, model_file, reference_model_dir)
    if parts is None:
        return None, lambda m: None
    key = cache.cache_key(MEASUREMENTS_STEP, parts)
    m = Measurements()
    entry = cache.lookup(key)
    if entry is not None:
        try:
            files = Path(entry.path) / "files"
            stored = json.loads((Path(entry.path) / "result.json").read_text()).get(MEASUREMENTS_DIGEST)
            if stored != measurements_digest(files):
                m.discarded = (f"its stored measurements (cache entry {entry.key[:12]}) do not match the digest "
                               f"stored with them{'' if stored else ' (none stored)'}: changed after they were "
                               "stored, so they are not used")
                print(f"tailguard: variant {variant.name}: {m.discarded}; measuring again", file=sys.stderr,
                      flush=True)
                return m, save_fn(key, variant)
            with np.load(files / MEASUREMENTS_NPZ) as z:
                m.order, m.outputs = z["order"], z["outputs"]
                m.block_sizes = [int(b) for b in z["block_sizes"]]
                m.exact_outputs = z["exact_outputs"] if "exact_outputs" in z.files else None
            raw = json.loads((files / TIMING_JSON).read_text())
            m.timing = {n: {int(bs): row for bs, row in rows.items()} for n, rows in raw.items()} or None
        except (OSError, ValueError, KeyError):  # pruned or replaced while read: measure again
            m = Measurements()
    return m, save_fn(key, variant)


def save_fn(key: str, variant: VariantSpec) -> Any:
    """The function that stores a variant's measurements under `key` with their digest (`load_measurements`)."""
    from tailguard.core import cache

    def save(meas: Any) -> None:
        if meas is None or not meas.changed or meas.order is None:
            return
        with tempfile.TemporaryDirectory(prefix="tailguard-measurements-") as tmp:
            arrays = {"order": meas.order, "outputs": meas.outputs,
                      "block_sizes": np.asarray(meas.block_sizes, dtype=np.int64)}
            if meas.exact_outputs is not None:
                arrays["exact_outputs"] = meas.exact_outputs
            np.savez(Path(tmp) / MEASUREMENTS_NPZ, **arrays)
            timing = {n: {str(bs): row for bs, row in rows.items()} for n, rows in (meas.timing or {}).items()}
            Path(tmp, TIMING_JSON).write_text(json.dumps(timing, default=json_default_safe))
            try:
                cache.store(key, tmp, {MEASUREMENTS_DIGEST: measurements_digest(Path(tmp)),
                                       "rows_scored": int(meas.order.size),
                                       "timed_batch_sizes": sorted({int(bs) for rows in (meas.timing or {}).values()
                                                                    for bs in rows})},
                            step=MEASUREMENTS_STEP, label=f"measurements {variant.name}", replace=True)
                cache.prune()
            except OSError:  # a full disk must not fail the validation: the result is still good
                pass

    return save


def json_default_safe(o: Any) -> Any:
    """json default for numpy scalars and arrays in stored timing rows."""
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def reference_runners(spec: Spec, reference_model_dir: str | Path | None) -> dict[str, Any] | None:
    """The baselines timed interleaved with a variant: {"onnx_fp32": the FP32 reference ONNX}, on the CPU
    execution provider with the spec's threads, built as every timed ORT session is
    (`tailguard.core.runtime.timed_ort_runner`: no spin-waiting, so the ratio is the one the reference pass and the
    promotion's paired rounds measure); None without a folder.

    Raises:
        InputError: the folder has no model.onnx.
    """
    if not reference_model_dir:
        return None
    from tailguard.core.contract import ONNX_FILE
    from tailguard.core.runtime import timed_ort_runner

    return {"onnx_fp32": timed_ort_runner(Path(reference_model_dir) / ONNX_FILE,
                                          intra_op_num_threads=spec.benchmark.intra_op_num_threads)}


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
                                  onnx=variant.backend == "onnxruntime")  # torch, TensorRT: the file + manifest
        if measurements is not None:  # the local cache: true when nothing was measured again (a gate-only change)
            out["cached"] = reused and not measurements.changed
        return out
    finally:
        shutil.rmtree(work, ignore_errors=True)


def ort_session_providers(variant: VariantSpec, build: dict[str, Any], variant_dir: Path) -> list[Any]:
    """The providers (with options) an ONNX Runtime variant was built and load-checked with (build.json
    `details.providers`, `tensorrt_build.ort_providers`), cache folders resolved under `variant_dir`; a build.json
    without them (an older build) gives the bare execution provider."""
    from tailguard.core.runtime import resolve_provider_paths

    recorded = (build.get("details") or {}).get("providers")
    return resolve_provider_paths(recorded or [variant.execution_provider], variant_dir)


def tensorrt_expected_fingerprint(build: dict[str, Any], reference_model_dir: str | Path | None, *,
                                  facts: Any = None) -> dict[str, Any]:
    """The fingerprint a TensorRT plan must carry to run here (`TensorRTRunner`'s `expected`): this node's
    TensorRT version, GPU, compute capability and CUDA version (`tensorrt_device_facts`, or `facts()`), the sha256
    of the FP32 ONNX in `reference_model_dir` (else the recorded one) and the sha256 of the build config recorded
    in build.json.

    Raises:
        InputError: build.json has no build_config (not a TensorRT build of this tailguard).
        MissingDependencyError: no TensorRT / CUDA here.
    """
    from tailguard.core.artifacts import config_sha256
    from tailguard.core.contract import ONNX_FILE
    from tailguard.core.digests import file_sha256
    from tailguard.core.errors import InputError
    from tailguard.core.runtime import tensorrt_device_facts

    details = build.get("details") or {}
    if not isinstance(details.get("build_config"), dict):
        raise InputError("build.json of a TensorRT variant has no details.build_config",
                         hint="rebuild the variant with this tailguard version")
    onnx = Path(reference_model_dir) / ONNX_FILE if reference_model_dir else None
    onnx_sha = file_sha256(onnx) if onnx is not None and onnx.is_file() else (
        (details.get("fingerprint") or {}).get("onnx_sha256"))
    return {**(facts or tensorrt_device_facts)(), "onnx_sha256": onnx_sha,
            "build_config_sha256": config_sha256(details["build_config"])}


def variant_runner(spec: Spec, variant: VariantSpec, build: dict[str, Any], variant_dir: Path,
                   reference_model_dir: str | Path | None) -> Any:
    """The runner of a built variant: a `TensorRTRunner` for backend tensorrt (the plan checked against its manifest
    and this node before TensorRT deserializes it), else an ONNX Runtime session on the providers and options it was
    built with (`ort_session_providers`), built as every timed session is (`runtime.timed_ort_runner`)."""
    from tailguard.core.runtime import TensorRTRunner, timed_ort_runner

    model_file = variant_dir / build["artifact"]
    if variant.backend == "tensorrt":
        return TensorRTRunner(model_file, tensorrt_expected_fingerprint(build, reference_model_dir),
                              output_names=[o.name for o in spec.model.outputs])
    return timed_ort_runner(model_file, providers=ort_session_providers(variant, build, variant_dir),
                            intra_op_num_threads=spec.benchmark.intra_op_num_threads)


def coverage_line(cov: dict[str, Any]) -> str:
    """One line for logs and tags from an INT8 build's `quantization_coverage` details (the dict of
    components/quantize/macs.py `quantization_coverage`): '3/3 MAC nodes INT8, 100.0% of 3.39 kMACs per sample'."""
    frac = cov.get("quantized_mac_fraction")
    total = cov.get("macs_total") or 0
    size = next((f"{total / d:.3g} {u}" for d, u in ((1e9, "GMACs"), (1e6, "MMACs"), (1e3, "kMACs"))
                 if total >= d), f"{total} MACs")
    share = "no MACs counted" if frac is None else f"{frac * 100:.1f}% of {size} per sample"
    return f"{cov.get('quantized_mac_nodes', 0)}/{cov.get('quantizable_nodes', 0)} MAC nodes INT8, {share}"


def log_coverage(client: Any, run_id: str, build: dict[str, Any]) -> None:
    """An INT8 build's quantization coverage on the variant's run, as tag COVERAGE_TAG (one line, or the reason
    it could not be counted). The metric quantized_mac_fraction comes with the validation's metrics (read from
    the model file: `gates.build_metrics`). Nothing for builds without coverage (fp32, fp16, skipped)."""
    cov = (build.get("details") or {}).get("quantization_coverage")
    if isinstance(cov, dict):
        client.set_tag(run_id, COVERAGE_TAG, (f"not counted: {cov['error']}" if cov.get("error")
                                              else coverage_line(cov))[:5000])


def load_reference_outputs(spec: Spec, reference_file: Path) -> list[np.ndarray]:
    """The FP32 reference outputs saved by reference-pass, in model.outputs order (each (rows, ...))."""
    with np.load(reference_file) as npz:
        # token_classification keeps only its first output (as ids: components/reference/logic.py)
        return [npz[o.name] for o in spec.model.outputs if o.name in npz.files]


def log_validation(client: Any, run_id: str, result: ValidationResult, *, metrics: Any = None,
                   model_id: str | None = None) -> tuple[bool, str]:
    """Log a ValidationResult's verdict to run `run_id`: metrics, gate tags, worst slice, reason.

    Args:
        client: an MlflowClient.
        run_id: the run to log to (it may be finished already).
        result: the ValidationResult.
        metrics: a KFP Output[Metrics] that also gets the metrics other than slice.* (None: MLflow only).
        model_id: the id of a LoggedModel already logged to this run: each metric is also linked to it (MLflow's
            `Metric.model_id`; the run gets the same metrics either way), in the one log_batch. None: the metrics
            are the run's only (MLflow links them to a model logged later itself, one query per metric).

    Returns:
        (passed, reason) as `gates.verdict` gives them; tags tailguard.gates and tailguard.reason say the same.
    """
    import mlflow

    flat = result.mlflow_metrics()
    client.log_batch(run_id, metrics=[mlflow.entities.Metric(k, float(v), 0, 0, model_id=model_id)
                                      for k, v in flat.items() if v is not None and np.isfinite(v)])
    if metrics is not None:
        for k, v in flat.items():
            if v is not None and not k.startswith("slice.") and np.isfinite(v):
                metrics.log_metric(k, float(v))
    from tailguard.components.validate.gates import verdict

    passed, reason = verdict(result)
    client.set_tag(run_id, GATES_TAG, GatesVerdict.PASSED if passed else GatesVerdict.FAILED)
    for g in result.gates:
        client.set_tag(run_id, gate_tag(g.gate), g.status)
        client.set_tag(run_id, gate_name_tag(g.gate), g.gate)  # the canonical spelling, in the value
    if result.worst_slice:
        client.set_tag(run_id, WORST_SLICE_TAG, json.dumps(result.worst_slice, default=str))
    if result.discovery is not None:
        client.set_tag(run_id, DISCOVERED_TAG, json.dumps(discovered_summary(result.discovered), default=str))
    if getattr(result, "numerics", None):  # consistent | hardware_dependent | not_checked (logic.compare_numerics)
        client.set_tag(run_id, NUMERICS_TAG, str(result.numerics.get("status")))
    if reason:
        client.set_tag(run_id, REASON_TAG, reason[:5000])
    return passed, reason


def onnx_pip_requirements(execution_provider: str) -> list[str]:
    """The pip requirements saved with a logged ONNX variant: onnx and the ONNX Runtime distribution installed
    here, pinned (onnxruntime-gpu when it is installed or the execution provider is CUDA/TensorRT).

    Passing them to `mlflow.onnx.log_model` skips MLflow's requirement inference, which starts a subprocess
    that imports the flavor (seconds per logged model)."""
    from importlib import metadata

    import onnx

    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    gpu = version("onnxruntime-gpu")
    wants_gpu = execution_provider in ("CUDAExecutionProvider", "TensorrtExecutionProvider")
    ort = ("onnxruntime-gpu", gpu) if gpu or wants_gpu else ("onnxruntime", version("onnxruntime"))
    return [f"onnx=={onnx.__version__}", f"{ort[0]}=={ort[1]}" if ort[1] else ort[0]]


def log_validated_model(client: Any, run_id: str, result: ValidationResult, *, work_dir: Path, model_file: Path,
                        execution_provider: str, metrics: Any = None, report_path: str | None = None,
                        identity: VariantResult | None = None, onnx: bool = True,
                        model_uri: str | None = None) -> dict[str, Any]:
    """Log a validated model to its run the way the register step reads it.

    Logs, in this order: an ONNX model itself (mlflow.onnx.log_model under "model"; with `onnx` True and no
    `model_uri`), `log_validation`'s metrics and tags (the metrics linked to that model's LoggedModel in the same
    log_batch), result.json (`result.to_dict()`, written first so the logged copy is the final one), every file
    of `work_dir` as an artifact (slices.csv, report.html, result.json, ...), the model's sha256 (tag
    tailguard.sha256), a node-bound artefact (with `onnx` False), the model's URI (tag tailguard.model_uri) and,
    last, variant_result.json (`variant_result`: what register reads). Used by the validate step and by the
    search step for the chosen trial.

    The ONNX model goes first because MLflow 3's log_model links every step-0 metric already on the run to the
    new LoggedModel with one get_metric_history query per metric (`Model.log`): for the validation's hundreds of
    metrics, 0.7-1.2 s of each validate task (py-spy of `tailguard demo`, MLflow 3.17). Logged after it with the
    model's id, they end the same way (on the run and on the LoggedModel) in one log_batch; metrics logged on
    the run earlier are still copied by MLflow.

    Args:
        client: an MlflowClient.
        run_id: the run (tags tailguard.variant, tailguard.status already set by the caller).
        result: the model's ValidationResult.
        work_dir: the folder validate_variant wrote into.
        model_file: the validated .onnx file, or (with `onnx` False) a node-bound artefact with its manifest
            `<file>.json` beside it (a torch program.pt2 / package.pt2, a TensorRT plan).
        execution_provider: the ONNX Runtime EP the model is meant for (saved with the MLflow model).
        onnx: True: log with mlflow.onnx.log_model (an MLflow model); False: log the artefact and its manifest as
            the run's "model" folder (registered by the register step with create_model_version) and tag the
            artefact's fingerprint (ARTIFACT_FINGERPRINT_TAG) and the digest of the folder's files
            (FILES_SHA256_TAG).
        metrics: optional KFP Output[Metrics].
        report_path: optional path the report.html is copied to (a KFP Output[HTML]).
        identity: the candidate's name, backend, precision and search fields for variant_result.json (its
            verdict fields are filled here); None: named `result.variant`, backend and precision unknown ("").
        model_uri: the URI of this same model (same bytes: `model_file`) already logged by an earlier run: it is
            not logged again; the run's tailguard.model_uri and variant_result.json name that URI (a re-decided
            run, components/redecide). None: the model is logged to this run.

    Returns:
        {passed, reason, model_uri, overall, perf, gates, worst_slice} for the task's output JSON.
    """
    import mlflow

    logged_here = model_uri is None
    model_id = None
    if logged_here and onnx:  # before the metrics: see the docstring
        import onnx as onnx_lib

        with mlflow.start_run(run_id=run_id):
            # explicit requirements: without them MLflow infers them in a subprocess that imports the flavor
            # (measured 3.5 of the validate task's 9 s on the tiny MLP)
            info = mlflow.onnx.log_model(onnx_model=onnx_lib.load(str(model_file)), name="model",
                                         save_as_external_data=False,
                                         onnx_execution_providers=[execution_provider],
                                         pip_requirements=onnx_pip_requirements(execution_provider))
        model_uri, model_id = info.model_uri, info.model_id
    passed, reason = log_validation(client, run_id, result, metrics=metrics, model_id=model_id)
    d = result.to_dict()
    write_json(Path(work_dir) / VALIDATION_RESULT_FILE, d)  # before the upload below, so it is the one logged
    for f in sorted(Path(work_dir).iterdir()):
        if f.is_dir():
            client.log_artifacts(run_id, str(f), artifact_path=f.name)
        else:
            client.log_artifact(run_id, str(f))
    if report_path and (Path(work_dir) / "report.html").exists():
        Path(report_path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(Path(work_dir) / "report.html", report_path)
    sha = _sha256(Path(model_file))
    client.set_tag(run_id, SHA256_TAG, sha)
    if logged_here and not onnx:
        from tailguard.core.artifacts import manifest_path

        manifest = manifest_path(model_file)
        client.log_artifact(run_id, str(model_file), artifact_path="model")
        client.log_artifact(run_id, str(manifest), artifact_path="model")
        client.set_tag(run_id, ARTIFACT_FINGERPRINT_TAG,
                       json.dumps(json.loads(manifest.read_text()).get("fingerprint", {}), sort_keys=True)[:5000])
        from tailguard.core.digests import files_sha256

        # the folder as registered (`tailguard fetch` checks every file of it against this)
        client.set_tag(run_id, FILES_SHA256_TAG, files_sha256([Path(model_file), manifest], Path(model_file).parent))
        model_uri = f"runs:/{run_id}/model"
    client.set_tag(run_id, MODEL_URI_TAG, model_uri)
    identity = identity or VariantResult(variant=result.variant, backend="", precision="", status=BuildStatus.OK)
    log_variant_result(client, run_id, variant_result(identity, result, passed=passed, reason=reason,
                                                      run_id=run_id, model_uri=model_uri, sha256=sha))
    return {"passed": passed, "reason": reason, "model_uri": model_uri,
            "overall": d.get("overall"), "perf": d.get("perf"), "gates": d.get("gates"),
            "worst_slice": d.get("worst_slice")}


def variant_result(identity: VariantResult, result: ValidationResult, *, passed: bool, reason: str, run_id: str,
                   model_uri: str | None, sha256: str | None) -> VariantResult:
    """The VariantResult of a validated candidate: `identity`'s name, backend, precision and search fields, the
    verdict (`passed`, `reason`, as `gates.verdict` decided them), and from the ValidationResult `result` the scalar
    perf at each benchmark batch size (raw timings left out), the overall metrics, each gate's
    {gate, status, metric, observed, threshold}, the worst slice, the top discovered slices
    (`discovered_summary`), quantized_mac_fraction and the numerics check (`hardware_dependent`, `numerics`
    without the exact pass's full metrics and gates, which stay in result.json)."""
    import dataclasses
    import numbers

    def scalars(row: dict[str, Any]) -> dict[str, float]:
        return {k: float(v) for k, v in (row or {}).items()
                if isinstance(v, numbers.Real) and not isinstance(v, bool)}

    frac = result.overall.get("quantized_mac_fraction")
    num = getattr(result, "numerics", None) or None
    return dataclasses.replace(
        identity, status=BuildStatus.OK, passed=bool(passed), reason=reason, run_id=run_id, model_uri=model_uri,
        sha256=sha256, perf={int(bs): scalars(row) for bs, row in result.perf.items()},
        overall=scalars(result.overall),
        gates=[{"gate": g.gate, "status": g.status, "metric": g.metric, "observed": g.observed,
                "threshold": g.threshold} for g in result.gates],
        worst_slice=result.worst_slice,
        discovered=discovered_summary(result.discovered) if result.discovery is not None else [],
        quantized_mac_fraction=None if frac is None or np.isnan(float(frac)) else float(frac),
        hardware_dependent=None if num is None else num.get("hardware_dependent"),
        rows=int(result.rows), rows_used=None if getattr(result, "rows_used", None) is None else int(result.rows_used),
        numerics=None if num is None else {k: v for k, v in num.items() if k not in ("exact_overall", "exact_gates")})
