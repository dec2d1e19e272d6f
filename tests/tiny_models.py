"""Tiny real models and data for tests (milliseconds to build, no downloads).

`make_tiny_encoder()` is a one-block transformer-shaped encoder (embedding, single-head self-attention with a
BERT-style additive mask, feed-forward with two Linear layers, residual + LayerNorm, masked mean pool, a
classification head). It takes `input_ids` and `attention_mask`
(int64, [batch, sequence]) and returns `logits` (float32, [batch, N_CLASSES]) and `pooled` (float32,
[batch, HIDDEN]), so it exercises everything the export and quantize steps care about: MatMul/Gemm to quantize,
an attention MatMul pair that ORT fuses into FusedMatMul, LayerNormalization, variable sequence length and a
masked reduction.

Reuse from other tests::

    from tests.tiny_models import export_tiny, tiny_model_spec, tiny_dataset
"""

from __future__ import annotations

from pathlib import Path

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
    from tailguard.spec import ModelSpec

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
    from tailguard.data import Dataset

    rng = np.random.default_rng(seed)
    lengths = rng.integers(min_len, max_len + 1, size=n_rows).astype(np.int64)
    ids = [rng.integers(1, VOCAB, size=n, dtype=np.int64) for n in lengths]
    mask = [np.ones(n, dtype=np.int64) for n in lengths]
    frame = pd.DataFrame({"n_tokens": lengths, "label": rng.integers(0, N_CLASSES, size=n_rows)})
    return Dataset({"input_ids": ids, "attention_mask": mask}, frame, lengths, "memory://tiny")
