"""Selective activation checkpointing (`memory=selective`): in every k-th block, the outputs of the
operators `memory.save_ops` names are kept for backward and everything else the block computes
(norms, activations, residual adds, casts) is recomputed from its input, with torch's
selective-checkpoint contexts over non-reentrant checkpointing. Keeping the matmuls' and
attention's outputs (the default) saves most of checkpointing's memory at a fraction of its
recomputation: the expensive operators run once.

Names: `matmul` (mm, addmm, bmm, baddbmm), `attention` (every fused SDPA kernel, the CPU's too),
`collectives` (functional all-gather, reduce-scatter, all-reduce, all-to-all: tensor parallel's,
not run again in backward), or an aten operator by name (`aten.mm`, `mm`).

What the contexts keep goes to checkpointing's own storage, past the saved-tensor hooks the
activation meter counts through: each kept output is reported to it (framework.measure.memory's
kept_for_backward), so the memory figures and the planner's forecast see it.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from framework.measure.memory import kept_for_backward
from framework.modules import map_blocks

GROUPS = {
    "matmul": ("aten", ("mm", "addmm", "bmm", "baddbmm")),
    "attention": ("aten", ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                           "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
                           "_scaled_dot_product_fused_attention_overrideable")),
    "collectives": ("_c10d_functional", ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce",
                                         "all_to_all_single")),
}  # fmt: skip


def saved_ops(names: Iterable[str]) -> frozenset:
    """The operator packets `names` mean; ValueError naming the first that is none."""
    found = set()
    for name in names:
        if name in GROUPS:
            namespace, ops = GROUPS[name]
            found |= {getattr(getattr(torch.ops, namespace), op) for op in ops}
            continue
        op = str(name).removeprefix("aten.")
        if not op or not hasattr(torch.ops.aten, op):
            raise ValueError(f"got {name!r}; one of {', '.join(GROUPS)} or an aten operator (aten.mm)")
        found.add(getattr(torch.ops.aten, op))
    return frozenset(found)


class _ReportKept(TorchDispatchMode):
    """Above the caching context in forward: reports each kept operator's outputs to the meter."""

    def __init__(self, ops: frozenset):
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in self.ops:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    kept_for_backward(t)
        return out


def selective_contexts(ops: frozenset, report: bool = True):
    """checkpoint's `context_fn`: keep what `ops` output, recompute the rest; the forward context
    also reports what it keeps (not under compile, which traces the contexts itself)."""

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op.overloadpacket in ops else CheckpointPolicy.PREFER_RECOMPUTE

    @contextmanager
    def reporting(forward):
        with forward, _ReportKept(ops):  # the caching mode below, the reporting mode above it
            yield

    def context_fn():
        forward, recompute = create_selective_checkpoint_contexts(policy)
        # what it keeps bypasses the meter's saved-tensor hooks (reported instead, on every torch;
        # torch >= 2.14 asks, and warns while unasked)
        forward.respect_saved_tensors_hooks = False
        return (reporting(forward) if report else forward), recompute

    return context_fn


def apply_selective_checkpointing(model: nn.Module, blocks: str | None, names: Iterable[str], every: int,
                                  compiled: bool) -> int:  # fmt: skip
    """Wrap every `every`-th block; returns how many were wrapped."""
    context_fn = selective_contexts(saved_ops(names), report=not compiled)
    wrap = lambda b: checkpoint_wrapper(b, checkpoint_impl=CheckpointImpl.NO_REENTRANT, context_fn=context_fn)  # noqa: E731
    try:
        return map_blocks(model, blocks, wrap, every)
    except ValueError as err:
        raise ValueError(f"memory=selective: {err} to checkpoint") from None
