"""Throughput, model FLOPs utilisation (MFU) and hardware FLOPs utilisation (HFU).

MFU = achieved model FLOP/s / peak FLOP/s of the devices used. Model FLOPs per token are the
model's own count (GPT: 6N over its matmul weights + 12·L·H·Q·T for attention, PaLM appendix B,
as nanoGPT), taken from the plain model before any sharding, so every strategy divides the same
work. HFU also counts the forward passes that activation checkpointing recomputes. The peak is
`metrics.peak_tflops` when set, a known GPU's datasheet figure for the run's compute dtype
(framework.measure.datasheet: bf16, fp16, TF32 or fp32), or on a CPU a short matmul probe in the run's
compute dtype, measured once per machine and cached.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from framework.machine import cpu_name
from framework.measure.datasheet import datasheet_tflops
from framework.measure.flops import training_flops


def gpu_peak_tflops(name: str, dtype: torch.dtype = torch.bfloat16, tf32: bool = False) -> float | None:
    """The datasheet's dense peak for a CUDA device name ("NVIDIA H100 80GB HBM3") computing in
    `dtype` (fp32: TF32 when `tf32`), or None (framework.measure.datasheet)."""
    return datasheet_tflops(name, dtype, tf32)


def peak_flops(
    device: torch.device, override_tflops: float | None, dtype: torch.dtype = torch.float32, tf32: bool = False
) -> float | None:
    """Per-device peak FLOP/s: the configured figure, else a known GPU's datasheet for the run's
    compute dtype (fp32 runs: the TF32 peak when `tf32`, matmuls allowed TF32), else (CPU) the
    cached matmul probe; None for an unknown GPU."""
    if override_tflops is not None:
        return override_tflops * 1e12
    if device.type == "cuda":
        tflops = gpu_peak_tflops(torch.cuda.get_device_name(device), dtype, tf32)
        return tflops * 1e12 if tflops else None
    if device.type == "cpu":
        return cpu_peak_flops(dtype)
    return None


def cpu_peak_flops(dtype: torch.dtype = torch.float32, seconds: float = 0.25) -> float:
    """FLOP/s of square matmuls on this process's threads (the best of a few sizes), run the way
    training runs them: `F.linear` on fp32 tensors, under autocast to `dtype` when it is not fp32
    (a bare bf16 matmul takes a much slower CPU path than autocast's, and would put MFU above 1).
    Measured once per CPU model, thread count, dtype and torch version, and cached in
    ~/.cache/hydradist/peak_flops.json. Local workers probe at the same time, sharing the cores
    as they will in training, so each measures its own share."""
    key = f"{cpu_name()}|threads={torch.get_num_threads()}|{dtype}|torch={torch.__version__}|probe=linear-autocast"
    path = os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "hydradist", "peak_flops.json"
    )
    try:
        with open(path) as f:
            cache = json.load(f)
    except (OSError, json.JSONDecodeError):
        cache = {}
    if key in cache:
        return cache[key]
    autocast = torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32)
    best = 0.0
    for n in (256, 512, 1024):
        a, b = torch.randn(n, n), torch.randn(n, n)
        with autocast:
            torch.nn.functional.linear(a, b)  # warm-up
            count, t0 = 0, time.perf_counter()
            while (elapsed := time.perf_counter() - t0) < seconds / 3 or count < 2:
                torch.nn.functional.linear(a, b)
                count += 1
        best = max(best, 2 * n**3 * count / elapsed)
    cache[key] = best
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(cache, f, indent=1)
    os.replace(tmp, path)  # concurrent probes: the last complete file wins, never a torn one
    return best


@dataclass(frozen=True)
class Flops:
    """Training FLOPs per token: the model's (MFU), and with recomputation (HFU); None where the
    run has no tokens to count them by. `devices`: the accelerators (or CPU ranks) the run uses."""

    model: float | None
    hardware: float | None
    devices: int
    by_length: dict[int, float] = field(default_factory=dict)  # data.seq_len_schedule: the model's at each length
    how: str | None = None  # declared by the model, counted on meta, or estimated (and why): framework.measure.flops

    def model_at(self, length: int | None) -> float | None:
        """The model's FLOPs per token at a sequence length of the schedule (else at data.seq_len)."""
        return self.by_length.get(length, self.model)


def recomputed_blocks(cfg: Any, n_blocks: int) -> int:
    """Blocks whose forward runs again in backward (memory=checkpoint, every k-th)."""
    return -(-n_blocks // cfg.memory.checkpoint_every) if cfg.memory.name == "checkpoint" else 0


def model_flops(
    model: torch.nn.Module, spec: Any, seq_len: int | None, recomputed: int = 0
) -> tuple[float, float] | None:
    """(model, hardware) training FLOPs per token of an lm: declared by the model
    (``flops_per_token``), else counted once with FlopCounterMode on a (1, seq_len) batch of the
    model built on the meta device (nothing is allocated; routed experts' grouped matmuls
    included), else estimated where the meta forward cannot run (framework.measure.flops); a
    checkpointed block adds its forward."""
    if seq_len is None or spec.task != "lm":
        return None
    return training_flops(model, spec, seq_len, recomputed)[:2]


def count_flops(meta_model: torch.nn.Module, spec: Any, cfg: Any, devices: int) -> Flops:
    """The run's FLOPs per token from the model built on meta (before any sharding: every strategy
    counts the same work), over the `devices` it computes on (the strategy's answer:
    framework.parallel.dims.Strategy.devices), and how they were had."""
    from framework.contract import blocks_of

    recomputed = recomputed_blocks(cfg, len(blocks_of(meta_model, spec)))
    seq_len = cfg.data.get("seq_len")
    if seq_len is None or spec.task != "lm":
        return Flops(None, None, devices)
    model, hardware, how = training_flops(meta_model, spec, seq_len, recomputed)
    lengths = sorted({int(n) for _, n in cfg.data.get("seq_len_schedule") or ()})
    by_length = {n: model_flops(meta_model, spec, n)[0] for n in lengths}
    return Flops(model, hardware, devices, by_length, how)


def mfu(flops_per_tok: float | None, tokens_per_s: float | None, peak: float | None, devices: int) -> float | None:
    """Achieved FLOP/s over the peak of the `devices` used (with flops_per_tok counting
    recomputation: HFU)."""
    if flops_per_tok is None or tokens_per_s is None or peak is None:
        return None
    return flops_per_tok * tokens_per_s / (peak * devices)


def above_ceiling(hfu: float | None, peak: float | None, ceiling_tflops: float | None) -> str | None:
    """Why a run's MFU is not reported (None: it is): its hardware FLOP rate (HFU, at least the
    MFU) above the rate this device's own dense matmul was measured to reach. No step of a model
    does better than a large matmul, so the step time is not the device's (a step timed before
    the device finished) or the FLOP count is wrong."""
    if hfu is None or not peak or not ceiling_tflops:
        return None
    ceiling = ceiling_tflops * 1e12 / peak
    if hfu <= ceiling:
        return None
    return (f"MFU/HFU {hfu:.1%} of the peak is above the measured matmul ceiling ({ceiling:.1%}: "
            f"metrics.ceiling_tflops={ceiling_tflops:g}): not reported, the step time is not the device's")  # fmt: skip


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

    def per_step(self) -> dict[str, float | int | None]:
        """Samples and tokens an optimizer step really took, over all data-parallel ranks: the
        mean (an int when every step took the same, as with fixed batches), and for tokens the
        range (token budgets and variable lengths vary it)."""
        samples = [s[1] for s in self.steps]
        tokens = [s[2] for s in self.steps if s[2] is not None]

        def mean(values: list[int]) -> float | int | None:
            if not values:
                return None
            return values[0] if len(set(values)) == 1 else sum(values) / len(values)

        return {
            "samples": mean(samples),
            "tokens": mean(tokens),
            "tokens_min": min(tokens, default=None),
            "tokens_max": max(tokens, default=None),
        }

    def total_time(self) -> float:
        """Seconds of all steps, sampled and warm-up ones included."""
        return sum(s[0] for s in self.steps)

    def median_step_time(self) -> float | None:
        window = self._window()
        return statistics.median(s[0] for s in window) if window else None


class ForwardTimer:
    """Accumulates forward time over a step's micro-batches (a context manager around each);
    `end_step` closes a step. On CUDA with events, read (`pop_steps`) after a sync point that
    follows them: no extra synchronisation. Every rank pops its steps, also those whose times
    are not reported (tensor-parallel peers): events left pending would pile up."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.pending: list = []
        self.seconds = 0.0
        self.steps: list[tuple[float, list]] = []  # closed steps not yet popped

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

    def end_step(self) -> None:
        self.steps.append((self.seconds, self.pending))
        self.seconds, self.pending = 0.0, []

    def pop_steps(self) -> list[float]:
        """The forward seconds of each step closed since the last pop (and forget them)."""
        out = [seconds + sum(a.elapsed_time(b) / 1000 for a, b in events) for seconds, events in self.steps]
        self.steps = []
        return out


def max_over_mean(values: list[float] | tuple[float, ...]) -> float:
    """How far the busiest of a group is above the group's mean (1.0: perfectly even)."""
    return max(values) / (sum(values) / len(values))


def compute_imbalance(per_rank: list[list[float]]) -> float | None:
    """Mean over steady steps (the first left out) of the slowest rank's time over the mean."""
    steps = [s for s in list(zip(*per_rank, strict=True))[1:] if sum(s) > 0]
    return sum(max_over_mean(s) for s in steps) / len(steps) if steps else None


def load_balance(work: list[list[int]], slots: list[int], forward_s: list[list[float]]) -> dict:
    """Load balance over the data-parallel ranks (one list per rank, one entry per step):
    `imbalance`, per step the busiest rank's work (tokens, or samples for fixed-size data) over
    the mean, averaged over steps, and its worst step; `padding_waste`, the share of token
    positions computed on padding (or, under packing, masked at document boundaries); and the
    forward-time imbalance (`compute_imbalance`: forward only, where a backward ends waiting for
    the slowest rank; under FSDP and tensor parallel the forward holds collectives too)."""
    per_step = [max_over_mean(s) for s in zip(*work, strict=True)]
    total_work = sum(sum(w) for w in work)
    return {
        "imbalance": sum(per_step) / len(per_step) if per_step else None,
        "max_imbalance": max(per_step, default=None),
        "padding_waste": 1 - total_work / sum(slots) if sum(slots) else None,
        "work_per_rank": [sum(w) for w in work],
        "compute_imbalance": compute_imbalance(forward_s),
        "forward_s_per_rank": [sum(f) for f in forward_s],
    }
