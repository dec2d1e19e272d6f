"""The variant's HTML report (report.html on its MLflow run): gates, overall parity, latency, per-slice parity,
discovered slices and the worst validation rows, as one self-contained page (building blocks, escaping and plot
conventions: tailguard.core.report)."""

from __future__ import annotations

import html
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from tailguard.core.metrics import higher_is_better
from tailguard.core.report import (
    CSS,
    TORCH_NOTE,
    html_table,
    img_tag,
    key_metric,
    no_mathtext,
    png_base64,
    value_text,
    zoom_limits,
)
from tailguard.core.results import GateStatus

if TYPE_CHECKING:
    from tailguard.components.validate.gates import GateResult

MAX_SLICE_BARS = 30  # groups shown in the per-slice plot (the worst ones)
MAX_WORST_SAMPLES = 20  # rows of worst_samples shown in the report (the CSV holds analysis.worst_k)


@no_mathtext
def _latency_plot(perf: dict[int, dict], reference_perf: dict | None, variant: str) -> str | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [bs for bs in perf if perf[bs].get("samples_ms")]
    if not sizes:
        return None
    fig, axes = plt.subplots(1, len(sizes), figsize=(5 * len(sizes), 3.4), squeeze=False)
    for ax, bs in zip(axes[0], sizes):
        series = [(variant, perf[bs]["samples_ms"])]
        ref = (reference_perf or {}).get(bs) or (reference_perf or {}).get(str(bs))
        if ref and ref.get("samples_ms"):
            series.append(("reference", ref["samples_ms"]))
        for label, samples in series:
            x = np.sort(np.asarray(samples, dtype=float))
            ax.step(x, np.arange(1, x.size + 1) / x.size, where="post", label=f"{label} (n={x.size})")
        p99 = perf[bs].get("latency_ms.p99")
        if p99 is not None:
            ax.axvline(p99, color="grey", ls=":", lw=1)
        ax.set_title(f"batch size {bs}: latency ECDF")
        ax.set_xlabel("latency (ms)")
        ax.set_ylabel("fraction of runs <= x")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    return png_base64(fig)


@no_mathtext
def _slice_plot(slice_table: pd.DataFrame, metric: str) -> str | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = slice_table[slice_table["support"] > 0].copy()
    if t.empty:
        return None
    # a column the catalogue does not know is drawn as higher-is-better (display only)
    t = t.sort_values(metric, ascending=higher_is_better(metric, default=True),
                      na_position="last").head(MAX_SLICE_BARS)
    vals = t[metric].to_numpy(dtype=float)
    finite = np.where(np.isfinite(vals), vals, np.nan)
    labels = [f"{s}={v} (n={n})" for s, v, n in zip(t["slice"], t["value"], t["support"])]
    fig, ax = plt.subplots(figsize=(7.5, 0.32 * len(t) + 1.2))
    y = np.arange(len(t))[::-1]
    lo, hi = zoom_limits(finite, metric)  # 0.984 vs 1.0 must be visible: the axis spans the data, not 0-1
    ends = np.where(np.isfinite(finite), finite, lo)
    ax.barh(y, ends - lo, left=lo, color="#4c72b0")
    for yi, v, end in zip(y, vals, ends):
        ax.text(end, yi, f" {v:.4g}" if np.isfinite(v) else f" {value_text(v)}", va="center", fontsize=7)
    ax.set_xlim(lo, hi)
    ax.set_yticks(y, labels, fontsize=7)
    ax.set_xlabel(f"{metric} (axis zoomed to the data)")
    worst = "lowest" if higher_is_better(metric, default=True) else "highest"
    ax.set_title(f"per-slice {metric}: {worst} first (n = support)")
    ax.grid(axis="x", alpha=0.3)
    return png_base64(fig)


def _group_text(f: dict) -> str:
    if "bound" in f:
        inner = f"estimate {value_text(f.get('estimate'))}, bound {value_text(f.get('bound'))}"
    else:
        inner = value_text(f.get("observed"))
    if "threshold" in f:
        inner += f", threshold {value_text(f.get('threshold'))}"
    return f"{f['slice']}={f['value']} ({inner}, n={f['support']})"


def _gate_detail(g: GateResult) -> str:
    d = g.detail or {}
    parts = []
    if d.get("reason"):
        parts.append(str(d["reason"]))
    if d.get("reference_score") is not None:
        parts.append(f"reference score {value_text(d['reference_score'])}, max_drop {value_text(d.get('max_drop'))}")
    if d.get("failing"):
        parts.append("failing: " + ", ".join(_group_text(f) for f in d["failing"][:20])
                     + (f" … +{len(d['failing']) - 20}" if len(d["failing"]) > 20 else ""))
    if d.get("insufficient"):
        parts.append(f"insufficient (< {g.min_support} rows): " + ", ".join(
            f"{f['slice']}={f['value']} (n={f['support']})" for f in d["insufficient"][:20])
            + (f" … +{len(d['insufficient']) - 20}" if len(d["insufficient"]) > 20 else ""))
    return "; ".join(parts)


def write_report(path: str | Path, *, variant: str, overall: dict, slice_table: pd.DataFrame,
                 gates: list[Any], perf: dict[int, dict], reference_perf: dict | None = None,
                 passed: bool | None = None, discovered: pd.DataFrame | None = None,
                 worst_samples: pd.DataFrame | None = None, numerics: dict | None = None) -> Path:
    """Write the variant's HTML report.

    Args:
        path: the .html file to write (parent folders are created).
        variant: variant name.
        overall: overall-scope metrics {name: float}.
        slice_table: `slices.per_slice_table` output.
        gates: `gates.evaluate_gates` output.
        perf: `latency.benchmark` output (plus derived metrics) per batch size, with "samples_ms".
        reference_perf: the FP32 reference's benchmark in the same form, drawn beside the variant's.
        passed: the variant's verdict (default: no gate failed or had insufficient data).
        discovered: the worst-slice discovery table (`discovery.DiscoveryResult.table`), or None when
            discovery did not run.
        worst_samples: `scoring.worst_samples` output (the first MAX_WORST_SAMPLES rows are shown), or None.
        numerics: the numerics check (components/validate/numerics.py `compare_numerics` / `not_checked`): a
            warning banner when `hardware_dependent`, else one line; None: nothing shown.

    Returns:
        The path written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if passed is None:
        passed = not any(g.status in (GateStatus.FAILED, GateStatus.INSUFFICIENT_DATA) for g in gates)

    def count(status: GateStatus) -> int:
        return sum(g.status == status for g in gates)

    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>tailguard: {html.escape(variant)}"
             f"</title><style>{CSS}</style></head><body>",
             f"<h1>Variant {html.escape(variant)}</h1>",
             f"<div class='banner {'ok' if passed else 'bad'}'>{'PASSED' if passed else 'FAILED'}: "
             f"{count(GateStatus.PASSED)} passed, {count(GateStatus.FAILED)} failed, "
             f"{count(GateStatus.INSUFFICIENT_DATA)} insufficient data, "
             f"{count(GateStatus.NOT_APPLICABLE)} not applicable</div>"]
    insufficient = [g for g in gates if g.status == GateStatus.INSUFFICIENT_DATA]
    if insufficient:
        parts.append("<div class='banner warn'>Not judged (no group with enough support), so the variant is not "
                     "promoted: "
                     + html.escape(", ".join(g.gate for g in insufficient)) + "</div>")
    if numerics:  # native INT8 kernels vs exact integer accumulation (issue 23)
        times = " ".join(f"{k.split('_')[0]} pass {numerics[k]:.2f} s." for k in ("native_seconds", "exact_seconds")
                         if isinstance(numerics.get(k), (int, float)))
        text = f"Numerics ({numerics.get('status')}): {numerics.get('reason', '')}. {times}".strip()
        cls = "banner warn" if numerics.get("hardware_dependent") else "note"
        if numerics.get("hardware_dependent"):
            text = ("HARDWARE-DEPENDENT: the gates judged with this node's INT8 kernels may not hold on a CPU with "
                    "another INT8 kernel (VNNI vs AVX2). " + text)
        parts.append(f"<div class='{cls}'>{html.escape(text)}</div>")

    parts.append("<h2>Gates</h2>")
    parts.append(html_table(
        ["gate", "metric", "scope", "batch size", "threshold", "estimate", "bound", "observed", "status",
         "method", "detail"],
        [[g.gate, g.metric, g.scope + (f" ({g.slice})" if g.slice else ""), g.batch_size,
          f"{g.op} {value_text(g.threshold)}", g.estimate,
          f"{value_text(g.bound)} ({g.confidence * 100:g}%)" if g.confidence is not None else None,
          g.observed, (g.status, g.status), g.method, _gate_detail(g)]
         for g in gates], cls="gates"))

    parts.append("<h2>Overall</h2>")
    parts.append(html_table(["metric", "value"], [[k, v] for k, v in overall.items()], cls="overall"))

    parts.append("<h2>Latency</h2>")
    perf_cols = ["latency_ms.p50", "latency_ms.p95", "latency_ms.p99", "latency_ms.mean", "throughput_per_s",
                 "usd_per_1m_inferences", "speedup_vs_torch", "speedup_vs_onnx_fp32", "n_iterations"]
    parts.append(html_table(["batch size", *perf_cols],
                        [[bs, *[perf[bs].get(c) for c in perf_cols]] for bs in perf], cls="perf"))
    if perf and all(p.get("speedup_vs_torch") is None for p in perf.values()):
        parts.append(f"<p class='note'>{html.escape(TORCH_NOTE.replace('x torch', 'speedup_vs_torch'))}</p>")
    lat = _latency_plot(perf, reference_perf, variant)
    if lat:
        parts.append(img_tag(lat, "latency distribution per batch size"))
    methods = sorted({str(p.get("method")) for p in perf.values() if p.get("method")})
    if methods:
        parts.append("<p><small>" + "<br/>".join(html.escape(m) for m in methods) + "</small></p>")

    parts.append("<h2>Per-slice parity</h2>")
    key = key_metric(slice_table) if len(slice_table) else None
    if key:
        sp = _slice_plot(slice_table, key)
        if sp:
            parts.append(img_tag(sp, f"per-slice {key}"))
        cols = list(slice_table.columns)
        parts.append(html_table(cols, [[r[c] if c not in ("slice", "value") else str(r[c]) for c in cols]
                                   for r in slice_table.to_dict("records")], cls="slices"))
    else:
        parts.append("<p>No slices declared.</p>")

    if discovered is not None:
        parts.append("<h2>Discovered slices</h2>")
        if len(discovered):
            cols = list(discovered.columns)
            parts.append(html_table(cols, [[r[c] for c in cols]
                                       for r in discovered.to_dict("records")], cls="discovered"))
        else:
            parts.append("<p>No slice tested met the discovery criteria.</p>")
    if worst_samples is not None and len(worst_samples):
        parts.append(f"<h2>Worst validation rows (first {min(MAX_WORST_SAMPLES, len(worst_samples))} of "
                     f"{len(worst_samples)})</h2>")
        cols = list(worst_samples.columns)
        parts.append(html_table(cols, [[r[c] for c in cols] for r in
                                   worst_samples.head(MAX_WORST_SAMPLES).to_dict("records")], cls="worst"))
    parts.append("</body></html>")
    path.write_text("\n".join(parts), encoding="utf-8")
    return path
