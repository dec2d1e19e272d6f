"""Task glue of the export component: torch -> ONNX, checked against torch (or an ONNX reference checked)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tailguard.core.contract import EXPORT_FACTS_FILE, ONNX_FILE, ONNX_INLINE_LIMIT_BYTES
from tailguard.core.taskio import task_entry, write_json

if TYPE_CHECKING:
    from tailguard.core.data import Dataset
    from tailguard.core.reference import ResolvedModel
    from tailguard.core.spec.root import Spec


def _copy_onnx(src: Path, out_dir: Path) -> Path:
    """Copy an ONNX file and its external-data files (same folder) into out_dir as model.onnx."""
    out_dir.mkdir(parents=True, exist_ok=True)
    import onnx

    model = onnx.load(str(src), load_external_data=True)
    dst = out_dir / ONNX_FILE
    if model.ByteSize() < ONNX_INLINE_LIMIT_BYTES:
        onnx.save(model, str(dst))
    else:
        onnx.save(model, str(dst), save_as_external_data=True, location=ONNX_FILE + ".data")
    return dst


def check_batches(spec: Spec, ds: Dataset) -> list[dict[str, np.ndarray]]:
    """Batches for the export check: the `export.check_samples` shortest-to-longest rows in two batch sizes.

    Two different batch sizes and padded lengths exercise both dynamic axes.
    """
    from tailguard.core.data import make_batch

    n = min(spec.model.export.check_samples, ds.n_rows)
    order = np.argsort(ds.lengths, kind="stable")
    picks = order[np.linspace(0, ds.n_rows - 1, num=n).astype(int)]
    first = picks[: max(1, n // 2)]
    second = picks[max(1, n // 2):] if n > 1 else picks
    return [make_batch(ds, idx, spec.model.inputs, pad_values=spec.model.pad_values) for idx in (first, second)]


@task_entry("export")
def main(*, spec_yaml: str, resolved_json: str, reference_dir: str, out_dir: str) -> str:
    """Write `out_dir/model.onnx`: the exported (torch) or checked (ONNX) FP32 reference.

    A pure step (no MLflow): under `tailguard run` its output comes from the local cache (tailguard.core.cache) when
    the reference's bytes, the model section, the validation rows it checks with and the versions are unchanged.

    Returns:
        JSON facts of the export plus "cached" (true: copied from the cache, not exported).

    Every export, cached or not, checks `model.outputs` against the model (`check_declared_outputs`); the facts
    (`export.json` beside model.onnx) hold that check (`outputs_check`) and the exporter's warnings (`warnings`).

    Raises:
        ExportMismatchError: an output differs beyond its tolerance (every output's max diff listed; exit 1).
        SpecError: a declared output's dtype, rank or fixed size differs from the model's, or the model lacks it
            (exit 2).
        InputError: a corrupt ONNX reference (exit 2).
    """
    from tailguard.core.cache import cached_step, dataset_parts, reference_parts
    from tailguard.core.reference import load_resolved
    from tailguard.core.spec import spec_from_yaml

    spec = spec_from_yaml(spec_yaml)
    resolved = load_resolved(resolved_json, reference_dir)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    parts = reference_parts(resolved, spec)
    if parts is not None and resolved.format != "onnx":  # the export check reads validation rows
        validation = dataset_parts(spec.data.validation)
        parts = None if validation is None else {**parts, "validation": validation}
    facts = cached_step("export", parts, out, lambda: _export(spec, resolved, out), label="export")
    if "outputs_check" not in facts:  # a cache entry written before the check existed: the check is never skipped
        facts["outputs_check"] = _check_outputs(spec, out / ONNX_FILE)
    return json.dumps(facts, default=str)


def _check_outputs(spec: Spec, onnx_path: Path) -> dict[str, Any]:
    """`check_declared_outputs` on a batch made from model.inputs alone (`feeds_for_graph`)."""
    from tailguard.components.export.logic import check_declared_outputs, feeds_for_graph
    from tailguard.core.runtime import OrtRunner

    runner = OrtRunner(onnx_path, graph_optimization="disabled")
    return check_declared_outputs(onnx_path, spec.model, feeds_for_graph(runner, spec.model), onnx_runner=runner)


def _export(spec: Spec, resolved: ResolvedModel, out: Path) -> dict[str, Any]:
    """Export (torch) or check and copy (ONNX) the reference into `out`; returns the facts."""
    from tailguard.components.export.logic import check_declared_outputs, check_export, check_onnx_file, export_onnx
    from tailguard.core.runtime import OrtRunner

    if resolved.format == "onnx":
        facts = check_onnx_file(resolved.onnx_path)
        _copy_onnx(Path(resolved.onnx_path), out)
        facts["exporter"] = "none (reference is ONNX)"
        # model.outputs against the graph and its outputs on a batch made from model.inputs (no data read: the
        # cache key of an ONNX reference has no data in it)
        facts["outputs_check"] = _check_outputs(spec, out / ONNX_FILE)
        facts["warnings"] = []
        write_json(out / EXPORT_FACTS_FILE, facts)
        return facts
    from tailguard.core.data import load_validation
    from tailguard.core.reference import load_torch_reference
    from tailguard.core.runtime import TorchRunner

    module = load_torch_reference(resolved, spec.model)
    ds = load_validation(spec)
    batches = check_batches(spec, ds)
    facts = export_onnx(module, spec.model, batches[-1], out / ONNX_FILE)
    onnx_runner = OrtRunner(out / ONNX_FILE, graph_optimization="disabled")
    # declared shapes first: a wrong declaration is the user's to fix (exit 2), whatever torch and ONNX agree on
    facts["outputs_check"] = check_declared_outputs(out / ONNX_FILE, spec.model, batches[0], onnx_runner=onnx_runner)
    runner = TorchRunner(module, [i.name for i in spec.model.inputs])
    facts["check"] = check_export(runner, str(out / ONNX_FILE), batches, spec.model, onnx_runner=onnx_runner)
    write_json(out / EXPORT_FACTS_FILE, facts)
    return facts
