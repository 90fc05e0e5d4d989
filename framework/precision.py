"""Mixed precision: the one place that builds the autocast context and the loss scaler.

- fp32: no autocast, no scaling.
- amp:  float16 autocast with dynamic loss scaling: the loss is multiplied by a scale before
        backward so small float16 gradients do not underflow; steps with inf/nan gradients are
        skipped and the scale lowered (torch.amp.GradScaler; works on CPU too).
- bf16: bfloat16 autocast; bf16 has fp32's exponent range, so no scaling is needed.

`precision.tf32` (CUDA): fp32 matmuls and convolutions on TF32 tensor cores (torch's
`allow_tf32` switches; PyTorch leaves matmuls off by default), about 7x the fp32 rate on Hopper.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from omegaconf import DictConfig

DTYPES = {"fp32": torch.float32, "amp": torch.float16, "bf16": torch.bfloat16}


@dataclass
class Precision:
    name: str
    dtype: torch.dtype
    device_type: str
    scaler: torch.amp.GradScaler  # disabled (a pass-through) unless name == "amp"
    tf32: bool = False  # fp32 matmuls run on TF32 tensor cores (CUDA with precision.tf32)

    def autocast(self) -> AbstractContextManager:
        return torch.autocast(self.device_type, dtype=self.dtype, enabled=self.name != "fp32")


def build_precision(cfg: DictConfig, device: torch.device, sharded: bool = False) -> Precision:
    """`sharded`: the ranks hold different gradient shards (fsdp, tp, hybrid): the scaler agrees
    across ranks on whether any shard overflowed, so every rank skips the same steps (each rank
    alone would skip on its own shards, and the replicas drift apart)."""
    Scaler = _shard_scaler() if sharded else torch.amp.GradScaler
    # the scaler's knobs are amp's (precision=amp); the other choices' disabled scaler takes torch's defaults
    knobs = {k: cfg[k] for k in ("init_scale", "growth_interval") if k in cfg}
    scaler = Scaler(device.type, enabled=cfg.name == "amp", **knobs)
    tf32 = apply_tf32(cfg.tf32, device)
    return Precision(cfg.name, DTYPES[cfg.name], device.type, scaler, tf32)


def _shard_scaler() -> type:
    """torch's ShardedGradScaler (found_inf all-reduced over the ranks), unscaling each DTensor
    gradient through its local shard: under tensor parallel some gradients are DTensors and
    others plain tensors, which torch's one foreach unscale refuses to mix."""
    from collections import defaultdict

    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    from torch.distributed.tensor import DTensor

    class LocalShardScaler(ShardedGradScaler):
        def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16=True):
            grads, found = defaultdict(list), {}
            with torch.no_grad():
                for group in optimizer.param_groups:
                    for grad in (p.grad for p in group["params"] if p.grad is not None):
                        local = grad.to_local() if isinstance(grad, DTensor) else grad
                        if not allow_fp16 and local.dtype == torch.float16:
                            raise ValueError("Attempting to unscale FP16 gradients.")
                        grads[(local.device, local.dtype)].append(local)
                for (place, _), tensors in grads.items():
                    found.setdefault(place, found_inf.to(place))
                    torch._amp_foreach_non_finite_check_and_unscale_(tensors, found[place], inv_scale.to(place))
            return found or {found_inf.device: found_inf}

    return LocalShardScaler


def apply_tf32(enabled: bool, device: torch.device) -> bool:
    """Set torch's TF32 switches for fp32 matmuls and cuDNN convolutions on CUDA; returns whether
    TF32 is on (the state torch now holds: the MFU peak reads it). CPU: no TF32, nothing set."""
    if device.type != "cuda":
        return False
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled
    return torch.backends.cuda.matmul.allow_tf32


def loss_scale(scaler: torch.amp.GradScaler, device: torch.device) -> torch.Tensor:
    """amp's loss scale as a device tensor, through the scaler's public API (get_scale() would be a
    host sync); 1 when the scaler is off."""
    return scaler.scale(torch.ones((), device=device))
