"""The contract between the steps: artifact file names, the `tailguard.*` MLflow tag names and the key formats that
more than one unit reads or writes. One home so that no component imports another for a constant.

The values are the public names in MLflow and on disk (docs/spec.md, docs/architecture.md): changing one
changes what users and dashboards see. Every `tailguard.*` MLflow tag name (runs and model versions) is defined
here and used by name elsewhere; tests/integration/test_layout.py fails on a tag name spelled as a string literal
outside this module.
"""

from __future__ import annotations

import re
from typing import Any

# ------------------------------------------------------------------------------------------------ files
ONNX_FILE = "model.onnx"                   # export's FP32 reference model, read by quantize, validate, search
EXPORT_FACTS_FILE = "export.json"          # export's facts beside ONNX_FILE (output check, warnings); read by build
REFERENCE_FILE = "reference_outputs.npz"   # export's FP32 outputs on the validation rows, read by validate, search
DATA_CHECK_FILE = "data_check.json"        # check_data's report
RUN_REPORT_FILE = "report.html"            # the parent run's report artifact (register, `tailguard report`)
SEARCH_ARTIFACT_PATH = "search"            # artifact folder of a search on the searched variant's run
SEARCH_JSON = f"{SEARCH_ARTIFACT_PATH}/search.json"
VARIANT_RESULT_FILE = "variant_result.json"  # results.VariantResult, on each candidate's run; read by register
VALIDATION_RESULT_FILE = "result.json"     # validate's full ValidationResult.to_dict(), on each validated run
COVERAGE_CSV = "calibration_coverage.csv"  # reference-pass's calibration coverage table, on the parent run
COVERAGE_JSON = "calibration_coverage.json"  # {"calibration.groups_missing": .., "calibration.min_coverage_ratio": ..}
BASELINES_FILE = "baselines.json"          # reference-pass's latency baselines (its output folder)

# ------------------------------------------------------------------------------------------------ parent-run tags
PARENT_TAG = "tailguard.pipeline_run"      # on every run of a pipeline run: the parent run id (set by resolve)
ALIAS_AT_START_TAG = "tailguard.alias_at_start"  # where the promotion alias pointed at the start ("" = nowhere)
PROMOTION_TAG = "tailguard.promotion"      # results.PromotionStatus: promoted | superseded | not_promoted
ALIAS_VERSION_TAG = "tailguard.alias_version"  # the version holding the alias when the tag was written
SUPERSEDED_BY_TAG = "tailguard.superseded_by"  # parent run id of the run whose promotion replaced this one's
REPORT_ERROR_TAG = "tailguard.report_error"  # why report.html could not be written
KFP_RUN_TAG = "tailguard.kfp_run"          # the KFP pipeline job id of a parent run
FAILURE_MESSAGE_TAG = "tailguard.failure_message"  # the first task error of a run, set by the failing task
NOTE_TAG = "mlflow.note.content"           # a run's description in the MLflow UI (MLflow's own name)
SPEC_TAG = "tailguard.spec"                # the spec's metadata.name (set by resolve)
SPEC_SHA256_TAG = "tailguard.spec_sha256"  # hex sha256 of the spec as run (parent runs and registered versions)
SOURCE_MODEL_TAG = "tailguard.source_model"  # the FP32 model's registered name (parent runs, registered variants)
SOURCE_VERSION_TAG = "tailguard.source_version"  # its resolved version number
SOURCE_FORMAT_TAG = "tailguard.source_format"  # its format (onnx | state_dict | exported_program | ...)
SOURCE_SHA256_TAG = "tailguard.source_sha256"  # hex sha256 of its file
LABEL_TAG_PREFIX = "tailguard.label."      # tailguard.label.<key> = metadata.labels[key]
RUNNER_PID_TAG = "tailguard.runner.pid"    # the local runner's process id (absent on a cluster)
RUNNER_HOST_TAG = "tailguard.runner.host"  # its host name
RUNNER_STARTED_TAG = "tailguard.runner.started"  # its process start time
OUTCOME_TAG = "tailguard.outcome"          # results.RunOutcome (set by register or a failing task)
FAILURE_TAG = "tailguard.failure"          # the failed task's name
PROMOTED_VARIANT_TAG = "tailguard.promoted_variant"  # the promoted variant's name or "none"
PROMOTED_VERSION_TAG = "tailguard.promoted_version"  # its registry version or "none"
TARGET_ALIASES_TAG = "tailguard.target_aliases"  # JSON {alias: version | null} of the per-target aliases after a run
REDECIDED_FROM_TAG = "tailguard.redecided_from"  # a re-decided run: the pipeline run whose measurements it decided on

# ------------------------------------------------------------------------------------------------ local re-decide
# Set by the local runner for its tasks: $TAILGUARD_HOME/runs/<run>. validate-<v> writes there, per variant, the
# inputs it validated on (VALIDATIONS_DIR/<variant>.json), so a later run whose only change is in `gates` or
# `promotion` can decide again on them in one task (components/redecide, tailguard.rerun). Absent on a cluster.
RUN_DIR_ENV = "TAILGUARD_RUN_DIR"
VALIDATIONS_DIR = "validations"

# ------------------------------------------------------------------------------------------------ variant-run tags
VARIANT_TAG = "tailguard.variant"
STATUS_TAG = "tailguard.status"            # results.BuildStatus: ok | failed | skipped
GATES_TAG = "tailguard.gates"              # results.GatesVerdict: passed | failed | not_evaluated
MODEL_URI_TAG = "tailguard.model_uri"
WORST_SLICE_TAG = "tailguard.worst_slice"  # JSON {slice, value, support, metric, observed}
DISCOVERED_TAG = "tailguard.discovered"    # JSON list of the 3 worst significant discovered slices (when it ran)
COVERAGE_TAG = "tailguard.quantization_coverage"  # INT8: '3/3 MAC nodes INT8, 100.0% of 3.39 kMACs per sample'
NUMERICS_TAG = "tailguard.numerics"        # consistent | hardware_dependent | not_checked (validate's numerics check)
BACKEND_TAG = "tailguard.backend"          # the variant's backend (onnxruntime | tensorrt | torch)
PRECISION_TAG = "tailguard.precision"      # fp32 | fp16 | bf16 | int8
REASON_TAG = "tailguard.reason"            # why a build, validation or trial failed or was skipped
ROLE_TAG = "tailguard.role"                # "reference" on the run that registered an FP32 reference
# the node that validated (and timed) the variant, from tailguard.core.hardware.hardware_tags
HW_CPU_TAG = "tailguard.hw.cpu"            # CPU model name, e.g. 'AMD EPYC 7B13'
HW_ISA_TAG = "tailguard.hw.isa"            # kernel-relevant ISA flags, e.g. 'avx2 fma f16c avx512f avx512_vnni'
HW_CORES_TAG = "tailguard.hw.cores"        # CPUs the task could run on
HW_GPU_TAG = "tailguard.hw.gpu"            # '<name> sm<major.minor>; ...' or 'none'
# serving targets (spec serving_targets, issue 23): on a variant run validated on one target
TARGET_TAG = "tailguard.target"            # the serving target's name (absent without serving_targets)
TARGET_PLACEMENT_TAG = "tailguard.target_placement"  # node_pool (cluster: the target's pool) | this_node (local run)
TARGET_CHECK_TAG = "tailguard.target_check"  # matched | mismatch | no_expect (the node vs the target's `expect`)

# ------------------------------------------------------------------------------------------------ search tags
SEARCH_OF_TAG = "tailguard.search_of"      # on trial runs and on the <V>-searched run: the searched variant V
TRIAL_TAG = "tailguard.trial"              # on trial runs: the 0-based trial index
TRIAL_RUN_TAG = "tailguard.trial_run_id"   # on the <V>-searched run: the run of the chosen trial
SEARCH_TAG = "tailguard.search"            # on V's run: chosen trial name | search/task.py SearchStatus
SEARCH_STOPPED_TAG = "tailguard.search_stopped_by"  # on V's run: search/logic.py SearchStop
TRIAL_NAME_TAG = "tailguard.trial_name"    # on trial runs: the trial's name (<V>-t<NN>)

# ------------------------------------------------------------------------------------------------ model-version tags
FORMAT_TAG = "tailguard.format"            # a registered FP32 reference's format
SHA256_TAG = "tailguard.sha256"            # a version's artefact fingerprint (hex sha256 of the model file)
# hex sha256 over every file of a version but MLflow's packaging files (digests.artifact_files_sha256): what
# `tailguard fetch` checks the whole download against (external data, manifests, descriptors: not the model file only)
FILES_SHA256_TAG = "tailguard.files_sha256"
# Files MLflow writes around a logged model (mlflow.models.Model.save and the registry's download); not part of
# what a serving runtime loads, nor of FILES_SHA256_TAG.
MLFLOW_PACKAGING_FILES = frozenset({"MLmodel", "conda.yaml", "python_env.yaml", "requirements.txt",
                                    "registered_model_meta", "input_example.json", "serving_input_example.json"})
OUTPUTS_TAG = "tailguard.outputs"          # a registered reference's recorded output signature (JSON)
RUN_ID_TAG = "tailguard.run_id"            # a registered variant's validated run
EXECUTION_PROVIDER_TAG = "tailguard.execution_provider"  # a registered variant's ONNX Runtime execution provider
COMPILE_TAG = "tailguard.compile"          # a registered torch variant's compile mode (eager | inductor | aot_inductor)
DEVICE_TAG = "tailguard.device"            # a registered torch variant's device (cpu | cuda)
CUDA_GRAPHS_TAG = "tailguard.cuda_graphs"  # a registered torch variant replays CUDA graphs (true | false)
ARTIFACT_FINGERPRINT_TAG = "tailguard.artifact_fingerprint"  # a node-bound artefact's fingerprint (JSON: torch or
#                                            TensorRT version, device name, compute capability or CPU ISA flags)
PROMOTION_REASON_TAG = "tailguard.promotion_reason"  # why a version was or was not promoted
VALIDATED_ON_TAG = "tailguard.validated_on"  # JSON list: the nodes a registered variant was validated on (per target)

# ------------------------------------------------------------------------------------------------ model-file metadata
QUANTIZATION_COVERAGE_KEY = "tailguard.quantization_coverage"  # INT8 .onnx metadata_props key: MAC coverage (JSON)

# ------------------------------------------------------------------------------------------------ key formats
GATE_TAG_PREFIX = "gate."        # gate.<key spelled for MLflow> = passed | failed | insufficient_data
GATE_NAME_PREFIX = "gate_name."  # gate_name.<same as gate_tag> = the gate key as the spec and docs spell it


def gate_tag(gate_key: str) -> str:
    """MLflow tag key for a gate verdict: `gate.<key>` with characters MLflow refuses in keys spelled out
    ('nn_top1_agreement>=0.9@per_slice:lexname' -> 'gate.nn_top1_agreement ge 0.9 per_slice lexname')."""
    k = gate_key.replace(">=", " ge ").replace("<=", " le ").replace("@", " ").replace(":", " ")
    return GATE_TAG_PREFIX + re.sub(r"[^A-Za-z0-9_\-. /]", "_", re.sub(r"\s+", " ", k).strip())


def gate_name_tag(gate_key: str) -> str:
    """MLflow tag key whose VALUE is the gate's key as written in docs and reports (MLflow keys cannot hold
    '>', '=', '@'): tag 'gate_name.top1_agreement ge 0.9 lb95 per_slice digit' holds
    'top1_agreement>=0.9@lb95@per_slice:digit' (docs/spec.md, gate keys)."""
    return GATE_NAME_PREFIX + gate_tag(gate_key)[len(GATE_TAG_PREFIX):]


def searched_name(variant_name: str) -> str:
    """Name of the candidate a search contributes: '<variant>-searched'."""
    return f"{variant_name}-searched"


def insufficient_reason(gate_keys: list[str] | tuple[str, ...]) -> str:
    """The verdict line of a variant held back by insufficient-data gates: 'not promoted: gate X had
    insufficient data' ('' when `gate_keys` is empty)."""
    keys = list(gate_keys)
    if not keys:
        return ""
    return f"not promoted: gate{'s' if len(keys) > 1 else ''} {', '.join(keys)} had insufficient data"


# protobuf's hard limit for one serialized ModelProto is 2 GiB: a model at or above it is saved with external data
# (weights in a side file); below it, as one self-contained .onnx file (what ONNX Runtime's tools handle best).
ONNX_INLINE_LIMIT_BYTES = 2 * 1024**3


BASELINE_NAMES = ("torch", "onnx_fp32")
BASELINE_PERCENTILES = ("p50", "p95", "p99")


def baseline_metrics(baselines: Any) -> dict[str, float]:
    """The parent run's baseline metrics from reference-pass's baselines: {"baseline.<torch|onnx_fp32>.bs<N>.
    latency_ms.<p50|p95|p99>": ms}.

    Args:
        baselines: {"torch": {batch size: benchmark entry} | None, "onnx_fp32": {...}, ...} (batch-size keys int,
            or str when parsed back from JSON).
    """
    return {f"baseline.{name}.bs{bs}.latency_ms.{p}": float(perf[f"latency_ms.{p}"])
            for name in BASELINE_NAMES for bs, perf in (baselines.get(name) or {}).items()
            for p in BASELINE_PERCENTILES}
