"""Pipelines past one shape and one backward: a compiled block under a zero-bubble schedule's split
backward (input gradients, then weight gradients: torch.distributed.pipelining's
stage_backward_input and stage_backward_weight) gives eager's gradients; a step whose batch or
sequence length changes (data.batch_schedule, data.seq_len_schedule) rebuilds the schedule for
the new micro-batch shape and trains as one process does."""

from __future__ import annotations

import pytest
import torch
import torch._functorch.config
from omegaconf import OmegaConf
from torch import nn
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from framework.levers import compile_block


@torch._functorch.config.patch(donated_buffer=True)  # torch's default, restored after the test
def test_compiled_block_splits_its_backward():
    """Compiled as a zero-bubble run compiles it, a block's backward runs whole once (as torch's
    shape inference does in the first step), then as input gradients with the graph kept and
    weight gradients: the same gradients. AOTAutograd's donated buffers (saved intermediates freed
    by a backward compiled for one use) refused the kept graph, so the old compile failed here."""
    cfg = OmegaConf.create({"memory": {"name": "none"}, "parallel": {"pp": 2, "schedule": "ZBVZeroBubble"}})
    torch.manual_seed(0)
    block = compile_block(nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)), cfg)
    x = torch.randn(4, 8)
    whole = x.clone().requires_grad_()
    block(whole).pow(2).sum().backward()
    weights = [p.grad for p in block.parameters()]
    block.zero_grad(set_to_none=True)
    split = x.clone().requires_grad_()
    (grad_input,), groups = stage_backward_input([block(split).pow(2).sum()], None, [split], block.parameters())
    stage_backward_weight(block.parameters(), groups)
    torch.testing.assert_close(grad_input, whole.grad, rtol=0, atol=0)
    for p, grad in zip(block.parameters(), weights, strict=True):
        torch.testing.assert_close(p.grad, grad, rtol=0, atol=0)


@pytest.mark.parametrize("schedule", ["1F1B", "ZBVZeroBubble"])
@torch._functorch.config.patch(donated_buffer=True)
def test_donated_buffers_only_where_backward_splits(schedule):
    cfg = OmegaConf.create({"memory": {"name": "none"}, "parallel": {"pp": 2, "schedule": schedule}})
    compile_block(nn.Linear(2, 2), cfg)
    assert torch._functorch.config.donated_buffer == (schedule == "1F1B")
