"""The optimizer step in backward (`optim.in_backward=true`): each parameter is updated as soon
as its gradient is ready (a post-accumulate-grad hook, after FSDP's reduce-scatter for a sharded
one), and its gradient freed at once, so a rank never holds more than the gradients of the
parameters whose backward is running: about one block's, not the model's.

`InBackwardOptimizer` is what the run sees as its optimizer: the param groups the scheduler
sets the learning rate in, the state checkpoints save and load (shared with the one-parameter
optimizers that step in the hooks), and a `step` with nothing left to do. It adds up the squares
of the gradients as it frees them and reports their norm (`applied_grad_norm`, which the run asks
any optimizer whose update has already run for).

Exact where the update does not wait for the whole gradient: no clipping (it needs the global
norm first), no accumulation (the update would run on the first micro-batch's gradients), no
pipeline (a stage's backward runs micro-batch by micro-batch), and one process or FSDP (DDP
reduces gradients in buckets after the hook; tensor parallel's replicated gradients are partial).
The checks are config/memory_checks.py's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist


class InBackwardOptimizer(torch.optim.Optimizer):
    """One `make([group])` optimizer per parameter, stepped in that parameter's gradient hook."""

    def __init__(self, groups: list[dict], make: Callable[[list[dict]], torch.optim.Optimizer]):
        template = make(groups)
        super().__init__(template.param_groups, template.defaults)
        self._squares: torch.Tensor | None = None
        self._each: dict[torch.Tensor, tuple[int, torch.optim.Optimizer]] = {}
        for index, group in enumerate(self.param_groups):
            settings = {k: v for k, v in group.items() if k != "params"}
            for param in group["params"]:
                one = make([{**settings, "params": [param]}])
                one.state = self.state  # one state for all: what checkpoints save and load
                self._each[param] = (index, one)
                param.register_post_accumulate_grad_hook(self._step_one)

    @torch.no_grad()
    def _step_one(self, param: torch.Tensor) -> None:
        index, one = self._each[param]
        one.param_groups[0]["lr"] = self.param_groups[index]["lr"]  # the scheduler's, this step
        grad = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad
        square = grad.float().pow(2).sum()
        self._squares = square if self._squares is None else self._squares + square
        one.step()
        param.grad = None

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ARG002
        """The updates ran in backward. A gradient set by hand is stepped here: torch's checkpoint
        loading creates the state to load into with zero gradients at lr 0."""
        for param, (index, one) in self._each.items():
            if param.grad is not None:
                one.param_groups[0]["lr"] = self.param_groups[index]["lr"]
                one.step()

    def applied_grad_norm(self) -> torch.Tensor:
        """The global norm of the gradients this step applied and freed (sharded ones summed over
        the ranks): what the run reports as the step's gradient norm (framework.run.step)."""
        squares, self._squares = self._squares, None
        if squares is None:
            return torch.zeros(())
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(squares)
        return squares.sqrt()

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        for _, one in self._each.values():
            one.state = self.state  # loading replaced the state object
