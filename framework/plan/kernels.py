"""What this machine's kernels cost, probed once per CPU, thread count, dtype and torch version
(a few seconds; cached in ~/.cache/hydradist/links.json beside the link figures):

- matmul seconds on a grid of shapes (M rows by a K x N weight, `F.linear` in the run's compute
  dtype; autocast's casts are operators of the trace, priced by their bytes), interpolated in log
  space for any shape;
- elementwise bytes per second: layer norm, GELU and an add, forward and backward, on a tensor
  the size of a small model's activations, in the compute dtype;
- the optimizer's seconds per parameter: AdamW's step (foreach) with gradient clipping and
  zeroing, over a model's worth of tensors.

On CUDA nothing is probed here: the datasheet's peak at a nominal efficiency prices matmuls
(framework.plan.timing), and the figures below are the CPU's only.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from functools import cached_property

import torch
from torch.nn import functional as F

GRID_M = (32, 128, 512, 2048)
GRID_S = (64, 256, 1024)  # K = N


@dataclass(frozen=True)
class Kernels:
    gemm: tuple[tuple[int, int, float], ...]  # (M, S, seconds) for M x S by S x S
    bytes_per_s: float
    optimizer_s_per_param: float

    def matmul_s(self, m: float, k: float, n: float) -> float:
        """Seconds of an (m, k) by (k, n) matmul: the grid's FLOP rate at the nearest shapes
        (bilinear in log M and log sqrt(K·N)), times this one's FLOPs."""
        if m <= 0 or k <= 0 or n <= 0:
            return 0.0
        rate = self._rates
        x = _clamp(math.log2(m), GRID_M)
        y = _clamp(0.5 * math.log2(k * n), GRID_S)
        (m0, m1, fx), (s0, s1, fy) = _bracket(x, GRID_M), _bracket(y, GRID_S)
        log_rate = (
            (1 - fx) * (1 - fy) * math.log(rate[m0, s0])
            + fx * (1 - fy) * math.log(rate[m1, s0])
            + (1 - fx) * fy * math.log(rate[m0, s1])
            + fx * fy * math.log(rate[m1, s1])
        )
        return 2 * m * k * n / math.exp(log_rate)

    @cached_property
    def _rates(self) -> dict[tuple[int, int], float]:
        """FLOP/s at each grid point (computed once: a search prices thousands of matmuls)."""
        return {(gm, gs): 2 * gm * gs * gs / s for gm, gs, s in self.gemm}

    def to_json(self) -> dict:
        return {"gemm": [list(g) for g in self.gemm], "bytes_per_s": self.bytes_per_s,
                "optimizer_s_per_param": self.optimizer_s_per_param}  # fmt: skip

    @classmethod
    def from_json(cls, d: dict) -> Kernels:
        return cls(tuple(tuple(g) for g in d["gemm"]), d["bytes_per_s"], d["optimizer_s_per_param"])


def _clamp(v: float, grid: tuple[int, ...]) -> float:
    return min(max(v, math.log2(grid[0])), math.log2(grid[-1]))


def _bracket(v: float, grid: tuple[int, ...]) -> tuple[int, int, float]:
    logs = [math.log2(g) for g in grid]
    for i in range(len(grid) - 1):
        if v <= logs[i + 1]:
            return grid[i], grid[i + 1], (v - logs[i]) / (logs[i + 1] - logs[i])
    return grid[-2], grid[-1], 1.0


def _median_s(fn, budget_s: float = 0.15, least: int = 3) -> float:
    fn()  # warm-up
    times, start = [], time.perf_counter()
    while len(times) < least or time.perf_counter() - start < budget_s:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if len(times) >= 50:
            break
    return statistics.median(times)


def probe_kernels(dtype: torch.dtype = torch.float32) -> Kernels:
    """Measure the three figures on this process's threads (a few seconds)."""
    gemm = []
    for m in GRID_M:
        for s in GRID_S:
            x, w = torch.randn(m, s, dtype=dtype), torch.randn(s, s, dtype=dtype)
            gemm.append((m, s, _median_s(lambda x=x, w=w: F.linear(x, w))))
    return Kernels(tuple(gemm), _elementwise_bytes_per_s(dtype), _optimizer_s_per_param())


def _elementwise_bytes_per_s(dtype: torch.dtype) -> float:
    """Bytes moved per second by a norm, an activation and a residual add, forward and backward:
    each reads and writes its (4096, 256) tensor once per pass (12 tensors' worth in all)."""
    x = torch.randn(4096, 256, dtype=dtype, requires_grad=True)
    weight = torch.ones(256, dtype=dtype, requires_grad=True)

    def step():
        y = F.gelu(F.layer_norm(x, (256,), weight)) + x
        y.sum().backward()

    return 12 * x.numel() * x.element_size() / _median_s(step)


def _optimizer_s_per_param() -> float:
    params = [torch.nn.Parameter(torch.randn(256, 256)) for _ in range(16)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-4)

    def step():
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()

    return _median_s(step) / sum(p.numel() for p in params)
