"""Steps whose figures wait on the device, settled with one host sync per logged step.

A step's figures (the global loss, tokens and samples, the gradient norm, whether the update was
applied, amp's loss scale, whether some rank got a signal) come out of one small all-reduce as a
device tensor (framework.run.step). Reading it (`.tolist()`) waits for the GPU to finish the step, so
steps that are not logged do not read theirs: they wait in the `Ledger`, and the next synced step
reads every waiting step's with one `.tolist()`. On a CPU every op has finished when it returns;
on CUDA the host runs ahead and the GPU never idles waiting for it.

Synced (`syncs_after`): the logged steps (metrics.log_every; the default, 1, syncs every step),
the first step (warm-up, measured apart), the sampled steps and the steps before them (so a
sampled step's time is its own), checkpoint steps, the last step, and a step a callback asks to
settle (framework.hooks.Control.sync: work of its own follows it). A signal or
a non-finite step is acted on at the next synced step.

Time is the window's, not the host's: from the start of the window's first step to the end of the
sync that settles it, read on the host clock after the device has finished (a host's own time of a
step on CUDA is only how long it took to queue the kernels, and read high tokens/s and MFU on a
GPU-bound step). The steps settled together share the window evenly. Work between windows
(a callback's, a checkpoint save) happens after a sync and before the next window starts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from omegaconf import DictConfig

from framework.data import DataPipeline
from framework.figures import Registry
from framework.hooks import Callbacks
from framework.measure.metrics import ForwardTimer, mfu
from framework.run.run_files import RunFiles
from framework.run.step import Parts, PendingStep, StepFigures
from framework.run.summary import RunStats


def is_sampled(step: int, start: int, total: int, every: int) -> bool:
    """Steps whose memory and communication are measured (measuring slows a step, so only a few):
    the third step run (the first steady one: DDP re-buckets during the second; the last of a
    shorter run), then every `every` steps. every=0: never."""
    k = step - start
    return every > 0 and (k == min(2, total - start - 1) or (k > 2 and (k - 2) % every == 0))


def is_logged(cfg: DictConfig, step: int) -> bool:
    return (step + 1) % cfg.metrics.log_every == 0 or step + 1 == cfg.steps


def syncs_after(cfg: DictConfig, step: int, start: int) -> bool:
    """Whether step `step` (0-based) ends with a host sync that settles the waiting steps."""
    every, done = cfg.metrics.sample_every, step + 1
    return (
        is_logged(cfg, step)
        or step == start
        or is_sampled(step, start, cfg.steps, every)
        or is_sampled(step + 1, start, cfg.steps, every)
        or bool(cfg.checkpoint.every and done % cfg.checkpoint.every == 0)
    )


@dataclass
class Entry:
    pending: PendingStep
    step: int  # 0-based
    epoch: int
    work: int  # tokens (samples for fixed-size data) this rank's batches held
    slots: int  # token positions, padding included
    figures: StepFigures | None = None  # once settled


class Ledger:
    """The steps run since the last sync, in order."""

    def __init__(self, sequence_data: bool, figures: Registry, clock: Callable[[], float] = time.perf_counter):
        self.sequence_data = sequence_data  # report tokens (text, varlen)
        self.figures = figures  # how the registry's part of each step's values reads
        self.clock = clock  # the steps' `started` are read on it too (tests: a clock they control)
        self.entries: list[Entry] = []

    def add(self, pending: PendingStep, step: int, step_batches: list, data: DataPipeline) -> None:
        """A step just run."""
        work = sum(data.tokens_in(b) or b[1].size(0) for _, b in step_batches)
        slots = sum(data.slots_in(b) or 0 for _, b in step_batches)
        self.entries.append(Entry(pending, step, step_batches[-1][0], work, slots))

    def settle(self) -> list[Entry]:
        """Read every waiting step's figures in one host sync; the entries, oldest first."""
        entries, self.entries = self.entries, []
        values = torch.stack([e.pending.values for e in entries]).tolist()  # the sync: the device has finished
        seconds = (self.clock() - entries[0].pending.started) / len(entries)  # the window, shared evenly
        for entry, row in zip(entries, values, strict=True):
            entry.figures = StepFigures.settled(entry.pending, row, seconds, self.sequence_data, self.figures)
        return entries


def record_steps(stats: RunStats, entries: list[Entry], counts_data: bool, forward_timer: ForwardTimer) -> None:
    """The settled steps into the run's figures. Every rank pops its forward timings (their CUDA
    events have completed at the sync); one rank per data-parallel group counts the work."""
    forward = forward_timer.pop_steps()
    for entry, forward_s in zip(entries, forward, strict=True):
        figures = entry.figures
        if stats.first_step_s is None:
            stats.first_step_s = figures.seconds
            # from the process start launch passed (none given, as under run_configs: 0)
            stats.startup_s = time.time() - (stats.started if stats.started is not None else time.time())
        stats.throughput.add(figures.seconds, figures.samples, figures.tokens, figures.sampled)
        stats.losses.append(figures.loss)
        stats.figures.append({**figures.extra, "step": entry.step + 1})  # `step`: no figure's name (reserved)
        stats.skipped_steps += not figures.applied
        if counts_data:
            stats.work.append(entry.work)
            stats.slots += entry.slots
            stats.forward_s.append(forward_s)


def log_step(entry: Entry, stats: RunStats, parts: Parts, peak: float | None, files: RunFiles,
             callbacks: Callbacks) -> dict:  # fmt: skip
    """One line of metrics.jsonl (rank 0 writes it) and its `on_log` (the trackers are callbacks);
    the record. The registry's figures follow the loop's own (framework/figures.py)."""
    figures, step = entry.figures, entry.step
    seconds, sampled = figures.seconds, figures.sampled
    tokens_per_s = figures.tokens / seconds if figures.tokens is not None else None
    record = {
        "step": step + 1,
        "loss": figures.loss,
        "lr": entry.pending.lr,
        "grad_norm": figures.grad_norm,
        "step_time_s": seconds,
        "samples_per_s": figures.samples / seconds,
        "tokens_per_s": tokens_per_s,
        "mfu": mfu(parts.flops.model_at(length_at(parts, step)), tokens_per_s, peak, parts.flops.devices),
        "epoch": entry.epoch,
        "loss_scale": figures.loss_scale,
        "skipped": not figures.applied,  # the update was not applied (non-finite gradients, a callback)
        "comm_calls": stats.comm[-1]["calls"] if sampled else None,  # sampled steps
        "comm_bytes": stats.comm[-1]["bytes"] if sampled else None,
    }
    record |= callbacks.figures.logged(figures.extra)
    files.log_step(record)
    callbacks.call("on_log", step + 1, record)
    return record


def length_at(parts: Parts, step: int) -> int | None:
    """The sequence length data.seq_len_schedule puts in force at `step` (None: no schedule)."""
    lengths = parts.data.seq_lens
    return lengths.of_step(step) if lengths is not None else None
