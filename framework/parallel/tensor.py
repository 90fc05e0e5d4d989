"""Tensor parallelism with DTensor (Megatron-style), from the plan a model declares in plain
strings (framework/contract.py), turned here into DTensor's parallel styles.

A column-wise linear is split by output features (each rank computes whole attention heads, a
slice of an MLP's hidden units), a row-wise one by input features (partial sums combined by one
all-reduce, or a reduce-scatter under sequence parallelism). gpt's plan: two collectives per block
forward, two backward.

Sequence parallel (``parallel.sequence_parallel``) also splits the norms, dropouts and residual
stream along the sequence, so activations outside the matmuls are 1/tp per rank: the embeddings
come out split along the sequence, ``gather_input`` modules gather it back, row-wise outputs are
reduce-scattered into it. Loss parallel (``parallel.loss_parallel``) keeps the logits split over the
vocabulary and computes the cross-entropy on the shards, never gathering the (B, T, vocab) logits.
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

from framework.contract import ModelSpec, expand_plan
from framework.parallel.routed import route_own_tokens


class GatherSequence(PrepareModuleInput):
    """Gather the first input (split along the sequence) before the module runs; any further
    inputs (a document mask, ``None``) pass through as they are."""

    def __init__(self):
        super().__init__(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))

    def _prepare_input_fn(self, inputs, device_mesh):
        first, rest = (inputs[0], inputs[1:]) if isinstance(inputs, tuple) else (inputs, ())
        gathered = super()._prepare_input_fn((first,), device_mesh)
        return (*gathered, *rest)


def distribute_parameter(module: nn.Module, name: str, mesh, placement) -> None:
    """Replace `module`'s parameter `name` by a DTensor of it on `mesh` (one placement)."""
    from torch.distributed.tensor import distribute_tensor

    p = getattr(module, name)
    module.register_parameter(name, nn.Parameter(distribute_tensor(p, mesh, [placement]), p.requires_grad))


class LoRAColwise(ColwiseParallel):
    """A column-wise linear with LoRA adapters (framework/peft.py): the weight (and bias) split by
    output features, A (rank x in) whole on every rank, B (out x rank) split by output features
    as the weight: each rank's B A x is its own slice of the update, added to its slice of x W^T."""

    def _partition_linear_fn(self, name, module, device_mesh):
        if name:  # the adapters themselves: placed with their layer, below
            return
        for param in ("weight", "bias") if module.bias is not None else ("weight",):
            distribute_parameter(module, param, device_mesh, Shard(0))
        distribute_parameter(module.lora_A, "weight", device_mesh, Replicate())
        distribute_parameter(module.lora_B, "weight", device_mesh, Shard(0))


class LoRARowwise(RowwiseParallel):
    """A row-wise linear with LoRA adapters: A split by input features as the weight, so A x is
    a partial sum on each rank; B whole: B (A x) stays partial, and the layer's one reduction sums
    it with x W^T."""

    def _partition_linear_fn(self, name, module, device_mesh):
        if name:
            return
        distribute_parameter(module, "weight", device_mesh, Shard(1))
        if module.bias is not None:
            distribute_parameter(module, "bias", device_mesh, Replicate())
        distribute_parameter(module.lora_A, "weight", device_mesh, Shard(1))
        distribute_parameter(module.lora_B, "weight", device_mesh, Replicate())


def _with_adapters(style):
    """The same style (its layouts) for a linear with LoRA adapters."""
    lora = {ColwiseParallel: LoRAColwise, RowwiseParallel: LoRARowwise}.get(type(style))
    if lora is None:
        raise ValueError(f"peft=lora: no tensor-parallel placement of adapters on a {type(style).__name__} layer")
    out = lora.__new__(lora)
    out.__dict__.update(style.__dict__)
    return out


def tp_style(style: str, sequence_parallel: bool, loss_parallel: bool):
    """The DTensor style for one entry of a model's plan (None: nothing to do in this setting)."""
    residual = Shard(1) if sequence_parallel else Replicate()  # layout of the residual stream
    if style == "colwise":
        return ColwiseParallel()
    if style == "rowwise":
        return RowwiseParallel(output_layouts=residual)
    if style == "output":
        return ColwiseParallel(
            input_layouts=residual,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    if style == "vocab_embedding":
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=residual)
    if style == "head_norm":  # (B, T, heads, head_dim): this rank's heads in, out
        return SequenceParallel(sequence_dim=2, use_local_output=True)
    if not sequence_parallel:
        return None  # the rest are sequence parallel's
    if style == "sequence_parallel":
        return SequenceParallel()
    if style == "gather_input":
        return GatherSequence()
    if style == "embedding":  # (B, T) ids in, split along the sequence out
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if style == "position_embedding":  # (T,) positions in: the sequence is dim 0
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0))
    raise ValueError(f"unknown tensor-parallel style {style!r}")


def apply_tp(model: nn.Module, spec: ModelSpec, tp_mesh, sequence_parallel: bool, loss_parallel: bool) -> nn.Module:
    from framework.peft import LoRALinear

    plan = {}
    for path, style in expand_plan(model, spec).items():
        dtensor_style = tp_style(style, sequence_parallel, loss_parallel)
        module = model.get_submodule(path)
        if isinstance(module, LoRALinear):
            dtensor_style = _with_adapters(dtensor_style)
        if dtensor_style is not None and callable(getattr(module, "tensor_parallel_style", None)):
            dtensor_style = module.tensor_parallel_style(dtensor_style)  # a converted layer's own (float8's)
        if dtensor_style is not None:
            plan[path] = dtensor_style
    frozen = {name for name, param in model.named_parameters() if not param.requires_grad}
    parallelize_module(model, tp_mesh, plan)
    if sequence_parallel:  # routed experts route their tp rank's own tokens (framework/parallel/routed.py)
        route_own_tokens(model, spec.blocks or "", tp_mesh)
    # torch's SequenceParallel re-registers a norm's parameters as new ones that require grad: a
    # frozen norm (peft=lora freezes all but the adapters) would train, and drift from one process
    for name, param in model.named_parameters():
        if name in frozen:
            param.requires_grad_(False)
    # The model's output leaves tensor parallel as a local tensor, a view of the DTensor it came
    # from. FSDP, applied next, hooks its pre-backward all-gather on the output, and an in-place
    # op on a view would drop that hook: give the output a storage of its own (a hook registered
    # now runs before FSDP's).
    model.register_forward_hook(own_storage)
    return model


def own_storage(module: nn.Module, args: tuple, output):
    """A forward hook: a plain tensor output that is a view comes back with a storage of its own."""
    if isinstance(output, torch.Tensor) and not hasattr(output, "to_local") and output._base is not None:
        return output.clone()
    return output
