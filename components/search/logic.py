"""Accuracy-driven mixed-precision search: the fastest INT8 configuration of a variant that passes every gate.

`run_search` (no MLflow, no KFP; components/search/task.py logs it):

1. Sensitivity (`sensitivity.node_sensitivity`) on at most `search.sensitivity_samples` calibration rows ranks
   the variant's quantizable nodes by how much quantizing each alone moves the model output.
2. Configurations are the product of the search space:
       k in space.exclude_most_sensitive     the k top-ranked nodes go to exclude_nodes (added to the variant's own)
       space.per_channel                     per-channel weight scales
       space.calibration_methods             static variants only (dynamic variants ignore it)
       space.float_op_types                  op types added to the variant's own exclude_op_types
   A *family* is one (per_channel, calibration_method, float_op_types) setting; its configurations differ in k
   only. Families that cannot differ are not planned: an op type in a float_op_types set that the variant's
   quantization never quantizes (`quantized_op_types`: ONNX Runtime's registry for the mode, e.g. dynamic
   quantization never touches LayerNormalization or GELU) or that the prepared graph (the variant's graph
   optimization + quant_pre_process, as the build sees it) does not contain is dropped from the set, since
   keeping it in float changes nothing; a family whose set then equals one already planned is skipped and
   recorded in `SearchResult.skipped` ("skipped: cannot differ", with the reason). Within a family the ranking
   skips nodes the family already keeps in float (their op type is in its exclude_op_types), so k always counts
   nodes that would otherwise be quantized; k larger than the number of probed nodes means all of them, and
   configurations that coincide are tried once.
3. Order. Families: the variant's own settings first, then the others in a seeded shuffle
   (`np.random.default_rng(search.seed).permutation`). Within a family the search assumes monotonicity: more
   nodes in float is at least as accurate and at least as slow. The fastest passing configuration of a family
   is then its smallest passing k, found by binary search over the family's sorted k values: try the middle;
   a pass moves the upper end down to it, a failure (gate failure, failed build or failed evaluation) moves
   the lower end above it; the family is done when the two ends meet (the frontier between failing and
   passing k is known), and the search moves on to the next family. About log2(len(k values)) + 1 trials per
   family instead of all of them. With `search.when: on_failure` the search runs because the variant as
   specified failed its gates, so the own family's k = 0 configuration (the variant itself) counts as a known
   failure and is not built again; with `when: always` it may pass, so it is tried first (if it passes,
   nothing in its family is faster) and the binary search covers the larger k values only if it fails.
4. Budget: before each trial the search stops when `max_trials` trials were run ("max_trials") or when
   `max_minutes` have passed since run_search started, sensitivity included ("max_minutes"); a running trial is
   always finished. When every family's frontier is known it stops with "space_exhausted".
5. Each trial builds with `tailguard.components.build.logic.build_variant` into out_dir/trials/<name>/ and
   is judged by the caller's `evaluate(trial_variant, model_path)`; a failed or skipped build and an exception
   in evaluate give a failed trial (status "failed" and the reason) and the search goes on.
6. The chosen trial is the passing trial with the lowest latency p50 at the promotion batch size
   (spec.promotion.batch_size, else the first benchmark batch size); ties go to the earlier trial.

Deterministic: the sensitivity ranking, the family order (seeded) and the binary search depend only on the
inputs, the seed and the pass/fail outcomes, so the same spec, data and seed give the same trial sequence as
long as the gates' verdicts are the same (gates on latency can differ between runs; parity gates cannot).
"""

from __future__ import annotations

import itertools
import json
import math
import re
import time
import traceback
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import pandas as pd

from tailguard.components.build.sensitivity import TOP_SENSITIVITY, node_sensitivity, write_sensitivity_artifacts
from tailguard.components.validate.result import ValidationResult
from tailguard.core.data import Dataset
from tailguard.core.errors import InputError
from tailguard.core.metrics import higher_is_better
from tailguard.core.results import BuildStatus, GateStatus, json_ready, number_or_none
from tailguard.core.spec.base import NAME_RE
from tailguard.core.spec.root import Spec
from tailguard.core.spec.variants import SearchSpec, VariantSpec

if TYPE_CHECKING:
    from tailguard.core.spec.variants import QuantizationSpec


class SearchStop(StrEnum):
    """Why a search stopped (SearchResult.stopped_by, search.json, the tag tailguard.search_stopped_by)."""

    SPACE_EXHAUSTED = "space_exhausted"  # every family's frontier is known
    MAX_TRIALS = "max_trials"            # search.max_trials trials were run
    MAX_MINUTES = "max_minutes"          # search.max_minutes passed (sensitivity included)


# The key parity metric when a trial has no worst slice (no slices with enough support): by model task, the same
# defaults as worst-slice discovery (spec DiscoverySpec.metric).
DEFAULT_KEY_METRIC = {"classification": "top1_agreement", "embedding": "nn_top1_agreement",
                      "regression": "abs_error.mean", "generic": "abs_error.mean",
                      "token_classification": "cer"}


@dataclass
class Trial:
    """One configuration built and validated.

    Attributes:
        index: 0-based, the order tried.
        name: f"{variant.name}-t{index:02d}" (variant name shortened to keep it DNS-1123, 63 characters).
        config: {"exclude_most_sensitive": k, "excluded_nodes": [the k nodes added, most sensitive first],
            "per_channel": bool, "calibration_method": str | None (static only), "float_op_types": [op types
            added]}.
        variant: the concrete VariantSpec built (quantization filled in, name = `name`, no search section).
        status: "ok" | "failed" (build or evaluation failed; `reason` says why).
        passed: every gate passed.
        p50_ms: latency p50 (ms) at the promotion batch size, None when not measured.
        worst_slice_value: ValidationResult.worst_slice["observed"] (key parity metric, worst group).
        overall_value: the same key metric over all validation rows.
        seconds: wall time of build + evaluation (s).
        reason: why the trial failed ("" when ok).
        model_path: the built .onnx file.
        result: the ValidationResult (None when the build or the evaluation failed).
        metric: name of the key parity metric of worst_slice_value / overall_value.
    """

    index: int
    name: str
    config: dict[str, Any]
    variant: VariantSpec
    status: str
    passed: bool
    p50_ms: float | None
    worst_slice_value: float | None
    overall_value: float | None
    seconds: float
    reason: str = ""
    model_path: str | None = None
    result: ValidationResult | None = None
    metric: str | None = None


@dataclass
class SearchResult:
    """Outcome of `run_search`.

    Attributes:
        variant: the searched variant's name.
        trials: every trial, in the order tried.
        chosen: index of the fastest passing trial (lowest p50_ms, ties: lower index), None when none passed.
        stopped_by: a SearchStop: "space_exhausted" | "max_trials" | "max_minutes".
        sensitivity: `sensitivity.node_sensitivity` table (rank, node, op_type, output_rel_l2,
            output_cosine_drop, quantized, seconds, error).
        seed: the search seed.
        sensitivity_seconds: wall time of the sensitivity analysis (s).
        skipped: families of the search space that were not planned because they cannot differ from one that
            was, in space order: {"per_channel", "calibration_method", "float_op_types" (the set as the space
            wrote it), "same_as" (the op types the planned family adds), "status": SKIPPED_STATUS, "reason"}.
        dropped_op_types: {op type: why keeping it in float changes nothing}, every op type dropped from a
            float_op_types set (`plan_families`).
    """

    variant: str
    trials: list[Trial]
    chosen: int | None
    stopped_by: SearchStop
    sensitivity: pd.DataFrame
    seed: int
    sensitivity_seconds: float = 0.0
    skipped: list[dict[str, Any]] = field(default_factory=list)
    dropped_op_types: dict[str, str] = field(default_factory=dict)

    def pareto(self) -> pd.DataFrame:
        """One row per trial with its Pareto status (latency vs worst-slice parity).

        A trial is on the front when its status is ok, it has a p50 and a value, and no other such trial is at
        least as good on both axes and better on one: lower p50_ms, and a better worst-slice value of the key
        metric (higher for agreement/cosine/accuracy, lower for errors; `tailguard.core.metrics.higher_is_better`). The
        overall value stands in when a trial has no worst slice. Passing or not does not matter for the front.

        Returns:
            DataFrame with columns index, name, status, passed, p50_ms, worst_slice_value, overall_value, metric,
            on_front (bool), chosen (bool), exclude_most_sensitive, excluded_count, per_channel,
            calibration_method, float_op_types (comma-joined), seconds, reason.
        """
        rows = []
        for t in self.trials:
            c = t.config
            rows.append({"index": t.index, "name": t.name, "status": t.status, "passed": bool(t.passed),
                         "p50_ms": t.p50_ms, "worst_slice_value": t.worst_slice_value,
                         "overall_value": t.overall_value, "metric": t.metric, "on_front": False,
                         "chosen": t.index == self.chosen,
                         "exclude_most_sensitive": c.get("exclude_most_sensitive"),
                         "excluded_count": len(c.get("excluded_nodes", [])), "per_channel": c.get("per_channel"),
                         "calibration_method": c.get("calibration_method"),
                         "float_op_types": ",".join(c.get("float_op_types", [])), "seconds": t.seconds,
                         "reason": t.reason})
        points = []
        for i, t in enumerate(self.trials):
            value = t.worst_slice_value if t.worst_slice_value is not None else t.overall_value
            if t.status != BuildStatus.OK or t.p50_ms is None or value is None or not math.isfinite(t.p50_ms) \
                    or math.isnan(value):
                continue
            sign = 1.0 if t.metric is None or higher_is_better(t.metric) else -1.0
            points.append((i, float(t.p50_ms), sign * float(value)))  # minimise p50, maximise signed value
        for i, p, v in points:
            dominated = any(p2 <= p and v2 >= v and (p2 < p or v2 > v) for j, p2, v2 in points if j != i)
            rows[i]["on_front"] = not dominated
        columns = ["index", "name", "status", "passed", "p50_ms", "worst_slice_value", "overall_value", "metric",
                   "on_front", "chosen", "exclude_most_sensitive", "excluded_count", "per_channel",
                   "calibration_method", "float_op_types", "seconds", "reason"]
        return pd.DataFrame.from_records(rows, columns=columns)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able summary: variant, seed, stopped_by, chosen, chosen_name, n_trials, n_passed,
        sensitivity_seconds, trials (the `pareto` records plus each trial's excluded_nodes, config and
        model_path), skipped (the families skipped as unable to differ, `skipped`), n_skipped, dropped_op_types,
        and the sensitivity table's top TOP_SENSITIVITY rows. Non-finite floats stay floats (json writes
        Infinity)."""
        trials = []
        for rec, t in zip(self.pareto().to_dict("records"), self.trials):
            rec = {k: json_ready(v, nan_as_none=True) for k, v in rec.items()}
            rec.update(excluded_nodes=list(t.config.get("excluded_nodes", [])),
                       config=json_ready(t.config, nan_as_none=True), model_path=t.model_path)
            trials.append(rec)
        sens = [{k: json_ready(v, nan_as_none=True) for k, v in r.items()}
                for r in self.sensitivity.head(TOP_SENSITIVITY).to_dict("records")]
        return {"variant": self.variant, "seed": self.seed, "stopped_by": self.stopped_by, "chosen": self.chosen,
                "chosen_name": self.trials[self.chosen].name if self.chosen is not None else None,
                "n_trials": len(self.trials), "n_passed": sum(1 for t in self.trials if t.passed),
                "sensitivity_seconds": self.sensitivity_seconds, "trials": trials,
                "skipped": json_ready(self.skipped, nan_as_none=True), "n_skipped": len(self.skipped),
                "dropped_op_types": dict(self.dropped_op_types), "sensitivity": sens}


# ------------------------------------------------------------------------------------------ configurations
@dataclass(frozen=True)
class _Family:
    per_channel: bool
    calibration_method: str | None
    float_op_types: tuple[str, ...]   # added to the variant's own exclude_op_types, spec order


@dataclass
class _FamilyState:
    family: _Family
    ranked: list[str]                 # probed nodes still quantized in this family, most sensitive first
    ks: list[int]                     # distinct effective k values, ascending
    lo: int = 0                       # every index < lo is known to fail
    hi: int = -1                      # index of the smallest k known to pass (len(ks): none known)
    first: int | None = None          # an index to try before the binary search (the variant as specified)
    results: dict[int, bool] = field(default_factory=dict)

    def next_index(self) -> int | None:
        """The next k index to try (binary search for the smallest passing k), None when the frontier is known."""
        if self.lo >= self.hi:
            return None
        if self.first is not None:
            return self.first
        return (self.lo + self.hi) // 2

    def record(self, i: int, passed: bool) -> None:
        self.first = None
        self.results[i] = passed
        if passed:
            self.hi = i
        else:
            self.lo = i + 1


def _dedupe(items: list[Any]) -> list[Any]:
    out: list[Any] = []
    for x in items:
        if x not in out:
            out.append(x)
    return out


SKIPPED_STATUS = "skipped: cannot differ"  # a family of the space that would repeat a planned one


def quantized_op_types(q: QuantizationSpec) -> frozenset[str]:
    """The op types ONNX Runtime's quantizer quantizes for quantization settings `q` (mode, format, op_types).

    Read from the installed library's registries (onnxruntime/quantization/registry.py and quantize.py), not a
    hand list:

    * dynamic (`quantize_dynamic`, IntegerOps): `IntegerOpsRegistry` (MatMul, Attention, LSTM, Gather,
      EmbedLayerNormalization, ...), restricted to `q.op_types` when set, plus Gemm whenever MatMul is in: the
      dynamic quantizer rewrites every Gemm as MatMul + Add first (`ONNXModel.replace_gemm_with_matmul`).
      LayerNormalization, Softmax and the GELUs are never quantized.
    * static QDQ: `q.op_types`, else quantize_static's default `QLinearOpsRegistry` | `QDQRegistry`; the QDQ
      quantizer wraps every listed op type in Q/DQ (`CreateQDQQuantizer` falls back to `QDQOperatorBase`).
    * static QOperator: the same list restricted to `QLinearOpsRegistry` (`CreateOpQuantizer` leaves other op
      types in float).

    Args:
        q: a `tailguard.core.spec.variants.QuantizationSpec`.

    Returns:
        The op type names (ONNX `op_type`), e.g. {"MatMul", "Gemm", "Attention", ...} for dynamic.
    """
    from onnxruntime.quantization.registry import IntegerOpsRegistry, QDQRegistry, QLinearOpsRegistry

    if q.mode == "dynamic":
        types = set(IntegerOpsRegistry) & set(q.op_types) if q.op_types else set(IntegerOpsRegistry)
        if "MatMul" in types:
            types.add("Gemm")
        return frozenset(types)
    listed = set(q.op_types) if q.op_types else set(QLinearOpsRegistry) | set(QDQRegistry)
    return frozenset(listed if q.format == "qdq" else listed & set(QLinearOpsRegistry))


def _never_quantized_reason(q: QuantizationSpec) -> str:
    """Why `quantized_op_types(q)` lacks an op type, in words (names the registry it was read from)."""
    if q.mode == "dynamic":
        return ("dynamic quantization never quantizes it (onnxruntime.quantization.registry.IntegerOpsRegistry"
                + (", restricted to quantization.op_types" if q.op_types else "") + ")")
    where = "quantization.op_types" if q.op_types else \
        "quantize_static's default op types, QLinearOpsRegistry | QDQRegistry"
    if q.format == "qdq":
        return f"static quantization never quantizes it (not in {where})"
    return f"static QOperator quantization never quantizes it (not in {where} restricted to QLinearOpsRegistry)"


def plan_families(variant: VariantSpec, search: SearchSpec, graph_op_types: set[str] | None = None
                  ) -> tuple[list[_Family], list[dict[str, Any]], dict[str, str]]:
    """The families to search, the ones skipped because they cannot differ from a planned one, and why.

    Each float_op_types set of the space loses the op types that cannot change a configuration: those the
    variant already keeps in float (its exclude_op_types), those its quantization never quantizes
    (`quantized_op_types`) and, when `graph_op_types` is given, those absent from the graph. A (per_channel,
    calibration_method, remaining set) equal to one already planned would build the same models: it is skipped.

    Args:
        variant: the INT8 variant searched (its quantization section).
        search: its search section (space, seed).
        graph_op_types: op types of the graph the quantizer sees (the prepared graph); None: not checked.

    Returns:
        (families: the variant's own first, then the rest in a seeded shuffle;
         skipped: one record per skipped space entry, see `SearchResult.skipped`;
         dropped: {op type: reason it was dropped}).
    """
    q = variant.quantization
    static = q.mode == "static"
    space = search.space
    methods: list[str | None] = _dedupe(list(space.calibration_methods)) if static else [None]
    own_types = set(q.exclude_op_types)
    quantized = quantized_op_types(q)
    dropped: dict[str, str] = {}
    for fot in space.float_op_types:
        for t in fot:
            if t in own_types or t in dropped:
                continue
            if t not in quantized:
                dropped[t] = _never_quantized_reason(q)
            elif graph_op_types is not None and t not in graph_op_types:
                dropped[t] = "the prepared graph has no node of this op type"
    fams: list[_Family] = []
    skipped: list[dict[str, Any]] = []
    seen: dict[tuple, _Family] = {}
    for pc, method, fot in itertools.product(_dedupe(list(space.per_channel)), methods, space.float_op_types):
        added = tuple(_dedupe([t for t in fot if t not in own_types and t not in dropped]))
        key = (pc, method, frozenset(added))  # op-type sets that end up equal are one family
        if key in seen:
            by_reason: dict[str, list[str]] = {}
            for t in _dedupe([t for t in fot if t in dropped or t in own_types]):
                by_reason.setdefault(dropped.get(t, "the variant's exclude_op_types already holds it"), []).append(t)
            why = "; ".join(f"{', '.join(ts)}: {r}" for r, ts in by_reason.items()) or \
                "the same set as an earlier entry"
            skipped.append({"per_channel": pc, "calibration_method": method, "float_op_types": list(fot),
                            "same_as": list(seen[key].float_op_types), "status": SKIPPED_STATUS,
                            "reason": f"keeping these op types in float changes nothing ({why})"})
            continue
        seen[key] = _Family(pc, method, added)
        fams.append(seen[key])
    own = _Family(q.per_channel, q.calibration_method if static else None, ())
    first = [f for f in fams if f == own]
    rest = [f for f in fams if f != own]
    order = np.random.default_rng(search.seed).permutation(len(rest))
    return first + [rest[i] for i in order], skipped, dropped


def _families(variant: VariantSpec, search: SearchSpec, graph_op_types: set[str] | None = None) -> list[_Family]:
    """Every family to search, the variant's own first, then the rest in a seeded shuffle (`plan_families`)."""
    return plan_families(variant, search, graph_op_types)[0]


def prepared_op_types(sensitivity_dir: Path, q: QuantizationSpec, fp32_onnx: str | Path) -> set[str]:
    """Op types of the graph the quantizer sees.

    Args:
        sensitivity_dir: `node_sensitivity`'s work folder; it leaves the prepared graph there (preprocessed.onnx
            when quantization.preprocess ran, else optimized.onnx: graph_optimization applied, fusions included).
        q: the variant's QuantizationSpec (`preprocess`).
        fp32_onnx: the FP32 .onnx file, read when neither prepared file is there.

    Returns:
        The set of ONNX `op_type` values of the graph's top-level nodes, e.g. {"MatMul", "SkipLayerNormalization"}.
    """
    import onnx

    for name in (("preprocessed.onnx",) if q.preprocess else ()) + ("optimized.onnx",):
        if (sensitivity_dir / name).is_file():
            path = sensitivity_dir / name
            break
    else:
        path = Path(fp32_onnx)
    return {n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node}


def _trial_name(variant_name: str, index: int) -> str:
    suffix = f"-t{index:02d}"
    base = variant_name[:63 - len(suffix)].rstrip("-")
    name = f"{base}{suffix}"
    if not re.fullmatch(NAME_RE, name):  # cannot happen for a valid variant name; kept as a guard
        raise InputError(f"search: trial name {name!r} is not DNS-1123")
    return name


def _trial_variant(variant: VariantSpec, name: str, family: _Family, nodes: list[str]) -> VariantSpec:
    """The concrete variant of one configuration (validated like a spec variant; no search section)."""
    d = variant.model_dump(mode="json", exclude_unset=True)
    d.pop("search", None)
    d["name"] = name
    q = dict(d.get("quantization", {}))
    q["exclude_nodes"] = _dedupe(list(variant.quantization.exclude_nodes) + nodes)
    q["exclude_op_types"] = _dedupe(list(variant.quantization.exclude_op_types) + list(family.float_op_types))
    q["per_channel"] = family.per_channel
    if family.calibration_method is not None:
        q["calibration_method"] = family.calibration_method
    d["quantization"] = q
    return VariantSpec.model_validate(d)


def _key_metric(spec: Spec, result: ValidationResult) -> str:
    if result.worst_slice:
        return str(result.worst_slice["metric"])
    return DEFAULT_KEY_METRIC.get(spec.model.task, "abs_error.mean")


def _p50(spec: Spec, result: ValidationResult) -> float | None:
    bs = spec.promotion.batch_size or spec.benchmark.batch_sizes[0]
    row = result.perf.get(bs) or result.perf.get(str(bs)) or {}  # type: ignore[call-overload]
    v = row.get("latency_ms.p50")
    return None if v is None else float(v)


# ------------------------------------------------------------------------------------------------- search
def run_search(spec: Spec, variant: VariantSpec, fp32_onnx: str | Path, out_dir: str | Path, *,
               calibration: Dataset | None, sensitivity_data: Dataset,
               evaluate: Callable[[VariantSpec, Path], ValidationResult],
               on_trial: Callable[[Trial], None] | None = None,
               clock: Callable[[], float] = time.monotonic) -> SearchResult:
    """Search mixed-precision configurations of `variant` for the fastest one that passes every gate.

    Strategy, budget and determinism: module docstring.

    Args:
        spec: the validated spec (model, calibration batch size, benchmark / promotion batch size).
        variant: an INT8 onnxruntime variant; its `search` section (defaults when None) sets budget, seed,
            sensitivity rows and space.
        fp32_onnx: the FP32 reference .onnx file.
        out_dir: folder (created): sensitivity/ (scratch) and trials/<trial name>/ (each trial's build).
        calibration: calibration rows for static variants (None for dynamic).
        sensitivity_data: rows for the sensitivity analysis (the calibration set; at most
            search.sensitivity_samples of them are used).
        evaluate: `evaluate(trial_variant, model_path) -> ValidationResult`, e.g. validate_variant on the
            validation set with the spec's gates (gates listing `variants` must be matched with the searched
            variant's name, not the trial's).
        on_trial: called with each Trial right after it finished (e.g. to log it).
        clock: seconds, monotonic (injectable for tests); budget only, trial seconds use perf_counter.

    Returns:
        SearchResult.

    Raises:
        InputError: the variant is not INT8 on onnxruntime, a static variant gets no calibration rows, the FP32
            file is missing or no sensitivity rows are given.
    """
    start = clock()
    q = variant.quantization
    if variant.precision != "int8" or variant.backend != "onnxruntime" or q is None:
        raise InputError(f"search: variant {variant.name} is not an INT8 ONNX Runtime variant",
                         hint="search applies to precision int8 on backend onnxruntime")
    static = q.mode == "static"
    if static and (calibration is None or calibration.n_rows == 0):
        raise InputError(f"search: static INT8 variant {variant.name} needs calibration rows",
                         hint="set data.calibration in the spec")
    search = variant.search or SearchSpec()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    t0 = time.perf_counter()
    sens = node_sensitivity(variant, fp32_onnx, sensitivity_data, spec.model, samples=search.sensitivity_samples,
                            work_dir=out / "sensitivity", batch_size=spec.data.calibration.batch_size)
    sens_seconds = round(time.perf_counter() - t0, 3)
    types = dict(zip(sens["node"], sens["op_type"]))
    families, skipped, dropped = plan_families(variant, search,
                                               prepared_op_types(out / "sensitivity", q, fp32_onnx))

    states = []
    for fam in families:
        floats = set(q.exclude_op_types) | set(fam.float_op_types)
        ranked = [n for n in sens["node"] if types[n] not in floats]
        ks = sorted({min(k, len(ranked)) for k in search.space.exclude_most_sensitive})
        states.append(_FamilyState(fam, ranked, ks, lo=0, hi=len(ks)))
    own = _Family(q.per_channel, q.calibration_method if static else None, ())
    if states and states[0].family == own and states[0].ks[0] == 0:
        if search.when == "on_failure":
            states[0].lo = 1  # the variant as specified failed its gates: that is why the search runs
        else:
            states[0].first = 0  # it may pass: if it does, nothing in its family is faster

    # Families are distinct (per_channel, calibration_method, op-type set) and a family's k values give distinct
    # node sets, so no configuration is ever built twice.
    trials: list[Trial] = []
    stopped_by = SearchStop.SPACE_EXHAUSTED
    for state in states:
        while (i := state.next_index()) is not None:
            if len(trials) >= search.max_trials:
                stopped_by = SearchStop.MAX_TRIALS
                break
            if clock() - start >= search.max_minutes * 60.0:
                stopped_by = SearchStop.MAX_MINUTES
                break
            k = state.ks[i]
            trial = _run_trial(spec, variant, fp32_onnx, out, calibration, evaluate, len(trials), state.family, k,
                               state.ranked[:k])
            trials.append(trial)
            state.record(i, trial.passed)
            if on_trial is not None:
                on_trial(trial)
        if stopped_by != SearchStop.SPACE_EXHAUSTED:
            break
    return SearchResult(variant=variant.name, trials=trials, chosen=choose_trial(trials), stopped_by=stopped_by,
                        sensitivity=sens, seed=search.seed, sensitivity_seconds=sens_seconds, skipped=skipped,
                        dropped_op_types=dropped)


def choose_trial(trials: list[Trial]) -> int | None:
    """Index of the fastest passing trial: lowest p50_ms among trials with status ok that passed every gate
    (a missing p50 counts as +inf), ties to the lower index; None when none passed."""
    passing = [t for t in trials if t.passed and t.status == BuildStatus.OK]
    if not passing:
        return None
    return min(passing, key=lambda t: (t.p50_ms if t.p50_ms is not None and not math.isnan(t.p50_ms)
                                       else math.inf, t.index)).index


def _run_trial(spec: Spec, variant: VariantSpec, fp32_onnx: str | Path, out: Path, calibration: Dataset | None,
               evaluate: Callable[[VariantSpec, Path], ValidationResult], index: int, fam: _Family, k: int,
               nodes: list[str]) -> Trial:
    """Build and evaluate one configuration; every failure becomes a failed trial."""
    from tailguard.components.build.logic import build_variant

    name = _trial_name(variant.name, index)
    config = {"exclude_most_sensitive": k, "excluded_nodes": list(nodes), "per_channel": fam.per_channel,
              "calibration_method": fam.calibration_method, "float_op_types": list(fam.float_op_types)}
    tv = _trial_variant(variant, name, fam, nodes)
    t0 = time.perf_counter()
    base = dict(index=index, name=name, config=config, variant=tv, passed=False, p50_ms=None,
                worst_slice_value=None, overall_value=None)
    try:
        built = build_variant(tv, fp32_onnx, out / "trials" / name, calibration=calibration, model=spec.model,
                              calibration_batch_size=spec.data.calibration.batch_size)
    except InputError:
        raise
    except Exception as exc:  # a step that raises instead of returning failed: still one failed trial
        return Trial(**base, status=BuildStatus.FAILED, seconds=round(time.perf_counter() - t0, 3),
                     reason=f"build raised {type(exc).__name__}: {str(exc)[:500]}")
    if built.status != BuildStatus.OK or not built.artifact:
        return Trial(**base, status=BuildStatus.FAILED, seconds=round(time.perf_counter() - t0, 3),
                     reason=f"build {built.status}: {built.reason}")
    model_path = Path(built.artifact)
    try:
        result = evaluate(tv, model_path)
    except Exception as exc:  # the evaluation of one configuration failing must not end the search
        tb = traceback.format_exc(limit=3)
        return Trial(**base, status=BuildStatus.FAILED, seconds=round(time.perf_counter() - t0, 3),
                     model_path=str(model_path),
                     reason=f"evaluation raised {type(exc).__name__}: {str(exc)[:500]}\n{tb[-1500:]}")
    metric = _key_metric(spec, result)
    worst = number_or_none(result.worst_slice["observed"]) if result.worst_slice else None
    return Trial(**{**base, "passed": bool(result.passed), "p50_ms": _p50(spec, result),
                    "worst_slice_value": worst, "overall_value": number_or_none(result.overall.get(metric))},
                 status=BuildStatus.OK, seconds=round(time.perf_counter() - t0, 3), model_path=str(model_path),
                 result=result, metric=metric)


# ---------------------------------------------------------------------------------------------- artifacts
def _pareto_plot(result: SearchResult, frame: pd.DataFrame, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    f = frame[(frame["status"] == BuildStatus.OK) & frame["p50_ms"].notna()].copy()
    f["value"] = f["worst_slice_value"].where(f["worst_slice_value"].notna(), f["overall_value"])
    f = f[f["value"].notna()]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    if len(f):
        for passed, color, label in ((True, "#55a868", "passed"), (False, "#c44e52", "failed")):
            g = f[f["passed"] == passed]
            ax.scatter(g["p50_ms"], g["value"], color=color, label=label, zorder=3)
        for _, r in f.iterrows():
            ax.annotate(str(r["index"]), (r["p50_ms"], r["value"]), textcoords="offset points", xytext=(4, 3),
                        fontsize=7)
        front = f[f["on_front"]].sort_values("p50_ms")
        if len(front):
            ax.step(front["p50_ms"], front["value"], where="post", color="#4c72b0", label="Pareto front",
                    zorder=2)
        ch = f[f["chosen"]]
        if len(ch):
            ax.scatter(ch["p50_ms"], ch["value"], marker="*", s=260, facecolor="none", edgecolor="black",
                       linewidth=1.5, label="chosen", zorder=4)
        ax.legend(fontsize=8)
        metric = next((m for m in f["metric"] if m), "key metric")
    else:
        ax.text(0.5, 0.5, "no evaluated trial", ha="center", va="center", transform=ax.transAxes)
        metric = "key metric"
    ax.set_xlabel("latency p50 (ms)")
    ax.set_ylabel(f"{metric}, worst slice")
    ax.set_title(f"Search of {result.variant}: {len(result.trials)} trials, stopped by {result.stopped_by}")
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=90, bbox_inches="tight")
    plt.close(fig)


def write_search_artifacts(result: SearchResult, out_dir: str | Path) -> dict[str, str]:
    """Write the search's files into `out_dir` (created).

    Files: sensitivity.csv (the full ranking), sensitivity.png (bar chart of the TOP_SENSITIVITY most sensitive
    nodes), trials.csv (one row per trial: the pareto columns plus excluded_nodes, float_op_types (JSON lists),
    model_path and the failed gates), pareto.csv (`SearchResult.pareto()`), pareto.png (p50 vs worst-slice
    value: passed / failed trials, the front as a step line, the chosen trial starred), search.json
    (`SearchResult.to_dict()`).

    Returns:
        {file name: path}, e.g. {"search.json": ".../search.json", ...}.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {n: out / n for n in ("sensitivity.csv", "sensitivity.png", "trials.csv", "pareto.csv", "pareto.png",
                                  "search.json")}
    write_sensitivity_artifacts(result.sensitivity, out)
    frame = result.pareto()
    frame.to_csv(paths["pareto.csv"], index=False)
    trials = frame.copy()
    trials["excluded_nodes"] = [json.dumps(t.config.get("excluded_nodes", [])) for t in result.trials]
    trials["float_op_types"] = [json.dumps(t.config.get("float_op_types", [])) for t in result.trials]
    trials["model_path"] = [t.model_path for t in result.trials]
    trials["failed_gates"] = [json.dumps([g.gate for g in t.result.gates if g.status == GateStatus.FAILED])
                              if t.result is not None else "" for t in result.trials]
    trials.to_csv(paths["trials.csv"], index=False)
    _pareto_plot(result, frame, paths["pareto.png"])
    paths["search.json"].write_text(json.dumps(result.to_dict(), indent=1, default=str))
    return {k: str(v) for k, v in paths.items()}
