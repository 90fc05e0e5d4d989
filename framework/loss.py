"""The training loss of every model and strategy, in one place (the trainer and a pipeline's
last stage both use it)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100  # a target position that carries no loss: padding, a document boundary


def cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the positions whose target is not IGNORE_INDEX, in fp32."""
    return F.cross_entropy(logits.flatten(0, -2).float(), target.flatten(), ignore_index=IGNORE_INDEX)
