"""Where a model keeps its repeated units: `.blocks`, an nn.ModuleList in the plain models, an
nn.ModuleDict (keyed by the full model's layer numbers) in a pipeline stage. Activation
checkpointing, compilation and FSDP all work block by block through these two helpers."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn


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
