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


def load(path: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Load `path` into model and optimizer in place; returns the optimizer steps it was saved at."""
    state = _state(model, optimizer, 0)
    dcp.load(state, checkpoint_id=path)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    return int(state["trainer"]["step"])


def full_model_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole, unsharded model state on every rank, for export (plain names, no wrapper prefixes)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
