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

from framework.precision import DTYPES


def model_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated units a model exposes in ``.blocks`` (none for models without them)."""
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleDict):
        return list(blocks.values())
    return list(blocks) if blocks is not None else []


def mixed_precision_dtypes(
    precision: str, reduce_dtype: str
) -> tuple[torch.dtype | None, torch.dtype]:
    """(parameter dtype for compute, gradient-reduction dtype). fp32 runs keep fp32 params."""
    param = None if precision == "fp32" else DTYPES[precision]
    return param, torch.float32 if reduce_dtype == "fp32" else torch.bfloat16


def apply_fsdp2(model: nn.Module, dp_mesh, cfg: DictConfig, precision: str) -> nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    param_dtype, reduce_dtype = mixed_precision_dtypes(precision, cfg.reduce_dtype)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block in model_blocks(model):
        fully_shard(
            block, mesh=dp_mesh, reshard_after_forward=cfg.reshard_after_forward, mp_policy=mp
        )
    # The root unit holds what is left (embeddings, head); it is needed again at once by the
    # backward, so it is never resharded after forward.
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False, mp_policy=mp)
    return model


@contextmanager
def fsdp2_grad_sync(model: nn.Module, enabled: bool, always: bool) -> Iterator[None]:
    """Skip the reduce-scatter on accumulation micro-batches (gradients then stay unsharded until
    the last one: less communication, more memory), unless `always` keeps syncing every one."""
    model.set_requires_gradient_sync(enabled or always)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def apply_fsdp1(
    model: nn.Module, dp_mesh, cfg: DictConfig, precision: str, device: torch.device
) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    param_dtype, reduce_dtype = mixed_precision_dtypes(precision, cfg.reduce_dtype)
    block_classes = {type(b) for b in model_blocks(model)}
    policy = (
        functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=block_classes)
        if block_classes
        else None
    )
    strategy = ShardingStrategy[cfg.sharding_strategy]
    return FSDP(
        model,
        auto_wrap_policy=policy,
        sharding_strategy=strategy,
        mixed_precision=MixedPrecision(
            param_dtype=param_dtype, reduce_dtype=reduce_dtype, buffer_dtype=param_dtype
        )
        if param_dtype is not None
        else None,
        device_id=device,  # also on CPU: FSDP1 otherwise looks for an accelerator
        device_mesh=dp_mesh,
        use_orig_params=True,
    )
