"""The INT8 numerics check (issue 23): does a variant's verdict depend on the CPU's integer kernels?

ONNX Runtime computes the same INT8 graph differently by CPU (on x86 without VNNI its u8 x s8 GEMM adds pairs of
8-bit products in int16 with saturation). `numerics_check` runs the validation rows again with exact integer
accumulation, scores them against the same reference, slices and discovered slices, evaluates the gates with the
same perf and build metrics, and compares the two passes (`compare_numerics`); a graph without integer kernels
(`integer_kernel_nodes`) or no exact runner gives `not_checked` with the reason.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pandas as pd

from tailguard.core.data import Dataset
from tailguard.core.errors import InputError
from tailguard.core.runtime import Runner
from tailguard.core.spec.root import Spec

from .gates import GateResult, evaluate_gates
from .measurements import Measurements
from .scoring import _concat, _in_row_order, _run_first_output, _score, worst_slice
from .sequential import SequentialScoring, _early_gates, _not_timed, _replay

# Numerics check (issue 23): the tolerance on the worst slice's key metric between the node's INT8 kernels and
# exact integer accumulation, |native - exact| > NUMERICS_TOLERANCE * max(1, |native|, |exact|). For proportions
# (agreement, accuracy) and cosines (all in [-1, 1]) it is 0.005 absolute: half of 0.01, the step gate thresholds
# are written in (0.97, 0.99), and under one top-1 change in a 200-row slice, so a move that could carry a gate
# across its threshold is flagged while float noise (identical integer results give identical outputs) is not;
# for metrics in output units above 1 (errors, KL) it is 0.5% relative.
NUMERICS_TOLERANCE = 0.005


# ONNX Runtime ops that run an integer GEMM / convolution kernel (MLAS QGEMM, where ORT's u8 x s8 path saturates
# int16 pair sums on x86 without VNNI); a float GEMM reading a DequantizeLinear output is fused into one of them
# at session creation (QDQ graphs).
INTEGER_KERNEL_OPS = frozenset({"MatMulInteger", "ConvInteger", "QLinearMatMul", "QLinearConv", "QGemm",
                                "DynamicQuantizeMatMul", "MatMulIntegerToFloat", "QAttention",
                                "DynamicQuantizeLSTM"})


QDQ_FUSED_OPS = frozenset({"MatMul", "Gemm", "Conv", "ConvTranspose", "FusedMatMul", "Attention"})


class NumericsStatus(str, Enum):
    """Outcome of the numerics check (`numerics_check`), as result.json, the variant_result.json `numerics` and
    the tag tailguard.numerics spell it."""

    CONSISTENT = "consistent"                  # the two passes agree within NUMERICS_TOLERANCE
    HARDWARE_DEPENDENT = "hardware_dependent"  # a gate outcome or the worst slice differs
    NOT_CHECKED = "not_checked"                # no exact pass: it could not differ, or none was asked for


@dataclass
class ParityPass:
    """One scoring of a variant's outputs against the FP32 reference (native kernels or exact accumulation).

    Attributes:
        overall: the parity metrics (`parity.aggregate`), {name: float}.
        slices: the per-slice table (`slices.per_slice_table`: slice, value, support, <metrics>).
        gates: the spec's gates evaluated on this pass (same perf and build metrics for both passes).
        seconds: wall time of the pass (s): run over the validation rows, scoring, gates (the exact pass also
            its session creation).
    """

    overall: dict[str, float]
    slices: pd.DataFrame
    gates: list[GateResult]
    seconds: float = 0.0


def integer_kernel_nodes(model_path: str | Path | None) -> list[str] | None:
    """The nodes of an ONNX graph that ONNX Runtime runs on an integer GEMM / convolution kernel.

    Those are the INTEGER_KERNEL_OPS nodes (QOperator graphs, dynamic quantization) and the QDQ_FUSED_OPS nodes
    whose first two inputs both come from DequantizeLinear, or whose second input (the weight) is a
    DequantizeLinear of an initializer (QDQ graphs: ORT's QDQ selectors fuse those into QLinearMatMul /
    QLinearConv / MatMulIntegerToFloat when it creates the session; a float MatMul of a dequantized activation
    and a float tensor stays float). Subgraphs (If/Loop bodies) are not inspected.

    Args:
        model_path: the variant's .onnx file (external data is not loaded).

    Returns:
        Node names (op type where a node has no name), graph order; None when the path is not an .onnx file
        (a folder, a torch artefact, a TensorRT plan, None): unknown, so the exact pass is run when one is asked for.

    Raises:
        InputError: the file is not a loadable ONNX model.
    """
    if model_path is None or Path(model_path).suffix != ".onnx" or not Path(model_path).is_file():
        return None
    import onnx

    try:
        model = onnx.load(str(model_path), load_external_data=False)
    except Exception as exc:  # noqa: BLE001 - protobuf raises DecodeError and others: one meaning for the user
        raise InputError(f"cannot read ONNX model {model_path}: {str(exc)[:300]}",
                         hint="rebuild the variant") from None
    nodes = list(model.graph.node)
    initializers = {t.name for t in model.graph.initializer}
    dequantized = {o for n in nodes if n.op_type == "DequantizeLinear" for o in n.output}
    weights = {o for n in nodes if n.op_type == "DequantizeLinear" and n.input and n.input[0] in initializers
               for o in n.output}

    def fused(n: Any) -> bool:
        ins = list(n.input)
        return n.op_type in QDQ_FUSED_OPS and len(ins) >= 2 and (
            ins[1] in weights or (ins[0] in dequantized and ins[1] in dequantized))

    return [n.name or n.op_type for n in nodes if n.op_type in INTEGER_KERNEL_OPS or fused(n)]


def _beyond(a: float | None, b: float | None, tolerance: float) -> bool:
    """|a - b| > tolerance * max(1, |a|, |b|); a value missing or non-finite on one side only is beyond."""
    if a is None or b is None:
        return (a is None) != (b is None)
    a, b = float(a), float(b)
    if not (math.isfinite(a) and math.isfinite(b)):
        return not (a == b or (math.isnan(a) and math.isnan(b)))
    return abs(a - b) > tolerance * max(1.0, abs(a), abs(b))


def _key_overall(overall: dict[str, float]) -> str | None:
    from tailguard.core.report import KEY_METRICS

    return next((m for m in KEY_METRICS if m in overall), None)


def compare_numerics(spec: Spec, native: ParityPass, exact: ParityPass, *,
                     tolerance: float = NUMERICS_TOLERANCE) -> dict[str, Any]:
    """Decide whether a variant's validation depends on the CPU's INT8 kernel: the flag `hardware_dependent`.

    The variant is hardware dependent when any gate's status differs between the two passes, or when the worst
    slice's value of the key metric (`worst_slice`: the report's key metric, groups with support >= the
    smallest per-slice min_support) differs by more than the tolerance (`_beyond`: tolerance * max(1, |native|,
    |exact|); NUMERICS_TOLERANCE says why 0.005). Each pass's own worst slice is compared (they may be
    different groups). Without a judged slice group the overall key metric is compared instead.

    Args:
        spec: the spec (gates' per-slice min_support).
        native: the pass with the node's own kernels.
        exact: the pass with exact integer accumulation (`session.x64quantprecision`).
        tolerance: see above.

    Returns:
        {"status": NumericsStatus value, "hardware_dependent": bool, "reason": str, "tolerance": float,
        "metric": the key metric, "native_worst" / "exact_worst": `worst_slice` records (None without a judged
        group), "worst_slice_delta": |native - exact| of those values (or of the overall key metric),
        "max_slice_delta": the largest |native - exact| over judged groups (None without), "gate_differences":
        [{gate, native, exact}] statuses that differ, "native_seconds" / "exact_seconds": the passes' times (s),
        "exact_overall": the exact pass's overall metrics, "exact_gates": [{gate, status, observed}]}.
    """
    nw, ew = worst_slice(spec, native.slices), worst_slice(spec, exact.slices)
    metric = (nw or ew or {}).get("metric") or _key_overall(native.overall)
    if nw is not None or ew is not None:
        a, b = (nw or {}).get("observed"), (ew or {}).get("observed")
        where = "worst slice"
    else:
        a, b = native.overall.get(metric) if metric else None, exact.overall.get(metric) if metric else None
        where = "overall"
    delta = abs(float(a) - float(b)) if a is not None and b is not None else None
    worst_moved = _beyond(a, b, tolerance)
    max_delta = None
    if metric and len(native.slices) and len(exact.slices) and metric in native.slices and metric in exact.slices:
        supports = [g.min_support for g in spec.gates if g.scope == "per_slice"]
        floor = min(supports) if supports else 30
        keys = ["slice", "value"]
        both = native.slices[keys + ["support", metric]].astype({"value": str}).merge(
            exact.slices[keys + [metric]].astype({"value": str}), on=keys, suffixes=("", ".exact"))
        both = both[both["support"] >= floor]
        diffs = (both[metric] - both[metric + ".exact"]).abs().dropna()
        max_delta = float(diffs.max()) if len(diffs) else None
    exact_status = {g.gate: g.status for g in exact.gates}
    differ = [{"gate": g.gate, "native": g.status, "exact": exact_status.get(g.gate)}
              for g in native.gates if exact_status.get(g.gate) != g.status]
    dependent = bool(differ) or worst_moved
    parts = []
    if differ:
        parts.append("gate outcomes differ: " + ", ".join(f"{d['gate']} {d['native']} (native) vs {d['exact']} "
                                                          f"(exact)" for d in differ))
    def fmt(v):
        return "n/a" if v is None else f"{float(v):.4g}"
    parts.append(f"{where} {metric}: {fmt(a)} native vs {fmt(b)} exact "
                 f"({'beyond' if worst_moved else 'within'} tolerance {tolerance:g})")
    return {"status": (NumericsStatus.HARDWARE_DEPENDENT if dependent else NumericsStatus.CONSISTENT).value,
            "hardware_dependent": dependent, "reason": "; ".join(parts), "tolerance": float(tolerance),
            "metric": metric, "native_worst": nw, "exact_worst": ew, "worst_slice_delta": delta,
            "max_slice_delta": max_delta, "gate_differences": differ,
            "native_seconds": float(native.seconds), "exact_seconds": float(exact.seconds),
            "exact_overall": {k: float(v) for k, v in exact.overall.items()},
            "exact_gates": [{"gate": g.gate, "status": g.status, "observed": g.observed} for g in exact.gates]}


def not_checked(reason: str, **extra: Any) -> dict[str, Any]:
    """The numerics record of a variant whose exact pass did not run (`compare_numerics` gives the others)."""
    return {"status": NumericsStatus.NOT_CHECKED.value, "hardware_dependent": None, "reason": reason, **extra}


def _exact_outputs(runner: Runner, validation: Dataset, spec: Spec, variant_name: str, blocks: list[np.ndarray],
                   measurements: Measurements | None) -> np.ndarray:
    """The exact pass's outputs over `blocks`: the stored ones for the rows they cover, the runner for the rest
    (added to `measurements`)."""
    m = measurements
    have = m.exact_outputs if m is not None and m.exact_outputs is not None else None
    n_have = 0 if have is None else have.shape[0]
    order = np.concatenate(blocks) if blocks else np.zeros(0, dtype=np.int64)
    ends = np.cumsum([b.size for b in blocks]) if blocks else np.zeros(0, dtype=np.int64)
    keep = int(ends[ends <= n_have].max(initial=0))  # stored outputs are used whole blocks at a time
    parts = [have[:keep]] if keep else []
    if keep < order.size:  # the rest in one length-sorted run (fewer, fuller batches than block by block)
        parts.append(_run_first_output(runner, validation.subset(order[keep:]), spec, variant_name))
    out = _concat(spec, parts)
    if m is not None and out.shape[0] > n_have and m.order is not None and out.shape[0] <= m.order.size:
        m.exact_outputs, m.changed = out, True
    return out


def numerics_check(spec: Spec, variant_name: str, native: ParityPass, *, model_path: str | Path | None,
                   exact_runner_factory: Callable[[], Runner] | None, validation: Dataset, ref: np.ndarray,
                   labels: np.ndarray | None, groups_all: list, groups: list, idx: np.ndarray | None,
                   scoring: SequentialScoring | None, perf: dict[int, dict[str, Any]], discovery: Any,
                   failed_first: str | None,
                   measurements: Measurements | None) -> tuple[dict[str, Any], pd.DataFrame | None]:
    """The numerics check of a validated variant: its rows run again with exact integer accumulation and the two
    passes compared (`compare_numerics`), or `not_checked` with the reason.

    Reads: the variant's graph (`integer_kernel_nodes(model_path)`; raises on an unreadable .onnx even without an
    exact runner); `gates`, `slices` and `analysis` of the spec (scoring, gates and, with sequential validation,
    the replayed stopping rules); the stored exact-pass outputs in `measurements`.

    Args:
        spec: the validated spec.
        variant_name: the variant (gates' `variants`).
        native: the native pass (overall metrics with the perf and build metrics, slice table, gates, seconds).
        model_path: the variant's model file.
        exact_runner_factory: builds the exact-accumulation runner (`validate_variant`), or None.
        validation: the validation set (with derived columns).
        ref: the FP32 reference's first output, (rows, ...).
        labels: per-row labels or None.
        groups_all: slice groups over every row; groups: over the rows scored.
        idx: sorted indices of the rows scored when scoring stopped before the last row, else None.
        scoring: the sequential scoring (its blocks are run in the same batches), or None.
        perf: the native pass's timing (the exact pass's gates use it too).
        discovery: the native pass's discovered slices (`discovery.DiscoveryResult`) or None.
        failed_first: the gate that failed the variant before timing, or None (`sequential._not_timed`).
        measurements: stored outputs (`Measurements.exact_outputs`), grown with what is run anew; or None.

    Returns:
        (the numerics record: `compare_numerics` output with "integer_kernel_nodes" (count, None when unknown), or
        `not_checked(reason, native_seconds=...)`; the exact pass's slice table, None when it did not run).

    Raises:
        InputError: the model is an .onnx file that cannot be read.
    """
    kernels = integer_kernel_nodes(model_path)
    if exact_runner_factory is None:
        return not_checked("no exact-accumulation pass was asked for (the validate task asks for one on "
                           "ONNX Runtime variants)", native_seconds=native.seconds), None
    if kernels is not None and not kernels:
        return not_checked("cannot differ: the graph has no integer MatMul/Gemm/Conv kernel (exact integer "
                           "accumulation changes only those)", native_seconds=native.seconds), None
    n_rows = validation.n_rows
    t_exact = time.perf_counter()
    exact_runner = exact_runner_factory()
    if scoring is None:
        exact_cand = _run_first_output(exact_runner, validation, spec, variant_name)
        exact_plans = None
    else:  # the same rows in the same blocks (batches) as the native pass, decided the same way
        exact_out = _exact_outputs(exact_runner, validation, spec, variant_name, scoring.blocks, measurements)
        exact_cand, _ = _in_row_order(scoring.order, exact_out, n_rows)
        exact_plans = _replay(spec, variant_name, validation, labels, groups_all, ref, scoring.blocks, exact_out)
    del exact_runner  # the second session's memory goes back before anything else runs
    exact_per_sample, exact_overall, exact_table = _score(spec, ref, exact_cand, labels, groups, idx)
    # the same perf and build metrics: only the parity numbers may differ between the passes
    extras = {k: v for k, v in native.overall.items() if k not in exact_overall}
    exact_gates = evaluate_gates(spec, variant_name, {**exact_overall, **extras}, exact_table, perf,
                                 per_sample=exact_per_sample, groups=groups, discovered=discovery)
    if idx is not None and exact_plans is not None:
        exact_gates = _early_gates(exact_plans, exact_gates, scoring.rows_used, n_rows, spec)
    if failed_first is not None:
        exact_gates = _not_timed(exact_gates, failed_first)
    numerics = compare_numerics(
        spec, native, ParityPass(exact_overall, exact_table, exact_gates, time.perf_counter() - t_exact))
    numerics["integer_kernel_nodes"] = None if kernels is None else len(kernels)
    return numerics, exact_table
