"""Optimizer and learning-rate schedule from the `optim` group."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn

from framework.modules import canonical_name


def build_optimizer(
    model: nn.Module, cfg: DictConfig, decay: set[str] | None = None, layout: Any = None
) -> torch.optim.Optimizer:
    """AdamW or SGD. Weight decay applies to matrices only (not to biases, norms, or 1-d params):
    those named in `decay` (the plain model's matrices, by name: FSDP1 flattens every parameter
    to 1-d, so a wrapped model's shapes cannot tell), else those with 2 or more dims. `layout`:
    the run's framework.parallel.apply.Parallelized, where the step in backward asks when a gradient is whole."""
    if isinstance(model, nn.parallel.DistributedDataParallel | nn.DataParallel):
        model = model.module  # the same parameters, under the plain model's names
    named = [(canonical_name(n), p) for n, p in model.named_parameters() if p.requires_grad]
    decays = (lambda n, p: n in decay) if decay is not None else (lambda n, p: p.dim() >= 2)
    groups = [
        {"params": [p for n, p in named if decays(n, p)], "weight_decay": cfg.weight_decay},
        {"params": [p for n, p in named if not decays(n, p)], "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    fused = fuses([p for _, p in named])
    if cfg.name == "adamw":
        make = lambda gs: torch.optim.AdamW(gs, lr=cfg.lr, betas=tuple(cfg.betas), fused=fused)  # noqa: E731
    elif cfg.name == "sgd":
        make = lambda gs: torch.optim.SGD(gs, lr=cfg.lr, momentum=cfg.momentum, fused=fused)  # noqa: E731
    else:
        raise ValueError(f"optim: unknown optimizer {cfg.name!r}")
    if cfg.get("in_backward"):  # each parameter's update in its gradient's hook (framework/optim_backward.py)
        from framework.optim_backward import InBackwardOptimizer

        return InBackwardOptimizer(groups, make, layout)
    return make(groups)


def fuses(params: list[torch.Tensor]) -> bool | None:
    """The fused (one-kernel) update where every parameter is on a CUDA device: fewer launches, and
    amp's GradScaler hands it `found_inf` on the device, so a step with the scaler waits for no
    host read. Elsewhere (a CPU, FSDP's CPU offload) None: torch's default (for-each) update."""
    return True if params and all(p.device.type == "cuda" for p in params) else None  # a DTensor: its shard's


def lr_factor(step: int, cfg: DictConfig, total_steps: int) -> float:
    """Linear warm-up, then cosine decay to `min_lr_ratio` of the peak (or constant)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    progress = (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine


class Schedule(torch.optim.lr_scheduler.LambdaLR):
    """Warm-up and cosine over `schedule_steps`. The length is an attribute, so it travels in the
    scheduler's state_dict: a resumed run keeps the length it started with even when `steps` is
    raised, and the LR does not jump."""

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: DictConfig, schedule_steps: int):
        self.schedule_steps = schedule_steps
        super().__init__(optimizer, lambda step: lr_factor(step, cfg, self.schedule_steps))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: DictConfig, total_steps: int) -> Schedule:
    """The schedule spans `optim.schedule_steps`, else the run's `steps`."""
    return Schedule(optimizer, cfg, cfg.get("schedule_steps") or total_steps)


def resumed_schedule(scheduler: Any, cfg: DictConfig, steps: int) -> str | None:
    """After loading a checkpoint's schedule: `optim.schedule_steps` re-plans it; otherwise it
    keeps the length it was saved with. Returns the one line to print when that length is not
    this run's `steps`, else None."""
    saved = getattr(scheduler, "schedule_steps", None) or steps  # checkpoints before this key: steps
    wanted = cfg.get("schedule_steps") or saved
    scheduler.schedule_steps = wanted
    if wanted == steps:
        return None
    how = "set by optim.schedule_steps" if cfg.get("schedule_steps") else "as saved; optim.schedule_steps=N re-plans it"
    return f"steps={steps}: the LR schedule spans {wanted} steps ({how})"


def step_unless(optimizer: torch.optim.Optimizer, skip: torch.Tensor, update: Callable[[], Any],
                fused: bool = True) -> None:  # fmt: skip
    """Run `update` (the optimizer's step), undone where the device bool `skip` holds, without
    the host reading it. A fused optimizer takes it as `found_inf`, as amp's GradScaler hands it
    over: the kernel skips the update and the step count (`fused`: no scaler of our own in the
    way), once its state exists (a fused SGD's first step would fill its momentum with whatever the
    allocator held, and skip). Otherwise: the parameters and the state are copied before and put back with
    `torch.where` after (state the step created is reset to zeros, a fresh state's value): exact
    for any optimizer, at the cost of one copy of its parameters and state (and, for a step count
    kept on the host beside CUDA parameters, as amp's unfused AdamW keeps it, one read)."""
    if fused and optimizer.defaults.get("fused") and _state_complete(optimizer):
        optimizer.found_inf = skip.float()
        try:
            update()
        finally:
            del optimizer.found_inf
        return
    saved = {k: t.clone() for k, t in _state_tensors(optimizer).items()}
    update()
    on = {skip.device: skip}  # a CPU step count beside CUDA parameters (amp): read there (a sync)
    for key, tensor in _state_tensors(optimizer).items():
        kept = saved.get(key)
        where = on.setdefault(tensor.device, skip.to(tensor.device))
        tensor.copy_(torch.where(where, kept if kept is not None else torch.zeros_like(tensor), tensor))


def _state_complete(optimizer: torch.optim.Optimizer) -> bool:
    """Every parameter's state exists, momentum buffers included (none created by this step)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return all(optimizer.state.get(p) and all(v is not None for v in optimizer.state[p].values()) for p in params)


def _state_tensors(optimizer: torch.optim.Optimizer) -> dict[tuple[int, str], torch.Tensor]:
    """The optimizer's parameters and state tensors (local shards of DTensors), by (parameter, name)."""
    out: dict[tuple[int, str], torch.Tensor] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            out[(id(param), "")] = _local(param.data)
            for name, value in optimizer.state.get(param, {}).items():
                if isinstance(value, torch.Tensor):
                    out[(id(param), name)] = _local(value)
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t
