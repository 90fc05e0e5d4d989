"""Mixture-of-experts layers (models/moe.py) as the parts that shard or plan them see them: one
way to recognise a routed layer. What a routed layer adds to a step (its counts, figures, the
auxiliary loss, bias balancing) goes through the contract's step protocol
(framework/contract.py, framework/callbacks/model.py), not through here."""

from __future__ import annotations

import re

from torch import nn


def is_routed(module: nn.Module) -> bool:
    """A routed layer: a router (`gate`) over grouped experts (`experts` with `w1`, `w2`, `w3`),
    its routing settings in `args` (models/moe.py's MoEArgs)."""
    experts = getattr(module, "experts", None)
    return hasattr(module, "gate") and hasattr(module, "args") and all(hasattr(experts, w) for w in ("w1", "w2", "w3"))


def routed_layers(module: nn.Module, blocks: str) -> list[tuple[int, nn.Module]]:
    """(block index, layer) of every routed MoE layer in `module` (a model, or a pipeline stage)."""
    number = re.compile(rf"(?:^|\.){re.escape(blocks)}\.(\d+)\.")
    found = []
    for name, sub in module.named_modules():
        if is_routed(sub):
            match = number.search(name)
            found.append((int(match.group(1)) if match else len(found), sub))
    return found
