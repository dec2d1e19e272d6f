"""Timing a variant: latency, throughput, cost and speed ratios at every benchmark batch size.

`time_variant` is the validate step's timing: interleaved with the baselines in rounds when their runners are given
(`latency.interleaved_benchmark`, replayed on stored rounds where the stopping rule can be decided on them,
`_timed`), else `latency.benchmark` alone; with `benchmark.precision` each batch size stops by `timing_rule`. It
adds `usd_per_1m_inferences` (with a `cost` section) and the speed ratios against baselines timed elsewhere.
"""

from __future__ import annotations

from typing import Any

from tailguard.core.data import Dataset
from tailguard.core.errors import InputError
from tailguard.core.latency import add_speed_ratios, benchmark, cost_per_1m, interleaved_benchmark
from tailguard.core.runtime import Runner
from tailguard.core.spec.root import Spec

from .measurements import Measurements


def _perf_row(perf: dict | None, bs: int) -> dict | None:
    if not perf:
        return None
    return perf.get(bs) or perf.get(str(bs))


def timing_rule(spec: Spec, variant_name: str, *, baseline: str | None, target: str,
                p50_decides: bool | None = None) -> Any:
    """The stopping rule of a variant's timing measured to `benchmark.precision` (None when it is not set: the
    full budget, as before). At a look, timing a batch size stops when

    - the speed ratio target vs `baseline` is within the precision (`latency.precision_reached`), or
    - every decision this batch size's timing makes is decided: each latency gate at the batch size (applicable to
      the variant) has its bound, at `look_confidence(level, looks)`, on one side of its threshold: a speed-ratio
      gate (`speedup_vs_<baseline>`, interleaved) on the paired-bootstrap bound at its `confidence` (95% for a
      gate without one: the point ratio then lies on the same side), a `latency_ms.p<q>` gate on the order-statistic
      bound of that quantile (`sequential_stats.order_statistic_bound`). Gates no interval of the rounds decides
      (throughput, cost, latency_ms.mean, speedup_vs_torch: its baseline is timed in reference-pass) and, with
      `p50_decides`, the p50 at the promotion batch size (it picks a search's trial, or the variant to promote with
      `promotion.margin: null`) are decided only by the precision or the budget. No interval of fewer than
      `latency.DECISION_MIN_ROUNDS` (30) rounds decides anything. A batch size that decides nothing stops at its
      first look: its figures carry their (wide) corrected bounds and the rounds used.

    Args:
        spec: the spec (benchmark.precision, gates, promotion, analysis.bootstrap).
        variant_name: gates' `variants`.
        baseline: the interleaved baseline the precision is about ("onnx_fp32"), or None (the target's p50).
        target: the variant's runner name in the timing ("variant", or "runner" for `latency.benchmark`).
        p50_decides: the p50 at the promotion batch size decides something (default: `promotion.margin` is None,
            the promotion then picks the lowest validation p50; the search passes True: it picks its trial so).
    """
    from tailguard.core.latency import DECISION_MIN_ROUNDS, precision_reached, speed_ratio
    from tailguard.core.sequential_stats import look_confidence, order_statistic_bound
    from tailguard.core.spec.gates import BATCHED_METRICS

    precision = spec.benchmark.precision
    if precision is None:
        return None
    if p50_decides is None:
        p50_decides = spec.promotion.margin is None
    boot = spec.analysis.bootstrap
    promotion_bs = spec.promotion.batch_size or spec.benchmark.batch_sizes[0]
    gates = [g for g in spec.gates if g.metric in BATCHED_METRICS
             and (g.variants is None or variant_name in g.variants)]

    def gate_decided(g: Any, samples: Any, n_looks: int) -> bool:
        thr = g.min if g.min is not None else g.max
        if thr is None:
            return False
        level = look_confidence(g.confidence or 0.95, n_looks)
        if g.metric.startswith("speedup_vs_"):
            name = g.metric.removeprefix("speedup_vs_")
            if name not in samples:
                return False
            try:
                r = speed_ratio(samples[name], samples[target], level, samples=boot.samples, seed=boot.seed)
            except InputError:
                return False
            lo, hi = r["lower"], r["upper"]
        elif g.metric.startswith("latency_ms.p") and g.metric[len("latency_ms.p"):].replace(".", "", 1).isdigit():
            q = float(g.metric[len("latency_ms.p"):]) / 100.0
            if not 0.0 < q < 1.0:
                return False
            lo = order_statistic_bound(samples[target], q, level, "lower")
            hi = order_statistic_bound(samples[target], q, level, "upper")
        else:
            return False
        return (lo >= thr or hi < thr) if g.min is not None else (hi <= thr or lo > thr)

    def decide(bs: int, samples: Any, look: int, n_looks: int) -> bool:
        if precision_reached(samples, precision, look, n_looks, baseline=baseline, target=target,
                             boot_samples=boot.samples, seed=boot.seed):
            return True
        if p50_decides and bs == promotion_bs:
            return False
        mine = [g for g in gates if spec.gate_batch_size(g) == bs]
        if mine and len(samples[target]) < DECISION_MIN_ROUNDS:  # no decision on a handful of rounds
            return False
        return all(gate_decided(g, samples, n_looks) for g in mine)

    return decide


def _timed(spec: Spec, runners: dict[str, Runner], validation: Dataset, decide: Any,
           measurements: Measurements | None) -> dict[str, dict[int, dict[str, Any]]]:
    """`interleaved_benchmark` of `runners` at every benchmark batch size, replaying the stored rounds where the
    stopping rule can be decided on them (`latency.replay_interleaved`) and timing only the other batch sizes;
    what is timed is stored in `measurements`."""
    from tailguard.core.latency import replay_interleaved

    names = list(runners)
    out: dict[str, dict[int, dict[str, Any]]] = {n: {} for n in names}
    stored = measurements.timing if measurements is not None and measurements.timing else {}
    missing = []
    for bs in spec.benchmark.batch_sizes:
        rows = None
        if all(bs in (stored.get(n) or {}) for n in names):
            rows = replay_interleaved({n: stored[n][bs] for n in names}, bs, spec.benchmark, decide)
        if rows is None:
            missing.append(bs)
        else:
            for n in names:
                out[n][bs] = rows[n]
    if missing:
        bench = spec.benchmark.model_copy(update={"batch_sizes": missing})
        fresh = interleaved_benchmark(runners, validation, spec.model.inputs, bench,
                                      pad_values=spec.model.pad_values, decide=decide)
        for n in names:
            out[n].update(fresh[n])
        if measurements is not None:
            timing = {n: dict(stored.get(n) or {}) for n in names}
            for n in names:
                for bs, row in fresh[n].items():
                    timing[n][bs] = {k: v for k, v in row.items()}
            measurements.timing, measurements.changed = timing, True
    # the rows are handed on and decorated (speed ratios, cost): copies, never the stored ones
    return {n: {bs: dict(r) for bs, r in rows.items()} for n, rows in out.items()}


def time_variant(spec: Spec, variant_name: str, runner: Runner, validation: Dataset, *, failed_first: str | None,
                 baseline_runners: dict[str, Runner] | None, reference_perf: dict | None, torch_perf: dict | None,
                 measurements: Measurements | None,
                 p50_decides: bool | None) -> tuple[dict[int, dict[str, Any]], dict | None]:
    """The validate step's timing of a variant at every `benchmark.batch_sizes` entry.

    Reads: `benchmark`, `cost`, `gates` and `promotion` (the stopping rule, `timing_rule`), `analysis.bootstrap`
    (speed-ratio bounds), `model.inputs` / `pad_values`; the stored timing rounds in `measurements` (`_timed`).

    Args:
        spec: the validated spec.
        variant_name: the variant (gates' `variants`).
        runner: the variant's runner.
        validation: the validation set (batches are drawn from its rows).
        failed_first: the key of a gate that already failed the variant before timing
            (`sequential._failed_before_timing`): nothing is timed (perf {}).
        baseline_runners: baselines timed interleaved with the variant ({"onnx_fp32": ..., "torch": ...}), or
            None: the variant alone (`latency.benchmark`).
        reference_perf: the ONNX FP32 reference's `benchmark` output from the reference pass ({batch size: row},
            int or str keys), or None.
        torch_perf: the torch reference's `benchmark` output, or None.
        measurements: stored timing rounds (`Measurements.timing`), grown with what is timed anew; or None.
        p50_decides: see `timing_rule`.

    Returns:
        (perf: {batch size: the benchmark row + "usd_per_1m_inferences" (USD, with a cost section) and
        "speedup_vs_torch" / "speedup_vs_onnx_fp32" (baseline p50 / variant p50, or the interleaved ratio of
        medians with .lb95/.ub95)}, the reference perf the report plots: the interleaved onnx_fp32 timing when it
        was timed here, else `reference_perf`).
    """
    interleaved: dict[str, Any] = {}
    if failed_first is not None:  # stop: verdict, and a parity gate failed: no timing can change the verdict
        perf = {}
    elif baseline_runners:
        base_name = "onnx_fp32" if "onnx_fp32" in baseline_runners else next(iter(baseline_runners))
        timed = _timed(spec, {"variant": runner, **baseline_runners}, validation,
                       timing_rule(spec, variant_name, baseline=base_name, target="variant",
                                   p50_decides=p50_decides), measurements)
        perf = timed.pop("variant")
        interleaved = timed
        add_speed_ratios(perf, interleaved, samples=spec.analysis.bootstrap.samples,
                         seed=spec.analysis.bootstrap.seed)
        if "onnx_fp32" in interleaved:
            reference_perf = interleaved["onnx_fp32"]
    else:
        perf = benchmark(runner, validation, spec.model.inputs, spec.benchmark, pad_values=spec.model.pad_values,
                         decide=timing_rule(spec, variant_name, baseline=None, target="runner",
                                            p50_decides=p50_decides))
    for bs, row in perf.items():
        if spec.cost is not None:
            row["usd_per_1m_inferences"] = cost_per_1m(spec.cost.usd_per_hour, row["throughput_per_s"])
        for key, base in (("speedup_vs_torch", torch_perf), ("speedup_vs_onnx_fp32", reference_perf)):
            if key.removeprefix("speedup_vs_") in interleaved:
                continue  # already the interleaved ratio of medians (add_speed_ratios)
            b = _perf_row(base, bs)
            if b and b.get("latency_ms.p50") and row["latency_ms.p50"] > 0:
                row[key] = float(b["latency_ms.p50"]) / row["latency_ms.p50"]
    return perf, reference_perf
