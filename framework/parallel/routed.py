"""Routed mixture-of-experts layers (models/moe.py) under tensor parallel with sequence parallel.

Sequence parallel hands a block's MLP the norm's output split along the sequence (each tp rank
holds T / tp of every sequence's tokens). A routed layer keeps it split: each tp rank routes its
own tokens through its experts (whole on every tp rank: its data-parallel or expert-parallel
share), as data-parallel ranks route their batches, and its output is its own tokens' (the
residual stream's layout), with no gather and no reduce-scatter (torchtitan instead gathers the
tokens and splits the experts' hidden units over tp; with experts replicated over tp, splitting
the tokens is the cheaper of the two, as its expert parallel does when tp is borrowed for ep).

Each tp rank's router, experts and shared expert then hold the gradient of its own tokens only:
their sum over the tp ranks is the layer's gradient, summed in one all-reduce (of all routed
layers' gradients together) before the gradient norm, as a pipeline's tied copies are. The
routing counts are each rank's own and are summed over the tp ranks (not counted once), and the
auxiliary loss of a rank's tokens weighs 1 / tp of the sequence's (framework/callbacks/model.py):
the global balance counts every token once, and the run equals one process.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import PrepareModuleInput, parallelize_module

from framework.moe import routed_layers


def route_own_tokens(module: nn.Module, blocks: str, tp_mesh) -> None:
    """Every routed layer of `module` (a model or a pipeline stage) takes its input as this tp
    rank's part of the sequence, a plain tensor (the norm before it gives a DTensor)."""
    style = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_output=True)
    for _, layer in routed_layers(module, blocks):
        parallelize_module(layer, tp_mesh, style)


def routed_parameters(modules: list[nn.Module], blocks: str) -> list[nn.Parameter]:
    """The parameters of every routed layer in `modules` (this rank's stages)."""
    return [p for m in modules for _, layer in routed_layers(m, blocks) for p in layer.parameters()]


@torch.no_grad()
def sum_over_tp(params: list[nn.Parameter], group) -> None:
    """Sum the parameters' gradients (their local shards) over the tp ranks `group`, in one
    all-reduce of them all flattened together."""
    grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    parts = flat.split([g.numel() for g in grads])
    torch._foreach_copy_(grads, [f.view_as(g) for f, g in zip(parts, grads, strict=True)])


def summing_routed_grads(clip: Callable, stages: list[nn.Module], blocks: str | None, mesh, parallel_cfg) -> Callable:
    """`clip` (the run's gradient clipping), first summing the routed layers' gradients over the
    tp ranks where sequence parallel splits their tokens; `clip` itself elsewhere."""
    if mesh.dims.tp == 1 or not parallel_cfg.get("sequence_parallel", None):
        return clip
    if not routed_parameters(stages, blocks or ""):
        return clip
    group = mesh.device_mesh["tp"].get_group()

    def sum_then_clip(max_norm: float) -> torch.Tensor:
        # the parameters asked each step: FSDP swaps a module's registered ones (sharded, unsharded)
        sum_over_tp(routed_parameters(stages, blocks or ""), group)
        return clip(max_norm)

    return sum_then_clip
