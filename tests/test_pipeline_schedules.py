"""Pipelines past one shape and one backward: a compiled block under a zero-bubble schedule's split
backward (input gradients, then weight gradients: torch.distributed.pipelining's
stage_backward_input and stage_backward_weight) gives eager's gradients; a step whose batch or
sequence length changes (data.batch_schedule, data.seq_len_schedule) rebuilds the schedule for
the new micro-batch shape and trains as one process does; context parallel's zigzag split and
ring follow the length too."""

from __future__ import annotations

import pytest
import torch
import torch._functorch.config
import torch._inductor.config
from omegaconf import OmegaConf
from torch import nn
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from framework.config import ConfigError, validate
from framework.levers import compile_block
from framework.run.sweep import run_configs
from tests.helpers import compose_config, losses, world_config

# 4 samples of 8 tokens a step, 8 samples from step 3 (index 2), 16 tokens from step 4: each
# change makes the micro-batches of another shape
RAMP = ["experiment=smoke", "logger=none", "steps=4", "model.n_layer=4", "data.batch_schedule=[[0,4],[2,8]]",
        "data.seq_len_schedule=[[0,8],[3,16]]", "metrics.sample_every=0"]  # fmt: skip
LAYOUTS = {"1F1B": ["parallel=pp"], "ZBVZeroBubble": ["parallel=pp", "parallel.schedule=ZBVZeroBubble"],
           "cp": ["parallel=cp"]}  # fmt: skip


def test_a_pipeline_and_context_parallel_follow_a_batch_and_a_length_ramp_as_one_process(tmp_path):
    """The schedule is built anew where the batch or the length changes (it was refused: torch's
    stages keep the shape of their first step), and cp x2 splits each step's length in 2 x cp
    chunks (it was refused too); the losses are one process's."""
    from framework.run.trainer import run

    one = tmp_path / "one"
    run(OmegaConf.create(world_config([*RAMP, "parallel=none"], 1)), str(one), {"parallel": "none"})
    summaries = run_configs({name: world_config([*RAMP, *args], 2) for name, args in LAYOUTS.items()}, 2,
                            str(tmp_path))  # fmt: skip
    assert set(summaries) == set(LAYOUTS)
    for name in LAYOUTS:
        assert losses(tmp_path / name) == pytest.approx(losses(one), rel=1e-5), name


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
@torch._inductor.config.patch(inplace_buffers=True)
def test_donated_buffers_only_where_backward_splits(schedule):
    cfg = OmegaConf.create({"memory": {"name": "none"}, "parallel": {"pp": 2, "schedule": schedule}})
    compile_block(nn.Linear(2, 2), cfg)
    assert torch._functorch.config.donated_buffer == (schedule == "1F1B")
    assert torch._inductor.config.inplace_buffers == (schedule == "1F1B")


def test_a_ramp_that_does_not_split_into_the_micro_batches_is_refused():
    """6 samples do not split into pp's 4 micro-batches: one line naming the key, before any worker."""
    args = ["experiment=smoke", "parallel=pp", "launch.nproc_per_node=2", "data.batch_schedule=[[0,4],[2,6]]"]
    with pytest.raises(ConfigError) as err:
        validate(compose_config(args))
    assert err.value.key == "data.batch_schedule" and "parallel.n_microbatches" in str(err.value), str(err.value)


def test_a_length_that_does_not_split_into_cp_chunks_is_refused():
    """6 tokens do not cut into cp=2's 4 zigzag chunks: one line naming the key and the multiple."""
    args = ["experiment=smoke", "parallel=cp", "launch.nproc_per_node=2", "data.seq_len_schedule=[[0,6],[2,16]]"]
    with pytest.raises(ConfigError) as err:
        validate(compose_config(args))
    assert err.value.key == "data.seq_len_schedule" and "multiple of 4 (2 x cp=4)" in str(err.value), str(err.value)
