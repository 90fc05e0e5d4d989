"""Memory levers beyond checkpointing whole blocks, each in its own file with its own config
(conf/memory/): selective checkpointing (selective.py) and activation offload (offload.py).
parallelize() applies the run's lever at one point of its order, where checkpointing goes."""

from __future__ import annotations

from omegaconf import DictConfig
from torch import nn

from framework.measure.memory import apply_activation_checkpointing


def apply_memory_lever(module: nn.Module, blocks: str | None, cfg: DictConfig) -> None:
    """The run's `memory` choice on its blocks, in place, before compile (parallelize's step 3)."""
    name = cfg.memory.name
    if name == "checkpoint":
        apply_activation_checkpointing(module, blocks, cfg.memory.checkpoint_every)
    elif name == "selective":
        from framework.levers.selective import apply_selective_checkpointing

        apply_selective_checkpointing(module, blocks, cfg.memory.save_ops, cfg.memory.checkpoint_every, cfg.compile)
    elif name == "offload_activations":
        from framework.levers.offload import apply_activation_offload

        apply_activation_offload(module, blocks)
