"""`profile=true`: a torch.profiler trace of a few steady steps, one Chrome trace per rank.

The window is set by `profiler.wait` (steps skipped after the start), `profiler.warmup` (traced but
discarded: the profiler's own start-up) and `profiler.active` (recorded). Each rank writes
`<run dir>/profile/rank<N>.trace.json` (open it in https://ui.perfetto.dev or chrome://tracing),
with Python stacks and the collectives as events (gloo's and NCCL's ops show under their own
names, e.g. `gloo:all_reduce`, `nccl:all_gather`). On CUDA, `profiler.memory=true` also records
the allocator's history and writes `rank<N>.memory.pickle`, which PyTorch's memory visualiser
(https://pytorch.org/memory_viz) opens.
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from omegaconf import DictConfig


class _NoProfiler(nullcontext):
    def step(self) -> None:
        pass


def build_profiler(enabled: bool, cfg: DictConfig, run_dir: str, rank: int, device: torch.device) -> Any:
    """A context manager with `.step()` (call it once per optimizer step); does nothing when off."""
    if not enabled:
        return _NoProfiler()
    from torch.profiler import ProfilerActivity, profile, schedule

    out = os.path.join(run_dir, "profile")
    os.makedirs(out, exist_ok=True)

    def save(prof: profile) -> None:
        prof.export_chrome_trace(os.path.join(out, f"rank{rank}.trace.json"))

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    prof = profile(
        activities=activities,
        schedule=schedule(wait=cfg.wait, warmup=cfg.warmup, active=cfg.active, repeat=1),
        on_trace_ready=save,
        record_shapes=True,
        with_stack=cfg.with_stack,
        profile_memory=cfg.memory,
    )
    if cfg.memory and device.type == "cuda":
        return _WithMemoryHistory(prof, os.path.join(out, f"rank{rank}.memory.pickle"))
    return prof


class _WithMemoryHistory(AbstractContextManager):
    """The profiler plus CUDA's allocator history (a snapshot for the memory visualiser)."""

    def __init__(self, prof: Any, path: str):
        self.prof, self.path = prof, path

    def __enter__(self):
        torch.cuda.memory._record_memory_history(max_entries=100_000)
        self.prof.__enter__()
        return self

    def step(self) -> None:
        self.prof.step()

    def __exit__(self, *exc):
        self.prof.__exit__(*exc)
        torch.cuda.memory._dump_snapshot(self.path)
        torch.cuda.memory._record_memory_history(enabled=None)
        return False
