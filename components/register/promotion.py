"""Promotion: which passing candidate gets the alias (`decide_promotion`, with confidence from the paired rounds of
`compare_passing`), per serving target (`fastest_on_target`, `merge_gate_statuses`), and moving the alias only when
the current holder does not win (`promote`). A failed gate never moves an alias; registry aliases, not stages.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from tailguard.components.register.summary import VariantSummary, read_variant_result
from tailguard.core.contract import (
    ALIAS_VERSION_TAG,
    PROMOTION_REASON_TAG,
    PROMOTION_TAG,
    RUN_ID_TAG,
    SHA256_TAG,
    SOURCE_VERSION_TAG,
    SUPERSEDED_BY_TAG,
)
from tailguard.core.reference import alias_version
from tailguard.core.results import BuildStatus, GateStatus, PromotionStatus, VariantResult

if TYPE_CHECKING:
    from tailguard.core.spec.root import Spec
    from tailguard.core.spec.variants import VariantSpec


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
                    *, margin: float, batch_size: int, baselines: Callable[[], dict[str, Any]] | None = None,
                    clock: Callable[[], int] = time.perf_counter_ns) -> dict[str, Any] | None:
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
    torch eager in the rounds must not spend the budget before anything may be decided). With a single passing variant
    it stops once its speed-up over each baseline is known within `benchmark.precision` (default 0.05;
    `latency.precision_reached`). The baselines never lead and are never promoted.

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
        clock: the rounds' clock (ns; `interleaved_benchmark`), time.perf_counter_ns; tests pass a seeded one where
            the claim under test is about the statistics, not the machine.

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
    from tailguard.core.latency import DECISION_MIN_ROUNDS, interleaved_benchmark, precision_reached, speed_ratio
    from tailguard.core.runtime import TIMED_ORT_SESSION, runner_for_file, timed_ort_runner
    from tailguard.core.sequential_stats import look_confidence
    from tailguard.core.torch_backend import loads_trusted

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
                    runners[r.variant] = runner_for_file(files[0], spec.model.inputs,
                                                         intra_op_num_threads=spec.benchmark.intra_op_num_threads,
                                                         trusted=loads_trusted(v, spec.model.source.trusted))
                    continue
                runners[r.variant] = timed_ort_runner(files[0], providers=[v.execution_provider],
                                                      intra_op_num_threads=spec.benchmark.intra_op_num_threads)
            runners.update({keys[b]: runner for b, runner in base.items()})
            ds = load_validation(spec)
            with pressure:  # how short of CPU the node was while the rounds were timed
                timed = interleaved_benchmark(runners, ds, spec.model.inputs, bench,
                                              pad_values=spec.model.pad_values, decide=decide,
                                              min_rounds=DECISION_MIN_ROUNDS, clock=clock)
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
