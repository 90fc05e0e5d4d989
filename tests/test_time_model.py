"""The planner's time model, piece by piece, on figures the tests set (no probe, no workers):
what a trace charges bytes for, which matmul grid each backward matmul reads, the in-situ factor
and each collective's own bandwidth."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from torch.nn import functional as F

from framework.plan import predict
from framework.plan.kernels import GRID_M, GRID_S, ORIENTATIONS, Kernels
from framework.plan.model import layout_of
from framework.plan.ops import Region, byte_kind, elementwise_bytes
from framework.plan.predict import forward_trace, meta_model, model_dims_of, model_spec, shapes_of
from framework.plan.profile import machine_profile
from framework.plan.timing import _region_s, compute_s
from tests.helpers import compose_config

LINK = ["plan.latency_us=100", "plan.intra_node_gbps=1"]


def kernels(rate: dict[str, float] | None = None, **figures) -> Kernels:
    """A flat machine: every matmul at `rate[orientation]` FLOP/s (1 GFLOP/s unless set)."""
    rate = {"forward": 1e9, "input_grad": 1e9, "weight_grad": 1e9} | (rate or {})
    gemm = {o: tuple((m, s, 2 * m * s * s / rate[o]) for m in GRID_M for s in GRID_S) for o in ORIENTATIONS}
    return Kernels(gemm, **({"bytes_per_s": 1e9, "optimizer_s_per_param": 0.0, "math_bytes_per_s": 1e8} | figures))


def test_a_view_moves_no_bytes_and_math_bound_operators_are_priced_apart():
    x = torch.randn(64, 32)
    nbytes = x.numel() * x.element_size()
    assert byte_kind(torch.ops.aten.t.default) is None and byte_kind(torch.ops.aten._unsafe_view.default) is None
    assert elementwise_bytes(lambda: x.t().reshape(32, 64).unsqueeze(0)) == {"memory": 0, "math": 0}
    assert elementwise_bytes(lambda: x + x) == {"memory": 3 * nbytes, "math": 0}  # two inputs, one output
    assert elementwise_bytes(lambda: F.gelu(x)) == {"memory": 0, "math": 2 * nbytes}
    # a region's seconds: memory-bound bytes at 1 GB/s, math-bound at 0.1 GB/s, forward and backward alike
    region = Region(bytes=1e6, math_bytes=1e6)
    layout = SimpleNamespace(tp=1, cp=1, sequence_parallel=False, fsdp=0)
    seconds = _region_s(region, "replicated", layout, kernels(), SimpleNamespace(op_overhead_s=0.0))
    assert seconds == pytest.approx((1e-3 + 1e-2) * 3)  # forward + BACKWARD_BYTES (2) x forward


def test_each_backward_matmul_reads_its_own_orientations_grid():
    """A CPU without bf16 units runs the input's gradient ten times slower than the forward: the
    step's backward is priced by that grid, not by the forward's shape transposed."""
    region = Region(matmuls=[(512, 256, 1024, None, None)])  # (m, k, n, weight, formats: a converter's)
    layout = SimpleNamespace(tp=1, cp=1, sequence_parallel=False, fsdp=0)
    overhead = SimpleNamespace(op_overhead_s=0.0)
    flops = 2 * 512 * 256 * 1024
    even = _region_s(region, "replicated", layout, kernels(), overhead)
    slow = _region_s(region, "replicated", layout, kernels({"input_grad": 1e8}), overhead)
    assert even == pytest.approx(3 * flops / 1e9)
    assert slow == pytest.approx(2 * flops / 1e9 + flops / 1e8)


def test_the_in_situ_factor_scales_every_ranks_arithmetic():
    cfg = compose_config(["experiment=smoke", "model.n_layer=2", *LINK, "device=cpu"])
    profile = machine_profile(cfg, 2, "config")
    layout = layout_of(cfg.parallel, 2, *model_dims_of(cfg))
    model, spec = meta_model(cfg), model_spec(cfg)
    traced, shapes = forward_trace(cfg, layout, model, spec), shapes_of(cfg, layout)
    plain = dataclasses.replace(profile, kernels=kernels(optimizer_s_per_param=1e-8))
    doubled = dataclasses.replace(plain, kernels=dataclasses.replace(plain.kernels, in_situ=2.0))
    one, two = compute_s(cfg, layout, shapes, plain, traced), compute_s(cfg, layout, shapes, doubled, traced)
    assert one[0] > 0 and two == pytest.approx((2 * one[0], 2 * one[1]))


def test_each_collective_is_priced_at_its_own_bandwidth():
    """gloo's reduce-scatter runs at a fifth of its all-reduce's rate here: FSDP's step pays for
    its reduce-scatters at that rate, DDP's all-reduces at theirs."""
    cfg = compose_config(["experiment=smoke", "model.n_layer=2", *LINK, "device=cpu", "parallel=fsdp"])
    profile = machine_profile(cfg, 2, "config")
    slow = dataclasses.replace(profile, op_bytes_per_s={"reduce_scatter": profile.intra_bytes_per_s / 5})
    assert slow.bandwidth_of("fsdp:reduce_scatter") == profile.intra_bytes_per_s / 5
    assert slow.bandwidth_of("all_reduce") == profile.intra_bytes_per_s  # unprobed: the link's
    assert slow.bandwidth_of("fsdp:reduce_scatter", spans_nodes=True) == profile.inter_bytes_per_s
    fast_s, slow_s = (predict(cfg, 2, p) for p in (profile, slow))
    reduce_scatter = fast_s["comm"]["by_op"]["reduce_scatter"]["bytes"] / 2  # wire: (n-1)/n of the payload
    extra = reduce_scatter * (5 - 1) / profile.intra_bytes_per_s
    assert slow_s["comm_time_s"] - fast_s["comm_time_s"] == pytest.approx(extra, rel=1e-6)
