"""A step's update undone on the device where a bool holds (`callbacks.spike.action=skip`,
`nonfinite=skip`), without the host reading it: for any optimizer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


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
