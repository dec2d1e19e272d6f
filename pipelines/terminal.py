"""The terminal presentation shared by the CLI and the demo: the consoles, the end-of-run summary table, a search's
Pareto table and the progress bar of a local run (application layer, docs/architecture.md)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from rich.console import Console
from rich.table import Table

from tailguard.core.results import BuildStatus

if TYPE_CHECKING:
    from tailguard.components.register.summary import RunSummary, VariantSummary
    from tailguard.core.spec.root import Spec

# Wide enough for the summary table when output goes to a file or a CI log (no terminal to measure).
console = Console(stderr=False, highlight=False, width=None if sys.stdout.isatty() else 160)
err_console = Console(stderr=True, highlight=False, width=None if sys.stderr.isatty() else 160)


def int8_macs_cell(v: VariantSummary | None) -> str:
    """The summary's "int8 MACs" cell of a VariantSummary: the share of MACs in INT8 for INT8 variants ("100%";
    red with "!" under LOW_QUANTIZED_MAC_FRACTION; "?" when not recorded), "" for other variants."""
    from tailguard.components.register.summary import LOW_QUANTIZED_MAC_FRACTION

    if v is None or getattr(v, "precision", None) != "int8":
        return ""
    frac = getattr(v, "quantized_mac_fraction", None)
    if frac is None:
        return "?" if getattr(v, "status", "") == BuildStatus.OK else ""
    text = f"{frac:.0%}" if frac >= 0.995 or frac < 0.005 else f"{frac:.1%}"
    return f"[bold red]{text} ![/bold red]" if frac < LOW_QUANTIZED_MAC_FRACTION else text


_SUMMARY_NUMBERS = ("x torch", "x onnx fp32", "p50 ms", "p99 ms")
_SUMMARY_TEXT = ("worst slice", "gates", "registered", "promoted")


def _summary_cells(r: dict[str, Any], v: VariantSummary | None) -> dict[str, Any]:
    """A summary row's cells (str, or Text where the content must not be read as markup), by column name."""
    from rich.text import Text

    def num(x):
        return "" if x is None else (f"{x:.2f}" if isinstance(x, float) else str(x))
    def frac(x):
        return "-" if x is None else f"{x:.4f}"
    style = "green" if r["status"] == "passed" else ("yellow" if r["status"] == "skipped" else "red")
    timed = r["status"] in ("passed", "failed gates")
    return {"variant": Text(r["variant"]), "status": Text(r["status"], style=style),
            **{c: num(r[c]) for c in _SUMMARY_NUMBERS}, "int8 MACs": int8_macs_cell(v),
            "agreement": frac(r["agreement"]) if timed else "", "accuracy": frac(r["accuracy"]) if timed else "",
            **{c: Text(r[c]) for c in _SUMMARY_TEXT}}


def _fit_widths(minimum: list[int], maximum: list[int], available: int) -> list[int] | None:
    """Column content widths that sum to at most `available`: each column gets its minimum (its longest word),
    then the rest goes one cell at a time to the columns still below their maximum (their longest line), the
    most cramped first. None when the minimums alone do not fit."""
    if sum(minimum) > available:
        return None
    widths = list(minimum)
    spare = available - sum(widths)
    while spare > 0:
        wanting = [i for i, w in enumerate(widths) if w < maximum[i]]
        if not wanting:
            break
        i = max(wanting, key=lambda j: (maximum[j] - widths[j]) / max(maximum[j], 1))
        widths[i] += 1
        spare -= 1
    return widths


def summary_renderables(summary: RunSummary, width: int) -> list[Any]:
    """What `print_summary` prints before the gate legend, for a console `width` columns wide.

    The table (columns: variant, status, x torch, x onnx fp32, p50 ms, p99 ms, int8 MACs, agreement, accuracy,
    worst slice, gates, registered, promoted) when every column can be as wide as its longest word (widths from
    `_fit_widths`: cells wrap at spaces, never inside a word); else, on a narrow terminal, the title and one
    two-column block per variant (field, value), empty fields left out, so no word is folded either way.

    Args:
        summary: a RunSummary (components/register/summary.py).
        width: the console's width in character cells.

    Returns:
        rich renderables, in print order.
    """
    from rich.text import Text

    from tailguard.runner import summary_rows

    title = (f"{summary.source_model} v{summary.source_version} -> {summary.optimized_model} "
             f"(latency at batch {summary.batch_size})")
    rows = summary_rows(summary)
    variants = list(getattr(summary, "variants", None) or [])  # one per row, same order (summary_rows)
    cells = [_summary_cells(r, variants[i] if i < len(variants) else None) for i, r in enumerate(rows)]
    columns = ("variant", "status", *_SUMMARY_NUMBERS, "int8 MACs", "agreement", "accuracy", *_SUMMARY_TEXT)
    texts = {col: [Text(col), *[Text.from_markup(c[col]) if isinstance(c[col], str) else c[col] for c in cells]]
             for col in columns}
    widths = _fit_widths([max((len(w) for t in texts[col] for w in t.plain.split()), default=1) for col in columns],
                         [max((t.cell_len for t in texts[col]), default=1) for col in columns],
                         width - 3 * len(columns) - 1)  # per column: 2 of padding and 1 of border, + the last border
    if widths is not None:
        table = Table(title=title, show_lines=False)
        for col, w in zip(columns, widths):
            numeric = col in _SUMMARY_NUMBERS or col in ("int8 MACs", "agreement", "accuracy")
            table.add_column(col, justify="right" if numeric else "left", width=w)
        for c in cells:
            table.add_row(*[c[col] for col in columns])
        return [table]
    out: list[Any] = [Text(title, style="italic")]
    for c in cells:
        block = Table.grid(padding=(0, 1))
        block.add_column(style="dim", no_wrap=True)
        block.add_column(overflow="fold")
        for col in columns[2:]:
            value = c[col]
            if str(value) not in ("", "-") or (col in ("agreement", "accuracy", "worst slice") and str(value)):
                block.add_row(f"  {col}", value)  # "-" is kept where it says something (perfect, not measured)
        out += [Text.assemble((str(c["variant"]), "bold"), "  ", c["status"]), block]
    return out


def print_summary(summary: RunSummary) -> None:
    """The end-of-run summary: `summary_renderables` (a table, or per-variant blocks on a terminal too narrow for
    it), a legend of the gate ids, the variants' warnings, discovered slices, searches and task timings.

    Agreement and accuracy are the overall fractions ("-" when not measured: runner.summary_rows); the worst
    slice is "-" for a variant whose worst slice is perfect (runner.worst_slice_cell); the gates column names
    failed gates by short id (runner.gate_ids). Gate keys appear whole only in the legend, one per line and
    never folded (rich soft wrap), so no key is broken inside a token however narrow the terminal."""
    from rich.text import Text

    from tailguard.runner import gate_ids, summary_rows

    rows = summary_rows(summary)
    variants = list(getattr(summary, "variants", None) or [])
    from tailguard.core.hardware import ran_on_line

    if ran_on := ran_on_line(getattr(summary, "hardware", None)):  # "ran on: <cpu model> (<isa flags>), N cores"
        console.print(Text(ran_on, style="dim"))
    for w in getattr(summary, "warnings", None) or []:  # run-level, e.g. an unstable torch baseline
        console.print(Text.assemble(("! baselines", "bold red"), f": {w}"))
    for part in summary_renderables(summary, console.width):
        console.print(part)
    from tailguard.core.report import TASK_MARK, TASK_NOTE, TIMING_COLUMNS, rounds_line

    # prose: wrapped at spaces to the terminal's width (only the gate keys below are never cut)
    if line := rounds_line(getattr(summary, "promotion_comparison", None)):  # where the unmarked figures come from
        console.print(Text(line, style="dim"))
    if any(str(r[c] or "").endswith(TASK_MARK) for r in rows for c in TIMING_COLUMNS):
        console.print(Text(TASK_NOTE, style="dim"))
    for key, gid in gate_ids(summary).items():  # soft_wrap: the key is never cut, the terminal wraps the line
        console.print(Text.assemble(f"  {gid} = ", (key, "dim")), soft_wrap=True)
    if reason := getattr(summary, "promotion_reason", ""):  # how the variant to promote was chosen
        console.print(Text.assemble(("promotion", "bold"), f": {reason}"), soft_wrap=True)
    scored = [f"{v.variant} {v.rows_used}/{v.rows}" for v in variants
              if getattr(v, "rows_used", None) is not None and getattr(v, "rows", None)]
    if scored:  # sequential validation: the rows each variant needed before its gates were decided
        console.print(Text("rows scored: " + ", ".join(scored), style="dim"), soft_wrap=True)
    from rich.markup import escape

    flagged: dict[str, list[str]] = {}  # warning -> variants: the exporter's warnings hold for every variant
    for v in variants:  # e.g. an INT8 variant that quantized under half of its MACs (register.coverage_warnings)
        for w in getattr(v, "warnings", None) or []:
            flagged.setdefault(w, []).append(v.variant)
    for w, names in flagged.items():
        console.print(f"[bold red]! {escape(', '.join(names))}[/bold red]: {escape(w)}")
    for v in variants:  # INT8 numerics check (validate logic.compare_numerics): native kernels vs exact int32
        if (num := getattr(v, "numerics", None) or {}).get("status") in ("consistent", "hardware_dependent"):
            console.print(Text(f"numerics {v.variant}: {num['status']}: {num.get('reason', '')}", style="dim"))
    timed = [r for r in rows if r["status"] in ("passed", "failed gates")]
    if timed and all(r["x torch"] is None for r in timed):  # no torch baseline: the reference is an ONNX model
        from tailguard.core.report import TORCH_NOTE

        console.print(f"[dim]{TORCH_NOTE}[/dim]")
    found = [r for r in rows if r.get("discovered")]
    if found:
        console.print("[bold]discovered slices[/bold] (significantly worse than the rest, Benjamini-Hochberg):")
        for r in found:
            console.print(f"  {r['variant']}: {r['discovered']}")
    for search in getattr(summary, "searches", None) or []:
        print_search(search)
    from tailguard.runner import timings_line

    line = timings_line(getattr(summary, "tasks", None))
    if line:  # per-task seconds, cached / ran, the share in process start-up + imports (runner.task_timings)
        console.print(Text(line, style="dim"))
    redecide = (getattr(summary, "tasks", None) or {}).get("redecide") or {}
    if redecide.get("used"):  # a gate-only re-run (tailguard.rerun, components/redecide)
        console.print(Text(f"decided again on the stored measurements of run {redecide.get('from_run')}: only "
                           "gates or promotion changed (nothing built, measured or logged as a model again)",
                           style="dim"))


def print_search(search: dict) -> None:
    """One search's trial table (`tailguard.components.register.report.search_table`: trial, the configuration
    columns that differ between trials, p50 ms, worst-slice value, passed, front, chosen), the reason it stopped in
    the title and, under the table, the settings every trial shared and the families skipped as unable to
    differ."""
    from rich.text import Text

    from tailguard.components.register.report import search_table
    from tailguard.runner import search_title

    cols, rows, notes = search_table(search)
    table = Table(title=search_title(search), show_lines=False)
    for col in cols:
        table.add_column(col, overflow="fold")
    def fmt(v):
        return "" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))
    for r in rows:
        style = "green" if r["chosen"] else ("" if r["passed"] == "yes" else "red")
        table.add_row(*[Text(fmt(r[c]), style=style) for c in cols])  # Text: node names are never read as markup
    console.print(table)
    for note in notes:
        console.print(Text(note, style="dim"))


def run_with_progress(spec: Spec, model_version: Optional[str], cache: bool = True,
                      model_path: Optional[list[Path]] = None) -> Any:
    """`runner.run_local` with a progress bar of its tasks on `console`; returns its result (a RunResult)."""
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from tailguard.runner import run_local, task_count

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/"
                  "{task.total} tasks"), TimeElapsedColumn(), console=console, transient=False) as progress:
        bar = progress.add_task(f"{spec.metadata.name}: starting", total=task_count(spec))

        def on_event(task: str, state: str) -> None:
            if state == "running":
                if task == "redecide":  # a gate-only re-run: one task (tailguard.rerun)
                    progress.update(bar, total=1, completed=0)
                elif task == "check-data":  # the whole pipeline (also after a re-decide that could not decide)
                    progress.update(bar, total=task_count(spec), completed=0)
                progress.update(bar, description=f"{spec.metadata.name}: {task}")
            else:
                progress.advance(bar)
                if state != "success":
                    progress.console.print(f"  [red]{task}: {state}[/red]")

        return run_local(spec, model_version=model_version, on_event=on_event, cache=cache,
                         model_path=model_path or ())
