"""Memory levers, each with its own config (conf/memory/): checkpointing every k-th block (here),
selective checkpointing (selective.py), activation offload (offload.py) and the compiler's activation
budget (budget.py). parallelize() applies the run's lever at one point of its order, where
checkpointing goes, and compiles each block through compile_block."""

from __future__ import annotations

from omegaconf import DictConfig
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

from framework.modules import map_blocks


def apply_activation_checkpointing(model: nn.Module, blocks: str | None, every: int = 1) -> int:
    """Recompute every `every`-th block (the container at path `blocks`) in backward instead of
    keeping its activations: non-reentrant torch.utils.checkpoint. Returns how many were wrapped."""
    wrap = lambda b: checkpoint_wrapper(b, checkpoint_impl=CheckpointImpl.NO_REENTRANT)  # noqa: E731
    try:
        return map_blocks(model, blocks, wrap, every)
    except ValueError as err:
        raise ValueError(f"memory=checkpoint: {err} to checkpoint") from None


def apply_memory_lever(module: nn.Module, blocks: str | None, cfg: DictConfig) -> None:
    """The run's `memory` choice on its blocks, in place, before compile (parallelize's step 3)."""
    name = cfg.memory.name
    if name == "checkpoint":
        apply_activation_checkpointing(module, blocks, cfg.memory.checkpoint_every)
    elif name == "selective":
        from framework.levers.selective import apply_selective_checkpointing

        apply_selective_checkpointing(module, blocks, cfg.memory, cfg.compile)
    elif name == "offload_activations":
        from framework.levers.offload import apply_activation_offload

        apply_activation_offload(module, blocks)


def compile_block(module: nn.Module, cfg: DictConfig) -> nn.Module:
    """torch.compile of one block (or a whole model without blocks) in place: `nn.Module.compile`,
    so its type and parameter names stay (FSDP units, state dicts, checkpoints); under
    memory=budget with the partitioner's activation budget (budget.py).

    A zero-bubble pipeline schedule splits each backward into the input gradients (autograd.grad,
    the graph kept) and the weight gradients later (torch.distributed.pipelining's
    stage_backward_input, stage_backward_weight): a compiled block's backward is one autograd
    node, which both run. AOTAutograd donates that node's saved buffers to its first run, and so
    refuses a kept graph (pytorch/pytorch#161904); and Inductor writes a kernel's output over an
    input buffer it reads last (`inplace_buffers`), which the weight pass, running the same
    backward again, would read overwritten (the tied Llama's losses moved 2.6e-4 from one
    process's by step 2). Under those schedules neither, for the whole process (the backward
    compiles and runs outside the block's call): the weight pass gets the same gradients, for a
    backward's compute more."""
    import torch._functorch.config
    import torch._inductor.config  # here, not at the top: it imports torch._dynamo (a second of start-up)

    splits = splits_backward(cfg)  # set anew by each run's compile
    torch._functorch.config.donated_buffer = not splits
    torch._inductor.config.inplace_buffers = not splits
    if cfg.memory.name == "budget":
        from framework.levers.budget import budget_compiled

        budget_compiled(module, cfg.memory.activation_budget)
    else:
        module.compile()
    return module


def splits_backward(cfg: DictConfig) -> bool:
    """The run's pipeline schedule computes input and weight gradients apart (the zero-bubble ones)."""
    p = cfg.get("parallel") or {}
    return p.get("pp", 1) != 1 and "ZeroBubble" in str(p.get("schedule", "1F1B"))
