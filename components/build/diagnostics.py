"""What an ONNX Runtime build reports about its own graph: fusion warnings (`fusion: bert`), quantized attention,
the torch exporter's warnings, and the INT8 coverage (`macs.quantization_coverage`).

None of these changes the artifact; they go to `details` (build.json) and, for coverage, into the model's
metadata, where the validate step's gates read them (`gates.build_metrics`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tailguard.components.build.onnx_files import _graph, _op_counts, _quantized_node_names

if TYPE_CHECKING:  # tailguard.core.data imports pandas: a build that reads no calibration rows never loads it
    from tailguard.core.data import Dataset
    from tailguard.core.spec.variants import GraphOptimizationSpec, VariantSpec


# Fused operators reported after graph optimization (onnxruntime.transformers BertOnnxModel's statistics list,
# plus the contrib ops ORT's own extended-level fusions produce on CPU).
FUSED_OP_TYPES = ("EmbedLayerNormalization", "Attention", "MultiHeadAttention", "Gelu", "FastGelu", "BiasGelu",
                  "GemmFastGelu", "LayerNormalization", "SimplifiedLayerNormalization", "SkipLayerNormalization",
                  "SkipSimplifiedLayerNormalization", "RotaryEmbedding", "FusedMatMul", "FusedGemm",
                  "MatMulIntegerToFloat", "BiasSoftmax", "QuickGelu")


# What `fusion: bert` is expected to produce on a BERT-like encoder, by role: any one op of a group counts
# (onnxruntime.transformers' BertOnnxModel fusions: FusionAttention -> Attention / MultiHeadAttention,
# FusionSkipLayerNormalization, FusionBiasGelu / FusionFastGelu / FusionGelu).
EXPECTED_BERT_FUSIONS: dict[str, tuple[str, ...]] = {
    "attention": ("Attention", "MultiHeadAttention"),
    "skip layer normalization": ("SkipLayerNormalization", "SkipSimplifiedLayerNormalization"),
    "GELU": ("BiasGelu", "FastGelu", "Gelu", "GemmFastGelu", "QuickGelu"),
}


ATTENTION_OP_TYPES = frozenset(EXPECTED_BERT_FUSIONS["attention"])


def fusion_warnings(fused_ops: dict[str, int], go: GraphOptimizationSpec, *, int8: bool = False) -> list[str]:
    """Warnings for the roles `fusion: bert` fused nothing for (EXPECTED_BERT_FUSIONS).

    Args:
        fused_ops: {op type: count} of the optimized graph (build.json graph_optimization.fused_ops).
        go: the variant's `graph_optimization` (num_heads, hidden_size: 0 = detected by ORT).
        int8: the variant is INT8 (then unfused attention is quantized as plain MatMuls: said so).

    Returns:
        One warning naming the missing roles, what was found and the fix; [] when every role was fused.
    """
    missing = [role for role, ops in EXPECTED_BERT_FUSIONS.items() if not any(fused_ops.get(op) for op in ops)]
    if not missing:
        return []
    found = ", ".join(f"{k} {v}" for k, v in fused_ops.items()) or "nothing"
    expected = "; ".join(" or ".join(EXPECTED_BERT_FUSIONS[r]) for r in missing)
    effect = (" (INT8 then quantizes attention as plain MatMuls)" if int8 and "attention" in missing else "")
    return [f"fusion: bert fused no {', no '.join(missing)} (expected {expected}; found {found}): that part of "
            f"the model runs unfused{effect}; set graph_optimization.num_heads and hidden_size to the model's "
            "values (0: ONNX Runtime detects them), and export with model.export.dynamo: false (the graphs ONNX "
            "Runtime's BERT fusions recognise)"]


def attention_matmuls(path: str | Path) -> list[str]:
    """Names of the MatMul nodes whose two inputs are both activations (neither an initializer nor computed from
    constants only): in a transformer without fused attention these are the attention score (Q K^T) and context
    (softmax(scores) V) MatMuls; a weight MatMul always has one constant input.

    Args:
        path: an .onnx file (read without external data).

    Returns:
        Node names in graph order (unnamed nodes as "<op>#<index>").
    """
    graph = _graph(path).graph
    const = {t.name for t in graph.initializer} | {""}
    names = []
    for i, n in enumerate(graph.node):  # ONNX graphs are topologically sorted
        if n.op_type == "Constant" or (n.input and all(x in const for x in n.input)):
            const.update(n.output)
        elif n.op_type == "MatMul" and len(n.input) == 2 and not any(x in const for x in n.input):
            names.append(n.name or f"{n.op_type}#{i}")
    return names


def attention_quantization_warnings(variant: VariantSpec, source: Path, quantized: Path,
                                    details: dict[str, Any]) -> list[str]:
    """A warning when INT8 quantized attention MatMuls (`attention_matmuls` of the graph given to the quantizer)
    and the graph has no fused attention op (Attention / MultiHeadAttention, whose INT8 kernels keep the scores
    and softmax in float): scores and probabilities in 8 bits broke MiniLM's top-1 agreement (0.31, issue 26).

    Records `details["attention_matmuls"] = {"nodes", "quantized", "fused_attention"}` (build.json).

    Returns:
        [] or one warning with the nodes and the exclusion that keeps them in float.
    """
    nodes = attention_matmuls(source)
    fused = sum(_op_counts(source).get(op, 0) for op in ATTENTION_OP_TYPES)
    done = _quantized_node_names(quantized)
    hit = [n for n in nodes if n in done or any(d.startswith(n + "_") for d in done)]
    details["attention_matmuls"] = {"nodes": nodes, "quantized": hit, "fused_attention": fused}
    if not hit or fused:
        return []
    mode = variant.quantization.mode
    names = json.dumps(hit) if len(hit) <= 4 else f"<the {len(hit)} names in build.json attention_matmuls.quantized>"
    return [f"INT8 {mode} quantized {len(hit)} attention MatMul(s) (both inputs activations) and the graph has no "
            "fused Attention: attention scores and softmax probabilities in 8 bits can wreck accuracy; keep them "
            f"in float with quantization: {{preset: transformer-static, exclude_nodes: {names}}} (the preset "
            "quantizes MatMul/Gemm only, so the Softmax and reshapes feeding them stay float too), or get attention "
            "fused (graph_optimization: {fusion: bert, num_heads, hidden_size})"]


def export_warnings(fp32: Path) -> list[str]:
    """The torch exporter's warnings recorded beside the FP32 model (`export.json` `warnings`, written by the
    export step), one line each ("export: TracerWarning at model.py:12: ... (x3)"); [] when there is no such file
    (an ONNX reference, a model built outside the pipeline)."""
    from tailguard.core.contract import EXPORT_FACTS_FILE

    facts_file = Path(fp32).parent / EXPORT_FACTS_FILE
    try:
        recorded = json.loads(facts_file.read_text()).get("warnings") or []
    except (OSError, ValueError, AttributeError):
        return []
    out = []
    for w in recorded:
        if isinstance(w, dict) and {"category", "message", "where"} <= set(w):
            times = f" (x{w['count']})" if int(w.get("count", 1)) > 1 else ""
            out.append(f"export: {w['category']} at {w['where']}: {w['message']}{times}")
    return out


def _coverage(source: Path, quantized: Path, calibration: Dataset | None,
              details: dict[str, Any]) -> dict[str, Any]:
    """Quantization coverage of the quantizer's output vs its input (`macs.quantization_coverage`), with symbolic
    axes at the calibration rows' median length when there are rows; top-level facts copied into `details`."""
    from tailguard.components.build.macs import quantization_coverage

    sequence = None
    if calibration is not None and calibration.n_rows:
        sequence = max(1, int(np.median(np.asarray(calibration.lengths))))
    try:
        cov = quantization_coverage(_graph(source), _graph(quantized), sequence=sequence)
    except Exception as exc:  # a measurement, not the build: recorded; a gate on it then fails with this reason
        cov = {"error": f"{type(exc).__name__}: {str(exc)[:500]}", "quantizable_nodes": None,
               "quantized_mac_nodes": None, "macs_total": None, "macs_int8": None, "quantized_mac_fraction": None}
    details["quantization_coverage"] = cov
    for key in ("quantizable_nodes", "quantized_mac_nodes", "macs_total", "macs_int8", "quantized_mac_fraction"):
        details[key] = cov[key]
    return cov
