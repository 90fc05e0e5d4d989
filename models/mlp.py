"""A plain multi-layer perceptron classifier: residual blocks in ``self.blocks``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MLPBlock(nn.Module):
    def __init__(self, dim: int, dropout: float):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.dropout(F.gelu(self.fc(self.norm(x))))


class MLP(nn.Module):
    task = "classify"
    trains_on = ("vectors",)
    blocks_path = "blocks"

    def __init__(
        self,
        in_dim: int = 32,
        hidden: int = 256,
        depth: int = 3,
        num_classes: int = 8,
        dropout: float = 0.0,
    ):
        super().__init__()
        self.inp = nn.Linear(in_dim, hidden)
        self.blocks = nn.ModuleList(MLPBlock(hidden, dropout) for _ in range(depth))
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)
