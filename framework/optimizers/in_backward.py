"""The optimizer step in backward (`optim.in_backward=true`): each parameter is updated as soon
as its gradient is whole, and its gradient freed at once, so a rank never holds more than the
gradients of the parameters whose backward is running: about one block's, not the model's.

When a gradient is whole depends on the layout (`layout`: the run's framework.parallel.apply.Parallelized):
- one process, FSDP (and FSDP over dp x cp, HSDP): a post-accumulate-grad hook, which FSDP runs
  after its reduce-scatter;
- tensor parallel: the same hook, a partial gradient (a sequence-parallel norm's weight) first
  reduced over tp into the parameter's own layout;
- DDP: a communication hook, after each bucket's all-reduce (as torch's own
  `_apply_optimizer_in_backward` does with DDP); DDP's buckets hold every gradient, so the step
  moves into backward but frees nothing;
- a pipeline: every micro-batch adds to a stage's gradients, and the schedule scales them (and
  reduces them over dp, syncs tied copies) after its last backward, so they are whole only when the
  schedule ends: the updates run then (`applied_grad_norm`), and free nothing early either.
Where nothing is freed early the gradients stay until the run's `zero_grad`, as without the step
in backward (so the run measures the memory they held), and `step` leaves them alone.

`InBackwardOptimizer` is what the run sees as its optimizer: the param groups the scheduler
sets the learning rate in, the state checkpoints save and load (shared with the one-parameter
optimizers that step in the hooks), and a `step` with nothing left to do. It adds up the squares
of the gradients as it frees them and reports their norm (`applied_grad_norm`, which the run asks
any optimizer whose update has already run for).

Exact where the update does not wait for the whole gradient: no clipping (it needs the global
norm first), no accumulation (the update would run on the first micro-batch's gradients). The
checks are config/memory_checks.py's.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel


class InBackwardOptimizer(torch.optim.Optimizer):
    """One `make([group])` optimizer per parameter, stepped when that parameter's gradient is whole."""

    def __init__(self, groups: list[dict], make: Callable[[list[dict]], torch.optim.Optimizer], layout=None):
        template = make(groups)
        super().__init__(template.param_groups, template.defaults)
        self._squares: torch.Tensor | None = None
        self._each: dict[torch.Tensor, tuple[int, torch.optim.Optimizer]] = {}
        self._stepped: set[torch.Tensor] = set()  # updated this step, their gradients kept (DDP, pipeline)
        self._layout = layout
        for index, group in enumerate(self.param_groups):
            settings = {k: v for k, v in group.items() if k != "params"}
            for param in group["params"]:
                one = make([{**settings, "params": [param]}])
                one.state = self.state  # one state for all: what checkpoints save and load
                self._each[param] = (index, one)
        module = getattr(layout, "module", None)
        if getattr(layout, "pipeline", None) is not None:
            return  # whole when the schedule ends: applied_grad_norm steps them
        if isinstance(module, DistributedDataParallel):
            if (compressed := getattr(module, "reduce_then", None)) is not None:  # framework/parallel/ddp.py
                compressed.after = self._step_bucket
            else:
                module.register_comm_hook(module.process_group, self._bucket_reduced)
            return
        for param in self._each:
            param.register_post_accumulate_grad_hook(lambda p: self._apply(p, p.grad))

    @torch.no_grad()
    def _apply(self, param: torch.Tensor, grad: torch.Tensor, free: bool = True) -> None:
        """Step `param` on its whole gradient `grad`, then free it (or keep it till zero_grad)."""
        index, one = self._each[param]
        one.param_groups[0]["lr"] = self.param_groups[index]["lr"]  # the scheduler's, this step
        if any(p.is_partial() for p in getattr(grad, "placements", ())):  # tp: a sum over its ranks
            grad = grad.redistribute(grad.device_mesh, param.placements)
        param.grad = grad
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        square = local.float().pow(2).sum() / _holders(grad)
        self._squares = square if self._squares is None else self._squares + square
        one.step()
        if free:
            param.grad = None
        else:
            self._stepped.add(param)

    def _bucket_reduced(self, group, bucket):  # unannotated: DDP checks a string annotation against its type
        """DDP's communication hook: the bucket (a dist.GradBucket) averaged over the ranks (torch's
        default hook), then its parameters stepped on it, in the backward's thread (their
        gradients: views of the bucket, which DDP keeps anyway)."""
        default_hooks.allreduce_hook(group, bucket).wait()
        self._step_bucket(bucket)
        done = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done

    def _step_bucket(self, bucket) -> None:
        """Each of a reduced DDP bucket's parameters stepped on its gradient there."""
        for param, grad in zip(bucket.parameters(), bucket.gradients(), strict=True):
            if param in self._each:
                self._apply(param, grad, free=False)

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ARG002
        """The updates ran in backward. A gradient set by hand is stepped here: torch's checkpoint
        loading creates the state to load into with zero gradients at lr 0."""
        for param, (index, one) in self._each.items():
            if param.grad is not None and param not in self._stepped:
                one.param_groups[0]["lr"] = self.param_groups[index]["lr"]
                one.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self._stepped.clear()

    @torch.no_grad()
    def applied_grad_norm(self) -> torch.Tensor:
        """After backward: the updates still waiting (a pipeline's, on the gradients its schedule
        left: tied copies summed, partial ones reduced, by the layout's norm), then the global norm
        of every gradient this step applied (each counted once over the ranks that hold it): what
        the run reports as the step's gradient norm (framework.run.step)."""
        held = self._step_held()
        squares, self._squares = self._squares, None
        if squares is None:
            return held if held is not None else torch.zeros(())
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(squares)
        return squares.sqrt() if held is None else (squares + held.pow(2)).sqrt()

    def _step_held(self) -> torch.Tensor | None:
        """A pipeline's updates, once its schedule has made the gradients whole; their norm."""
        if getattr(self._layout, "pipeline", None) is None:
            return None
        norm = self._layout.clip_grad_norm(math.inf)  # syncs tied copies, reduces partial sums
        for param, (index, one) in self._each.items():
            if param.grad is not None:
                one.param_groups[0]["lr"] = self.param_groups[index]["lr"]
                one.step()
                self._stepped.add(param)
        return norm

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        for _, one in self._each.values():
            one.state = self.state  # loading replaced the state object


def _holders(grad: torch.Tensor) -> int:
    """How many ranks hold each element of `grad`: a DTensor's replicated mesh axes and the ranks
    outside its mesh (its copies on other ranks); a plain tensor: every rank (one process, DDP)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    mesh = getattr(grad, "device_mesh", None)
    if mesh is None:
        return world
    replicated = math.prod(mesh.size(i) for i, pl in enumerate(grad.placements) if pl.is_replicate())
    return replicated * world // mesh.size()
