"""Sequential validation (issue 25): score the validation rows in a shuffled order, block by block, and decide each
parity gate as soon as a confidence sequence says on which side of its threshold the gate's ALL-ROWS value falls.

What is decided. A parity gate's outcome on every validation row is a function of counts over a finite population
of rows: for a 0/1 metric (PROPORTION_METRICS: agreements, accuracy) the group's number of good rows K decides the
point value K / N and its Wilson bound alike (both increase with K), so the gate passes exactly when K >= k*,
the smallest count that clears the threshold (`_threshold_count`); for a quantile, maximum or minimum of per-row
values (cosine_similarity.p01, abs_error.max, kl_divergence.p99, ...) without `confidence`, the number B of rows on
the bad side of the threshold decides it (np.percentile's linear interpolation at position q (N - 1) / 100 between
sorted values s[lo] and s[hi]: the value clears a `min` threshold when B <= lo and misses it when B >= hi + 1; B =
hi = lo + 1 needs the values themselves, `_percentile_counts`). Each such count gets the prior-posterior-ratio
confidence sequence for a population drawn without replacement (`tailguard.core.sequential_stats.wor_decide_at_least`,
Waudby-Smith & Ramdas 2020), at level alpha / (number of groups the gate judges) for `analysis.sequential.alpha`
(Bonferroni over the groups): whenever scoring stops, the chance that any decision taken differs from the decision
on all rows is at most alpha per gate. With every row scored the decisions are exactly the all-rows ones (the
validate step then evaluates the gates on all rows as before).

Units (the populations a gate judges): `overall` one unit, all rows; `per_slice` every group of the gate's slice(s)
with at least `min_support` rows on all rows (groups under it are insufficient_data as on all rows; the support is
known from the metadata before any row is scored); `discovered` every slice discovery tests
(`discovery.tested_slices`, also metadata only): the gate passes early when every one clears the threshold
(then it passes whatever discovery marks significant on all rows); it is never failed early (which slices are
significant is known only on all rows), and it is decided on all rows when its `min_support` exceeds discovery's.

Gates decided on all rows only (they keep the run going until the last row unless another gate already failed the
variant, `stop: verdict`): relative accuracy (`max_drop` on accuracy, Newcombe's paired bound), `confidence` on a
metric that is not 0/1 (bootstrap bounds), means of continuous values (cosine_similarity.mean, abs_error.mean).
Performance and build gates do not depend on the rows.

Row order: a permutation of the validation rows seeded by `analysis.sequential.seed`; blocks of `block_rows`; no
gate is decided before `min_rows` rows (all rows when the set is smaller). Rows of any group arrive in a uniformly
random order too, so each group's sequence is valid on its own rows.

The scoring loop is here too: `score_sequentially` runs the variant over the permutation (several blocks per runner
call, `_score_chunk`; stored outputs first, `measurements.Measurements`), scores each block (`scoring._per_row`)
and updates the plans (`plan_gates`) until `should_stop`; `_replay` decides the exact-accumulation pass's plans on
the same blocks (numerics.py); `_early_gates` puts the plans' decisions in place of the gates evaluated on the rows
scored; with `stop: verdict` a gate that needs no timing and already failed skips the timing
(`_failed_before_timing`) and leaves the timed gates undecided (`_not_timed`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from tailguard.core.data import Dataset
from tailguard.core.results import GateStatus
from tailguard.core.runtime import Runner
from tailguard.core.sequential_stats import wor_confidence_sequence, wor_log_evidence
from tailguard.core.spec.gates import BATCHED_METRICS, BUILD_METRICS, PERF_METRICS, PROPORTION_METRICS, GateSpec
from tailguard.core.spec.root import Spec
from tailguard.core.stats import wilson_bound

from .gates import GateResult, evaluate_gates, gate_op, static_threshold
from .measurements import Measurements
from .scoring import _concat, _per_row, _run_first_output

METHOD = ("prior-posterior-ratio confidence sequence for the all-rows count, rows drawn without replacement in a "
          "seeded shuffled order (Waudby-Smith & Ramdas 2020)")


@dataclass
class Unit:
    """One population of rows whose count of 'bad' rows decides (part of) a gate.

    Attributes:
        slice, value: the group ("overall", "" for all rows).
        member: bool (rows,) over all validation rows.
        population: rows of the group (member.sum()).
        pass_max: the gate passes on this group exactly when its bad count C <= pass_max (on all rows).
        fail_min: ... and fails exactly when C >= fail_min (> pass_max + 1 when the count alone cannot say).
        seen / bad: rows of the group scored so far and the bad ones among them.
        decided: True (passes), False (fails) or None; decided_at: rows scored (all groups) when decided.
        value_of_bad: for 0/1 metrics, the gate's value (point or Wilson bound) as a function of the all-rows bad
            count, for the reported range of the all-rows value; None for quantiles.
    """

    slice: str
    value: str
    member: np.ndarray
    population: int
    pass_max: int
    fail_min: int
    seen: int = 0
    bad: int = 0
    decided: bool | None = None
    decided_at: int | None = None
    value_of_bad: Any = None

    def update(self, bad_rows: np.ndarray, rows: np.ndarray, scored: int, alpha: float, can_decide: bool) -> None:
        """Count the block's rows of this group (`rows`: global indices, `bad_rows`: bool of the same shape) and
        decide the group when the confidence sequence of its bad count allows (never before `can_decide`)."""
        m = self.member[rows]
        self.seen += int(m.sum())
        self.bad += int(np.count_nonzero(bad_rows[m]))
        if self.decided is not None or not can_decide or not m.any():
            return
        # one evaluation of the sequence for both sides (`wor_decide_at_least` on pass_max + 1 and fail_min)
        excluded = wor_log_evidence(self.bad, self.seen, self.population) >= math.log(1.0 / alpha)
        if excluded[self.pass_max + 1:].all():  # every total above pass_max is ruled out: passes on all rows
            self.decided = True
        elif excluded[:max(self.fail_min, 0)].all():  # every total under fail_min is ruled out: fails
            self.decided = False
        if self.decided is not None:
            self.decided_at = scored

    def record(self, alpha: float) -> dict[str, Any]:
        """Evidence of this group for a GateResult's detail: support, rows seen, bad rows seen, the confidence
        sequence's range of the all-rows bad count and (0/1 metrics) of the all-rows gate value, the decision."""
        lo, hi = wor_confidence_sequence(self.bad, self.seen, self.population, alpha)
        rec: dict[str, Any] = {"slice": self.slice, "value": self.value, "support": int(self.population),
                               "seen": int(self.seen), "bad_seen": int(self.bad), "bad_all_rows_range": [lo, hi],
                               "decided": self.decided, "decided_at": self.decided_at}
        if self.value_of_bad is not None:
            a, b = self.value_of_bad(lo), self.value_of_bad(hi)
            rec["all_rows_range"] = [min(a, b), max(a, b)]
            if self.seen:
                rec["estimate"] = (self.seen - self.bad) / self.seen if self.value_of_bad(0) >= \
                    self.value_of_bad(self.population) else self.bad / self.seen
        return rec


@dataclass
class GatePlan:
    """How one gate is decided while rows are scored.

    Attributes:
        index: the gate's position in `spec.gates`.
        gate: the GateSpec.
        mode: "sequential" (units decide it), "all_rows" (only every row can), "fixed" (known before any row:
            `status` is set), "rows_free" (performance / build gates: no row decides them).
        units: the populations judged (mode "sequential").
        alpha: the per-unit level (analysis.sequential.alpha / len(units)).
        pass_only: discovered gates: never decided failed early.
        status: "passed" / "failed" / "insufficient_data" once decided, else None.
        decided_at: rows scored when decided.
        reason: why the gate needs all rows, or why it is fixed.
        key: the per-row key its units count (e.g. "nn_top1_agree").
        bad_of: callable per-row values -> bool "bad" rows (the units' count).
    """

    index: int
    gate: GateSpec
    mode: str
    units: list[Unit] = field(default_factory=list)
    alpha: float = 0.0
    pass_only: bool = False
    status: str | None = None
    decided_at: int | None = None
    reason: str = ""
    key: str | None = None
    bad_of: Any = None

    def update(self, per_row: dict[str, np.ndarray], rows: np.ndarray, scored: int, can_decide: bool) -> None:
        """Fold one scored block into the units and decide the gate when its units allow."""
        if self.mode != "sequential" or self.status is not None:
            return
        if self.key not in per_row:  # e.g. accuracy without labels: it fails on all rows too, with the reason
            self.mode, self.status, self.decided_at = "fixed", GateStatus.FAILED, scored
            self.reason = f"per-row values {self.key!r} are not computed (on all rows the gate fails the same way)"
            return
        bad = np.asarray(self.bad_of(np.asarray(per_row[self.key])), dtype=bool)
        for u in self.units:
            u.update(bad, rows, scored, self.alpha, can_decide)
        if any(u.decided is False for u in self.units) and not self.pass_only:
            self.status, self.decided_at = GateStatus.FAILED, scored
        elif all(u.decided is True for u in self.units):
            self.status, self.decided_at = GateStatus.PASSED, scored


def _threshold_count(n: int, op: str, threshold: float, value_of_bad: Any) -> int:
    """The largest bad count C in 0..n whose gate value value_of_bad(C) still passes (`op` threshold); -1 when
    even C = 0 fails. The value is monotone in C (worse with more bad rows), so the passing counts are 0..C."""
    values = np.asarray(value_of_bad(np.arange(n + 1)), dtype=np.float64)
    ok = (values >= threshold if op == ">=" else values <= threshold) & ~np.isnan(values)
    failing = np.nonzero(~ok)[0]
    return n if failing.size == 0 else int(failing[0]) - 1


def _percentile_counts(n: int, how: str, op: str) -> tuple[int, int]:
    """(pass_max, fail_min) of the count B of rows on the bad side of a threshold, for the statistic `how`
    ("max", "min", "p<q>") of n values with np.percentile's linear interpolation (module docstring)."""
    q = 100.0 if how == "max" else 0.0 if how == "min" else float(how[1:])
    pos = q / 100.0 * (n - 1)
    lo, hi = int(math.floor(pos)), int(math.ceil(pos))
    if op == ">=":  # bad rows: value < threshold, sorted ascending they come first
        return lo, hi + 1
    return n - 1 - hi, n - lo  # "<=": bad rows (value > threshold) are the top of the sorted values


def _proportion_unit(sl: str, val: str, mask: np.ndarray, n: int, op: str, threshold: float,
                     confidence: float | None) -> Unit:
    """A unit of a gate on a 0/1 metric. Bad rows: 0s of a higher-is-better metric (">=" gates), 1s of a
    lower-is-better one. The all-rows value of C bad rows: the share of good rows (ones for "<="), or its Wilson
    bound on the bad side at `confidence` (what `evaluate_gates` compares on all rows)."""
    higher = op == ">="

    def value_of_bad(c: Any) -> Any:
        """The all-rows gate value of c bad rows (int or int array), NaN for an empty group."""
        if n == 0:
            return np.full(np.shape(c), math.nan) if np.ndim(c) else math.nan
        ones = n - np.asarray(c) if higher else np.asarray(c)
        if confidence is None:
            out = ones / n
        else:
            out = wilson_bound(ones, n, confidence, "lower" if higher else "upper")
        return float(out) if np.ndim(out) == 0 else np.asarray(out, dtype=np.float64)

    pass_max = _threshold_count(n, op, threshold, value_of_bad)
    return Unit(sl, val, mask, n, pass_max, pass_max + 1, value_of_bad=value_of_bad)


def plan_gates(spec: Spec, variant_name: str, frame: Any, groups: Sequence[Any], *,
               discovery_slices: Sequence[tuple[str, str, np.ndarray]] | None = None) -> list[GatePlan]:
    """How each gate of `spec` is decided while rows are scored (module docstring).

    Args:
        spec: the validated spec (gates, analysis.sequential / discovery).
        variant_name: matched against each gate's `variants` (not_applicable gates are "rows_free").
        frame: the validation metadata (all rows).
        groups: `slices.slice_groups` over all rows (masks of shape (rows,)).
        discovery_slices: `discovery.tested_slices` over all rows (None: computed here when a discovered
            gate needs them).

    Returns:
        One GatePlan per gate, in spec order.
    """
    from tailguard.core.parity import row_source

    rows = len(frame)
    alpha = spec.analysis.sequential.alpha
    plans: list[GatePlan] = []
    for i, gate in enumerate(spec.gates):
        plan = GatePlan(index=i, gate=gate, mode="rows_free")
        plans.append(plan)
        if gate.variants is not None and variant_name not in gate.variants:
            continue
        if gate.metric in PERF_METRICS or gate.metric in BUILD_METRICS:
            continue
        op, thr = gate_op(gate), static_threshold(gate)
        key, how = row_source(gate.metric)
        plan.key = key
        proportion = gate.metric in PROPORTION_METRICS
        if thr is None:
            plan.mode, plan.reason = "all_rows", "its threshold is the reference's own score on the same rows"
            continue
        if gate.confidence is not None and not proportion:
            plan.mode, plan.reason = "all_rows", "a bootstrap bound is not a function of a count"
            continue
        if not proportion and how == "mean":
            plan.mode, plan.reason = "all_rows", "a mean of continuous values is not a function of a count"
            continue
        if gate.scope == "discovered":
            disc = spec.analysis.discovery
            if not disc.enabled:
                plan.mode, plan.status, plan.reason = "fixed", GateStatus.FAILED, "discovery did not run"
                continue
            if gate.min_support > disc.min_support:
                plan.mode, plan.reason = "all_rows", ("its min_support exceeds discovery's: a significant slice "
                                                      "may be insufficient on all rows")
                continue
            if discovery_slices is None:
                from .discovery import tested_slices

                label = spec.data.validation.label_column
                discovery_slices = tested_slices(frame, disc,
                                                        exclude_columns=[label] if label is not None else [])
            targets = [(s, v, np.asarray(m, dtype=bool)) for s, v, m in discovery_slices]
            plan.pass_only = True
            if not targets:  # nothing to test: discovery finds no slice on all rows either, the gate passes
                plan.mode, plan.status, plan.reason = "fixed", GateStatus.PASSED, "discovery tests no slice"
                continue
        elif gate.scope == "per_slice":
            targets = [(str(g.slice), str(g.value), np.asarray(g.mask, dtype=bool)) for g in groups
                       if gate.slice is None or str(g.slice) == gate.slice]
            judged = [t for t in targets if int(t[2].sum()) >= gate.min_support]
            if not judged:
                plan.mode, plan.status = "fixed", GateStatus.INSUFFICIENT_DATA
                plan.reason = f"no group has >= {gate.min_support} rows"
                continue
            targets = judged
        else:
            targets = [("overall", "", np.ones(rows, dtype=bool))]
        plan.mode, plan.alpha = "sequential", alpha / len(targets)
        higher = op == ">="
        for sl, val, mask in targets:
            n = int(mask.sum())
            if proportion:
                plan.units.append(_proportion_unit(sl, val, mask, n, op, float(thr), gate.confidence))
            else:
                pass_max, fail_min = _percentile_counts(n, how, op)
                plan.units.append(Unit(sl, val, mask, n, pass_max, fail_min))
        if proportion:
            plan.bad_of = (lambda v: ~np.asarray(v, dtype=bool)) if higher else (lambda v: np.asarray(v, dtype=bool))
        else:
            t = float(thr)
            plan.bad_of = (lambda v, t=t: np.asarray(v, dtype=np.float64) < t) if higher else \
                (lambda v, t=t: np.asarray(v, dtype=np.float64) > t)
    return plans


def should_stop(plans: Sequence[GatePlan], stop: str) -> bool:
    """Whether scoring can stop: every row-dependent gate decided, or (`stop` "verdict") one decided failed."""
    open_ = [p for p in plans if p.mode in ("sequential", "all_rows") and p.status is None]
    if stop == "verdict" and any(p.status in (GateStatus.FAILED, GateStatus.INSUFFICIENT_DATA) for p in plans):
        return True
    return not open_


def describe(plans: Sequence[GatePlan], rows_used: int, rows: int, spec: Spec) -> dict[str, Any]:
    """The `sequential` record of a ValidationResult: settings, rows used and each gate's decision."""
    seq = spec.analysis.sequential
    gates = []
    for p in plans:
        rec: dict[str, Any] = {"gate": p.gate.key, "mode": p.mode, "status": p.status, "decided_at": p.decided_at}
        if p.reason:
            rec["reason"] = p.reason
        if p.mode == "sequential":
            rec.update(units=len(p.units), alpha_per_unit=p.alpha)
        gates.append(rec)
    return {"enabled": True, "rows": int(rows), "rows_used": int(rows_used), "block_rows": seq.block_rows,
            "min_rows": seq.min_rows, "alpha": seq.alpha, "seed": seq.seed, "stop": seq.stop,
            "stopped_early": rows_used < rows, "method": METHOD, "gates": gates}


def early_result(plan: GatePlan, base: Any, rows_used: int, rows: int, spec: Spec) -> Any:
    """The GateResult of a parity gate when scoring stopped before the last row (rows_used < rows).

    A decided gate keeps its decision, `decided_on` "sequential", `observed` the edge of the all-rows value the
    confidence sequence allows on the decided side (the worst group's, for 0/1 metrics; the estimate on the rows
    scored for quantiles), detail {"sequential": ..., "failing" / "judged" per group}; a gate still open is
    GateStatus.UNDECIDED (the variant stopped because another gate failed it).

    Args:
        plan: the gate's plan.
        base: the GateResult `evaluate_gates` gave on the rows scored (its key, metric, threshold, op, ...).
        rows_used, rows: rows scored and all rows.
        spec: the spec (analysis.sequential).
    """
    words = (f"decided after {rows_used} of {rows} rows on the {METHOD}; the chance that it differs from the "
             f"decision on all rows is at most {spec.analysis.sequential.alpha:g}")
    seq = {"rows_used": int(rows_used), "rows": int(rows), "decided_at": plan.decided_at,
           "alpha": spec.analysis.sequential.alpha, "units": len(plan.units)}
    if plan.mode == "fixed" or plan.mode == "rows_free":
        return base
    if plan.status is None:
        why = plan.reason or "its groups were not all decided"
        return dataclasses.replace(
            base, status=GateStatus.UNDECIDED, passed=None, observed=None, decided_on="sequential",
            method=f"not decided: scoring stopped after {rows_used} of {rows} rows because another gate failed the "
                   f"variant ({why})",
            detail={"sequential": seq, "reason": "another gate failed the variant first"})
    passed = plan.status == GateStatus.PASSED
    records = [u.record(plan.alpha) for u in plan.units]
    failing = [r for r in records if r["decided"] is False]
    observed, bound = base.observed, None
    if records and all("all_rows_range" in r for r in records):
        # passed: the worst all-rows value the sequence allows over every group; failed: the best value it allows
        # for the failing groups (still on the failing side)
        higher = base.op == ">="
        if passed:
            ends = [r["all_rows_range"][0 if higher else 1] for r in records]
            observed = bound = min(ends) if higher else max(ends)
        else:
            ends = [r["all_rows_range"][1 if higher else 0] for r in failing]
            observed = bound = min(ends) if higher else max(ends)
    judged = {"judged": len(records), "failing": failing[:50]} if plan.gate.scope != "overall" else {}
    return dataclasses.replace(base, status=plan.status, passed=passed, observed=observed, bound=bound,
                               decided_on="sequential", method=f"{base.method}; {words}",
                               detail={"sequential": seq, **judged,
                                       **({"insufficient": base.detail.get("insufficient", [])}
                                          if plan.gate.scope == "per_slice" else {})})


@dataclass
class SequentialScoring:
    """What `score_sequentially` scored: the rows in scoring order, their outputs, the blocks and the gate plans."""

    order: np.ndarray            # int64 (rows_used,), global row indices in the order scored
    outputs: np.ndarray          # the variant's first output for `order`, (rows_used, ...)
    blocks: list[np.ndarray]     # the blocks of `order`
    plans: list[Any]             # sequential.GatePlan per gate

    @property
    def rows_used(self) -> int:
        return int(self.order.size)


CHUNK_ROWS = 400  # rows the runner is asked for at once past min_rows (`_score_chunk`)


def _score_chunk(runner: Runner, validation: Dataset, spec: Spec, variant_name: str, perm: np.ndarray,
                 scored: int, blocks_so_far: int, floor: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The next blocks of `perm` from row `scored` on, scored in ONE length-sorted `run_dataset` call and split
    back into blocks of `analysis.sequential.block_rows`: enough blocks to reach `floor` (min_rows) first, then as
    many as were scored so far, up to CHUNK_ROWS (400) rows. Why: a 100-row block sorted by length pads its
    batches more than a longer run does. MiniLM, the demo's 2,500 validation rows at batch 32 on its ORT FP32
    variant (one-off timing of run_dataset, min of 2, 2-core Intel Xeon, load ~2): 5.15 s in runs of 100 rows,
    4.19 s of 200, 3.88 s of 400, 3.77 s of 800, 3.4 s at once. The looks are unchanged (after every block, in
    the same order); at most the rest of one chunk (< 400 rows) is scored past the stopping look and not used.
    A model whose row outputs depend on their batch mates (dynamic INT8: one activation scale per batch tensor)
    gives slightly different outputs than block by block, so its stopping look can move (the demo's
    ort-int8-dynamic: 1,000 rows instead of 800, the same failure).

    Returns:
        [(block rows (global indices, int64), the variant's first output for them (block, ...))] in scoring order.
    """
    size = spec.analysis.sequential.block_rows
    n_blocks = max(-(-(floor - scored) // size), min(blocks_so_far, max(1, CHUNK_ROWS // size)), 1)
    rows = perm[scored:scored + n_blocks * size]
    out = _run_first_output(runner, validation.subset(rows), spec, variant_name)
    return [(rows[i:i + size], out[i:i + size]) for i in range(0, rows.size, size)]


def score_sequentially(spec: Spec, variant_name: str, runner: Runner, ref: np.ndarray, validation: Dataset,
                       labels: np.ndarray | None, groups: list, *,
                       discovery_slices: list | None = None,
                       measurements: Measurements | None = None) -> SequentialScoring:
    """Score the validation rows in a seeded shuffled order, `analysis.sequential.block_rows` at a time, until the
    gates are decided (`sequential.should_stop`; never before `min_rows` rows) or the rows run out. The runner is
    asked for several blocks at once (`_score_chunk`: the first chunk reaches `min_rows`, then up to CHUNK_ROWS rows);
    the gates still look after every block (the block-by-block looks; `_score_chunk` on models whose outputs
    depend on the batch).

    Args:
        spec: the validated spec (analysis.sequential, gates, data.validation.batch_size).
        variant_name: the variant (gate `variants`).
        runner: the variant's runner.
        ref: the FP32 reference's first output over every row, (rows, ...).
        validation: the validation set.
        labels: per-row labels (classification / embedding accuracy) or None.
        groups: `slice_groups` over every row.
        discovery_slices: `discovery.tested_slices` over every row (None: computed when needed).
        measurements: stored outputs of earlier scored blocks (`Measurements`): they are used block by block
            before the runner is asked for more; blocks scored beyond them are added to it (`changed`).

    Returns:
        SequentialScoring (rows in scoring order, their outputs, blocks, decided plans).
    """
    seq = spec.analysis.sequential
    n = validation.n_rows
    perm = np.random.default_rng(seq.seed).permutation(n).astype(np.int64)
    plans = plan_gates(spec, variant_name, validation.frame, groups, discovery_slices=discovery_slices)
    floor = min(seq.min_rows, n)
    stored_blocks, stored_outs = [], []
    m = measurements
    if m is not None and m.order is not None and m.outputs is not None and \
            np.array_equal(m.order, perm[:m.order.size]):
        stored_blocks = m.blocks()
        stored_outs = list(np.split(m.outputs, np.cumsum(m.block_sizes)[:-1])) if m.block_sizes else []
    blocks: list[np.ndarray] = []
    outs: list[np.ndarray] = []
    ahead: list[tuple[np.ndarray, np.ndarray]] = []  # blocks scored in the current chunk, not yet looked at
    scored = 0
    while scored < n:
        k = len(blocks)
        if k < len(stored_blocks):
            block, out = stored_blocks[k], stored_outs[k]
        else:
            if not ahead:
                ahead = _score_chunk(runner, validation, spec, variant_name, perm, scored, k, floor)
            block, out = ahead.pop(0)
        per_row = _per_row(spec, ref, out, labels, block)
        blocks.append(block)
        outs.append(out)
        scored += block.size
        for p in plans:
            p.update(per_row, block, scored, scored >= floor)
        if scored >= floor and should_stop(plans, seq.stop):
            break
    result = SequentialScoring(perm[:scored], _concat(spec, outs), blocks, plans)
    if m is not None and len(blocks) > len(stored_blocks):  # scored past the stored rows: they grow
        m.order, m.outputs = result.order, result.outputs
        m.block_sizes = [int(b.size) for b in blocks]
        m.changed = True
    return result


def _replay(spec: Spec, variant_name: str, validation: Dataset, labels: np.ndarray | None, groups_all: list,
            ref: np.ndarray, blocks: list[np.ndarray], outputs: np.ndarray) -> list[Any]:
    """The gate plans decided on `outputs` (rows of `blocks`, concatenated) block by block, as
    `score_sequentially` decides them (the exact-accumulation pass of the numerics check)."""
    plans = plan_gates(spec, variant_name, validation.frame, groups_all)
    floor = min(spec.analysis.sequential.min_rows, validation.n_rows)
    scored = 0
    for block in blocks:
        per_row = _per_row(spec, ref, outputs[scored:scored + block.size], labels, block)
        scored += block.size
        for p in plans:
            p.update(per_row, block, scored, scored >= floor)
    return plans


def _early_gates(plans: list[Any], gates: list[GateResult], rows_used: int, n_rows: int,
                 spec: Spec) -> list[GateResult]:
    """The gate results of a validation that stopped before the last row: each parity gate's sequential decision
    (`sequential.early_result`) in place of its evaluation on the rows scored."""
    return [early_result(p, g, rows_used, n_rows, spec) for p, g in zip(plans, gates)]


def _failed_before_timing(spec: Spec, variant_name: str, overall: dict[str, Any], table: Any,
                          per_sample: dict[str, np.ndarray], groups: list[Any], discovery: Any, scoring: Any,
                          idx: np.ndarray | None, n_rows: int) -> str | None:
    """With `analysis.sequential.stop: verdict` (the default), the key of a gate that is not timed (a parity,
    build or per-node gate) and already failed on the rows scored, whose failure decides the verdict before any
    timing: the benchmark is then skipped (issue 25: a variant that fails clearly stops early; its search starts
    early). None when timing is needed (every such gate passed or is undecided, `stop: all_gates`, sequential
    validation off)."""
    seq = spec.analysis.sequential
    if not seq.enabled or seq.stop != "verdict":
        return None
    pre = evaluate_gates(spec, variant_name, overall, table, {}, per_sample=per_sample, groups=groups,
                         discovered=discovery)
    if idx is not None and scoring is not None:
        pre = _early_gates(scoring.plans, pre, scoring.rows_used, n_rows, spec)
    for g in pre:
        if g.metric not in BATCHED_METRICS and g.status == GateStatus.FAILED:
            return g.gate
    return None


def _not_timed(gates: list[GateResult], failed: str) -> list[GateResult]:
    """The timed gates of a variant whose verdict a parity gate decided first (`_failed_before_timing`):
    undecided, with the reason, as sequential validation reports the gates it did not need."""
    why = f"not timed: the verdict was already failed by {failed} (analysis.sequential.stop: verdict)"
    return [dataclasses.replace(g, status=GateStatus.UNDECIDED, passed=None, observed=None, method=why,
                                detail={**(g.detail or {}), "reason": why})
            if g.metric in BATCHED_METRICS else g for g in gates]
