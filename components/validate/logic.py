"""The validate step for one variant: parity (overall and per slice), latency, cost, memory, gates, report.

`validate_variant` runs the variant over the validation set, compares its first output with the FP32
reference's, searches the metadata for the worst slices (when `analysis.discovery.enabled`), times it,
evaluates the spec's gates and writes these files into `out_dir`:

    slices.csv         the per-slice table (slice, value, support, <metrics>)
    discovered.csv     the worst-slice discovery table (`discovery.DiscoveryResult.table`: slice, value,
                       support, metric, value_in_slice, value_rest, drop, p_value, q_value, significant);
                       only when discovery ran
    worst_samples.csv  the `analysis.worst_k` rows with the worst per-row parity (`worst_samples`)
    slices_exact.csv   the per-slice table of the exact-integer-accumulation pass (same columns as slices.csv);
                       only when the numerics check ran (`numerics_check`)
    report.html        the self-contained report (report.py)
    result.json        `ValidationResult.to_dict()` (Python's json: non-finite floats as Infinity / NaN)

MLflow metric names (`ValidationResult.mlflow_metrics`, docs/architecture.md "MLflow names"):

    <parity metric>                   overall, e.g. top1_agreement, cosine_similarity.p01, abs_error.max
    peak_rss_mb, model_size_mb        overall resources (MiB), when measured
    quantized_mac_fraction            INT8 builds: MACs in INT8 / all MACs (gates.build_metrics)
    non_finite_rows                   validation rows whose candidate output had NaN/inf
    rows_used                         validation rows scored (fewer than all when sequential validation
                                      decided every gate first, `analysis.sequential`)
    gates_passed                      1.0 when the variant passed its gates, else 0.0
    <perf metric>                     at the FIRST benchmark batch size (the gates' default):
                                      latency_ms.p50/.p95/.p99/.mean, throughput_per_s,
                                      usd_per_1m_inferences, speedup_vs_torch, speedup_vs_onnx_fp32,
                                      speedup_vs_onnx_fp32.lb95/.ub95 (when timed interleaved),
                                      latency_ms.p50.lb95/.ub95, latency_ms.p99.ub95 (order statistics)
    bs<N>.<perf metric>               the same at every batch size N (first one included), plus
                                      bs<N>.n_iterations and, timed to benchmark.precision, bs<N>.looks
    slice.<slice>.<value>.<metric>    per slice group, and slice.<slice>.<value>.support; <value> is
                                      sanitised to [A-Za-z0-9_.- ] (every other character, '/' included,
                                      becomes '_'; a key clash after that gets a suffix _2, _3, ...); a value
                                      that would make "slice.<slice>.<value>" longer than 160 characters is
                                      cut and ends with -h<16 hex of its sha256> (`slice_key_prefix`), so no
                                      key passes MLflow's 250-character limit
    discovered.count                  slices worst-slice discovery marked significant (only when it ran)
    discovered.<i>.drop               for the i-th worst significant discovered slice, i = 1..5: its drop
    discovered.<i>.support            (metric units, > 0 = worse than the rest), support (rows) and
    discovered.<i>.q_value            Benjamini-Hochberg q-value
    hardware_dependent                the numerics check (only when it ran, `numerics_check`): 1.0 when the
                                      gates or the worst slice differ between the node's INT8 kernels and exact
                                      integer accumulation beyond NUMERICS_TOLERANCE, else 0.0
    exact.<parity metric>             overall parity metrics of the exact-accumulation pass
    exact.slice.<slice>.<value>.<m>   per slice group, the exact pass's value of the key metric m (the one the
                                      worst slice is ranked by); every metric is in slices_exact.csv
    numerics.worst_slice_delta        |native - exact| of the worst slice's key metric (metric units)
    numerics.max_slice_delta          the largest |native - exact| over judged slice groups (metric units)
    numerics.gate_differences         gates whose status differs between the two passes
    numerics.native_seconds           seconds of the native pass (run + scoring + gates)
    numerics.exact_seconds            seconds of the exact pass (session + run + scoring + gates)

Values that are None or NaN (a metric not measured, a group with no rows) are left out; +inf is kept
(MLflow's SQL store clamps it to the largest float).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import time
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pandas as pd

from tailguard.core.data import Dataset
from tailguard.core.derive import (
    CENTROIDS_FILE,
    derive_dataset,
    fit_centroids,
    monitored_default_slices,
    save_centroids,
)
from tailguard.core.errors import InputError
from tailguard.core.latency import add_speed_ratios, benchmark, cost_per_1m, interleaved_benchmark, peak_rss_mb
from tailguard.core.metrics import higher_is_better
from tailguard.core.parity import aggregate, non_finite_rows, per_sample_metrics
from tailguard.core.report import key_metric
from tailguard.core.results import GateStatus
from tailguard.core.runtime import Runner, run_dataset
from tailguard.core.slices import per_slice_table, slice_groups
from tailguard.core.spec.models import Spec
from tailguard.core.taskio import json_default
from tailguard.core.tokens import align, decode_settings, run_token_ids

from .gates import GateResult, all_passed, build_metrics, evaluate_gates
from .report import write_report

PERF_KEYS = ("latency_ms.p50", "latency_ms.p95", "latency_ms.p99", "latency_ms.mean", "throughput_per_s",
             "usd_per_1m_inferences", "speedup_vs_torch", "speedup_vs_onnx_fp32",
             # bounds of the speed ratios when the baselines were timed interleaved (latency.add_speed_ratios)
             "speedup_vs_torch.lb95", "speedup_vs_torch.ub95", "speedup_vs_onnx_fp32.lb95",
             "speedup_vs_onnx_fp32.ub95",
             # distribution-free bounds of the p50 / p99 (latency.add_quantile_bounds)
             "latency_ms.p50.lb95", "latency_ms.p50.ub95", "latency_ms.p99.ub95")
_KEY_BAD = re.compile(r"[^A-Za-z0-9_.\- ]")
DISCOVERED_METRICS_TOP = 5  # discovered.<i>.* MLflow metrics for the i = 1..5 worst significant slices
# per task: the per-row value that ranks worst_samples.csv, and whether low values are the bad ones
WORST_SAMPLE_KEY: dict[str, tuple[str, bool]] = {
    "classification": ("kl_divergence", False),
    "embedding": ("cosine_similarity", True),
    "regression": ("abs_error", False),
    "generic": ("abs_error", False),
    "token_classification": ("char_error", False),
}


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


def sanitize_key_part(value: str) -> str:
    """A slice value made safe inside an MLflow metric key: characters outside [A-Za-z0-9_.- ] become '_'.

    '/' is replaced too although MLflow allows it: MLflow rejects keys that change under path normalisation.
    """
    return _KEY_BAD.sub("_", str(value)) or "_"


# MLflow refuses metric keys longer than 250 characters (mlflow/utils/validation.py MAX_ENTITY_KEY_LENGTH). The
# longest key made from a slice group is "exact." + prefix + a clash suffix "_NN" + "." + metric; with the prefix
# "slice.<slice>.<value>" at most SLICE_KEY_PREFIX_MAX characters, every metric name up to 80 characters fits
# (the longest per-slice metric today: nn_top1_margin_agreement, 24).
SLICE_KEY_PREFIX_MAX = 160
SLICE_KEY_HASH_HEX = 16  # hex digits of sha256 kept in a shortened value (64 bits)


def slice_key_prefix(slice_name: str, value: Any) -> str:
    """The MLflow key prefix of one slice group, "slice.<slice>.<value>", at most SLICE_KEY_PREFIX_MAX characters.

    The value is sanitised (`sanitize_key_part`). When the prefix would be longer, the value is shortened, stably:
    its sanitised text cut to fit, then "-h" and the first SLICE_KEY_HASH_HEX hex digits of the sha256 of the raw
    value's UTF-8 bytes (so two long values with the same beginning get different keys, and a value always gets
    the same key). slices.csv, result.json and the report keep the full value.

    Example: a 300-character value "aaa...a" of slice "topic" gives
    "slice.topic.aaa...a-h<16 hex>" (160 characters).
    """
    head = f"slice.{slice_name}."
    part = sanitize_key_part(value)
    if len(head) + len(part) <= SLICE_KEY_PREFIX_MAX:
        return head + part
    digest = hashlib.sha256(str(value).encode("utf-8", "surrogatepass")).hexdigest()[:SLICE_KEY_HASH_HEX]
    keep = max(SLICE_KEY_PREFIX_MAX - len(head) - len(digest) - 2, 0)
    return f"{head}{part[:keep]}-h{digest}"


def _perf_row(perf: dict | None, bs: int) -> dict | None:
    if not perf:
        return None
    return perf.get(bs) or perf.get(str(bs))


@dataclass
class ValidationResult:
    """Everything the validate step measured and decided for one variant.

    Attributes:
        variant: variant name.
        task: the spec's model.task.
        rows: rows of the validation set.
        overall: overall-scope metrics: the parity metrics (`parity.aggregate`), plus "peak_rss_mb" (MiB)
            and "model_size_mb" (MiB) when measured.
        perf: {batch size: `latency.benchmark` entry + "usd_per_1m_inferences" (USD, when the spec has a cost
            section), "speedup_vs_torch" / "speedup_vs_onnx_fp32" (baseline p50 / variant p50, when the
            baseline was given)}; "samples_ms" (raw timings, ms) is kept.
        slices: per-slice table records ({slice, value, support, <metric>: float}).
        gates: one GateResult per spec gate.
        passed: the variant passed its gates (`gates.all_passed`: none failed, none had insufficient data).
        non_finite_rows: validation rows whose candidate output held NaN/inf.
        batch_sizes: benchmark batch sizes, in spec order (the first is the default for gates and metrics).
        files: {"report": path, "slices_csv": path, "result_json": path, "worst_samples_csv": path,
            "discovered_csv": path (only when discovery ran)}.
        worst_slice: the slice group with the worst value of the report's key metric among groups with
            support >= the smallest per-slice gate min_support (30 without per-slice gates):
            {slice, value, support, metric, observed}; None when no group qualifies.
        discovered: the worst-slice discovery table as records ({slice, value, support, metric,
            value_in_slice, value_rest, drop, p_value, q_value, significant}), worst first; [] when discovery
            did not run or found no candidate.
        discovery: {"tested": candidate slices tested, "significant": slices marked significant, "method":
            test and correction in words, "metric": the metric tested} when discovery ran, else None.
        numerics: the numerics check: `compare_numerics` output when the exact-accumulation pass ran, else
            `not_checked(reason, ...)` ({"status": "not_checked", "hardware_dependent": None, "reason": why});
            None in results written before it existed.
        exact_slices: the exact pass's per-slice table records (same columns as `slices`); [] when it did not
            run.
        rows_used: validation rows scored: `rows` unless sequential validation (`analysis.sequential`) stopped
            earlier, when every metric, table and gate is over the rows scored (the parity gates decided on the
            confidence sequence, `sequential.py`); None in results written before it existed.
        sequential: `sequential.describe` (settings, rows used, each gate's mode and the rows at which it was
            decided) when sequential validation ran, else None.
    """

    variant: str
    task: str
    rows: int
    overall: dict[str, float]
    perf: dict[int, dict[str, Any]]
    slices: list[dict[str, Any]]
    gates: list[GateResult]
    passed: bool
    non_finite_rows: int
    batch_sizes: list[int]
    files: dict[str, str] = field(default_factory=dict)
    worst_slice: dict[str, Any] | None = None
    discovered: list[dict[str, Any]] = field(default_factory=list)
    discovery: dict[str, Any] | None = None
    numerics: dict[str, Any] | None = None
    exact_slices: list[dict[str, Any]] = field(default_factory=list)
    rows_used: int | None = None
    sequential: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-serializable form (perf keys become strings in JSON; `from_dict` turns them back)."""
        return {"variant": self.variant, "task": self.task, "rows": self.rows, "overall": dict(self.overall),
                "perf": {str(k): v for k, v in self.perf.items()}, "slices": list(self.slices),
                "gates": [g.to_dict() for g in self.gates], "passed": self.passed,
                "non_finite_rows": self.non_finite_rows, "batch_sizes": list(self.batch_sizes),
                "files": dict(self.files), "worst_slice": self.worst_slice,
                "discovered": list(self.discovered), "discovery": self.discovery, "numerics": self.numerics,
                "exact_slices": list(self.exact_slices), "rows_used": self.rows_used,
                "sequential": self.sequential}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ValidationResult":
        """Inverse of `to_dict` (also accepts the parsed result.json)."""
        return cls(variant=d["variant"], task=d["task"], rows=int(d["rows"]), overall=dict(d["overall"]),
                   perf={int(k): v for k, v in d["perf"].items()}, slices=list(d["slices"]),
                   gates=[GateResult.from_dict(g) for g in d["gates"]], passed=bool(d["passed"]),
                   non_finite_rows=int(d["non_finite_rows"]), batch_sizes=[int(b) for b in d["batch_sizes"]],
                   files=dict(d.get("files", {})), worst_slice=d.get("worst_slice"),
                   discovered=list(d.get("discovered") or []), discovery=d.get("discovery"),
                   numerics=d.get("numerics"), exact_slices=list(d.get("exact_slices") or []),
                   rows_used=d.get("rows_used"), sequential=d.get("sequential"))

    @classmethod
    def load(cls, path: str | Path) -> "ValidationResult":
        """Read a result.json written by `validate_variant`.

        Raises:
            InputError: missing or unreadable file.
        """
        p = Path(path)
        try:
            return cls.from_dict(json.loads(p.read_text()))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise InputError(f"cannot read validation result {p}: {exc}",
                             hint="re-run the validate step for this variant") from None

    def mlflow_metrics(self) -> dict[str, float]:
        """Flat {MLflow metric key: value} (naming scheme: module docstring)."""
        out: dict[str, float] = {}

        def put(key: str, value: Any) -> None:
            if value is None or isinstance(value, (str, bool, list, dict)):
                return
            f = float(value)
            if not math.isnan(f):
                out[key] = f

        for k, v in self.overall.items():
            put(k, v)
        put("non_finite_rows", self.non_finite_rows)
        put("rows_used", self.rows_used)
        put("gates_passed", 1.0 if self.passed else 0.0)
        first = self.batch_sizes[0] if self.batch_sizes else None
        for bs in self.batch_sizes:
            row = self.perf.get(bs) or {}
            for k in PERF_KEYS:
                put(f"bs{bs}.{k}", row.get(k))
                if bs == first:
                    put(k, row.get(k))
            put(f"bs{bs}.n_iterations", row.get("n_iterations"))
            put(f"bs{bs}.looks", row.get("looks"))
        for key, rec in _slice_keys(self.slices):
            for k, v in rec.items():
                if k not in ("slice", "value"):
                    put(f"{key}.{k}", v)
        num = self.numerics or {}
        if num.get("hardware_dependent") is not None:  # the numerics check ran (module docstring)
            put("hardware_dependent", 1.0 if num["hardware_dependent"] else 0.0)
            for k, v in (num.get("exact_overall") or {}).items():
                put(f"exact.{k}", v)
            metric = num.get("metric")
            for key, rec in _slice_keys(self.exact_slices):
                if metric:
                    put(f"exact.{key}.{metric}", rec.get(metric))
            for k in ("worst_slice_delta", "max_slice_delta", "native_seconds", "exact_seconds"):
                put(f"numerics.{k}", num.get(k))
            put("numerics.gate_differences", len(num.get("gate_differences") or []))
        if self.discovery is not None:
            significant = [r for r in self.discovered if bool(r.get("significant"))]
            put("discovered.count", len(significant))
            for i, rec in enumerate(significant[:DISCOVERED_METRICS_TOP], start=1):
                for k in ("drop", "support", "q_value"):
                    put(f"discovered.{i}.{k}", rec.get(k))
        return out


def _slice_keys(records: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """(MLflow key prefix "slice.<slice>.<sanitized value>", record) per slice record; a clash after sanitizing
    gets a suffix _2, _3, ... in record order."""
    used: set[str] = set()
    out = []
    for rec in records:
        base = slice_key_prefix(rec["slice"], rec["value"])
        key, n = base, 1
        while key in used:
            n += 1
            key = f"{base}_{n}"
        used.add(key)
        out.append((key, rec))
    return out


def _labels(spec: Spec, validation: Dataset) -> np.ndarray | None:
    col = spec.data.validation.label_column
    if spec.model.task not in ("classification", "embedding") or col is None:
        return None
    if col not in validation.frame.columns:
        raise InputError(f"data.validation.label_column: no column {col!r} in the validation data; "
                         f"available: {list(map(str, validation.frame.columns))}",
                         hint="fix the column name or drop label_column")
    s = validation.frame[col]
    if s.isna().any():
        raise InputError(f"data.validation.label_column: column {col!r} has {int(s.isna().sum())} missing labels",
                         hint="fill or drop the rows without a label")
    if spec.model.task == "embedding":  # kNN label accuracy: any hashable label (parity.per_sample_metrics)
        return s.to_numpy()
    if not pd.api.types.is_integer_dtype(s) and not (
            pd.api.types.is_float_dtype(s) and np.all(np.mod(s.to_numpy(), 1) == 0)):
        raise InputError(f"data.validation.label_column: column {col!r} must hold integer class ids "
                         f"(index of the logit), got dtype {s.dtype}", hint="map class names to ids in the data")
    return s.to_numpy().astype(np.int64)


def worst_slice(spec: Spec, table: pd.DataFrame) -> dict[str, Any] | None:
    """The worst slice group for the report's key metric (see `ValidationResult.worst_slice`)."""
    metric = key_metric(table) if len(table) else None
    if metric is None:
        return None
    supports = [g.min_support for g in spec.gates if g.scope == "per_slice"]
    floor = min(supports) if supports else 30
    t = table[(table["support"] >= floor) & table[metric].notna()]
    if t.empty:
        return None
    row = t.sort_values(metric, ascending=higher_is_better(metric, default=True), kind="stable").iloc[0]
    return {"slice": str(row["slice"]), "value": str(row["value"]), "support": int(row["support"]),
            "metric": metric, "observed": float(row[metric])}


def worst_samples(task: str, per_sample: dict[str, np.ndarray], frame: pd.DataFrame, k: int) -> pd.DataFrame:
    """The k validation rows with the worst per-row parity, with their per-row metrics and metadata.

    Ranked by `WORST_SAMPLE_KEY[task]`: classification `kl_divergence` highest first, embedding
    `cosine_similarity` lowest first, regression/generic `abs_error` highest first; ties by row index.
    Non-finite rows (scored worst case by `parity.per_sample_metrics`) come first.

    Args:
        task: the spec's `model.task`.
        per_sample: `parity.per_sample_metrics` output, arrays of shape (rows,).
        frame: the validation metadata (`Dataset.frame`), `rows` rows in the same order.
        k: rows to keep (spec `analysis.worst_k`; 0 gives an empty table with the columns).

    Returns:
        DataFrame of min(k, rows) rows, worst first, with columns "row" (int, the 0-based position in the
        validation set), every per-row metric of `per_sample` (in its order), then every column of `frame`
        (a frame column named like one of those is renamed "meta.<name>").

    Raises:
        InputError: the per-row key is missing, or `frame` has another row count.
    """
    key, low_is_bad = WORST_SAMPLE_KEY[task]
    if key not in per_sample:
        raise InputError(f"worst_samples: per-row values {key!r} missing for task {task!r}")
    vals = np.asarray(per_sample[key], dtype=np.float64)
    rows = vals.shape[0]
    if len(frame) != rows:
        raise InputError(f"worst_samples: metadata has {len(frame)} rows, per-row values {rows}")
    order = np.lexsort((np.arange(rows), vals if low_is_bad else -vals))[:max(0, min(k, rows))]
    out = pd.DataFrame({"row": order.astype(np.int64)})
    for name, arr in per_sample.items():
        out[name] = np.asarray(arr)[order]
    meta = frame.iloc[order].reset_index(drop=True)
    for col in meta.columns:
        name = str(col)
        out[f"meta.{name}" if name in out.columns else name] = meta[col].to_numpy()
    return out


def _model_size_mb(model_path: str | Path | None) -> float | None:
    if model_path is None:
        return None
    p = Path(model_path)
    if p.is_dir():
        return sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) / 2**20
    if p.is_file():
        return p.stat().st_size / 2**20
    raise InputError(f"model file not found: {p}", hint="pass the variant's built model path")


def _run_first_output(runner: Runner, validation: Dataset, spec: Spec, variant_name: str) -> np.ndarray:
    """The variant's first output over every validation row, original row order: (rows, ...).

    Raises:
        InputError: the runner produced no outputs.
    """
    if spec.model.task == "token_classification":  # reduced batch by batch to (rows, time) ids: tailguard.core.tokens
        return run_token_ids(runner, validation, spec.model.inputs, batch_size=spec.data.validation.batch_size,
                             pad_values=spec.model.pad_values, mask_input=decode_settings(spec.model)["mask_input"])
    outputs = run_dataset(runner, validation, spec.model.inputs, batch_size=spec.data.validation.batch_size,
                          pad_values=spec.model.pad_values)
    if not outputs:
        raise InputError(f"validate: variant {variant_name!r} produced no outputs")
    return outputs[0]


def _per_row(spec: Spec, ref: np.ndarray, cand: np.ndarray, labels: np.ndarray | None,
             rows: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Per-row parity values of candidate outputs `cand` against the reference. `rows` None: `cand` covers every
    row of `ref` (rows, ...). Otherwise `cand` holds the rows `rows` (global indices) only and each gets the values
    it gets among all rows (embedding neighbours searched in the full FP32 set, `per_sample_metrics(query_rows=)`)."""
    task = spec.model.task
    emb = spec.analysis.embedding
    kw: dict[str, Any] = ({"recall_k": emb.recall_k, "knn_k": emb.knn_k, "margin_tolerance": emb.margin_tolerance}
                          if task == "embedding" else {})
    if task == "classification":
        kw["probabilities"] = spec.model.outputs[0].kind == "probabilities"
    if task == "token_classification":  # outputs are tokens.token_ids (the mask is applied in them)
        d = decode_settings(spec.model)
        kw.update(decode=d["decode"], blank=d["blank"])
    if rows is None:
        return per_sample_metrics(task, ref, cand, labels=labels, **kw)
    if task == "embedding":
        kw.update(reference_index=ref, query_rows=rows, index_labels=labels)
    return per_sample_metrics(task, ref[rows], cand, labels=None if labels is None else labels[rows], **kw)


def _score(spec: Spec, ref: np.ndarray, cand: np.ndarray, labels: np.ndarray | None, groups: list,
           rows: np.ndarray | None = None) -> tuple[dict[str, np.ndarray], dict[str, float], pd.DataFrame]:
    """(per-row values (rows,), overall parity metrics, per-slice table) of candidate outputs `cand` against the
    reference `ref` (both (rows, ...), float); `rows`: as `_per_row`, with `groups` over those rows."""
    task = spec.model.task
    per_sample = _per_row(spec, ref, cand, labels, rows)
    return per_sample, aggregate(task, per_sample), per_slice_table(task, per_sample, groups)


def _concat(spec: Spec, parts: list[np.ndarray]) -> np.ndarray:
    """Outputs of several runs stacked on the rows axis; token_classification ids (rows, time) of runs padded to
    different lengths are first widened with `tokens.IGNORE` to the widest."""
    if spec.model.task == "token_classification" and parts:
        width = max(p.shape[1] for p in parts)
        parts = [align(p, np.zeros((p.shape[0], width), dtype=np.int32))[0] for p in parts]
    return np.concatenate(parts)


def _run_blocks(runner: Runner, validation: Dataset, spec: Spec, variant_name: str,
                blocks: list[np.ndarray]) -> np.ndarray:
    """The variant's first output over the rows of `blocks` (global row indices), block after block, each block
    length-sorted into batches as `run_dataset` does: (sum of block sizes, ...), in block order."""
    return _concat(spec, [_run_first_output(runner, validation.subset(b), spec, variant_name) for b in blocks])


@dataclass
class Measurements:
    """A variant's measurements that do not depend on its gates (issue 25, item 4): the outputs of the rows scored
    and the timing rounds. The validate step keys them on the variant's model bytes, the data, the benchmark
    section and the node (components/validate/task.py `measurement_parts`), so a re-run whose only change is in
    `gates` or `promotion` decides on them again (`validate_variant(measurements=)`) instead of measuring again:
    the stopping rules are replayed on the stored rows and rounds and give what a fresh run would on the same
    ones; more rows or rounds are measured only when the new gates need them.

    Attributes:
        order: int64 (rows scored,): validation rows in the order scored (a prefix of the seeded permutation;
            0..rows-1 when sequential validation is off).
        block_sizes: rows per scored block, summing to order.size.
        outputs: the variant's first output for `order`, (rows scored, ...).
        exact_outputs: the exact-accumulation pass (numerics check) for the first rows of `order`, or None.
        timing: {runner name: {batch size: the `interleaved_benchmark` row (samples_ms included)}}, or None.
        changed: set when validation measured something new (the caller stores it again).
        discarded: why a stored entry was found but not used (its content no longer matches the digest stored
            with it: changed after it was stored), else None; the measurements are then empty.
    """

    order: np.ndarray | None = None
    block_sizes: list[int] = field(default_factory=list)
    outputs: np.ndarray | None = None
    exact_outputs: np.ndarray | None = None
    timing: dict[str, dict[int, dict[str, Any]]] | None = None
    changed: bool = False
    discarded: str | None = None

    def blocks(self) -> list[np.ndarray]:
        """`order` split into its scored blocks."""
        if self.order is None:
            return []
        return list(np.split(self.order, np.cumsum(self.block_sizes)[:-1])) if self.block_sizes else []


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
                       discovery_candidates: list | None = None,
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
        discovery_candidates: `discovery.candidate_slices` over every row (None: computed when needed).
        measurements: stored outputs of earlier scored blocks (`Measurements`): they are used block by block
            before the runner is asked for more; blocks scored beyond them are added to it (`changed`).

    Returns:
        SequentialScoring (rows in scoring order, their outputs, blocks, decided plans).
    """
    from .sequential import plan_gates, should_stop

    seq = spec.analysis.sequential
    n = validation.n_rows
    perm = np.random.default_rng(seq.seed).permutation(n).astype(np.int64)
    plans = plan_gates(spec, variant_name, validation.frame, groups, discovery_candidates=discovery_candidates)
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


def timing_rule(spec: Spec, variant_name: str, *, baseline: str | None, target: str,
                p50_decides: bool | None = None) -> Any:
    """The stopping rule of a variant's timing measured to `benchmark.precision` (None when it is not set: the
    full budget, as before). At a look, timing a batch size stops when

    - the speed ratio target vs `baseline` is within the precision (`latency.precision_reached`), or
    - every decision this batch size's timing makes is decided: each latency gate at the batch size (applicable to
      the variant) has its bound, at `look_confidence(level, looks)`, on one side of its threshold: a speed-ratio
      gate (`speedup_vs_<baseline>`, interleaved) on the paired-bootstrap bound at its `confidence` (95% for a
      gate without one: the point ratio then lies on the same side), a `latency_ms.p<q>` gate on the order-statistic
      bound of that quantile (`stats.order_statistic_bound`). Gates no interval of the rounds decides
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
    from tailguard.core.spec.models import BATCHED_METRICS
    from tailguard.core.stats import look_confidence, order_statistic_bound

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


def _in_row_order(order: np.ndarray, outputs: np.ndarray, n_rows: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Outputs scored in `order` put back in validation-row order: (outputs (n_rows, ...), None) when every row
    was scored, else (outputs of the scored rows sorted by row, their sorted row indices)."""
    if order.size == n_rows:
        out = np.empty_like(outputs)
        out[order] = outputs
        return out, None
    o = np.argsort(order, kind="stable")
    return outputs[o], order[o]


def _replay(spec: Spec, variant_name: str, validation: Dataset, labels: np.ndarray | None, groups_all: list,
            ref: np.ndarray, blocks: list[np.ndarray], outputs: np.ndarray) -> list[Any]:
    """The gate plans decided on `outputs` (rows of `blocks`, concatenated) block by block, as
    `score_sequentially` decides them (the exact-accumulation pass of the numerics check)."""
    from .sequential import plan_gates

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
    from .sequential import early_result

    return [early_result(p, g, rows_used, n_rows, spec) for p, g in zip(plans, gates)]


def _failed_before_timing(spec: Spec, variant_name: str, overall: dict[str, Any], table: Any,
                          per_sample: dict[str, np.ndarray], groups: list[Any], discovery: Any, scoring: Any,
                          idx: np.ndarray | None, n_rows: int) -> str | None:
    """With `analysis.sequential.stop: verdict` (the default), the key of a gate that is not timed (a parity,
    build or per-node gate) and already failed on the rows scored, whose failure decides the verdict before any
    timing: the benchmark is then skipped (issue 25: a variant that fails clearly stops early; its search starts
    early). None when timing is needed (every such gate passed or is undecided, `stop: all_gates`, sequential
    validation off)."""
    from tailguard.core.spec.models import BATCHED_METRICS

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
    from tailguard.core.spec.models import BATCHED_METRICS

    why = f"not timed: the verdict was already failed by {failed} (analysis.sequential.stop: verdict)"
    return [dataclasses.replace(g, status=GateStatus.UNDECIDED, passed=None, observed=None, method=why,
                                detail={**(g.detail or {}), "reason": why})
            if g.metric in BATCHED_METRICS else g for g in gates]


def validate_variant(spec: Spec, variant_name: str, runner: Runner, reference_outputs: list[np.ndarray],
                     validation: Dataset, out_dir: str | Path, *, reference_perf: dict | None = None,
                     torch_perf: dict | None = None, model_path: str | Path | None = None,
                     baseline_runners: dict[str, Runner] | None = None,
                     exact_runner_factory: Callable[[], Runner] | None = None,
                     measurements: Measurements | None = None,
                     p50_decides: bool | None = None) -> ValidationResult:
    """Validate one variant against the FP32 reference and the spec's gates.

    Args:
        spec: the validated spec.
        variant_name: name of the variant (spec `variants[].name`; matched against gates' `variants`).
        runner: the variant's runner (run(feeds) -> outputs in model.outputs order).
        reference_outputs: the FP32 reference outputs over `validation`, original row order; the first,
            shape (rows, ...) float, is compared (model.outputs[0]).
        validation: the validation dataset.
        out_dir: folder for slices.csv, worst_samples.csv, discovered.csv (when discovery ran), report.html
            and result.json (created).
        reference_perf: the ONNX FP32 reference's `benchmark` output ({batch size: {...}}, int or str keys),
            for speedup_vs_onnx_fp32 and the latency plot.
        torch_perf: the torch reference's `benchmark` output, for speedup_vs_torch.
        model_path: the variant's model file (or folder) for model_size_mb.
        baseline_runners: {"onnx_fp32": runner, "torch": runner} (either or both): the baselines are timed
            interleaved with the variant in this process (`latency.interleaved_benchmark`), and the speed ratios
            speedup_vs_<name> and their bounds (.lb95/.ub95) come from those paired rounds
            (`latency.add_speed_ratios`); the interleaved onnx_fp32 timing also replaces `reference_perf`.
            A baseline not given here keeps the ratio of p50s against `reference_perf` / `torch_perf`.
        exact_runner_factory: builds the variant's runner with exact integer accumulation
            (`OrtRunner(..., exact_int8_accumulation=True)`) for the numerics check: when given and the graph has
            integer GEMM/conv kernels (`integer_kernel_nodes`; unknown counts as yes), the validation rows are
            run again with it after the benchmark (so peak_rss_mb stays the native session's), scored against
            the same reference outputs, slices and discovered slices, the gates evaluated with the same perf and
            build metrics, and the two passes compared (`compare_numerics`); the session is freed after. None,
            or a graph without integer kernels (FP32/FP16: the option cannot change a float kernel): the check
            is `not_checked` with the reason.
        measurements: the variant's stored outputs and timing rounds (`Measurements`, issue 25 item 4): used
            instead of measuring again wherever they suffice (outputs of rows already scored, exact-pass outputs,
            timing rounds the stopping rule can be replayed on); what is measured anew is added to it and
            `changed` is set, for the caller to store.
        p50_decides: the p50 at the promotion batch size decides something (`timing_rule`; the search passes
            True), so with `benchmark.precision` it is timed to the precision or the budget.

    Returns:
        The ValidationResult (also written to out_dir/result.json).

    Raises:
        InputError: reference outputs missing or of another row count, a bad label column, a missing slice
            column, or candidate/reference output shapes that differ.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    task = spec.model.task
    if not reference_outputs:
        raise InputError("validate: no reference outputs given", hint="run the FP32 reference first")
    ref = np.asarray(reference_outputs[0])
    if ref.shape[0] != validation.n_rows:
        raise InputError(f"validate: reference output has {ref.shape[0]} rows, the validation set "
                         f"{validation.n_rows} ({validation.uri})",
                         hint="compute the reference outputs on the same validation rows")
    labels = _labels(spec, validation)

    t_native = time.perf_counter()
    n_rows = validation.n_rows
    derived, centroids = derive_dataset(spec.slices, validation.inputs, reference_outputs)
    for d in monitored_default_slices(spec):  # the monitor's default `topic` needs the centroids too
        if d.derive is not None and d.derive.reduce == "nearest_centroid" and n_rows:
            centroids[d.name] = fit_centroids(ref, int(d.derive.centroids or 2))
    if centroids:  # logged with the run (validate/task.py logs out_dir), for the monitor (--centroids)
        save_centroids(str(out / CENTROIDS_FILE), centroids)
    extra = {k: v for k, v in derived.items() if k not in validation.frame.columns}
    if extra:  # derived values are columns for discovery, sequential plans and worst samples too
        validation = dataclasses.replace(validation, frame=validation.frame.assign(**extra))
    groups_all = slice_groups(validation.frame, spec.slices, derived)
    scoring = None
    if spec.analysis.sequential.enabled and n_rows:
        scoring = score_sequentially(spec, variant_name, runner, ref, validation, labels, groups_all,
                                     measurements=measurements)
    idx = None  # the rows scored (sorted global indices) when scoring stopped before the last row
    frame, groups = validation.frame, groups_all
    if scoring is None:
        m = measurements
        if m is not None and m.outputs is not None and m.order is not None and \
                np.array_equal(m.order, np.arange(n_rows)):
            cand = m.outputs
        else:
            cand = _run_first_output(runner, validation, spec, variant_name)
            if m is not None:
                m.order, m.outputs, m.block_sizes, m.exact_outputs = np.arange(n_rows), cand, [n_rows], None
                m.changed = True
    else:
        cand, idx = _in_row_order(scoring.order, scoring.outputs, n_rows)
        if idx is not None:
            frame = validation.frame.iloc[idx].reset_index(drop=True)
            groups = [dataclasses.replace(g, mask=g.mask[idx], support=int(g.mask[idx].sum())) for g in groups_all]
    per_sample, overall, table = _score(spec, ref, cand, labels, groups, idx)
    native_seconds = time.perf_counter() - t_native
    discovery = None
    if spec.analysis.discovery.enabled:
        from .discovery import discover_slices

        label = spec.data.validation.label_column
        discovery = discover_slices(frame, per_sample, task=task, spec=spec.analysis.discovery,
                                    exclude_columns=[label] if label is not None else [])
    worst = worst_samples(task, per_sample, frame, spec.analysis.worst_k)
    if idx is not None:  # positions in the validation set, not in the rows scored
        worst["row"] = idx[worst["row"].to_numpy()]

    interleaved: dict[str, Any] = {}
    failed_first = _failed_before_timing(spec, variant_name, overall, table, per_sample, groups, discovery,
                                         scoring, idx, n_rows)
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
    overall["peak_rss_mb"] = peak_rss_mb()
    size = _model_size_mb(model_path)
    if size is not None:
        overall["model_size_mb"] = size
    overall.update(build_metrics(model_path))  # INT8: quantized_mac_fraction, stored in the model by the build

    t_gates = time.perf_counter()
    gates = evaluate_gates(spec, variant_name, overall, table, perf, per_sample=per_sample, groups=groups,
                           discovered=discovery)
    if idx is not None:  # stopped before the last row: the parity gates are the sequential decisions
        gates = _early_gates(scoring.plans, gates, scoring.rows_used, n_rows, spec)
    if failed_first is not None:
        gates = _not_timed(gates, failed_first)
    native_seconds += time.perf_counter() - t_gates
    passed = all_passed(gates)
    kernels = integer_kernel_nodes(model_path)
    exact_table = None
    if exact_runner_factory is None:
        numerics = not_checked("no exact-accumulation pass was asked for (the validate task asks for one on "
                               "ONNX Runtime variants)", native_seconds=native_seconds)
    elif kernels is not None and not kernels:
        numerics = not_checked("cannot differ: the graph has no integer MatMul/Gemm/Conv kernel (exact integer "
                               "accumulation changes only those)", native_seconds=native_seconds)
    else:
        t_exact = time.perf_counter()
        exact_runner = exact_runner_factory()
        if scoring is None:
            exact_cand = _run_first_output(exact_runner, validation, spec, variant_name)
            exact_plans = None
        else:  # the same rows in the same blocks (batches) as the native pass, decided the same way
            exact_out = _exact_outputs(exact_runner, validation, spec, variant_name, scoring.blocks, measurements)
            exact_cand, _ = _in_row_order(scoring.order, exact_out, n_rows)
            exact_plans = _replay(spec, variant_name, validation, labels, groups_all, ref, scoring.blocks,
                                  exact_out)
        del exact_runner  # the second session's memory goes back before anything else runs
        exact_per_sample, exact_overall, exact_table = _score(spec, ref, exact_cand, labels, groups, idx)
        # the same perf and build metrics: only the parity numbers may differ between the passes
        extras = {k: v for k, v in overall.items() if k not in exact_overall}
        exact_gates = evaluate_gates(spec, variant_name, {**exact_overall, **extras}, exact_table, perf,
                                     per_sample=exact_per_sample, groups=groups, discovered=discovery)
        if idx is not None and exact_plans is not None:
            exact_gates = _early_gates(exact_plans, exact_gates, scoring.rows_used, n_rows, spec)
        if failed_first is not None:
            exact_gates = _not_timed(exact_gates, failed_first)
        numerics = compare_numerics(
            spec, ParityPass(overall, table, gates, native_seconds),
            ParityPass(exact_overall, exact_table, exact_gates, time.perf_counter() - t_exact))
        numerics["integer_kernel_nodes"] = None if kernels is None else len(kernels)
    files = {"slices_csv": str(out / "slices.csv"), "report": str(out / "report.html"),
             "result_json": str(out / "result.json"), "worst_samples_csv": str(out / "worst_samples.csv")}
    table.to_csv(files["slices_csv"], index=False)
    if exact_table is not None:
        files["slices_exact_csv"] = str(out / "slices_exact.csv")
        exact_table.to_csv(files["slices_exact_csv"], index=False)
    worst.to_csv(files["worst_samples_csv"], index=False)
    discovered: list[dict[str, Any]] = []
    discovery_info = None
    if discovery is not None:
        files["discovered_csv"] = str(out / "discovered.csv")
        discovery.table.to_csv(files["discovered_csv"], index=False)
        discovered = discovery.table.to_dict("records")
        discovery_info = {"tested": int(discovery.tested), "method": str(discovery.method),
                          "metric": str(getattr(discovery, "tested_metric", "") or getattr(discovery, "metric", "")),
                          "significant": int(sum(bool(r.get("significant")) for r in discovered))}
    write_report(files["report"], variant=variant_name, overall=overall, slice_table=table, gates=gates,
                 perf=perf, reference_perf=reference_perf, passed=passed,
                 discovered=discovery.table if discovery is not None else None, worst_samples=worst,
                 numerics=numerics)
    sequential = None
    if scoring is not None:
        from .sequential import describe

        sequential = describe(scoring.plans, scoring.rows_used, n_rows, spec)
    result = ValidationResult(worst_slice=worst_slice(spec, table), numerics=numerics,
        exact_slices=exact_table.to_dict("records") if exact_table is not None else [],
        rows_used=scoring.rows_used if scoring is not None else n_rows, sequential=sequential,
        variant=variant_name, task=task, rows=validation.n_rows, overall=overall, perf=perf,
        slices=table.to_dict("records"), gates=gates, passed=passed,
        non_finite_rows=int(non_finite_rows(cand).sum()), batch_sizes=list(spec.benchmark.batch_sizes),
        files=files, discovered=discovered, discovery=discovery_info)
    Path(files["result_json"]).write_text(json.dumps(result.to_dict(), indent=1, default=json_default))
    return result

