"""Where a model keeps its repeated units: `.blocks`, an nn.ModuleList in the plain models, an
nn.ModuleDict (keyed by the full model's layer numbers) in a pipeline stage. Activation
checkpointing, compilation and FSDP all work block by block through these two helpers."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from models.init import Rule, fill_

WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def model_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's blocks in order (none for models without them)."""
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleDict):
        return list(blocks.values())
    return list(blocks) if isinstance(blocks, nn.ModuleList) else []


def map_blocks(model: nn.Module, fn: Callable[[nn.Module], nn.Module], every: int = 1) -> int:
    """Replace every `every`-th block (the 1st, the (1+every)-th, ...) by `fn(block)`; returns how
    many were replaced. Raises ValueError for a model without blocks."""
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList | nn.ModuleDict):
        raise ValueError(f"{type(model).__name__} has no `blocks`")
    keys = list(blocks.keys()) if isinstance(blocks, nn.ModuleDict) else list(range(len(blocks)))
    for key in keys[::every]:
        blocks[key] = fn(blocks[key])
    return len(keys[::every])


def canonical_name(name: str) -> str:
    """A parameter's name in the plain model (wrappers' prefixes removed)."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


@torch.no_grad()
def materialize(module: nn.Module, device: torch.device, rule: Callable[[str, int], Rule], seed: int) -> None:
    """Allocate this rank's part of every parameter of a module built on the meta device, on
    `device`, and initialise it as the whole model would be (models/init.py): a shard (FSDP,
    tensor parallel) or a pipeline stage is filled on its own, with no full-size tensor."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    ties = tied_parameters(module)
    module.to_empty(device=device)
    for owner, attr, source, source_attr in ties:  # to_empty gives each holder a tensor of its own: share again
        setattr(owner, attr, getattr(source, source_attr))
    for name, p in module.named_parameters():
        name = canonical_name(name)
        if isinstance(p, DTensor):
            _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
            fill_(p.to_local(), rule(name, p.dim()), seed, name, p.shape, offset)
        else:
            fill_(p, rule(name, p.dim()), seed, name)


def tied_parameters(module: nn.Module) -> list[tuple[nn.Module, str, nn.Module, str]]:
    """(module, attribute, first holder, its attribute) for each parameter held a second time,
    e.g. an output head tied to the token embedding."""
    first: dict[int, tuple[nn.Module, str]] = {}
    ties = []
    for mod in module.modules():
        for attr, p in mod._parameters.items():
            if p is None:
                continue
            if id(p) in first:
                ties.append((mod, attr, *first[id(p)]))
            else:
                first[id(p)] = (mod, attr)
    return ties
