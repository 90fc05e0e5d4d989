"""Mixture-of-experts layers (models/moe.py) seen from the training loop.

Each routed layer counts what it routed since it was last read (`stats`). After every optimizer
step the framework reads every rank's layers into one vector (blocks x experts token counts,
tokens dropped, the auxiliary loss and its calls), sums it over all ranks (data-parallel ranks
routed other tokens; pipeline stages hold other blocks; context-parallel ranks other positions;
tensor-parallel ranks the same tokens, counted once),
and from the whole step's loads:

- `moe_load_imbalance`: the most loaded expert's tokens over the mean, averaged over the blocks;
- `moe_dropped_tokens`: expert assignments dropped at capacity (0 when dropless);
- `moe_aux_loss`: the balancing loss (coef x experts x sum f_e P_e), averaged over its calls;
- balance=bias: each block's expert biases move by bias_rate towards the less loaded experts
  (sign(mean load - load), DeepSeek-V3), identically on every rank, since every rank holds the
  same sums.

Before each step, each layer's auxiliary loss gradient is scaled to the micro-batch's share of
the step (1/accumulation_steps; pipelines average their micro-batches themselves) and, under amp,
by the loss scale, as the training loss's own gradient is.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from framework.dist import DistInfo, all_reduce_sum


def routed_layers(module: nn.Module, blocks: str) -> list[tuple[int, nn.Module]]:
    """(block index, layer) of every routed MoE layer in `module` (a model, or a pipeline stage)."""
    number = re.compile(rf"(?:^|\.){re.escape(blocks)}\.(\d+)\.")
    found = []
    for name, sub in module.named_modules():
        if hasattr(sub, "expert_bias") and hasattr(sub, "stats"):
            match = number.search(name)
            found.append((int(match.group(1)) if match else len(found), sub))
    return found


def set_aux_scale(layers: list[tuple[int, nn.Module]], scale: float | torch.Tensor) -> None:
    for _, layer in layers:
        layer.aux_scale = torch.as_tensor(scale, dtype=torch.float32)


def step_figures(
    layers: list[tuple[int, nn.Module]], blocks: int, experts: int, copies: int, info: DistInfo
) -> dict[str, Any]:
    """The step's routing figures over every rank (see the module's docstring); resets the layers'
    counts and applies bias balancing. `copies`: ranks that route the same tokens (tensor
    parallel's ranks run the routed layers whole on their replicated tokens), counted once."""
    values = torch.zeros(blocks * experts + 3)
    for i, layer in layers:
        s = layer.stats
        values[i * experts : (i + 1) * experts] += s["tokens"]
        values[-3:] += torch.tensor([s["dropped"], s["aux"], s["calls"]])
        layer.reset_stats()
    values = all_reduce_sum(values.to(info.device), info).cpu() / copies
    loads = values[:-3].view(blocks, experts)
    used = loads.sum(1) > 0
    imbalance = (loads.max(1).values / loads.mean(1).clamp_min(1e-9))[used].mean()
    with torch.no_grad():
        for i, layer in layers:
            if layer.args.balance == "bias":
                step = layer.args.bias_rate * torch.sign(loads[i].mean() - loads[i])
                layer.expert_bias.add_(step.to(layer.expert_bias.device, layer.expert_bias.dtype))
    dropped, aux, calls = values[-3:].tolist()
    return {"moe_load_imbalance": float(imbalance), "moe_aux_loss": aux / max(calls, 1.0),
            "moe_dropped_tokens": round(dropped), "moe_tokens_per_expert": loads.sum(0).tolist()}  # fmt: skip
