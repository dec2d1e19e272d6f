"""What tailguard's HTML reports share: escaping, tables, embedded plots, the report status colours, the key
parity metric and zoomed axes. The variant report (components/validate/report.py) and the parent run's report
(components/register/report.py) are built from these.

Plots are drawn with matplotlib's Agg backend and embedded as base64 PNGs, so a report can be opened from an MLflow
artifact or a KFP HTML visualization without anything beside it. Every piece of text that comes from data or the
spec (slice values, gate keys, variant names, statuses) is escaped with html.escape, also inside attributes; a
status used as a CSS class must be a `CellStatus` (anything else is drawn as `unknown`). Markdown text (the parent
run's MLflow description) is escaped with `markdown_text` so that no link, image or HTML can come from data. Plot
text is drawn with mathtext and TeX off (`no_mathtext`), so a slice value such as `$x$` is shown as written and
cannot break a plot.
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
from typing import Any, Callable, Iterable, Iterator, TypeVar

import numpy as np
import pandas as pd

from tailguard.core import metrics as _metrics

# key metric of the per-slice plot, per task (first one present in the table is used)
KEY_METRICS = ("top1_agreement", "nn_top1_agreement", "cosine_similarity.p01", "accuracy", "abs_error.max", "cer")


class CellStatus(StrEnum):
    """The statuses a report cell is coloured by (its CSS class): a gate's status (`tailguard.core.results.
    GateStatus`) or a variant's verdict. A status read from tags or files that is not one of these is drawn as
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
def no_mathtext_context() -> Iterator[None]:
    """A context in which matplotlib draws text as written (rcParams text.usetex and text.parse_math off)."""
    import matplotlib

    with matplotlib.rc_context({"text.usetex": False, "text.parse_math": False}):
        yield


def no_mathtext(fn: _F) -> _F:
    """Run a plotting function with matplotlib's mathtext and TeX off (rcParams text.parse_math / text.usetex):
    labels made of data (slice values, variant names) are drawn as written; `$x$` or an unbalanced `$` would
    otherwise be parsed as math, and a bad expression raises when the figure is saved."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with no_mathtext_context():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def value_text(v: Any) -> str:
    """A cell value as escaped HTML text: None "—", booleans yes/no, integers as they are, other numbers to 6
    significant digits (NaN "n/a", ±inf), anything else its str() escaped."""
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


def png_base64(fig: Any) -> str:
    """A matplotlib figure as base64 PNG text (90 dpi, tight box); the figure is closed."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def img_tag(b64: str, alt: str) -> str:
    """An <img> embedding base64 PNG text, its alt text escaped."""
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{b64}"/>'


def html_table(header: Iterable[str], rows: Iterable[Iterable[Any]], cls: str = "") -> str:
    """An escaped HTML table in a sideways-scrolling wrapper. A cell given as (text, status) is coloured by the
    status (its CSS class, checked by `cell_status`); other cells go through `value_text` (str cells escaped)."""
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = []
    for r in rows:
        cells = []
        for c in r:
            if isinstance(c, tuple):  # (text, status): the status, checked against CellStatus, is the CSS class
                cells.append(f'<td class="{cell_status(c[1]).value}">{html.escape(str(c[0]))}</td>')
            else:
                cells.append(f"<td>{value_text(c) if not isinstance(c, str) else html.escape(c)}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    # The wrapper scrolls sideways instead of overflowing a narrow frame (MLflow's artifact pane).
    return (f'<div class="tw"><table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody>'
            '</table></div>')


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


# The reports' style sheet: the status classes colour cells (CellStatus values) and banners (ok, bad, warn).
CSS = """
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

# Why the speed-up over torch is blank (both reports and the terminal summary say it).
TORCH_NOTE = ("x torch is blank when the reference is an ONNX model (model.source.format onnx): there is no torch "
              "model to time, so no torch baseline exists; x onnx fp32 compares with the ONNX FP32 reference.")


# One timing truth (issue 37): a variant's latency and speed-up cells come from the promotion's paired rounds
# (components/register/promotion.py `compare_passing`: the passing variants, torch eager and the ONNX FP32 export timed
# interleaved on the same batches); a figure marked TASK_MARK is the variant's own validate-task timing, a gate
# input timed at another time, shown only where the variant was not in the rounds (it failed a gate, or no rounds
# could be timed).
TASK_MARK = "*"
TASK_NOTE = (f"{TASK_MARK} the variant's own validate-task timing (a gate input, timed in its own task, not beside "
             "the others); unmarked latencies and speed-ups come from the promotion's paired rounds, "
             "x = speed-up [one-sided 95% bounds]")
TIMING_COLUMNS = ("x torch", "x onnx fp32", "p50 ms", "p99 ms")


def timing_cells(paired: dict | None, *, p50_ms: float | None, p99_ms: float | None,
                 speedup_vs_torch: float | None, speedup_vs_onnx_fp32: float | None) -> dict[str, str | None]:
    """The summary table's and the report's timing cells of one variant: {"x torch", "x onnx fp32", "p50 ms",
    "p99 ms"} as text, None where there is no figure.

    From the paired rounds when `paired` is given (`VariantSummary.paired`): p50 / p99 in ms ("3.68"), speed-ups
    with their one-sided 95% bounds ("1.52 [1.44,1.61]"); a speed-up whose baseline was not in the rounds falls
    back to the task figure. Else the task figures, each marked TASK_MARK ("6.72*").

    Args:
        paired: {"p50_ms", "p99_ms", "speedup_vs_torch": {"ratio", "lower", "upper"}, ...} or None.
        p50_ms, p99_ms, speedup_vs_torch, speedup_vs_onnx_fp32: the validate task's figures (ms; ratios), or None.
    """
    def task(x):
        return None if x is None else f"{x:.2f}{TASK_MARK}"
    if not paired:
        return {"x torch": task(speedup_vs_torch), "x onnx fp32": task(speedup_vs_onnx_fp32), "p50 ms": task(p50_ms),
                "p99 ms": task(p99_ms)}

    def ratio(key: str, fallback: float | None) -> str | None:
        r = paired.get(key)
        if not r:
            return task(fallback)
        return f"{r['ratio']:.2f} [{r['lower']:.2f},{r['upper']:.2f}]"  # a narrow column wraps before the bounds

    def fmt(x):
        return None if x is None else f"{x:.2f}"
    return {"x torch": ratio("speedup_vs_torch", speedup_vs_torch),
            "x onnx fp32": ratio("speedup_vs_onnx_fp32", speedup_vs_onnx_fp32),
            "p50 ms": fmt(paired.get("p50_ms")), "p99 ms": fmt(paired.get("p99_ms"))}


def rounds_line(comparison: dict | None) -> str:
    """One line on the promotion's paired rounds for the summary and the report: "timing: 80 paired rounds at
    batch 1 (4 variants, torch eager 8.12 ms, onnx fp32 3.70 ms p50; stopped by decided; CPU pressure 3%)";
    "" without a comparison."""
    if not comparison:
        return ""
    lat = comparison.get("latency") or {}
    base = ", ".join(f"{'torch eager' if b == 'torch' else b.replace('_', ' ')} {lat[b]['p50_ms']:.2f} ms"
                     for b in comparison.get("baselines") or [] if b in lat)
    n = len(comparison.get("p50_ms") or {})
    share = (comparison.get("cpu_pressure") or {}).get("some_share")
    return (f"timing: {comparison.get('rounds')} paired rounds at batch {comparison.get('batch_size')} "
            f"({n} passing variant{'s' if n != 1 else ''}" + (f"; baselines p50: {base}" if base else
                                                               "; no FP32 baseline in the rounds")
            + f"; stopped by {comparison.get('stopped_by')}"
            + (f"; CPU pressure {share:.0%}" if share is not None else "") + ")")
