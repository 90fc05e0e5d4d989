"""Fully sharded data parallel: parameters, gradients and optimizer state split over the dp ranks
(ZeRO-3). Each block is one FSDP unit: its parameters are all-gathered just before it runs and
freed after (``reshard_after_forward``), gradients are reduce-scattered as its backward ends.

- FSDP2 (``fully_shard``, ``parallel.version=2``, the default): per-parameter DTensor sharding;
  a 2-D (replicate, shard) mesh gives hybrid sharding (HSDP); mixed precision through
  ``MixedPrecisionPolicy``.
- FSDP1 (``FullyShardedDataParallel``, ``parallel.version=1``) with the article's names:
  ``sharding_strategy=FULL_SHARD | SHARD_GRAD_OP | HYBRID_SHARD | NO_SHARD`` and a transformer
  auto-wrap policy over the model's block class.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from omegaconf import DictConfig
from torch import nn
from torch.distributed.fsdp import FSDPModule

from framework.moe import is_routed
from framework.parallel.tensor import own_storage
from framework.precision import DTYPES


def mixed_precision_dtypes(precision: str, reduce_dtype: str) -> tuple[torch.dtype | None, torch.dtype]:
    """(parameter dtype for compute, gradient-reduction dtype). fp32 runs keep fp32 params."""
    param = None if precision == "fp32" else DTYPES[precision]
    return param, torch.float32 if reduce_dtype == "fp32" else torch.bfloat16


def apply_fsdp2(model: nn.Module, blocks: list[nn.Module], dp_mesh, cfg: DictConfig) -> nn.Module:
    """One unit per block, and the root for the rest. `cfg`: the run's config. Under expert
    parallel, each layer's experts (already split over ep) are a unit of their own first, sharded
    over the data-parallel ranks left (framework/parallel/expert.py)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    param_dtype, reduce_dtype = mixed_precision_dtypes(cfg.precision.name, cfg.parallel.get("reduce_dtype", "fp32"))
    kwargs = {
        "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
        # offload: shards (and so the optimizer step) live in CPU memory, copied in unit by unit
        "offload_policy": CPUOffloadPolicy() if cfg.memory.name == "offload" else OffloadPolicy(),
    }
    # A unit whose output is a view (a Linear head on (B, T, dim) returns one: docs/own_model.md's
    # TinyLM) would make FSDP warn of wrong gradients: an in-place op on a view drops the hook
    # FSDP puts on it for its pre-backward all-gather. Each unit's output gets a storage of its
    # own first (a hook registered now runs before FSDP's); outputs that are no views pass as they are.
    reshard = cfg.parallel.get("reshard_after_forward", True)
    # expert parallel's experts: a unit of their own over the dp_shard ranks ep leaves (framework/parallel/expert.py)
    for layer in (m for m in model.modules() if is_routed(m) and m.experts.dispatcher is not None):
        fully_shard(layer.experts, mesh=layer.experts.dispatcher.fsdp_mesh, reshard_after_forward=reshard, **kwargs)
    for block in blocks:
        block.register_forward_hook(own_storage)
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard, **kwargs)
    # The root unit holds what is left (embeddings, head); it is needed again at once by the
    # backward, so it is never resharded after forward.
    model.register_forward_hook(own_storage)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False, **kwargs)
    return model


@contextmanager
def fsdp2_grad_sync(model: nn.Module, enabled: bool, cfg: DictConfig) -> Iterator[None]:
    """Accumulation with FSDP2. On the micro-batches before the last (`enabled=False`), skip the
    reduce-scatter and keep the parameters gathered: they are all-gathered once, in the first
    forward, and gradients stay unsharded until the last micro-batch, whose backward reshards and
    reduce-scatters as a plain step would. A step then communicates exactly what a step without
    accumulation does, at the cost of holding unsharded parameters and gradients in between.
    `sync_every_microbatch` keeps the plain behaviour on every micro-batch instead."""
    if enabled or cfg.get("sync_every_microbatch", False):
        yield
        return
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.set_requires_gradient_sync(False, recurse=False)
        unit.set_reshard_after_backward(False, recurse=False)
        unit.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for unit in units:
            unit.set_requires_gradient_sync(True, recurse=False)
            unit.set_reshard_after_backward(True, recurse=False)
            # blocks go back to the configured behaviour; the root is never resharded after forward
            unit.set_reshard_after_forward(cfg.get("reshard_after_forward", True) and unit is not model, recurse=False)


def apply_fsdp1(model: nn.Module, blocks: list[nn.Module], dp_mesh, cfg: DictConfig, device: torch.device) -> nn.Module:
    """A transformer auto-wrap policy over the blocks' class. `cfg`: the run's config."""
    from torch.distributed.fsdp import CPUOffload, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    param_dtype, reduce_dtype = mixed_precision_dtypes(cfg.precision.name, cfg.parallel.get("reduce_dtype", "fp32"))
    block_classes = {type(b) for b in blocks}
    policy = (
        functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=block_classes) if block_classes else None
    )
    strategy = ShardingStrategy[cfg.parallel.sharding_strategy]
    return FSDP(
        model,
        auto_wrap_policy=policy,
        sharding_strategy=strategy,
        mixed_precision=MixedPrecision(param_dtype=param_dtype, reduce_dtype=reduce_dtype, buffer_dtype=param_dtype)
        if param_dtype is not None
        else None,
        device_id=device,  # also on CPU: FSDP1 otherwise looks for an accelerator
        device_mesh=dp_mesh,
        use_orig_params=True,
        cpu_offload=CPUOffload(offload_params=cfg.memory.name == "offload"),
    )
