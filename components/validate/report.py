"""One self-contained HTML report per variant: gates, overall parity, latency, per-slice parity, discovered
slices and the worst validation rows.

Plots are drawn with matplotlib's Agg backend and embedded as base64 PNGs, so the file can be opened from an
MLflow artifact or a KFP HTML visualization without anything beside it. Every piece of text that comes from
data or the spec (slice values, gate keys, variant names) is escaped with html.escape.
"""

from __future__ import annotations

import base64
import html
import io
import math
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import pandas as pd

from .gates import GateResult

MAX_SLICE_BARS = 30  # groups shown in the per-slice plot (the worst ones)
MAX_WORST_SAMPLES = 20  # rows of worst_samples shown in the report (the CSV holds analysis.worst_k)
HIGHER_IS_BETTER = ("accuracy", "agreement", "cosine_similarity", "speedup", "throughput")
# key metric of the per-slice plot, per task (first one present in the table is used)
KEY_METRICS = ("top1_agreement", "nn_top1_agreement", "cosine_similarity.p01", "accuracy", "abs_error.max")


def higher_is_better(metric: str) -> bool:
    """True for agreement/accuracy/cosine/throughput/speedup metrics, False for errors, KL, latency and cost."""
    return any(p in metric for p in HIGHER_IS_BETTER)


def _fmt(v: Any) -> str:
    if v is None:
        return "—"
    if isinstance(v, (bool, np.bool_)):
        return "yes" if v else "no"
    if isinstance(v, (int, np.integer)):
        return str(int(v))
    try:
        f = float(v)
    except (TypeError, ValueError):
        return html.escape(str(v))
    if math.isnan(f):
        return "n/a"
    if math.isinf(f):
        return "inf" if f > 0 else "-inf"
    return f"{f:.6g}"


def _png(fig: Any) -> str:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _img(b64: str, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{b64}"/>'


def _table(header: Iterable[str], rows: Iterable[Iterable[Any]], cls: str = "") -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = []
    for r in rows:
        cells = []
        for c in r:
            if isinstance(c, tuple):  # (text, css class): already-decided styling
                cells.append(f'<td class="{c[1]}">{html.escape(str(c[0]))}</td>')
            else:
                cells.append(f"<td>{_fmt(c) if not isinstance(c, str) else html.escape(c)}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'


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
    return _png(fig)


def key_metric(slice_table: pd.DataFrame) -> str | None:
    """The per-slice metric plotted (and used for the worst slice): the first of KEY_METRICS in the table."""
    for m in KEY_METRICS:
        if m in slice_table.columns:
            return m
    extra = [c for c in slice_table.columns if c not in ("slice", "value", "support")]
    return extra[0] if extra else None


def _slice_plot(slice_table: pd.DataFrame, metric: str) -> str | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = slice_table[slice_table["support"] > 0].copy()
    if t.empty:
        return None
    t = t.sort_values(metric, ascending=higher_is_better(metric), na_position="last").head(MAX_SLICE_BARS)
    vals = t[metric].to_numpy(dtype=float)
    finite = np.where(np.isfinite(vals), vals, np.nan)
    labels = [f"{s}={v} (n={n})" for s, v, n in zip(t["slice"], t["value"], t["support"])]
    fig, ax = plt.subplots(figsize=(7.5, 0.32 * len(t) + 1.2))
    y = np.arange(len(t))[::-1]
    ax.barh(y, np.nan_to_num(finite, nan=0.0), color="#4c72b0")
    for yi, v, bar in zip(y, vals, np.nan_to_num(finite, nan=0.0)):
        ax.text(bar, yi, f" {v:.4g}" if np.isfinite(v) else f" {_fmt(v)}", va="center", fontsize=7)
    ax.set_yticks(y, labels, fontsize=7)
    ax.set_xlabel(metric)
    worst = "lowest" if higher_is_better(metric) else "highest"
    ax.set_title(f"per-slice {metric}: {worst} first (n = support)")
    ax.grid(axis="x", alpha=0.3)
    return _png(fig)


_CSS = """
body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.5em;font-size:13px}
th,td{border:1px solid #ccc;padding:3px 8px;text-align:left}
th{background:#f2f2f2}
td.passed{background:#d8f0d8}td.failed{background:#f6d2d2}
td.insufficient_data{background:#fff1c9}td.not_applicable{color:#888}
.banner{padding:.6em 1em;border-radius:4px;margin:.5em 0;font-weight:600}
.ok{background:#d8f0d8}.bad{background:#f6d2d2}.warn{background:#fff1c9}
"""


def _group_text(f: dict) -> str:
    if "bound" in f:
        inner = f"estimate {_fmt(f.get('estimate'))}, bound {_fmt(f.get('bound'))}"
    else:
        inner = _fmt(f.get("observed"))
    if "threshold" in f:
        inner += f", threshold {_fmt(f.get('threshold'))}"
    return f"{f['slice']}={f['value']} ({inner}, n={f['support']})"


def _gate_detail(g: GateResult) -> str:
    d = g.detail or {}
    parts = []
    if d.get("reason"):
        parts.append(str(d["reason"]))
    if d.get("reference_score") is not None:
        parts.append(f"reference score {_fmt(d['reference_score'])}, max_drop {_fmt(d.get('max_drop'))}")
    if d.get("failing"):
        parts.append("failing: " + ", ".join(_group_text(f) for f in d["failing"][:20])
                     + (f" … +{len(d['failing']) - 20}" if len(d["failing"]) > 20 else ""))
    if d.get("insufficient"):
        parts.append(f"insufficient (< {g.min_support} rows): " + ", ".join(
            f"{f['slice']}={f['value']} (n={f['support']})" for f in d["insufficient"][:20])
            + (f" … +{len(d['insufficient']) - 20}" if len(d["insufficient"]) > 20 else ""))
    return "; ".join(parts)


def write_report(path: str | Path, *, variant: str, overall: dict, slice_table: pd.DataFrame,
                 gates: list[GateResult], perf: dict[int, dict], reference_perf: dict | None = None,
                 passed: bool | None = None, discovered: pd.DataFrame | None = None,
                 worst_samples: pd.DataFrame | None = None) -> Path:
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
        worst_samples: `logic.worst_samples` output (the first MAX_WORST_SAMPLES rows are shown), or None.

    Returns:
        The path written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if passed is None:
        passed = not any(g.status in ("failed", "insufficient_data") for g in gates)
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>tailguard: {html.escape(variant)}"
             f"</title><style>{_CSS}</style></head><body>",
             f"<h1>Variant {html.escape(variant)}</h1>",
             f"<div class='banner {'ok' if passed else 'bad'}'>{'PASSED' if passed else 'FAILED'}: "
             f"{sum(g.status == 'passed' for g in gates)} passed, {sum(g.status == 'failed' for g in gates)} "
             f"failed, {sum(g.status == 'insufficient_data' for g in gates)} insufficient data, "
             f"{sum(g.status == 'not_applicable' for g in gates)} not applicable</div>"]
    insufficient = [g for g in gates if g.status == "insufficient_data"]
    if insufficient:
        parts.append("<div class='banner warn'>Not judged (no group with enough support), so the variant is not "
                     "promoted: "
                     + html.escape(", ".join(g.gate for g in insufficient)) + "</div>")

    parts.append("<h2>Gates</h2>")
    parts.append(_table(
        ["gate", "metric", "scope", "batch size", "threshold", "estimate", "bound", "observed", "status",
         "method", "detail"],
        [[g.gate, g.metric, g.scope + (f" ({g.slice})" if g.slice else ""), g.batch_size,
          f"{g.op} {_fmt(g.threshold)}", g.estimate,
          f"{_fmt(g.bound)} ({g.confidence * 100:g}%)" if g.confidence is not None else None,
          g.observed, (g.status, g.status), g.method, _gate_detail(g)]
         for g in gates], cls="gates"))

    parts.append("<h2>Overall</h2>")
    parts.append(_table(["metric", "value"], [[k, v] for k, v in overall.items()], cls="overall"))

    parts.append("<h2>Latency</h2>")
    perf_cols = ["latency_ms.p50", "latency_ms.p95", "latency_ms.p99", "latency_ms.mean", "throughput_per_s",
                 "usd_per_1m_inferences", "speedup_vs_torch", "speedup_vs_onnx_fp32", "n_iterations"]
    parts.append(_table(["batch size", *perf_cols],
                        [[bs, *[perf[bs].get(c) for c in perf_cols]] for bs in perf], cls="perf"))
    lat = _latency_plot(perf, reference_perf, variant)
    if lat:
        parts.append(_img(lat, "latency distribution per batch size"))
    methods = sorted({str(p.get("method")) for p in perf.values() if p.get("method")})
    if methods:
        parts.append("<p><small>" + "<br/>".join(html.escape(m) for m in methods) + "</small></p>")

    parts.append("<h2>Per-slice parity</h2>")
    key = key_metric(slice_table) if len(slice_table) else None
    if key:
        sp = _slice_plot(slice_table, key)
        if sp:
            parts.append(_img(sp, f"per-slice {key}"))
        cols = list(slice_table.columns)
        parts.append(_table(cols, [[r[c] if c not in ("slice", "value") else str(r[c]) for c in cols]
                                   for r in slice_table.to_dict("records")], cls="slices"))
    else:
        parts.append("<p>No slices declared.</p>")

    if discovered is not None:
        parts.append("<h2>Discovered slices</h2>")
        if len(discovered):
            cols = list(discovered.columns)
            parts.append(_table(cols, [[r[c] for c in cols]
                                       for r in discovered.to_dict("records")], cls="discovered"))
        else:
            parts.append("<p>No candidate slice met the discovery criteria.</p>")
    if worst_samples is not None and len(worst_samples):
        parts.append(f"<h2>Worst validation rows (first {min(MAX_WORST_SAMPLES, len(worst_samples))} of "
                     f"{len(worst_samples)})</h2>")
        cols = list(worst_samples.columns)
        parts.append(_table(cols, [[r[c] for c in cols] for r in
                                   worst_samples.head(MAX_WORST_SAMPLES).to_dict("records")], cls="worst"))
    parts.append("</body></html>")
    path.write_text("\n".join(parts), encoding="utf-8")
    return path
