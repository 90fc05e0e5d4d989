"""Model converters (torchtitan's ModelConverter): what changes a model's structure before it is
sharded, applied at one point of the build on the meta model. Today: peft=lora's adapters
(framework/peft.py), the rest frozen. A converter added later (float8's linears, say) goes here,
and the build does not change."""

from __future__ import annotations

from omegaconf import DictConfig
from torch import nn

from framework.contract import ModelSpec
from framework.peft import apply_peft


def convert_model(model: nn.Module, cfg: DictConfig, spec: ModelSpec) -> None:
    """Apply every converter the config asks for to `model`, in place."""
    apply_peft(model, cfg.get("peft"), spec.blocks, cfg.seed)
