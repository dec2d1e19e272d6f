"""Importable tiny torch modules for the resolve tests (a state dict needs a 'module:Class' path to load into)."""

from __future__ import annotations

import torch

N_IN = 4
N_OUT = 3


class TinyClassifier(torch.nn.Module):
    """x: (batch, N_IN) float32 -> logits: (batch, n_out) float32."""

    def __init__(self, hidden: int = 8, n_out: int = N_OUT) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(N_IN, hidden)
        self.fc2 = torch.nn.Linear(hidden, n_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class OtherClassifier(torch.nn.Module):
    """Same function shape as TinyClassifier, different parameter names (its state dict does not fit)."""

    def __init__(self, hidden: int = 8) -> None:
        super().__init__()
        self.encoder = torch.nn.Linear(N_IN, hidden)
        self.head = torch.nn.Linear(hidden, N_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.encoder(x)))


def make_tiny(seed: int, hidden: int = 8) -> TinyClassifier:
    """A seeded TinyClassifier in eval mode."""
    torch.manual_seed(seed)
    return TinyClassifier(hidden=hidden).eval()
