"""The `memory` group's schemas: what every choice has, checkpointing every k-th block, selective
checkpointing's operators and the compiler's activation budget (framework/levers/)."""

from __future__ import annotations

from dataclasses import dataclass, field

from framework.config.choices import HostAllocator, MemoryName

__all__ = ["BudgetMemoryConfig", "CheckpointMemoryConfig", "MemoryConfig", "SelectiveMemoryConfig"]


@dataclass
class MemoryConfig:
    """none, offload (FSDP CPU offload: sharded parameters, gradients and optimizer state in CPU
    memory) and what every choice has."""

    name: MemoryName = MemoryName.none
    empty_cache_every: int = 0  # release the accelerator's cached blocks every N steps (0: never)
    # glibc malloc policy (framework.measure.memory.set_host_allocator); auto: lean under fsdp, hybrid and
    # cp, steady elsewhere
    host_allocator: HostAllocator = HostAllocator.auto


@dataclass
class CheckpointMemoryConfig(MemoryConfig):
    """Activation checkpointing around transformer blocks."""

    name: MemoryName = MemoryName.checkpoint
    checkpoint_every: int = 1  # checkpoint every k-th transformer block (1: all of them)


@dataclass
class SelectiveMemoryConfig(CheckpointMemoryConfig):
    """Selective checkpointing (framework/levers/selective.py): in every k-th block, what the named
    operators output is kept and the rest (norms, activations, adds) recomputed in backward."""

    name: MemoryName = MemoryName.selective
    # matmul | attention | collectives, or an aten operator's name (aten.mm)
    save_ops: list[str] = field(default_factory=lambda: ["matmul", "attention"])
    # keep every k-th matmul's output in a block's order (1: all; 2: torchtitan's "op" policy)
    matmul_every: int = 1


@dataclass
class BudgetMemoryConfig(MemoryConfig):
    """Budgeted checkpointing under compile=true (framework/levers/budget.py): the compiler's
    partitioner keeps what it can of each compiled block's activations within the budget and
    recomputes the rest, the cheapest to recompute first."""

    name: MemoryName = MemoryName.budget
    # in (0, 1]: the share of what the compiler keeps beyond each block's input (1: all of it, as
    # compile alone; towards 0: the input only, as checkpointing)
    activation_budget: float = 0.5
