"""Parameter-efficient fine-tuning: LoRA (Hu et al., 2021, "LoRA: Low-Rank Adaptation of Large
Language Models"), as `peft=lora`.

Each targeted nn.Linear of the model's blocks (`peft.targets`: module-name patterns in the
model's own names, e.g. `*.wq` or `layers.*.attention.*`; a pattern without a dot matches the
last name) keeps its weight, frozen, and gains two small linears beside it: `lora_A` (rank x in)
and `lora_B` (out x rank), so that y = x W^T + b + (alpha / rank) B(A(dropout(x))). Every other
parameter is frozen too: only the adapters train, and only they are in the optimizer. The
adapters sit inside the linear they adapt (`layers.0.attention.wq.lora_A.weight`, PEFT's names
under the module's own), so the strategies see ordinary submodules of the blocks: DDP reduces
only what trains, FSDP shards frozen and trainable parameters in the same units, a pipeline
splits blocks with their adapters, checkpointing and compile wrap them.

A starts normal(0, 1/rank) (PEFT's `init_lora_weights="gaussian"`), B at zero (the adapted model
starts as the base), row-seeded from the run's seed (models/init.py): every layout starts alike.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

import torch
from omegaconf import DictConfig
from torch import nn

from models.init import fill_

ADAPTERS = (".lora_A.", ".lora_B.")


class LoRALinear(nn.Linear):
    """An nn.Linear with a low-rank update beside its weight (made by `adapt`, not built)."""

    lora_A: nn.Linear
    lora_B: nn.Linear
    lora_dropout: nn.Module
    scaling: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling


def is_adapter(name: str) -> bool:
    return any(part in f".{name}" for part in ADAPTERS)


def enabled(cfg: DictConfig | None) -> bool:
    return cfg is not None and cfg.get("name", "none") != "none"


def targets_of(model: nn.Module, blocks: str | None, patterns: list[str]) -> list[str]:
    """The names of the nn.Linear modules inside the blocks that a pattern matches."""
    prefix = f"{blocks}." if blocks else ""
    names = [n for n, m in model.named_modules()
             if type(m) in (nn.Linear, LoRALinear) and n.startswith(prefix) and not n.endswith(("lora_A", "lora_B"))]  # fmt: skip
    return [n for n in names if any(fnmatchcase(n if "." in p else n.rpartition(".")[2], p) for p in patterns)]


def apply_peft(model: nn.Module, cfg: DictConfig | None, blocks: str | None, seed: int) -> list[str]:
    """Freeze `model` and give each targeted linear its adapters (filled now unless on meta);
    the adapted names. `cfg`: the run's `peft` (none: nothing changes)."""
    if not enabled(cfg):
        return []
    names = targets_of(model, blocks, list(cfg.targets))
    if not names:  # (validate names it first, with the model's linears)
        raise ValueError(f"peft.targets: {list(cfg.targets)} match no linear layer of the blocks")
    model.requires_grad_(False)
    for name in names:
        if type(model.get_submodule(name)) is nn.Linear:  # (not twice)
            adapt(model.get_submodule(name), cfg.rank, cfg.alpha, cfg.dropout)
    init_adapters(model, cfg.rank, seed)
    return names


def adapt(linear: nn.Linear, rank: int, alpha: float, dropout: float) -> None:
    """Turn `linear` into a LoRALinear with fresh (unfilled) adapters on its weight's device."""
    device = linear.weight.device
    linear.lora_A = nn.Linear(linear.in_features, rank, bias=False, device=device)
    linear.lora_B = nn.Linear(rank, linear.out_features, bias=False, device=device)
    linear.lora_dropout = nn.Dropout(dropout) if dropout else nn.Identity()
    linear.scaling = alpha / rank
    linear.__class__ = LoRALinear


def adapter_rule(name: str, rank: int) -> tuple[str, float]:
    return ("zeros", 0.0) if ".lora_B." in f".{name}" else ("normal", 1.0 / rank)


@torch.no_grad()
def init_adapters(model: nn.Module, rank: int, seed: int) -> None:
    """Fill every adapter parameter that has storage (this rank's shard of a sharded one) as
    the whole single-process model's: row-seeded by name (models/init.py)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from framework.contract import canonical_name

    for name, p in model.named_parameters():
        name = canonical_name(name)
        if not is_adapter(name) or p.is_meta:
            continue
        if isinstance(p, DTensor):
            _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
            fill_(p.to_local(), adapter_rule(name, rank), seed, name, p.shape, offset)
        else:
            fill_(p, adapter_rule(name, rank), seed, name)


def describe(model: nn.Module, cfg: DictConfig) -> str:
    """The console's line of what trains under the adapters (counted on the unwrapped model)."""
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return (f"peft: LoRA rank {cfg.rank} (alpha {cfg.alpha:g}) on {list(cfg.targets)}: {trainable:,} trainable "
            f"parameters of {total:,} ({trainable / max(total, 1):.2%})")  # fmt: skip
