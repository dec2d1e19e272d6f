"""Register the selected variant (and, by `promotion.register_variants`, the passing or all built ones) in the
MLflow model registry and promote the selected one by alias.

Order matters for "nothing is lost, no alias moved by a failed or partial run": this step runs only
after every variant's validation (and search) finished; it registers first and moves the alias last, only to a
variant that passed every gate. Registry aliases, not the deprecated stages.

What gets a registry version (`registration_policy`; every variant's MLflow run and logged model stay either
way, the runs are the record): `promoted` (default) only the variant `decide_promotion` chose, `passing`
every variant that passed every gate, `all` every built variant, failing ones included. An artefact is never
registered twice: a variant whose model file has the sha256 of an existing version of the optimized model (tag
tailguard.sha256) reuses that version (the lowest such number); the alias is set on it when it is promoted, and
the summary row says "reused vN (same sha256)".

A variant V with a `search` section whose search chose a trial contributes one more candidate, '<V>-searched'
(the chosen trial's run, a direct child of the parent run tagged tailguard.search_of = V): registered like the
others (backend, precision and execution provider of V; tags tailguard.search_of and tailguard.trial_run_id)
and competing in `decide_promotion` (the fastest passing variant, with confidence: docs/spec.md).

Each row and the promotion decision come from the candidate's variant_result.json (`tailguard.core.results.
VariantResult`, written by the validate or search step on the candidate's run), not from its tags or metric
names: `passed` is the one the validate step decided. A run without a readable file (its task died mid-way)
is a failed row that is not registered, never a passing one.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from tailguard.core.contract import (ALIAS_AT_START_TAG, ALIAS_VERSION_TAG, ARTIFACT_FINGERPRINT_TAG, BACKEND_TAG,
                                     COMPILE_TAG, CUDA_GRAPHS_TAG, DEVICE_TAG, EXECUTION_PROVIDER_TAG,
                                     FILES_SHA256_TAG, GATES_TAG,
                                     HW_CPU_TAG, HW_GPU_TAG, HW_ISA_TAG, PRECISION_TAG, PROMOTION_REASON_TAG,
                                     PROMOTION_TAG, RUN_ID_TAG, SEARCH_OF_TAG, SHA256_TAG, SOURCE_MODEL_TAG,
                                     SOURCE_SHA256_TAG, SOURCE_VERSION_TAG, SPEC_SHA256_TAG, SUPERSEDED_BY_TAG,
                                     TARGET_ALIASES_TAG, TARGET_CHECK_TAG, TARGET_PLACEMENT_TAG, TARGET_TAG,
                                     TRIAL_RUN_TAG, VALIDATED_ON_TAG, VARIANT_RESULT_FILE, VARIANT_TAG, searched_name)
from tailguard.core.reference import alias_version
from tailguard.core.results import (BuildStatus, GatesVerdict, GateStatus, PromotionStatus, ResultFormatError,
                                    VariantResult)

if TYPE_CHECKING:
    from tailguard.core.spec.models import Spec, VariantSpec


@dataclass
class VariantSummary:
    """One row of the run summary.

    Attributes:
        variant, backend, precision: from the spec.
        status: ok | failed | skipped (build/validation); reason: why not ok, or which gates failed.
        passed: every gate passed (a gate with insufficient data is not passed: the variant is not promoted and
            `reason` says "not promoted: gate X had insufficient data").
        run_id: the nested MLflow run. version: registered version (or None).
        p50_ms, p99_ms: latency at the promotion batch size (ms). speedup_vs_torch, speedup_vs_onnx_fp32: ratios
        of the baseline p50 to this variant's p50 at that batch size. All four are the validate task's own timing
        (per-task: gate inputs); what the table shows for a passing variant is `paired`.
        paired: a passing variant's figures from the promotion's paired rounds (`compare_passing`), None when it
            was not in them: {"p50_ms", "p99_ms", "p50_ms.lb95", "p50_ms.ub95" (ms), "speedup_vs_torch",
            "speedup_vs_onnx_fp32" ({"ratio", "lower", "upper"}, one-sided bounds; absent without that baseline),
            "rounds", "tied" (bool: within the margin of the fastest, or the rounds were not trusted to rank)}.
        worst_slice: {"slice", "value", "metric", "value_observed", "support"} of the lowest per-slice parity.
        discovered: the worst significant slices worst-slice discovery found (up to 3: slice, value, support,
            metric, value_in_slice, value_rest, q_value); [] when none was significant or discovery was off.
        gates: {gate key: status}.
        quantized_mac_fraction: INT8 variants: share of the MACs computed in INT8 (from the variant's
            variant_result.json; components/quantize/macs.py), else None.
        warnings: what the summary must flag although no gate asked (`coverage_warnings`: an INT8 variant that
            quantized under LOW_QUANTIZED_MAC_FRACTION of its MACs, or whose coverage was not recorded).
        registration: a `Registration` value (registered | reused | not_registered), "" when there was no
            model to register (the variant failed or was skipped). registration_note: the same in words for the
            summary row, e.g. "v3", "reused v1 (same sha256)", "not registered: failed its gates
            (promotion.register_variants: promoted)".
        overall: the variant's overall-scope metrics from its variant_result.json ({name: value}, e.g.
            top1_agreement, accuracy, reference_accuracy as fractions in [0, 1]); {} when not validated.
        hardware_dependent: the validate step's numerics check (VariantResult.hardware_dependent): True when the
            gates or the worst slice differ between the node's INT8 kernels and exact integer accumulation; None
            when not checked. numerics: its summary (VariantResult.numerics), None when not recorded.
        targets: with spec `serving_targets`, the variant's verdict per target that serves it ({target: {status,
            passed, reason, run_id, p50_ms, p99_ms (ms, at `batch_size`), placement (node_pool | this_node), check
            (matched | mismatch | no_expect), hardware {cpu, isa, gpu}}}), `target_rows`; {} without targets. The
            row's own `passed` is then "passed on every target that serves it", its p50_ms/p99_ms and speedups
            those of its slowest target (by p50), its gates the worst status of each gate over the targets, its
            other metrics (overall, worst slice, numerics) the first validated target's.
        target_aliases: the per-target aliases (`<alias>-<target>`) this run moved to the variant's version.
        rows, rows_used: validation rows, and the rows scored before its gates were decided (sequential
            validation); None when not recorded.
    """

    variant: str
    backend: str
    precision: str
    status: str
    reason: str = ""
    passed: bool = False
    run_id: str | None = None
    version: str | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    speedup_vs_torch: float | None = None
    speedup_vs_onnx_fp32: float | None = None
    worst_slice: dict[str, Any] | None = None
    gates: dict[str, str] = field(default_factory=dict)
    promoted: bool = False
    discovered: list[dict[str, Any]] = field(default_factory=list)
    quantized_mac_fraction: float | None = None
    warnings: list[str] = field(default_factory=list)
    overall: dict[str, float] = field(default_factory=dict)
    registration: str = ""
    registration_note: str = ""
    hardware_dependent: bool | None = None
    numerics: dict[str, Any] | None = None
    targets: dict[str, dict[str, Any]] = field(default_factory=dict)
    target_aliases: list[str] = field(default_factory=list)
    rows: int | None = None
    rows_used: int | None = None
    paired: dict[str, Any] | None = None


@dataclass
class RunSummary:
    """What a pipeline run decided.

    Attributes:
        parent_run_id, experiment_id: the MLflow parent run.
        source_model, source_version: the FP32 reference.
        optimized_model: registered model holding the variants; alias: the spec's promotion alias.
        promoted_variant / promoted_version: the selected variant, or None (no alias moved).
        promotion: promoted | superseded (a passing variant was chosen, but the alias had moved during the run to
            a version that wins the comparison, see `promote`) | not_promoted (nothing passed, or promotion off).
        alias_version: the version the alias points to after this run's promotion step (None: nowhere).
        promotion_enabled: False when the spec turns promotion off.
        batch_size: the batch size 'fastest' was judged at.
        variants: one VariantSummary per spec variant, spec order; a variant V with a search whose chosen
            trial was logged is followed by a row '<V>-searched' (it competes for promotion like the others).
        searches: the search.json of every searched variant (components/search: variant, seed, stopped_by,
            chosen, chosen_name, trials = Pareto records, sensitivity), spec order; [] without searches.
        tasks: per-task timings of a local run, filled by the runner after the pipeline ends (None on a cluster
            and inside the register task): {"tasks": [{task, status, cached (bool | None), wall_s, body_s,
            imports_s, overhead_s, hosted}], "total_s", "startup_s", "startup_share"} (tailguard.runner.task_timings).
        hardware: the facts of the node the FP32 baselines were timed on (`tailguard.core.hardware.node_facts`:
            cpu model / isa flags / cores, gpus, os, library versions), from reference-pass; None when unknown.
        warnings: run-level warnings, e.g. an unstable torch baseline (components/reference/logic.py
            `time_baselines`); [] when none.
        serving_targets: the spec's serving target names, spec order ([] without targets).
        target_aliases: one entry per serving target: {target, alias (`<alias>-<target>`), variant (the fastest
            variant passing on the target, or None), version, outcome (promoted | superseded | not_promoted),
            alias_version (where the alias points after this run)}; [] without targets.
        promotion_rule: how the variant to promote was chosen (`PromotionRule`), "" before a choice.
        promotion_reason: the choice in words (the summary's promotion line).
        promotion_comparison: the paired timing of the passing variants (`compare_passing`), None when none ran.
    """

    parent_run_id: str
    experiment_id: str
    source_model: str
    source_version: str
    optimized_model: str
    alias: str
    promotion_enabled: bool
    batch_size: int
    promoted_variant: str | None = None
    promoted_version: str | None = None
    variants: list[VariantSummary] = field(default_factory=list)
    searches: list[dict[str, Any]] = field(default_factory=list)
    promotion: PromotionStatus = PromotionStatus.NOT_PROMOTED
    alias_version: str | None = None
    tasks: dict[str, Any] | None = None
    hardware: dict[str, Any] | None = None
    warnings: list[str] = field(default_factory=list)
    serving_targets: list[str] = field(default_factory=list)
    target_aliases: list[dict[str, Any]] = field(default_factory=list)
    promotion_rule: str = ""
    promotion_reason: str = ""
    promotion_comparison: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-serializable form."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RunSummary":
        """Inverse of to_dict (summaries written before searches existed read with searches = [])."""
        d = dict(d)
        d["variants"] = [VariantSummary(**v) for v in d.get("variants", [])]
        d["searches"] = list(d.get("searches") or [])
        return cls(**d)

    @property
    def any_passed(self) -> bool:
        """At least one variant passed every gate."""
        return any(v.passed for v in self.variants)


def read_variant_result(client: Any, run_id: str) -> VariantResult | str:
    """The VariantResult the validate (or search) step logged to run `run_id` (artifact VARIANT_RESULT_FILE).

    Returns:
        The result, or, when there is none to trust, the reason in words (the file is missing: the task stopped
        before writing it; or unreadable: another schema version, bad JSON) -- the caller marks the row failed.
    """
    import tempfile

    from mlflow.exceptions import MlflowException

    try:
        names = {a.path for a in client.list_artifacts(run_id)}
        if VARIANT_RESULT_FILE not in names:
            return (f"no {VARIANT_RESULT_FILE} on run {run_id}: its validation did not finish (the task stopped "
                    "before writing its result)")
        with tempfile.TemporaryDirectory() as tmp:
            return VariantResult.read(client.download_artifacts(run_id, VARIANT_RESULT_FILE, tmp))
    except ResultFormatError as exc:
        return f"unreadable {VARIANT_RESULT_FILE} on run {run_id}: {exc.message}"
    except (MlflowException, OSError) as exc:
        return f"cannot download {VARIANT_RESULT_FILE} from run {run_id}: {exc}"


def _search_json(client: Any, run_id: str) -> dict[str, Any] | None:
    """The search.json a search step logged to a variant's run (artifact search/search.json); None if absent."""
    import tempfile

    from mlflow.exceptions import MlflowException

    from tailguard.core.contract import SEARCH_JSON

    try:
        names = {a.path for a in client.list_artifacts(run_id, SEARCH_JSON.rsplit("/", 1)[0])}
        if SEARCH_JSON not in names:
            return None
        with tempfile.TemporaryDirectory() as tmp:
            with open(client.download_artifacts(run_id, SEARCH_JSON, tmp)) as f:
                d = json.load(f)
    except (MlflowException, OSError, ValueError):  # unreadable: the summary goes on without this search
        return None
    return d if isinstance(d, dict) else None


LOW_QUANTIZED_MAC_FRACTION = 0.5  # an INT8 variant computing less than this share of its MACs in INT8 is flagged


def coverage_warnings(precision: str, backend: str, status: str, fraction: float | None) -> list[str]:
    """The summary's warnings about quantization coverage for one variant (no gate needed to see them).

    Args:
        precision, backend: the variant's (from the spec).
        status: its build/validation status (ok | failed | skipped).
        fraction: its quantized_mac_fraction metric (MACs in INT8 / all MACs, in [0, 1]), or None.

    Returns:
        [] unless the variant asked for INT8 on onnxruntime and was built (status ok); then one warning when
        fraction < LOW_QUANTIZED_MAC_FRACTION ("INT8 variant computes only 9% of its MACs in INT8 ...") or when
        no fraction was recorded.
    """
    if precision != "int8" or backend != "onnxruntime" or status != "ok":
        return []
    if fraction is None:
        return ["INT8 variant: quantization coverage was not recorded (no quantized_mac_fraction metric); see "
                "its build.json"]
    if fraction < LOW_QUANTIZED_MAC_FRACTION:
        return [f"INT8 variant computes only {fraction:.0%} of its MACs in INT8 (quantized_mac_fraction "
                f"{fraction:.3f} < {LOW_QUANTIZED_MAC_FRACTION:g}): most of it runs in float; build.json "
                "quantization_coverage lists the float nodes"]
    return []


EIGHT_BIT_WEIGHTS_NOTE = ("8-bit weights: results depend on the CPU's INT8 kernel (VNNI vs AVX2); hardware_dependent "
                          "checks it")


def numerics_warnings(variant: VariantSpec, hardware_dependent: bool | None,
                      numerics: dict[str, Any] | None) -> list[str]:
    """The summary's warnings about INT8 numerics for one variant (issue 23).

    Args:
        variant: the spec's VariantSpec (its quantization section).
        hardware_dependent: VariantResult.hardware_dependent of the row.
        numerics: VariantResult.numerics of the row (its reason is quoted).

    Returns:
        EIGHT_BIT_WEIGHTS_NOTE for an INT8 ONNX Runtime CPU variant with int8 weights and `reduce_range: false`
        (the u8 x s8 kernel of x86 CPUs without VNNI saturates int16 pair sums with 8-bit weights; 7-bit weights
        cannot overflow), and a "hardware_dependent: ..." warning when the numerics check flagged the variant.
    """
    out = []
    q = getattr(variant, "quantization", None)
    if (q is not None and variant.backend == "onnxruntime" and not variant.needs_gpu and q.weight_type == "int8"
            and not q.reduce_range):
        out.append(EIGHT_BIT_WEIGHTS_NOTE)
    if hardware_dependent:
        out.append("hardware_dependent: the gates judged here may not hold on a CPU with another INT8 kernel "
                   f"(native kernels vs exact integer accumulation: {(numerics or {}).get('reason', '?')}); use "
                   "7-bit weights (quantization.reduce_range: true) or validate on the serving node's kind")
    return out


class Registration(str, Enum):
    """What the register step did with a built variant's model (VariantSummary.registration)."""

    REGISTERED = "registered"          # a new version of the optimized model
    REUSED = "reused"                  # an existing version holds the same artefact (sha256): that version is used
    NOT_REGISTERED = "not_registered"  # the policy leaves it out; its MLflow run holds the model


def registration_policy(policy: str, row: VariantSummary, selected: bool) -> tuple[bool, str]:
    """Whether `row` gets a registry version under `promotion.register_variants`, and why not.

    Args:
        policy: promoted | passing | all (spec `promotion.register_variants`).
        row: a built variant's summary row (status ok, a logged model).
        selected: `row` is the variant `decide_promotion` chose (it gets the alias when promotion is on).

    Returns:
        (register, reason): reason is "" when it is registered, else the words for the summary row.
    """
    if policy == "all" or selected or (policy == "passing" and row.passed):
        return True, ""
    if row.passed:
        return False, f"not registered: passed, not selected (promotion.register_variants: {policy})"
    return False, f"not registered: failed its gates (promotion.register_variants: {policy})"


def versions_by_sha256(client: Any, model_name: str) -> dict[str, str]:
    """Which artefacts the registry already holds for `model_name`.

    Args:
        client: an `mlflow.MlflowClient` on the registry.
        model_name: the registered model (the spec's optimized model name).

    Returns:
        {hex sha256 (tag SHA256_TAG): the lowest version number holding it, as str}; versions without the tag
        (registered by hand) are left out.
    """
    out: dict[str, str] = {}
    token = None
    while True:
        page = client.search_model_versions(f"name = '{model_name}'", page_token=token)
        for mv in page:
            sha = (mv.tags or {}).get(SHA256_TAG)
            if sha and (sha not in out or int(mv.version) < int(out[sha])):
                out[sha] = str(mv.version)
        token = page.token
        if not token:
            return out


def backend_tags(variant: VariantSpec, run_tags: dict[str, str]) -> dict[str, str]:
    """The registered version's backend-specific tags: the ONNX Runtime execution provider (onnxruntime), the
    TensorRT plan's fingerprint (tensorrt: TensorRT version, GPU, compute capability, CUDA; from the validated run's
    ARTIFACT_FINGERPRINT_TAG), or the torch variant's compile mode, device, CUDA graphs and the artefact's
    fingerprint (torch version, device name, compute capability or CPU ISA flags); for both node-bound kinds also
    the digest of the artefact folder's files (FILES_SHA256_TAG, checked by `tailguard fetch`)."""
    files = {FILES_SHA256_TAG: run_tags[FILES_SHA256_TAG]} if run_tags.get(FILES_SHA256_TAG) else {}
    if variant.backend == "tensorrt":
        return {ARTIFACT_FINGERPRINT_TAG: run_tags.get(ARTIFACT_FINGERPRINT_TAG, ""), **files}
    if variant.backend != "torch":
        return {EXECUTION_PROVIDER_TAG: variant.execution_provider}
    return {COMPILE_TAG: variant.torch_compile, DEVICE_TAG: variant.torch_device,
            CUDA_GRAPHS_TAG: str(variant.cuda_graphs).lower(),
            ARTIFACT_FINGERPRINT_TAG: run_tags.get(ARTIFACT_FINGERPRINT_TAG, ""), **files}


def register_artifact_folder(client: Any, name: str, model_uri: str, run_id: str, tags: dict[str, str]) -> Any:
    """Register a run's artefact folder (`runs:/<run>/<path>`, not an MLflow model: no MLmodel file) as a new
    version of `name`, with `MlflowClient.create_model_version(source=<the run's artifact URI>/<path>)`;
    `mlflow.register_model` only takes logged MLflow models. `models:/name/N` downloads the folder.

    Returns:
        The ModelVersion.
    """
    from mlflow.exceptions import MlflowException

    path = model_uri.removeprefix(f"runs:/{run_id}/").strip("/")
    source = client.get_run(run_id).info.artifact_uri.rstrip("/") + "/" + path
    try:
        client.create_registered_model(name)
    except MlflowException as exc:
        if exc.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    return client.create_model_version(name, source=source, run_id=run_id, tags=tags)


def node_of(tags: dict[str, str]) -> dict[str, str]:
    """The validating node's facts from a variant run's tailguard.hw.* tags, in `tailguard.core.hardware.
    kernel_facts` form: {"cpu": model name, "isa": "avx2 fma ..." | "unknown", "gpu": "sm8.9" | "none"}."""
    from tailguard.core.hardware import gpu_capabilities

    return {"cpu": tags.get(HW_CPU_TAG, "unknown"), "isa": tags.get(HW_ISA_TAG, "unknown"),
            "gpu": gpu_capabilities(tags.get(HW_GPU_TAG, "none"))}


def target_entry(r: VariantResult | str, tags: dict[str, str], run_id: str | None, batch_size: int) -> dict[str, Any]:
    """One target's entry of `VariantSummary.targets`: the verdict of the variant's validation on it.

    Args:
        r: the run's VariantResult, or why there is none to trust (the words `read_variant_result` returned).
        tags: the run's tags (tailguard.target_placement, tailguard.target_check, tailguard.hw.*); {} without a run.
        run_id: the run, None when no validation run was logged.
        batch_size: the promotion batch size (p50_ms / p99_ms are taken there, ms).
    """
    if isinstance(r, str):
        return {"status": BuildStatus.FAILED, "passed": False, "reason": r, "run_id": run_id, "p50_ms": None,
                "p99_ms": None,
                "placement": tags.get(TARGET_PLACEMENT_TAG), "check": tags.get(TARGET_CHECK_TAG),
                "hardware": node_of(tags) if tags else None}
    return {"status": r.status, "passed": r.passed, "reason": r.reason, "run_id": run_id,
            "p50_ms": r.perf_value(batch_size, "latency_ms.p50"), "p99_ms": r.perf_value(batch_size, "latency_ms.p99"),
            "placement": tags.get(TARGET_PLACEMENT_TAG), "check": tags.get(TARGET_CHECK_TAG),
            "hardware": node_of(tags)}


# A gate's status over several targets is its worst one (failed, then insufficient data, then passed); a gate that
# does not apply to the variant does not apply on any target.
GATE_STATUS_RANK = {GateStatus.NOT_APPLICABLE: 0, GateStatus.PASSED: 1, GateStatus.INSUFFICIENT_DATA: 2,
                    GateStatus.FAILED: 3}


def merge_gate_statuses(per_target: list[dict[str, str]]) -> dict[str, str]:
    """{gate key: worst status over `per_target`} (GATE_STATUS_RANK; an unknown status ranks as failed), keys in
    first-seen order."""
    out: dict[str, str] = {}
    for gates in per_target:
        for key, status in gates.items():
            if key not in out or GATE_STATUS_RANK.get(status, 3) > GATE_STATUS_RANK.get(out[key], 3):
                out[key] = status
    return out


def fastest_on_target(rows: list[VariantSummary], target: str) -> VariantSummary | None:
    """The row with the lowest p50 on `target` among those that passed there (ties: spec order); None when none
    did. The per-target alias `<alias>-<target>` moves to it."""
    passing = [r for r in rows if (r.targets.get(target) or {}).get("passed")
               and r.targets[target].get("p50_ms") is not None]
    return min(passing, key=lambda r: r.targets[target]["p50_ms"]) if passing else None


def validated_on(row: VariantSummary, tags: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """The `tailguard.validated_on` tag of a registered variant (JSON list; the monitor compares its own node with
    the nodes a variant passed on, monitoring/node_check.py): with serving targets one entry per target,
    {target, status, passed, placement, cpu, isa, gpu}; without, one entry {target: null, ..., placement:
    "build_node"} from the validation run's `tags`."""
    if row.targets:
        return [{"target": t, "status": e["status"], "passed": bool(e["passed"]), "placement": e.get("placement"),
                 **(e.get("hardware") or {"cpu": "unknown", "isa": "unknown", "gpu": "none"})}
                for t, e in row.targets.items()]
    return [{"target": None, "status": row.status, "passed": row.passed, "placement": "build_node",
             **node_of(tags or {})}]
# Promotion decided with confidence (issue 25, item 5). The more exact the arithmetic, the less a variant can drift
# from the FP32 reference on inputs validation did not see: among variants whose speeds are within the margin,
# this order decides.
EXACTNESS = ("fp32", "fp16", "int8")


class PromotionRule(str, Enum):
    """How `decide_promotion` chose (RunSummary.promotion_rule)."""

    NONE_PASSED = "none_passed"          # no variant passed every gate
    ONLY_PASSING = "only_passing"        # one variant passed: nothing to compare
    FASTEST_P50 = "fastest_p50"          # promotion.margin null: the lowest validation p50
    CONFIDENT = "confident"              # the fastest is confidently faster than every other by the margin
    HOLDER = "holder"                    # within the margin of the fastest (or timed on a contended node): the
                                         # current alias holder stays
    MOST_EXACT = "most_exact"            # within the margin of the fastest (or timed on a contended node): the
                                         # most exact of them


@dataclass
class PromotionDecision:
    """What `decide_promotion` chose and why.

    Attributes:
        chosen: the row to promote, or None.
        rule: a PromotionRule value.
        reason: the decision in words (the summary's promotion line).
        comparison: the paired timing (`compare_passing`'s dict: leader, per candidate ratio / lower / upper,
            rounds, confidence, stopped_by, method), or None when none ran.
        tied: the candidates within the margin of the fastest (names), [] when the fastest was confident.
    """

    chosen: VariantSummary | None
    rule: str
    reason: str
    comparison: dict[str, Any] | None = None
    tied: list[str] = field(default_factory=list)


def _exactness(row: VariantSummary) -> int:
    return EXACTNESS.index(row.precision) if row.precision in EXACTNESS else len(EXACTNESS)


def decide_promotion(candidates: list[VariantSummary], *, margin: float | None, holder: str | None = None,
                     compare: Any = None, max_cpu_pressure: float | None = None) -> PromotionDecision:
    """Choose the variant to promote, with confidence, not by noise (docs/spec.md, Gates and promotion).

    Rule: among the variants that passed every gate,
    1. one passing variant: it;
    2. `margin` None: the lowest validation p50 (the rule before issue 25);
    3. else the passing variants are timed interleaved in one process (`compare(rows)`, paired rounds at the
       promotion batch size, `compare_passing`); the fastest (lowest median) takes the alias when, against every
       other passing variant, the lower one-sided 95% bound of its speed ratio (corrected for the looks) is above
       1 + margin; unless the node was short of CPU for more than `max_cpu_pressure` of the comparison's wall
       time (the comparison's `cpu_pressure.some_share`, Linux PSI, `tailguard.core.hardware.CpuPressure`): then
       the timings are not trusted to rank anything and every passing variant is tied (rule 4);
    4. otherwise the variants not confidently slower than the fastest by the margin are tied: the current alias
       holder keeps the alias if it is one of them (`holder`: the name of the passing row holding the artefact the
       alias points to), else the most exact of them (EXACTNESS: fp32, then fp16, then int8; ties: the order of
       `candidates`). Without a comparison (`compare` None or it returns None: a variant that cannot be timed
       here) every passing variant is tied.

    Args:
        candidates: the run's rows (spec order; '<V>-searched' after V).
        margin: spec `promotion.margin` (e.g. 0.03), or None.
        holder: the passing row that holds the alias now, or None.
        compare: callable(list of passing rows) -> comparison dict {"leader": name, "ratios": {name: {"ratio",
            "lower", "upper"}}, "cpu_pressure": {"some_share": float | None, ...}, ...} or None.
        max_cpu_pressure: spec `promotion.max_cpu_pressure` (e.g. 0.1), or None: the comparison is trusted
            whatever the node's load. A share that could not be read (no PSI) is not held against the comparison.

    Returns:
        PromotionDecision.
    """
    passing = [v for v in candidates if v.passed and v.status == BuildStatus.OK and v.p50_ms is not None]
    if not passing:
        return PromotionDecision(None, PromotionRule.NONE_PASSED.value, "no variant passed every gate")
    if len(passing) == 1:
        return PromotionDecision(passing[0], PromotionRule.ONLY_PASSING.value,
                                 f"{passing[0].variant} is the only variant that passed every gate")
    if margin is None:
        best = min(passing, key=lambda v: v.p50_ms)
        return PromotionDecision(best, PromotionRule.FASTEST_P50.value,
                                 f"{best.variant} has the lowest validation p50 ({best.p50_ms:.4g} ms; "
                                 "promotion.margin: null, no paired comparison)")
    comparison = compare(passing) if compare is not None else None
    by_name = {v.variant: v for v in passing}
    share = ((comparison or {}).get("cpu_pressure") or {}).get("some_share")
    if not comparison:
        tied = list(passing)
        why = "no paired comparison could be timed here"
        leader = None
    elif max_cpu_pressure is not None and share is not None and share > max_cpu_pressure:
        tied = list(passing)
        leader = by_name[comparison["leader"]]
        why = (f"the node was short of CPU for {share:.0%} of the paired comparison (Linux PSI cpu 'some'; "
               f"promotion.max_cpu_pressure {max_cpu_pressure:g}), so its timings ({leader.variant} fastest over "
               f"{comparison['rounds']} paired rounds) are not trusted to rank the passing variants")
    else:
        leader = by_name[comparison["leader"]]
        ratios = comparison["ratios"]
        slower = {n for n, r in ratios.items() if n != leader.variant and r["lower"] > 1.0 + margin}
        tied = [v for v in passing if v.variant not in slower]
        if len(tied) == 1:
            nxt = min((r for n, r in ratios.items() if n != leader.variant), key=lambda r: r["ratio"])
            return PromotionDecision(
                leader, PromotionRule.CONFIDENT.value,
                f"{leader.variant} is the fastest passing variant with confidence: at least "
                f"{(nxt['lower'] - 1) * 100:.1f}% faster than the next ({nxt['name']}: {nxt['ratio']:.3f}x, lower "
                f"95% bound {nxt['lower']:.3f} > 1 + margin {margin:g}) over {comparison['rounds']} paired rounds",
                comparison, [])
        close = [f"{v.variant} ({ratios[v.variant]['ratio']:.3f}x, lower bound {ratios[v.variant]['lower']:.3f})"
                 for v in tied if v is not leader]
        why = (f"{leader.variant} is fastest but not confidently by more than {margin:.0%} over "
               + ", ".join(close) + f" ({comparison['rounds']} paired rounds)")
    names = [v.variant for v in tied]
    if holder is not None and holder in names:
        return PromotionDecision(by_name[holder], PromotionRule.HOLDER.value,
                                 f"{why}: the alias holder {holder} keeps it", comparison, names)
    exact = min(tied, key=lambda v: (_exactness(v), passing.index(v)))
    return PromotionDecision(exact, PromotionRule.MOST_EXACT.value,
                             f"{why}: the most exact of them, {exact.variant} ({exact.precision}), is promoted",
                             comparison, names)


def compare_passing(spec: Spec, rows: list[VariantSummary], results: dict[str, VariantResult], variants: dict[str, Any],
                    *, margin: float, batch_size: int, baselines: Callable[[], dict[str, Any]] | None = None
                    ) -> dict[str, Any] | None:
    """Time the passing variants, and the FP32 references beside them, interleaved in this process: paired rounds
    at the promotion batch size, until the fastest's advantage over every other is decided against 1 + margin or
    the budget ends. These rounds are the one timing the summary table, the report and the parent run's
    `paired.*` metrics show (issue 37): the promotion, the latencies and the speed-ups over torch eager and the
    ONNX FP32 export all come from them.

    Method: `tailguard.core.latency.interleaved_benchmark` over every row's model (downloaded from its logged
    MLflow model or artefact folder) and the `baselines` runners: ONNX models on ONNX Runtime with their execution
    provider and the spec's threads, each session built as every timed session is (`runtime.timed_ort_runner`,
    no spin-waiting: no runner's time depends on the runners beside it), torch CPU artefacts through
    `runner_for_file` (manifest checked), the validation rows, the spec's `benchmark` section at `batch_size`;
    looks at 10, 20, 40, ... rounds (`latency.timing_looks`); at each look the leader is the passing variant with
    the lowest median and each other variant's ratio median(other) / median(leader) gets one-sided 95% bounds
    corrected for the looks (`latency.speed_ratio` at `look_confidence(0.95, looks)`, paired bootstrap); timing
    stops when every ratio's lower bound is above 1 + margin (confident) or its upper bound below it (within the
    margin), else at the budget (`benchmark.max_seconds`, but never before `latency.DECISION_MIN_ROUNDS` rounds:
    torch eager in the rounds must not spend the budget before anything may be decided). With a single passing variant it stops once its speed-up over each baseline is
    known within `benchmark.precision` (default 0.05; `latency.precision_reached`). The baselines never lead and
    are never promoted.

    Args:
        spec: the spec (benchmark, model inputs, data.validation, analysis.bootstrap).
        rows: the passing rows.
        results: their VariantResults by row name (model_uri).
        variants: their spec VariantSpecs by row name (backend, execution provider).
        margin: promotion.margin.
        batch_size: the promotion batch size.
        baselines: callable() -> {"torch": torch eager runner, "onnx_fp32": ONNX FP32 export runner} (either may be
            missing: an ONNX reference has no torch eager), or None: the rounds hold the variants only. A baseline
            that does not load leaves the comparison without baselines (printed), not without a comparison.

    Returns:
        {"leader": name, "ratios": {name: {"name", "ratio", "lower", "upper"}} for every other row, "rounds",
        "confidence" (per look), "stopped_by", "batch_size", "p50_ms" ({row: ms}), "latency" ({row or baseline:
        {"p50_ms", "p99_ms", "p50_ms.lb95", "p50_ms.ub95"}}, ms, bounds None when the rounds are too few),
        "baselines" ([names timed]), "speedups" ({row: {baseline: {"ratio", "lower", "upper"}}}: median(baseline)
        / median(row), one-sided bounds at "confidence"), "cpu_pressure" (`CpuPressure.to_dict()` over the timed
        rounds), "method"}; None when a row cannot be timed here (not a CPU variant of onnxruntime or torch, no
        logged model, a model that does not load) or the budget allows fewer than `latency.DECISION_MIN_ROUNDS`
        rounds. No look before that many rounds decides.
    """
    import tempfile

    import mlflow
    import numpy as np

    from tailguard.core.data import load_validation
    from tailguard.core.errors import TailguardError
    from tailguard.core.hardware import CpuPressure
    from tailguard.core.latency import (DECISION_MIN_ROUNDS, interleaved_benchmark, precision_reached,
                                        speed_ratio)
    from tailguard.core.runtime import TIMED_ORT_SESSION, runner_for_file, timed_ort_runner
    from tailguard.core.stats import look_confidence

    def timeable(v: VariantSpec) -> bool:  # the register task runs on a CPU node: CPU variants only
        return v.backend == "onnxruntime" and v.execution_provider == "CPUExecutionProvider" or (
            v.backend == "torch" and v.torch_device == "cpu")

    if not rows or any(not timeable(variants[r.variant]) or not results[r.variant].model_uri for r in rows):
        return None
    boot = spec.analysis.bootstrap
    bench = spec.benchmark.model_copy(update={"batch_sizes": [batch_size]})
    names = [r.variant for r in rows]
    base: dict[str, Any] = {}
    if baselines is not None:
        try:
            base = dict(baselines())
        except (TailguardError, OSError) as exc:
            print(f"tailguard register: the paired rounds go without the FP32 baselines: {type(exc).__name__}: "
                  f"{exc}", file=sys.stderr)
    keys = {b: f"@{b}" for b in base}  # a variant may be named like a baseline: keys apart in the rounds

    def judge(samples: Any, n_looks: int) -> tuple[str, dict[str, dict[str, float]], float]:
        level = look_confidence(0.95, n_looks)
        med = {n: float(np.median(samples[n])) for n in names}
        leader = min(names, key=lambda n: (med[n], names.index(n)))
        ratios = {}
        for n in names:
            if n != leader:
                r = speed_ratio(samples[n], samples[leader], level, samples=boot.samples, seed=boot.seed)
                ratios[n] = {"name": n, "ratio": r["ratio"], "lower": r["lower"], "upper": r["upper"]}
        return leader, ratios, level

    precision = getattr(spec.benchmark, "precision", None) or 0.05

    def decide(bs: int, samples: Any, look: int, n_looks: int) -> bool:
        if len(next(iter(samples.values()))) < DECISION_MIN_ROUNDS:
            return False
        if len(names) == 1:  # nothing to rank: until the speed-ups over the baselines are known to the precision
            return all(precision_reached(samples, precision, look, n_looks, baseline=k, target=names[0],
                                         boot_samples=boot.samples, seed=boot.seed) for k in keys.values())
        leader, ratios, _ = judge(samples, n_looks)
        return all(r["lower"] > 1.0 + margin or r["upper"] < 1.0 + margin for r in ratios.values())

    pressure = CpuPressure()
    with tempfile.TemporaryDirectory(prefix="tailguard-promotion-") as tmp:
        runners = {}
        try:
            for r in rows:
                local = mlflow.artifacts.download_artifacts(results[r.variant].model_uri, dst_path=f"{tmp}/{r.variant}")
                v = variants[r.variant]
                files = sorted(Path(local).rglob("*.pt2" if v.backend == "torch" else "*.onnx"))
                if not files:
                    return None
                if v.backend == "torch":  # the artefact's manifest is checked on this node first
                    runners[r.variant] = runner_for_file(files[0], spec.model.inputs,  # a registry .pt2: vetted
                                                         intra_op_num_threads=spec.benchmark.intra_op_num_threads,
                                                         trusted=spec.model.source.trusted)
                    continue
                runners[r.variant] = timed_ort_runner(files[0], providers=[v.execution_provider],
                                                      intra_op_num_threads=spec.benchmark.intra_op_num_threads)
            runners.update({keys[b]: runner for b, runner in base.items()})
            ds = load_validation(spec)
            with pressure:  # how short of CPU the node was while the rounds were timed
                timed = interleaved_benchmark(runners, ds, spec.model.inputs, bench,
                                              pad_values=spec.model.pad_values, decide=decide,
                                              min_rounds=DECISION_MIN_ROUNDS)
        except (TailguardError, OSError, mlflow.exceptions.MlflowException) as exc:
            print(f"tailguard register: no paired promotion comparison: {type(exc).__name__}: {exc}",
                  file=sys.stderr)
            return None
    samples = {n: np.asarray(t[batch_size]["samples_ms"], dtype=np.float64) for n, t in timed.items()}
    first = next(iter(timed.values()))[batch_size]
    if first["n_iterations"] < DECISION_MIN_ROUNDS:  # the budget allowed too few rounds to be confident of anything
        print(f"tailguard register: no paired promotion comparison: {first['n_iterations']} rounds in the benchmark "
              f"budget, fewer than {DECISION_MIN_ROUNDS}", file=sys.stderr)
        return None
    leader, ratios, level = judge(samples, int(first.get("n_looks") or 1))

    def latency(row: dict[str, Any]) -> dict[str, Any]:
        return {"p50_ms": row["latency_ms.p50"], "p99_ms": row["latency_ms.p99"],
                "p50_ms.lb95": row.get("latency_ms.p50.lb95"), "p50_ms.ub95": row.get("latency_ms.p50.ub95")}

    speedups = {}
    for n in names:
        speedups[n] = {}
        for b, k in keys.items():
            r = speed_ratio(samples[k], samples[n], level, samples=boot.samples, seed=boot.seed)
            speedups[n][b] = {"ratio": r["ratio"], "lower": r["lower"], "upper": r["upper"]}
    return {"leader": leader, "ratios": ratios, "rounds": int(first["n_iterations"]), "confidence": level,
            "stopped_by": first.get("stopped_by"), "batch_size": batch_size,
            "p50_ms": {n: float(np.median(samples[n])) for n in names},
            "latency": {**{n: latency(timed[n][batch_size]) for n in names},
                        **{b: latency(timed[k][batch_size]) for b, k in keys.items()}},
            "baselines": list(keys), "speedups": speedups,
            "cpu_pressure": pressure.to_dict(),
            "method": (f"{first['method'].replace(', '.join(runners), ', '.join(names + list(keys)))}; ONNX Runtime "
                       f"sessions with {TIMED_ORT_SESSION}; leader = lowest median of the variants; ratio = "
                       f"median(other) / median(leader), one-sided bounds at {level * 100:.4g}% per look (95% over "
                       "the looks), paired bootstrap")}


PAIRED_LATENCY = {"latency_ms.p50": "p50_ms", "latency_ms.p99": "p99_ms"}  # gate metric -> `paired` key


def apply_paired(rows: list[VariantSummary], comparison: dict[str, Any] | None, decision: PromotionDecision) -> None:
    """Set each passing row's `paired` figures from the promotion's paired rounds (`compare_passing`), in place:
    its p50 / p99 (ms, with the p50's bounds), its speed-ups over the baselines timed in them with one-sided
    bounds, the rounds, and `tied` when the decision found it within the margin of the fastest (or ranked nothing:
    CPU pressure, no confident leader). Rows not in the rounds, or no comparison: `paired` stays None."""
    if not comparison:
        return
    tied = set(decision.tied) if len(decision.tied) > 1 else set()
    for row in rows:
        lat = (comparison.get("latency") or {}).get(row.variant)
        if lat is None:
            continue
        paired: dict[str, Any] = {**lat, "rounds": comparison["rounds"], "tied": row.variant in tied}
        for b, r in ((comparison.get("speedups") or {}).get(row.variant) or {}).items():
            paired[f"speedup_vs_{b}"] = dict(r)
        row.paired = paired


def latency_gate_contradictions(spec: Spec, row: VariantSummary, batch_size: int) -> list[str]:
    """Warnings for the row's latency gates (overall `latency_ms.p50` / `.p99` with `min` / `max`, at the
    promotion batch size) whose verdict on the validate task's own figure the promotion's paired rounds
    contradict: the gate passed on the task's figure, but the paired rounds' figure is outside the threshold.
    The gate stays decided on the task's figure (the gate input); the warning says the rounds disagree. [] when
    the row has no `paired` figures or nothing disagrees."""
    if not row.paired:
        return []
    out = []
    for g in spec.gates:
        key = PAIRED_LATENCY.get(g.metric)
        if key is None or g.scope != "overall" or spec.gate_batch_size(g) != batch_size or g.max_drop is not None:
            continue
        value = row.paired.get(key)
        task_value = row.p50_ms if key == "p50_ms" else row.p99_ms
        if value is None or row.gates.get(g.key) != GateStatus.PASSED:
            continue
        outside = (g.max is not None and value > g.max) or (g.min is not None and value < g.min)
        if outside:
            bound = f"<= {g.max:g}" if g.max is not None else f">= {g.min:g}"
            out.append(f"gate {g.key} passed on the validate task's {g.metric} "
                       f"{'?' if task_value is None else f'{task_value:.4g}'} ms, but the promotion's "
                       f"{row.paired['rounds']} paired rounds measured {value:.4g} ms (not {bound}) at batch "
                       f"{batch_size}: the node's load changed between the two timings")
    return out


def paired_metrics(comparison: dict[str, Any] | None, decision: PromotionDecision | None = None) -> dict[str, float]:
    """The parent run's metrics from the promotion's paired rounds: `paired.<name>.latency_ms.p50` / `.p99` (ms)
    for every variant and baseline timed, `paired.<variant>.speedup_vs_<baseline>` with `.lb95` / `.ub95` (one-
    sided bounds at the comparison's level), `paired.rounds`, and `paired.<variant>.tied` (1.0 / 0.0) when a
    decision is given. {} without a comparison."""
    if not comparison:
        return {}
    out: dict[str, float] = {"paired.rounds": float(comparison["rounds"])}
    for name, lat in (comparison.get("latency") or {}).items():
        out[f"paired.{name}.latency_ms.p50"] = float(lat["p50_ms"])
        out[f"paired.{name}.latency_ms.p99"] = float(lat["p99_ms"])
    for name, per in (comparison.get("speedups") or {}).items():
        for b, r in per.items():
            out[f"paired.{name}.speedup_vs_{b}"] = float(r["ratio"])
            out[f"paired.{name}.speedup_vs_{b}.lb95"] = float(r["lower"])
            out[f"paired.{name}.speedup_vs_{b}.ub95"] = float(r["upper"])
    if decision is not None:
        tied = set(decision.tied) if len(decision.tied) > 1 else set()
        for name in comparison.get("p50_ms") or {}:
            out[f"paired.{name}.tied"] = 1.0 if name in tied else 0.0
    return out


def log_paired_metrics(client: Any, parent_run_id: str, comparison: dict[str, Any] | None,
                       decision: PromotionDecision) -> None:
    """Log `paired_metrics` to the parent run (nothing without a comparison)."""
    import time

    from mlflow.entities import Metric

    values = paired_metrics(comparison, decision)
    if values:
        now = int(time.time() * 1000)
        client.log_batch(parent_run_id, metrics=[Metric(k, v, now, 0) for k, v in values.items()])


def register_and_promote(spec: Spec, *, parent_run_id: str, experiment_id: str, source_version: str,
                         source_sha256: str | None = None,
                         baselines: Callable[[], dict[str, Any]] | None = None) -> RunSummary:
    """Register the variants `promotion.register_variants` asks for and move the alias to the fastest passing one.

    Registration policy and artefact reuse (same sha256: the existing version is used, never a second one):
    module docstring. Rows that get no version say why (`VariantSummary.registration_note`).

    With spec `serving_targets` each variant has one validation run per target that serves it (tag
    tailguard.target); its row's `targets` holds each verdict, and the row passes only when it passed on every one
    of them. `promotion.alias` moves to the fastest variant passing on every target that serves it (p50 of its
    slowest target), and each target's alias `<alias>-<target>` to the fastest variant passing on that target
    (p50 there), before the default alias; a target where nothing passed keeps its alias where it was.

    Args:
        spec: the Spec.
        parent_run_id: the parent run whose nested runs (tag mlflow.parentRunId) are the variants.
        experiment_id: experiment of the parent run.
        source_version: the FP32 reference version (tag tailguard.source_version on every registered version).
        source_sha256: fingerprint of the reference artifact.
        baselines: callable() -> the FP32 references' runners timed in the promotion's paired rounds ({"torch":
            torch eager, "onnx_fp32": the ONNX export}; `compare_passing`), or None (the rounds hold the variants
            only, e.g. a re-decide on stored measurements).

    Returns:
        The RunSummary (also logged to the parent run as summary.json): one row per spec variant plus one
        '<V>-searched' row per search that chose a trial; `searches` holds each searched variant's search.json.
    """
    import mlflow
    from mlflow.exceptions import MlflowException

    from tailguard.core.spec.models import target_alias
    from tailguard.core.tracking import store_lock

    client = mlflow.MlflowClient()
    # Where the alias pointed when the run started (resolve recorded it); promotion is compare-and-set against it.
    at_start = client.get_run(parent_run_id).data.tags.get(ALIAS_AT_START_TAG)
    expected = (at_start or None) if at_start is not None else \
        alias_version(client, spec.optimized_model_name, spec.promotion.alias)
    targets = [t.name for t in spec.serving_targets]
    # the per-target aliases are compare-and-set against where they pointed when this step started
    expected_targets = {t: alias_version(client, spec.optimized_model_name, target_alias(spec.promotion.alias, t))
                        for t in targets}
    runs = client.search_runs([experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent_run_id}'",
                              max_results=1000)
    by_variant = {r.data.tags.get(VARIANT_TAG): r for r in runs if not r.data.tags.get(TARGET_TAG)}
    by_target = {(r.data.tags.get(VARIANT_TAG), r.data.tags.get(TARGET_TAG)): r for r in runs
                 if r.data.tags.get(TARGET_TAG)}
    bs = spec.promotion.batch_size or spec.benchmark.batch_sizes[0]
    summary = RunSummary(parent_run_id=parent_run_id, experiment_id=experiment_id,
                         source_model=spec.model.registered_name, source_version=str(source_version),
                         optimized_model=spec.optimized_model_name, alias=spec.promotion.alias,
                         promotion_enabled=spec.promotion.enabled, batch_size=bs, serving_targets=targets)
    try:
        client.get_registered_model(spec.optimized_model_name)
    except MlflowException:
        client.create_registered_model(spec.optimized_model_name, tags={SOURCE_MODEL_TAG:
                                                                        spec.model.registered_name},
                                       description=f"Optimized variants of {spec.model.registered_name} "
                                                   "built and validated by tailguard.")
    # One spec fingerprint per run: the one resolve put on the parent run (sha256 of the spec YAML the tasks got).
    spec_sha = client.get_run(parent_run_id).data.tags.get(SPEC_SHA256_TAG, "")
    built: list[tuple[VariantSummary, VariantResult, Any, str]] = []  # rows with a logged model, spec order
    nodes: dict[str, list[dict[str, Any]]] = {}  # row name -> its tailguard.validated_on entries

    def result_of(name: str, run: Any) -> VariantResult | str:
        r = read_variant_result(client, run.info.run_id)
        if isinstance(r, VariantResult) and r.variant != name:
            r = f"{VARIANT_RESULT_FILE} on run {run.info.run_id} is the result of {r.variant!r}, not of {name!r}"
        return r

    def row_of(name: str, v: VariantSpec, r: VariantResult, run_id: str) -> VariantSummary:
        row = VariantSummary(
            variant=name, backend=v.backend, precision=v.precision, status=r.status, reason=r.reason,
            passed=r.passed, run_id=run_id,
            p50_ms=r.perf_value(bs, "latency_ms.p50"), p99_ms=r.perf_value(bs, "latency_ms.p99"),
            speedup_vs_torch=r.perf_value(bs, "speedup_vs_torch"),
            speedup_vs_onnx_fp32=r.perf_value(bs, "speedup_vs_onnx_fp32"),
            worst_slice=r.worst_slice, discovered=list(r.discovered), gates=r.gate_statuses(),
            quantized_mac_fraction=r.quantized_mac_fraction, overall=dict(r.overall),
            hardware_dependent=r.hardware_dependent, numerics=r.numerics, rows=r.rows, rows_used=r.rows_used)
        row.warnings = coverage_warnings(v.precision, v.backend, row.status, row.quantized_mac_fraction) + list(
            r.warnings)  # + the build's (components/quantize: fusion, attention MatMuls, exporter warnings)
        if row.status == BuildStatus.OK:  # INT8 numerics: 8-bit weights on x86, the numerics check's flag
            row.warnings += numerics_warnings(v, r.hardware_dependent, r.numerics)
        return row

    def add_row(name: str, v: VariantSpec, run: Any, node_tags: dict[str, str] | None = None) -> None:
        """The row of candidate `name` from its run; `node_tags`: the run whose tailguard.hw.* tags name the node
        it was validated on (default `run`; a '<V>-searched' run is the search's, on V's node)."""
        run_id = run.info.run_id
        r = result_of(name, run)
        if isinstance(r, str):  # no result to trust: failed, not registered (a died task never passes)
            summary.variants.append(VariantSummary(name, v.backend, v.precision, BuildStatus.FAILED, reason=r,
                                                   run_id=run_id))
            return
        row = row_of(name, v, r, run_id)
        nodes[name] = validated_on(row, node_tags if node_tags is not None else run.data.tags)
        if row.status == BuildStatus.OK and r.model_uri:
            built.append((row, r, v, run_id))  # registered after the selection (registration policy)
        summary.variants.append(row)

    def add_target_row(v: VariantSpec) -> None:
        """One row for variant `v` from its validation on each target that serves it (`VariantSummary.targets`)."""
        entries: dict[str, dict[str, Any]] = {}
        results: dict[str, tuple[VariantResult, str]] = {}
        for t in spec.targets_for(v):
            run = by_target.get((v.name, t.name))
            if run is None:
                entries[t.name] = target_entry("no validation run was logged", {}, None, bs)
                continue
            r = result_of(v.name, run)
            entries[t.name] = target_entry(r, run.data.tags, run.info.run_id, bs)
            if isinstance(r, VariantResult):
                results[t.name] = (r, run.info.run_id)
        validated = [t for t, (r, _) in results.items() if r.status == BuildStatus.OK]
        base = validated[0] if validated else next(iter(results), None)
        if base is None:  # no target left a result: failed, not registered
            reason = "; ".join(f"{t}: {e['reason']}" for t, e in entries.items())
            summary.variants.append(VariantSummary(v.name, v.backend, v.precision, BuildStatus.FAILED, reason=reason,
                                                   targets=entries))
            return
        r, run_id = results[base]
        row = row_of(v.name, v, r, run_id)
        row.targets = entries
        row.passed = all(e["passed"] for e in entries.values())
        if not row.passed and row.status == BuildStatus.OK:
            row.reason = "not passed on every serving target: " + "; ".join(
                f"{t}: {e['reason'] or e['status']}" for t, e in entries.items() if not e["passed"])
        row.gates = merge_gate_statuses([results[t][0].gate_statuses() for t in validated])
        timed = [t for t in validated if entries[t]["p50_ms"] is not None]
        if timed:  # perf of the slowest target: what the variant guarantees on every pool it serves
            slow = results[max(timed, key=lambda t: entries[t]["p50_ms"])][0]
            row.p50_ms, row.p99_ms = slow.perf_value(bs, "latency_ms.p50"), slow.perf_value(bs, "latency_ms.p99")
            row.speedup_vs_torch = slow.perf_value(bs, "speedup_vs_torch")
            row.speedup_vs_onnx_fp32 = slow.perf_value(bs, "speedup_vs_onnx_fp32")
        if any(results[t][0].hardware_dependent for t in validated):
            row.hardware_dependent = True
        nodes[v.name] = validated_on(row)
        if row.status == BuildStatus.OK and r.model_uri:
            built.append((row, r, v, run_id))
        summary.variants.append(row)

    for v in spec.variants:
        if targets:
            add_target_row(v)
            continue
        run = by_variant.get(v.name)
        if run is None:
            summary.variants.append(VariantSummary(v.name, v.backend, v.precision, BuildStatus.FAILED,
                                                   reason="no validation run was logged"))
            continue
        add_row(v.name, v, run)
        if v.search is None:
            continue
        searched = by_variant.get(searched_name(v.name))
        if searched is not None and searched.data.tags.get(SEARCH_OF_TAG) == v.name:
            add_row(searched_name(v.name), v, searched, node_tags=run.data.tags)  # the search ran on V's node
        found = _search_json(client, run.info.run_id)
        if found is not None:
            summary.searches.append(found)
    by_target_choice = {t: fastest_on_target([row for row, *_ in built], t) for t in targets}
    picked = {id(row) for row in by_target_choice.values() if row is not None}
    # One timing truth (issue 37): the passing variants and the FP32 references are timed once, in one set of paired
    # rounds; the promotion decides on them and the table, report and paired.* metrics show them.
    passing = [row for row, *_ in built if row.passed and row.status == BuildStatus.OK and row.p50_ms is not None]
    comparison = compare_passing(spec, passing, {row.variant: r for row, r, *_ in built},
                                 {row.variant: v for row, _, v, _ in built},
                                 margin=float(spec.promotion.margin or 0.0), batch_size=bs,
                                 baselines=baselines) if passing else None
    decision = decide_promotion(
        [row for row, *_ in built], margin=spec.promotion.margin,
        holder=_holder_row(client, spec.optimized_model_name, expected, built),
        compare=lambda rows: comparison, max_cpu_pressure=spec.promotion.max_cpu_pressure)
    chosen = decision.chosen
    summary.promotion_rule, summary.promotion_reason = decision.rule, decision.reason
    summary.promotion_comparison = comparison
    apply_paired(passing, comparison, decision)
    for row in passing:
        row.warnings += latency_gate_contradictions(spec, row, bs)
    log_paired_metrics(client, parent_run_id, comparison, decision)
    print(f"tailguard register: promotion: {decision.reason}", file=sys.stderr)
    policy = spec.promotion.register_variants
    # under a lock on a local store: two runs of one machine never register the same artefact twice
    with store_lock(mlflow.get_tracking_uri(), f"register-{spec.optimized_model_name}"):
        existing = versions_by_sha256(client, spec.optimized_model_name)
        for row, r, v, run_id in built:
            wanted, why = registration_policy(policy, row, row is chosen or id(row) in picked)
            if not wanted:
                row.registration, row.registration_note = Registration.NOT_REGISTERED.value, why
                continue
            if r.sha256 and r.sha256 in existing:
                row.version = existing[r.sha256]
                row.registration = Registration.REUSED.value
                row.registration_note = f"reused v{row.version} (same sha256)"
                print(f"tailguard register: {row.variant}: reused v{row.version} of {spec.optimized_model_name} "
                      f"(same sha256 {r.sha256[:12]})", file=sys.stderr)
                continue
            extra = {SEARCH_OF_TAG: r.search_of, TRIAL_RUN_TAG: r.trial_run_id or ""} if r.search_of else {}
            tags = {VARIANT_TAG: row.variant, BACKEND_TAG: v.backend, PRECISION_TAG: v.precision,
                    **backend_tags(v, client.get_run(run_id).data.tags),
                    SOURCE_MODEL_TAG: spec.model.registered_name,
                    SOURCE_VERSION_TAG: str(source_version),
                    SOURCE_SHA256_TAG: source_sha256 or "",
                    GATES_TAG: (GatesVerdict.PASSED if row.passed else GatesVerdict.FAILED).value,
                    SHA256_TAG: r.sha256 or "",
                    SPEC_SHA256_TAG: spec_sha, RUN_ID_TAG: run_id,
                    VALIDATED_ON_TAG: validated_on_text(nodes.get(row.variant, [])), **extra}
            if v.backend in ("torch", "tensorrt"):  # a node-bound artefact folder, not an MLflow model: by source
                mv = register_artifact_folder(client, spec.optimized_model_name, r.model_uri, run_id, tags)
            else:
                mv = mlflow.register_model(r.model_uri, spec.optimized_model_name, tags=tags)
            row.version = str(mv.version)
            row.registration, row.registration_note = Registration.REGISTERED.value, f"v{row.version}"
            if r.sha256:
                existing[r.sha256] = row.version
    if spec.promotion.enabled:
        # Per-target aliases first, each to the fastest variant passing on its target (its p50 there), then the
        # default alias below, last. They do not tag the parent run's promotion outcome: that is the default alias'.
        for t in targets:
            alias_t, pick = target_alias(spec.promotion.alias, t), by_target_choice[t]
            entry: dict[str, Any] = {"target": t, "alias": alias_t, "variant": None, "version": None,
                                     "outcome": PromotionStatus.NOT_PROMOTED, "alias_version": expected_targets[t]}
            if pick is not None and pick.version is not None:
                result = promote(client, model_name=spec.optimized_model_name, alias=alias_t,
                                 version=str(pick.version), parent_run_id=parent_run_id, batch_size=bs,
                                 expected=expected_targets[t], tracking_uri=mlflow.get_tracking_uri(), record=False)
                entry.update(variant=pick.variant, version=pick.version, outcome=result.outcome,
                             alias_version=result.alias_version)
                if result.outcome == PromotionStatus.PROMOTED:
                    pick.target_aliases.append(alias_t)
                    _record_nodes(client, spec.optimized_model_name, pick, nodes)
            summary.target_aliases.append(entry)
    if chosen is not None and spec.promotion.enabled:
        # The alias moves last, after every variant is registered: a failure before this line moves nothing.
        result = promote(client, model_name=spec.optimized_model_name, alias=spec.promotion.alias,
                         version=str(chosen.version), parent_run_id=parent_run_id, batch_size=bs,
                         expected=expected, tracking_uri=mlflow.get_tracking_uri())
        summary.promotion, summary.alias_version = result.outcome, result.alias_version
        if result.outcome == PromotionStatus.PROMOTED:
            chosen.promoted = True
            summary.promoted_variant, summary.promoted_version = chosen.variant, chosen.version
            _record_nodes(client, spec.optimized_model_name, chosen, nodes)
    else:
        summary.alias_version = alias_version(client, spec.optimized_model_name, spec.promotion.alias)
    if targets:
        client.set_tag(parent_run_id, TARGET_ALIASES_TAG,
                       json.dumps({e["alias"]: e["alias_version"] for e in summary.target_aliases}))
    from .report import log_run_report

    log_run_report(client, summary.to_dict(), tracking_uri=mlflow.get_tracking_uri())
    return summary


VALIDATED_ON_MAX_CHARS = 5000  # MLflow's limit on a model version tag value


def validated_on_text(entries: list[dict[str, Any]]) -> str:
    """`validated_on` entries as the tag's JSON text; past VALIDATED_ON_MAX_CHARS the CPU model names are dropped
    (the monitor compares the ISA flags and GPUs only), then the entries that did not pass."""
    text = json.dumps(entries, separators=(",", ":"))
    if len(text) > VALIDATED_ON_MAX_CHARS:
        text = json.dumps([{k: v for k, v in e.items() if k != "cpu"} for e in entries], separators=(",", ":"))
    if len(text) > VALIDATED_ON_MAX_CHARS:
        text = json.dumps([{k: v for k, v in e.items() if k != "cpu"} for e in entries if e.get("passed")],
                          separators=(",", ":"))[:VALIDATED_ON_MAX_CHARS]
    return text


def _record_nodes(client: Any, model_name: str, row: VariantSummary, nodes: dict[str, list[dict[str, Any]]]) -> None:
    """Set `tailguard.validated_on` on the version an alias just moved to (a reused version holds the tag of the
    run that registered it: this run's validation is the one the alias now stands on)."""
    if row.registration == Registration.REUSED.value and row.version is not None:
        client.set_model_version_tag(model_name, str(row.version), VALIDATED_ON_TAG,
                                     validated_on_text(nodes.get(row.variant, [])))


def _holder_row(client: Any, model_name: str, version: str | None,
                built: list[tuple[VariantSummary, VariantResult, Any, str]]) -> str | None:
    """The name of the passing row whose artefact (sha256) is the version the alias pointed to when the run
    started, or None (no alias, a version without a sha256 tag, no passing row holding it)."""
    from mlflow.exceptions import MlflowException

    if not version:
        return None
    try:
        sha = (client.get_model_version(model_name, version).tags or {}).get(SHA256_TAG)
    except MlflowException:
        return None
    return next((row.variant for row, r, *_ in built if sha and r.sha256 == sha and row.passed), None)


@dataclass
class Promotion:
    """What `promote` did: outcome promoted | superseded, the version holding the alias after it, and why."""

    outcome: PromotionStatus
    alias_version: str | None
    reason: str = ""


def _version_int(v: Any) -> int | None:
    try:
        return int(str(v))
    except (TypeError, ValueError):
        return None


def _holder_wins(client: Any, model_name: str, holder: str, *, version: str, batch_size: int) -> tuple[bool, str]:
    """Whether the version now holding the alias (`holder`, promoted by another run while this one ran) should keep
    it against this run's `version`, by the rule a single run applies plus source recency.

    A newer source model version (tag tailguard.source_version) wins; for the same source version the faster
    passing variant wins (`passed` and p50 at `batch_size` from the variant_result.json of each version's
    validation run; ties: the holder). A holder that cannot be judged (no source version,
    no result file or no latency recorded, e.g. promoted by hand) keeps the alias: an unknown promotion is not
    overwritten.
    """
    mine, theirs = client.get_model_version(model_name, version), client.get_model_version(model_name, holder)
    src_mine = _version_int(mine.tags.get(SOURCE_VERSION_TAG))
    src_theirs = _version_int(theirs.tags.get(SOURCE_VERSION_TAG))
    if src_mine is None or src_theirs is None:
        return True, f"v{holder} was promoted by another process and cannot be compared"
    if src_theirs != src_mine:
        newer = src_theirs > src_mine
        return newer, (f"v{holder} is built from {'a newer' if newer else 'an older'} source version "
                       f"({src_theirs} vs {src_mine})")

    def p50(mv: Any) -> float | None:
        run_id = mv.tags.get(RUN_ID_TAG)
        r = read_variant_result(client, run_id) if run_id else None
        return r.perf_value(batch_size, "latency_ms.p50") if isinstance(r, VariantResult) and r.passed else None

    p_mine, p_theirs = p50(mine), p50(theirs)
    if p_theirs is None:
        return True, f"v{holder} was promoted by another process and has no passing latency to compare"
    if p_mine is None or p_theirs <= p_mine:
        return True, f"v{holder} is at least as fast (p50 {p_theirs:.4g} ms vs {p_mine} ms)"
    return False, f"v{holder} is slower (p50 {p_theirs:.4g} ms vs {p_mine:.4g} ms)"


def promote(client: Any, *, model_name: str, alias: str, version: str, parent_run_id: str, batch_size: int,
            expected: str | None, tracking_uri: str, record: bool = True) -> Promotion:
    """Move `alias` to `version`, compare-and-set: only if the alias still points where it pointed when the run
    decided (`expected`, None = nowhere); else re-decide against the version it now points to (`_holder_wins`).

    For a local store the re-read and the move happen under a file lock ($TAILGUARD_HOME/locks), so two runs of
    one machine cannot interleave them; for a remote store (a tracking server: MLflow's API has no atomic
    compare-and-set and no lock) the alias is re-read right before it is set and again right after, and the tags
    say superseded when another run's write landed last; two runs on different machines can still interleave
    between those reads, so run one promotion per model at a time there (docs/architecture.md). Tags are
    written under the same lock, so they stay true: this run's parent run gets tailguard.promotion (promoted |
    superseded) and tailguard.alias_version; when this run takes the alias from a version another run promoted
    while this one ran, that run's parent is re-tagged superseded (tailguard.superseded_by = this run).
    `record` False (a per-target alias, `<alias>-<target>`) writes none of these run tags: the parent run's
    promotion outcome is the default alias', and the summary's `target_aliases` records the per-target ones.
    """
    from mlflow.exceptions import MlflowException

    from tailguard.core.tracking import store_lock

    with store_lock(tracking_uri, f"promote-{model_name}"):
        holder = alias_version(client, model_name, alias)
        reason = ""
        if holder is not None and holder != expected and holder != version:
            keep, reason = _holder_wins(client, model_name, holder, version=version, batch_size=batch_size)
            if keep:
                if record:
                    _tag(client, parent_run_id, PromotionStatus.SUPERSEDED, holder, reason)
                return Promotion(PromotionStatus.SUPERSEDED, holder, reason)
            try:  # the run that promoted `holder` no longer holds the alias: say so on its parent run
                other = client.get_run(client.get_run(client.get_model_version(model_name, holder)
                                                      .tags[RUN_ID_TAG]).data.tags["mlflow.parentRunId"])
                if record and other.info.run_id != parent_run_id:
                    _tag(client, other.info.run_id, PromotionStatus.SUPERSEDED, version,
                         f"v{version} of run {parent_run_id} "
                         f"took the alias: {reason.replace(f'v{holder} is', 'it was')}")
                    client.set_tag(other.info.run_id, SUPERSEDED_BY_TAG, parent_run_id)
            except (MlflowException, KeyError):
                pass
        client.set_registered_model_alias(model_name, alias, version)
        now = alias_version(client, model_name, alias)
        if now != version:  # a remote store has no lock: another run moved the alias between our read and set
            why = f"v{now} took the alias right after this run set it (a concurrent run on a remote store)"
            if record:
                _tag(client, parent_run_id, PromotionStatus.SUPERSEDED, now, why)
            return Promotion(PromotionStatus.SUPERSEDED, now, why)
        if record:
            _tag(client, parent_run_id, PromotionStatus.PROMOTED, version, reason)
        return Promotion(PromotionStatus.PROMOTED, version, reason)


def _tag(client: Any, run_id: str, outcome: PromotionStatus, holder: str | None, reason: str) -> None:
    client.set_tag(run_id, PROMOTION_TAG, outcome)
    client.set_tag(run_id, ALIAS_VERSION_TAG, holder or "none")
    if reason:
        client.set_tag(run_id, PROMOTION_REASON_TAG, reason)
