"""Tensor parallelism for `gpt` with DTensor (Megatron-style).

In each block q/k/v and the MLP's first linear are split by output features (column-wise: each
rank computes whole attention heads and a slice of the MLP's hidden units) and the two output
projections by input features (row-wise: partial sums combined by one all-reduce, or a
reduce-scatter with sequence parallelism). Two collectives per block forward, two backward.

Sequence parallel (``parallel.sequence_parallel``) also splits the layer norms, dropouts and
residual stream along the sequence, so activations outside the matmuls are 1/tp per rank.
Loss parallel (``parallel.loss_parallel``) keeps the logits split over the vocabulary and computes
the cross-entropy on the shards, never gathering the (B, T, vocab) logits.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from framework.modules import model_blocks


def apply_tp(model: nn.Module, tp_mesh, sequence_parallel: bool, loss_parallel: bool) -> nn.Module:
    residual = Shard(1) if sequence_parallel else Replicate()  # layout of the residual stream
    for block in model_blocks(model):
        plan = {
            "attn.q": ColwiseParallel(),
            "attn.k": ColwiseParallel(),
            "attn.v": ColwiseParallel(),
            "attn.proj": RowwiseParallel(output_layouts=residual),
            "mlp.fc": ColwiseParallel(),
            "mlp.proj": RowwiseParallel(output_layouts=residual),
        }
        if sequence_parallel:
            # gather the sequence back before attention (its second input, a document mask, is None
            # here: packing is not combined with tensor parallel) and before the MLP
            attn_in = PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None))
            mlp_in = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
            plan |= {"ln_1": SequenceParallel(), "attn": attn_in, "ln_2": SequenceParallel(), "mlp": mlp_in}
        parallelize_module(block, tp_mesh, plan)

    head = ColwiseParallel(
        input_layouts=residual,
        output_layouts=Shard(-1) if loss_parallel else Replicate(),
        use_local_output=not loss_parallel,
    )
    plan = {}
    if getattr(model, "lm_head", None) is not None:
        plan["lm_head"] = head
    if sequence_parallel:
        if getattr(model, "tok_emb", None) is not None:
            # token and position embeddings come out split along the sequence, to be added shard to shard
            plan["tok_emb"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
            plan["pos_emb"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0))
        if getattr(model, "ln_f", None) is not None:
            plan["ln_f"] = SequenceParallel()
    if plan:
        parallelize_module(model, tp_mesh, plan)
    # The model's output leaves tensor parallel as a local tensor, a view of the DTensor it came
    # from. FSDP, applied next, hooks its pre-backward all-gather on the output, and an in-place
    # op on a view would drop that hook: give the output a storage of its own (a hook registered
    # now runs before FSDP's).
    model.register_forward_hook(_own_storage)
    return model


def _own_storage(module: nn.Module, args: tuple, output):
    if isinstance(output, torch.Tensor) and not hasattr(output, "to_local") and output._base is not None:
        return output.clone()
    return output
