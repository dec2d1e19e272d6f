"""The ONNX graph files of a build: parsed once per build, checked, saved self-contained, counted.

The builders (`builders/onnxruntime.py`, `builders/tensorrt.py`), calibration (`calibration.py`), the diagnostics
(`diagnostics.py`) and the sensitivity analysis (`sensitivity.py`) read and write graphs through these helpers:
`_graph` (the per-build parse memo, `_graph_scope`), `_check_inputs` (the FP32 file and the calibration rows a
variant needs), `_save_self_contained` (one file, external data only above 2 GB), `_op_counts` / `_summary` (what
a build.json records of a graph) and `_load_check` (the artifact opens in ONNX Runtime on its providers).
"""

from __future__ import annotations

import contextlib
import os
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from tailguard.core.contract import ONNX_INLINE_LIMIT_BYTES as TWO_GB  # protobuf's 2 GiB limit
from tailguard.core.errors import InputError

if TYPE_CHECKING:  # tailguard.core.data imports pandas: a build that reads no calibration rows never loads it
    from tailguard.core.data import Dataset
    from tailguard.core.spec.variants import VariantSpec


# Operators that compute in integer arithmetic (QOperator format and dynamic quantization).
INTEGER_OP_TYPES = frozenset({"MatMulInteger", "ConvInteger", "DynamicQuantizeMatMul", "MatMulIntegerToFloat",
                              "QAttention", "QGemm", "QEmbedLayerNormalization", "DynamicQuantizeLSTM"})
QDQ_OP_TYPES = frozenset({"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear"})
_MATMUL_OPS = ("MatMul", "Gemm", "FusedMatMul", "FusedGemm", "Conv", "FusedConv", "ConvTranspose", "Attention",
               "MultiHeadAttention")


# ----------------------------------------------------------------------------- one parse per graph file per build
# A build reads the same .onnx files several times (op counts, excluded nodes, contrib-op check, graph inputs,
# attention check, coverage, summary); each parse of MiniLM's 90 MB graph takes 0.1-0.2 s (py-spy of the demo: about
# 1 s per INT8 build in parses). Inside `build_variant` (`_graph_scope`), `_graph` parses a file once: keyed on the
# file's resolved path, inode, size and mtime (a rewritten file is parsed again), at most _GRAPHS_MAX kept; the scope
# drops them when the build ends. Outside a build (the sensitivity analysis, checks) every call parses. Callers
# only read what it returns.
_GRAPHS: OrderedDict[tuple, Any] | None = None


_GRAPHS_MAX = 3


@contextlib.contextmanager
def _graph_scope() -> Iterator[None]:
    """Within it, `_graph` parses each file once; on leaving, the parsed graphs are dropped."""
    global _GRAPHS
    outer, _GRAPHS = _GRAPHS, OrderedDict() if _GRAPHS is None else _GRAPHS
    try:
        yield
    finally:
        _GRAPHS = outer


def _graph(path: str | Path) -> Any:
    """The onnx ModelProto of `path` (external data not loaded), parsed once per build (comment above); read only.

    Raises:
        OSError: the file cannot be read; onnx's DecodeError and friends: not an ONNX file.
    """
    import onnx

    if _GRAPHS is None:
        return onnx.load(str(path), load_external_data=False)
    st = os.stat(path)
    key = (os.path.realpath(path), st.st_ino, st.st_size, st.st_mtime_ns)
    if key in _GRAPHS:
        _GRAPHS.move_to_end(key)
        return _GRAPHS[key]
    proto = onnx.load(str(path), load_external_data=False)
    _GRAPHS[key] = proto
    while len(_GRAPHS) > _GRAPHS_MAX:
        _GRAPHS.popitem(last=False)
    return proto


def _check_inputs(variant: VariantSpec, fp32_onnx: str | Path, calibration: Dataset | None) -> Path:
    path = Path(fp32_onnx)
    if not path.is_file():
        raise InputError(f"variant {variant.name}: FP32 ONNX file not found: {path}",
                         hint="run the export step first, or pass the path of the exported .onnx file")
    try:
        _graph(path)
    except Exception as exc:  # DecodeError and friends: not an ONNX file
        raise InputError(f"variant {variant.name}: {path} is not a readable ONNX model: "
                         f"{type(exc).__name__}: {str(exc)[:200]}",
                         hint="pass the .onnx file written by the export step") from None
    q = variant.quantization
    if q is not None and q.mode == "static" and (calibration is None or calibration.n_rows == 0):
        raise InputError(f"variants.{variant.name}.quantization: static INT8 needs calibration rows but none "
                         "were given", hint="set data.calibration in the spec (a Parquet file with the model inputs)")
    return path


def _has_contrib_ops(src: Path) -> bool:

    graph = _graph(src).graph
    return any(n.domain not in ("", "ai.onnx") for n in graph.node)


def _quant_type(name: str):
    from onnxruntime.quantization import QuantType

    return {"int8": QuantType.QInt8, "uint8": QuantType.QUInt8}[name]


def _large(src: Path) -> bool:
    return src.stat().st_size >= TWO_GB


# --------------------------------------------------------------------------------------- files and facts
def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return {k: (v if isinstance(v, (bool, int, float, str, type(None))) else str(v)) for k, v in d.items()}


def _save_proto(proto: Any, dst: Path) -> None:
    import onnx

    if proto.ByteSize() < TWO_GB:
        onnx.save_model(proto, str(dst))
    else:
        onnx.save_model(proto, str(dst), save_as_external_data=True, location=dst.name + ".data")


def _save_self_contained(src: Path, dst: Path, metadata: dict[str, str] | None = None) -> None:
    """Load `src` (with its external data) and save it as `dst`, with `metadata` set in metadata_props."""
    import onnx

    proto = onnx.load(str(src))
    if metadata:
        keep = [p for p in proto.metadata_props if p.key not in metadata]
        del proto.metadata_props[:]
        proto.metadata_props.extend(keep)
        for k, v in metadata.items():
            proto.metadata_props.add(key=k, value=v)
    _save_proto(proto, dst)


def _op_counts(path: Path) -> dict[str, int]:

    counts: dict[str, int] = {}
    for n in _graph(path).graph.node:
        counts[n.op_type] = counts.get(n.op_type, 0) + 1
    return counts


def _summary(path: Path, excluded: list[str]) -> dict[str, Any]:
    """Facts of the built model: op counts, quantized nodes, float MatMul-like nodes left, excluded nodes kept
    in float, initializer dtypes, file size (bytes, incl. external data).

    A node counts as quantized when it computes in integers (MatMulInteger, QLinear*, QAttention, ...), reads a
    tensor dequantized from an integer weight or from a QuantizeLinear (QDQ format), or reads an 8-bit
    initializer directly (a quantized Gather).
    """
    import onnx

    proto = _graph(path)
    nodes = list(proto.graph.node)
    is_quantized = _quantized_test(proto)
    counts: dict[str, int] = {}
    quantized: dict[str, int] = {}
    float_left: list[str] = []
    for n in nodes:
        counts[n.op_type] = counts.get(n.op_type, 0) + 1
        if n.op_type in QDQ_OP_TYPES:
            continue
        if is_quantized(n):
            quantized[n.op_type] = quantized.get(n.op_type, 0) + 1
        elif n.op_type in _MATMUL_OPS:
            float_left.append(n.name)
    by_name = {n.name: n for n in nodes}
    kept_float = [name for name in excluded if name in by_name and not is_quantized(by_name[name])]
    locations = {e.value for t in proto.graph.initializer for e in t.external_data if e.key == "location"}
    size = path.stat().st_size + sum((path.parent / loc).stat().st_size for loc in locations)
    init_types: dict[str, int] = {}
    for t in proto.graph.initializer:
        name = onnx.TensorProto.DataType.Name(t.data_type).lower()
        init_types[name] = init_types.get(name, 0) + 1
    return {"op_types": counts, "quantized_nodes": sum(quantized.values()), "quantized_by_op": quantized,
            "quantize_ops": {k: counts[k] for k in sorted(QDQ_OP_TYPES) if counts.get(k)},
            "float_matmul_nodes": float_left, "excluded_kept_float": kept_float,
            "initializer_dtypes": init_types, "bytes": int(size), "external_data": bool(locations),
            "nodes": len(nodes)}


def _quantized_test(proto: Any) -> Any:
    """A predicate node -> bool: the node computes in integers (MatMulInteger, QLinear*, QAttention, ...), reads a
    tensor dequantized from an integer weight or from a QuantizeLinear (QDQ format), or reads an 8-bit initializer
    directly (a quantized Gather)."""
    import onnx

    nodes = list(proto.graph.node)
    by_output = {o: n for n in nodes for o in n.output}
    int8_inits = {t.name for t in proto.graph.initializer
                  if t.data_type in (onnx.TensorProto.INT8, onnx.TensorProto.UINT8)}
    inits = {t.name for t in proto.graph.initializer}

    def from_quantized(tensor: str) -> bool:
        dq = by_output.get(tensor)
        if dq is None or dq.op_type != "DequantizeLinear":
            return False
        src = by_output.get(dq.input[0])
        return dq.input[0] in inits or (src is not None and src.op_type in ("QuantizeLinear", "DynamicQuantizeLinear"))

    def is_quantized(n: Any) -> bool:
        return (n.op_type in INTEGER_OP_TYPES or n.op_type.startswith("QLinear")
                or any(from_quantized(i) or i in int8_inits for i in n.input))

    return is_quantized


def _quantized_node_names(path: Path) -> set[str]:
    """Names of the nodes of `path` that compute in INT8 (`_quantized_test`; QDQ/integer ops themselves left out)."""
    proto = _graph(path)
    test = _quantized_test(proto)
    return {n.name for n in proto.graph.node if n.op_type not in QDQ_OP_TYPES and test(n)}


def _load_check(path: Path, providers: list) -> None:
    """Open the built model once on its execution provider, with the options it will run with (`ort_providers`,
    cache paths in the variant's folder): a variant that cannot load, or whose first provider ONNX Runtime drops,
    is a failed build. On the TensorRT EP this builds the engines into the engine cache the validate step reuses."""
    import onnxruntime as ort

    from tailguard.core.runtime import require_active_provider, resolve_provider_paths

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    resolved = resolve_provider_paths(providers, path.parent)
    require_active_provider(ort.InferenceSession(str(path), sess_options=opts, providers=resolved), resolved)
