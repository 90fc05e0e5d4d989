"""Throughput and model FLOPs utilisation (MFU).

MFU = achieved model FLOP/s / peak FLOP/s of the devices. Model FLOPs per token for a transformer
are 6N + 12·L·H·Q·T (PaLM, appendix B; as nanoGPT): 6N for forward+backward through N weights and
12·L·H·Q·T for attention scores over T positions. Recomputation (checkpointing) is not counted:
MFU measures useful work.
"""

from __future__ import annotations

import statistics
import time

import torch

# Dense bf16/fp16 tensor-core peak per device, TFLOP/s (vendor datasheets, no sparsity).
PEAK_TFLOPS = {
    "H200": 989.0,
    "H100": 989.0,
    "A100": 312.0,
    "L40S": 362.0,
    "A10G": 125.0,
    "L4": 121.0,
    "V100": 125.0,
}


def peak_flops(device: torch.device, override_tflops: float | None) -> float | None:
    """Per-device peak FLOP/s: the configured figure, else a known GPU's datasheet, else None."""
    if override_tflops is not None:
        return override_tflops * 1e12
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, tflops in PEAK_TFLOPS.items():
            if key in name:
                return tflops * 1e12
    return None


def flops_per_token(model: torch.nn.Module, seq_len: int | None) -> float | None:
    fn = getattr(model, "flops_per_token", None)
    return fn(seq_len) if fn is not None and seq_len is not None else None


def mfu(flops_per_tok: float | None, tokens_per_s: float | None, peak: float | None, world_size: int) -> float | None:
    if flops_per_tok is None or tokens_per_s is None or peak is None:
        return None
    return flops_per_tok * tokens_per_s / (peak * world_size)


class Throughput:
    """Per-step time, samples and tokens. Rates leave out the first step (warm-up) and the
    sampled steps (slowed by measuring), when other steps remain."""

    def __init__(self) -> None:
        self.steps: list[tuple[float, int, int | None, bool]] = []

    def add(self, seconds: float, samples: int, tokens: int | None, sampled: bool = False) -> None:
        self.steps.append((seconds, samples, tokens, sampled))

    def _window(self) -> list[tuple[float, int, int | None, bool]]:
        steady = self.steps[1:] or self.steps
        return [s for s in steady if not s[3]] or steady

    def rates(self) -> dict[str, float | None]:
        window = self._window()
        elapsed = sum(s[0] for s in window)
        tokens = [s[2] for s in window]
        return {
            "samples_per_s": sum(s[1] for s in window) / elapsed if elapsed else None,
            "tokens_per_s": sum(tokens) / elapsed if elapsed and None not in tokens else None,
        }

    def total_time(self) -> float:
        """Seconds of all steps, sampled and warm-up ones included."""
        return sum(s[0] for s in self.steps)

    def median_step_time(self) -> float | None:
        window = self._window()
        return statistics.median(s[0] for s in window) if window else None


class ForwardTimer:
    """Accumulates forward time over a step's micro-batches (a context manager around each).
    On CUDA with events, read after the step's own sync point: no extra synchronisation."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.pending: list = []
        self.seconds = 0.0

    def __enter__(self):
        if self.cuda:
            self.pending.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
            self.pending[-1][0].record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.pending[-1][1].record()
        else:
            self.seconds += time.perf_counter() - self.t0
        return False

    def take(self) -> float:
        """This step's forward seconds (and reset)."""
        seconds = self.seconds + sum(a.elapsed_time(b) / 1000 for a, b in self.pending)
        self.seconds, self.pending = 0.0, []
        return seconds


def compute_imbalance(per_rank: list[list[float]]) -> float | None:
    """Mean over steady steps (the first left out) of the slowest rank's time over the mean."""
    steps = [s for s in list(zip(*per_rank, strict=True))[1:] if sum(s) > 0]
    return sum(max(s) / (sum(s) / len(s)) for s in steps) / len(steps) if steps else None
