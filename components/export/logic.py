"""torch -> ONNX export, the check of the export against the source model, and the check of an ONNX reference.

Three entry points, all importable without KFP:

- `export_onnx`: torch.nn.Module -> one .onnx file, with the spec's input/output names and named dynamic axes.
- `check_export`: runs the source model and the ONNX graph on the same batches and compares *every* output with
  |onnx - torch| <= atol + rtol * |torch| (the numpy.allclose rule); any failure raises `ExportMismatchError`
  listing every output and its max difference. A failed check is never downgraded to a warning (STYLE.md item 8,
  after optimum's `validate_model_outputs` and optimum issue 1755).
- `check_onnx_file`: an ONNX reference taken from the registry is checked (onnx.checker, path-based so external
  data works) and loaded in ONNX Runtime; a corrupt file raises `InputError` naming it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from tailguard.core.errors import ExportMismatchError, InputError, StepError
from tailguard.core.runtime import OrtRunner, Runner

from tailguard.core.contract import ONNX_INLINE_LIMIT_BYTES as TWO_GB  # noqa: E402  protobuf's 2 GiB limit


# ------------------------------------------------------------------------------------------------ export
def dynamic_axes_from_spec(spec: Any) -> dict[str, dict[int, str]]:
    """Named dynamic axes per input/output: every axis the spec gives as a string (e.g. "batch", "sequence").

    Args:
        spec: a `tailguard.spec.ModelSpec`.

    Returns:
        {tensor name: {axis index: axis name}}; tensors without dynamic axes are left out.
    """
    out: dict[str, dict[int, str]] = {}
    for t in [*spec.inputs, *spec.outputs]:
        axes = {i: ax for i, ax in enumerate(t.shape) if isinstance(ax, str)}
        if axes:
            out[t.name] = axes
    return out


def dummy_feeds(spec: Any, *, batch: int = 2, length: int = 4) -> dict[str, np.ndarray]:
    """Feeds made from the spec's input shapes alone (no data), for tracing an export.

    Args:
        spec: a `tailguard.spec.ModelSpec` (inputs: name, dtype, shape with batch first).
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


def export_onnx(module: Any, spec: Any, sample_feeds: Mapping[str, np.ndarray], out_path: str | Path
                ) -> dict[str, Any]:
    """Export a torch module to one ONNX file with the spec's names and dynamic axes.

    The legacy TorchScript exporter (`spec.export.dynamo` False, `torch.onnx.export(..., dynamo=False)`) is what
    ONNX Runtime's BERT fusion recognises; the torch.export-based exporter (True) gets a `torch.export.Dim` per
    named axis (min 2: torch.export specializes sizes 0 and 1). Either way the file is re-saved self-contained
    (no external .data file) when it is under 2 GB.

    Args:
        module: torch.nn.Module; called with the inputs positionally in `spec.inputs` order.
        spec: `tailguard.spec.ModelSpec` (inputs, outputs, export.opset, export.dynamo).
        sample_feeds: {input name: array (batch, sequence, ...)} used for tracing; with dynamo a dynamic axis of
            size 1 is repeated to size 2 (torch.export would otherwise specialize it to a constant).
        out_path: the .onnx file to write (folders are created).

    Returns:
        Facts: {"path", "exporter" ("torchscript"|"dynamo"), "opset", "nodes" (count), "op_types" ({op: count}),
        "bytes" (file size incl. external data), "external_data" (bool), "seconds", "inputs", "outputs",
        "dynamic_axes"}.

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
    _make_self_contained(out_path)
    facts = _model_facts(out_path)
    if facts["outputs"] != names_out:
        raise InputError(f"export: the module returned outputs {facts['outputs']} but model.outputs names "
                         f"{names_out}", hint="list every forward() output in model.outputs, in order")
    facts.update(exporter=exporter, seconds=round(seconds, 3), dynamic_axes={k: {str(i): a for i, a in v.items()}
                                                                               for k, v in axes.items()})
    return facts


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


def _export_dynamo(module: Any, args: tuple, spec: Any, axes: dict[str, dict[int, str]], out_path: Path) -> None:
    import torch

    dims: dict[str, Any] = {}
    dynamic_shapes: dict[str, dict[int, Any]] = {}
    for t, a in zip(spec.inputs, args):
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
def _tolerance(spec: Any, name: str) -> tuple[float, float]:
    tol = spec.export.tolerances.get(name, spec.export.default)
    return float(tol.atol), float(tol.rtol)


def check_export(torch_runner: Runner, onnx_path: str | Path, feeds_list: Sequence[Mapping[str, np.ndarray]],
                 spec: Any, *, onnx_runner: Runner | None = None) -> dict[str, dict[str, Any]]:
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
        spec: `tailguard.spec.ModelSpec`.
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
