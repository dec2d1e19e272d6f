"""The computation of the reference pass: FP32 reference outputs (checked finite), FP32 latency baselines, and
the calibration coverage figures. No file or MLflow I/O (task.py does that)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

if TYPE_CHECKING:
    from tailguard.core.data import Dataset
    from tailguard.core.spec.root import Spec

# Torch baseline method (issue 26, item 1). Alternating a default ONNX Runtime session and torch eager in one process
# made torch wait on ORT's intra-op workers, which spin on the cores for a while after each ORT Run: measured 2.9x
# torch's solo time for a 4-layer width-256 encoder on a 2-core node (5.9 vs 2.1 ms), 513 vs 28 ms for MiniLM. Issue
# 26 set `session.force_spinning_stop`; since issue 37 the session is built as every timed ORT session is, with
# spinning off (`tailguard.core.runtime.timed_ort_runner`; force_spinning_stop made ORT-vs-ORT ratios 2x noisier
# and disagree with the validate step's, the measurements are beside that function), so the ONNX FP32 baseline
# here is timed exactly as the validate step and the promotion's paired rounds time it. Rounds stay interleaved
# per run (same batch, order alternating), so a change of the node's load still hits both alike.
TORCH_SEGMENTS = 5        # the timed rounds are split into this many consecutive segments for the stability check
TORCH_SPREAD_MAX = 1.5    # warn when the slowest segment's torch p50 is more than 1.5x the fastest's
TORCH_STABILITY_MIN_ROUNDS = 30  # judged from 30 rounds (6 per segment): a median of 2 rounds is not a p50, and a
                                 # batch size stopped at its first look (10 rounds) would be flagged on noise


def reference_outputs(truth: Any, ds: Dataset, spec: Spec) -> list[np.ndarray]:
    """The FP32 reference's outputs over the validation set.

    Args:
        truth: the reference runner (`tailguard.core.runtime.Runner`: torch eager, or ONNX Runtime for an ONNX
            reference).
        ds: the validation Dataset (rows in file order).
        spec: the validated spec (model.inputs / outputs / pad_values, data.validation.batch_size).

    Returns:
        One array per `model.outputs` entry, (rows, ...), the model's dtype, original row order; for model.task
        token_classification only the first, as its per-position top-1 ids, int32 (rows, time)
        (`tailguard.core.tokens.run_token_ids`: one batch's scores held at a time).

    Raises:
        StepError: an output holds NaN/Inf (the message counts the rows; exit 1).
    """
    from tailguard.core.errors import StepError
    from tailguard.core.runtime import run_dataset

    if spec.model.task == "token_classification":  # only the compared output, as per-position ids (rows, time)
        from tailguard.core.tokens import NON_FINITE, decode_settings, run_token_ids

        ids = run_token_ids(truth, ds, spec.model.inputs, batch_size=spec.data.validation.batch_size,
                            pad_values=spec.model.pad_values, mask_input=decode_settings(spec.model)["mask_input"])
        bad = int((ids == NON_FINITE).any(axis=1).sum())
        if bad:
            raise StepError(f"the FP32 reference output {spec.model.outputs[0].name!r} has NaN/Inf in {bad} "
                            "validation rows", step="reference-pass",
                            hint="check the validation inputs (data.validation.uri) and the reference model")
        return [ids]
    outputs = run_dataset(truth, ds, spec.model.inputs, batch_size=spec.data.validation.batch_size,
                          pad_values=spec.model.pad_values)
    for spec_out, arr in zip(spec.model.outputs, outputs):
        if np.issubdtype(arr.dtype, np.floating) and not np.isfinite(arr).all():
            bad = int((~np.isfinite(arr.reshape(len(arr), -1))).any(axis=1).sum())
            raise StepError(f"the FP32 reference output {spec_out.name!r} has NaN/Inf in {bad} validation rows",
                            step="reference-pass",
                            hint="check the validation inputs (data.validation.uri) and the reference model")
    return outputs


def output_kind_warnings(spec: Spec, reference: np.ndarray) -> list[str]:
    """A classification model whose compared output is declared (or left) as logits while every FP32 reference
    row is a probability distribution (in [0, 1], summing to 1: `parity.looks_like_probabilities`): KL divergence
    and margins would be computed on a softmax of probabilities, understating them (issue 38: KL mean 0.0020
    reported where 0.018 was true). One warning naming the fix, else none."""
    from tailguard.core.parity import looks_like_probabilities

    out = spec.model.outputs[0]
    if spec.model.task != "classification" or out.kind == "probabilities" or not looks_like_probabilities(reference):
        return []
    return [f"model.outputs[0] ({out.name}): every FP32 reference row is in [0, 1] and sums to 1, so the output "
            "holds probabilities, yet it is scored as logits (KL divergence on their softmax is too small); "
            "declare `kind: probabilities` on it"]


def onnx_baseline_runner(onnx_path: str | Path, threads: int) -> Any:
    """The ONNX Runtime session the reference pass times as the `onnx_fp32` baseline (CPU execution provider,
    `threads` intra-op threads, 0 = all cores), built as every timed ORT session is
    (`tailguard.core.runtime.timed_ort_runner`, spinning off; why: the module comment above TORCH_SEGMENTS).

    Args:
        onnx_path: the exported FP32 model.onnx.
        threads: spec `benchmark.intra_op_num_threads`.

    Raises:
        InputError: the file is missing or not loadable (names the file).
    """
    from tailguard.core.runtime import timed_ort_runner

    return timed_ort_runner(onnx_path, intra_op_num_threads=threads)


def torch_stability(samples_ms: Sequence[float], segments: int = TORCH_SEGMENTS,
                    max_spread: float = TORCH_SPREAD_MAX) -> dict[str, Any]:
    """Whether torch's p50 holds across the timed rounds of one reference pass.

    Method: the rounds, in time order, are split into `segments` consecutive segments of near-equal size
    (numpy.array_split); each segment's median (np.median) is its p50; spread = largest / smallest segment p50.
    Stable when spread <= `max_spread` (TORCH_SPREAD_MAX = 1.5: a baseline that moves by more than 1.5x within one
    pass moves `speedup_vs_torch` by as much, enough to carry a variant across a typical `min: 2` gate either way).
    Judged only from TORCH_STABILITY_MIN_ROUNDS (30) rounds on (at least 2 per segment).

    Args:
        samples_ms: torch's time per round, ms, shape (rounds,), time order (`samples_ms` of the benchmark row).
        segments: number of segments (at least 2).
        max_spread: the largest spread still called stable (a factor >= 1).

    Returns:
        {"segment_p50_ms": list[float] (segments,), "spread": float | None, "max_spread": float,
         "stable": bool | None, "method": str}; spread and stable are None below TORCH_STABILITY_MIN_ROUNDS rounds
        or 2 rounds per segment (no verdict).

    Raises:
        ValueError: segments < 2 or max_spread < 1.
    """
    if segments < 2 or not max_spread >= 1.0:
        raise ValueError(f"torch_stability: need segments >= 2 and max_spread >= 1, got {segments}, {max_spread}")
    ms = np.asarray(samples_ms, dtype=np.float64).reshape(-1)
    method = (f"rounds split into {segments} consecutive segments (numpy.array_split), p50 = np.median per "
              f"segment, spread = max / min segment p50, stable when <= {max_spread:g}x")
    need = max(2 * segments, TORCH_STABILITY_MIN_ROUNDS)
    if ms.size < need:
        return {"segment_p50_ms": [], "spread": None, "max_spread": float(max_spread), "stable": None,
                "method": method + f"; not judged: {ms.size} rounds < {need}"}
    p50s = [float(np.median(part)) for part in np.array_split(ms, segments)]
    low = min(p50s)
    spread = max(p50s) / low if low > 0 else float("inf")
    return {"segment_p50_ms": p50s, "spread": float(spread), "max_spread": float(max_spread),
            "stable": bool(spread <= max_spread), "method": method}


BASELINE_METRICS = ("speedup_vs_torch", "speedup_vs_onnx_fp32")  # gate metrics read from the reference pass


def baseline_gate_batch_sizes(spec: Spec) -> set[int]:
    """The batch sizes at which a gate reads the reference pass's baselines: `speedup_vs_torch` (its torch p50
    comes only from here) and `speedup_vs_onnx_fp32` (here for a variant not timed interleaved with the ONNX FP32
    reference), at the gate's batch size (`Spec.gate_batch_size`).

    Returns:
        {batch size}; empty when no gate reads them (the demo spec: its only timing gate is a p99 one).
    """
    return {spec.gate_batch_size(g) for g in spec.gates if g.metric in BASELINE_METRICS}


def timing_gates_key(spec: Spec) -> list[int] | None:
    """The one thing the baselines' timing reads from `gates`: with `benchmark.precision`, the sorted
    `baseline_gate_batch_sizes` (their timing stops at the first look elsewhere); None without it (the full
    budget). Part of reference-pass's cache key and of a gate-only re-run's identity (`tailguard.rerun`), so
    adding a speed gate that reads these baselines times them again instead of reusing a first-look timing. What
    reference-pass reads of `gates` is declared in `tailguard.core.spec.reads.REFERENCE_PASS`."""
    from tailguard.core.spec.reads import REFERENCE_PASS

    if REFERENCE_PASS.gates != "baseline_batch_sizes" or getattr(spec.benchmark, "precision", None) is None:
        return None
    return sorted(baseline_gate_batch_sizes(spec))


def time_baselines(onnx_path: str | Path, torch_runner: Any | None, ds: Dataset, spec: Spec, *,
                   clock: Callable[[], int] | None = None) -> dict[str, Any]:
    """Time ONNX Runtime FP32 and (for a torch reference) torch eager FP32 at every benchmark batch size, with
    the spec's `benchmark` section, and check that torch's p50 is stable across the rounds.

    With a torch reference the two are timed interleaved in rounds on the same batches
    (`tailguard.core.latency.interleaved_benchmark`, as the validate step times a variant against the ONNX FP32
    reference): one `benchmark.max_seconds` budget per batch size covers both, and a load change hits both alike.
    With `benchmark.precision` a batch size that a gate reads these baselines at (`baseline_gate_batch_sizes`)
    stops once the torch / ONNX ratio's interval (an ONNX reference: the ONNX p50's interval) is within it
    (`latency.precision_reached`, bounds corrected for the looks); any other batch size decides nothing here and
    stops at its first look (10 rounds), its figures reported with the rounds used.
    The ORT session is built here (`onnx_baseline_runner`) without spinning so that torch is not timed waiting
    on ORT's spinning workers (why and the figures: the module comment above TORCH_SEGMENTS).
    Each torch row then gets the stability check (`torch_stability`): `segment_p50_ms`, `segment_spread`,
    `segment_spread_max`, and a line in "warnings" when the spread is above TORCH_SPREAD_MAX. An ONNX reference
    is timed alone (`latency.benchmark`), its session built the same way.

    Args:
        onnx_path: the exported FP32 model.onnx.
        torch_runner: the torch eager reference (`TorchRunner`), or None for an ONNX reference.
        ds: the validation Dataset.
        spec: the validated spec (model.inputs, model.pad_values, benchmark).
        clock: the interleaved rounds' clock in integer ns (the seam tests replace; default time.perf_counter_ns).

    Returns:
        {"rows": validation rows, "torch": {batch size: perf} | None, "onnx_fp32": {batch size: perf},
         "warnings": [str] (torch baselines that were unstable; [] otherwise)}; perf as `benchmark` returns it
        (latency_ms.p50/.p95/.p99/.mean in ms, throughput_per_s, samples_ms, method, ...).

    Raises:
        InputError: the model file is missing or unloadable, or the validation set has no rows.
    """
    from tailguard.core.latency import benchmark, interleaved_benchmark, precision_reached
    from tailguard.core.runtime import TIMED_ORT_SESSION

    threads = spec.benchmark.intra_op_num_threads
    onnx_runner = onnx_baseline_runner(onnx_path, threads)
    precision = getattr(spec.benchmark, "precision", None)

    def rule(baseline: str | None, target: str) -> Any:
        """Measured to benchmark.precision (None: the full budget): at a batch size some gate reads these
        baselines at (`baseline_gate_batch_sizes`), until the torch / ONNX ratio's interval, or the ONNX p50's
        alone, is within the precision (`latency.precision_reached`, corrected for the looks); at any other batch
        size the baselines decide nothing, so timing stops at the first look (as validate's `timing_rule` does)."""
        if precision is None:
            return None
        boot = spec.analysis.bootstrap
        deciding = baseline_gate_batch_sizes(spec)

        def decide(bs: int, samples: Any, look: int, n_looks: int) -> bool:
            if bs not in deciding:
                return True
            return precision_reached(samples, precision, look, n_looks, baseline=baseline, target=target,
                                     boot_samples=boot.samples, seed=boot.seed)

        return decide

    if torch_runner is None:
        return {"rows": ds.n_rows, "torch": None, "warnings": [],
                "onnx_fp32": benchmark(onnx_runner, ds, spec.model.inputs, spec.benchmark,
                                       pad_values=spec.model.pad_values, decide=rule(None, "runner"))}
    kw = {"clock": clock} if clock is not None else {}
    timed = interleaved_benchmark({"onnx_fp32": onnx_runner, "torch": torch_runner}, ds, spec.model.inputs,
                                  spec.benchmark, pad_values=spec.model.pad_values,
                                  decide=rule("torch", "onnx_fp32"), **kw)
    warnings: list[str] = []
    for name in timed:
        for row in timed[name].values():
            row["method"] += f"; ONNX Runtime session with {TIMED_ORT_SESSION}"
    for bs, row in timed["torch"].items():
        check = torch_stability(row["samples_ms"])
        row.update(segment_p50_ms=check["segment_p50_ms"], segment_spread=check["spread"],
                   segment_spread_max=check["max_spread"], stability_method=check["method"])
        if check["stable"] is False:
            lo, hi = min(check["segment_p50_ms"]), max(check["segment_p50_ms"])
            warnings.append(
                f"torch baseline at batch {bs} unstable: its p50 over {TORCH_SEGMENTS} segments of the reference "
                f"pass ranged {lo:.3g}-{hi:.3g} ms ({check['spread']:.2f}x > {TORCH_SPREAD_MAX:g}x), so "
                "speedup_vs_torch is uncertain by as much; the node's load changed while it was timed: re-run on a "
                "quieter node (tailguard run --no-cache)")
    return {"rows": ds.n_rows, "torch": timed["torch"], "onnx_fp32": timed["onnx_fp32"], "warnings": warnings}


def coverage_metrics(table: Any) -> dict[str, float]:
    """Calibration coverage figures from `coverage.calibration_coverage`'s table (one row per declared slice group;
    columns validation_rows, missing, coverage_ratio).

    Returns:
        {"calibration.groups_missing": validation groups without a calibration row (count, as float),
         "calibration.min_coverage_ratio": lowest calibration share / validation share} (the ratio only when a
        group has validation rows).
    """
    judged = table[table["validation_rows"] > 0]
    values = {"calibration.groups_missing": float(judged["missing"].sum())}
    if len(judged):
        values["calibration.min_coverage_ratio"] = float(judged["coverage_ratio"].min())
    return values
