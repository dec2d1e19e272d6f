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
from typing import TYPE_CHECKING, Any, Callable

from tailguard.components.register.promotion import (
    _holder_row,
    apply_paired,
    compare_passing,
    decide_promotion,
    fastest_on_target,
    latency_gate_contradictions,
    log_paired_metrics,
    merge_gate_statuses,
    promote,
)
from tailguard.components.register.summary import (
    RunSummary,
    VariantSummary,
    _search_json,
    coverage_warnings,
    numerics_warnings,
    read_variant_result,
    target_entry,
)
from tailguard.components.register.versions import (
    Registration,
    _record_nodes,
    backend_tags,
    register_artifact_folder,
    registration_policy,
    validated_on,
    validated_on_text,
    versions_by_sha256,
)
from tailguard.core.contract import (
    ALIAS_AT_START_TAG,
    BACKEND_TAG,
    GATES_TAG,
    PRECISION_TAG,
    RUN_ID_TAG,
    SEARCH_OF_TAG,
    SHA256_TAG,
    SOURCE_MODEL_TAG,
    SOURCE_SHA256_TAG,
    SOURCE_VERSION_TAG,
    SPEC_SHA256_TAG,
    TARGET_ALIASES_TAG,
    TARGET_TAG,
    TRIAL_RUN_TAG,
    VALIDATED_ON_TAG,
    VARIANT_RESULT_FILE,
    VARIANT_TAG,
    searched_name,
)
from tailguard.core.reference import alias_version
from tailguard.core.results import BuildStatus, GatesVerdict, PromotionStatus, VariantResult

if TYPE_CHECKING:
    from tailguard.core.spec.root import Spec
    from tailguard.core.spec.variants import VariantSpec


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

    from tailguard.core.spec.targets import target_alias
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
            r.warnings)  # + the build's (components/build: fusion, attention MatMuls, exporter warnings)
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
            if v.artifact != "onnx":  # a node-bound folder (.pt2, TensorRT plan), not an MLflow model: by source
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
