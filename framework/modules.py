"""Helpers over a model's blocks (framework/contract.py finds them) and meta-device
materialisation. Activation checkpointing, compilation and FSDP all work block by block."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from framework.contract import canonical_name
from framework.hf import load_pretrained, restore_buffers
from framework.peft import enabled, init_adapters, is_adapter
from models.init import Rule, fill_

__all__ = ["canonical_name", "map_blocks", "materialize", "materialize_model"]


def map_blocks(model: nn.Module, path: str | None, fn: Callable[[nn.Module], nn.Module], every: int = 1) -> int:
    """Replace every `every`-th block (the 1st, the (1+every)-th, ...) of the container at `path`
    by `fn(block)`; returns how many were replaced. Raises ValueError for a model without blocks."""
    blocks = model.get_submodule(path) if path else None
    if not isinstance(blocks, nn.ModuleList | nn.ModuleDict | nn.Sequential):
        raise ValueError(f"{type(model).__name__} has no blocks (declare blocks_path or set model.blocks)")
    keys = list(blocks.keys()) if isinstance(blocks, nn.ModuleDict) else list(range(len(blocks)))
    for key in keys[::every]:
        blocks[key] = fn(blocks[key])
    return len(keys[::every])


@torch.no_grad()
def materialize(
    module: nn.Module,
    device: torch.device,
    rule: Callable[[str, int], Rule],
    seed: int,
    ties: dict[str, str] | None = None,
) -> None:
    """Allocate this rank's part of every parameter of a module built on the meta device, on
    `device`, and initialise it as the whole model would be (models/init.py): a shard (FSDP,
    tensor parallel) or a pipeline stage is filled on its own, with no full-size tensor. A copy of
    a tied parameter (`ties`: alias -> source; a pipeline's last stage holds the head, tied to the
    first stage's embedding) is filled as its source."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    to_empty(module, device)
    for name, p in module.named_parameters():
        name = canonical_name(name)
        name = (ties or {}).get(name, name)
        if isinstance(p, DTensor):
            _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
            fill_(p.to_local(), rule(name, p.dim()), seed, name, p.shape, offset)
        else:
            fill_(p, rule(name, p.dim()), seed, name)


def materialize_model(module: nn.Module, spec, cfg, device: torch.device) -> None:
    """Allocate and fill a module (a model, a stage, or a sharded model) built on the meta device:
    by the model's init rule, then its non-persistent buffers, then pretrained weights if any."""
    if spec.init_rule is not None:
        materialize(module, device, spec.init_rule, cfg.seed, spec.ties)
    else:
        to_empty(module, device)
    restore_buffers(module, device)
    for sub in module.modules():
        if hasattr(sub, "init_buffers"):
            sub.init_buffers()
    folder = cfg.model.get("pretrained")
    if folder is not None:
        # a model whose names or layouts differ from the checkpoint's maps them (models/llama.py)
        missing = load_pretrained(module, folder, device, spec.from_hf_name, spec.ties)
        missing = [name for name in missing if not is_adapter(name)]  # peft=lora's own, filled below
        if missing and (spec.init_rule is None or spec.from_hf_name is not None):
            shown = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
            raise ValueError(f"model.pretrained: {folder} has no weights for {len(missing)} parameters ({shown})")
    if enabled(cfg.get("peft")):
        init_adapters(module, cfg.peft.rank, cfg.seed)  # whatever filled the rest: A normal, B zero


def to_empty(module: nn.Module, device: torch.device) -> None:
    """module.to_empty, keeping tied parameters tied (it gives each holder of a plain parameter
    a tensor of its own, which would untie an output head from its token embedding)."""
    ties = tied_parameters(module)
    module.to_empty(device=device)
    for owner, attr, source, source_attr in ties:
        setattr(owner, attr, getattr(source, source_attr))


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
