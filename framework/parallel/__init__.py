"""Parallel strategies: each is an ``apply_*`` function that wraps a plain model.

``apply_parallelism`` returns a ``Parallelized``: the module to run forward/backward through, the
plain model underneath (for parameter counts and state dicts) and ``grad_sync(enabled)``, a
context manager the trainer enters around each micro-batch: with ``enabled=False`` the strategy
skips gradient synchronisation (DDP's ``no_sync``), so accumulation communicates once per step.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

from omegaconf import DictConfig
from torch import nn

from framework.dist import DistInfo
from framework.parallel.ddp import apply_ddp


@dataclass
class Parallelized:
    module: nn.Module
    model: nn.Module
    grad_sync: Callable[[bool], AbstractContextManager]


def apply_parallelism(model: nn.Module, cfg: DictConfig, info: DistInfo) -> Parallelized:
    if cfg.name == "none":
        return Parallelized(model, model, lambda enabled: nullcontext())
    if cfg.name == "ddp":
        ddp = apply_ddp(model, cfg, info)
        return Parallelized(ddp, model, lambda enabled: nullcontext() if enabled else ddp.no_sync())
    raise ValueError(f"parallel: unknown strategy {cfg.name!r}")
