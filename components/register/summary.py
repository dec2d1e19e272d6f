"""The rows of a run's summary: one `VariantSummary` per candidate, read from its run's variant_result.json, and the
`RunSummary` that the CLI, the terminal table, the report and `summary.json` show.

A row comes from the candidate's `variant_result.json` (`tailguard.core.results.VariantResult`, `read_variant_result`),
never from tags or metric names; the warnings a row carries (INT8 coverage, 8-bit weights) are written here.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from tailguard.core.contract import (
    HW_CPU_TAG,
    HW_GPU_TAG,
    HW_ISA_TAG,
    TARGET_CHECK_TAG,
    TARGET_PLACEMENT_TAG,
    VARIANT_RESULT_FILE,
)
from tailguard.core.results import BuildStatus, PromotionStatus, ResultFormatError, VariantResult

if TYPE_CHECKING:
    from tailguard.core.spec.variants import VariantSpec


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
            variant_result.json; components/build/macs.py), else None.
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
