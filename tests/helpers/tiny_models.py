"""Tiny real models and data for tests (milliseconds to build, no downloads).

`make_tiny_encoder()` is a one-block transformer-shaped encoder (embedding, single-head self-attention with a
BERT-style additive mask, feed-forward with two Linear layers, residual + LayerNorm, masked mean pool, a
classification head). It takes `input_ids` and `attention_mask`
(int64, [batch, sequence]) and returns `logits` (float32, [batch, N_CLASSES]) and `pooled` (float32,
[batch, HIDDEN]), so it exercises everything the export and quantize steps care about: MatMul/Gemm to quantize,
an attention MatMul pair that ORT fuses into FusedMatMul, LayerNormalization, variable sequence length and a
masked reduction.

Reuse from other tests::

    from tests.helpers.tiny_models import export_tiny, tiny_model_spec, tiny_dataset, int8_dynamic_error_bound
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

VOCAB = 64
HIDDEN = 16
FF = 32
N_CLASSES = 4
INPUT_NAMES = ("input_ids", "attention_mask")
OUTPUT_NAMES = ("logits", "pooled")


def make_tiny_encoder(seed: int = 0):
    """A seeded tiny encoder (torch.nn.Module in eval mode); see the module docstring for its inputs/outputs."""
    import torch

    class TinyEncoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(VOCAB, HIDDEN)
            self.l1 = torch.nn.Linear(HIDDEN, FF)
            self.l2 = torch.nn.Linear(FF, HIDDEN)
            self.ln = torch.nn.LayerNorm(HIDDEN)
            self.head = torch.nn.Linear(HIDDEN, N_CLASSES)

        def forward(self, input_ids, attention_mask):
            x = self.emb(input_ids)
            # single-head self-attention without projections, BERT-style additive mask
            scores = torch.matmul(x, x.transpose(-1, -2)) / 4.0
            scores = scores + (1.0 - attention_mask[:, None, :].to(x.dtype)) * -10000.0
            x = x + torch.matmul(torch.softmax(scores, dim=-1), x)
            h = self.ln(x + self.l2(torch.nn.functional.gelu(self.l1(x))))
            m = attention_mask.unsqueeze(-1).to(h.dtype)
            pooled = (h * m).sum(1) / m.sum(1).clamp(min=1.0)
            return self.head(pooled), pooled

    torch.manual_seed(seed)
    return TinyEncoder().eval()


def tiny_model_spec(**export):
    """A tailguard ModelSpec for the tiny encoder; keyword arguments go to `model.export` (e.g. dynamo=True)."""
    from tailguard.core.spec.model import ModelSpec

    return ModelSpec.model_validate({
        "registered_name": "tiny-encoder", "task": "classification",
        "inputs": [{"name": n, "dtype": "int64", "shape": ["batch", "sequence"]} for n in INPUT_NAMES],
        "outputs": [{"name": "logits", "dtype": "float32", "shape": ["batch", N_CLASSES]},
                    {"name": "pooled", "dtype": "float32", "shape": ["batch", HIDDEN]}],
        "export": export,
    })


def tiny_feeds(batch: int, sequence: int, seed: int = 0, *, pad_last: int = 0) -> dict[str, np.ndarray]:
    """Random token ids (int64, [batch, sequence]) and a mask whose last row has `pad_last` padded positions."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, VOCAB, size=(batch, sequence), dtype=np.int64)
    mask = np.ones((batch, sequence), dtype=np.int64)
    if pad_last:
        ids[-1, -pad_last:] = 0
        mask[-1, -pad_last:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def export_tiny(tmp_path, *, seed: int = 0, dynamo: bool = False, name: str = "tiny.onnx"):
    """Export the tiny encoder with tailguard's exporter.

    Returns:
        (module, ModelSpec, path of the .onnx file).
    """
    from tailguard.components.export.logic import export_onnx

    module = make_tiny_encoder(seed)
    spec = tiny_model_spec(dynamo=dynamo)
    path = Path(tmp_path) / name
    export_onnx(module, spec, tiny_feeds(2, 7, seed), path)
    return module, spec, path


def tiny_dataset(n_rows: int = 24, *, min_len: int = 3, max_len: int = 12, seed: int = 0):
    """A tailguard Dataset of variable-length rows for the tiny encoder (lengths uniform in [min_len, max_len]).

    The frame holds `n_tokens` and a `label` column (n_rows,) int64 in [0, N_CLASSES).
    """
    from tailguard.core.data import Dataset

    rng = np.random.default_rng(seed)
    lengths = rng.integers(min_len, max_len + 1, size=n_rows).astype(np.int64)
    ids = [rng.integers(1, VOCAB, size=n, dtype=np.int64) for n in lengths]
    mask = [np.ones(n, dtype=np.int64) for n in lengths]
    frame = pd.DataFrame({"n_tokens": lengths, "label": rng.integers(0, N_CLASSES, size=n_rows)})
    return Dataset({"input_ids": ids, "attention_mask": mask}, frame, lengths, "memory://tiny")


def int8_dynamic_error_bound(module, feeds: dict[str, np.ndarray], *, reduce_range: bool,
                             safety: float = 1.25) -> tuple[list[np.ndarray], dict[str, Any]]:
    """Per-element bound on |dynamic INT8 output - FP32 output| of the tiny encoder, from the quantization steps.

    Quantized sites (quantize_dynamic on this model with /l2/MatMul excluded): the embedding table (Gather:
    uint8, one scale), and the input and weight of l1 and of head (MatMulInteger: input uint8 with one scale for
    the whole tensor, computed at run time; weight int8 symmetric, one scale per output channel).

    Steps (onnxruntime/quantization/quant_utils.py compute_scale_zp, get_qmin_qmax_for_qType):
        uint8 tensor t (range widened to include 0): s = (max(t, 0) - min(t, 0)) / 255; an activation's range is
            taken from the FP32 forward pass on `feeds`.
        int8 weight, output channel j: s_j = max_k |W_kj| / q, with q = 127, or 64 when `reduce_range`.
    Rounding to the nearest point of a grid that spans the range moves each element by at most r = s / 2.

    Bound (first order, worst case over the signs of every rounding error):
        |dy_o| <= safety * sum_sites sum_e |d y_o / d t_e| * r_e
    The Jacobians come from torch autograd through the whole model (attention, GELU, LayerNorm, masked pool).
    `safety` covers the terms the first-order bound leaves out: products of two rounding errors, curvature of
    softmax/GELU/LayerNorm, the shift of the run-time ranges along the quantized path, float reordering by graph
    fusions. Measured errors are 0.09-0.17 of the first-order term (both weight widths).
    Assumes exact int32 accumulation (the MatMulInteger contract). ORT's u8s8 kernels on x86 without VNNI
    saturate int16 pair sums with 8-bit weights; that error is not covered.

    Args:
        module: the torch module of `make_tiny_encoder` that was exported.
        feeds: the batch (`tiny_feeds`).
        reduce_range: 7-bit weights ([-64, 64]) instead of 8-bit ([-127, 127]).
        safety: factor on the first-order bound.

    Returns:
        ([bound on logits (batch, N_CLASSES), bound on pooled (batch, HIDDEN)], steps): steps maps
        "emb.weight", "l1.input", "head.input" to a float and "l1.weight" (FF,), "head.weight" (N_CLASSES,)
        to the per-channel steps.
    """
    import torch

    ids, mask = torch.from_numpy(feeds["input_ids"]), torch.from_numpy(feeds["attention_mask"])
    layers = {"l1": module.l1, "head": module.head}
    seen: dict[str, torch.Tensor] = {}
    hooks = [m.register_forward_pre_hook(lambda _m, args, n=n: seen.__setitem__(n, args[0].detach()))
             for n, m in layers.items()]
    try:
        with torch.no_grad():
            module(ids, mask)
    finally:
        for h in hooks:
            h.remove()
    weights = {n: p.detach() for n, p in module.named_parameters() if n in ("emb.weight", "l1.weight", "head.weight")}

    def uint8_step(t: torch.Tensor) -> float:
        return float((t.max().clamp(min=0) - t.min().clamp(max=0)) / 255)

    q = 64 if reduce_range else 127
    steps: dict[str, Any] = {"emb.weight": uint8_step(weights["emb.weight"]),
                             "l1.input": uint8_step(seen["l1"]), "head.input": uint8_step(seen["head"]),
                             "l1.weight": (weights["l1.weight"].abs().amax(dim=1) / q).numpy(),
                             "head.weight": (weights["head.weight"].abs().amax(dim=1) / q).numpy()}

    def forward(d_emb, d_x1, d_w1, d_xh, d_wh):
        deltas = {"l1": d_x1, "head": d_xh}
        hs = [m.register_forward_pre_hook(lambda _m, args, n=n: (args[0] + deltas[n],)) for n, m in layers.items()]
        try:
            params = {"emb.weight": weights["emb.weight"] + d_emb, "l1.weight": weights["l1.weight"] + d_w1,
                      "head.weight": weights["head.weight"] + d_wh}
            logits, pooled = torch.func.functional_call(module, params, (ids, mask))
        finally:
            for h in hs:
                h.remove()
        return torch.cat([logits.reshape(-1), pooled.reshape(-1)])

    sites = (weights["emb.weight"], seen["l1"], weights["l1.weight"], seen["head"], weights["head.weight"])
    radius = (torch.full_like(sites[0], steps["emb.weight"] / 2), torch.full_like(sites[1], steps["l1.input"] / 2),
              torch.from_numpy(steps["l1.weight"] / 2)[:, None].expand_as(sites[2]),
              torch.full_like(sites[3], steps["head.input"] / 2),
              torch.from_numpy(steps["head.weight"] / 2)[:, None].expand_as(sites[4]))
    jac = torch.autograd.functional.jacobian(forward, tuple(torch.zeros_like(t) for t in sites))
    first_order = sum((j.abs().reshape(j.shape[0], -1) * r.reshape(1, -1)).sum(dim=1) for j, r in zip(jac, radius))
    bound = (safety * first_order).numpy()
    n_logits = ids.shape[0] * N_CLASSES
    return [bound[:n_logits].reshape(-1, N_CLASSES), bound[n_logits:].reshape(-1, HIDDEN)], steps
