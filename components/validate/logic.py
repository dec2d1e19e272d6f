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


`validate_variant` runs these steps in order; each is a function whose arguments are what it reads and whose
return value is what the later steps read (the idea of Triton Model Navigator's commands/base.py: a small
lifecycle of named steps):

    reference_output   the reference's first output, checked against the validation rows
    derive_rows        derived slice columns (tailguard.core.derive) and the slice groups over every row
    score_rows         the variant's outputs (stored ones first), scored all at once or sequentially
                       (sequential.score_sequentially), per row, overall and per slice (`ScoredRows`)
    discover           worst-slice discovery over the rows scored (discovery.py), when enabled
    worst_rows         the worst rows (scoring.worst_samples)
    time_variant       latency, throughput, cost and speed ratios (timing.py); skipped when a gate that needs no
                       timing already failed (sequential._failed_before_timing)
    resource_metrics   peak_rss_mb, model_size_mb and the build's metrics (gates.build_metrics)
    decide_gates       the spec's gates (gates.evaluate_gates, the sequential decisions, the untimed gates)
    numerics_check     the exact-integer-accumulation pass (numerics.py)
    write_outputs      the files above and the `ValidationResult` (result.py; its MLflow metric names are there)
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
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
from tailguard.core.latency import peak_rss_mb
from tailguard.core.parity import non_finite_rows
from tailguard.core.runtime import Runner
from tailguard.core.slices import slice_groups
from tailguard.core.spec.root import Spec
from tailguard.core.taskio import json_default

from .gates import GateResult, all_passed, build_metrics, evaluate_gates
from .measurements import Measurements
from .numerics import ParityPass, numerics_check
from .report import write_report
from .result import ValidationResult
from .scoring import _in_row_order, _labels, _run_first_output, _score, worst_samples, worst_slice
from .sequential import SequentialScoring, _early_gates, _failed_before_timing, _not_timed, describe, score_sequentially
from .timing import time_variant


@dataclass
class ScoredRows:
    """What `score_rows` produced: the variant's outputs over the rows scored and their parity.

    Attributes:
        cand: the variant's first output over the rows scored, in validation-row order, (rows scored, ...).
        idx: int64 (rows scored,) sorted validation-row indices when scoring stopped before the last row, else
            None (every row scored).
        frame: the metadata of the rows scored (`Dataset.frame`, derived columns included).
        groups: the slice groups over the rows scored (`slices.slice_groups`).
        scoring: the sequential scoring (rows in scoring order, blocks, gate plans), None when it was off.
        per_sample: per-row parity values, arrays of shape (rows scored,).
        overall: the overall parity metrics (`parity.aggregate`); `resource_metrics` are added to it.
        table: the per-slice table (slice, value, support, <metrics>).
    """

    cand: np.ndarray
    idx: np.ndarray | None
    frame: pd.DataFrame
    groups: list
    scoring: SequentialScoring | None
    per_sample: dict[str, np.ndarray]
    overall: dict[str, float]
    table: pd.DataFrame


def reference_output(reference_outputs: list[np.ndarray], validation: Dataset) -> np.ndarray:
    """The FP32 reference's first output, (rows, ...), checked against the validation rows.

    Raises:
        InputError: no reference outputs, or a row count other than the validation set's.
    """
    if not reference_outputs:
        raise InputError("validate: no reference outputs given", hint="run the FP32 reference first")
    ref = np.asarray(reference_outputs[0])
    if ref.shape[0] != validation.n_rows:
        raise InputError(f"validate: reference output has {ref.shape[0]} rows, the validation set "
                         f"{validation.n_rows} ({validation.uri})",
                         hint="compute the reference outputs on the same validation rows")
    return ref


def derive_rows(spec: Spec, validation: Dataset, reference_outputs: list[np.ndarray], ref: np.ndarray,
                out: Path) -> tuple[Dataset, list]:
    """The derived slice columns and the slice groups over every validation row.

    Reads: `slices` (their `derive`), the monitor's default slices (`derive.monitored_default_slices`), the
    validation inputs and the reference outputs. Writes the fitted centroids to `out`/CENTROIDS_FILE when any
    (logged with the run by the validate task, for the monitor's --centroids).

    Returns:
        (the validation set with the derived columns added to its frame (for discovery, sequential plans and
        worst samples), `slices.slice_groups` over every row).
    """
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
    return validation, slice_groups(validation.frame, spec.slices, derived)


def score_rows(spec: Spec, variant_name: str, runner: Runner, ref: np.ndarray, validation: Dataset,
               labels: np.ndarray | None, groups_all: list, measurements: Measurements | None) -> ScoredRows:
    """Run the variant over the validation rows and score it against the reference.

    Reads: `analysis.sequential` (every row at once, or block by block until the gates are decided:
    `sequential.score_sequentially`), `model` and `data.validation.batch_size` (running), `analysis.embedding`
    (scoring); the stored outputs in `measurements` (used instead of running again; what is run anew is added).

    Returns:
        The `ScoredRows`.
    """
    n_rows = validation.n_rows
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
    return ScoredRows(cand, idx, frame, groups, scoring, per_sample, overall, table)


def discover(spec: Spec, scored: ScoredRows) -> Any:
    """Worst-slice discovery over the rows scored (`discovery.discover_slices`), or None when
    `analysis.discovery.enabled` is off. Reads `analysis.discovery`, `model.task` and the label column (left out of
    the columns searched)."""
    if not spec.analysis.discovery.enabled:
        return None
    from .discovery import discover_slices

    label = spec.data.validation.label_column
    return discover_slices(scored.frame, scored.per_sample, model_task=spec.model.task, spec=spec.analysis.discovery,
                           exclude_columns=[label] if label is not None else [])


def worst_rows(spec: Spec, scored: ScoredRows) -> pd.DataFrame:
    """worst_samples.csv's table (`scoring.worst_samples`, `analysis.worst_k` rows), its "row" column the
    position in the validation set (not in the rows scored)."""
    worst = worst_samples(spec.model.task, scored.per_sample, scored.frame, spec.analysis.worst_k)
    if scored.idx is not None:  # positions in the validation set, not in the rows scored
        worst["row"] = scored.idx[worst["row"].to_numpy()]
    return worst


def _model_size_mb(model_path: str | Path | None) -> float | None:
    if model_path is None:
        return None
    p = Path(model_path)
    if p.is_dir():
        return sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) / 2**20
    if p.is_file():
        return p.stat().st_size / 2**20
    raise InputError(f"model file not found: {p}", hint="pass the variant's built model path")


def resource_metrics(model_path: str | Path | None) -> dict[str, float]:
    """The overall metrics that are not parity: "peak_rss_mb" (this process's high-water mark, MiB, measured
    after the timing), "model_size_mb" (the model file or folder, MiB; only with `model_path`) and the build's
    metrics stored in the model (`gates.build_metrics`: INT8 quantized_mac_fraction).

    Raises:
        InputError: `model_path` names a file that does not exist.
    """
    out = {"peak_rss_mb": peak_rss_mb()}
    size = _model_size_mb(model_path)
    if size is not None:
        out["model_size_mb"] = size
    out.update(build_metrics(model_path))  # INT8: quantized_mac_fraction, stored in the model by the build
    return out


def decide_gates(spec: Spec, variant_name: str, scored: ScoredRows, perf: dict[int, dict[str, Any]],
                 discovery: Any, failed_first: str | None, n_rows: int) -> list[GateResult]:
    """The spec's gates for the variant (`gates.evaluate_gates`; every gate, all failures together): on the rows
    scored, with the sequential decisions in place of the parity gates' evaluation when scoring stopped before the
    last row (`sequential._early_gates`), and the timed gates undecided when a gate failed the variant before
    timing (`sequential._not_timed`). Reads `gates` and `analysis` of the spec."""
    gates = evaluate_gates(spec, variant_name, scored.overall, scored.table, perf, per_sample=scored.per_sample,
                           groups=scored.groups, discovered=discovery)
    if scored.idx is not None:  # stopped before the last row: the parity gates are the sequential decisions
        gates = _early_gates(scored.scoring.plans, gates, scored.scoring.rows_used, n_rows, spec)
    if failed_first is not None:
        gates = _not_timed(gates, failed_first)
    return gates


def write_outputs(out: Path, spec: Spec, variant_name: str, validation: Dataset, scored: ScoredRows,
                  worst: pd.DataFrame, discovery: Any, gates: list[GateResult], perf: dict[int, dict[str, Any]],
                  reference_perf: dict | None, passed: bool, numerics: dict[str, Any],
                  exact_table: pd.DataFrame | None) -> ValidationResult:
    """Write slices.csv, slices_exact.csv (when the numerics check ran), worst_samples.csv, discovered.csv (when
    discovery ran), report.html and result.json into `out` (module docstring), and return the ValidationResult."""
    table, scoring, n_rows = scored.table, scored.scoring, validation.n_rows
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
    write_report(files["report"], variant=variant_name, overall=scored.overall, slice_table=table, gates=gates,
                 perf=perf, reference_perf=reference_perf, passed=passed,
                 discovered=discovery.table if discovery is not None else None, worst_samples=worst,
                 numerics=numerics)
    sequential = None
    if scoring is not None:
        sequential = describe(scoring.plans, scoring.rows_used, n_rows, spec)
    result = ValidationResult(worst_slice=worst_slice(spec, table), numerics=numerics,
        exact_slices=exact_table.to_dict("records") if exact_table is not None else [],
        rows_used=scoring.rows_used if scoring is not None else n_rows, sequential=sequential,
        variant=variant_name, model_task=spec.model.task, rows=n_rows, overall=scored.overall, perf=perf,
        slices=table.to_dict("records"), gates=gates, passed=passed,
        non_finite_rows=int(non_finite_rows(scored.cand).sum()), batch_sizes=list(spec.benchmark.batch_sizes),
        files=files, discovered=discovered, discovery=discovery_info)
    Path(files["result_json"]).write_text(json.dumps(result.to_dict(), indent=1, default=json_default))
    return result


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
    ref = reference_output(reference_outputs, validation)
    labels = _labels(spec, validation)

    t_native = time.perf_counter()
    validation, groups_all = derive_rows(spec, validation, reference_outputs, ref, out)
    scored = score_rows(spec, variant_name, runner, ref, validation, labels, groups_all, measurements)
    native_seconds = time.perf_counter() - t_native
    discovery = discover(spec, scored)
    worst = worst_rows(spec, scored)

    n_rows = validation.n_rows
    failed_first = _failed_before_timing(spec, variant_name, scored.overall, scored.table, scored.per_sample,
                                         scored.groups, discovery, scored.scoring, scored.idx, n_rows)
    perf, reference_perf = time_variant(spec, variant_name, runner, validation, failed_first=failed_first,
                                        baseline_runners=baseline_runners, reference_perf=reference_perf,
                                        torch_perf=torch_perf, measurements=measurements, p50_decides=p50_decides)
    scored.overall.update(resource_metrics(model_path))

    t_gates = time.perf_counter()
    gates = decide_gates(spec, variant_name, scored, perf, discovery, failed_first, n_rows)
    native_seconds += time.perf_counter() - t_gates
    passed = all_passed(gates)
    numerics, exact_table = numerics_check(
        spec, variant_name, ParityPass(scored.overall, scored.table, gates, native_seconds), model_path=model_path,
        exact_runner_factory=exact_runner_factory, validation=validation, ref=ref, labels=labels,
        groups_all=groups_all, groups=scored.groups, idx=scored.idx, scoring=scored.scoring, perf=perf,
        discovery=discovery, failed_first=failed_first, measurements=measurements)
    return write_outputs(out, spec, variant_name, validation, scored, worst, discovery, gates, perf, reference_perf,
                         passed, numerics, exact_table)
