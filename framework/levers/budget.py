"""Budgeted checkpointing (`memory=budget`, compile=true): each compiled block keeps
`memory.activation_budget` of the activations the compiler would keep beyond the block's input,
and recomputes the rest in backward. The choice is the compiler's: AOTAutograd's min-cut
partitioner solves a knapsack over what it may recompute, keeping the outputs that cost most
FLOPs to recompute (matmuls, attention) within the budget, and the cheap elementwise work never.
0 would be full checkpointing and 1 what compile keeps alone.

The budget is torch's partitioner setting (`torch._functorch.config.activation_memory_budget`,
what torchtitan's `memory_budget` mode sets for the whole process), held here only around each
block's compiled call, where the compilation happens: the run's other compiled code and other
runs in the same process keep their own.
"""

from __future__ import annotations

from typing import Any

import torch._functorch.config
from torch import nn


def budget_compiled(module: nn.Module, budget: float) -> None:
    """Compile `module` (nn.Module.compile: its type and parameter names stay) with the partitioner
    keeping `budget` of its activations."""
    module.compile()
    compiled = module._compiled_call_impl  # what nn.Module.__call__ runs once compiled

    def call(*args: Any, **kwargs: Any) -> Any:
        with torch._functorch.config.patch(activation_memory_budget=budget):
            return compiled(*args, **kwargs)

    module._compiled_call_impl = call
