"""Per-node quantization sensitivity: quantize ONE node at a time and measure how far the model output moves.

Method ("one at a time" sensitivity):

1. The graph is prepared exactly as the variant's build prepares it before quantizing
   (`tailguard.components.build.builders.onnxruntime`): `_optimize_graph` with the variant's
   `graph_optimization`, then `_preprocess` (quant_pre_process) when `quantization.preprocess` is set. Node
   names therefore are the names `quantization.exclude_nodes` must use (`_excluded_nodes` checks them against
   this very graph).
2. The probed nodes are the nodes the variant's quantization would quantize and that carry weights or heavy
   compute: op types in WEIGHTED_OP_TYPES that ONNX Runtime's quantizer registry for the variant's mode knows
   (dynamic: `IntegerOpsRegistry` (+ Gemm, which quantize_dynamic rewrites as MatMul + Add); static QDQ:
   `QDQRegistry`; static QOperator: `QLinearOpsRegistry`; onnxruntime/quantization/registry.py), allowed by
   `quantization.op_types`, not already kept in float by the variant (`exclude_nodes`, `exclude_op_types`), and
   named. Dynamic MatMuls count only with a constant B (quantize_dynamic's default MatMulConstBOnly=True);
   Gathers only with a float initializer as data (an embedding table).
3. For each probed node, the graph is quantized with the variant's settings (the same `_quantize_dynamic` /
   `_quantize_static` helpers the build calls, so per_channel, reduce_range, weight/activation types,
   calibration method and the DefaultTensorType option for contrib ops are identical) keeping EVERY OTHER node
   in float (nodes_to_exclude = all other node names; equivalent to nodes_to_quantize=[node]). Static
   variants calibrate on the sensitivity rows themselves (one quantize_static call per node). Dynamic variants
   (graph under 2 GB) do not call quantize_dynamic once per node: most of its time went into steps that do not
   depend on the node (shape inference of the whole graph through a temp file, twice, and writing the model),
   so each worker does those once (`_dynamic_base`) and builds every single-node model in memory from a copy
   (`_quantize_dynamic_in_memory`): byte for byte the model quantize_dynamic writes, checked on every probed node
   of the test models and of MiniLM (25 of 25). The probed nodes are scored by up to MAX_WORKERS spawned worker
   processes (one per usable core), each on its own link to the prepared graph, with the cores shared among
   their ONNX Runtime sessions; the scores are those of one process (tests/components/test_sensitivity.py).
   On MiniLM (25 probed nodes, 64 rows, 2 workers, 2 shared cores at load 2-3, the prepared graph from the run's
   cache as in the demo; 2026-11-26): 12.1-20.7 s against 17.9-37.4 s with one quantize_dynamic call per node
   (5 interleaved rounds); in one process (cProfile) 28 s against 37 s, of which the model runs (64 rows x 26
   models) take ~11 s either way and serializing the 90 MB single-node models ~5.5 s.
4. The single-node model and the unquantized prepared graph run on the same `samples` rows (length-sorted
   batches, `tailguard.core.runtime.run_dataset` + `OrtRunner`); their first outputs y_q, y (rows, ...) give

       output_rel_l2      = mean_i ||y_q,i - y_i||_2 / max(||y_i||_2, 1e-12)
       output_cosine_drop = mean_i (1 - <y_q,i, y_i> / (max(||y_q,i||, 1e-12) max(||y_i||, 1e-12)))

   (rows flattened to vectors; a non-finite output or a failed quantization scores +inf / 2).

This is the model-output counterpart of ONNX Runtime's quantization debugger (onnxruntime/quantization/
qdq_loss_debug.py: `collect_activations` + `compute_activation_error`, which compares every intermediate
tensor of a QDQ model with its float twin). Measuring at the model output instead ranks nodes by what the
parity gates see: an error that later layers absorb ranks low, one that is amplified ranks high; and it works
for dynamic (QOperator) models, which have no QDQ pairs to compare. Single-node errors ignore interactions
(two nodes that are harmless alone can hurt together); the search therefore validates every configuration
with the real gates and uses this ranking only to choose which nodes to keep in float first.
"""

from __future__ import annotations

import contextlib
import io
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from tailguard.core.data import Dataset
from tailguard.core.errors import InputError

if TYPE_CHECKING:
    from tailguard.core.spec.model import ModelSpec
    from tailguard.core.spec.variants import QuantizationSpec, VariantSpec

# Op types whose quantization carries a weight or heavy arithmetic: the nodes worth keeping in float.
WEIGHTED_OP_TYPES = ("MatMul", "Gemm", "Conv", "ConvTranspose", "Attention", "LSTM", "Gather", "GatherElements",
                     "EmbedLayerNormalization")
NORM_EPS = 1e-12  # floor of the output norms (rows with an all-zero reference output)
FAILED_COSINE_DROP = 2.0  # worst possible 1 - cos, scored for a node whose quantization failed
SENSITIVITY_COLUMNS = ("rank", "node", "op_type", "output_rel_l2", "output_cosine_drop", "quantized", "seconds",
                       "error")
_UNNAMED = "_tailguard_unnamed_"


def _registry_op_types(q: QuantizationSpec) -> set[str]:
    from onnxruntime.quantization.registry import IntegerOpsRegistry, QDQRegistry, QLinearOpsRegistry

    if q.mode == "dynamic":
        return set(IntegerOpsRegistry) | {"Gemm"}
    return set(QDQRegistry if q.format == "qdq" else QLinearOpsRegistry)


def probed_nodes(graph: Any, q: QuantizationSpec) -> list[tuple[str, str]]:
    """Nodes of `graph` that quantization `q` would quantize and that carry weights (module docstring, step 2).

    Args:
        graph: onnx GraphProto of the prepared (optimized, preprocessed) model.
        q: `tailguard.core.spec.variants.QuantizationSpec` of the variant.

    Returns:
        [(node name, op type)] in graph order.
    """
    import onnx

    inits = {t.name: t for t in graph.initializer}
    constants = set(inits) | {o for n in graph.node if n.op_type == "Constant" for o in n.output}
    allowed = _registry_op_types(q) & set(WEIGHTED_OP_TYPES)
    if q.op_types:
        allowed &= set(q.op_types)
    if q.mode == "dynamic":  # quantize_dynamic rewrites every Gemm as MatMul + Add first: it follows MatMul
        allowed.discard("Gemm")
        if "MatMul" in allowed:
            allowed.add("Gemm")
    kept_float = set(q.exclude_nodes)
    out = []
    for n in graph.node:
        if not n.name or n.op_type not in allowed or n.name in kept_float or n.op_type in q.exclude_op_types:
            continue
        if q.mode == "dynamic" and n.op_type == "MatMul" and (len(n.input) < 2 or n.input[1] not in constants):
            continue  # MatMulConstBOnly: quantize_dynamic leaves activation x activation MatMuls in float
        if n.op_type in ("Gather", "GatherElements"):
            t = inits.get(n.input[0])
            if t is None or t.data_type not in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16):
                continue  # shape arithmetic, not an embedding table
        out.append((n.name, n.op_type))
    return out


def _others_excluded(graph: Any, node: str) -> list[str]:
    """nodes_to_exclude that leaves only `node` quantizable: every other node name, plus the "<gemm>_MatMul"
    name quantize_dynamic gives a rewritten Gemm (onnxruntime/quantization/onnx_model.py)."""
    names = [n.name for n in graph.node if n.name != node]
    names += [f"{n.name}_MatMul" for n in graph.node if n.op_type == "Gemm" and n.name != node]
    return sorted(set(names))


def _name_unnamed(src: Path, dst: Path) -> Path:
    """Give unnamed nodes a name so they can be kept in float during single-node trials (they are never
    probed: the build could not name them in exclude_nodes)."""
    import onnx

    proto = onnx.load(str(src))
    unnamed = [n for n in proto.graph.node if not n.name]
    if not unnamed:
        return src
    for i, n in enumerate(unnamed):
        n.name = f"{_UNNAMED}{i}"
    onnx.save_model(proto, str(dst))
    return dst


def _has_quantized_ops(graph: Any) -> bool:
    """Whether onnx GraphProto `graph` holds integer, QDQ or QLinear ops."""
    from .onnx_files import INTEGER_OP_TYPES, QDQ_OP_TYPES

    return any(n.op_type in INTEGER_OP_TYPES or n.op_type in QDQ_OP_TYPES or n.op_type.startswith("QLinear")
               for n in graph.node)


def _run(path: Path, ds: Dataset, model: ModelSpec, provider: str, batch_size: int, threads: int = 0) -> np.ndarray:
    from tailguard.core.runtime import OrtRunner, run_dataset

    runner = OrtRunner(path, providers=[provider], intra_op_num_threads=threads)
    return run_dataset(runner, ds, model.inputs, batch_size=batch_size, pad_values=model.pad_values)[0]


# ------------------------------------------------------------------ dynamic mode: single-node models in memory
def _in_memory(q: QuantizationSpec, named: Path) -> bool:
    """Whether the dynamic fast path applies: dynamic mode and a graph under 2 GB (one serializable protobuf)."""
    from .onnx_files import _large

    return q.mode == "dynamic" and not _large(named)


def _dynamic_base(q: QuantizationSpec, src: Path) -> tuple[Any, dict[str, Any]]:
    """The part of quantize_dynamic that does not depend on nodes_to_exclude, done once per worker.

    ONNX Runtime's `quantize_dynamic(src, ...)` (onnxruntime/quantization/quantize.py) loads `src` with shape
    inference (`load_model_with_shape_infer`), sets MatMulConstBOnly=True unless given, raises the opset
    (`update_opset_version`) and builds an `ONNXQuantizer`, whose __init__ in dynamic mode rewrites EVERY Gemm as
    MatMul (+ Add) (`ONNXModel.replace_gemm_with_matmul`, excluded or not) and shape-infers the result again
    (`save_and_reload_model_with_shape_infer`). This function does exactly those steps, in that order, with the
    build's options (`builders.onnxruntime._dynamic_options`).

    Args:
        q: the variant's quantization (mode dynamic).
        src: the prepared graph (ORT writes `<src>-inferred.onnx` beside it for a moment).

    Returns:
        (the shape-inferred ModelProto quantize_model starts from, ONNXQuantizer's keyword arguments).
    """
    from onnxruntime.quantization import QuantType
    from onnxruntime.quantization.onnx_model import ONNXModel
    from onnxruntime.quantization.quant_utils import (
        QuantizationMode,
        load_model_with_shape_infer,
        save_and_reload_model_with_shape_infer,
        update_opset_version,
    )
    from onnxruntime.quantization.registry import IntegerOpsRegistry

    from .builders.onnxruntime import _dynamic_options

    options = _dynamic_options(q, src)
    extra = dict(options["extra_options"])
    extra.setdefault("MatMulConstBOnly", True)
    model = update_opset_version(load_model_with_shape_infer(Path(src)), options["weight_type"])
    ONNXModel(model).replace_gemm_with_matmul()
    model = save_and_reload_model_with_shape_infer(model)
    kwargs = {"per_channel": options["per_channel"], "reduce_range": options["reduce_range"],
              "mode": QuantizationMode.IntegerOps, "weight_qType": options["weight_type"],
              "activation_qType": QuantType.QUInt8, "tensors_range": None, "nodes_to_quantize": [],
              "op_types_to_quantize": list(options["op_types_to_quantize"] or IntegerOpsRegistry.keys()),
              "extra_options": extra}
    return model, kwargs


def _quantize_dynamic_in_memory(base: tuple[Any, dict[str, Any]], excluded: list[str]) -> Any:
    """The model `quantize_dynamic(src, dst, nodes_to_exclude=excluded, ...)` writes to `dst`, built in memory
    from `_dynamic_base(q, src)`: byte for byte the same serialized model (tests/components/test_sensitivity.py
    compares them on every probed node), without the per-call shape inference on the whole graph, file write and
    read.

    The ONNXQuantizer is built with static=True, then switched to dynamic: in onnxruntime 1.32 `static` in its
    __init__ only guards the Gemm rewrite and the second shape inference, which `base` already went through, and
    is stored as `.static`; quantize_model reads `.static`. Then, as `ONNXModel.save_model_to_file` does before
    writing: topological sort and its initializer check.

    Args:
        base: `_dynamic_base`'s result (not modified: the quantizer works on a copy).
        excluded: nodes_to_exclude.

    Returns:
        The quantized onnx ModelProto.
    """
    import onnx
    from onnxruntime.quantization.onnx_quantizer import ONNXQuantizer

    inferred, kwargs = base
    model = onnx.ModelProto()
    model.CopyFrom(inferred)
    quantizer = ONNXQuantizer(model, static=True, nodes_to_exclude=excluded,
                              **{**kwargs, "extra_options": dict(kwargs["extra_options"])})
    quantizer.static = False
    quantizer.quantize_model()
    quantizer.model.topological_sort()
    for init in quantizer.model.model.graph.initializer:
        quantizer.model._check_init(init, "end")
    return quantizer.model.model


# Probed nodes are scored by a pool of worker processes (`_workers`): quantizing one node is single-threaded Python
# and protobuf work on the whole graph (load, shape inference, save), so on a 2-core node two workers score the
# probed nodes in about half the wall time; each worker's ONNX Runtime sessions get cores / workers intra-op threads
# (the reference output is computed with the same count). Spawned, not forked: the parent has ORT thread pools.
MAX_WORKERS = 4


def _cores() -> int:
    """The cores this process may run on (its CPU affinity, else os.cpu_count())."""
    import os

    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _workers(n_nodes: int) -> int:
    """Worker processes for `n_nodes` nodes: min(usable cores, MAX_WORKERS, n_nodes), at least 1."""
    return max(1, min(_cores(), MAX_WORKERS, n_nodes))


_CTX: dict[str, Any] = {}


def _init_worker(ctx: dict[str, Any]) -> None:
    """Pool initializer: the context every probed node's scoring reads (graph loaded once per worker; for dynamic
    variants also `_dynamic_base`, the shape-inferred graph every single-node model starts from). Each worker
    quantizes its own link to the prepared graph: ONNX Runtime's quantizer writes `<input>-inferred.onnx` beside
    its input and deletes it after, so two workers sharing one input path would read each other's half-written
    file."""
    import os
    import shutil

    import onnx

    _CTX.clear()
    _CTX.update(ctx)
    src = Path(ctx["named"])
    own = src.with_name(f"{src.stem}-w{os.getpid()}{src.suffix}")
    own.unlink(missing_ok=True)
    try:
        os.link(src, own)
    except OSError:
        shutil.copyfile(src, own)
    _CTX["named"] = str(own)
    _CTX["graph"] = onnx.load(str(own), load_external_data=False).graph
    _CTX["base"] = _CTX["base_error"] = None
    if "q" in ctx and _in_memory(ctx["q"], own):
        try:  # a failure here is every probed node's failure: reported per node, as quantize_dynamic would
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                _CTX["base"] = _dynamic_base(ctx["q"], own)
        except Exception as exc:  # ORT's quantizer raises anything
            _CTX["base_error"] = exc


def _score_node(name: str, op_type: str) -> dict[str, Any]:
    """Quantize `name` alone and score the output against the reference (module docstring, steps 3-4), in a
    worker (`_init_worker`'s context): its own scratch files, so workers never share one. Dynamic: the model
    built in memory is written to the worker's scratch file for the ONNX Runtime session (measured on MiniLM:
    writing 90 MB and a session from the file cost about what a session from the bytes costs)."""
    import os

    ctx = _CTX
    q, work = ctx["q"], Path(ctx["work"])
    t0 = time.perf_counter()
    dst = work / f"single-{os.getpid()}.onnx"
    rec: dict[str, Any] = {"node": name, "op_type": op_type, "error": ""}
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            from .builders.onnxruntime import _quantize_dynamic
            from .calibration import _quantize_static

            excluded = _others_excluded(ctx["graph"], name)
            if ctx.get("base_error") is not None:
                raise ctx["base_error"]
            if ctx.get("base") is not None:  # dynamic: in memory from the worker's shape-inferred graph
                quantized = _quantize_dynamic_in_memory(ctx["base"], excluded)
                dst.write_bytes(quantized.SerializeToString())
                graph = quantized.graph
            else:
                if q.mode == "dynamic":
                    _quantize_dynamic(q, Path(ctx["named"]), dst, excluded, {})
                else:
                    tmp = work / f"calibration-{os.getpid()}"
                    tmp.mkdir(exist_ok=True)
                    _quantize_static(q, Path(ctx["named"]), dst, excluded, ctx["rows"], ctx["model"],
                                     ctx["batch_size"], tmp, {})
                import onnx

                graph = onnx.load(str(dst), load_external_data=False).graph
        rec["quantized"] = _has_quantized_ops(graph)
        rec["output_rel_l2"], rec["output_cosine_drop"] = output_errors(
            ctx["reference"], _run(dst, ctx["rows"], ctx["model"], ctx["provider"], ctx["batch_size"],
                                   ctx["threads"]))
    except InputError:
        raise
    except Exception as exc:  # ORT's quantizer raises anything; a node it cannot quantize alone is reported
        rec.update(quantized=False, output_rel_l2=float("inf"), output_cosine_drop=FAILED_COSINE_DROP,
                   error=f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}")
    rec["seconds"] = round(time.perf_counter() - t0, 4)
    dst.unlink(missing_ok=True)
    return rec


def output_errors(reference: np.ndarray, candidate: np.ndarray) -> tuple[float, float]:
    """Mean relative L2 error and mean cosine drop of `candidate` vs `reference` (module docstring, step 4).

    Args:
        reference: (rows, ...) float, the FP32 output.
        candidate: (rows, ...) float, the same shape.

    Returns:
        (output_rel_l2, output_cosine_drop); (+inf, 2.0) when the candidate holds NaN/inf.

    Raises:
        InputError: the shapes differ.
    """
    ref = np.asarray(reference, dtype=np.float64).reshape(len(reference), -1)
    cand = np.asarray(candidate, dtype=np.float64).reshape(len(candidate), -1)
    if ref.shape != cand.shape:
        raise InputError(f"sensitivity: output shapes differ: reference {ref.shape}, quantized {cand.shape}")
    if not np.all(np.isfinite(cand)):
        return float("inf"), FAILED_COSINE_DROP
    rn = np.maximum(np.linalg.norm(ref, axis=1), NORM_EPS)
    cn = np.maximum(np.linalg.norm(cand, axis=1), NORM_EPS)
    rel = np.linalg.norm(cand - ref, axis=1) / rn
    cos = np.clip((ref * cand).sum(axis=1) / (rn * cn), -1.0, 1.0)
    return float(rel.mean()), float((1.0 - cos).mean())


def node_sensitivity(variant: VariantSpec, fp32_onnx: str | Path, data: Dataset, model: ModelSpec, *, samples: int,
                     work_dir: str | Path, batch_size: int = 8) -> pd.DataFrame:
    """Rank the variant's quantizable nodes by how much quantizing each ALONE changes the model output.

    Method and formulas: module docstring. Static variants calibrate each single-node model on the same rows.

    Args:
        variant: `tailguard.core.spec.variants.VariantSpec`, precision int8 on onnxruntime (its `quantization` is used).
        fp32_onnx: the FP32 reference .onnx file.
        data: rows to measure on (calibration rows); the first `samples` rows are used.
        model: `tailguard.core.spec.model.ModelSpec` (inputs, pad values; the first output is compared).
        samples: at most this many rows.
        work_dir: scratch folder (created): the prepared graph and one quantized model per worker at a time.
        batch_size: rows per inference / calibration batch.

    Returns:
        DataFrame, one row per probed node, ranked: rank (1 = most sensitive), node, op_type,
        output_rel_l2 (float, unitless), output_cosine_drop (float in [0, 2]), quantized (bool: the single-node
        model holds integer / QDQ ops; False means the quantizer left the node in float and both errors are 0),
        seconds (quantize + run, s; a worker's one-off `_dynamic_base` not included), error ("" or why
        quantizing that node failed; such nodes score +inf and rank first: keeping them in float is the safe
        choice). Sorted by output_rel_l2 descending, ties by node name. Empty (same columns) when the graph has
        no probed node.

    Raises:
        InputError: the variant is not an INT8 ONNX Runtime variant, `fp32_onnx` is missing, or `data` has
            no rows.
    """
    import onnx

    from .builders.onnxruntime import _excluded_nodes, _optimize_graph, _preprocess

    q = variant.quantization
    if variant.precision != "int8" or variant.backend != "onnxruntime" or q is None:
        raise InputError(f"sensitivity: variant {variant.name} is not an INT8 ONNX Runtime variant")
    fp32 = Path(fp32_onnx)
    if not fp32.is_file():
        raise InputError(f"sensitivity: FP32 ONNX file not found: {fp32}")
    if data.n_rows == 0:
        raise InputError(f"sensitivity: no rows to measure on ({data.uri})",
                         hint="the calibration set (data.calibration) must hold rows")
    rows = data.subset(np.arange(min(samples, data.n_rows)))
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    details: dict[str, Any] = {}
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        source = _optimize_graph(variant, fp32, work / "optimized.onnx", details)
        if q.preprocess:
            source = _preprocess(source, work / "preprocessed.onnx", details)
    # the variant's own float nodes (exclude_nodes / exclude_op_types) are not probed
    own_float, _ = _excluded_nodes(source, q)
    graph = onnx.load(str(source), load_external_data=False).graph
    probed = [(n, t) for n, t in probed_nodes(graph, q) if n not in set(own_float)]
    named = _name_unnamed(source, work / "named.onnx")
    provider = variant.execution_provider
    workers = _workers(len(probed))
    threads = max(1, _cores() // workers)  # the node's usable cores shared among the workers
    reference = _run(named, rows, model, provider, batch_size, threads)
    ctx = {"q": q, "named": str(named), "work": str(work), "rows": rows, "model": model, "provider": provider,
           "batch_size": batch_size, "threads": threads, "reference": reference}
    if workers <= 1:
        _init_worker(ctx)
        records = [_score_node(n, t) for n, t in probed]
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                 initializer=_init_worker, initargs=(ctx,)) as pool:
            records = list(pool.map(_score_node, [n for n, _ in probed], [t for _, t in probed]))
    for link in work.glob(f"{Path(named).stem}-w*{Path(named).suffix}"):  # the workers' links (_init_worker)
        link.unlink(missing_ok=True)
    frame = pd.DataFrame.from_records(records, columns=[c for c in SENSITIVITY_COLUMNS if c != "rank"])
    if frame.empty:
        frame.insert(0, "rank", pd.Series(dtype=np.int64))
        return frame
    frame = frame.sort_values(["output_rel_l2", "node"], ascending=[False, True], kind="stable")
    frame = frame.reset_index(drop=True)
    frame.insert(0, "rank", np.arange(1, len(frame) + 1))
    frame["quantized"] = frame["quantized"].astype(bool)
    return frame


# ---------------------------------------------------------------------------------------------- artifacts
TOP_SENSITIVITY = 20  # nodes in search.json and in the sensitivity plot


def _bar_plot(sens: pd.DataFrame, path: Path) -> None:
    """Bar chart of the TOP_SENSITIVITY most sensitive nodes of `sens` (node_sensitivity's table) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    top = sens.head(TOP_SENSITIVITY)
    fig, ax = plt.subplots(figsize=(8, max(2.0, 0.32 * len(top) + 1.0)))
    if len(top):
        vals = np.nan_to_num(top["output_rel_l2"].to_numpy(dtype=float), posinf=np.nan)
        finite_max = np.nanmax(vals) if np.isfinite(vals).any() else 1.0
        vals = np.where(np.isnan(vals), finite_max, vals)
        labels = [f"{n} ({t})" for n, t in zip(top["node"], top["op_type"])]
        ax.barh(range(len(top))[::-1], vals, color="#c44e52")
        ax.set_yticks(range(len(top))[::-1])
        ax.set_yticklabels(labels, fontsize=7)
    else:
        ax.text(0.5, 0.5, "no quantizable node", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("output relative L2 error, this node quantized alone")
    ax.set_title("Quantization sensitivity (most sensitive first)")
    ax.grid(axis="x", alpha=0.3)
    fig.savefig(path, dpi=90, bbox_inches="tight")
    plt.close(fig)


def write_sensitivity_artifacts(sensitivity: pd.DataFrame, out_dir: str | Path) -> dict[str, str]:
    """Write a sensitivity ranking (`sensitivity.node_sensitivity` output) as sensitivity.csv (every node) and
    sensitivity.png (bar chart of the TOP_SENSITIVITY most sensitive nodes) into `out_dir` (created).

    Returns:
        {file name: path}.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"sensitivity.csv": out / "sensitivity.csv", "sensitivity.png": out / "sensitivity.png"}
    sensitivity.to_csv(paths["sensitivity.csv"], index=False)
    _bar_plot(sensitivity, paths["sensitivity.png"])
    return {k: str(v) for k, v in paths.items()}
