"""Optimizer and learning-rate schedule from the `optim` group."""

from __future__ import annotations

import math

import torch
from omegaconf import DictConfig
from torch import nn

from framework.modules import canonical_name


def build_optimizer(model: nn.Module, cfg: DictConfig, decay: set[str] | None = None) -> torch.optim.Optimizer:
    """AdamW or SGD. Weight decay applies to matrices only (not to biases, norms, or 1-d params):
    those named in `decay` (the plain model's matrices, by name: FSDP1 flattens every parameter
    to 1-d, so a wrapped model's shapes cannot tell), else those with 2 or more dims."""
    if isinstance(model, nn.parallel.DistributedDataParallel | nn.DataParallel):
        model = model.module  # the same parameters, under the plain model's names
    named = [(canonical_name(n), p) for n, p in model.named_parameters() if p.requires_grad]
    decays = (lambda n, p: n in decay) if decay is not None else (lambda n, p: p.dim() >= 2)
    groups = [
        {"params": [p for n, p in named if decays(n, p)], "weight_decay": cfg.weight_decay},
        {"params": [p for n, p in named if not decays(n, p)], "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    if cfg.name == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas))
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)
    raise ValueError(f"optim: unknown optimizer {cfg.name!r}")


def lr_factor(step: int, cfg: DictConfig, total_steps: int) -> float:
    """Linear warm-up, then cosine decay to `min_lr_ratio` of the peak (or constant)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    progress = (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: DictConfig, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg, total_steps))
