"""The validate step for one variant: parity (overall and per slice), latency, cost, memory, gates, report.

`validate_variant` runs the variant over the validation set, compares its first output with the FP32
reference's, searches the metadata for the worst slices (when `analysis.discovery.enabled`), times it,
evaluates the spec's gates and writes these files into `out_dir`:

    slices.csv         the per-slice table (slice, value, support, <metrics>)
    discovered.csv     the worst-slice discovery table (`discovery.DiscoveryResult.table`: slice, value,
                       support, metric, value_in_slice, value_rest, drop, p_value, q_value, significant);
                       only when discovery ran
    worst_samples.csv  the `analysis.worst_k` rows with the worst per-row parity (`worst_samples`)
    report.html        the self-contained report (report.py)
    result.json        `ValidationResult.to_dict()` (Python's json: non-finite floats as Infinity / NaN)

MLflow metric names (`ValidationResult.mlflow_metrics`, docs/architecture.md "MLflow names"):

    <parity metric>                   overall, e.g. top1_agreement, cosine_similarity.p01, abs_error.max
    peak_rss_mb, model_size_mb        overall resources (MiB), when measured
    quantized_mac_fraction            INT8 builds: MACs in INT8 / all MACs (gates.build_metrics)
    non_finite_rows                   validation rows whose candidate output had NaN/inf
    gates_passed                      1.0 when the variant passed its gates, else 0.0
    <perf metric>                     at the FIRST benchmark batch size (the gates' default):
                                      latency_ms.p50/.p95/.p99/.mean, throughput_per_s,
                                      usd_per_1m_inferences, speedup_vs_torch, speedup_vs_onnx_fp32,
                                      speedup_vs_onnx_fp32.lb95/.ub95 (when timed interleaved)
    bs<N>.<perf metric>               the same at every batch size N (first one included), plus
                                      bs<N>.n_iterations
    slice.<slice>.<value>.<metric>    per slice group, and slice.<slice>.<value>.support; <value> is
                                      sanitised to [A-Za-z0-9_.- ] (every other character, '/' included,
                                      becomes '_'; a key clash after that gets a suffix _2, _3, ...)
    discovered.count                  slices worst-slice discovery marked significant (only when it ran)
    discovered.<i>.drop               for the i-th worst significant discovered slice, i = 1..5: its drop
    discovered.<i>.support            (metric units, > 0 = worse than the rest), support (rows) and
    discovered.<i>.q_value            Benjamini-Hochberg q-value

Values that are None or NaN (a metric not measured, a group with no rows) are left out; +inf is kept
(MLflow's SQL store clamps it to the largest float).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from tailguard.core.data import Dataset
from tailguard.core.errors import InputError
from tailguard.core.runtime import Runner, run_dataset
from tailguard.core.spec import Spec
from tailguard.core.taskio import json_default

from .gates import GateResult, all_passed, build_metrics, evaluate_gates
from tailguard.core.latency import add_speed_ratios, benchmark, cost_per_1m, interleaved_benchmark, peak_rss_mb
from tailguard.core.parity import aggregate, non_finite_rows, per_sample_metrics
from .report import higher_is_better, key_metric, write_report
from tailguard.core.slices import per_slice_table, slice_groups

PERF_KEYS = ("latency_ms.p50", "latency_ms.p95", "latency_ms.p99", "latency_ms.mean", "throughput_per_s",
             "usd_per_1m_inferences", "speedup_vs_torch", "speedup_vs_onnx_fp32",
             # bounds of the speed ratios when the baselines were timed interleaved (latency.add_speed_ratios)
             "speedup_vs_torch.lb95", "speedup_vs_torch.ub95", "speedup_vs_onnx_fp32.lb95",
             "speedup_vs_onnx_fp32.ub95")
_KEY_BAD = re.compile(r"[^A-Za-z0-9_.\- ]")
DISCOVERED_METRICS_TOP = 5  # discovered.<i>.* MLflow metrics for the i = 1..5 worst significant slices
# per task: the per-row value that ranks worst_samples.csv, and whether low values are the bad ones
WORST_SAMPLE_KEY: dict[str, tuple[str, bool]] = {
    "classification": ("kl_divergence", False),
    "embedding": ("cosine_similarity", True),
    "regression": ("abs_error", False),
    "generic": ("abs_error", False),
}


def sanitize_key_part(value: str) -> str:
    """A slice value made safe inside an MLflow metric key: characters outside [A-Za-z0-9_.- ] become '_'.

    '/' is replaced too although MLflow allows it: MLflow rejects keys that change under path normalisation.
    """
    return _KEY_BAD.sub("_", str(value)) or "_"


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
        rows: validation rows compared.
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

    def to_dict(self) -> dict[str, Any]:
        """JSON-serializable form (perf keys become strings in JSON; `from_dict` turns them back)."""
        return {"variant": self.variant, "task": self.task, "rows": self.rows, "overall": dict(self.overall),
                "perf": {str(k): v for k, v in self.perf.items()}, "slices": list(self.slices),
                "gates": [g.to_dict() for g in self.gates], "passed": self.passed,
                "non_finite_rows": self.non_finite_rows, "batch_sizes": list(self.batch_sizes),
                "files": dict(self.files), "worst_slice": self.worst_slice,
                "discovered": list(self.discovered), "discovery": self.discovery}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ValidationResult":
        """Inverse of `to_dict` (also accepts the parsed result.json)."""
        return cls(variant=d["variant"], task=d["task"], rows=int(d["rows"]), overall=dict(d["overall"]),
                   perf={int(k): v for k, v in d["perf"].items()}, slices=list(d["slices"]),
                   gates=[GateResult.from_dict(g) for g in d["gates"]], passed=bool(d["passed"]),
                   non_finite_rows=int(d["non_finite_rows"]), batch_sizes=[int(b) for b in d["batch_sizes"]],
                   files=dict(d.get("files", {})), worst_slice=d.get("worst_slice"),
                   discovered=list(d.get("discovered") or []), discovery=d.get("discovery"))

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
        put("gates_passed", 1.0 if self.passed else 0.0)
        first = self.batch_sizes[0] if self.batch_sizes else None
        for bs in self.batch_sizes:
            row = self.perf.get(bs) or {}
            for k in PERF_KEYS:
                put(f"bs{bs}.{k}", row.get(k))
                if bs == first:
                    put(k, row.get(k))
            put(f"bs{bs}.n_iterations", row.get("n_iterations"))
        used: set[str] = set()
        for rec in self.slices:
            base = f"slice.{rec['slice']}.{sanitize_key_part(rec['value'])}"
            key, n = base, 1
            while key in used:
                n += 1
                key = f"{base}_{n}"
            used.add(key)
            for k, v in rec.items():
                if k not in ("slice", "value"):
                    put(f"{key}.{k}", v)
        if self.discovery is not None:
            significant = [r for r in self.discovered if bool(r.get("significant"))]
            put("discovered.count", len(significant))
            for i, rec in enumerate(significant[:DISCOVERED_METRICS_TOP], start=1):
                for k in ("drop", "support", "q_value"):
                    put(f"discovered.{i}.{k}", rec.get(k))
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
    row = t.sort_values(metric, ascending=higher_is_better(metric), kind="stable").iloc[0]
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


def validate_variant(spec: Spec, variant_name: str, runner: Runner, reference_outputs: list[np.ndarray],
                     validation: Dataset, out_dir: str | Path, *, reference_perf: dict | None = None,
                     torch_perf: dict | None = None, model_path: str | Path | None = None,
                     baseline_runners: dict[str, Runner] | None = None) -> ValidationResult:
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

    outputs = run_dataset(runner, validation, spec.model.inputs, batch_size=spec.data.validation.batch_size,
                          pad_values=spec.model.pad_values)
    if not outputs:
        raise InputError(f"validate: variant {variant_name!r} produced no outputs")
    cand = outputs[0]
    emb = spec.analysis.embedding
    per_sample = per_sample_metrics(task, ref, cand, labels=labels,
                                    **({"recall_k": emb.recall_k, "knn_k": emb.knn_k,
                                        "margin_tolerance": emb.margin_tolerance} if task == "embedding" else {}))
    overall: dict[str, float] = aggregate(task, per_sample)
    groups = slice_groups(validation.frame, spec.slices)
    table = per_slice_table(task, per_sample, groups)
    discovery = None
    if spec.analysis.discovery.enabled:
        from .discovery import discover_slices

        label = spec.data.validation.label_column
        discovery = discover_slices(validation.frame, per_sample, task=task, spec=spec.analysis.discovery,
                                    exclude_columns=[label] if label is not None else [])
    worst = worst_samples(task, per_sample, validation.frame, spec.analysis.worst_k)

    interleaved: dict[str, Any] = {}
    if baseline_runners:
        timed = interleaved_benchmark({"variant": runner, **baseline_runners}, validation, spec.model.inputs,
                                      spec.benchmark, pad_values=spec.model.pad_values)
        perf = timed.pop("variant")
        interleaved = timed
        add_speed_ratios(perf, interleaved, samples=spec.analysis.bootstrap.samples,
                         seed=spec.analysis.bootstrap.seed)
        if "onnx_fp32" in interleaved:
            reference_perf = interleaved["onnx_fp32"]
    else:
        perf = benchmark(runner, validation, spec.model.inputs, spec.benchmark, pad_values=spec.model.pad_values)
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

    gates = evaluate_gates(spec, variant_name, overall, table, perf, per_sample=per_sample, groups=groups,
                           discovered=discovery)
    passed = all_passed(gates)
    files = {"slices_csv": str(out / "slices.csv"), "report": str(out / "report.html"),
             "result_json": str(out / "result.json"), "worst_samples_csv": str(out / "worst_samples.csv")}
    table.to_csv(files["slices_csv"], index=False)
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
                 discovered=discovery.table if discovery is not None else None, worst_samples=worst)
    result = ValidationResult(worst_slice=worst_slice(spec, table),
        variant=variant_name, task=task, rows=validation.n_rows, overall=overall, perf=perf,
        slices=table.to_dict("records"), gates=gates, passed=passed,
        non_finite_rows=int(non_finite_rows(cand).sum()), batch_sizes=list(spec.benchmark.batch_sizes),
        files=files, discovered=discovered, discovery=discovery_info)
    Path(files["result_json"]).write_text(json.dumps(result.to_dict(), indent=1, default=json_default))
    return result

