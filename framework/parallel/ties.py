"""Tied parameters under every strategy: an output head that is the token embedding stays one
parameter in value, whatever the layout.

A tie is a property of the model (``ModelSpec.ties``: {alias: source}, e.g. ``{"output.weight":
"tok_embeddings.weight"}``). Where both holders sit on one rank they hold one parameter: tensor
parallel gives each module a DTensor of its own, so the alias is pointed back at the source's
(both split over the vocabulary: one DTensor), and FSDP then shards that one parameter. Where a
pipeline puts them on different ranks (the embedding on the first stage, the head on the last),
each of those ranks holds a copy: filled from the source's name (framework/modules.py), loaded
from the source's tensor (model.pretrained), and kept equal by summing the copies' gradients over
the ranks that hold one before clipping, as Megatron's embedding group does. The global gradient
norm counts the copies once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

Holder = tuple[nn.Module, str]  # (module, attribute)


def holder(module: nn.Module, name: str) -> Holder | None:
    """The (module, attribute) holding parameter `name` in `module`, or None where a pipeline
    stage has no such submodule."""
    *path, attr = name.split(".")
    for part in path:
        module = module._modules.get(part) if module is not None else None
    if module is None or module._parameters.get(attr) is None:
        return None
    return module, attr


def _find(stages: list[nn.Module], name: str) -> tuple[int, Holder] | None:
    """(index of the stage, holder) of parameter `name` among this rank's stages."""
    return next(((i, h) for i, h in ((i, holder(s, name)) for i, s in enumerate(stages)) if h is not None), None)


def retie(stages: list[nn.Module], ties: dict[str, str]) -> list[list[Holder]]:
    """Point each alias back at its source where both are in one stage of this rank (after tensor
    parallel made them two DTensors). Returns, per tie split over stages, this rank's holders of a
    copy: one where the other copy is on another pipeline rank; two where a V schedule runs the
    first and the last stage on this rank (each stage's backward needs a parameter of its own)."""
    split = []
    for alias, source in ties.items():
        a, s = _find(stages, alias), _find(stages, source)
        if a is None or s is None:
            split += [[found[1]] for found in (a, s) if found is not None]
            continue
        (a_stage, a), (s_stage, s) = a, s
        alias_param, source_param = getattr(*a), getattr(*s)
        if a_stage != s_stage:
            if alias_param is source_param:  # the stages share one module tree: a copy of its own
                setattr(*a, nn.Parameter(source_param.detach().clone(), source_param.requires_grad))
            split.append([s, a])
            continue
        if alias_param is source_param:
            continue
        placements = [getattr(p, "placements", None) for p in (alias_param, source_param)]
        if placements[0] != placements[1]:
            raise ValueError(
                f"model: {alias} is tied to {source}, but tensor parallel lays them out differently "
                f"({placements[0]} vs {placements[1]}); give both the same split in model.tp_plan or untie them"
            )
        setattr(*a, source_param)
    return split


@dataclass
class SplitTies:
    """This rank's copies of parameters tied across pipeline stages (per tie: its holders here),
    the group of ranks holding a copy (None: this rank is the only one), and how many copies
    there are in all (each counts 1/copies in the gradient norm)."""

    holders: list[list[Holder]] = field(default_factory=list)
    group: object = None
    copies: int = 1

    def params(self) -> list[nn.Parameter]:
        return [getattr(*h) for tie in self.holders for h in tie]  # read each time: FSDP replaces them

    @torch.no_grad()
    def sync(self) -> None:
        """Each copy's gradient becomes the sum of all copies' (local shards: every copy is split
        alike), so every copy takes the same update."""
        for tie in self.holders:
            grads = [_local_grad(getattr(*h)) for h in tie]
            total = grads[0] if len(grads) == 1 else torch.stack(grads).sum(0)
            if self.group is not None:
                dist.all_reduce(total, group=self.group)
            for g in grads:
                if g is not total:
                    g.copy_(total)


def _local_grad(p: nn.Parameter) -> torch.Tensor:
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    if hasattr(p.grad, "placements") and p.grad.placements != p.placements:
        # e.g. a vocabulary-split embedding's gradient comes back replicated: into the parameter's
        # own layout, which its copy shares (no communication)
        p.grad = p.grad.redistribute(p.grad.device_mesh, p.placements)
    return p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad


def split_ties(holders: list[list[Holder]], device_mesh, pp_holders: list[int]) -> SplitTies:
    """This rank's copies, and (collective: every rank calls it, holders or not, where more than
    one pipeline rank holds a copy) for each coordinate off the pipeline axis the group of
    pipeline ranks `pp_holders` (those running the first or the last stage)."""
    group = None
    if len(pp_holders) > 1:
        ranks = device_mesh.mesh.movedim(0, -1).reshape(-1, device_mesh.mesh.shape[0])  # a row per pp group
        group, _ = dist.new_subgroups_by_enumeration([[int(row[r]) for r in pp_holders] for row in ranks])
    return SplitTies(holders, group if holders else None, copies=2)
