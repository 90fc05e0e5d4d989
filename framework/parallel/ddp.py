"""DistributedDataParallel: a full replica per rank, gradients all-reduced in buckets that overlap
with the backward pass. Optional communication hooks compress gradients before the all-reduce."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from framework.contract import step_buffers
from framework.dist import DistInfo


def apply_ddp(model: nn.Module, cfg: DictConfig, info: DistInfo) -> DDP:
    # Newer torch renames broadcast_buffers (syncing buffers such as BatchNorm statistics from
    # rank 0 before each forward) to forward_sync_buffers; same knob.
    buffers_kw = (
        "forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DDP).parameters else "broadcast_buffers"
    )
    # device_ids=None, CUDA too (a single-device module's documented choice): DDP then leaves the
    # inputs where the data pipeline put them; with ids it would copy host-side inputs (an LSTM's
    # lengths) back to the GPU, and the model's read of them would be a host sync per micro-batch.
    # buffers every rank keeps identical itself (the step protocol's, updated from the step's reduced
    # totals: framework/contract.py): not DDP's to broadcast before each forward, a collective a step
    DDP._set_params_and_buffers_to_ignore_for_model(model, step_buffers(model))
    ddp = DDP(
        model,
        device_ids=None,
        bucket_cap_mb=cfg.bucket_cap_mb,
        gradient_as_bucket_view=cfg.gradient_as_bucket_view,
        static_graph=cfg.static_graph,
        find_unused_parameters=cfg.find_unused_parameters,
        **{buffers_kw: cfg.broadcast_buffers},
    )
    state, reduce = dist.group.WORLD, None
    if cfg.comm_hook == "fp16":
        reduce = default_hooks.fp16_compress_hook
    elif cfg.comm_hook == "bf16":
        reduce = default_hooks.bf16_compress_hook
    elif cfg.comm_hook == "powersgd":
        # Low-rank gradient compression with error feedback; plain all-reduce for the first steps.
        state = powerSGD_hook.PowerSGDState(
            process_group=dist.group.WORLD,
            matrix_approximation_rank=cfg.powersgd_rank,
            start_powerSGD_iter=2,
        )
        reduce = powerSGD_hook.powerSGD_hook
    if reduce is not None:
        ddp.reduce_then = ReduceThen(reduce)  # what the step in backward extends (framework/optimizers/in_backward.py)
        ddp.register_comm_hook(state, ddp.reduce_then)
    return ddp


class ReduceThen:
    """A communication hook: `reduce` (a compression hook), then, where the step in backward set
    `after` (framework/optimizers/in_backward.py), `after(bucket)` on the reduced bucket, in the backward's
    thread (DDP allows one hook per module: the compression and the step share it)."""

    def __init__(self, reduce: Callable):
        self.reduce, self.after = reduce, None
        self.__name__ = self.__qualname__ = reduce.__name__  # DDP's logger names the hook

    def __call__(self, state, bucket):  # unannotated: DDP checks a string annotation against its type
        reduced = self.reduce(state, bucket)
        if self.after is None:
            return reduced
        buffer = bucket.buffer()
        value = reduced.wait()
        if value.data_ptr() != buffer.data_ptr():
            buffer.copy_(value)
        self.after(bucket)
        done = torch.futures.Future()
        done.set_result(buffer)
        return done
