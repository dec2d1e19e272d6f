"""The terminal presentation shared by the CLI and the demo: the consoles, the end-of-run summary table, a search's
Pareto table and the progress bar of a local run (application layer, docs/architecture.md)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

from rich.console import Console
from rich.table import Table

# Wide enough for the summary table when output goes to a file or a CI log (no terminal to measure).
console = Console(stderr=False, highlight=False, width=None if sys.stdout.isatty() else 160)
err_console = Console(stderr=True, highlight=False, width=None if sys.stderr.isatty() else 160)


def int8_macs_cell(v: Any) -> str:
    """The summary's "int8 MACs" cell of a VariantSummary: the share of MACs in INT8 for INT8 variants ("100%";
    red with "!" under LOW_QUANTIZED_MAC_FRACTION; "?" when not recorded), "" for other variants."""
    from tailguard.components.register.logic import LOW_QUANTIZED_MAC_FRACTION

    if v is None or getattr(v, "precision", None) != "int8":
        return ""
    frac = getattr(v, "quantized_mac_fraction", None)
    if frac is None:
        return "?" if getattr(v, "status", "") == "ok" else ""
    text = f"{frac:.0%}" if frac >= 0.995 or frac < 0.005 else f"{frac:.1%}"
    return f"[bold red]{text} ![/bold red]" if frac < LOW_QUANTIZED_MAC_FRACTION else text


def print_summary(summary: Any) -> None:
    """The end-of-run table."""
    from tailguard.runner import summary_rows

    table = Table(title=f"{summary.source_model} v{summary.source_version} -> {summary.optimized_model} "
                        f"(latency at batch {summary.batch_size})", show_lines=False)
    rows = summary_rows(summary)
    variants = list(getattr(summary, "variants", None) or [])  # one per row, same order (summary_rows)
    for col in ("variant", "status", "x torch", "x onnx fp32", "p50 ms", "p99 ms", "int8 MACs", "worst slice",
                "gates", "registered", "promoted"):
        table.add_column(col, overflow="fold")
    for i, r in enumerate(rows):
        fmt = lambda v: "" if v is None else (f"{v:.2f}" if isinstance(v, float) else str(v))  # noqa: E731
        style = "green" if r["status"] == "passed" else ("yellow" if r["status"] == "skipped" else "red")
        table.add_row(*[fmt(r[c]) for c in ("variant",)], f"[{style}]{r['status']}[/{style}]",
                      *[fmt(r[c]) for c in ("x torch", "x onnx fp32", "p50 ms", "p99 ms")],
                      int8_macs_cell(variants[i] if i < len(variants) else None),
                      *[fmt(r[c]) for c in ("worst slice", "gates", "registered", "promoted")])
    console.print(table)
    for v in variants:  # e.g. an INT8 variant that quantized under half of its MACs (register.coverage_warnings)
        for w in getattr(v, "warnings", None) or []:
            console.print(f"[bold red]! {v.variant}[/bold red]: {w}")
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
    from rich.text import Text

    from tailguard.runner import timings_line

    line = timings_line(getattr(summary, "tasks", None))
    if line:  # per-task seconds, cached / ran, the share in process start-up + imports (runner.task_timings)
        console.print(Text(line, style="dim"))


def print_search(search: dict) -> None:
    """One search's Pareto table (trial, excluded nodes, per_channel, p50 ms, worst-slice value, passed, front,
    chosen) and the reason it stopped."""
    from rich.text import Text

    from tailguard.runner import search_rows, search_title

    cols = ("trial", "excluded nodes", "per_channel", "p50 ms", "worst slice", "passed", "front", "chosen")
    table = Table(title=search_title(search), show_lines=False)
    for col in cols:
        table.add_column(col, overflow="fold")
    fmt = lambda v: "" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))  # noqa: E731
    for r in search_rows(search):
        style = "green" if r["chosen"] else ("" if r["passed"] == "yes" else "red")
        cells = [fmt(r[c]) for c in cols]
        table.add_row(*[Text(c, style=style) for c in cells])  # Text: node names are never read as markup
    console.print(table)


def run_with_progress(spec: Any, model_version: Optional[str], cache: bool = True,
                      model_path: Optional[list[Path]] = None) -> Any:
    """`runner.run_local` with a progress bar of its tasks on `console`; returns its result (a RunResult)."""
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from tailguard.runner import run_local, task_count

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/"
                  "{task.total} tasks"), TimeElapsedColumn(), console=console, transient=False) as progress:
        bar = progress.add_task(f"{spec.metadata.name}: starting", total=task_count(spec))

        def on_event(task: str, state: str) -> None:
            if state == "running":
                progress.update(bar, description=f"{spec.metadata.name}: {task}")
            else:
                progress.advance(bar)
                if state != "success":
                    progress.console.print(f"  [red]{task}: {state}[/red]")

        return run_local(spec, model_version=model_version, on_event=on_event, cache=cache,
                         model_path=model_path or ())
