"""Mixed precision: the one place that builds the autocast context and the loss scaler.

- fp32: no autocast, no scaling.
- amp:  float16 autocast with dynamic loss scaling: the loss is multiplied by a scale before
        backward so small float16 gradients do not underflow; steps with inf/nan gradients are
        skipped and the scale lowered (torch.amp.GradScaler; works on CPU too).
- bf16: bfloat16 autocast; bf16 has fp32's exponent range, so no scaling is needed.
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

    def autocast(self) -> AbstractContextManager:
        return torch.autocast(self.device_type, dtype=self.dtype, enabled=self.name != "fp32")


def build_precision(cfg: DictConfig, device: torch.device, sharded: bool = False) -> Precision:
    """`sharded`: FSDP1, whose ranks hold different gradient shards: its scaler agrees across
    ranks on whether any shard overflowed, so every rank skips the same steps."""
    if sharded:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as Scaler
    else:
        Scaler = torch.amp.GradScaler
    scaler = Scaler(
        device.type,
        init_scale=cfg.init_scale,
        growth_interval=cfg.growth_interval,
        enabled=cfg.name == "amp",
    )
    return Precision(cfg.name, DTYPES[cfg.name], device.type, scaler)
