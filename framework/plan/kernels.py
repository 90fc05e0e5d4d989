"""What this machine's kernels cost, probed once per CPU, thread count, dtype and torch version
(a few seconds; cached in ~/.cache/hydradist/links.json beside the link figures):

- matmul seconds on a grid of shapes (M rows by a K x N weight, in the run's compute dtype;
  autocast's casts are operators of the trace, priced by their bytes), interpolated in log space
  for any shape, in each of the three orientations a linear layer runs: the forward (`F.linear`,
  the weight transposed), the input's gradient (by the weight as stored) and the weight's (by the
  input transposed). They differ: a CPU without bf16 units runs the input's gradient in bf16
  several times slower than the forward;
- elementwise bytes per second, forward and backward on a tensor the size of a small model's
  activations, in the compute dtype, of two kinds (framework.plan.ops sorts a trace's operators
  alike): memory-bound operators (an add, a scale) and math-bound ones (layer norm and GELU),
  which on a CPU run several times slower per byte;
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
# a linear layer's three matmuls, of its input x (M, K), weight w (N, K) and output's gradient g
# (M, N), each with its operands laid out as autograd has them: the forward x @ w.T, the input's
# gradient g @ w, the weight's gradient g.T @ x. All three are priced by the forward's (M, K, N).
ORIENTATIONS = {
    "forward": lambda x, g, w: F.linear(x, w),
    "input_grad": lambda x, g, w: g @ w,
    "weight_grad": lambda x, g, w: g.t() @ x,
}


@dataclass(frozen=True)
class Kernels:
    gemm: dict[str, tuple[tuple[int, int, float], ...]]  # orientation -> (M, S, seconds) for M x S by S x S
    bytes_per_s: float  # memory-bound elementwise operators
    optimizer_s_per_param: float
    math_bytes_per_s: float  # math-bound ones (norms, activations, softmax)
    in_situ: float = 1.0  # a real step's seconds over the operators' alone (framework.plan.calibrate)

    def matmul_s(self, m: float, k: float, n: float, orientation: str = "forward") -> float:
        """Seconds of an (m, k) by (k, n) matmul in `orientation` (ORIENTATIONS): the grid's FLOP
        rate at the nearest shapes (bilinear in log M and log sqrt(K·N)), times this one's FLOPs."""
        if m <= 0 or k <= 0 or n <= 0:
            return 0.0
        rate = self._rates[orientation]
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

    def attention_s(self, m: float, k: float, n: float) -> float:
        """Seconds of attention's forward for scores of shape (m, n) over head dim k: two matmuls
        of that shape (the scores and their weighted sum)."""
        return 2 * self.matmul_s(m, k, n)

    def format_share(self, fmt: str | None) -> float:
        """A matmul in another format than the compute dtype's ("fp8"): a CPU has no units for
        one, so it is emulated at the compute dtype's rate (its casts are priced apart)."""
        return 1.0

    @cached_property
    def _rates(self) -> dict[str, dict[tuple[int, int], float]]:
        """FLOP/s at each grid point (computed once: a search prices thousands of matmuls)."""
        return {o: {(gm, gs): 2 * gm * gs * gs / s for gm, gs, s in grid} for o, grid in self.gemm.items()}

    def to_json(self) -> dict:
        return {"gemm": {o: [list(g) for g in grid] for o, grid in self.gemm.items()}, "bytes_per_s": self.bytes_per_s,
                "optimizer_s_per_param": self.optimizer_s_per_param, "math_bytes_per_s": self.math_bytes_per_s,
                "in_situ": self.in_situ}  # fmt: skip

    @classmethod
    def from_json(cls, d: dict) -> Kernels:
        gemm = {o: tuple(tuple(g) for g in grid) for o, grid in d["gemm"].items()}
        return cls(gemm, d["bytes_per_s"], d["optimizer_s_per_param"], d["math_bytes_per_s"], d["in_situ"])


def _clamp(v: float, grid: tuple[int, ...]) -> float:
    return min(max(v, math.log2(grid[0])), math.log2(grid[-1]))


def _bracket(v: float, grid: tuple[int, ...]) -> tuple[int, int, float]:
    logs = [math.log2(g) for g in grid]
    for i in range(len(grid) - 1):
        if v <= logs[i + 1]:
            return grid[i], grid[i + 1], (v - logs[i]) / (logs[i + 1] - logs[i])
    return grid[-2], grid[-1], 1.0


def _median_s(fn, budget_s: float = 0.15, least: int = 3) -> float:
    start = time.perf_counter()
    fn()  # warm-up; a call longer than the budget is its own measure (a slow bf16 kernel takes seconds)
    warm = time.perf_counter() - start
    if warm > budget_s:
        return warm
    times, start = [], time.perf_counter()
    while len(times) < least or time.perf_counter() - start < budget_s:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if len(times) >= 50:
            break
    return statistics.median(times)


def probe_kernels(dtype: torch.dtype = torch.float32) -> Kernels:
    """Measure the figures on this process's threads (a few seconds; tens where a dtype's
    matmuls run without native units)."""
    gemm = {}
    for orientation, matmul in ORIENTATIONS.items():
        grid = []
        for m in GRID_M:
            for s in GRID_S:
                x, g, w = torch.randn(m, s, dtype=dtype), torch.randn(m, s, dtype=dtype), torch.randn(s, s, dtype=dtype)
                grid.append((m, s, _median_s(lambda x=x, g=g, w=w, mm=matmul: mm(x, g, w))))
        gemm[orientation] = tuple(grid)
    memory, math_bound = _elementwise_bytes_per_s(dtype)
    return Kernels(gemm, memory, _optimizer_s_per_param(), math_bound)


def _elementwise_bytes_per_s(dtype: torch.dtype) -> tuple[float, float]:
    """(memory-bound, math-bound) bytes per second of elementwise operators, forward and backward:
    an add and a scale, and layer norm and GELU, each on a (4096, 256) tensor. The bytes are
    counted as a trace counts them (framework.plan.ops.elementwise_bytes: each operator's inputs
    and outputs, times 1 + BACKWARD_BYTES for the backward), so that the rates price a trace."""
    from framework.plan.ops import BACKWARD_BYTES, elementwise_bytes

    x = torch.randn(4096, 256, dtype=dtype, requires_grad=True)
    weight = torch.ones(256, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)
    probes = (lambda: x * 2.0 + x, lambda: F.gelu(F.layer_norm(x, (256,), weight)))
    rates = []
    for kind, forward in zip(("memory", "math"), probes, strict=True):
        moved = elementwise_bytes(forward)[kind] * (1 + BACKWARD_BYTES)
        rates.append(moved / _median_s(lambda f=forward: f().backward(grad)))
    return rates[0], rates[1]


def _optimizer_s_per_param() -> float:
    params = [torch.nn.Parameter(torch.randn(256, 256)) for _ in range(16)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-4)

    def step():
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()

    return _median_s(step) / sum(p.numel() for p in params)
