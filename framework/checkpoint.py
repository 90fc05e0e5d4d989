"""Checkpoints with torch.distributed.checkpoint (DCP): every rank writes its own part in
parallel, and a checkpoint saved at one world size loads at another. Loading reads tensors and
plain numbers only (DCP loads with weights_only); nothing arbitrary is unpickled."""

from __future__ import annotations

import os

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


def _state(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> dict:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd, "trainer": {"step": torch.tensor(step)}}


def save(path: str, model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    """Save after `step` optimizer steps into folder `path` (collective: every rank calls it)."""
    os.makedirs(path, exist_ok=True)
    dcp.save(_state(model, optimizer, step), checkpoint_id=path)


def latest(folder: str) -> str | None:
    """The newest complete checkpoint (`step-N` with DCP's .metadata written) in `folder`."""
    if not os.path.isdir(folder):
        return None
    done = [
        d for d in os.listdir(folder) if d.startswith("step-") and os.path.exists(os.path.join(folder, d, ".metadata"))
    ]
    return os.path.join(folder, max(done)) if done else None


def load(path: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Load `path` into model and optimizer in place; returns the optimizer steps it was saved at."""
    state = _state(model, optimizer, 0)
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return int(state["trainer"]["step"])


def full_model_state_dict(par) -> dict[str, torch.Tensor]:
    """The whole, unsharded model state on every rank, under the plain model's names (no wrapper
    prefixes): FSDP/TP shards gathered, pipeline stages merged. Collective: every rank calls it."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(par.module, options=StateDictOptions(full_state_dict=True))
    state = {k: v.detach().cpu() for k, v in state.items()}
    if par.pp_group is not None:  # each stage holds some layers: merge them
        parts: list = [None] * dist.get_world_size(par.pp_group)
        dist.all_gather_object(parts, state, group=par.pp_group)
        state = {k: v for part in parts for k, v in part.items()}
    return state


def export(path: str, par, is_main: bool) -> None:
    """Write the full model state dict for use outside this framework (`torch.load(path,
    weights_only=True)` into the plain model). Rank 0 writes."""
    state = full_model_state_dict(par)
    if is_main:
        torch.save(state, path)
