"""Plain single-device models. Nothing here imports torch.distributed."""

from __future__ import annotations

from typing import Any

from torch import nn

from models.gpt import GPT
from models.llama import Llama
from models.lstm import LSTMClassifier
from models.mlp import MLP
from models.resnet import ResNet

MODELS: dict[str, type[nn.Module]] = {
    "gpt": GPT,
    "llama": Llama,
    "mlp": MLP,
    "resnet": ResNet,
    "lstm": LSTMClassifier,
}


def build_model(name: str, **kwargs: Any) -> nn.Module:
    """Build a model by its config name with the group's keys as keyword arguments."""
    return MODELS[name](**kwargs)
