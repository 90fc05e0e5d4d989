"""An LSTM sequence classifier over variable-length input.

Padded batches are packed with ``pack_padded_sequence`` so the recurrence runs over each
sequence's real tokens only: no compute and no hidden-state pollution from padding.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence


class LSTMClassifier(nn.Module):
    task = "classify"
    trains_on = ("varlen",)

    def __init__(
        self,
        vocab_size: int = 32,
        embed_dim: int = 64,
        hidden: int = 128,
        num_layers: int = 1,
        num_classes: int = 4,
        bidirectional: bool = False,
    ):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, embed_dim, padding_idx=0)
        self.lstm = nn.LSTM(embed_dim, hidden, num_layers, batch_first=True, bidirectional=bidirectional)
        self.head = nn.Linear(hidden * (2 if bidirectional else 1), num_classes)

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """tokens: (B, T) padded with 0; lengths: (B,) real lengths -> logits (B, classes). Lengths
        in host memory (the framework leaves them there) cost no device-to-host copy."""
        packed = pack_padded_sequence(self.embed(tokens), lengths.cpu(), batch_first=True, enforce_sorted=False)
        with _native_bf16_recurrence(tokens.device):
            _, (h, _) = self.lstm(packed)
        # last layer's final hidden state (both directions if bidirectional)
        last = torch.cat([h[-2], h[-1]], dim=-1) if self.lstm.bidirectional else h[-1]
        return self.head(last)


def _native_bf16_recurrence(device: torch.device):
    """Under CPU autocast, the recurrence on torch's own kernels: oneDNN's bfloat16 LSTM (torch
    2.14) cannot build a primitive for a batch whose sequences all have one length ("could not
    create a primitive descriptor"), and torch's kernels compute the same as oneDNN's for the
    others. Anywhere else, nothing changes."""
    if device.type != "cpu" or not torch.is_autocast_enabled("cpu"):
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(warnings.catch_warnings())
    warnings.filterwarnings("ignore", message="TF32 acceleration on top of oneDNN")
    stack.enter_context(torch.backends.mkldnn.flags(enabled=False))
    return stack
