"""One self-contained HTML report per variant: gates, overall parity, latency, per-slice parity, discovered
slices and the worst validation rows.

Plots are drawn with matplotlib's Agg backend and embedded as base64 PNGs, so the file can be opened from an
MLflow artifact or a KFP HTML visualization without anything beside it. Every piece of text that comes from
data or the spec (slice values, gate keys, variant names, statuses) is escaped with html.escape, also inside
attributes; a status used as a CSS class must be a `CellStatus` (anything else is drawn as `unknown`). The
parent run's MLflow description (`decision_note`) is Markdown: its values are escaped so that no link, image or
HTML can come from data. Plot text is drawn with mathtext and TeX off (`_plain_text`), so a slice value such as
`$x$` is shown as written and cannot break a plot.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import html
import io
import math
import re
from enum import StrEnum
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, TypeVar

import numpy as np
import pandas as pd

from tailguard.core import metrics as _metrics
from tailguard.core.contract import RUN_REPORT_FILE


MAX_SLICE_BARS = 30  # groups shown in the per-slice plot (the worst ones)
MAX_WORST_SAMPLES = 20  # rows of worst_samples shown in the report (the CSV holds analysis.worst_k)
# key metric of the per-slice plot, per task (first one present in the table is used)
KEY_METRICS = ("top1_agreement", "nn_top1_agreement", "cosine_similarity.p01", "accuracy", "abs_error.max")


class CellStatus(StrEnum):
    """The statuses a report cell is coloured by (its CSS class): a gate's status (components/validate/gates.py
    GateStatus) or a variant's verdict. A status read from tags or files that is not one of these is drawn as
    UNKNOWN, its text escaped: a crafted status never reaches the markup as is (issue 22)."""

    PASSED = "passed"
    FAILED = "failed"
    INSUFFICIENT_DATA = "insufficient_data"
    NOT_APPLICABLE = "not_applicable"
    UNDECIDED = "undecided"  # sequential validation stopped on another gate's failure first
    UNKNOWN = "unknown"


def cell_status(value: Any) -> CellStatus:
    """`value` as a CellStatus; UNKNOWN for anything else (text, None, other types)."""
    try:
        return CellStatus(value) if isinstance(value, str) else CellStatus.UNKNOWN
    except ValueError:
        return CellStatus.UNKNOWN


# CommonMark backslash-escapes these (spec 0.31, "Backslash escapes"): with them escaped, text from data cannot
# open a link or image ([..](..), ![..](..)), an autolink or raw HTML (<...>), code (`) or emphasis (*). `_`, `>`
# and `-` are left as they are: gate keys and metric names use them, and inside a line they start nothing.
_MD_SPECIAL = re.compile(r"([\\`*\[\]<])")


def markdown_text(text: Any) -> str:
    """`text` as literal Markdown: CommonMark specials backslash-escaped, line breaks flattened to spaces, and
    the slashes of `://` and the dot of `www.` escaped too, so GFM's autolinks make no link of a bare URL."""
    flat = " ".join(str(text).split())
    text = re.sub(r":(/)(/)", r":\\\1\\\2", _MD_SPECIAL.sub(r"\\\1", flat))
    return re.sub(r"(?i)\b(www)\.", r"\1\\.", text)


_F = TypeVar("_F", bound=Callable[..., Any])


@contextlib.contextmanager
def _plain_context() -> Iterator[None]:
    import matplotlib

    with matplotlib.rc_context({"text.usetex": False, "text.parse_math": False}):
        yield


def _plain_text(fn: _F) -> _F:
    """Run a plotting function with matplotlib's mathtext and TeX off (rcParams text.parse_math / text.usetex):
    labels made of data (slice values, variant names) are drawn as written; `$x$` or an unbalanced `$` would
    otherwise be parsed as math, and a bad expression raises when the figure is saved."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _plain_context():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


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
            if isinstance(c, tuple):  # (text, status): the status, checked against CellStatus, is the CSS class
                cells.append(f'<td class="{cell_status(c[1]).value}">{html.escape(str(c[0]))}</td>')
            else:
                cells.append(f"<td>{_fmt(c) if not isinstance(c, str) else html.escape(c)}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    # The wrapper scrolls sideways instead of overflowing a narrow frame (MLflow's artifact pane).
    return (f'<div class="tw"><table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody>'
            '</table></div>')


@_plain_text
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


def zoom_limits(values: Any, metric: str | None = None, *, pad_fraction: float = 0.08) -> tuple[float, float]:
    """Axis limits that span the finite `values` with a margin, instead of a fixed 0-1.

    Args:
        values: 1-D array-like of floats (NaN/inf ignored).
        metric: the metric plotted; for an agreement/accuracy/cosine metric (bounded by 1) the upper limit does not
            go past 1 + the margin.
        pad_fraction: margin on each side, as a fraction of the data range.

    Returns:
        (lo, hi) with lo < hi: e.g. values 0.984 and 1.0 give about (0.983, 1.001), not (0, 1). No finite value:
        (0, 1).
    """
    v = np.asarray(values, dtype=float).ravel()
    v = v[np.isfinite(v)]
    if v.size == 0:
        return 0.0, 1.0
    lo, hi = float(v.min()), float(v.max())
    span = hi - lo
    pad = span * pad_fraction if span > 0 else max(abs(hi) * 1e-3, 1e-6)
    lo, hi = lo - pad, hi + pad
    if (metric is not None and _metrics.higher_is_better(metric, default=True) and float(v.max()) <= 1.0
            and "speedup" not in metric and "throughput" not in metric):
        hi = min(hi, 1.0 + pad)
    return lo, hi


@_plain_text
def _slice_plot(slice_table: pd.DataFrame, metric: str) -> str | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = slice_table[slice_table["support"] > 0].copy()
    if t.empty:
        return None
    # a column the catalogue does not know is drawn as higher-is-better (display only)
    t = t.sort_values(metric, ascending=_metrics.higher_is_better(metric, default=True),
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
        ax.text(end, yi, f" {v:.4g}" if np.isfinite(v) else f" {_fmt(v)}", va="center", fontsize=7)
    ax.set_xlim(lo, hi)
    ax.set_yticks(y, labels, fontsize=7)
    ax.set_xlabel(f"{metric} (axis zoomed to the data)")
    worst = "lowest" if _metrics.higher_is_better(metric, default=True) else "highest"
    ax.set_title(f"per-slice {metric}: {worst} first (n = support)")
    ax.grid(axis="x", alpha=0.3)
    return _png(fig)


_CSS = """
body{font-family:system-ui,sans-serif;margin:1em;color:#222;max-width:100%;overflow-wrap:break-word}
.tw{max-width:100%;overflow-x:auto;margin:.5em 0 1.5em}
table{border-collapse:collapse;font-size:13px}
th,td{border:1px solid #ccc;padding:3px 8px;text-align:left;vertical-align:top}
th{white-space:nowrap}
td{max-width:32em;overflow-wrap:break-word}
img{max-width:100%;height:auto}
.note{color:#555;font-size:12px}
th{background:#f2f2f2}
td.passed{background:#d8f0d8}td.failed{background:#f6d2d2}
td.insufficient_data{background:#fff1c9}td.not_applicable{color:#888}td.undecided{color:#888;font-style:italic}td.unknown{background:#eee}
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


def _gate_detail(g: Any) -> str:
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
        worst_samples: `logic.worst_samples` output (the first MAX_WORST_SAMPLES rows are shown), or None.
        numerics: the numerics check (components/validate/logic.py `compare_numerics` / `not_checked`): a
            warning banner when `hardware_dependent`, else one line; None: nothing shown.

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
    if perf and all(p.get("speedup_vs_torch") is None for p in perf.values()):
        parts.append(f"<p class='note'>{html.escape(TORCH_NOTE.replace('x torch', 'speedup_vs_torch'))}</p>")
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


# --------------------------------------------------------------------------------------- run report (parent run)
MAX_HEAT_ROWS = 40  # slice groups in the heat map (the worst ones across variants)
TORCH_NOTE = ("x torch is blank when the reference is an ONNX model (model.source.format onnx): there is no torch "
              "model to time, so no torch baseline exists; x onnx fp32 compares with the ONNX FP32 reference.")
GATE_NAME_NOTE = ("Gate names are the spec's gate keys (metric, bound, @bs batch size, @lb95/@ub95 confidence "
                  "bound, @per_slice:slice / @discovered scope). MLflow tag keys cannot hold > = @, so a variant "
                  "run's tag gate.<key with >= as ' ge ', <= as ' le ', @ and : as spaces> holds the status and "
                  "gate_name.<same> holds the key as written here.")


def _g4(x: Any) -> Any:
    """A number to 4 significant digits for the run report's table and description (None and text unchanged)."""
    try:
        f = float(x)
    except (TypeError, ValueError):
        return x
    return float(f"{f:.4g}") if math.isfinite(f) else f


def _status_of(v: dict) -> str:
    """A variant row's one-word state: passed | failed gates | failed | skipped."""
    if v.get("status") != "ok":
        return str(v.get("status") or "failed")
    return "passed" if v.get("passed") else "failed gates"


def _ws_value(v: dict) -> float | None:
    ws = v.get("worst_slice") or {}
    val = ws.get("observed")
    try:
        f = float(val)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def decision_note(summary: dict[str, Any], *, markdown: bool = True) -> str:
    """The parent run's description (mlflow.note.content): the decision in two lines.

    Line 1: what moved (the promoted variant, its version, alias, p50 latency and worst slice) or why nothing did.
    Line 2: how many variants passed / failed / were skipped, the source and target models, where the report is.

    Args:
        summary: `RunSummary.to_dict()`.
        markdown: escape the text for Markdown (`markdown_text`: MLflow renders the description as Markdown, and
            variant names, reasons and slice values come from data); False for plain text (the HTML report's
            banner, which escapes it as HTML).

    Returns:
        Two lines joined by a newline (as Markdown each line ends with two spaces so it stays a line break).
    """
    variants = summary.get("variants") or []
    by_name = {v["variant"]: v for v in variants}
    alias = summary.get("alias", "")
    promoted = summary.get("promoted_variant")
    if promoted and summary.get("promoted_version"):
        v = by_name.get(promoted, {})
        ws = v.get("worst_slice") or {}
        obs = ws.get("observed")
        obs_text = f"{obs:.3f}" if isinstance(obs, (int, float)) else _fmt(obs)
        worst = f", worst slice {ws.get('slice')}={ws.get('value')} {ws.get('metric', '')} {obs_text}" if ws else ""
        line1 = (f"Promoted {promoted} as {summary.get('optimized_model')} v{summary['promoted_version']} "
                 f"@{alias}: p50 {_fmt(_g4(v.get('p50_ms')))} ms at batch {summary.get('batch_size')}{worst}.")
        if summary.get("promotion_reason"):  # how it was chosen (register.decide_promotion)
            line1 += f" Why: {summary['promotion_reason']}."
    elif summary.get("promotion") == "superseded":
        line1 = (f"Superseded: a variant passed, but @{alias} moved during the run to "
                 f"v{summary.get('alias_version')}, which wins the comparison; no alias moved.")
    elif not any(v.get("passed") for v in variants):
        failed = [f"{v['variant']} ({v.get('reason') or _status_of(v)})" for v in variants]
        line1 = "No alias moved: no variant passed every gate. " + "; ".join(failed)[:600]
    else:
        line1 = (f"Promotion is off: {sum(bool(v.get('passed')) for v in variants)} variant(s) passed and were "
                 "registered; no alias moved.")
    counts: dict[str, int] = {}
    for v in variants:
        counts[_status_of(v)] = counts.get(_status_of(v), 0) + 1
    line2 = (f"{len(variants)} variants: " + ", ".join(f"{n} {k}" for k, n in counts.items())
             + f". {summary.get('source_model')} v{summary.get('source_version')} -> {summary.get('optimized_model')}"
             f"; table, Pareto plot, gate matrix and per-slice heat map in {RUN_REPORT_FILE}.")
    if markdown:
        line1, line2 = markdown_text(line1), markdown_text(line2)
    return f"{line1}  \n{line2}"


def _pareto_front(points: list[tuple[float, float]], higher: bool) -> list[int]:
    """Indices of the points not dominated on (lower x, better y), sorted by x."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], -points[i][1] if higher else points[i][1]))
    front, best = [], None
    for i in order:
        y = points[i][1]
        if best is None or (y > best if higher else y < best):
            front.append(i)
            best = y
    return front


@_plain_text
def _run_pareto_plot(summary: dict[str, Any]) -> str | None:
    """Latency (p50 ms at the promotion batch size) vs worst-slice parity, one point per ok variant (green passed,
    red failed), the search trials in grey, the promoted variant starred. Axes zoomed to the data."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [v for v in summary.get("variants") or []
            if v.get("status") == "ok" and v.get("p50_ms") is not None and _ws_value(v) is not None]
    trials = [(float(t["p50_ms"]), float(t["worst_slice_value"])) for s in summary.get("searches") or []
              for t in s.get("trials") or []
              if t.get("p50_ms") is not None and t.get("worst_slice_value") is not None
              and math.isfinite(float(t["p50_ms"])) and math.isfinite(float(t["worst_slice_value"]))]
    if not rows:
        return None
    metric = next((v["worst_slice"].get("metric") for v in rows if v["worst_slice"].get("metric")), "worst slice")
    higher = _metrics.higher_is_better(str(metric), default=True)
    xs = [float(v["p50_ms"]) for v in rows]
    ys = [float(_ws_value(v)) for v in rows]  # type: ignore[arg-type]
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    if trials:
        ax.scatter([t[0] for t in trials], [t[1] for t in trials], s=14, color="#bbbbbb", label="search trials",
                   zorder=1)
    front = _pareto_front(list(zip(xs, ys)), higher)
    ax.plot([xs[i] for i in front], [ys[i] for i in front], color="#888888", ls="--", lw=1, zorder=2,
            label="Pareto front")
    for v, x, y in zip(rows, xs, ys):
        color = "#2a9d3a" if v.get("passed") else "#c0392b"
        ax.scatter([x], [y], s=40, color=color, zorder=3)
        ax.annotate(v["variant"], (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8)
        if v.get("promoted"):
            ax.scatter([x], [y], s=260, marker="*", facecolor="none", edgecolor="#d4a017", linewidths=1.8,
                       zorder=4, label=f"promoted ({v['variant']})")
    ax.set_xlim(*zoom_limits(xs + [t[0] for t in trials], pad_fraction=0.15))  # room for the labels
    ax.set_ylim(*zoom_limits(ys + [t[1] for t in trials], str(metric)))
    ax.set_xlabel(f"p50 latency (ms) at batch {summary.get('batch_size')}: lower is faster")
    ax.set_ylabel(f"worst-slice {metric}")
    ax.set_title("latency vs worst-slice parity (green passed, red failed; axes zoomed to the data)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    return _png(fig)


@_plain_text
def _heat_map(slice_tables: dict[str, pd.DataFrame]) -> tuple[str | None, str | None]:
    """Per-slice heat map: slice groups (rows, the MAX_HEAT_ROWS worst across variants) x variants (columns),
    colour = the key parity metric, colour scale zoomed to the data. Returns (png base64, metric)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tables = {k: t for k, t in slice_tables.items() if t is not None and len(t)}
    metric = next((key_metric(t) for t in tables.values() if key_metric(t)), None)
    if metric is None:
        return None, None
    cols: dict[str, pd.Series] = {}
    support: dict[str, Any] = {}
    for name, t in tables.items():
        if metric not in t.columns:
            continue
        t = t[t["support"] > 0]
        idx = [f"{s}={v}" for s, v in zip(t["slice"], t["value"])]
        cols[name] = pd.Series(t[metric].to_numpy(dtype=float), index=idx)
        support.update(dict(zip(idx, t["support"])))
    if not cols:
        return None, None
    grid = pd.DataFrame(cols)
    higher = _metrics.higher_is_better(metric, default=True)
    worst = grid.min(axis=1) if higher else grid.max(axis=1)
    grid = grid.loc[worst.sort_values(ascending=higher).index[:MAX_HEAT_ROWS]]
    vals = grid.to_numpy(dtype=float)
    lo, hi = zoom_limits(vals, metric, pad_fraction=0.0)
    fig, ax = plt.subplots(figsize=(1.6 + 1.3 * grid.shape[1], 0.3 * grid.shape[0] + 1.6))
    im = ax.imshow(np.ma.masked_invalid(vals), aspect="auto", vmin=lo, vmax=hi,
                   cmap="RdYlGn" if higher else "RdYlGn_r")
    ax.set_xticks(range(grid.shape[1]), list(grid.columns), rotation=30, ha="right", fontsize=8)
    ax.set_yticks(range(grid.shape[0]), [f"{i} (n={support.get(i)})" for i in grid.index], fontsize=7)
    for (r, c), v in np.ndenumerate(vals):
        ax.text(c, r, f"{v:.4g}" if np.isfinite(v) else "n/a", ha="center", va="center", fontsize=6)
    fig.colorbar(im, ax=ax, fraction=0.04, label=f"{metric} (scale zoomed to the data)")
    ax.set_title(f"per-slice {metric}: worst groups first", fontsize=9)
    return _png(fig), metric


# The configuration columns of a search's trial table: (column, how a trial record gives it).
SEARCH_CONFIG_COLUMNS = ("excluded nodes", "per_channel", "calibration", "float op types")
SEARCH_RESULT_COLUMNS = ("p50 ms", "worst slice", "passed", "front", "chosen")


def _trial_nodes(record: dict[str, Any]) -> str:
    """A trial's excluded_nodes (a list, or the JSON text trials.csv holds) as a short cell."""
    import json

    nodes = record.get("excluded_nodes")
    if isinstance(nodes, str):
        try:
            nodes = json.loads(nodes)
        except ValueError:
            return nodes
    if not nodes:
        return "-"
    nodes = [str(n) for n in nodes]
    return ", ".join(nodes) if len(nodes) <= 3 else f"{', '.join(nodes[:3])}, … ({len(nodes)})"


def _trial_float_types(record: dict[str, Any]) -> str:
    types = (record.get("config") or {}).get("float_op_types", record.get("float_op_types"))
    if isinstance(types, str):
        types = [t for t in types.split(",") if t]
    return ", ".join(map(str, types)) if types else "-"


def search_table(search: dict[str, Any]) -> tuple[list[str], list[dict[str, Any]], list[str]]:
    """One search's trial table as the terminal (`terminal.print_search`) and the run report show it.

    The configuration columns (SEARCH_CONFIG_COLUMNS: excluded nodes, per_channel, calibration method, float op
    types) are shown only when their value differs between trials: a column with one value in every trial is
    dropped and named in a note instead, so two trials never look identical while differing in a hidden column
    (issue 26: trials that differed only in float_op_types looked the same). The trial name and the result
    columns (SEARCH_RESULT_COLUMNS: p50 ms, worst-slice value of the key parity metric, passed, front, chosen)
    are always shown.

    Args:
        search: a search.json (`SearchResult.to_dict()`, an entry of `RunSummary.searches`).

    Returns:
        (columns, rows, notes): columns in order; one row per trial in trial order, {column: value} (p50 ms and
        worst slice floats or None, the rest str: passed "yes" | "no" | the trial's status, front "*" | "",
        chosen "<-" | ""); notes: one line per constant configuration column ("same in every trial: ...") and,
        when the search skipped families that could not differ, one line saying how many and why.
    """
    trials = search.get("trials") or []
    config = []
    for t in trials:
        method = t.get("calibration_method", (t.get("config") or {}).get("calibration_method"))
        config.append({"excluded nodes": _trial_nodes(t), "per_channel": str(t.get("per_channel", "")),
                       "calibration": method or "-", "float op types": _trial_float_types(t)})
    varying = [c for c in SEARCH_CONFIG_COLUMNS if len({cfg[c] for cfg in config}) > 1]
    constant = [c for c in SEARCH_CONFIG_COLUMNS if c not in varying]
    rows = []
    for t, cfg in zip(trials, config):
        status = t.get("status", "ok")
        rows.append({"trial": t.get("name", str(t.get("index", ""))), **{c: cfg[c] for c in varying},
                     "p50 ms": t.get("p50_ms"), "worst slice": t.get("worst_slice_value"),
                     "passed": ("yes" if t.get("passed") else "no") if status == "ok" else str(status),
                     "front": "*" if t.get("on_front") else "", "chosen": "<-" if t.get("chosen") else ""})
    notes = []
    if config and constant:
        notes.append("same in every trial: " + "; ".join(f"{c} {config[0][c]}" for c in constant))
    skipped = search.get("skipped") or []
    if skipped:
        dropped = search.get("dropped_op_types") or {}
        why = "; ".join(f"{', '.join(ts)}: {r}" for r, ts in _group_by_value(dropped).items())
        notes.append(f"{len(skipped)} famil{'y' if len(skipped) == 1 else 'ies'} of the search space skipped: "
                     f"cannot differ from a planned one" + (f" ({why})" if why else ""))
    return ["trial", *varying, *SEARCH_RESULT_COLUMNS], rows, notes


def _group_by_value(d: dict[str, str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for k, v in d.items():
        out.setdefault(v, []).append(k)
    return out


def _trial_table(search: dict[str, Any]) -> str:
    columns, rows, notes = search_table(search)
    text = "".join(f"<p class='note'>{html.escape(n)}</p>" for n in notes)
    return _table(columns, [[r[c] if r[c] != "<-" else "chosen" for c in columns] for r in rows],
                  cls="trials") + text


def run_report_html(summary: dict[str, Any] | None, *, run: dict[str, Any],
                    slice_tables: dict[str, pd.DataFrame] | None = None, links: dict[str, str] | None = None,
                    torch_baseline: bool | None = None, gate_names: dict[str, str] | None = None) -> str:
    """The parent run's report as one self-contained HTML page.

    Sections: the decision (banner), a table of all variants, the Pareto plot of p50 latency vs worst-slice parity
    (promoted point starred), the gate matrix (variant x gate), the per-slice heat map (slice group x variant), each
    search's trials, and links to the variant runs. Failed runs show their error and whatever variants were logged.

    Args:
        summary: `RunSummary.to_dict()`, or None when the run has none (it failed before the register step).
        run: parent run facts: run_id, experiment_id, status (FINISHED | FAILED | RUNNING | ...), note (its
            description), error (the failing task's message, if any), name, start (text).
        slice_tables: {variant: its slices.csv as a DataFrame (columns slice, value, support, metrics...)}.
        links: {variant: URL of its MLflow run}, shown as links.
        torch_baseline: whether a torch baseline was timed (False adds the note on the blank x torch column;
            None: unknown, the note is added when every x torch cell is blank).
        gate_names: {gate key as in summary: canonical spelling} when they differ (old runs).

    Returns:
        The HTML text; every value from data or the spec is escaped.
    """
    summary = summary or {}
    slice_tables = slice_tables or {}
    links = links or {}
    gate_names = gate_names or {}
    variants = summary.get("variants") or []
    title = f"tailguard run {run.get('name') or run.get('run_id', '')}"
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
             f"<style>{_CSS}</style></head><body>", f"<h1>{html.escape(title)}</h1>"]
    facts = [f"parent run {run.get('run_id', '?')}", f"status {run.get('status', '?')}"]
    if run.get("start"):
        facts.append(f"started {run['start']}")
    if summary:
        facts.append(f"{summary.get('source_model')} v{summary.get('source_version')} -> "
                     f"{summary.get('optimized_model')} @{summary.get('alias')}")
    parts.append(f"<p class='note'>{html.escape('; '.join(facts))}</p>")
    failed = str(run.get("status", "")).upper() == "FAILED" or not summary or bool(run.get("error"))
    if failed:
        msg = run.get("error") or run.get("note") or "the run ended before the register step wrote its summary"
        parts.append(f"<div class='banner bad'>FAILED: {html.escape(str(msg))}</div>")
    else:
        cls = "ok" if summary.get("promoted_version") else ("warn" if summary.get("promotion") == "superseded"
                                                            else "bad" if not any(v.get("passed") for v in variants)
                                                            else "warn")
        parts.append("<div class='banner " + cls + "'>"
                     + "<br/>".join(html.escape(x.strip())
                                    for x in decision_note(summary, markdown=False).split("\n")) + "</div>")

    parts.append("<h2>Variants</h2>")
    if variants:
        rows = []
        for v in variants:
            ws = v.get("worst_slice") or {}
            st = _status_of(v)
            gates = v.get("gates") or {}
            n_pass = sum(s == "passed" for s in gates.values())
            mac = v.get("quantized_mac_fraction")  # INT8 builds: share of MACs computed in INT8
            reason = "; ".join(str(x) for x in [v.get("reason"), *(v.get("warnings") or [])] if x)
            rows.append([v["variant"], v.get("backend"), v.get("precision"),
                         (st, "passed" if st == "passed" else "not_applicable" if st == "skipped" else "failed"),
                         *[_g4(v.get(k)) for k in ("speedup_vs_torch", "speedup_vs_onnx_fp32", "p50_ms", "p99_ms")],
                         f"{ws.get('slice')}={ws.get('value')}: {_fmt(_g4(ws.get('observed')))} "
                         f"(n={ws.get('support')})" if ws else "", _g4(mac),
                         f"{n_pass}/{len(gates)}" if gates else "-",
                         f"v{v['version']}" if v.get("version") else "",
                         f"@{summary.get('alias')} -> v{v['version']}" if v.get("promoted") else "",
                         reason])
        parts.append(_table(["variant", "backend", "precision", "status", "x torch", "x onnx fp32", "p50 ms",
                             "p99 ms", "worst slice", "INT8 MAC share", "gates passed", "registered", "promoted",
                             "reason / warnings"], rows, cls="variants"))
        blank_torch = all(v.get("speedup_vs_torch") is None for v in variants if v.get("status") == "ok")
        bs = summary.get("batch_size")
        where = f"batch {bs}" if bs else "the first benchmark batch size"
        notes = [f"Latency at {where}. The promoted column lists only the version this run moved the alias to; "
                 "registered lists every version it registered."]
        if torch_baseline is False or (torch_baseline is None and blank_torch):
            notes.append(TORCH_NOTE)
        parts.append("<p class='note'>" + "<br/>".join(html.escape(n) for n in notes) + "</p>")
    else:
        parts.append("<p>No variant was validated.</p>")

    pareto = _run_pareto_plot(summary) if variants else None
    parts.append("<h2>Latency vs worst-slice parity</h2>")
    parts.append(_img(pareto, "Pareto plot: latency vs worst-slice parity") if pareto else
                 "<p>No validated variant with a latency and a worst slice.</p>")

    parts.append("<h2>Gate matrix</h2>")
    gate_keys: list[str] = []
    for v in variants:
        for k in v.get("gates") or {}:
            if k not in gate_keys:
                gate_keys.append(k)
    if gate_keys:
        parts.append(_table(["variant", *[gate_names.get(k, k) for k in gate_keys]],
                            [[v["variant"], *[((v.get("gates") or {}).get(k, "-"),
                                               (v.get("gates") or {}).get(k, "not_applicable")) for k in gate_keys]]
                             for v in variants], cls="gate-matrix"))
        parts.append(f"<p class='note'>{html.escape(GATE_NAME_NOTE)}</p>")
    else:
        parts.append("<p>No gate was evaluated.</p>")

    parts.append("<h2>Per-slice parity</h2>")
    heat, metric = _heat_map(slice_tables)
    parts.append(_img(heat, f"per-slice {metric} heat map") if heat else "<p>No per-slice table was logged.</p>")

    for search in summary.get("searches") or []:
        parts.append(f"<h2>Search {html.escape(str(search.get('variant', '?')))}</h2>")
        parts.append(f"<p class='note'>{len(search.get('trials') or [])} trials; chosen "
                     f"{html.escape(str(search.get('chosen_name') or 'none'))}; stopped by "
                     f"{html.escape(str(search.get('stopped_by', '?')))}</p>")
        parts.append(_trial_table(search))

    parts.append("<h2>Variant runs</h2><ul>")
    for v in variants:
        if not v.get("run_id"):
            parts.append(f"<li>{html.escape(v['variant'])}: no run</li>")
            continue
        url = links.get(v["variant"])
        target = (f"<a href='{html.escape(url, quote=True)}' target='_blank' rel='noopener'>"
                  f"{html.escape(v['run_id'])}</a>" if url else html.escape(v["run_id"]))
        parts.append(f"<li>{html.escape(v['variant'])}: run {target} (its report.html has the gates' evidence, "
                     "latency and per-slice details)</li>")
    parts.append("</ul></body></html>")
    return "\n".join(parts)


def write_run_report(path: str | Path, summary: dict[str, Any] | None, **kwargs: Any) -> Path:
    """Write `run_report_html(summary, **kwargs)` to `path` (parent folders created). Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(run_report_html(summary, **kwargs), encoding="utf-8")
    return path
