"""The kernels in place: one real training step of a small reference transformer against what the
time model prices it at, as a factor on the arithmetic (probed with the kernels; framework.plan.kernels).

The kernel grid times each matmul and elementwise operator alone, back to back on the same
tensors, which then sit in cache. In a step every operator finds its operands cold, and the step
adds what no operator accounts for: autograd's engine, the loss, the gradients' accumulation. On
this project's CPUs that costs 15 to 40% over the operators alone (the in-situ factor). The
reference is neither shape benchmarks/plan.py checks the forecast on.
"""

from __future__ import annotations

import statistics
import time
from types import SimpleNamespace

import torch
from torch import nn
from torch.nn import functional as F

# the reference: 2 pre-norm blocks of width 192 (4 heads), 4 sequences of 64 tokens over 256 symbols
WIDTH, HEADS, LAYERS, BATCH, SEQ, VOCAB = 192, 4, 2, 4, 64, 256


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.up, self.down = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, HEADS, WIDTH // HEADS).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, WIDTH))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


def _reference() -> nn.Module:
    torch.manual_seed(0)
    blocks = [_Block() for _ in range(LAYERS)]
    return nn.Sequential(nn.Embedding(VOCAB, WIDTH), *blocks, nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB))


def in_situ_factor(kernels, op_overhead_s: float, dtype: torch.dtype) -> float:
    """Measured over modelled seconds of the reference's step (forward, loss, backward, AdamW with
    clipping) in `dtype` (bf16 and fp16 under CPU autocast, as training runs them)."""
    from framework.plan.ops import _record
    from framework.plan.timing import _region_s

    model = _reference()
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-4)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
    autocast = dtype != torch.float32

    def forward():
        with torch.autocast("cpu", dtype=dtype, enabled=autocast):
            return model(tokens)

    def step():
        F.cross_entropy(forward().flatten(0, 1).float(), tokens.flatten()).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # warm-up: the optimizer's state, the allocator
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    region = _record(forward)
    layout = SimpleNamespace(tp=1, cp=1, sequence_parallel=False, fsdp=0)
    modelled = _region_s(region, "replicated", layout, kernels, SimpleNamespace(op_overhead_s=op_overhead_s))
    modelled += sum(p.numel() for p in params) * kernels.optimizer_s_per_param
    return statistics.median(times) / modelled
