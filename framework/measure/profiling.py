"""`profile=true`: a torch.profiler trace of a few steady steps, one Chrome trace per rank.

The window is set by `profiler.wait` (steps skipped after the start), `profiler.warmup` (traced but
discarded: the profiler's own start-up) and `profiler.active` (recorded). Each rank writes
`<run dir>/profile/rank<N>.trace.json` (open it in https://ui.perfetto.dev or chrome://tracing),
with Python stacks and the collectives as events (gloo's and NCCL's ops show under their own
names, e.g. `gloo:all_reduce`, `nccl:all_gather`). On CUDA, `profiler.memory=true` also records
the allocator's history over the active steps (Python stacks) and writes `rank<N>.memory.pickle`, which PyTorch's memory visualiser
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
        return _WithMemoryHistory(prof, os.path.join(out, f"rank{rank}.memory.pickle"), memory_window(cfg))
    return prof


def memory_window(cfg: DictConfig) -> tuple[int, int]:
    """(first, end) optimizer steps whose allocations the memory history records: the profiler's
    active steps. Recording the whole loop, with C++ stacks, made the history huge and its dump
    take minutes."""
    first = cfg.wait + cfg.warmup
    return first, first + cfg.active


class _WithMemoryHistory(AbstractContextManager):
    """The profiler plus CUDA's allocator history over the profiler's window, with Python stacks
    (a snapshot for the memory visualiser), dumped when the window closes."""

    def __init__(self, prof: Any, path: str, window: tuple[int, int]):
        self.prof, self.path, self.window, self.steps, self.recording = prof, path, window, 0, False

    def __enter__(self):
        self.prof.__enter__()
        self._at_step()
        return self

    def _at_step(self) -> None:
        if self.steps == self.window[0] and not self.recording:
            torch.cuda.memory._record_memory_history(max_entries=100_000, stacks="python")
            self.recording = True
        elif self.steps >= self.window[1] and self.recording:
            self._dump()

    def _dump(self) -> None:
        torch.cuda.memory._dump_snapshot(self.path)
        torch.cuda.memory._record_memory_history(enabled=None)
        self.recording = False

    def step(self) -> None:
        self.prof.step()
        self.steps += 1
        self._at_step()

    def __exit__(self, *exc):
        self.prof.__exit__(*exc)
        if self.recording:  # a run shorter than the window: what it recorded
            self._dump()
        return False
