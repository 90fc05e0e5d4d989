"""Selective activation checkpointing (`memory=selective`): in every k-th block, the outputs of the
operators `memory.save_ops` names are kept for backward and everything else the block computes
(norms, activations, residual adds, casts) is recomputed from its input, with torch's
selective-checkpoint contexts over non-reentrant checkpointing. Keeping the matmuls' and
attention's outputs (the default) saves most of checkpointing's memory at a fraction of its
recomputation: the expensive operators run once.

Names: `matmul` (mm, addmm, bmm, baddbmm), `attention` (every fused SDPA kernel, the CPU's too),
`collectives` (functional all-gather, reduce-scatter, all-reduce, all-to-all: tensor parallel's,
not run again in backward), or an aten operator by name (`aten.mm`, `mm`).

`memory.matmul_every=k` keeps only every k-th matmul of a block, in the order its forward runs them
(the 1st, the (k+1)-th, ...), and recomputes the others: at 2, torchtitan's selective "op" policy
(a Llama block keeps wq's, wv's, w1's and w2's outputs and runs wk, wo and w3 again).

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


MATMULS = frozenset(getattr(torch.ops.aten, op) for op in GROUPS["matmul"][1])


class _Keeps:
    """One block's forward (or its recomputation): whether an operator's output is kept, counting
    the matmuls as they run so that only every `matmul_every`-th is."""

    def __init__(self, ops: frozenset, matmul_every: int):
        self.ops, self.every, self.matmuls = ops, matmul_every, 0

    def __call__(self, op) -> bool:
        if op.overloadpacket not in self.ops:
            return False
        if op.overloadpacket in MATMULS:
            self.matmuls += 1
            return (self.matmuls - 1) % self.every == 0
        return True


class _ReportKept(TorchDispatchMode):
    """Above the caching context in forward: reports each kept operator's outputs to the meter."""

    def __init__(self, keeps: _Keeps):
        super().__init__()
        self.keeps = keeps

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.keeps(func):
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    kept_for_backward(t)
        return out


def selective_contexts(ops: frozenset, report: bool = True, matmul_every: int = 1):
    """checkpoint's `context_fn`: keep what `ops` output (of the matmuls every `matmul_every`-th),
    recompute the rest; the forward context also reports what it keeps (not under compile, which
    traces the contexts itself)."""

    @contextmanager
    def reporting(forward):
        with forward, _ReportKept(_Keeps(ops, matmul_every)):  # caching below, reporting above
            yield

    def context_fn():
        keeps = {False: _Keeps(ops, matmul_every), True: _Keeps(ops, matmul_every)}  # forward, recompute

        def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
            kept = keeps[ctx.is_recompute](op)
            return CheckpointPolicy.MUST_SAVE if kept else CheckpointPolicy.PREFER_RECOMPUTE

        forward, recompute = create_selective_checkpoint_contexts(policy)
        # what it keeps bypasses the meter's saved-tensor hooks (reported instead, on every torch;
        # torch >= 2.14 asks, and warns while unasked)
        forward.respect_saved_tensors_hooks = False
        return (reporting(forward) if report else forward), recompute

    return context_fn


def apply_selective_checkpointing(model: nn.Module, blocks: str | None, memory, compiled: bool) -> int:
    """Wrap every `memory.checkpoint_every`-th block; returns how many were wrapped."""
    ops, every = saved_ops(memory.save_ops), memory.get("matmul_every", 1)
    context_fn = selective_contexts(ops, report=not compiled, matmul_every=every)
    wrap = lambda b: checkpoint_wrapper(b, checkpoint_impl=CheckpointImpl.NO_REENTRANT, context_fn=context_fn)  # noqa: E731
    try:
        return map_blocks(model, blocks, wrap, memory.checkpoint_every)
    except ValueError as err:
        raise ValueError(f"memory=selective: {err} to checkpoint") from None
