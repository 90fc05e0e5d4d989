"""The optimizer built over the framework's parameter groups (framework/optimizers: the groups)."""

from __future__ import annotations

from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn

from framework.components import build_component, locate, takes
from framework.modules import canonical_name
from framework.optimizers import OWN, setting


def build_optimizer(model: nn.Module, cfg: DictConfig, decay: set[str] | None = None, layout: Any = None,
                    matrices: set[str] | None = None) -> torch.optim.Optimizer:  # fmt: skip
    """`cfg` (the optim group)'s class over `model`'s trainable parameters, in the groups above:
    `decay` and `matrices` by the plain model's names (else: 2-D and up decay, none are the blocks');
    `layout`: the run's framework.parallel.apply.Parallelized, where the step in backward asks
    when a gradient is whole."""
    if isinstance(model, nn.parallel.DistributedDataParallel | nn.DataParallel):
        model = model.module  # the same parameters, under the plain model's names
    named = [(canonical_name(n), p) for n, p in model.named_parameters() if p.requires_grad]
    cls = locate(cfg, "optim")
    groups = param_groups(named, decay, matrices or set(), zero_decay=takes(cls, "weight_decay"))
    fused = {"fused": fuses([p for _, p in named])} if takes(cls, "fused") else {}

    def make(gs: list[dict]) -> torch.optim.Optimizer:
        return build_component(cfg, OWN, gs, **fused)

    if setting(cfg, "in_backward"):  # each update in its gradient's hook (framework/optimizers/in_backward.py)
        from framework.optimizers.in_backward import InBackwardOptimizer

        return InBackwardOptimizer(groups, make, layout)
    return make(groups)


def param_groups(named: list[tuple[str, torch.Tensor]], decay: set[str] | None, matrices: set[str],
                 zero_decay: bool) -> list[dict]:  # fmt: skip
    """The blocks' matrices, the other decayed parameters, the rest (`weight_decay` 0 where the
    class takes one); the decayed groups take the class's own weight decay. Empty groups left out."""
    decays = (lambda n, p: n in decay) if decay is not None else (lambda n, p: p.dim() >= 2)
    kinds: list[tuple[dict, list]] = [
        ({"matrix": True}, []),
        ({}, []),
        ({"weight_decay": 0.0} if zero_decay else {}, []),
    ]
    for name, param in named:
        kinds[0 if name in matrices and decays(name, param) else 1 if decays(name, param) else 2][1].append(param)
    return [{"params": params, **keys} for keys, params in kinds if params]


def fuses(params: list[torch.Tensor]) -> bool | None:
    """The fused (one-kernel) update where every parameter is on a CUDA device: fewer launches, and
    amp's GradScaler hands it `found_inf` on the device, so a step with the scaler waits for no
    host read. Elsewhere (a CPU, FSDP's CPU offload) None: torch's default (for-each) update."""
    return True if params and all(p.device.type == "cuda" for p in params) else None  # a DTensor: its shard's
