"""The parent run's report: its MLflow description (`decision_note`, the decision in two lines) and report.html (all
variants, the Pareto plot of latency vs worst-slice parity, the gate matrix, the per-slice heat map, each search's
trials, links to the variant runs), built from the run summary and what the store holds. The register step logs
both when a run finishes (`log_run_report`); `tailguard report RUN_ID` (pipelines/run_report.py) rebuilds the page
for any parent run. Building blocks, escaping and plot conventions: tailguard.core.report."""

from __future__ import annotations

import html
import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from tailguard.core.contract import GATE_NAME_PREFIX, NOTE_TAG, REPORT_ERROR_TAG, RUN_REPORT_FILE
from tailguard.core.metrics import higher_is_better
from tailguard.core.report import (
    CSS,
    TASK_MARK,
    TASK_NOTE,
    TIMING_COLUMNS,
    TORCH_NOTE,
    html_table,
    img_tag,
    key_metric,
    markdown_text,
    no_mathtext,
    png_base64,
    rounds_line,
    timing_cells,
    value_text,
    zoom_limits,
)
from tailguard.core.results import BuildStatus, GateStatus, PromotionStatus

MAX_HEAT_ROWS = 40  # slice groups in the heat map (the worst ones across variants)
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
    if v.get("status") != BuildStatus.OK:
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
        obs_text = f"{obs:.3f}" if isinstance(obs, (int, float)) else value_text(obs)
        worst = f", worst slice {ws.get('slice')}={ws.get('value')} {ws.get('metric', '')} {obs_text}" if ws else ""
        line1 = (f"Promoted {promoted} as {summary.get('optimized_model')} v{summary['promoted_version']} "
                 f"@{alias}: p50 {value_text(_g4((v.get('paired') or {}).get('p50_ms') or v.get('p50_ms')))} ms "
                 f"at batch {summary.get('batch_size')}{worst}.")
        if summary.get("promotion_reason"):  # how it was chosen (register.decide_promotion)
            line1 += f" Why: {summary['promotion_reason']}."
    elif summary.get("promotion") == PromotionStatus.SUPERSEDED:
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


@no_mathtext
def _run_pareto_plot(summary: dict[str, Any]) -> str | None:
    """Latency (p50 ms at the promotion batch size) vs worst-slice parity, one point per ok variant (green passed,
    red failed), the search trials in grey, the promoted variant starred. Axes zoomed to the data."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [v for v in summary.get("variants") or []
            if v.get("status") == BuildStatus.OK and v.get("p50_ms") is not None and _ws_value(v) is not None]
    trials = [(float(t["p50_ms"]), float(t["worst_slice_value"])) for s in summary.get("searches") or []
              for t in s.get("trials") or []
              if t.get("p50_ms") is not None and t.get("worst_slice_value") is not None
              and math.isfinite(float(t["p50_ms"])) and math.isfinite(float(t["worst_slice_value"]))]
    if not rows:
        return None
    metric = next((v["worst_slice"].get("metric") for v in rows if v["worst_slice"].get("metric")), "worst slice")
    higher = higher_is_better(str(metric), default=True)
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
    return png_base64(fig)


@no_mathtext
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
    higher = higher_is_better(metric, default=True)
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
    return png_base64(fig), metric


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
    return html_table(columns, [[r[c] if r[c] != "<-" else "chosen" for c in columns] for r in rows],
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
             f"<style>{CSS}</style></head><body>", f"<h1>{html.escape(title)}</h1>"]
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
        superseded = summary.get("promotion") == PromotionStatus.SUPERSEDED
        cls = "ok" if summary.get("promoted_version") else ("warn" if superseded
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
            n_pass = sum(s == GateStatus.PASSED for s in gates.values())
            mac = v.get("quantized_mac_fraction")  # INT8 builds: share of MACs computed in INT8
            reason = "; ".join(str(x) for x in [v.get("reason"), *(v.get("warnings") or [])] if x)
            # one timing truth (issue 37): the promotion's paired rounds, else the task's figures marked "*"
            cells = timing_cells(v.get("paired"), p50_ms=v.get("p50_ms"), p99_ms=v.get("p99_ms"),
                                 speedup_vs_torch=v.get("speedup_vs_torch"),
                                 speedup_vs_onnx_fp32=v.get("speedup_vs_onnx_fp32"))
            promoted = f"@{summary.get('alias')} -> v{v['version']}" if v.get("promoted") else ""
            if (v.get("paired") or {}).get("tied"):
                promoted = f"{promoted} tied".strip()
            rows.append([v["variant"], v.get("backend"), v.get("precision"),
                         (st, "passed" if st == "passed" else "not_applicable" if st == "skipped" else "failed"),
                         *[cells[c] or "" for c in TIMING_COLUMNS],
                         f"{ws.get('slice')}={ws.get('value')}: {value_text(_g4(ws.get('observed')))} "
                         f"(n={ws.get('support')})" if ws else "", _g4(mac),
                         f"{n_pass}/{len(gates)}" if gates else "-",
                         f"v{v['version']}" if v.get("version") else "",
                         promoted, reason])
        parts.append(html_table(["variant", "backend", "precision", "status", "x torch", "x onnx fp32", "p50 ms",
                             "p99 ms", "worst slice", "INT8 MAC share", "gates passed", "registered", "promoted",
                             "reason / warnings"], rows, cls="variants"))
        blank_torch = all(v.get("speedup_vs_torch") is None for v in variants if v.get("status") == BuildStatus.OK)
        bs = summary.get("batch_size")
        where = f"batch {bs}" if bs else "the first benchmark batch size"
        notes = [f"Latency at {where}. The promoted column lists only the version this run moved the alias to; "
                 "registered lists every version it registered."]
        if line := rounds_line(summary.get("promotion_comparison")):
            notes.append(line)
        if any(str(r[4 + i]).endswith(TASK_MARK) for r in rows for i in range(len(TIMING_COLUMNS))):
            notes.append(TASK_NOTE)
        if torch_baseline is False or (torch_baseline is None and blank_torch):
            notes.append(TORCH_NOTE)
        parts.append("<p class='note'>" + "<br/>".join(html.escape(n) for n in notes) + "</p>")
    else:
        parts.append("<p>No variant was validated.</p>")

    pareto = _run_pareto_plot(summary) if variants else None
    parts.append("<h2>Latency vs worst-slice parity</h2>")
    parts.append(img_tag(pareto, "Pareto plot: latency vs worst-slice parity") if pareto else
                 "<p>No validated variant with a latency and a worst slice.</p>")

    parts.append("<h2>Gate matrix</h2>")
    gate_keys: list[str] = []
    for v in variants:
        for k in v.get("gates") or {}:
            if k not in gate_keys:
                gate_keys.append(k)
    if gate_keys:
        parts.append(html_table(["variant", *[gate_names.get(k, k) for k in gate_keys]],
                            [[v["variant"], *[((v.get("gates") or {}).get(k, "-"),
                                               (v.get("gates") or {}).get(k, "not_applicable")) for k in gate_keys]]
                             for v in variants], cls="gate-matrix"))
        parts.append(f"<p class='note'>{html.escape(GATE_NAME_NOTE)}</p>")
    else:
        parts.append("<p>No gate was evaluated.</p>")

    parts.append("<h2>Per-slice parity</h2>")
    heat, metric = _heat_map(slice_tables)
    parts.append(img_tag(heat, f"per-slice {metric} heat map") if heat else "<p>No per-slice table was logged.</p>")

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


# -------------------------------------------------------------------- from the store (register, `tailguard report`)
LOCAL_UI_URL = "http://127.0.0.1:5000"  # where `mlflow ui` serves a local store by default: the report's run links


def gate_statuses(tags: dict[str, str]) -> dict[str, str]:
    """{gate key as the spec and docs spell it: status} from a variant run's tags.

    `gate.<sanitised key>` holds the status; `gate_name.<sanitised key>` holds the canonical key (runs logged
    before that tag existed fall back to the sanitised key).
    """
    out = {}
    for k, val in tags.items():
        if k.startswith("gate."):
            short = k[len("gate."):]
            out[tags.get(GATE_NAME_PREFIX + short, short)] = val
    return out


def run_url(tracking_uri: str, experiment_id: str, run_id: str, ui_url: str | None = None) -> str:
    """The MLflow UI address of a run: under `ui_url`, else the tracking server (http/https URIs), else
    LOCAL_UI_URL (`mlflow ui` on a local store)."""
    base = ui_url or (tracking_uri if tracking_uri.startswith(("http://", "https://")) else LOCAL_UI_URL)
    return f"{base.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"


def report_inputs(client: Any, summary: dict[str, Any], *, tracking_uri: str,
                  ui_url: str | None = None) -> dict[str, Any]:
    """What `run_report_html` needs beyond the summary, read from the store: each variant's slices.csv
    (skipped when absent or unreadable), links to the variant runs, and whether a torch baseline was timed
    (a `baseline.torch.*` metric on the parent run).

    Args:
        client: an MlflowClient on the run's store.
        summary: `RunSummary.to_dict()` (or a partial one with parent_run_id, experiment_id and variants).
        tracking_uri: the store's URI (for the links).
        ui_url: the MLflow UI base URL for the links (default: see `run_url`).

    Returns:
        {slice_tables, links, torch_baseline} keyword arguments.
    """
    import tempfile

    from mlflow.exceptions import MlflowException

    tables, links = {}, {}
    exp = summary.get("experiment_id", "")
    for v in summary.get("variants") or []:
        run_id = v.get("run_id")
        if not run_id:
            continue
        links[v["variant"]] = run_url(tracking_uri, exp, run_id, ui_url)
        if v.get("status") != BuildStatus.OK:
            continue
        try:
            with tempfile.TemporaryDirectory() as tmp:
                tables[v["variant"]] = _read_slices_csv(client.download_artifacts(run_id, "slices.csv", tmp))
        except (MlflowException, OSError, ValueError):  # no per-slice table: the heat map goes without it
            continue
    parent = client.get_run(summary["parent_run_id"])
    torch_baseline = any(k.startswith("baseline.torch.") for k in parent.data.metrics)
    return {"slice_tables": tables, "links": links, "torch_baseline": torch_baseline}


def _read_slices_csv(path: str) -> Any:
    """A slices.csv as a DataFrame, slice values kept as text (a value '01' stays '01')."""
    import pandas as pd

    return pd.read_csv(path, dtype={"slice": str, "value": str})


def log_run_report(client: Any, summary: dict[str, Any], *, tracking_uri: str) -> None:
    """Give the parent run its description (mlflow.note.content: `decision_note`, the decision in two lines)
    and its report.html (all variants, Pareto plot, gate matrix, per-slice heat map, search trials, run links).

    The description is set first; a report that cannot be built (an unreadable artifact, a plotting error) does
    not fail the run that registered and promoted: the error goes to tag tailguard.report_error and stderr, and
    `tailguard report RUN_ID` can rebuild the report from the store later.
    """
    import sys
    import tempfile
    import time


    run_id = summary["parent_run_id"]
    client.set_tag(run_id, NOTE_TAG, decision_note(summary))
    try:
        parent = client.get_run(run_id)
        run = {"run_id": run_id, "experiment_id": summary.get("experiment_id"), "status": "FINISHED",
               "name": parent.info.run_name,
               "start": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(parent.info.start_time / 1000))}
        with tempfile.TemporaryDirectory() as tmp:
            path = write_run_report(f"{tmp}/{RUN_REPORT_FILE}", summary, run=run,
                                    **report_inputs(client, summary, tracking_uri=tracking_uri))
            client.log_artifact(run_id, str(path))
    except Exception as exc:  # noqa: BLE001 - see the docstring: the report is rebuilt by `tailguard report`
        client.set_tag(run_id, REPORT_ERROR_TAG, f"{type(exc).__name__}: {exc}"[:4000])
        print(f"tailguard: the run report could not be written: {type(exc).__name__}: {exc}", file=sys.stderr)
