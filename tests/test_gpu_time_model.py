"""The planner's GPU time model (framework/plan/gpu.py): matmuls at the part's measured best rate
with tile and wave quantization, memory-bound work at HBM's achievable rate, links placed on
nodes by the mesh, and `plan.gpu` from any machine; and Megatron-LM's published rows
(benchmarks/plan_megatron.py) within 15%. No GPU, no workers: the planner is a pure function."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from framework.config import ConfigError
from framework.plan.gpu import HBM_SHARE, NIC_SHARE, NVLINK_SHARE, SPECS, GpuKernels
from framework.plan.profile import machine_profile
from framework.plan.timing import comm_seconds
from tests.helpers import compose_config

A100 = GpuKernels(SPECS["A100"], 312e12)


def test_a_matmul_that_fills_whole_waves_of_whole_tiles_runs_at_the_measured_best_rate():
    m, n, k = 256 * 108, 128 * 4, 8192  # 432 tiles of 256 x 128: four full waves over 108 SMs
    seconds = A100.matmul_s(m, k, n)
    assert 2 * m * k * n / seconds == pytest.approx(267.9e12, rel=1e-12)


def test_one_tile_past_a_wave_costs_a_whole_wave_more():
    """108 tiles run in one wave; 112 take two: twice the time for 0.01% more work."""
    full = A100.matmul_s(256 * 27, 8192, 128 * 4)
    over = A100.matmul_s(256 * 27 + 1, 8192, 128 * 4)
    assert over / full == pytest.approx(2.0, rel=1e-12)


def test_a_partial_tile_costs_a_whole_one_and_few_tiles_split_their_reduction():
    whole = A100.matmul_s(256 * 27, 8192, 128 * 4)
    assert A100.matmul_s(256 * 27 - 200, 8192, 128 * 4) == pytest.approx(whole, rel=1e-12)  # the same tiles
    # 27 tiles (3 x 9) over a 4x deeper reduction: split-K 4 ways fills the 108 SMs (the time of
    # 108 tiles of a quarter of the depth), instead of leaving three quarters of them idle
    assert A100.matmul_s(256 * 3, 8192 * 4, 128 * 9) == pytest.approx(whole, rel=1e-12)


def test_a_matmul_whose_operands_outweigh_its_flops_is_bound_by_hbm():
    m, k, n = 256, 65536, 128  # one output tile, split-K 108 ways: 16 us of FLOPs, 28 us of operands
    assert A100.matmul_s(m, k, n) == pytest.approx(2 * (m * k + k * n + m * n) / (2.039e12 * HBM_SHARE))
    assert A100.bytes_per_s == A100.math_bytes_per_s == pytest.approx(2.039e12 * 0.88)
    assert A100.optimizer_s_per_param == pytest.approx(44 / (2.039e12 * 0.88))


def test_the_input_and_weight_gradients_are_tiled_by_their_own_outputs():
    """x (256, 12288) by w (1536, 12288): the forward's (256, 1536) output is 12 tiles, split-K'd
    9 ways into one full wave; the weight's gradient is a (1536, 12288) output of 576 tiles over the
    256 tokens, 6 waves of which the last is a third idle (648 tile-slots for 576)."""
    m, k, n = 256, 12288, 1536
    forward, weight_grad = A100.matmul_s(m, k, n), A100.matmul_s(m, k, n, "weight_grad")
    assert weight_grad == pytest.approx(forward * 648 / 576, rel=1e-12)
    assert A100.matmul_s(m, k, n, "input_grad") == pytest.approx(A100.matmul_s(m, n, k))


def test_groups_are_placed_on_nodes_by_their_stride_on_the_mesh():
    """8 GPUs a node, tp innermost: a tp group of 8 stays on NVLink; a data-parallel group of 4
    ranks 8 apart has one member on each of 4 nodes and crosses at one NIC's rate; a group of 16
    neighbours spans 2 nodes with 8 members on each, whose rings cross over 8 NICs at once."""
    cfg = compose_config(["plan.gpu=A100", "plan.nodes=4"])
    profile = machine_profile(cfg, 32)
    nvlink, nic = 300e9 * NVLINK_SHARE, 25e9 * NIC_SHARE
    assert (profile.intra_bytes_per_s, profile.inter_bytes_per_s) == (pytest.approx(nvlink), pytest.approx(nic))
    wire = 1e9
    base, (step_in, step_out) = profile.latency_s, profile.step_latency_s
    assert comm_seconds(profile, ("tp:all_reduce", 1, wire, 8, "model", 1), 8) == pytest.approx(
        base + 2 * 3 * step_in + wire / nvlink  # a tree of 8 (3 levels up and down) beats a ring of 14 steps
    )
    assert comm_seconds(profile, ("all_gather", 1, wire, 4, "dp", 8), 8) == pytest.approx(
        base + 3 * step_out + wire / nic
    )
    assert comm_seconds(profile, ("reduce_scatter", 1, wire, 16, "dp", 1), 8) == pytest.approx(
        base + 14 * step_in + 1 * step_out + wire / min(nvlink, 8 * nic)
    )
    assert comm_seconds(profile, ("send", 1, wire, 2, "model", 8), 8) == pytest.approx(base + step_out + wire / nic)


def test_plan_gpu_prices_from_the_datasheet_on_any_machine_and_names_an_unknown_part():
    cfg = compose_config(["model=gpt", "plan.gpu=H100", "precision=bf16"])
    profile = machine_profile(cfg, 8)
    assert profile.peak_flops == 989e12 and isinstance(profile.kernels, GpuKernels)
    assert profile.kernels.matmul_flops == pytest.approx(792.1e12)
    assert profile.sources["kernels"] == "datasheet" and profile.baseline_bytes == 0
    with pytest.raises(ConfigError, match=r"plan\.gpu: 'B300' .*A100, H100, H200"):
        machine_profile(compose_config(["plan.gpu=B300"]), 8)


def test_megatrons_published_rows_are_forecast_within_15_percent():
    """Narayanan et al. (SC'21) Tables 1 and 2, as benchmarks/plan_megatron.py plans them on the
    A100 cluster's published figures: every row and schedule within 15% of the paper's TFLOP/s
    per GPU (at the datasheet peak, 1.3-1.6 times it: docs/results/plan_megatron.md)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from plan_megatron import plan_rows

    rows, _ = plan_rows(with_peak=False)
    assert len(rows) == 8
    for row in rows:
        forecast, paper = row[-3], row[-2]
        assert abs(forecast / paper - 1) <= 0.15, row
        assert math.isfinite(row[6]) and row[6] < 80, row  # fits an 80 GB A100


def test_the_parts_plan_gpu_accepts_are_the_parts_the_time_model_holds():
    """validate checks plan.gpu against the datasheet's list (below the planner's layer); the list
    and the time model's table are the same parts, and a CUDA device name of one is taken."""
    from framework.measure.datasheet import PLANNED_PARTS, is_planned_part

    assert set(PLANNED_PARTS) == set(SPECS)
    assert all(map(is_planned_part, ("A100", "NVIDIA H100 80GB HBM3", "NVIDIA H200")))
    assert not any(map(is_planned_part, ("Z100", "NVIDIA H100 PCIe", "L4")))
