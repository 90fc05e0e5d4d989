"""The whole model in one place, for export: gathered from shards and stages onto rank 0's host."""

from __future__ import annotations

import torch
import torch.distributed as dist


def full_model_state_dict(par) -> dict[str, torch.Tensor]:
    """The whole, unsharded model state on global rank 0's host, under the plain model's names (no
    wrapper prefixes): FSDP/TP shards gathered, pipeline stages merged; {} on every other rank.
    Collective: every rank calls it. Gathered tensor by tensor, each copied to the host of the
    rank that keeps it (rank 0, or the first rank of another pipeline stage) and dropped before
    the next, so no device ever holds more than one full tensor: a model that fits only because
    FSDP shards it exports too."""
    from torch.distributed._state_dict_utils import _gather_state_dict
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from framework.checkpoint.optim_state import plain_tensors

    state = plain_tensors(get_model_state_dict(par.module))  # this rank's shards, as plain tensors
    rank = dist.get_rank() if dist.is_initialized() else 0
    in_stage_zero_group = par.mesh is None or (par.mesh.dp_rank, par.mesh.tp_rank, par.mesh.cp_rank) == (0, 0, 0)
    keep = rank == 0 or (par.pp_group is not None and in_stage_zero_group)
    if dist.is_initialized():
        state = _gather_state_dict(state, cpu_offload=True, ranks_only=(rank,) if keep else (-1,))
    state = {k: v.detach().cpu() for k, v in state.items()} if keep else {}
    if par.pp_group is not None and in_stage_zero_group:  # each stage holds some layers: merge them on rank 0
        parts: list | None = [None] * dist.get_world_size(par.pp_group) if rank == 0 else None
        dist.gather_object(state, parts, group=par.pp_group, group_dst=0)
        state = {k: v for part in parts for k, v in part.items()} if rank == 0 else {}
    return state
