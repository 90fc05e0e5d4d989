"""The training loss of every model and strategy, in one place (the trainer and a pipeline's
last stage both use it), and how it is weighted across ranks and micro-batches."""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100  # a target position that carries no loss: padding, a document boundary


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy over the positions whose target is not IGNORE_INDEX, in fp32."""
    return F.cross_entropy(
        logits.flatten(0, -2).float(), target.flatten(), ignore_index=IGNORE_INDEX, reduction=reduction
    )


def loss_elements(target: torch.Tensor) -> int:
    """How many terms a batch adds to the loss: its tokens that carry a target (language
    models), or its samples (classifiers)."""
    return int((target != IGNORE_INDEX).sum())


class ScaledLoss:
    """A pipeline schedule's loss (torch's schedules backpropagate what it returns, and divide the
    gradients by the micro-batch count): each micro-batch's summed loss times `weight`, set each
    step to n_microbatches x dp x cp / the step's loss terms on every rank (amp's loss scale
    folded in), so the gradient is the step's global token mean's whatever each micro-batch
    holds, as without a pipeline (a mean per micro-batch weighs a padded one's tokens more)."""

    def __init__(self) -> None:
        self.weight: torch.Tensor | float = 1.0

    def __call__(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return cross_entropy(logits, target, reduction="sum") * self.weight
