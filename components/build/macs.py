"""Multiply-accumulates (MACs) per node of an ONNX graph, and the share of them an INT8 build computes in integers.

Why: a node count hides what matters. ORT's extended graph optimization fused Gemm+Relu into FusedGemm, which no
quantizer knows, so an "INT8" MLP quantized 1 of its 3 layers (9% of its MACs) and still read "passed". The build
step (`builders.onnxruntime.quantize_onnxruntime`) counts MACs on the FP32 graph it gives the quantizer and on the
quantized graph, and reports `quantized_mac_fraction` = MACs in INT8 / all MACs; a spec may gate on it.

Shapes: ONNX shape inference (`onnx.shape_inference.infer_shapes`, data propagation on) after every symbolic
dimension of the graph inputs is made concrete; when that leaves a MAC node's inputs untyped (contrib ops such
as SkipLayerNormalization or Attention after BERT fusion), ONNX Runtime's symbolic shape inference
(`onnxruntime.tools.symbolic_shape_infer`, auto_merge, guess_output_rank) is tried too. A node whose shapes are
still unknown gets `macs=None` and is listed, never guessed.

Both inferences run on a skeleton of the graph, not on its weights: every float or 8-bit initializer of rank
>= 2 with more than KEEP_VALUES_NUMEL elements becomes a graph input of its element type and dims, without data
(copying and serializing MiniLM's 90 MB of weights took ~1 s per coverage). The shapes are the same, because
neither inference reads such a tensor's values: ONNX's data propagation and the shape-computing inputs it reads
(Reshape's shape, Slice's starts, Resize's scales, ...) are 0-D/1-D, and ORT's ignores values of rank > 1. As a
guard, a graph in which such a weight feeds an input outside `_SHAPE_ONLY_USES` (MAC operands, Q/DQ, Gather's
data, elementwise arithmetic, normalization weights), or which has sub-graphs, is inferred with all its
weights. `keep_weights=True` forces that reference path; the tests check both give the same counts.

Symbolic dimensions (`concrete_dims`): the first axis of every graph input is the batch and is evaluated at 1
(MACs per sample); every other symbolic axis (sequence, time, ...) at `sequence`: the build passes the median
row length of the calibration rows when it has them, else `DEFAULT_SEQUENCE` (128, a documented assumption).
Only attention-style products (S x S terms) make the fraction depend on that length; MLPs and CNNs with fixed
feature dims do not.

Formulas (per node; shapes at the concrete dims; bias adds, activations and normalizations are not MACs):

    MatMul family        A [..., M, K] x B [..., K, N]          MACs = prod(broadcast(...)) * M * K * N
      (MatMul, FusedMatMul (transA/transB), MatMulInteger, QLinearMatMul, MatMulIntegerToFloat,
      DynamicQuantizeMatMul; a 1-D A is [1, K], a 1-D B is [K, 1])
    Gemm family          A (M, K), B (K, N) after transA/transB MACs = M * K * N          (Gemm, FusedGemm, QGemm)
    Conv family          X (N, C, D1..Dd), W (M, C/group, k1..kd), Y (N, M, O1..Od)
                                                                MACs = N * M * prod(O) * (C/group) * prod(k)
      (Conv, FusedConv, ConvInteger, QLinearConv; Y from shape inference, else from pads/strides/dilations/
      auto_pad: O = floor((D + pad_begin + pad_end - dilation * (k - 1) - 1) / stride) + 1)
    ConvTranspose        X (N, C, D1..Dd), W (C, M/group, k1..kd) MACs = numel(X) * (M/group) * prod(k)
    Attention / QAttention (com.microsoft, no past state)
                         X (B, S, D_in), W (D_in, Dq + Dk + Dv)  MACs = B*S*D_in*(Dq+Dk+Dv) + B*S*S*(Dq+Dv)
      (projections, then Q.K^T and softmax.V over all heads; Dq = Dk = Dv = W's columns / 3 unless
      qkv_hidden_sizes says otherwise)
    MultiHeadAttention   Q (B, S, D), K (B, L, D), V (B, L, Dv)  MACs = B*S*L*(D + Dv)    (3-D inputs only)
    LSTM / GRU / RNN / DynamicQuantizeLSTM
                         X (S, B, I) (layout 1: (B, S, I)), W (dirs, g*H, I), R (dirs, g*H, H)
                                                                MACs = S * B * (numel(W) + numel(R))

Not counted: Einsum, ops with sub-graphs (If/Loop/Scan bodies), convolutions of other domains (NCHWc).

INT8 or not: a node computes in INT8 when it is an integer op (MatMulInteger, QLinearMatMul, ConvInteger,
QLinearConv, QGemm, QAttention, MatMulIntegerToFloat, DynamicQuantizeMatMul, DynamicQuantizeLSTM), or, in QDQ
format, when every one of its MAC operands (A and B; X and W; X, W and R) is the output of a DequantizeLinear
of an 8-bit tensor (an int8/uint8 initializer, or a QuantizeLinear / DynamicQuantizeLinear output with an
8-bit zero point). A weight-only DequantizeLinear in front of a float activation is float compute.
"""

from __future__ import annotations

import contextlib
import math
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

DEFAULT_SEQUENCE = 128  # symbolic non-batch axes without calibration rows (module docstring)
BATCH = 1               # MACs are per sample: the batch axis is evaluated at 1

# op type -> (family, indices of the MAC operands among the node's inputs)
MAC_OPS: dict[str, tuple[str, tuple[int, ...]]] = {
    "MatMul": ("matmul", (0, 1)), "FusedMatMul": ("matmul", (0, 1)), "MatMulInteger": ("matmul", (0, 1)),
    "MatMulIntegerToFloat": ("matmul", (0, 1)), "DynamicQuantizeMatMul": ("matmul", (0, 1)),
    "QLinearMatMul": ("matmul", (0, 3)),
    "Gemm": ("gemm", (0, 1)), "FusedGemm": ("gemm", (0, 1)), "QGemm": ("gemm", (0, 3)),
    "Conv": ("conv", (0, 1)), "FusedConv": ("conv", (0, 1)), "ConvInteger": ("conv", (0, 1)),
    "QLinearConv": ("conv", (0, 3)),
    "ConvTranspose": ("conv_transpose", (0, 1)),
    "Attention": ("attention", (0, 1)), "QAttention": ("attention", (0, 1)),
    "MultiHeadAttention": ("mha", (0, 1, 2)),
    "LSTM": ("rnn", (0, 1, 2)), "GRU": ("rnn", (0, 1, 2)), "RNN": ("rnn", (0, 1, 2)),
    "DynamicQuantizeLSTM": ("rnn", (0, 1, 2)),
}
# Ops that compute their MACs in integers whatever feeds them.
INTEGER_MAC_OPS = frozenset({"MatMulInteger", "MatMulIntegerToFloat", "DynamicQuantizeMatMul", "QLinearMatMul",
                             "QGemm", "ConvInteger", "QLinearConv", "QAttention", "DynamicQuantizeLSTM"})
_PASS_THROUGH = frozenset({"DequantizeLinear", "QuantizeLinear", "DynamicQuantizeLinear", "Cast", "Identity"})
_EIGHT_BIT = (2, 3)  # onnx.TensorProto.UINT8, INT8

Shape = tuple  # of int | None


@dataclass
class NodeMacs:
    """One MAC-carrying node.

    Attributes:
        name: node name ("" when unnamed); op_type: its op type.
        macs: multiply-accumulates per sample at the concrete dims (int), None when its shapes are unknown.
        int8: the node computes in INT8 (module docstring).
        reason: why `macs` is None ("" otherwise).
    """

    name: str
    op_type: str
    macs: int | None
    int8: bool
    reason: str = ""


@dataclass
class MacCount:
    """The MAC-carrying nodes of one graph.

    Attributes:
        nodes: one NodeMacs per node of a MAC_OPS type, graph order.
        dims: {symbolic dim name (or "<input>[<axis>]" when unnamed): value used}.
        shapes: {tensor name: shape} the counting used (inputs, initializers, inferred tensors).
    """

    nodes: list[NodeMacs]
    dims: dict[str, int] = field(default_factory=dict)
    shapes: dict[str, Shape] = field(default_factory=dict, repr=False)

    @property
    def total(self) -> int:
        """MACs of the nodes whose shapes are known (per sample)."""
        return sum(n.macs for n in self.nodes if n.macs is not None)

    @property
    def int8(self) -> int:
        """MACs of the known INT8 nodes (per sample)."""
        return sum(n.macs for n in self.nodes if n.macs is not None and n.int8)

    @property
    def fraction(self) -> float | None:
        """int8 / total, in [0, 1]; None when no MAC was counted."""
        return self.int8 / self.total if self.total else None

    @property
    def unknown(self) -> list[str]:
        """Names (or op types) of MAC nodes whose MACs could not be computed."""
        return [n.name or n.op_type for n in self.nodes if n.macs is None]


# ------------------------------------------------------------------------------------------------- shapes
def _load(model: Any) -> Any:
    import onnx

    if isinstance(model, (str, Path)):
        return onnx.load(str(model), load_external_data=False)
    return model


def concrete_dims(model: Any, *, batch: int = BATCH, sequence: int = DEFAULT_SEQUENCE) -> dict[str, int]:
    """The values the symbolic axes of a graph's inputs are evaluated at.

    Args:
        model: ModelProto or path of an .onnx file.
        batch: value of every input's first axis when symbolic (default 1: MACs per sample).
        sequence: value of every other symbolic axis.

    Returns:
        {dim name: value}; an unnamed symbolic axis is keyed "<input name>[<axis>]".
    """
    out: dict[str, int] = {}
    for key, axis, _ in _symbolic_input_dims(_load(model)):
        out.setdefault(key, batch if axis == 0 else sequence)
    return out


def _symbolic_input_dims(m: Any) -> Iterator[tuple[str, int, Any]]:
    """(key, axis, dim proto) for each symbolic axis of the graph's tensor inputs (initializers listed as inputs
    excluded): a dim without a positive dim_value. key = the dim_param, or "<input name>[<axis>]" when unnamed."""
    inits = {t.name for t in m.graph.initializer}
    for inp in m.graph.input:
        if inp.name in inits or not inp.type.HasField("tensor_type"):
            continue
        for axis, d in enumerate(inp.type.tensor_type.shape.dim):
            if not (d.HasField("dim_value") and d.dim_value > 0):
                yield d.dim_param or f"{inp.name}[{axis}]", axis, d


def _with_concrete_inputs(m: Any, dims: dict[str, int], *, keep_weights: bool = False) -> Any:
    """A copy of `m` whose graph inputs have concrete dims, without stale value_info or output shapes; unless
    `keep_weights`, a skeleton (`_skeleton`) whose large weights are typed graph inputs without data."""
    import onnx

    if keep_weights or _value_read_risk(m):
        c = onnx.ModelProto()
        c.CopyFrom(m)
    else:
        c = _skeleton(m)
    for key, axis, d in list(_symbolic_input_dims(c)):  # listed first: the loop rewrites the dims it walks
        value = dims.get(key, BATCH if axis == 0 else DEFAULT_SEQUENCE)
        d.Clear()
        d.dim_value = int(value)
    del c.graph.value_info[:]
    for o in c.graph.output:  # inferred shapes must not clash with the exporter's symbolic ones
        if o.type.HasField("tensor_type"):
            o.type.tensor_type.ClearField("shape")
    return c


# Initializers whose data the skeleton drops: float or 8-bit, rank >= 2, more than this many elements.
KEEP_VALUES_NUMEL = 1024
_STRIPPED_TYPES = frozenset({1, 2, 3, 10, 11, 16})  # FLOAT, UINT8, INT8, FLOAT16, DOUBLE, BFLOAT16
# Where a stripped tensor may be consumed: op type -> input indices (None: any) whose shape inference (ONNX's and
# ORT's symbolic) reads that input's shape only. Anywhere else the full graph is used.
_SHAPE_ONLY_USES: dict[str, tuple[int, ...] | None] = {
    **{op: None for op in MAC_OPS},
    "DequantizeLinear": (0,), "QuantizeLinear": (0,), "Gather": (0,), "Transpose": (0,),
    "Add": None, "Sub": None, "Mul": None, "Div": None,
    "LayerNormalization": (1, 2), "SimplifiedLayerNormalization": (1,), "SkipLayerNormalization": (2, 3, 4),
    "SkipSimplifiedLayerNormalization": (2, 3), "EmbedLayerNormalization": (2, 3, 4, 5, 6),
    "QEmbedLayerNormalization": None, "BiasGelu": (1,), "FastGelu": (1,),
}


def _strippable(t: Any) -> bool:
    return t.data_type in _STRIPPED_TYPES and len(t.dims) >= 2 and _prod(t.dims) > KEEP_VALUES_NUMEL


def _value_read_risk(m: Any) -> bool:
    """True when a strippable initializer is used where shape inference might read its values: as an input
    outside `_SHAPE_ONLY_USES`, as a graph output, or anywhere in a graph with sub-graphs (If/Loop/Scan bodies
    see the outer graph's tensors)."""
    g = m.graph
    strip = {t.name for t in g.initializer if _strippable(t)}
    if not strip:
        return False
    if any(o.name in strip for o in g.output):
        return True
    for n in g.node:
        if any(a.type in (5, 10) for a in n.attribute):  # AttributeProto.GRAPH, GRAPHS
            return True
        for i, name in enumerate(n.input):
            if name in strip:
                allowed = _SHAPE_ONLY_USES.get(n.op_type, ())
                if allowed is not None and i not in allowed:
                    return True
    return False


def _skeleton(m: Any) -> Any:
    """A copy of `m` in which every strippable initializer (float or 8-bit, rank >= 2, more than
    KEEP_VALUES_NUMEL elements) is a graph input of the same element type and dims instead: its data is neither
    copied nor serialized. Initializers listed as graph inputs keep their place; the others are appended."""
    import onnx

    c = onnx.ModelProto()
    for f, v in m.ListFields():
        if f.name != "graph":
            _copy_field(c, f, v)
    for f, v in m.graph.ListFields():
        if f.name != "initializer":
            _copy_field(c.graph, f, v)
    inputs = {i.name: i for i in c.graph.input}
    for t in m.graph.initializer:
        if not _strippable(t):
            c.graph.initializer.add().CopyFrom(t)
            continue
        vi = inputs.get(t.name) or c.graph.input.add()
        vi.CopyFrom(onnx.helper.make_tensor_value_info(t.name, t.data_type, [int(d) for d in t.dims]))
    return c


def _copy_field(dst: Any, f: Any, v: Any) -> None:
    if f.label == f.LABEL_REPEATED:
        getattr(dst, f.name).extend(v)
    elif f.type == f.TYPE_MESSAGE:
        getattr(dst, f.name).CopyFrom(v)
    else:
        setattr(dst, f.name, v)


def _collect(m: Any) -> dict[str, Shape]:
    out: dict[str, Shape] = {}
    for vi in list(m.graph.input) + list(m.graph.value_info) + list(m.graph.output):
        t = vi.type.tensor_type if vi.type.HasField("tensor_type") else None
        if t is None or not t.HasField("shape"):
            continue
        out[vi.name] = tuple(d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None
                             for d in t.shape.dim)
    for t in m.graph.initializer:
        out[t.name] = tuple(int(d) for d in t.dims)
    return out


def infer_shapes(model: Any, dims: dict[str, int], *, symbolic: bool = False,
                 keep_weights: bool = False) -> dict[str, Shape]:
    """Tensor shapes of a graph at concrete input dims.

    Args:
        model: ModelProto or path (external data is not needed: only initializer dims are read).
        dims: `concrete_dims` output.
        symbolic: also run ONNX Runtime's symbolic shape inference (knows contrib ops such as Attention and
            SkipLayerNormalization) for the tensors ONNX shape inference left unknown. It runs in a scratch
            folder: it dumps a file into the current directory when it fails.
        keep_weights: infer on a copy with every initializer's data (the reference; slower). By default large
            weights are given by element type and dims only (module docstring), with the same result.

    Returns:
        {tensor name: shape tuple (int per axis, None where unknown)} for inputs, initializers and every
        tensor inference typed.
    """
    m = _with_concrete_inputs(_load(model), dims, keep_weights=keep_weights)
    shapes = _infer_onnx(m)
    return _infer_symbolic(m, shapes) if symbolic else shapes


def _infer_onnx(m: Any) -> dict[str, Shape]:
    """Shapes of `m` (concrete inputs) from ONNX shape inference with data propagation."""
    import onnx

    shapes = _collect(m)
    with contextlib.suppress(Exception):  # inference may reject a graph; what was typed so far is kept
        shapes.update(_collect(onnx.shape_inference.infer_shapes(m, check_type=False, strict_mode=False,
                                                                 data_prop=True)))
    return shapes


def _infer_symbolic(m: Any, shapes: dict[str, Shape]) -> dict[str, Shape]:
    """`shapes` (from `_infer_onnx(m)`) plus ORT's symbolic shape inference for the tensors they leave unknown."""
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    shapes = dict(shapes)
    with tempfile.TemporaryDirectory(prefix="tailguard-shapes-") as scratch, contextlib.chdir(scratch), \
            contextlib.suppress(Exception):
        inferred = SymbolicShapeInference.infer_shapes(m, auto_merge=True, guess_output_rank=True)
        for name, shape in _collect(inferred).items():
            if not _known(shapes.get(name)):
                shapes[name] = shape
    return shapes


def _known(shape: Shape | None) -> bool:
    return shape is not None and all(isinstance(d, int) and d > 0 for d in shape)


# --------------------------------------------------------------------------------------------- counting
def _attr(node: Any, name: str, default: Any) -> Any:
    import onnx

    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def _prod(xs: Iterable[int]) -> int:
    return math.prod(int(x) for x in xs)


def _matmul(node: Any, a: Shape, b: Shape) -> int:
    a, b = list(a), list(b)
    if len(a) == 1:
        a = [1] + a
    if len(b) == 1:
        b = b + [1]
    if _attr(node, "transA", 0):
        a[-2], a[-1] = a[-1], a[-2]
    if _attr(node, "transB", 0):
        b[-2], b[-1] = b[-1], b[-2]
    m, k, n = a[-2], a[-1], b[-1]
    ba, bb = a[:-2], b[:-2]
    width = max(len(ba), len(bb))
    ba, bb = [1] * (width - len(ba)) + ba, [1] * (width - len(bb)) + bb
    return _prod(max(x, y) for x, y in zip(ba, bb)) * m * k * n


def _gemm(node: Any, a: Shape, b: Shape) -> int:
    m, k = (a[1], a[0]) if _attr(node, "transA", 0) else (a[0], a[1])
    n = b[0] if _attr(node, "transB", 0) else b[1]
    return int(m) * int(k) * int(n)


def _conv_out(node: Any, x: Shape, w: Shape) -> list[int]:
    spatial = list(x[2:])
    k = list(w[2:])
    d = len(spatial)
    strides = list(_attr(node, "strides", [1] * d))
    dil = list(_attr(node, "dilations", [1] * d))
    pads = list(_attr(node, "pads", [0] * (2 * d)))
    auto = _attr(node, "auto_pad", b"NOTSET")
    auto = auto.decode() if isinstance(auto, bytes) else str(auto)
    out = []
    for i in range(d):
        if auto in ("SAME_UPPER", "SAME_LOWER"):
            out.append(-(-spatial[i] // strides[i]))
        else:
            pad = 0 if auto == "VALID" else pads[i] + pads[i + d]
            out.append((spatial[i] + pad - dil[i] * (k[i] - 1) - 1) // strides[i] + 1)
    return out


def _conv(node: Any, x: Shape, w: Shape, y: Shape | None) -> int:
    spatial = list(y[2:]) if _known(y) and len(y) == len(x) else _conv_out(node, x, w)
    return int(x[0]) * int(w[0]) * _prod(spatial) * _prod(w[1:])


def _attention(node: Any, x: Shape, w: Shape) -> int:
    b, s, d_in = x
    sizes = list(_attr(node, "qkv_hidden_sizes", []))
    dq, _, dv = sizes if len(sizes) == 3 else [w[1] // 3] * 3
    return int(b) * int(s) * int(d_in) * int(w[1]) + int(b) * int(s) * int(s) * (int(dq) + int(dv))


def _mha(q: Shape, k: Shape, v: Shape) -> int:
    if len(q) != 3 or len(k) != 3 or len(v) != 3:
        raise ValueError("only 3-D query/key/value layouts are counted")
    b, s, d = q
    return int(b) * int(s) * int(k[1]) * (int(d) + int(v[2]))


def _rnn(node: Any, x: Shape, w: Shape, r: Shape) -> int:
    s, b = (x[1], x[0]) if _attr(node, "layout", 0) else (x[0], x[1])
    return int(s) * int(b) * (_prod(w) + _prod(r))


def _producer_map(m: Any) -> dict[str, Any]:
    return {o: n for n in m.graph.node for o in n.output}


def _trace(name: str, producers: dict[str, Any], shapes: dict[str, Shape]) -> Shape | None:
    """The shape of `name`, looking through Q/DQ/Cast/Identity to the tensor they were made from."""
    seen = 0
    while name and seen < 8:
        if _known(shapes.get(name)):
            return shapes[name]
        p = producers.get(name)
        if p is None or p.op_type not in _PASS_THROUGH or not p.input:
            return shapes.get(name)
        name, seen = p.input[0], seen + 1
    return None


def _eight_bit_source(dq: Any, producers: dict[str, Any], init_types: dict[str, int]) -> bool:
    src = dq.input[0] if dq.input else ""
    if init_types.get(src) in _EIGHT_BIT:
        return True
    p = producers.get(src)
    if p is None:
        return False
    if p.op_type == "DynamicQuantizeLinear":
        return True
    if p.op_type == "QuantizeLinear":
        zp = p.input[2] if len(p.input) > 2 else ""
        return not zp or init_types.get(zp) in _EIGHT_BIT
    return False


def _is_int8(node: Any, operands: tuple[int, ...], producers: dict[str, Any], init_types: dict[str, int]) -> bool:
    if node.op_type in INTEGER_MAC_OPS:
        return True
    names = [node.input[i] for i in operands if i < len(node.input) and node.input[i]]
    if not names:
        return False
    for n in names:
        p = producers.get(n)
        if p is None or p.op_type != "DequantizeLinear" or not _eight_bit_source(p, producers, init_types):
            return False
    return True


# Ops whose first output has the shape of their first input (activations, normalizations, Q/DQ, casts).
_SAME_SHAPE = frozenset({"Relu", "LeakyRelu", "Sigmoid", "Tanh", "Gelu", "FastGelu", "BiasGelu", "QuickGelu", "Erf",
                         "Clip", "Softmax", "LogSoftmax", "Dropout", "Identity", "Cast", "DequantizeLinear",
                         "QuantizeLinear", "DynamicQuantizeLinear", "LayerNormalization", "SkipLayerNormalization",
                         "SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization", "BatchNormalization",
                         "HardSigmoid", "HardSwish", "Neg", "Sqrt", "Exp", "Abs", "Elu", "Selu", "Softplus"})
_BROADCAST = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Where"})


def _broadcast(shapes: list[Shape]) -> Shape | None:
    if not all(_known(s) for s in shapes):
        return None
    width = max(len(s) for s in shapes)
    padded = [(1,) * (width - len(s)) + tuple(s) for s in shapes]
    return tuple(max(col) for col in zip(*padded))


def _propagate(m: Any, shapes: dict[str, Shape]) -> None:
    """Last resort for graphs that neither inference types through (ORT-fused FusedGemm/FusedConv, ...): walk
    the graph in order, giving MAC ops, shape-preserving ops and broadcasting binary ops the output shape
    their inputs imply. Only unknown shapes are filled in."""
    for n in m.graph.node:
        if not n.output or _known(shapes.get(n.output[0])):
            continue
        ins = [shapes.get(i) if i else None for i in n.input]
        out: Shape | None = None
        try:
            if n.op_type in _SAME_SHAPE and ins and _known(ins[0]):
                out = ins[0]
            elif n.op_type in _BROADCAST:
                out = _broadcast([s for s in ins if s is not None]) if all(s is not None for s in ins) else None
            elif n.op_type in MAC_OPS:
                family, operands = MAC_OPS[n.op_type]
                a, b = (shapes.get(n.input[i]) if i < len(n.input) else None for i in operands[:2])
                a = a if _known(a) else None
                if family == "gemm" and _known(a) and _known(b):
                    tb = _attr(n, "transB", 0)
                    out = ((a[1] if _attr(n, "transA", 0) else a[0]), (b[0] if tb else b[1]))
                elif family == "matmul" and _known(a) and _known(b) and len(a) >= 2 and len(b) >= 2:
                    a, b = list(a), list(b)
                    if _attr(n, "transA", 0):
                        a[-2], a[-1] = a[-1], a[-2]
                    if _attr(n, "transB", 0):
                        b[-2], b[-1] = b[-1], b[-2]
                    batch = _broadcast([tuple(a[:-2]), tuple(b[:-2])]) if len(a) > 2 or len(b) > 2 else ()
                    out = tuple(batch or ()) + (a[-2], b[-1])
                elif family == "conv" and _known(a) and _known(b):
                    out = (a[0], b[0], *_conv_out(n, a, b))
        except (IndexError, TypeError, ValueError):
            out = None
        if out is not None:
            shapes[n.output[0]] = tuple(int(d) for d in out)


def count_macs(model: Any, *, batch: int = BATCH, sequence: int = DEFAULT_SEQUENCE,
               extra_shapes: dict[str, Shape] | None = None, keep_weights: bool = False) -> MacCount:
    """MACs of every MAC-carrying node (MAC_OPS) of a graph, per sample (formulas: module docstring).

    Args:
        model: ModelProto or path of an .onnx file (external data is not read).
        batch: value of the inputs' symbolic first axis (1: per sample).
        sequence: value of every other symbolic input axis (the typical row length).
        extra_shapes: shapes to fall back on for tensors this graph's inference leaves unknown, e.g. the FP32
            graph's shapes when counting the graph the quantizer made from it (activations keep their names).
        keep_weights: shape inference on the graph with all its weights (`infer_shapes`); the same result.

    Returns:
        MacCount (nodes in graph order, the dims used). A node whose operand shapes stay unknown has macs None.
    """
    m = _load(model)
    dims = concrete_dims(m, batch=batch, sequence=sequence)
    mac_nodes = [n for n in m.graph.node if n.op_type in MAC_OPS]
    producers = _producer_map(m)
    need = [n.input[i] for n in mac_nodes for i in MAC_OPS[n.op_type][1] if i < len(n.input)]
    shapes = dict(extra_shapes or {})
    concrete = _with_concrete_inputs(m, dims, keep_weights=keep_weights)
    inferred = _infer_onnx(concrete)
    shapes.update({k: v for k, v in inferred.items() if _known(v) or k not in shapes})
    if any(not _known(_trace(t, producers, shapes)) for t in need if t):  # contrib ops: ORT's inference too
        shapes.update({k: v for k, v in _infer_symbolic(concrete, inferred).items()
                       if _known(v) and not _known(shapes.get(k))})
    if any(not _known(_trace(t, producers, shapes)) for t in need if t):
        _propagate(m, shapes)
    init_types = {t.name: t.data_type for t in m.graph.initializer}
    nodes = []
    for n in mac_nodes:
        family, operands = MAC_OPS[n.op_type]
        ops = [_trace(n.input[i], producers, shapes) if i < len(n.input) and n.input[i] else None
               for i in operands]
        int8 = _is_int8(n, operands, producers, init_types)
        if family == "mha" and ops[1] is None and ops[2] is None:
            ops[1] = ops[2] = ops[0]  # self-attention without separate key/value inputs
        if not all(_known(s) for s in ops):
            nodes.append(NodeMacs(n.name, n.op_type, None, int8, "operand shape unknown"))
            continue
        try:
            if family == "matmul":
                macs = _matmul(n, ops[0], ops[1])
            elif family == "gemm":
                macs = _gemm(n, ops[0], ops[1])
            elif family == "conv":
                macs = _conv(n, ops[0], ops[1], shapes.get(n.output[0]))
            elif family == "conv_transpose":
                macs = _prod(ops[0]) * _prod(ops[1][1:])
            elif family == "attention":
                macs = _attention(n, ops[0], ops[1])
            elif family == "mha":
                macs = _mha(*ops)
            else:
                macs = _rnn(n, *ops)
        except (ValueError, IndexError, TypeError) as exc:
            nodes.append(NodeMacs(n.name, n.op_type, None, int8, f"cannot count: {exc}"))
            continue
        nodes.append(NodeMacs(n.name, n.op_type, int(macs), int8))
    return MacCount(nodes, dims, shapes)


# --------------------------------------------------------------------------------------------- coverage
def quantization_coverage(fp32: Any, quantized: Any, *, sequence: int | None = None, top: int = 20,
                          keep_weights: bool = False) -> dict[str, Any]:
    """How much of a model the quantizer turned into INT8 compute: the facts an INT8 build reports.

    Args:
        fp32: the float graph given to the quantizer (ModelProto or path).
        quantized: the quantizer's output graph, before any later fusion (ModelProto or path).
        sequence: the typical length of the symbolic non-batch input axes (e.g. the calibration rows' median
            length); None: DEFAULT_SEQUENCE (recorded in `assumption`).
        top: float MAC nodes listed, largest first.
        keep_weights: shape inference on the graphs with all their weights (`infer_shapes`); the same result.

    Returns:
        {"quantizable_nodes": MAC nodes of the FP32 graph (MatMul, Gemm, Conv, Attention-like: MAC_OPS),
        "quantized_mac_nodes": MAC nodes of the quantized graph computing in INT8,
        "macs_total": MACs per sample of the quantized graph's MAC nodes (int),
        "macs_int8": of those, MACs in INT8 (int),
        "macs_fp32_graph": MACs per sample of the FP32 graph (the same as macs_total unless a node's shapes
        are unknown in one of them),
        "quantized_mac_fraction": macs_int8 / macs_total (float in [0, 1]; None when no MAC was counted),
        "float_mac_nodes": [{"name", "op_type", "macs"}] of the quantized graph's float MAC nodes, largest first
        (at most `top`), "float_mac_nodes_count": how many there are,
        "unknown_mac_nodes": names of MAC nodes whose shapes stayed unknown (left out of both sums),
        "dims": {symbolic dim: value used}, "assumption": how the symbolic dims were chosen, "method": in words}.
    """
    seq = int(sequence) if sequence else DEFAULT_SEQUENCE
    f = _load(fp32)
    q = _load(quantized)
    base = count_macs(f, sequence=seq, keep_weights=keep_weights)
    qc = count_macs(q, sequence=seq, extra_shapes=base.shapes, keep_weights=keep_weights)
    floats = sorted((n for n in qc.nodes if not n.int8 and n.macs is not None), key=lambda n: -n.macs)
    frac = qc.fraction
    return {
        "quantizable_nodes": len(base.nodes),
        "quantized_mac_nodes": sum(1 for n in qc.nodes if n.int8),
        "macs_total": int(qc.total),
        "macs_int8": int(qc.int8),
        "macs_fp32_graph": int(base.total),
        "quantized_mac_fraction": None if frac is None else round(float(frac), 6),
        "float_mac_nodes": [{"name": n.name, "op_type": n.op_type, "macs": int(n.macs)} for n in floats[:top]],
        "float_mac_nodes_count": sum(1 for n in qc.nodes if not n.int8),
        "unknown_mac_nodes": sorted(set(base.unknown) | set(qc.unknown)),
        "dims": dict(qc.dims),
        "assumption": (f"batch axes at {BATCH}, other symbolic axes at {seq} "
                       + ("(median calibration row length)" if sequence else
                          "(DEFAULT_SEQUENCE: no calibration rows given)")),
        "method": "MACs per sample from ONNX shape inference (components/build/macs.py); INT8 = integer "
                  "ops or QDQ nodes whose every MAC operand is dequantized from 8 bits",
    }


def to_dict(count: MacCount) -> dict[str, Any]:
    """JSON form of a MacCount: {"nodes": [NodeMacs as dict], "dims", "total", "int8", "fraction"}."""
    return {"nodes": [asdict(n) for n in count.nodes], "dims": dict(count.dims), "total": count.total,
            "int8": count.int8, "fraction": count.fraction}
