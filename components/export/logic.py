"""torch -> ONNX export, the check of the export against the source model, and the check of an ONNX reference.

Three entry points, all importable without KFP:

- `export_onnx`: torch.nn.Module -> one .onnx file, with the spec's input/output names and named dynamic axes.
- `check_export`: runs the source model and the ONNX graph on the same batches and compares *every* output with
  |onnx - torch| <= atol + rtol * |torch| (the numpy.allclose rule); any failure raises `ExportMismatchError`
  listing every output and its max difference. A failed check is never downgraded to a warning (STYLE.md item 8,
  after optimum's `validate_model_outputs` and optimum issue 1755).
- `check_onnx_file`: an ONNX reference taken from the registry is checked (onnx.checker, path-based so external
  data works) and loaded in ONNX Runtime; a corrupt file raises `InputError` naming it.
- `check_declared_outputs`: `model.outputs` (dtype, rank, fixed sizes) against the ONNX graph's outputs and
  against what it returns on a batch; a mismatch raises `SpecError` (exit 2) with the declaration that fits.
  The export task runs it on every export and on every ONNX reference (components/export/signature.py).

`export_onnx` also records the torch exporter's warnings about the model (TracerWarnings: a value traced as a
constant) in its facts (`warnings`), which the build copies into each variant's warnings (the run summary).
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

from tailguard.core.contract import ONNX_INLINE_LIMIT_BYTES as TWO_GB
from tailguard.core.errors import ExportMismatchError, InputError, StepError
from tailguard.core.runtime import OrtRunner, Runner

if TYPE_CHECKING:
    from tailguard.core.spec.model import ModelSpec


# ------------------------------------------------------------------------------------------------ export
def dynamic_axes_from_spec(spec: ModelSpec) -> dict[str, dict[int, str]]:
    """Named dynamic axes per input/output: every axis the spec gives as a string (e.g. "batch", "sequence").

    Args:
        spec: a `tailguard.core.spec.model.ModelSpec`.

    Returns:
        {tensor name: {axis index: axis name}}; tensors without dynamic axes are left out.
    """
    out: dict[str, dict[int, str]] = {}
    for t in [*spec.inputs, *spec.outputs]:
        axes = {i: ax for i, ax in enumerate(t.shape) if isinstance(ax, str)}
        if axes:
            out[t.name] = axes
    return out


def dummy_feeds(spec: ModelSpec, *, batch: int = 2, length: int = 4) -> dict[str, np.ndarray]:
    """Feeds made from the spec's input shapes alone (no data), for tracing an export.

    Args:
        spec: a `tailguard.core.spec.model.ModelSpec` (inputs: name, dtype, shape with batch first).
        batch: size of the batch axis (the first axis). At least 2 keeps torch.export from specializing it.
        length: size of every other named axis (e.g. `sequence`), at least 2 for the same reason.

    Returns:
        {input name: array of the input's dtype}, e.g. image (2, 1, 8, 8) float32 for `[batch, 1, 8, 8]`,
        frames (2, 4, 80) for `[batch, sequence, 80]`; filled with `value_range`'s lower bound, else 0.
    """
    from tailguard.core.data import NP_DTYPES

    feeds = {}
    for t in spec.inputs:
        dims = [batch] + [d if isinstance(d, int) else length for d in list(t.shape)[1:]]
        fill = t.value_range[0] if getattr(t, "value_range", None) is not None else 0
        feeds[t.name] = np.full(dims, fill, dtype=NP_DTYPES[t.dtype])
    return feeds


def export_onnx(module: Any, spec: ModelSpec, sample_feeds: Mapping[str, np.ndarray], out_path: str | Path
                ) -> dict[str, Any]:
    """Export a torch module to one ONNX file with the spec's names and dynamic axes.

    The legacy TorchScript exporter (`spec.export.dynamo` False, `torch.onnx.export(..., dynamo=False)`) is what
    ONNX Runtime's BERT fusion recognises; the torch.export-based exporter (True) gets a `torch.export.Dim` per
    named axis (min 2: torch.export specializes sizes 0 and 1). Either way the file is re-saved self-contained
    (no external .data file) when it is under 2 GB.

    Args:
        module: torch.nn.Module; called with the inputs positionally in `spec.inputs` order.
        spec: `tailguard.core.spec.model.ModelSpec` (inputs, outputs, export.opset, export.dynamo).
        sample_feeds: {input name: array (batch, sequence, ...)} used for tracing; with dynamo a dynamic axis of
            size 1 is repeated to size 2 (torch.export would otherwise specialize it to a constant).
        out_path: the .onnx file to write (folders are created).

    Returns:
        Facts: {"path", "exporter" ("torchscript"|"dynamo"), "opset", "nodes" (count), "op_types" ({op: count}),
        "bytes" (file size incl. external data), "external_data" (bool), "seconds", "inputs", "outputs",
        "dynamic_axes", "warnings" (the exporter's warnings about the model, `summarize_exporter_warnings`)}.

    Raises:
        InputError: a spec input is missing from `sample_feeds`, or the module's outputs do not match
            `spec.outputs` in number.
        StepError: the torch exporter itself failed (step "export"), with its message.
    """
    import torch

    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    names_in = [t.name for t in spec.inputs]
    names_out = [t.name for t in spec.outputs]
    missing = [n for n in names_in if n not in sample_feeds]
    if missing:
        raise InputError(f"export: sample feeds lack model input(s) {missing} (model.inputs: {names_in})",
                         hint="give one sample array per model input, named as in model.inputs")
    axes = dynamic_axes_from_spec(spec)
    feeds = {n: np.asarray(sample_feeds[n]) for n in names_in}
    if spec.export.dynamo:
        feeds = _grow_dynamic_axes(feeds, axes)
    args = tuple(torch.from_numpy(np.ascontiguousarray(feeds[n])) for n in names_in)
    if hasattr(module, "eval"):
        module.eval()
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # each trace site once per export, whatever the caller's filters say
        if spec.export.dynamo:
            _export_dynamo(module, args, spec, axes, out_path)
            exporter = "dynamo"
        else:
            try:
                with torch.no_grad():
                    torch.onnx.export(module, args, str(out_path), dynamo=False, input_names=names_in,
                                      output_names=names_out, opset_version=spec.export.opset, dynamic_axes=axes,
                                      do_constant_folding=True)
            except Exception as exc:  # the exporter raises many types (RuntimeError, SymbolicValueError, ...)
                raise StepError(f"torch.onnx.export (legacy TorchScript exporter) failed: {exc}", step="export",
                                hint="try model.export.dynamo: true, or a different model.export.opset") from exc
            exporter = "torchscript"
    seconds = time.perf_counter() - t0
    exporter_warnings = summarize_exporter_warnings(caught)
    for w in exporter_warnings:  # still in the task's log, as before they were recorded
        print(f"export warning: {warning_text(w)}", file=sys.stderr)
    _make_self_contained(out_path)
    facts = _model_facts(out_path)
    if facts["outputs"] != names_out:
        raise InputError(f"export: the module returned outputs {facts['outputs']} but model.outputs names "
                         f"{names_out}", hint="list every forward() output in model.outputs, in order")
    facts.update(exporter=exporter, seconds=round(seconds, 3), dynamic_axes={k: {str(i): a for i, a in v.items()}
                                                                               for k, v in axes.items()},
                 warnings=exporter_warnings)
    return facts


# Warnings about the exporter's own API (e.g. "You are using the legacy TorchScript-based ONNX export"), not about
# the model: left out of the recorded warnings.
_API_WARNINGS = (DeprecationWarning, PendingDeprecationWarning, FutureWarning)
WARNING_MESSAGE_CHARS = 160  # a recorded warning's message is cut to its first sentence, at most this long


def summarize_exporter_warnings(caught: Sequence[warnings.WarningMessage]) -> list[dict[str, Any]]:
    """The model-related warnings the torch exporter raised (TracerWarnings such as "Converting a tensor to a Python
    boolean might cause the trace to be incorrect", i.e. a value traced as a constant), deduplicated.

    Args:
        caught: what `warnings.catch_warnings(record=True)` recorded around the export.

    Returns:
        [{"category": "TracerWarning", "message": first sentence (<= WARNING_MESSAGE_CHARS chars), "where":
        "file.py:line" (the model's line that raised it), "count": times raised}], first-seen order;
        DeprecationWarning / PendingDeprecationWarning / FutureWarning (about the exporter's API) left out.
    """
    seen: dict[tuple[str, str, str], dict[str, Any]] = {}
    for w in caught:
        if issubclass(w.category, _API_WARNINGS):
            continue
        text = " ".join(str(w.message).split())
        first = text.split(". ")[0].rstrip(".") + "."
        if len(first) > WARNING_MESSAGE_CHARS:
            first = first[:WARNING_MESSAGE_CHARS - 3] + "..."
        where = f"{Path(str(w.filename)).name}:{w.lineno}"
        key = (w.category.__name__, first, where)
        if key in seen:
            seen[key]["count"] += 1
        else:
            seen[key] = {"category": w.category.__name__, "message": first, "where": where, "count": 1}
    return list(seen.values())


def warning_text(w: Mapping[str, Any]) -> str:
    """One line for a recorded exporter warning: "TracerWarning at model.py:12: <message> (x3)"."""
    times = f" (x{w['count']})" if w.get("count", 1) > 1 else ""
    return f"{w['category']} at {w['where']}: {w['message']}{times}"


def _grow_dynamic_axes(feeds: dict[str, np.ndarray], axes: dict[str, dict[int, str]]) -> dict[str, np.ndarray]:
    """Repeat samples along every dynamic axis shorter than 2: torch.export specializes sizes 0 and 1 into
    constants. Tracing records shapes, not values, so repeated rows/positions change nothing in the graph."""
    grown = {}
    for name, a in feeds.items():
        for i in axes.get(name, {}):
            if i < a.ndim and 0 < a.shape[i] < 2:
                a = np.concatenate([a, a], axis=i)
        grown[name] = a
    return grown


def _export_dynamo(module: Any, args: tuple, spec: ModelSpec, axes: dict[str, dict[int, str]], out_path: Path) -> None:
    import torch

    dims: dict[str, Any] = {}
    dynamic_shapes: dict[str, dict[int, Any]] = {}
    for t, _ in zip(spec.inputs, args):
        per_axis = {}
        for i, name in axes.get(t.name, {}).items():
            per_axis[i] = dims.setdefault(name, torch.export.Dim(name, min=2))
        dynamic_shapes[t.name] = per_axis
    try:
        prog = torch.onnx.export(module, args, None, dynamo=True, input_names=[t.name for t in spec.inputs],
                                 opset_version=spec.export.opset, dynamic_shapes=dynamic_shapes)
    except Exception as exc:
        raise StepError(f"torch.onnx.export (dynamo=True) failed: {exc}", step="export",
                        hint="try model.export.dynamo: false (the TorchScript exporter)") from exc
    graph = prog.model.graph
    names_out = [t.name for t in spec.outputs]
    if len(graph.outputs) != len(names_out):
        raise InputError(f"export: the module returned {len(graph.outputs)} output(s) but model.outputs lists "
                         f"{len(names_out)} ({names_out})", hint="list every forward() output in model.outputs")
    # The dynamo exporter names internal values after aten ops ("embedding", "linear"): passing output_names
    # can then define one name twice (an invalid model). Rename clashing internal values first.
    values = {v.name: v for node in graph for v in node.outputs if v.name}
    values.update({v.name: v for v in graph.inputs if v.name})
    values.update({name: v for name, v in graph.initializers.items()})
    for out, name in zip(graph.outputs, names_out):
        clash = values.get(name)
        if clash is not None and clash is not out:
            new, k = f"{name}_internal", 1
            while new in values:
                new, k = f"{name}_internal{k}", k + 1
            clash.name = new
            values[new] = clash
        out.name = name
        values[name] = out
    prog.save(str(out_path))  # external data only when > 2 GB


def _make_self_contained(path: Path) -> None:
    """Re-save a model with external data as one file when it fits in 2 GB (what ORT tools handle best)."""
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    locations = {e.value for t in proto.graph.initializer for e in t.external_data if e.key == "location"}
    if not locations:
        return
    total = path.stat().st_size + sum((path.parent / loc).stat().st_size for loc in locations
                                      if (path.parent / loc).is_file())
    if total >= TWO_GB:
        return
    proto = onnx.load(str(path))
    onnx.save_model(proto, str(path), save_as_external_data=False)
    for loc in locations:
        (path.parent / loc).unlink(missing_ok=True)


def _model_facts(path: Path) -> dict[str, Any]:
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    op_types: dict[str, int] = {}
    for n in proto.graph.node:
        op_types[n.op_type] = op_types.get(n.op_type, 0) + 1
    locations = {e.value for t in proto.graph.initializer for e in t.external_data if e.key == "location"}
    size = path.stat().st_size + sum((path.parent / loc).stat().st_size for loc in locations
                                     if (path.parent / loc).is_file())
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), None)
    return {"path": str(path), "opset": opset, "nodes": len(proto.graph.node), "op_types": op_types,
            "bytes": int(size), "external_data": bool(locations), "ir_version": proto.ir_version,
            "inputs": [i.name for i in proto.graph.input], "outputs": [o.name for o in proto.graph.output]}


# ------------------------------------------------------------------------------------------------- check
def check_declared_outputs(onnx_path: str | Path, spec: ModelSpec, feeds: Mapping[str, np.ndarray], *,
                           onnx_runner: Runner | None = None, source: str = "export") -> dict[str, Any]:
    """Check `model.outputs` (name, dtype, rank, fixed sizes) against the ONNX graph and against what it returns.

    Two comparisons (rules in components/export/signature.py and docs/spec.md, "Outputs"): the graph's declared
    outputs (element type, dim_value / dim_param), then the arrays ONNX Runtime returns for `feeds`, whose sizes
    are real (a fixed declared size must equal them; a named axis such as `batch` matches any size). A declared
    output the graph lacks is an error; outputs the graph has beyond the declared ones are ignored.

    Args:
        onnx_path: the .onnx file.
        spec: `tailguard.core.spec.model.ModelSpec` (outputs).
        feeds: one batch {input name: array (batch, ...)}.
        onnx_runner: an open runner of `onnx_path` (default: a CPU `OrtRunner`, graph optimizations off).
        source: who checks, for the error's first line.

    Returns:
        {"graph": [{name, dtype, shape}], "batch": [{name, dtype, shape}] (shapes of the outputs on `feeds`),
        "rows": batch size}.

    Raises:
        SpecError: every mismatch, e.g. "model.outputs.0.shape: logits is declared [batch, 16] but the ONNX graph
            gives [batch, 15]", with the fix ("declare logits: [batch, 15]") as hint (exit 2).
    """
    from tailguard.components.export.signature import (
        array_output_signature,
        check_output_signature,
        onnx_output_signature,
    )

    graph = onnx_output_signature(onnx_path)
    check_output_signature(spec.outputs, graph, what="the ONNX graph", source=source)
    runner = onnx_runner or OrtRunner(onnx_path, graph_optimization="disabled")
    names = list(getattr(runner, "output_names", [t.name for t in spec.outputs]))
    rows = int(next(iter(feeds.values())).shape[0]) if feeds else 0
    try:
        arrays = runner.run(dict(feeds))
    except Exception as exc:  # ORT raises InvalidArgument / Fail / RuntimeException for a batch it cannot run
        first = (str(exc).splitlines() or [type(exc).__name__])[0][:300]
        raise InputError(f"{source}: the ONNX model {Path(onnx_path).name} failed on a batch of {rows} rows shaped "
                         f"like model.inputs ({first})",
                         hint="make model.inputs (names, dtypes, shapes) match the model's inputs") from None
    got = array_output_signature(names, arrays)
    check_output_signature(spec.outputs, got, what=f"the ONNX model's output on a batch of {rows} rows",
                           source=source, concrete=True)
    return {"graph": [g.to_dict() for g in graph], "batch": [g.to_dict() for g in got], "rows": rows}


def feeds_for_graph(runner: Any, spec: ModelSpec, *, batch: int = 2, length: int = 4) -> dict[str, np.ndarray]:
    """A batch built from the spec's inputs alone (`dummy_feeds`), with every axis the graph fixes set to the
    graph's size: what an ONNX reference is run on to see its real output shapes without reading data.

    Args:
        runner: an `OrtRunner` (its `session.get_inputs()` give the graph's input shapes).
        spec: `tailguard.core.spec.model.ModelSpec`.
        batch, length: sizes of the batch axis and of the other named axes the graph leaves free.

    Returns:
        {input name: array}, dtypes from `model.inputs`.
    """
    feeds = dummy_feeds(spec, batch=batch, length=length)
    fixed = {i.name: list(i.shape) for i in runner.session.get_inputs()} if hasattr(runner, "session") else {}
    for name, arr in list(feeds.items()):
        dims = fixed.get(name)
        if dims is None or len(dims) != arr.ndim:
            continue
        shape = [d if isinstance(d, int) and d > 0 else s for d, s in zip(dims, arr.shape)]
        if list(shape) != list(arr.shape):
            feeds[name] = np.full(shape, arr.flat[0] if arr.size else 0, dtype=arr.dtype)
    return feeds


def _tolerance(spec: ModelSpec, name: str) -> tuple[float, float]:
    tol = spec.export.tolerances.get(name, spec.export.default)
    return float(tol.atol), float(tol.rtol)


def check_export(torch_runner: Runner, onnx_path: str | Path, feeds_list: Sequence[Mapping[str, np.ndarray]],
                 spec: ModelSpec, *, onnx_runner: Runner | None = None) -> dict[str, dict[str, Any]]:
    """Compare every output of the ONNX graph with the source model on the given batches.

    The rule per element is numpy.allclose's: |onnx - torch| <= atol + rtol * |torch|, with (atol, rtol) from
    `spec.export.tolerances[output]`, else `spec.export.default`. A NaN/Inf in either output, a shape
    difference, or an output the graph lacks also fails. Differences of all batches are collected first, then
    every failing output is reported together.

    Args:
        torch_runner: runs the source model; `run(feeds)` returns outputs in `spec.outputs` order.
        onnx_path: the exported .onnx file.
        feeds_list: batches {input name: array (batch, sequence, ...)}; different batch sizes and sequence
            lengths are welcome (they test the dynamic axes).
        spec: `tailguard.core.spec.model.ModelSpec`.
        onnx_runner: an already-open runner for `onnx_path` (default: a CPU `OrtRunner`).

    Returns:
        {output name: {"max_abs_diff": float, "max_rel_diff": float, "atol": float, "rtol": float,
        "ok": bool, "non_finite": int (count of NaN/Inf elements in either output), "elements": int,
        "batches": int}} for every output in `spec.outputs`.

    Raises:
        ExportMismatchError: any output fails; `.diffs` is the dict above (all outputs).
        InputError: the ONNX file cannot be loaded, or `feeds_list` is empty.
    """
    if not feeds_list:
        raise InputError("check_export: no batches to compare", hint="pass at least one batch of feeds")
    runner = onnx_runner or OrtRunner(onnx_path, graph_optimization="disabled")
    onnx_names = list(getattr(runner, "output_names", [t.name for t in spec.outputs]))
    diffs: dict[str, dict[str, Any]] = {}
    for t in spec.outputs:
        atol, rtol = _tolerance(spec, t.name)
        diffs[t.name] = {"max_abs_diff": 0.0, "max_rel_diff": 0.0, "atol": atol, "rtol": rtol, "ok": True,
                         "non_finite": 0, "elements": 0, "batches": 0}
    for feeds in feeds_list:
        ref = torch_runner.run(dict(feeds))
        got = runner.run(dict(feeds))
        got_by_name = dict(zip(onnx_names, got))
        for i, t in enumerate(spec.outputs):
            d = diffs[t.name]
            d["batches"] += 1
            if i >= len(ref) or t.name not in got_by_name:
                d.update(ok=False, max_abs_diff=float("inf"),
                         problem=("the source model returned no output #%d" % i) if i >= len(ref)
                         else f"the ONNX graph has no output {t.name!r} (has {onnx_names})")
                continue
            b = np.asarray(ref[i], dtype=np.float64)
            a = np.asarray(got_by_name[t.name], dtype=np.float64)
            if a.shape != b.shape:
                d.update(ok=False, max_abs_diff=float("inf"),
                         problem=f"shape {a.shape} in ONNX vs {b.shape} in the source model")
                continue
            finite = np.isfinite(a) & np.isfinite(b)
            n_bad = int(a.size - finite.sum())
            err = np.abs(a - b)
            err_f = np.where(finite, err, 0.0)
            rel = err_f / np.maximum(np.abs(b), 1e-12)
            d["elements"] += int(a.size)
            d["non_finite"] += n_bad
            if n_bad:
                d["max_abs_diff"] = float("nan")
                d["ok"] = False
                d["problem"] = f"{d['non_finite']} NaN/Inf value(s)"
            elif not np.isnan(d["max_abs_diff"]):
                d["max_abs_diff"] = max(d["max_abs_diff"], float(err_f.max(initial=0.0)))
            d["max_rel_diff"] = max(d["max_rel_diff"], float(rel.max(initial=0.0)))
            if not bool(np.all(err_f <= atol + rtol * np.abs(np.where(finite, b, 0.0)))):
                d["ok"] = False
    if not all(d["ok"] for d in diffs.values()):
        raise ExportMismatchError(diffs)
    return diffs


def check_onnx_file(path: str | Path) -> dict[str, Any]:
    """Check an ONNX model file: onnx.checker (full check, by path so external data works) and an ORT load.

    Args:
        path: the .onnx file (external data files beside it are followed).

    Returns:
        Facts: {"path", "opset", "ir_version", "nodes", "op_types", "bytes", "external_data", "inputs",
        "outputs"} (bytes include external data).

    Raises:
        InputError: the file is missing, truncated/corrupt, fails the ONNX checker, or ONNX Runtime cannot load
            it; the message names the file.
    """
    import onnx

    path = Path(path)
    if not path.is_file():
        raise InputError(f"ONNX file not found: {path}", hint="check the registry version's artifacts")
    try:
        onnx.checker.check_model(str(path), full_check=False)
        facts = _model_facts(path)
    except Exception as exc:  # DecodeError, ValidationError, OSError for missing external data, ...
        first = (str(exc).splitlines() or [type(exc).__name__])[0][:300]
        raise InputError(f"ONNX file {path} is corrupt or invalid: {first}",
                         hint="re-export the model or re-register a complete .onnx file") from None
    OrtRunner(path, graph_optimization="disabled")  # raises InputError naming the file
    return facts
